"""Errors that point at the fix (issue 53): a misspelled flag or field names the one meant, a missing config file the
shipped ones, and a workdir of another model is refused before anything compiles."""
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from helpers import SPEC, TINY_LM, load_config
from laurel import checkpoint, config_lib, train


def parse(monkeypatch, capsys, *args) -> str:
  """The one line a program with laurel.main's --config and --workdir flags exits with (status 2) for `args`."""
  flag_values, argv = flags.FlagValues(), ['laurel-train', *args]
  monkeypatch.setattr(sys, 'argv', argv)  # where ml_collections finds the overrides
  config_flags.DEFINE_config_file('config', None, 'config file', flag_values=flag_values, lock_config=True)
  flags.DEFINE_string('workdir', None, 'workdir', flag_values=flag_values)
  with pytest.raises(SystemExit) as exited:
    config_lib.parse_flags(argv, flag_values)
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
  assert parse(monkeypatch, capsys, '--config=c4_ablation:rw_lr,preset=tiny', typed) == message


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
  checkpoint.guard_config(load_config(SPEC, TINY_LM), workdir)  # no checkpoint yet: writes config.json
  (workdir / 'checkpoints' / '3').mkdir(parents=True)
  monkeypatch.setattr(train, 'compile_step', lambda *_: pytest.fail('compiled'))
  with pytest.raises(config_lib.InputError, match=r"^--workdir='.+': holds checkpoints of a different task/model "
                     r'\(step 3: model\.d_model=32 \(now 64\)\); use a new workdir or the original config$'):
    train.train(load_config(SPEC, {**TINY_LM, 'model.d_model': 64}), str(workdir),
                allow_config_change=allow_config_change)
