"""What a researcher sees every day: a quiet start, progress and one line per logged step, a closing summary,
Ctrl-C at any time, and the Makefile and packaging that set it up."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib

import jax
import ml_collections
import numpy as np
import pytest
from etils import epath

from as_printed import run_as_printed
from helpers import ROOT, TINY_LM, cli_args, cli_env, load_config, metrics, without_this_python
from laurel import tasks, train
from laurel.cli import console, process
from laurel.plan import hardware
from laurel.run import metrics_log

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'
# A line that absl, glog, libtpu or TensorFlow's C++ logging printed: 'E0000 00:00:...', 'I1124 05:02:52...'.
LOGGING_PREFIX = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d')


@pytest.mark.slow
def test_a_run_prints_progress_one_line_per_step_and_a_summary_and_no_error_line(tmp_path):
  env = cli_env()
  del env['JAX_PLATFORMS']  # as a user runs it: JAX would probe libtpu (the test extra's) for a TPU
  env['PATH'] = without_this_python(env['PATH'])  # a shell where the venv is not activated
  workdir = tmp_path / 'run'
  result = subprocess.run(cli_args(SPEC, workdir, {**TINY_LM, 'steps': 4, 'log_every': 2, 'tensorboard': True}),
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = (result.stdout + result.stderr).splitlines()
  assert not [l for l in lines if LOGGING_PREFIX.match(l) or 'INVALID_ARGUMENT' in l or 'Traceback' in l], lines
  assert result.stderr == ''
  out = result.stdout.splitlines()
  assert out[0] == 'config: run/config.json (lm, row rw_lr, design laurel rw+lr r=8, preset tiny, 4 steps)'
  assert json.loads((workdir / 'config.json').read_text())['steps'] == 4
  assert 'compiling the train step for 1 device...' in out
  assert any(re.fullmatch(r'compiling the train step for 1 device: done in [\d.]+ s', l) for l in out)
  steps = [l for l in out if l.startswith('step ')]
  assert len(steps) == 2, out  # one line per logged step
  assert re.fullmatch(r'step 2/4 \(50%\) \| mean of 2 steps: loss [\d.]+ \| accuracy [\d.]+ \| grad_norm [\d.]+ \| '
                      r'lr [\d.e+-]+ \| '
                      r'[\d.e+-]+ s/step, [\d,]+ tokens/s \| ETA [\d.]+ s', steps[0]), steps[0]
  assert 'evaluating on 2 batches...' in out and any(l.startswith('eval at step 4/4 | loss ') for l in out)
  final = json.loads((workdir / 'final.json').read_text())
  end = out[out.index(next(l for l in out if l.startswith('finished '))):]
  assert end[0].startswith(f'finished rw_lr at step 4 in ') and f'eval_loss {final["eval_loss"]:.4f}' in end[0]
  assert re.search(r'; train loss [\d.]+ \(the mean of steps 3-4\)$', end[0]), end[0]
  assert end[1:] == [
      '  final.json    run/final.json', '  checkpoints   run/checkpoints (the last: step 4)',
      '  metrics       run/metrics.jsonl',
      f'  TensorBoard   {os.path.dirname(sys.executable)}/tensorboard --logdir run/tensorboard', 'next:',
      f"  {sys.executable} -m laurel.serve.generate --workdir=run --prompt='The ' --max_new_tokens=16 --temperature=0.8 "
      '--top_k=40',
      f'  {sys.executable} -m laurel.serve.evaluate --workdir=run --task=held_out --max_items=10   # the first 10 of '
      'its held-out documents; text:GLOB, .jsonl and TFDS tasks: docs/evaluation.md']
  assert (workdir / 'checkpoints' / '4').is_dir() and list((workdir / 'tensorboard').iterdir())
  # The next command works as printed, from that shell (its laurel command line in this process).
  generated = run_as_printed(end[-2].strip(), tmp_path, env)
  assert generated.returncode == 0 and generated.stdout.startswith("=== 1/1 | prompt 'The ' | "), generated.stderr


def test_printed_commands_start_the_venv_s_python_unless_the_shell_s_python_is_it(tmp_path, monkeypatch):
  """`python` only where the PATH finds this interpreter in its own folder (an activated venv); else its path,
  relative to the working directory when inside it. A `python` elsewhere that links to the same binary (the base
  interpreter of a venv) lacks the venv's packages."""
  venv, other = tmp_path / '.venv' / 'bin', tmp_path / 'usr' / 'bin'
  for folder in (venv, other):
    folder.mkdir(parents=True)
    (folder / 'python').symlink_to(os.path.realpath(sys.executable))
  monkeypatch.setattr(sys, 'executable', str(venv / 'python'))
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('PATH', str(other))
  assert console.python_command() == os.path.join('.venv', 'bin', 'python')
  monkeypatch.setenv('PATH', f'{venv}{os.pathsep}{other}')  # source .venv/bin/activate
  assert console.python_command() == 'python'
  monkeypatch.setenv('PATH', '')
  monkeypatch.chdir(other)
  assert console.python_command() == str(venv / 'python')  # outside the working directory: its full path


def test_a_logged_row_is_the_mean_of_its_interval_and_says_so():
  """Losses 4, 2, 3 and 7 over a 4-step interval log 4.0, not the last step's 7; the learning rate is the last
  step's; the console line and the closing summary name the steps the mean is over."""
  rows = [{'loss': np.float32(l), 'grad_norm': g, 'learning_rate': lr}
          for l, g, lr in zip((4, 2, 3, 7), (1, 1, 2, 4), (1e-3, 2e-3, 3e-3, 4e-3))]
  row = metrics_log.interval_mean(rows)
  assert row == {'loss': 4.0, 'grad_norm': 2.0, 'learning_rate': 4e-3, 'mean_of_steps': 4}
  line = console.step_line(8, 10, {**row, 'step_time_s': 0.5, 'tokens_per_s': 100.0}, 'tokens')
  assert line.startswith('step 8/10 (80%) | mean of 4 steps: loss 4.0000 | grad_norm 2.0000 | lr 4.00e-03 | '), line
  assert 'mean_of_steps' not in line


def test_the_summary_gives_the_last_interval_mean_train_loss(tmp_path):
  config = ml_collections.ConfigDict({'row': 'rw_lr', 'task': 'lm', 'tensorboard': False,
                                      'data': {'name': 'synthetic', 'path': '', 'seq_len': 128}})
  lines = [{'step': 4, 'loss': 5.0, 'mean_of_steps': 4}, {'step': 8, 'loss': 3.25, 'mean_of_steps': 4},
           {'step': 8, 'eval_loss': 3.5}]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
  first = metrics_log.summary(config, epath.Path(tmp_path), {'step': 8, 'eval_loss': 3.5}, 12.0).splitlines()[0]
  assert first == 'finished rw_lr at step 8 in 12.0 s: eval_loss 3.5000; train loss 3.2500 (the mean of steps 5-8)'


@pytest.mark.slow
def test_the_train_loop_logs_the_mean_loss_of_each_interval_and_the_mfu_of_its_devices(tmp_path, monkeypatch):
  """The same deterministic run logged every step and every 3 steps: each 3-step row is the mean of the 3 rows. Its
  MFU counts the peak of the devices it runs on: one of the host's 8 (a peak given to the CPU for it)."""
  monkeypatch.setitem(hardware.PEAK_FLOPS, jax.devices()[0].device_kind, 1e12)
  every = {}
  for log_every in (1, 3):
    config = load_config(SPEC, {**TINY_LM, 'steps': 6, 'log_every': log_every})
    train.train(config, str(tmp_path / str(log_every)), devices=jax.devices()[:1])
    every[log_every] = metrics(tmp_path / str(log_every))
  flops = tasks.get_task(config).model_flops(config.batch_size)
  for row in (r for r in every[1] if 'loss' in r):
    assert row['mfu'] == pytest.approx(flops / row['step_time_s'] / 1e12, rel=1e-6)
  per_step = {r['step']: r['loss'] for r in every[1] if 'loss' in r}
  assert len(set(per_step.values())) == 6  # the losses differ, so a mean differs from the last one
  logged = [(r['step'], r['loss'], r['mean_of_steps']) for r in every[3] if 'loss' in r]
  assert [(s, n) for s, _, n in logged] == [(3, 3), (6, 3)]
  for s, loss, _ in logged:
    assert loss == pytest.approx(np.mean([per_step[s - 2], per_step[s - 1], per_step[s]]), rel=1e-6)


def _wait_for_line(proc, prefix: str, timeout=240) -> list[str]:
  seen, deadline = [], time.time() + timeout
  for line in proc.stdout:
    seen.append(line)
    if line.startswith(prefix) or time.time() > deadline:
      break
  return seen


@pytest.mark.slow
@pytest.mark.parametrize('when', ['start-up', 'compiling'])
def test_ctrl_c_during_start_up_and_compiling_exits_130_with_one_line(tmp_path, when):
  """Before the train loop Ctrl-C exits at once with status 130 and one line, also while XLA compiles (it used to
  crash on exit, status 139, or print a traceback)."""
  proc = subprocess.Popen(cli_args(SPEC, tmp_path, TINY_LM), env=cli_env(), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  if when == 'start-up':
    time.sleep(1.0)  # importing jax, flax and orbax
  else:
    assert _wait_for_line(proc, 'compiling the train step')[-1].startswith('compiling the train step')
  proc.send_signal(signal.SIGINT)
  start = time.time()
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and re.fullmatch(r'interrupted: [^\n]+\n', err), (proc.returncode, err[-2000:])
  assert time.time() - start < 10, 'it waited for the compile to end'
  assert 'Traceback' not in out
  if when == 'compiling':  # written before: whole
    assert json.loads((tmp_path / 'config.json').read_text())['steps'] == TINY_LM['steps']


def test_ctrl_c_in_a_deferred_section_exits_when_it_ends(monkeypatch):
  exits = []
  monkeypatch.setattr(console.os, '_exit', exits.append)
  monkeypatch.setattr(console.os, 'write', lambda fd, text: None)
  # None again afterwards: a pending interrupt left behind ends this process at its next deferred section's end.
  monkeypatch.setitem(process._interrupt, 'pending', None)  # pylint: disable=protected-access
  with process.deferred():
    process._exit_interrupted()  # pylint: disable=protected-access  # what the handler and the watcher call
    assert not exits  # the file being written is finished first
  assert exits == [130]


@pytest.mark.parametrize('env, accelerator, libtpu, expected', [
    ({}, False, True, 'cpu'),  # a CPU-only machine with the TPU compiler installed: no TPU probe
    ({}, True, True, None),  # a TPU VM or a GPU machine
    ({}, False, False, None),  # nothing to probe
    ({'JAX_PLATFORMS': 'tpu'}, False, True, 'tpu'),  # the user's choice stays
])
def test_quiet_start_skips_the_tpu_probe_only_without_an_accelerator(monkeypatch, env, accelerator, libtpu,
                                                                     expected):
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setattr(console, 'has_accelerator', lambda: accelerator)
  monkeypatch.setattr(console.importlib.util, 'find_spec', lambda name: object() if libtpu else None)
  console.quiet_start()
  assert os.environ.get('JAX_PLATFORMS') == expected
  assert os.environ['TF_CPP_MIN_LOG_LEVEL'] and os.environ['TF_ENABLE_ONEDNN_OPTS'] == '0'


IMPORT_EVERY_MODULE = '''
import contextlib, importlib, json, os, pkgutil, sys
import jax  # sets its own defaults (TF_CPP_MIN_LOG_LEVEL) on import, as lm_eval does: not laurel's doing
with contextlib.suppress(ImportError):
  import lm_eval
from absl import flags
before = dict(os.environ)
import laurel
names = sorted(m.name for m in pkgutil.walk_packages(laurel.__path__, 'laurel.'))
for name in names:
  importlib.import_module(name)
  for flag in flags.FLAGS.get_key_flags_for_module(name):  # modules that define the same flags import side by side
    delattr(flags.FLAGS, flag.name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps({'modules': names, 'changed': changed}))
'''


@pytest.mark.slow
def test_importing_every_laurel_module_changes_no_environment_variable():
  env = {k: v for k, v in cli_env().items() if k not in ('JAX_PLATFORMS', 'TF_CPP_MIN_LOG_LEVEL',
                                                          'TF_ENABLE_ONEDNN_OPTS')}
  result = subprocess.run([sys.executable, '-c', IMPORT_EVERY_MODULE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  seen = json.loads(result.stdout.splitlines()[-1])
  assert {'laurel.main', 'laurel.train', 'laurel.serve.generate', 'laurel.serve.evaluate'} <= set(seen['modules'])
  assert seen['changed'] == []


def test_phase_prints_a_heartbeat_and_its_duration(capsys):
  with console.phase('compiling the step', every_s=0.05):
    time.sleep(0.18)
  out = capsys.readouterr().out.splitlines()
  assert out[0] == 'compiling the step...' and out[1].startswith('  still compiling the step (')
  assert re.fullmatch(r'compiling the step: done in 0\.\d s', out[-1])


def test_a_phase_that_was_cut_says_so_and_never_done(capsys):
  with console.phase('evaluating on 16 batches') as progress:
    progress.cut('SIGTERM')
  out = capsys.readouterr().out.splitlines()
  assert out[0] == 'evaluating on 16 batches...'
  assert re.fullmatch(r'evaluating on 16 batches: interrupted \(SIGTERM\) after 0\.\d s', out[-1]), out


def test_pyproject_licence_is_an_spdx_string_for_a_setuptools_that_reads_it_silently():
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())
  assert project['project']['license'] == 'Apache-2.0'  # the table form printed a deprecation banner per build
  requires = project['build-system']['requires']
  assert any(re.fullmatch(r'setuptools>=(\d+)', r) and int(r.split('>=')[1]) >= 77 for r in requires), requires
  # The package at the root is a path entry for an editable install: setuptools prints no notice for it.
  assert project['tool']['setuptools']['package-dir'] == {'': '.'}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which('make') is None, reason='needs make')
def test_make_train_installs_what_training_needs_and_clean_keeps_runs(tmp_path):
  make = lambda target: subprocess.run(['make', '-n', target, f'VENV={tmp_path / "venv"}'], cwd=ROOT,
                                       capture_output=True, text=True, check=True).stdout
  train, test = make('train'), make('test')
  assert "pip install -q --no-compile -e ." in train and '[test]' not in train and 'laurel.main' in train
  assert "pip install -q --no-compile -e '.[test]'" in test and 'pytest' in test
  assert 'compileall' in train and 'compileall' in test  # the bytecode pip was told not to write
  assert 'runs' not in make('clean') and 'rm -rf runs' in make('distclean')
