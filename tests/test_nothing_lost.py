"""Nothing lost and nothing wrong accepted (issue 40): run files written atomically, SIGTERM before the loop, only
finite checkpoints called good, a fresh start only where no checkpoint is good, the config signature in every
checkpoint, the bad inputs refused before compiling, interrupted sweeps that keep their point, and checksummed
files."""
import builtins
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import ROOT, TINY_LM, call_main, cli_env, load_config, losses, run_script, typed_config
from laurel import config_lib, main, train, train_config
from laurel.plan import preflight
from laurel.cli import process
from laurel.run import checkpoint, metrics_log
from laurel.serve import generate, loader

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'
sys.path.insert(0, str(ROOT / 'scripts'))


@pytest.fixture
def torn_writes(monkeypatch):
  """torn_writes(*names): from now on every write to a file whose name contains one of `names` writes half its
  data, then raises KeyboardInterrupt, as a kill in the middle of the write would; torn_writes() ends it."""
  names = []

  class Torn:
    def __init__(self, file):
      self.file = file

    def write(self, data):
      self.file.write(data[:len(data) // 2])
      self.file.flush()
      raise KeyboardInterrupt

    def __getattr__(self, name):
      return getattr(self.file, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.file.close()

  def torn(opener, name_of):
    def open_(file, mode='r', *args, **kwargs):
      opened = opener(file, mode, *args, **kwargs)
      writes = any(c in mode for c in 'wax+')
      return Torn(opened) if writes and any(n in os.path.basename(name_of(file)) for n in names) else opened
    return open_

  monkeypatch.setattr(builtins, 'open', torn(builtins.open, os.fspath))
  monkeypatch.setattr(os, 'fdopen', torn(os.fdopen, lambda fd: os.readlink(f'/proc/self/fd/{fd}')))
  return lambda *tearing: names.__setitem__(slice(None), tearing)


def _files(folder) -> dict:
  return {p.name: p.read_bytes().decode(errors="replace") for p in sorted(folder.iterdir()) if p.is_file()}


# 1. Every file the project rewrites is written atomically; SIGTERM before the loop is one line and a status.

def test_a_kill_inside_the_config_writes_keeps_both_files(tmp_path, torn_writes):
  config = typed_config(SPEC, TINY_LM)
  checkpoint.guard_config(config, tmp_path)()  # checked, then written (once the checkpoint is restored)
  (tmp_path / 'checkpoints' / '6').mkdir(parents=True)
  before = _files(tmp_path)
  config = dataclasses.replace(config, steps=12)  # a longer run: config.json and its history are rewritten
  for name in ('config_history.jsonl', 'config.json'):
    torn_writes(name)
    with pytest.raises(KeyboardInterrupt):
      checkpoint.guard_config(config, tmp_path)()
    after = _files(tmp_path)  # the old files whole (the history may have one whole line more), no temporary
    assert sorted(after) == sorted(before) and after['config.json'] == before['config.json']
    assert after['config_history.jsonl'].startswith(before['config_history.jsonl'])
    assert [json.loads(l)['step'] for l in after['config_history.jsonl'].splitlines()] in ([0], [0, 6])


def test_a_kill_between_the_history_and_config_writes_records_the_entry_once(tmp_path, monkeypatch):
  config = typed_config(SPEC, TINY_LM)
  write = checkpoint.write_text_atomic

  def killed_at_config(path, text):
    if path.name == 'config.json':
      raise KeyboardInterrupt
    write(path, text)
  monkeypatch.setattr(checkpoint, 'write_text_atomic', killed_at_config)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.guard_config(config, tmp_path)()
  monkeypatch.setattr(checkpoint, 'write_text_atomic', write)
  checkpoint.guard_config(config, tmp_path)()  # the rerun
  assert (tmp_path / 'config.json').exists()
  assert len((tmp_path / 'config_history.jsonl').read_text().splitlines()) == 1


def test_a_torn_config_json_is_rewritten_and_refused_in_one_line_where_it_is_read(tmp_path, capsys):
  # A torn copy (written by other means than this project's atomic writes) no longer ends every rerun in a traceback.
  config = typed_config(SPEC, TINY_LM)
  checkpoint.guard_config(config, tmp_path)()
  (tmp_path / 'checkpoints' / '6').mkdir(parents=True)
  whole = (tmp_path / 'config.json').read_text()
  (tmp_path / 'config.json').write_text(whole[:len(whole) // 2])
  with pytest.raises(config_lib.InputError, match=r"config.json is not JSON \("):
    train_config.read_config(tmp_path)  # what generate, evaluate and --config=WORKDIR read
  checkpoint.guard_config(config, tmp_path)()  # the checkpoint's own signature is checked on restore instead
  assert 'config.json is not JSON; it is rewritten' in capsys.readouterr().err
  assert json.loads((tmp_path / 'config.json').read_text()) == json.loads(whole)


def test_a_config_file_that_is_not_python_is_one_line(tmp_path, capsys):
  (tmp_path / 'notes.py').write_text('Table 5 \u2212 the C4 ablation\n')
  assert main.main(['laurel-train', f'--config={tmp_path / "notes.py"}', f'--workdir={tmp_path / "run"}']) == 2
  assert capsys.readouterr().err.splitlines() == [
      f'error: --config={tmp_path / "notes.py"}: not a Python config file (invalid character '
      "'\u2212' (U+2212), line 1)"]


def test_a_kill_inside_the_metrics_rewrite_keeps_every_line(tmp_path, torn_writes):
  text = ''.join(json.dumps({'step': s, 'loss': 1.0 / s}) + '\n' for s in (1, 2, 3))
  (tmp_path / 'metrics.jsonl').write_text(text)
  torn_writes('metrics.jsonl')
  with pytest.raises(KeyboardInterrupt):  # a resume from checkpoint 2 drops line 3
    metrics_log.MetricsLog(tmp_path, typed_config(SPEC, TINY_LM), resume_step=2, info={})
  assert _files(tmp_path) == {'metrics.jsonl': text}


@pytest.mark.slow
def test_a_kill_inside_the_final_write_leaves_a_run_that_finishes(tmp_path, torn_writes):
  config = load_config(SPEC, TINY_LM)  # two_checkpoints' step: compiled once for both
  torn_writes('final.json')
  with pytest.raises(KeyboardInterrupt):
    train.train(config, str(tmp_path))
  assert not (tmp_path / 'final.json').exists() and not list(tmp_path.glob('.final.json*'))
  torn_writes()
  final = train.train(config, str(tmp_path))
  assert json.loads((tmp_path / 'final.json').read_text())['step'] == final['step'] == 6


def test_a_kill_inside_a_table_write_keeps_the_old_table(tmp_path, torn_writes):
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  import cli  # pylint: disable=import-outside-toplevel
  import tables  # pylint: disable=import-outside-toplevel
  rows = [{'row': 'rw', 'loss': 3.0}]
  tables.write_results(tmp_path, 'sweep', {'rows': rows}, rows, '| rw | 3.0 |\n', plt.figure())
  cli.write_json(tmp_path / 'bench.json', {'rows': rows})
  before = _files(tmp_path)
  torn_writes('sweep.json', 'sweep.csv', 'sweep.md', 'bench.json')
  with pytest.raises(KeyboardInterrupt):
    tables.write_results(tmp_path, 'sweep', {'rows': []}, [], '', plt.figure())
  with pytest.raises(KeyboardInterrupt):
    cli.write_json(tmp_path / 'bench.json', {'rows': []})
  assert _files(tmp_path) == before


TERM_WHILE_COMPILING = (
    'import os, signal, sys, time\n'
    'from laurel import main, step, train\n'
    'def compile_step(*a):\n'
    '  os.kill(os.getpid(), signal.SIGTERM)\n'
    '  time.sleep(60)\n'
    'train.compile_step = compile_step\n'
    f'sys.argv = ["laurel", "--config={ROOT / SPEC}", "--workdir=" + sys.argv[1], "--config.steps=2",\n'
    '            "--config.optimizer.warmup_steps=1"]\n'
    'main.run()\n')


@pytest.mark.slow
@pytest.mark.process
def test_sigterm_while_compiling_is_one_line_and_status_130(tmp_path):
  result = subprocess.run([sys.executable, '-c', TERM_WHILE_COMPILING, str(tmp_path / 'run')], env=cli_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == process.INTERRUPTED, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [
      'terminated (SIGTERM): exited; nothing was lost (rerun the same command to start or resume)']


# 2. A checkpoint is good only if its state is.

def _poisoning_compile_step(monkeypatch, at_call: int):
  """train.compile_step whose compiled step returns a NaN state at its `at_call`th call, with the finite loss of the
  state it was given (as a learning rate of inf does: the update is NaN, the loss before it is not)."""
  compile_step = train.compile_step

  class Poisoning:
    def __init__(self, compiled):
      self.compiled, self.calls = compiled, 0

    def __getattr__(self, name):
      return getattr(self.compiled, name)

    def __call__(self, state, batch):
      self.calls += 1
      state, metrics = self.compiled(state, batch)
      if self.calls == at_call:
        state = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
      return state, metrics

  def poisoning(*args):
    compiled, *rest = compile_step(*args)
    return (Poisoning(compiled), *rest)

  monkeypatch.setattr(train, 'compile_step', poisoning)


@pytest.mark.slow
def test_a_non_finite_state_is_never_saved_nor_named_good(tmp_path, monkeypatch):
  _poisoning_compile_step(monkeypatch, at_call=3)
  config = load_config(SPEC, {**TINY_LM, 'checkpoint_every': 1})  # two_checkpoints' step
  with pytest.raises(train.TrainingDiverged, match=re.escape(
      'the state (parameters or optimizer state) is not finite (loss ') + r'[\d.]+\) at step 3; not saved; last good '
      'checkpoint: 2 in '):
    train.train(config, str(tmp_path))
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [1, 2]
  monkeypatch.undo()
  final = train.train(config, str(tmp_path))  # the rerun resumes from checkpoint 2
  assert final['step'] == 6 and sorted(losses(tmp_path)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_non_finite_checkpoint_of_older_code_is_moved_aside(tmp_path, monkeypatch, capsys):
  config = load_config(SPEC, {**TINY_LM, 'steps': 3, 'checkpoint_every': 1})
  monkeypatch.setattr(checkpoint, 'is_finite', lambda state: True, raising=False)  # the old code checked nothing
  _poisoning_compile_step(monkeypatch, at_call=3)
  train.train(config, str(tmp_path))
  monkeypatch.undo()
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [1, 2, 3]
  final = train.train(config, str(tmp_path))
  assert final['step'] == 3 and [p.name.split('.')[0] for p in (tmp_path / 'unreadable_checkpoints').iterdir()] == ['3']
  assert 'warning: checkpoint 3 is damaged (its state is not finite); moved to ' in capsys.readouterr().err


# 3. No silent restart, no half-fresh start; a missing data-iterator file is damage.

@pytest.fixture(scope='module')
def two_checkpoints(tmp_path_factory):
  """A run of 6 steps with checkpoints 3 and 6, and its losses."""
  workdir = tmp_path_factory.mktemp('two') / 'run'
  train.train(load_config(SPEC, {**TINY_LM, 'checkpoint_every': 3}), str(workdir))
  return workdir, losses(workdir)


def _truncate_arrays(checkpoint_dir):
  for path in (checkpoint_dir / 'state').rglob('d/*'):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.slow
def test_where_no_checkpoint_is_good_every_one_is_moved_aside_and_the_run_starts_afresh(two_checkpoints, tmp_path,
                                                                                        capsys):
  """Each damaged checkpoint is one line, moved aside, never deleted; with none left the run starts at step 0, its
  input included, and its first line says which were moved."""
  workdir = tmp_path / 'run'
  shutil.copytree(two_checkpoints[0], workdir)
  (workdir / 'final.json').unlink()
  for step in (3, 6):
    _truncate_arrays(workdir / 'checkpoints' / str(step))
  train.train(load_config(SPEC, {**TINY_LM, 'checkpoint_every': 3}), str(workdir))
  err = capsys.readouterr().err
  assert err.count('warning: checkpoint') == 2 and 'warning: checkpoint 3 is damaged (state/' in err
  assert sorted(p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()) == ['3', '6']
  first = json.loads((workdir / 'metrics.jsonl').read_text().splitlines()[0])
  assert first['step'] == 1 and first['moved_aside'] == [6, 3]
  assert losses(workdir) == two_checkpoints[1]  # fresh, the input's position included: the same losses again


@pytest.mark.slow
def test_a_missing_data_iterator_file_is_damage(two_checkpoints, tmp_path, capsys):
  workdir = tmp_path / 'run'
  shutil.copytree(two_checkpoints[0], workdir)
  for path in (workdir / 'checkpoints' / '6' / 'data').glob('process_*'):
    path.unlink()
  train.train(load_config(SPEC, {**TINY_LM, 'steps': 7, 'checkpoint_every': 3}), str(workdir))
  out = capsys.readouterr()
  assert 'checkpoint 6 is damaged (data/process_0-of-1.json is missing)' in out.err
  assert 'resumed from checkpoint 3' in out.out
  assert [p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()] == ['6']
  assert max(losses(workdir)) == 7
  same = lambda run: {s: l for s, l in run.items() if s <= 4}  # 7 steps: the cosine decays on from step 5
  assert same(losses(workdir)) == same(two_checkpoints[1])


# 4. A checkpoint carries its config signature; a refused --allow_config_change changes nothing.

@pytest.mark.slow
def test_a_checkpoint_refuses_another_learning_rate_without_config_json(two_checkpoints, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(two_checkpoints[0], workdir)
  (workdir / 'config.json').unlink()
  config = load_config(SPEC, {**TINY_LM, 'steps': 7, 'checkpoint_every': 3})
  config.optimizer.learning_rate /= 2
  with pytest.raises(config_lib.InputError, match=re.escape(
      f'checkpoint 6 was trained with optimizer.learning_rate={2 * config.optimizer.learning_rate!r} (now '
      f'{config.optimizer.learning_rate!r}); resume with that config, or pass --allow_config_change')):
    train.train(config, str(workdir))
  assert not (workdir / 'config.json').exists()
  assert train.train(config, str(workdir), allow_config_change=True)['step'] == 7


@pytest.mark.slow
def test_a_refused_allow_config_change_leaves_the_config_files_as_they_were(two_checkpoints, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(two_checkpoints[0], workdir)
  before = _files(workdir)
  config = load_config(SPEC, {**TINY_LM, 'steps': 7, 'model.d_model': 64})
  with pytest.raises(config_lib.InputError, match='holds checkpoints of a different task/model'):
    train.train(config, str(workdir), allow_config_change=True)
  assert _files(workdir) == before


# 6. The inputs that got through, each refused in one line before compiling (the host's memory: before running).

@pytest.mark.parametrize('overrides, message', [
    ({'data.seq_len': 1}, 'data.seq_len=1: must be an integer >= 2'),
    ({'model.positional': 'learned', 'model.max_len': 16},
     'model.max_len=16: shorter than data.seq_len=32; learned positions need one embedding per position'),
    ({'optimizer.learning_rate': float('inf')}, 'optimizer.learning_rate=inf: must be a positive number'),
    ({'optimizer.learning_rate': float('nan')}, 'optimizer.learning_rate=nan: must be a positive number'),
    ({'model.laurel.rw_scale': float('inf')}, 'model.laurel.rw_scale=inf: '),
    ({'model.rope_base': float('inf')}, 'model.rope_base=inf: must be a number > 1'),
    ({'steps': 10**22}, 'steps=10000000000000000000000: must be a positive integer below 2**31'),
])
def test_bad_numbers_and_shapes_are_refused(overrides, message):
  with pytest.raises(config_lib.InputError, match=re.escape(message)):
    train_config.validate_config(load_config(SPEC, {**TINY_LM, **overrides}), num_devices=1)


def test_a_text_corpus_of_empty_files_is_refused(tmp_path):
  for i in range(4):
    (tmp_path / f'{i}.txt').write_text('')
  with pytest.raises(config_lib.InputError, match=r"data\.path='.*': its \d+ train files? (is|are) empty: nothing to "
                     'train on'):
    train_config.validate_config(load_config(SPEC, {**TINY_LM, 'data.name': 'text', 'data.path': f'{tmp_path}/*.txt'}),
                         num_devices=1)


def test_an_override_without_a_config_file_says_so_and_a_spaced_config_resolves(capsys):
  assert main.main(['laurel-train', '--config.steps=30', '--workdir=unused']) == 2
  assert capsys.readouterr().err.splitlines() == [
      'error: --config.steps: --config is required (the config file whose field it overrides)']
  assert main.main(['laurel-train', '--config', 'c4_ablation:rw_lr,preset=tiny', '--config.steps=70',
                    '--print_config']) == 0
  assert json.loads(capsys.readouterr().out)['steps'] == 70


def test_a_flag_with_no_value_names_it(capsys):
  assert main.main(['laurel-train', '--config=c4_ablation:rw_lr,preset=tiny', '--print_config',
                    '--config.steps']) == 2
  assert capsys.readouterr().err.splitlines() == ['error: --config.steps: no value; write --config.steps=<value>']


@pytest.mark.slow
def test_a_step_larger_than_the_host_is_refused_before_it_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(preflight, 'available_host_bytes', lambda: 2**20)
  with pytest.raises(config_lib.InputError, match=r'batch_size=8, data\.seq_len=32: the compiled step needs [\d.]+ '
                     r'GiB, more than the 0\.0 GiB of memory available on this host'):
    train.train(load_config(SPEC, TINY_LM), str(tmp_path / 'run'))
  assert not (tmp_path / 'run' / 'checkpoints').exists() or not list((tmp_path / 'run' / 'checkpoints').iterdir())


def test_attention_scores_larger_than_the_host_are_refused_before_compiling(tmp_path, monkeypatch):
  # At data.seq_len=100000 on CPU the compile alone grew to 10 GB and the kernel killed it with no message.
  monkeypatch.setattr(preflight, 'available_host_bytes', lambda: 2**30)
  monkeypatch.setattr(train, 'compile_step', lambda *args: pytest.fail('compiled'))
  with pytest.raises(config_lib.InputError, match=r"batch_size=8, data\.seq_len=8192: one layer's attention scores "
                     r'alone need 8\.0 GiB, more than the 1\.0 GiB of memory available on this host'):
    train.train(load_config(SPEC, {**TINY_LM, 'data.seq_len': 8192}), str(tmp_path / 'run'))


@pytest.mark.slow
def test_generating_past_the_context_is_refused(two_checkpoints):
  status, _, err = call_main(generate.main, f'--workdir={two_checkpoints[0]}', '--prompt=ab', '--max_new_tokens=31')
  assert status == 2 and err.strip().splitlines() == [
      'error: --max_new_tokens=31: the longest prompt and the new tokens make 33, past the context the model '
      'trained on (data.seq_len=32)'], err[-2000:]


def test_prepare_text_on_an_empty_input_keeps_nothing(tmp_path, sp_model):
  from laurel.prepare import text  # pylint: disable=import-outside-toplevel
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'a.txt').write_text('')
  prepare = [f'--input={tmp_path}/in/*.txt', f'--output={tmp_path / "out"}', f'--vocab_path={sp_model}',
             '--text_unit=line', '--validation_fraction=0.3']
  status, _, err = call_main(text.main, *prepare)
  assert status == 2 and err.strip().splitlines()[-1] == (
      f'error: --input={tmp_path}/in/*.txt: its 1 file hold no documents; nothing was kept'), err[-2000:]
  assert not list((tmp_path / 'out').iterdir())
  (tmp_path / 'in' / 'a.txt').write_text(''.join(f'document {i}\n' for i in range(40)))
  status, out, err = call_main(text.main, *prepare)
  assert status == 0 and 'documents in 1 shards' in out, err[-2000:]


# 5. Ctrl-C on a sweep keeps the point in progress: passed on to it, it saves; the sweep exits 130; a rerun resumes.

@pytest.mark.slow
def test_ctrl_c_on_a_sweep_saves_the_running_point_and_a_rerun_resumes_it(tmp_path):
  sweep = [sys.executable, str(ROOT / 'scripts' / 'sweep.py'), f'--config={ROOT / SPEC}', '--field=model.laurel.rank',
           '--values=4', f'--workdir={tmp_path}', *[f'--set={k}={v}' for k, v in {**TINY_LM, 'steps': 60}.items()]]
  proc = subprocess.Popen(sweep, env=cli_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if ' step 3/60 ' in line:  # the point trains
      proc.send_signal(signal.SIGINT)  # the sweep's process only, as a terminal's Ctrl-C now reaches it
      break
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, err[-2000:]
  assert err.strip().splitlines()[-1] == ('interrupted: the running point saved what it had (see its log); rerun the '
                                          'same command to resume')
  point = tmp_path / 'rank=4'
  saved = [int(p.name) for p in (point / 'checkpoints').iterdir()]
  assert len(saved) == 1 and 3 <= saved[0] < 60 and 'interrupted (Ctrl-C): saved checkpoint' in out
  assert not (point / 'failed.json').exists() and not (point / 'final.json').exists()
  rerun = run_script('sweep.py', *sweep[2:], env=cli_env())  # the rerun's process is no subject: this one
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert f'resumed from checkpoint {saved[0]}' in rerun.stdout and json.loads((point / 'final.json').read_text())[
      'step'] == 60


# 7. Litter and noise.

@pytest.mark.slow
def test_a_save_cut_by_a_kill_leaves_no_temporary_folder(two_checkpoints, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(two_checkpoints[0], workdir)
  litter = workdir / 'checkpoints' / f'9{ocp.path.atomicity_types.TMP_DIR_SUFFIX}'
  shutil.copytree(workdir / 'checkpoints' / '6', litter)  # a save of step 9 killed before its rename
  for done in litter.rglob('commit_success.txt'):
    done.unlink()
  train.train(load_config(SPEC, {**TINY_LM, 'steps': 7, 'checkpoint_every': 3}), str(workdir))
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == ['3', '6', '7']


# 8. A content checksum per saved file, verified on restore: a flipped byte is damage.

@pytest.mark.slow
def test_a_flipped_byte_in_an_array_file_is_damage(two_checkpoints, tmp_path, capsys):
  workdir = tmp_path / 'run'
  shutil.copytree(two_checkpoints[0], workdir)
  array_file = max((workdir / 'checkpoints' / '6' / 'state').rglob('d/*'), key=lambda p: p.stat().st_size)
  data = bytearray(array_file.read_bytes())
  data[len(data) // 2] ^= 0x10
  array_file.write_bytes(bytes(data))
  config = load_config(SPEC, {**TINY_LM, 'steps': 7, 'checkpoint_every': 3})
  with pytest.raises(config_lib.InputError, match=r'checkpoint 6 is damaged \(state/\S+: content checksum mismatch'):
    with loader.lm_run_on_mesh(workdir):  # what generate and evaluate read
      pass
  train.train(config, str(workdir))
  out = capsys.readouterr()
  assert re.search(r'checkpoint 6 is damaged \(state/\S+: content checksum mismatch', out.err), out.err[-2000:]
  assert 'resumed from checkpoint 3' in out.out
  assert [p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()] == ['6']


def test_checksums_name_the_changed_missing_or_cut_file(tmp_path, monkeypatch):
  """Each host checks its share of the files (process_count 2 here: process 0 the first, third, ...)."""
  (tmp_path / 'state' / 'd').mkdir(parents=True)
  for name in ('a', 'b', 'c'):
    (tmp_path / 'state' / 'd' / name).write_bytes(b'abcd' * 1000)
  (tmp_path / checkpoint.METADATA).write_text(json.dumps({'item_handlers': {}, 'commit_timestamp_nsecs': 1}))
  checkpoint.record(tmp_path, tmp_path)
  (tmp_path / checkpoint.COMMITTED).write_text(f'Checkpoint commit was successful to {tmp_path}')
  (tmp_path / checkpoint.METADATA).write_text(json.dumps({'item_handlers': {}, 'commit_timestamp_nsecs': 2}))
  assert checkpoint.damage(tmp_path) is None  # the commit's own writes as the list foresaw them
  a = tmp_path / 'state' / 'd' / 'a'
  a.write_bytes(b'abce' + b'abcd' * 999)
  assert checkpoint.damage(tmp_path).startswith('state/d/a: content checksum mismatch (xxh3_64 ')
  a.write_bytes(b'abcd')
  assert checkpoint.damage(tmp_path) == 'state/d/a has 4 bytes, 4000 when saved'
  a.unlink()
  assert checkpoint.damage(tmp_path) == 'state/d/a is missing'
  monkeypatch.setattr(checkpoint.jax, 'process_count', lambda: 2)
  monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 1)  # its share: the second, fourth, ... listed
  assert checkpoint.damage(tmp_path) is None
  (tmp_path / 'state' / 'd' / 'b').write_bytes(b'')
  assert checkpoint.damage(tmp_path) == 'state/d/b has 0 bytes, 4000 when saved'
