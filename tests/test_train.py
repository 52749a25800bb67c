"""The train loop: exact resume, preemption, meshes, multi-process, bad input, NaN, unreadable checkpoints."""
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import (ROOT, SPEC, TINY_LM, TRAINED, checkpoint_steps, cli_args, cli_env, free_port,
                     load_config, losses, metrics, train_cli, tree_snapshot)
from laurel import config_lib, designs, main, train, train_config
from laurel.cli import console, process
from laurel.run import metrics_log
from laurel.plan import cost, hardware


def _wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    assert proc.poll() is None, f'run ended early: {proc.stderr.read()[-2000:]}'
    time.sleep(0.02)
  raise TimeoutError


def _arrays(workdir, number: int) -> dict:
  """Every array of checkpoint `number` (the train state), as numpy, by path."""
  with ocp.CheckpointManager(pathlib.Path(workdir) / 'checkpoints') as mngr:
    state = mngr.restore(number, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}


@pytest.mark.slow
@pytest.mark.process
def test_resume_after_sigkill_at_random_moments_matches_the_uninterrupted_run_bit_for_bit(tmp_path):
  """Two SIGKILLs at random moments of the run (a step, a log line, a save in flight), each rerun resuming where its
  last checkpoint left it: every logged loss and every array of the last checkpoint equal the uninterrupted run's."""
  overrides = {**TINY_LM, 'steps': 40, 'checkpoint_every': 5}
  train.train(load_config(SPEC, overrides), str(tmp_path / 'ref'), devices=jax.devices()[:1])
  workdir, moments = tmp_path / 'killed', random.Random(58)
  for _ in range(2):
    proc = subprocess.Popen(cli_args(SPEC, workdir, overrides), env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    logged = lambda: max(losses(workdir), default=0) if (workdir / 'metrics.jsonl').exists() else 0
    at = logged() + moments.randint(4, 12)
    _wait_for(lambda: logged() >= at, proc)  # pylint: disable=cell-var-from-loop
    time.sleep(moments.uniform(0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(losses(workdir)) < 40, 'the run finished before it could be killed'
  final = train.train(load_config(SPEC, overrides), str(workdir), devices=jax.devices()[:1])
  assert final['step'] == 40 and losses(workdir) == losses(tmp_path / 'ref')  # every step, bit for bit
  reference, resumed = _arrays(tmp_path / 'ref', 40), _arrays(workdir, 40)
  assert reference.keys() == resumed.keys()
  for path, array in reference.items():
    np.testing.assert_array_equal(resumed[path], array, err_msg=path)
  steps = [r['step'] for r in metrics(workdir) if 'loss' in r]
  assert steps == list(range(1, 41))  # no step logged twice


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize('signum, scheduler', [(signal.SIGTERM, False), (signal.SIGINT, False),
                                               (signal.SIGTERM, True)])
def test_sigterm_and_ctrl_c_save_a_checkpoint_and_exit_cleanly_but_never_0_under_a_scheduler(tmp_path, signum,
                                                                                             scheduler):
  env = {**cli_env(), **({'SLURM_JOB_ID': '58', 'SLURM_NTASKS': '1'} if scheduler else {})}
  proc = subprocess.Popen(cli_args(SPEC, tmp_path, {**TINY_LM, 'steps': 100_000}), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _wait_for(lambda: (tmp_path / 'metrics.jsonl').exists() and max(losses(tmp_path), default=0) >= 3, proc)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == (process.PREEMPTED if scheduler else 0), err[-2000:]
  said = 'interrupted (Ctrl-C)' if signum == signal.SIGINT else 'preempted (SIGTERM)'
  assert f'\n{said}: saved checkpoint ' in out and 'Traceback' not in err
  saved = checkpoint_steps(tmp_path)
  assert saved and max(saved) == max(losses(tmp_path)) >= 3  # the step it stopped at: saved at its end


def _as_from_a_shell():
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
    signal.signal(signum, signal.SIG_DFL)
  signal.pthread_sigmask(signal.SIG_SETMASK, [])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which('make') is None, reason='needs make')
def test_ctrl_c_through_make_train_saves_and_make_ends_on_the_signal_as_the_readme_says(tmp_path):
  """A terminal's Ctrl-C reaches make and the run (one process group): the run saves and exits 0, and make then ends
  on the SIGINT it got itself (130 in a shell) whatever the run's status, which the README says."""
  venv = tmp_path / 'venv'  # `make train`'s prerequisite, installed already
  venv.mkdir()
  (venv / '.installed').touch()
  args = ' '.join(f'--config.{k}={v}' for k, v in {**TINY_LM, 'steps': 100_000}.items())
  make = ['make', '-C', str(ROOT), 'train', f'VENV={venv}', f'PY={sys.executable}', f'CONFIG={SPEC}',
          f'WORKDIR={tmp_path / "run"}', f'ARGS={args}']
  # make starts as from a terminal's shell: default signal dispositions and none blocked, whatever this worker's
  # earlier tests left (make keeps an inherited SIG_IGN for SIGINT, and a blocked mask crosses exec).
  worker = {s.name: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
  worker['blocked'] = signal.pthread_sigmask(signal.SIG_BLOCK, [])
  proc = subprocess.Popen(make, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=_as_from_a_shell)
  _wait_for(lambda: (tmp_path / 'run' / 'metrics.jsonl').exists() and max(losses(tmp_path / 'run'), default=0) >= 3,
            proc)
  os.killpg(proc.pid, signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == -signal.SIGINT, (worker, err[-2000:])
  assert '\ninterrupted (Ctrl-C): saved checkpoint ' in out and checkpoint_steps(tmp_path / 'run')
  readme = ' '.join((ROOT / 'README.md').read_text().split())
  assert ('Through `make train` the run saves and exits the same way, and make then exits 130 on the Ctrl-C it got '
          'too, whatever the run did: rerun `make train` to resume.') in readme


def test_a_second_ctrl_c_exits_at_once_and_the_handlers_before_come_back(monkeypatch, capsys):
  exits, before = [], signal.getsignal(signal.SIGINT)
  monkeypatch.setattr(process.os, '_exit', exits.append)
  with process.stop_requests(1, []) as requested:
    handler = signal.getsignal(signal.SIGINT)
    handler(signal.SIGINT, None)
    assert requested == [signal.SIGINT] and not exits  # the loop saves a checkpoint at its next step
    handler(signal.SIGINT, None)
    assert exits == [130]
  assert 'exiting without a checkpoint' in capsys.readouterr().err
  assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is not handler


@pytest.mark.slow
def test_ctrl_c_during_the_final_eval_stops_it_and_a_rerun_evaluates(tmp_path, monkeypatch, capsys):
  """Ctrl-C during an eval ends the run as its message says (a checkpoint of the step, then exit), not after the
  eval; the rerun resumes at the last step and writes final.json."""
  config = load_config(SPEC, {**TINY_LM, 'eval_steps': 3})  # eval and checkpoint at the last step only
  real = train.local_dataset

  def interrupted_eval(task, *, train):  # pylint: disable=redefined-outer-name
    batches = iter(real(task, train=train))
    if train:
      return batches
    def after_one():
      yield next(batches)
      signal.raise_signal(signal.SIGINT)
      yield from batches
    return after_one()

  monkeypatch.setattr(train, 'local_dataset', interrupted_eval)
  assert train.train(config, str(tmp_path), devices=jax.devices()[:1]) == {'step': 6, 'preempted': True}
  assert checkpoint_steps(tmp_path) == {6} and not (tmp_path / 'final.json').exists()
  assert 'interrupted: saving a checkpoint, then exiting' in capsys.readouterr().err
  monkeypatch.undo()
  final = train.train(config, str(tmp_path), devices=jax.devices()[:1])
  assert final['step'] == 6 and json.loads((tmp_path / 'final.json').read_text())['eval_loss'] == final['eval_loss']
  assert " params | 1 device, mesh {'data': 1," in capsys.readouterr().out  # the run's devices, not the host's 8


def _in_process_losses(workdir, devices, mesh, **extra):
  config = load_config(SPEC, {**TINY_LM, 'mesh.data': mesh[0], 'mesh.fsdp': mesh[1], 'mesh.tensor': mesh[2],
                              **extra})
  train.train(config, str(workdir), devices=devices)
  return losses(workdir)


@pytest.fixture(scope='module')
def one_device_losses(tmp_path_factory):
  return _in_process_losses(tmp_path_factory.mktemp('one_device'), jax.devices()[:1], (1, 1, 1))


@pytest.mark.slow
@pytest.mark.parametrize('mesh', [(8, 1, 1), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 8, 1)])
def test_sharded_meshes_match_one_device(tmp_path, mesh, one_device_losses):
  assert jax.device_count() == 8
  one = one_device_losses
  many = _in_process_losses(tmp_path / 'many', jax.devices(), mesh)
  assert one.keys() == many.keys()
  np.testing.assert_allclose([many[s] for s in sorted(many)], [one[s] for s in sorted(one)], rtol=2e-5)


@pytest.fixture(scope='module')
def eight_device_losses(tmp_path_factory):
  return _in_process_losses(tmp_path_factory.mktemp('eight'), jax.devices(), (4, 2, 1), data_shards=2)


def _outputs(procs, timeout: float) -> list[tuple[str, str]]:
  """Each process's (stdout, stderr). Where one hangs, all are killed and the failure shows where each had got to."""
  try:
    return [p.communicate(timeout=timeout) for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    tails = [f'process {i}:\n{out[-1500:]}{err[-1500:]}' for i, (out, err) in enumerate(p.communicate() for p in procs)]
    pytest.fail(f'no exit within {timeout} s:\n' + '\n'.join(tails))


@pytest.mark.slow
def test_two_processes_match_one_process_with_eight_devices(tmp_path, eight_device_losses):
  """Two processes joined by flags (laurel.run.cluster), 4 devices each, train as one process on 8 does. srun's and
  Open MPI's variables reach the same jax.distributed.initialize: tests/test_cluster.py joins two processes as srun
  starts them and checks what Open MPI's give it."""
  steps, port = 6, free_port()
  overrides = {**TINY_LM, 'data_shards': 2, 'mesh.data': 4, 'mesh.fsdp': 2, 'steps': steps}
  flags = lambda i: [f'--coordinator_address=localhost:{port}', '--num_processes=2', f'--process_id={i}']
  procs = [subprocess.Popen(cli_args(SPEC, tmp_path / 'two', overrides) + flags(i), env=cli_env(4),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  for i, (p, (out, err)) in enumerate(zip(procs, _outputs(procs, timeout=300))):
    assert p.returncode == 0, err[-3000:]
    assert out.startswith(f'cluster: flags (--num_processes=2): process {i} of 2 on '), out[:500]
    assert '4 of 8 cpu devices' in out.splitlines()[0]
  two = losses(tmp_path / 'two')
  assert eight_device_losses.keys() == two.keys() == set(range(1, steps + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [eight_device_losses[s] for s in sorted(two)], rtol=1e-5)


def _checked_fields(section, prefix=''):
  """(dotted name, value, check) of every field of a built config section that declares a check (config_lib.field)."""
  for f in dataclasses.fields(section):
    name, value = prefix + f.name, getattr(section, f.name)
    if 'sections' in f.metadata:  # a model's `stream`: every design's section model.<section>, each checked
      for d in designs.REGISTRY.values():
        yield from _checked_fields(value if d.name == value.design else d.config(), f'{prefix}{d.section}.')
    elif dataclasses.is_dataclass(value):
      yield from _checked_fields(value, name + '.')
    elif 'check' in f.metadata:
      yield name, value, f.metadata['check']


RESNET = 'configs/imagenet_resnet50.py:rw_lr_pa,preset=tiny'
TASK_CONFIGS = {'lm': (SPEC, TINY_LM), 'resnet': (RESNET, {})}
# Values of another type than the default's (a bool is no integer nor number), then values at or past the usual
# bounds: the first that a field's check refuses is tried too.
WRONG_TYPES = {bool: (1,), int: (1.0, True), float: ('3e-4', None, True), str: (1,), tuple: ('x',)}
OUT_OF_RANGE = {bool: (), int: (-1, 0, 2**31), float: (-1.0, 0.0, 1.0, float('inf'), float('nan')),
                str: ('no-such-value',), tuple: ((0,), (2, 1))}


@functools.cache
def _task_config(task: str) -> dict:
  return load_config(*TASK_CONFIGS[task]).to_dict()  # a plain dict takes any type


def _field_cases():
  for name, (spec, overrides) in TASK_CONFIGS.items():
    task = train_config.validate_config(load_config(spec, overrides), num_devices=1, process_count=1)
    for field, default, (ok, why) in _checked_fields(task.config):
      kind = type(default)
      refused = [v for v in OUT_OF_RANGE[kind] if not ok(v)][:1]
      for value in [*WRONG_TYPES[kind], *refused]:
        yield pytest.param(name, field, value, why, id=f'{name}:{field}={value!r}')


@pytest.mark.parametrize('task, field, value, why', list(_field_cases()))
def test_every_checked_field_refuses_a_bad_value_in_one_line(task, field, value, why):
  """Every field that declares a check, of every task's config: values of another type (as a config built in
  Python can carry) and one past its bounds raise one InputError naming field, value and the check's reason."""
  config = copy.deepcopy(_task_config(task))
  *parents, leaf = field.split('.')
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(config_lib.InputError) as raised:
    train_config.validate_config(ml_collections.ConfigDict(config), num_devices=1, process_count=1)
  assert str(raised.value) == f'{field}={value!r}: {why}'


@pytest.mark.parametrize('bad, message', [
    ({'model.laurel.rank': 0}, 'model.laurel.rank=0'),
    ({'model.laurel.rank': 99}, 'model.laurel.rank=99'),
    ({'model.laurel.k': 9}, 'model.laurel.k=9'),
    ({'batch_size': 12, 'mesh.data': 8}, 'batch_size=12'),
    ({'mesh.tensor': 3}, 'mesh='),
    ({'optimizer.warmup_steps': 7}, 'optimizer.warmup_steps=7: longer than the run (steps=6)'),
    ({'optimizer.warmup_steps': 6}, 'optimizer.warmup_steps=6: as long as the run (steps=6): the learning rate would '
                                    'never leave its warmup'),
])
def test_checks_across_fields_are_one_line(bad, message):
  with pytest.raises(config_lib.InputError, match=f'^{re.escape(message)}'):
    train_config.validate_config(load_config(SPEC, {**TINY_LM, **bad}), num_devices=8, process_count=1)


@pytest.mark.parametrize('bad, message', [
    ({'foo': 1}, 'config.foo: unknown config field'),  # the flags
    ({'model.laurel.rank': 0}, 'model.laurel.rank=0: '),  # validate_config
    ({'data.name': 'text', 'data.path': '/nonexistent/*.txt'}, "data.path='/nonexistent/*.txt'"),  # the inputs
])
def test_bad_input_fails_fast_with_one_line_and_leaves_checkpoints(trained_run, monkeypatch, capsys, bad, message):
  monkeypatch.setattr(train, 'compile_step', lambda *_: pytest.fail('compiled'))
  before = tree_snapshot(trained_run)
  status, _, err = train_cli(capsys, SPEC, trained_run, {**TRAINED, **bad})
  assert status == process.BAD_INPUT and err.startswith('error: ') and err.count('\n') == 1 and message in err, err
  assert tree_snapshot(trained_run) == before


@pytest.mark.slow
def test_workdir_of_another_model_is_refused_untouched(trained_run, tmp_path, capsys):
  before = tree_snapshot(trained_run)
  status, _, err = train_cli(capsys, SPEC, trained_run, {**TRAINED, 'model.d_model': 64, 'steps': 12})
  assert status == process.BAD_INPUT and 'model.d_model=32 (now 64)' in err
  assert tree_snapshot(trained_run) == before
  # Without its config.json (e.g. a workdir written by hand), the checkpoint's own record refuses it.
  shutil.copytree(trained_run / 'checkpoints', tmp_path / 'checkpoints')
  with pytest.raises(ValueError, match='different task/model'):
    train.train(load_config(SPEC, {**TINY_LM, 'model.d_model': 64}), str(tmp_path), devices=jax.devices()[:1])


@pytest.mark.slow
def test_resuming_with_another_config_is_refused_unless_allowed_and_then_recorded(trained_run, tmp_path, capsys):
  before = tree_snapshot(trained_run)
  changed = {**TRAINED, 'optimizer.learning_rate': 0.01, 'seed': 5, 'steps': 11}
  status, _, err = train_cli(capsys, SPEC, trained_run, changed)
  assert status == process.BAD_INPUT and err.splitlines() == [(
      f"error: --workdir='{trained_run}': its checkpoints (step 9) were trained with optimizer.learning_rate=0.003 "
      f'(now 0.01), seed=0 (now 5); resume with the saved config (--config={trained_run}), or pass '
      '--allow_config_change to go on with the new values')]
  assert tree_snapshot(trained_run) == before

  workdir = tmp_path / 'copy'
  shutil.copytree(trained_run, workdir)
  config = load_config(SPEC, changed)
  train.train(config, str(workdir), devices=jax.devices()[:1], allow_config_change=True)
  history = [json.loads(l) for l in (workdir / 'config_history.jsonl').read_text().splitlines()]
  assert [h['step'] for h in history] == [0, 9] and history[0]['changes'] == {}
  assert history[1]['changes'] == {'optimizer.learning_rate': [0.003, 0.01], 'seed': [0, 5], 'steps': [9, 11]}
  assert history[1]['allowed_by_flag'] and history[1]['config']['seed'] == 5
  assert json.loads((workdir / 'config.json').read_text())['seed'] == 5  # the config the run goes on with
  # Only the fields that may change: no flag needed.
  train.train(load_config(SPEC, {**changed, 'steps': 12, 'log_every': 3}), str(workdir), devices=jax.devices()[:1])
  history = [json.loads(l) for l in (workdir / 'config_history.jsonl').read_text().splitlines()]
  assert history[-1]['changes'] == {'log_every': [1, 3], 'steps': [11, 12]} and not history[-1]['allowed_by_flag']
  assert max(losses(workdir)) == 12


def _garbage(state):
  for f in state.rglob('*'):
    if f.is_file():
      f.write_bytes(b'garbage')


@pytest.mark.slow
@pytest.mark.parametrize('damage, why', [(_garbage, 'bytes, '), (lambda state: (state / 'manifest.ocdbt').unlink(),
                                                                 'manifest.ocdbt is missing')],
                         ids=['garbage', 'no_manifest'])
def test_unreadable_latest_checkpoint_is_moved_aside_not_deleted(trained_run, tmp_path, capsys, damage, why):
  workdir = tmp_path / 'run'
  shutil.copytree(trained_run, workdir)
  assert checkpoint_steps(workdir) == {3, 6, 9}
  damage(workdir / 'checkpoints' / '9' / 'state')
  status, out, err = train_cli(capsys, SPEC, workdir, TRAINED)  # trained_run's step: compiled already
  assert status == 0, err[-2000:]
  assert re.search(rf'checkpoint 9 is damaged \(state/[^)]*{why}', err), err[-2000:]
  assert 'resumed from checkpoint 6' in out
  assert list((workdir / 'unreadable_checkpoints').iterdir())  # kept for inspection
  assert (workdir / 'checkpoints' / '9').is_dir()  # trained again from 6


@pytest.mark.slow
def test_nan_loss_stops_the_run_naming_step_and_checkpoint(tmp_path, capsys):
  status, _, err = train_cli(capsys, SPEC, tmp_path, {**TINY_LM, 'steps': 30, 'checkpoint_every': 2,
                                                      'optimizer.learning_rate': 1e30, 'optimizer.warmup_steps': 0})
  assert status == process.DIVERGED and err.count('\n') == 1, err[-2000:]
  assert re.fullmatch(r'error: (loss is nan at step \d+|the state .* is not finite .* at step \d+; not saved); last good '
                      r'checkpoint: \S+ in .*\n', err), err


@pytest.mark.slow
def test_a_relative_workdir_saves_checkpoints(tmp_path, monkeypatch):
  config = load_config(SPEC, {**TINY_LM, 'checkpoint_every': 3})  # one_device_losses' step: compiled once
  monkeypatch.chdir(tmp_path)  # `make train`'s --workdir=runs/demo
  train.train(config, 'runs/demo', devices=jax.devices()[:1])
  assert sorted(p.name for p in (tmp_path / 'runs' / 'demo' / 'checkpoints').iterdir()) == ['3', '6']
  assert json.loads((tmp_path / 'runs' / 'demo' / 'final.json').read_text())['step'] == 6


def test_a_step_the_backend_counts_no_flops_for_has_no_count_not_the_loss_chunks_alone():
  # As under the CUDA plug-in (measured on an H200); the loss chunks are compiled apart, so counted there too.
  chunked = train_config.validate_config(load_config(SPEC, {**TINY_LM, 'model.loss_chunk': 8}), 1, 1)
  assert cost.step_costs(chunked, lambda t: (0.0, 0.0)) == (0.0, 0.0)


@pytest.mark.slow
def test_training_reduces_loss_and_writes_outputs(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(hardware.PEAK_FLOPS, jax.devices()[0].device_kind, 1e12)  # as if the CPU's peak were known
  # The SIGKILL test's step (40 steps): compiled once for both
  config = load_config(SPEC, {**TINY_LM, 'steps': 40, 'log_every': 5, 'eval_every': 20, 'tensorboard': True})
  final = train.train(config, str(tmp_path), devices=jax.devices()[:1])
  rows = metrics(tmp_path)
  logged = [r for r in rows if 'loss' in r]
  assert logged[-1]['loss'] < 0.7 * logged[0]['loss']
  for key in ('step', 'loss', 'learning_rate', 'grad_norm', 'step_time_s', 'tokens_per_s', 'peak_memory_bytes',
              'mfu', 'time'):
    assert key in logged[0], key
  assert 0 < logged[-1]['mfu'] < 1 and 'hfu' not in logged[-1]  # hfu: the benchmark's, not lowered at every start
  console = [l for l in capsys.readouterr().out.splitlines() if l.startswith('step ')]
  assert len(console) == 8
  assert all(' | mean of 5 steps: loss ' in l and ', mfu ' in l and 'hfu' not in l for l in console), console
  assert [r['step'] for r in rows if 'eval_loss' in r] == [20, 40]
  # What explains the run: the first line and final.json carry the commit, the config's hash and the times.
  saved = json.loads((tmp_path / 'final.json').read_text())
  assert final['eval_loss'] == saved['eval_loss']
  assert {k: rows[0][k] for k in ('commit', 'config_hash', 'started_at')} == {
      k: saved[k] for k in ('commit', 'config_hash', 'started_at')}
  assert saved['commit'] == metrics_log.code_commit() and len(saved['config_hash']) == 16
  assert saved['started_at'] <= saved['finished_at'] and 'commit' not in rows[1]
  assert rows[0]['time'] <= rows[-1]['time']
  assert list((tmp_path / 'tensorboard').iterdir())


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch(tmp_path, one_device_losses):
  full = one_device_losses
  accum = _in_process_losses(tmp_path / 'accum', jax.devices()[:1], (1, 1, 1), **{'optimizer.grad_accum_steps': 2})
  np.testing.assert_allclose([accum[s] for s in sorted(accum)], [full[s] for s in sorted(full)], rtol=1e-5)


# Two stages of the tiny preset's two blocks: batch norm, PA's history and a stage boundary at half the compile.
# 30 steps of the tiny preset's 300, warming up for a tenth of them as the preset does (its 30 would never end).
TINY_RESNET = {'steps': 30, 'log_every': 5, 'eval_every': 1000, 'eval_steps': 2, 'checkpoint_every': 10,
               'keep_checkpoints': 5, 'tensorboard': False, 'model.stage_sizes': (2, 2), 'optimizer.warmup_steps': 3}


@pytest.mark.slow
def test_resnet_trains_with_accuracy_and_resumes_batchnorm_statistics_exactly(tmp_path):
  config = load_config(RESNET, {**TINY_RESNET, 'eval_every': 30})
  final = train.train(config, str(tmp_path / 'full'), devices=jax.devices()[:1])
  logged = metrics(tmp_path / 'full')
  logged = [r for r in logged if 'loss' in r]
  assert logged[-1]['loss'] < 0.7 * logged[0]['loss']
  assert {'top1', 'top5', 'images_per_s'} <= logged[0].keys()
  assert 0 <= final['eval_top1'] <= final['eval_top5'] <= 1 and final['eval_top1'] > 0.2

  resumed = tmp_path / 'resumed'
  # Resume from step 20 of the same run (10 steps again: BatchNorm's statistics carry every step's batch on): later
  # checkpoints and outputs are left behind.
  shutil.copytree(tmp_path / 'full' / 'checkpoints' / '20', resumed / 'checkpoints' / '20')
  (resumed / 'metrics.jsonl').write_text((tmp_path / 'full' / 'metrics.jsonl').read_text())
  train.train(config, str(resumed), devices=jax.devices()[:1])
  assert losses(resumed) == losses(tmp_path / 'full')


def _step_flops(**overrides):
  config = load_config(SPEC, {**TINY_LM, 'model.laurel.k': 2, **overrides})
  return cost.step_flops(train_config.validate_config(config, 1, 1))


def _lowered_configs(**overrides) -> list:
  """The configs whose steps cost.step_costs lowers for the step of `overrides` (their counts made up: none lowered)."""
  config = load_config(SPEC, {**TINY_LM, 'model.laurel.k': 2, **overrides})
  lowered = []
  cost.step_costs(train_config.validate_config(config, 1, 1), lambda t: lowered.append(t.config) or (1.0, 1.0))
  return lowered


@pytest.mark.slow
@pytest.mark.parametrize('layers', [3, 4])
def test_step_flops_count_every_scanned_layer(layers):
  """XLA counts a loop's body once: an odd layer count is counted unrolled in one iteration, an even one extrapolated
  from scan_unroll 1 and 2. Either is the Python loop's count within 0.5% (the scan's own slicing adds 0.1-0.3%,
  by jax version); a layer missed or counted twice would be 1/layers off."""
  scanned = _step_flops(**{'model.num_layers': layers})
  looped = _step_flops(**{'model.num_layers': layers, 'model.scan_layers': False})
  assert scanned == pytest.approx(looped, rel=5e-3)
  # The config's own unroll changes nothing: the count sets its unroll itself, so it lowers the same steps.
  unrolled = _lowered_configs(**{'model.num_layers': layers, 'model.scan_unroll': layers})
  assert len(unrolled) == 2 and unrolled == _lowered_configs(**{'model.num_layers': layers})


@pytest.mark.slow
def test_step_flops_count_every_loss_chunk_and_micro_batch():
  """XLA counts a loop's body once: the loss's chunks and the micro-batches are loops too. One layer: no layer scan
  to count apart (test_step_flops_count_every_scanned_layer), one lowering a count."""
  one_layer = {'model.num_layers': 1, 'model.laurel.k': 1}
  whole = _step_flops(**one_layer, **{'model.loss_chunk': 0})
  chunked = _step_flops(**one_layer, **{'model.loss_chunk': TINY_LM['data.seq_len'] // 4})
  assert chunked == pytest.approx(whole, rel=0.02)
  assert _step_flops(**one_layer, **{'optimizer.grad_accum_steps': 2}) == pytest.approx(_step_flops(**one_layer),
                                                                                        rel=1e-3)


@pytest.mark.slow
def test_resuming_a_trained_run_without_final_json_still_writes_the_eval(trained_run, tmp_path, capsys):
  workdir = tmp_path / 'copy'
  shutil.copytree(trained_run, workdir)
  (workdir / 'final.json').unlink()
  assert train_cli(capsys, SPEC, workdir, TRAINED)[0] == 0
  assert 'eval_loss' in json.loads((workdir / 'final.json').read_text())


def test_missing_data_and_an_unwritable_workdir_fail_before_compiling(tmp_path, sp_model, monkeypatch):
  monkeypatch.setattr(train, 'compile_step', lambda *_: pytest.fail('compiled'))
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'file').write_text('')
  c4 = load_config(SPEC, {**TINY_LM, 'data.name': 'c4', 'data.path': str(tmp_path / 'empty'),
                          'data.vocab_path': sp_model})
  with pytest.raises(ValueError, match=re.escape(
      f"data.path='{tmp_path / 'empty'}': no c4-train.*.array_record shards; write them with "
      f"{console.python_command()} -m laurel.prepare.c4 --input=<folder of C4's c4-*.json.gz> --output=")):
    train.train(c4, str(tmp_path / 'run'))
  with pytest.raises(ValueError, match=re.escape(f"--workdir='{tmp_path / 'file' / 'run'}': not writable: ")):
    train.train(load_config(SPEC, TINY_LM), str(tmp_path / 'file' / 'run'))
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('gcsfs') is not None, reason='gcsfs would reach the network')
def test_gs_paths_without_their_filesystem_fail_before_compiling(tmp_path, sp_model):
  env = {**cli_env(), 'EPATH_USE_TF': '0'}  # epath's gs:// then needs gcsfs, which is not installed here
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  for split in ('train', 'validation'):  # the data is checked before the vocabulary that tokenizes it
    writer = array_record_module.ArrayRecordWriter(str(tmp_path / f'c4-{split}.00000-of-00001.array_record'),
                                                   'group_size:1')
    writer.write(b'a document')
    writer.close()
  cases = [
      (TINY_LM, 'gs://bucket/run', "error: --workdir='gs://bucket/run': its filesystem is not installed: "
       "pip install -e '.[gcs]'"),
      ({**TINY_LM, 'data.name': 'c4', 'data.path': tmp_path, 'data.vocab_path': 'gs://bucket/sp.model'},
       tmp_path / 'run', "error: data.vocab_path='gs://bucket/sp.model': cannot read a SentencePiece model: its "
       "filesystem is not installed: pip install -e '.[gcs]'"),
  ]
  # One process (epath reads EPATH_USE_TF as it starts) runs laurel-train's main on each command line.
  argvs = [cli_args(SPEC, workdir, overrides)[3:] for overrides, workdir, _ in cases]
  result = subprocess.run([sys.executable, '-c', EACH_COMMAND_LINE, json.dumps(argvs, default=str)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  for (_, _, message), (status, out, err) in zip(cases, json.loads(result.stdout.splitlines()[-1]), strict=True):
    lines = [l for l in err.splitlines() if l.startswith('error:')]
    assert status == 2 and len(lines) == 1 and lines[0].startswith(message), err[-2000:]
    assert 'Traceback' not in err and ' params | ' not in out  # nothing compiled
  assert not (tmp_path / 'run').exists()


# laurel-train's main on each command line of the JSON list argv[1], in turn: its [status, stdout, stderr] each.
EACH_COMMAND_LINE = (
    'import contextlib, io, json, sys\nfrom laurel import main\nresults = []\n'
    'for argv in json.loads(sys.argv[1]):\n'
    '  out, err = io.StringIO(), io.StringIO()\n'
    '  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n'
    '    status = main.main(["laurel-train", *argv])\n'
    '  results.append([status, out.getvalue(), err.getvalue()])\n'
    'print(json.dumps(results))\n')


def test_cli_help_print_config_and_configs_from_any_directory(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  cli = lambda *args: (main.main(['laurel-train', *args]), *capsys.readouterr())
  status, out, _ = cli('--help')
  assert status == 0
  for flag in ('--config', '--workdir', '--print_config', '--allow_config_change', 'laurel-train --config=',
               '--heartbeat_timeout', '--join_timeout'):
    assert flag in out, flag
  for status, meaning in process.EXIT_STATUSES.items():  # each exit status, with what it means
    assert re.search(rf'^  {status} +\S', out, re.M), (status, meaning)
  status, out, err = cli('--config=c4_ablation:rw,preset=tiny', '--config.steps=70', '--print_config')
  assert status == 0, err[-2000:]
  assert {k: json.loads(out)[k] for k in ('row', 'preset', 'steps')} == {'row': 'rw', 'preset': 'tiny', 'steps': 70}
  shutil.copy(ROOT / 'configs' / 'c4_ablation.py', tmp_path / 'mine.py')  # relative to the working directory
  status, out, err = cli('--config=mine.py:pa,preset=tiny', '--print_config')
  assert status == 0 and json.loads(out)['row'] == 'pa', err[-2000:]
  status, _, err = cli('--config=missing.py:pa', '--workdir=run')
  assert status == 2 and err.splitlines() == ["error: --config='missing.py:pa': no such config file (shipped: "
                                              "c4_ablation, imagenet_resnet50, llm, residual_designs; or a run's "
                                              'WORKDIR)']
