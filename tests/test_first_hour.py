"""Errors that point at the fix (issue 53): a misspelled flag or field names the one meant, a missing config file the
shipped ones, a workdir of another model is refused before anything compiles, a short trial run warms up for part
of it, the paper preset without C4 says how to prepare it, and a run of a design from outside the package is read
back without PYTHONPATH (with --trust_design_file: tests/test_shared_run.py) and names its design."""
import json
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from helpers import ROOT, SPEC, TINY_LM, load_config, typed_config
from laurel import command_line, config_lib, designs, lm, train, train_config
from laurel.plan import preflight
from laurel.cli import console
from laurel.run import checkpoint, metrics_log
from laurel.train_config import file_sha256

TINY = 'c4_ablation:rw_lr,preset=tiny'


def parsed(monkeypatch, *args) -> flags.FlagValues:
  """Flags as laurel.main's (--config and --workdir), parsed from `args` by command_line.parse_flags."""
  flag_values, argv = flags.FlagValues(), ['laurel-train', *args]
  monkeypatch.setattr(sys, 'argv', argv)  # where ml_collections finds the overrides
  config_flags.DEFINE_config_file('config', None, 'config file', flag_values=flag_values, lock_config=True)
  flags.DEFINE_string('workdir', None, 'workdir', flag_values=flag_values)
  command_line.parse_flags(argv, flag_values)
  return flag_values


def parse(monkeypatch, capsys, *args) -> str:
  """The one line that parsing `args` as laurel.main does exits with (status 2)."""
  with pytest.raises(SystemExit) as exited:
    parsed(monkeypatch, *args)
  assert exited.value.code == 2
  [line] = capsys.readouterr().err.splitlines()
  return line


@pytest.mark.parametrize('typed, message', [
    ('--config.optimzer.lr=1', 'error: config.optimzer.lr: unknown config field; did you mean '
     '--config.optimizer.learning_rate?'),
    ('--config.model.laurel.rnak=4', 'error: config.model.laurel.rnak: unknown config field; did you mean '
     '--config.model.laurel.rank?'),
    ('--stepz=20', 'error: --stepz: unknown flag; did you mean --config.steps?'),
    ('--workdr=runs/demo', 'error: --workdr: unknown flag; did you mean --workdir?'),
    ('--config.nothing_like_it=1', 'error: config.nothing_like_it: unknown config field'),
])
def test_a_misspelled_flag_or_field_names_the_one_meant(monkeypatch, capsys, typed, message):
  assert parse(monkeypatch, capsys, f'--config={TINY}', typed) == message


@pytest.mark.parametrize('typed, message', [
    ('--config.model.laurel.rank=eight', "error: --config.model.laurel.rank='eight': must be an integer"),
    ('--config.optimizer.learning_rate=fast', "error: --config.optimizer.learning_rate='fast': must be a number"),
    ('--config.model.laurel.rw_per_dim=maybe',
     "error: --config.model.laurel.rw_per_dim='maybe': must be true or false"),
])
def test_a_value_of_the_wrong_type_is_one_line_in_the_projects_words(monkeypatch, capsys, typed, message):
  """It was int()'s: `flag --config.model.laurel.rank=eight: invalid literal for int() with base 10: 'eight'`."""
  assert parse(monkeypatch, capsys, f'--config={TINY}', typed) == message


def test_a_misspelled_sweep_field_names_the_one_meant(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / 'scripts'))
  import sweep  # pylint: disable=import-outside-toplevel  # scripts/sweep.py (its flags at their defaults)
  with pytest.raises(config_lib.InputError, match=r'^--field=model\.laurel\.rnak: unknown config field; did you mean '
                     r'model\.laurel\.rank\?$'):
    sweep.check_fields(TINY, ['model.laurel.rnak'], [])
  sweep.check_fields(TINY, ['model.hc.expansion'], ['model.stream.design=hc'])  # every design's section is a field


def test_a_missing_config_file_lists_the_shipped_ones(monkeypatch, capsys):
  shipped = '(shipped: c4_ablation, imagenet_resnet50, llm, residual_designs; or a run\'s WORKDIR)'
  assert parse(monkeypatch, capsys, '--config=c4_ablatoin:rw_lr') == (
      f"error: --config='c4_ablatoin:rw_lr': no such config file; did you mean c4_ablation? {shipped}")
  assert parse(monkeypatch, capsys, '--config=missing.py:pa') == (
      f"error: --config='missing.py:pa': no such config file {shipped}")


@pytest.mark.parametrize('allow_config_change', [False, True])
def test_a_workdir_of_another_model_is_refused_before_compiling(tmp_path, monkeypatch, allow_config_change):
  """Its config.json says so: the checkpoint's own record is read only after compiling (7.5 s on 2 cores)."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  checkpoint.guard_config(typed_config(SPEC, TINY_LM), workdir)()  # no checkpoint yet: config.json written
  (workdir / 'checkpoints' / '3').mkdir(parents=True)
  monkeypatch.setattr(train, 'compile_step', lambda *_: pytest.fail('compiled'))
  with pytest.raises(config_lib.InputError, match=r"^--workdir='.+': holds checkpoints of a different task/model "
                     r'\(step 3: model\.d_model=32 \(now 64\)\); use a new workdir or the original config$'):
    train.train(load_config(SPEC, {**TINY_LM, 'model.d_model': 64}), str(workdir),
                allow_config_change=allow_config_change)


def test_a_workdir_of_another_design_is_refused_naming_the_design_first(tmp_path):
  """Not ten `model.laurel.* (now None)` lines before the decisive `model.stream.design='laurel' (now 'residual')`."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  checkpoint.guard_config(typed_config(SPEC, TINY_LM), workdir)()  # an RW+LR+PA run
  (workdir / 'checkpoints' / '3').mkdir(parents=True)
  with pytest.raises(config_lib.InputError) as refused:
    checkpoint.guard_config(typed_config('configs/c4_ablation.py:baseline_24,preset=tiny', TINY_LM), workdir)
  assert str(refused.value) == (f"--workdir='{workdir}': holds checkpoints of a different task/model (step 3: "
                                "model.stream.design='laurel' (now 'residual'), the 10 fields of model.laurel, which "
                                "design 'residual' does not have); use a new workdir or the original config")


def test_a_run_shorter_than_the_presets_warmup_warms_up_for_the_same_part_of_it(monkeypatch, capsys):
  config = parsed(monkeypatch, f'--config={TINY}', '--config.steps=20').config  # the tiny preset: 50 of 500 steps
  assert (config.steps, config.optimizer.warmup_steps) == (20, 2)
  assert capsys.readouterr().err == ('notice: optimizer.warmup_steps=50 is longer than the run (steps=20): it warms up '
                                     'for 2 steps instead, 10% of the run as in the config file '
                                     '(--config.optimizer.warmup_steps sets it)\n')
  train_config.validate_config(config, num_devices=1, process_count=1)
  assert command_line.load(TINY, ['steps=20']).optimizer.warmup_steps == 2  # the scripts' loader too


def test_a_run_as_long_as_the_presets_warmup_leaves_it(monkeypatch, capsys):
  """steps=50 on the tiny preset (warmup 50) never left the warmup, without a word."""
  config = parsed(monkeypatch, f'--config={TINY}', '--config.steps=50').config
  assert (config.steps, config.optimizer.warmup_steps) == (50, 5)
  assert capsys.readouterr().err.startswith('notice: optimizer.warmup_steps=50 is as long as the run (steps=50): it '
                                            'warms up for 5 steps instead, 10% of the run')


@pytest.mark.parametrize('preset', ['paper', 'small', 'gpu', 'tiny'])
def test_table5_runs_keep_their_warmup(capsys, preset):
  spec = f'c4_ablation:rw_lr,preset={preset}'
  file = command_line.load(spec)
  for steps in (file.steps, 2 * file.steps, file.optimizer.warmup_steps + 1):
    assert command_line.load(spec, [f'steps={steps}']).optimizer.warmup_steps == file.optimizer.warmup_steps
  assert capsys.readouterr().err == ''


def test_a_warmup_set_longer_than_the_run_names_the_flag_and_a_value_that_fits():
  config = command_line.load(TINY, ['steps=20', 'optimizer.warmup_steps=50'])
  with pytest.raises(config_lib.InputError, match=r'^optimizer\.warmup_steps=50: longer than the run \(steps=20\): .*; '
                     r'set --config\.optimizer\.warmup_steps=2 \(a tenth of the run\) or any value below 20$'):
    train_config.validate_config(config, num_devices=1, process_count=1)


def test_the_paper_preset_without_c4_says_to_prepare_it_and_set_data_path(tmp_path, monkeypatch):
  """It said to install gcsfs (for the vocabulary), then the tfds extra; neither brings C4."""
  for module in ('tensorflow_datasets', 'tensorflow_datasets.core.constants'):  # the default install: no tfds
    monkeypatch.setitem(sys.modules, module, None)
  task = train_config.validate_config(command_line.load('c4_ablation:rw_lr'), num_devices=1, process_count=1)
  with pytest.raises(config_lib.InputError) as raised:
    preflight.check_inputs(task, tmp_path / 'run')
  assert str(raised.value) == (
      f"data.path='': no C4 to read: prepare it with {console.python_command()} -m laurel.prepare.c4 "
      "--input=<folder of C4's c4-*.json.gz> --output=DIR (docs/data.md) and set --config.data.path=DIR")
  assert not (tmp_path / 'run').exists()


@pytest.fixture
def tanh_gate(tmp_path, monkeypatch):
  """tests/gated_design.py as a module of one's own, tanh_gate.py in a folder on the Python path; gone afterwards."""
  folder = tmp_path / 'mine'
  folder.mkdir()
  source = (ROOT / 'tests' / 'gated_design.py').read_text()
  (folder / 'tanh_gate.py').write_text(source.replace("Design('gated'", "Design('tanh_gate'"))
  monkeypatch.syspath_prepend(str(folder))
  yield folder / 'tanh_gate.py'
  forget_tanh_gate()


def forget_tanh_gate():
  """As a later process: the module neither imported nor registered."""
  designs.REGISTRY.pop('tanh_gate', None)
  sys.modules.pop('tanh_gate', None)


def test_a_run_of_an_outside_design_is_read_back_from_the_file_it_recorded(tanh_gate, tmp_path, capsys):
  config = command_line.load('c4_ablation:baseline_24,preset=tiny', ['model.stream.design=tanh_gate:tanh_gate'])
  workdir = tmp_path / 'run'
  workdir.mkdir()
  checkpoint.guard_config(train_config.build_config(config), workdir)()  # config.json, as a run writes it
  saved = json.loads((workdir / 'config.json').read_text())
  assert (saved['design_file'], saved['design_sha256']) == (str(tanh_gate), file_sha256(tanh_gate))
  sys.path.remove(str(tanh_gate.parent))  # a later command, without PYTHONPATH
  forget_tanh_gate()
  with train_config.design_policy(trust=True):  # --trust_design_file
    saved = command_line.load(str(workdir))  # --config=WORKDIR (sampling reads train_config.read_config too)
  assert capsys.readouterr().err == (f"notice: model.stream.design='tanh_gate:tanh_gate': imported tanh_gate from "
                                     f'{tanh_gate}, the file the run recorded (--trust_design_file)\n')
  assert lm.LMConfig.from_config(saved.model).stream.design == 'tanh_gate'
  (workdir / 'checkpoints' / '3').mkdir(parents=True)
  checkpoint.guard_config(train_config.build_config(saved), workdir)  # the record is no change: a resume goes on


def test_an_outside_design_that_cannot_be_imported_says_what_to_set(tanh_gate, tmp_path):
  sys.path.remove(str(tanh_gate.parent))
  with pytest.raises(config_lib.InputError, match=r"^model\.stream\.design='tanh_gate:tanh_gate': cannot import "
                     r"tanh_gate \(No module named 'tanh_gate'\): put the folder holding tanh_gate\.py on PYTHONPATH$"):
    command_line.load('c4_ablation:baseline_24,preset=tiny', ['model.stream.design=tanh_gate:tanh_gate'])


@pytest.mark.parametrize('spec, overrides, design', [
    ('c4_ablation:rw_lr,preset=tiny', [], 'laurel rw+lr r=8'),
    ('c4_ablation:rw_lr_pa', [], 'laurel rw+lr+pa r=32 k=3'),
    ('c4_ablation:baseline_24,preset=tiny', [], 'residual'),
    ('residual_designs:hc,preset=tiny', [], 'hc'),
    ('c4_ablation:baseline_24,preset=tiny', ['model.stream.design=tests.gated_design:gated'],
     'tests.gated_design:gated'),
])
def test_the_config_line_names_the_design(spec, overrides, design):
  try:
    config = command_line.load(spec, overrides)
    task = train_config.validate_config(config, num_devices=1, process_count=1)
    assert f', design {design}, ' in metrics_log.config_line(task.config, ROOT / 'runs' / 'x')
  finally:
    designs.REGISTRY.pop('gated', None)  # other tests enumerate every design
    sys.modules.pop('tests.gated_design', None)
