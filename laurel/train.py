"""The train loop of every task (laurel.tasks): resumes from WORKDIR/checkpoints, writes metrics.jsonl, tensorboard/
and final.json; input shards, eval, preemption and a watchdog."""

import collections
import contextlib
import functools
import hashlib
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback

import flax
import flax.linen as nn
import grain
import jax
import numpy as np
from absl import logging
from etils import epath

from laurel import config_lib, sharding
from laurel.run import checkpoint, checksums, console, hardware, lease, metric_writers
from laurel.run.checkpoint import run_dir
from laurel.config_lib import InputError
from laurel.run.files import is_remote, remove_temporaries, utc, write_text_atomic
from laurel.run.stats import weighted_mean_se
from laurel.step import (LOGICAL_AXIS_RULES, check_fits_host, compile_step, num_data_shards,  # noqa: F401
                         step_flops, validate_config)  # LOGICAL_AXIS_RULES: importable from here


class TrainingDiverged(RuntimeError):
  """The loss, or a state about to be saved, is not finite."""


class SaveFailed(TrainingDiverged):
  """A checkpoint could not be written (e.g. a full disk): the run stops at once, with status 3 as for a loss that is
  not finite, since a rerun would fail alike until the cause is fixed."""


class ShardedBatches(grain.IterDataset):
  """Batches of several independent input shards, concatenated along the batch axis."""
  def __iter__(self):
    return _ShardedBatchIterator([iter(p) for p in self.parents])


class _ShardedBatchIterator(grain.DatasetIterator):
  def __next__(self):
    parts = [next(it) for it in self._parents]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self):
    return {'shards': [it.get_state() for it in self._parents]}

  def set_state(self, state):
    for it, shard_state in zip(self._parents, state['shards']):
      it.set_state(shard_state)


def local_dataset(task, *, train: bool):
  """This process's rows of the global batch: its consecutive run of the input shards (num_data_shards)."""
  config = task.config
  num_shards, nproc, pid = num_data_shards(config), jax.process_count(), jax.process_index()
  return ShardedBatches([task.dataset(train=train, batch_size=config.batch_size // num_shards, seed=config.seed,
                                      process_index=s, process_count=num_shards)
                         for s in range(pid * num_shards // nproc, (pid + 1) * num_shards // nproc)])


class MetricsLog:
  """WORKDIR/metrics.jsonl (one object per logged step) beside laurel.run.metric_writers. Process 0 writes it: by appends
  where local, rewritten whole behind '://' (gcsfs overwrites on 'a'; GCS replaces an object atomically)."""
  def __init__(self, workdir: epath.Path, config, resume_step: int, info: dict, keep_later_steps: bool = False,
               fence=lease.fence(None)):
    self.active, self.info = jax.process_index() == 0, info  # info goes on the first line this process writes
    self.fence = fence  # before each write: raises where another run took the workdir over
    self.path, self.lines = workdir / 'metrics.jsonl', []
    if self.active and self.path.exists():
      text = self.path.read_text()
      for number, line in enumerate(text.splitlines(), 1):
        try:
          row = json.loads(line) if line else None
        except ValueError:
          row = None
        if isinstance(row, dict) and isinstance(row.get('step'), int):
          if keep_later_steps or row['step'] <= resume_step:  # not the lines a killed run logged past the checkpoint
            self.lines.append(line + '\n')
        elif line:
          print(f'warning: {self.path}: dropped line {number}, not a JSON object with a step (cut by a kill?): '
                f'{line[:80]!r}', file=sys.stderr, flush=True)
      if ''.join(self.lines) != text:
        fence()
        write_text_atomic(self.path, ''.join(self.lines))
    flat = flax.traverse_util.flatten_dict(config.to_dict(), sep='.')
    self.writer = metric_writers.create(workdir, config, flat, self.active, resumed=resume_step > 0)

  def write(self, step: int, values: dict):
    values = {k: float(v) if isinstance(v, (float, np.floating, jax.Array)) else v for k, v in values.items()}
    self.fence()
    self.writer.write_scalars(step, {k: v for k, v in values.items() if v is not None})
    if self.active:
      self.lines.append(json.dumps({'step': step, **values, **self.info, 'time': round(time.time(), 3)}) + '\n')
      if not is_remote(self.path):
        with self.path.open('a') as f:
          f.write(self.lines[-1])
      else:
        self.path.write_text(''.join(self.lines))
      self.info = {}

  def step_times(self) -> list[float]:
    """The step_time_s of every train line logged, by earlier runs too (process 0 alone reads the log)."""
    rows = (json.loads(line) for line in self.lines)
    return [row['step_time_s'] for row in rows if isinstance(row.get('step_time_s'), (int, float))]


def check_inputs(task, workdir: epath.Path) -> None:
  """As one-line InputErrors, what would otherwise fail after compiling: remote paths, data, extras, the workdir."""
  for name, path in [('--workdir', os.fspath(workdir))] + [(f'data.{k}', getattr(task.data_cfg, k, '') or '')
                                                           for k in ('path', 'tfds_data_dir')]:  # vocab: check_data
    try:
      if is_remote(path):
        epath.Path(path).exists()
    except Exception as e:  # pylint: disable=broad-except  # whatever the filesystem raises, as one line
      raise InputError(f'{name}={path!r}: {config_lib.io_error_reason(e)}') from None
  task.check_data()
  metric_writers.check_extras(task.config)
  probe = workdir / f'.write_test.{jax.process_index()}'
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe.write_text('')
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except
    raise InputError(f'--workdir={os.fspath(workdir)!r}: not writable: {config_lib.io_error_reason(e)}') from None


@functools.cache
def code_commit() -> str | None:
  """The git commit ('+' if tracked files changed), else the COMMIT file scripts/launch_tpu.py ships, else None."""
  git = lambda *args: subprocess.run(['git', '-C', str(config_lib.REPO), *args], capture_output=True, text=True,
                                     check=False)
  head = git('rev-parse', 'HEAD') if (config_lib.REPO / '.git').exists() else None  # not an enclosing repo's
  if head is not None and head.returncode == 0:
    return head.stdout.strip() + ('+' if git('status', '--porcelain', '--untracked-files=no').stdout.strip() else '')
  commit_file = config_lib.REPO / 'COMMIT'
  return commit_file.read_text().strip() if commit_file.is_file() else None


def _preemption_handler(preempted: list, nproc: int):
  """SIGTERM and Ctrl-C (SIGINT) ask for a checkpoint and a clean exit; a second Ctrl-C exits at once."""
  def handle(signum, _):
    if signum == signal.SIGINT and preempted:
      print('interrupted again: exiting without a checkpoint', file=sys.stderr, flush=True)
      os._exit(130)  # pylint: disable=protected-access
    preempted.append(signum)
    if signum == signal.SIGINT:
      print('interrupted: saving a checkpoint, then exiting (Ctrl-C again exits at once)', file=sys.stderr,
            flush=True)
    if nproc > 1:  # JAX's preemption service takes SIGTERM, and stops every host at the same step
      signal.raise_signal(signal.SIGTERM)
  return handle


DIVERGED = 3  # exit status of a loss that is not finite or a failed save: a rerun would repeat it
WATCHDOG_EXIT = 75  # a hung process: restart it from its last checkpoint (EX_TEMPFAIL)


class Watchdog:
  """Ends a process whose loop stopped making progress (e.g. a collective one host never entered) with WATCHDOG_EXIT,
  printing every thread's stack, for a supervisor to restart. Call `beat(step)` after each step, `beat()` after other
  progress. The limit: `limit_s`, and after WARMUP steps (compiling) max(factor × the median step time, min_s).
  Time the whole process was stopped (SIGSTOP, a suspended job) is no stall: the watchdog's own poll comes back that
  much late, and the stall is then counted from the resumption."""
  WARMUP = 3

  def __init__(self, factor: float, min_s: float, limit_s: float, flush=lambda: None):
    self.factor, self.min_s, self.limit_s, self.flush = factor, min_s, limit_s, flush
    self.step, self.last, self.steps_seen = None, time.monotonic(), 0
    self.step_times = collections.deque(maxlen=200)
    self._stop = threading.Event()
    self._poll_s = min([1.0] + [x / 10 for x in (limit_s, min_s) if x]) if factor or limit_s else None

  def start(self) -> 'Watchdog':
    self.last = time.monotonic()
    if self._poll_s:
      threading.Thread(target=self._watch, name='laurel-watchdog', daemon=True).start()
    return self

  def stop(self):
    self._stop.set()

  def beat(self, step: int | None = None):
    now = time.monotonic()
    if step is not None:
      self.steps_seen += 1
      if self.steps_seen > self.WARMUP:
        self.step_times.append(now - self.last)
      self.step = step
    self.last = now

  def limit(self) -> float | None:
    limits = [self.limit_s] if self.limit_s else []
    if self.factor and len(self.step_times) >= self.WARMUP:
      limits.append(max(self.factor * statistics.median(self.step_times), self.min_s))
    return min(limits, default=None)

  def _watch(self):
    polled = resumed = time.monotonic()
    while not self._stop.wait(self._poll_s):
      now = time.monotonic()
      if now - polled > 2 * self._poll_s + 1.0:  # this thread was stopped too: the whole process was
        resumed = now
      polled = now
      stalled, limit = now - max(self.last, resumed), self.limit()
      if limit is not None and stalled > limit:
        return self._fire(stalled, limit)

  def _fire(self, stalled: float, limit: float):
    after = 'before the first step' if self.step is None else f'after step {self.step}'
    message = (f'watchdog: no progress for {stalled:.1f}s {after} (limit {limit:.1f}s) on process '
               f'{jax.process_index()} of {jax.process_count()} on host {socket.gethostname()}; exiting with status '
               f'{WATCHDOG_EXIT} so that a supervisor restarts the run from its last checkpoint')
    logging.error(message)
    print(f'error: {message}', file=sys.stderr, flush=True)
    for thread_id, frame in sys._current_frames().items():  # pylint: disable=protected-access  # where it hangs
      print(f'thread {thread_id}:\n{"".join(traceback.format_stack(frame))}', file=sys.stderr)
    for flush in (self.flush, logging.flush, sys.stdout.flush, sys.stderr.flush):
      try:
        flush()
      except Exception as e:  # pylint: disable=broad-except  # exit regardless
        print(f'watchdog: flushing failed: {e!r}', file=sys.stderr)
    os._exit(WATCHDOG_EXIT)  # pylint: disable=protected-access  # the main thread is stuck: no clean exit


def train(config, workdir: str, devices=None, allow_config_change: bool = False, allow_fresh_start: bool = False,
          hold_lease: bool = False) -> dict:
  """Trains (or resumes) to config.steps; returns what it writes to WORKDIR/final.json. Bad input is refused before
  anything compiles. Where every checkpoint was unreadable it starts from step 0 only if `allow_fresh_start`. With
  `hold_lease` process 0 holds WORKDIR/lease.json throughout."""
  started = time.perf_counter()
  devices = jax.devices() if devices is None else devices
  task = validate_config(config, num_devices=len(devices))
  workdir = run_dir(workdir)
  check_inputs(task, workdir)
  nproc = jax.process_count()
  with lease.held(workdir, jax.process_index(), nproc) if hold_lease else contextlib.nullcontext() as held:
    if held is not None:  # this run alone writes the workdir: temporaries of writes a kill cut short go
      remove_temporaries(workdir, RUN_FILES)
      checksums.remove_list_temporaries(workdir / 'checkpoints')
    return _train_checked(config, task, workdir, devices, allow_config_change, allow_fresh_start, started,
                          lease.fence(held, nproc))


RUN_FILES = (lease.NAME, 'config.json', 'config_history.jsonl', 'metrics.jsonl', 'final.json')


def config_line(config, cfg, workdir: epath.Path) -> str:
  """A run's first line: its config.json and what it trains (the ConfigDict `config`, typed `cfg`)."""
  design = design_label(cfg.model.stream, config.model.stream.design)
  return (f'config: {console.shown(workdir / "config.json")} ({cfg.task}, row {cfg.row or "-"}, design {design}, '
          f'preset {cfg.preset or "-"}, {cfg.steps} steps)')


def design_label(spec, name: str) -> str:
  """The residual design of a model's `stream` config `spec` (named `name` in the config): 'laurel rw+lr r=8'."""
  if spec.design != 'residual':
    return name
  if spec.variant == 'none':
    return 'residual'
  details = [f'r={spec.rank}'] * spec.low_rank + [f'k={spec.k}'] * spec.pa
  return ' '.join(['laurel', spec.variant, *details, *[f'form={spec.form}'] * (spec.form != 'paper')])


def utilisation_flops(task, batch_size: int) -> dict[str, float]:
  """FLOPs per step behind MFU (the model's count) and HFU (the compiler's, remat included). A count the backend
  does not give is 0 (XLA's analysis of a lowered program under the CUDA and TPU plug-ins, a ResNet's model FLOPs
  there too): left out, not logged as 0%."""
  flops = {'mfu': task.model_flops(batch_size), 'hfu': step_flops(task)}
  return {name: count for name, count in flops.items() if count > 0}


def _train_checked(config, task, workdir: epath.Path, devices, allow_config_change: bool, allow_fresh_start: bool,
                   started: float, fence=lease.fence(None)) -> dict:
  cfg = task.config  # typed; the ConfigDict `config` is only written (config.json, hashes, checkpoint signatures)
  check_fits_host(task)  # before anything is written or compiled: compiling alone can exhaust the host
  fence()  # each write of a run file or checkpoint is fenced: it stops where another run took the workdir over
  record_config = checkpoint.guard_config(config, workdir, allow_config_change)
  print(config_line(config, cfg, workdir), flush=True)
  canonical = json.dumps(json.loads(config.to_json_best_effort()), sort_keys=True)
  info = {'commit': code_commit(), 'config_hash': hashlib.sha256(canonical.encode()).hexdigest()[:16],
          'started_at': utc()}  # what identifies the run
  mesh, nproc = sharding.make_mesh(cfg.mesh, devices), jax.process_count()

  with jax.set_mesh(mesh), nn.logical_axis_rules(cfg.logical_axis_rules), contextlib.ExitStack() as cleanup:
    with console.phase(f'compiling the train step for {len(devices)} device{"s" * (len(devices) > 1)}'):
      compiled, init_state, abstract_state, state_shardings = compile_step(task, mesh)
    check_fits_host(task, compiled, len(devices))
    eval_step = jax.jit(lambda s, b: task.loss(s.params, s.model_state, b, False)[1][0],
                        in_shardings=(state_shardings, sharding.batch_sharding(mesh)))
    train_iter = iter(local_dataset(task, train=True))
    mngr = checkpoint.manager(workdir, cfg.keep_checkpoints)
    cleanup.callback(checkpoint.close, mngr)
    with console.phase('restoring the latest checkpoint') if mngr.all_steps() else contextlib.nullcontext():
      state, start, moved_aside = checkpoint.restore_latest(mngr, workdir, config, abstract_state, train_iter,
                                                            allow_change=allow_config_change)
    if state is None and (quarantined := checkpoint.quarantined_steps(workdir)) and not allow_fresh_start:
      raise InputError(f'--workdir={os.fspath(workdir)!r}: no readable checkpoint: step'
                       f'{"s" * (len(quarantined) > 1)} {", ".join(map(str, quarantined))} moved to '
                       f'{workdir / "unreadable_checkpoints"}; pass --allow_fresh_start to train from step 0')
    checkpoint.check_room(mngr, workdir, abstract_state)  # a save would fail: stop before training
    with console.deferred():  # only now: a refused checkpoint leaves config.json and its history as they were
      fence()
      record_config()
    if state is None:
      if quarantined:  # a fresh start is fresh: a failed restore may have moved the input's position
        train_iter = iter(local_dataset(task, train=True))
        info['fresh_start_after'] = quarantined
      with console.phase('initialising the model'):
        state = init_state(jax.random.key(cfg.seed))
    elif start >= cfg.steps and (workdir / 'final.json').exists():
      print(f'already finished: checkpoint {start} in {workdir}', flush=True)
      return json.loads((workdir / 'final.json').read_text())
    else:
      print(f'resumed from checkpoint {start} in {workdir}', flush=True)
    if moved_aside:  # the log keeps the steps logged after `start`, and says why they come again
      info['moved_aside'] = moved_aside

    num_params = task.num_params(abstract_state.params)
    peak_memory = hardware.peak_memory_bytes(compiled)
    peak_flops = hardware.PEAK_FLOPS.get(jax.devices()[0].device_kind)
    flops = utilisation_flops(task, cfg.batch_size) if peak_flops else {}
    keep = 'moved_aside' in info or 'fresh_start_after' in info  # lines past `start` stay: the log says why
    with console.deferred():  # it rewrites metrics.jsonl
      log = MetricsLog(workdir, config, start, info, keep_later_steps=keep, fence=fence)
    cleanup.callback(log.writer.close)
    watchdog = Watchdog(cfg.watchdog_factor, cfg.watchdog_min_s, cfg.watchdog_s, flush=log.writer.flush)
    cleanup.callback(watchdog.stop)
    profiler = metric_writers.Profiler(workdir / 'profile', cfg.profile_steps)
    cleanup.callback(profiler.close)
    actions = [metric_writers.Progress(log.writer, cfg.log_every, cfg.steps), profiler]
    print(f'{num_params:,} params | {jax.device_count()} device{"s" * (jax.device_count() > 1)}, mesh '
          f'{dict(mesh.shape)} | peak memory of the compiled step {peak_memory / 2**20:,.1f} MiB', flush=True)

    def evaluate():
      """The eval metrics, or None where SIGTERM or Ctrl-C came during the eval of one process (several hosts finish
      it: each batch is a collective step)."""
      it, totals, loss_batches = iter(local_dataset(task, train=False)), {}, []
      with console.phase(f'evaluating on {cfg.eval_steps} batches') as progress:
        for _ in range(cfg.eval_steps):
          if preempted and nproc == 1:
            progress.cut(signal.Signals(preempted[0]).name)  # its line must not say done
            return None
          batch_metrics = jax.device_get(eval_step(state, sharding.global_batch(next(it), mesh)))
          for name, sum_and_weight in batch_metrics.items():  # weighted means over the batches
            totals[name] = totals.get(name, 0.0) + np.asarray(sum_and_weight, np.float64)
          loss_batches.append(batch_metrics['loss'])
          watchdog.beat()
      # final.json's held_out: the eval set's size and own sampling noise (eval_loss's standard error over batches).
      eval_noise.update(loss_se=weighted_mean_se(*zip(*loss_batches)), batches=len(loss_batches),
                        **{task.unit: int(totals['loss'][1])})
      return {f'eval_{k}': float(s / max(w, 1.0)) for k, (s, w) in totals.items()}

    def evaluate_and_log(step):
      """The eval metrics, logged and printed; None where the eval was interrupted (see evaluate)."""
      metrics = evaluate()
      if metrics is not None:
        log.write(step, metrics)
        print(console.eval_line(step, cfg.steps, metrics), flush=True)
      return metrics

    def check_finite(step, metrics, saving=None):  # before a save also the state: only a finite one is a checkpoint
      loss = float(metrics['loss'])
      if math.isfinite(loss) and (saving is None or checkpoint.is_finite(saving)):
        return
      diverged = (f'loss is {loss}' if not math.isfinite(loss) else
                  f'the state (parameters or optimizer state) is not finite (loss {loss:.4f})')
      good = mngr.latest_step()
      raise TrainingDiverged(f'{diverged} at step {step}; not saved; last good checkpoint: '
                             f'{"none" if good is None else good} in {workdir / "checkpoints"}')

    def stop_if_a_save_failed(wait=False):  # at once: steps trained past a failed save are lost on a rerun
      if (failed := checkpoint.finish(mngr) if wait else checkpoint.failure(mngr)) is not None:
        raise SaveFailed(failed)

    # One process: our own flag. Several: only orbax's reached_preemption, which every host agrees on (JAX's
    # preemption service catches SIGTERM), so no host starts a collective save alone.
    preempted = []
    handler = _preemption_handler(preempted, nproc)
    for signum in (signal.SIGTERM, signal.SIGINT) if nproc == 1 else (signal.SIGINT,):
      cleanup.callback(signal.signal, signum, signal.signal(signum, handler))  # the old handler back at the end
    eval_metrics, eval_noise, pending, interval = {}, {}, None, []
    t0, interval_start = time.time(), start
    watchdog.start()
    for done in range(start + 1, cfg.steps + 1):
      fence(reread=False)  # the heartbeat found another holder: stop at this step boundary
      state, metrics = compiled(state, sharding.global_batch(next(train_iter), mesh))
      if pending is not None:  # one step behind, so the host never waits on the step in flight
        check_finite(*pending)
      pending = (done, metrics)
      interval.append(metrics)  # on the device until logged
      for action in actions:
        action.after_step(done)
      last = done == cfg.steps
      stop = mngr.reached_preemption(done) if nproc > 1 else bool(preempted)
      if done % cfg.log_every == 0 or last or stop:
        check_finite(*pending)
        dt = (time.time() - t0) / (done - interval_start)
        row, interval = interval_mean(jax.device_get(interval)), []
        row.update(step_time_s=dt, **{f'{task.unit}_per_s': cfg.batch_size * task.units_per_example() / dt},
                   peak_memory_bytes=peak_memory, params=num_params,
                   **{k: f / dt / (peak_flops * jax.device_count()) for k, f in flops.items()})
        if 'peak_bytes_in_use' in (stats := jax.local_devices()[0].memory_stats() or {}):
          row['device_peak_bytes'] = stats['peak_bytes_in_use']
        log.write(done, row)
        print(console.step_line(done, cfg.steps, row, task.unit), flush=True)
      if done % cfg.eval_every == 0 or last:
        eval_metrics = evaluate_and_log(done)
        if eval_metrics is None:  # interrupted: this step's checkpoint, then exit; a rerun evaluates it
          eval_metrics, stop = {}, True
      if done % cfg.checkpoint_every == 0 or last or stop:
        check_finite(*pending, saving=state)
        fence(every_process=True)
        checkpoint.save(mngr, done, state, train_iter, config)
      stop_if_a_save_failed()
      if done % cfg.log_every == 0 or done % cfg.eval_every == 0 or done % cfg.checkpoint_every == 0:
        t0, interval_start = time.time(), done  # steps only: not the logging, eval and saving
      watchdog.beat(done)
      if stop:
        stop_if_a_save_failed(wait=True)
        print(f'preempted: saved checkpoint {done} in {workdir}; rerun the same command to resume', flush=True)
        return {'step': done, 'preempted': True}
    if not eval_metrics:  # resumed at the last step: nothing trained, but final.json needs the eval
      eval_metrics = evaluate_and_log(cfg.steps)
    stop_if_a_save_failed(wait=True)
    if eval_metrics is None:
      print(f'preempted: checkpoint {cfg.steps} in {workdir} is not evaluated yet; rerun the same command', flush=True)
      return {'step': cfg.steps, 'preempted': True}
    final = {'step': cfg.steps, **eval_metrics, 'held_out': eval_noise, 'params': num_params,
             'peak_memory_bytes': peak_memory, **median_step_time(log.step_times()), **info, 'finished_at': utc()}
    log.writer.write_summary(final)

  if jax.process_index() == 0:
    with console.deferred():
      fence()
      write_text_atomic(workdir / 'final.json', json.dumps(final, indent=2) + '\n')
    print(summary(cfg, workdir, final, time.perf_counter() - started), flush=True)
  return final


def median_step_time(step_times: list[float]) -> dict:
  """final.json's median_step_time_s over every logged interval of every run of the workdir; null, and why, where
  none was timed."""
  if step_times:
    return {'median_step_time_s': float(np.median(step_times))}
  return {'median_step_time_s': None, 'median_step_time_why': 'metrics.jsonl holds no timed step of any run'}


def interval_mean(rows: list[dict]) -> dict:
  """Each metric's mean over a logging interval's steps (the learning rate: the last step's), and `mean_of_steps`."""
  row = {k: statistics.fmean(float(r[k]) for r in rows) for k in rows[-1] if k != 'learning_rate'}
  if 'learning_rate' in rows[-1]:
    row['learning_rate'] = float(rows[-1]['learning_rate'])
  return {**row, 'mean_of_steps': len(rows)}


def summary(config, workdir: epath.Path, final: dict, seconds: float) -> str:
  """The closing lines of a run: its final losses, where its outputs are, and what to run next."""
  path = workdir / 'metrics.jsonl'
  logged = [r for r in map(json.loads, path.read_text().splitlines() if path.exists() else []) if 'loss' in r]
  evals = ', '.join(f'{k} {final[k]:.4f}' for k in sorted((k for k in final if k.startswith('eval_')),
                                                              key=lambda k: (k != 'eval_loss', k)))
  train_loss = ''
  if logged:
    last, steps = logged[-1], logged[-1].get('mean_of_steps', 1)
    train_loss = f'; train loss {last["loss"]:.4f} ' + (f'(the mean of steps {last["step"] - steps + 1}-{last["step"]})'
                                                        if steps > 1 else f'at step {last["step"]}')
  lines = [f'finished {config.row or config.task} at step {final["step"]} in {console.duration(seconds)}: '
           f'{evals}{train_loss}',
           f'  final.json    {console.shown(workdir / "final.json")}',
           f'  checkpoints   {console.shown(workdir / "checkpoints")} (the last: step {final["step"]})',
           f'  metrics       {console.shown(path)}']
  if config.tensorboard:
    tensorboard = console.script_command('tensorboard', 'tensorboard.main')  # the venv's, which the PATH may lack
    lines.append(f'  TensorBoard   {tensorboard} --logdir {console.quoted(workdir / "tensorboard")}')
  if config.task == 'lm':
    lines += ['next:'] + next_commands(config, workdir)
  return '\n'.join(lines)


def next_commands(config, workdir: epath.Path) -> list[str]:
  """What to run on a finished LM run, each working as printed: sample it, and score its own held-out documents."""
  prompt = 'def ' if config.data.name == 'text' and not config.data.path else 'The '
  new_tokens = min(64, config.data.seq_len // 2)  # prompt and new tokens within the context it trained on
  python, run = console.python_command(), console.quoted(workdir)  # the venv's python unless it is `python`
  # Sampled: greedy decoding of a small model repeats itself (`def test the the the`).
  return [f'  {python} -m laurel.serve.generate --workdir={run} --prompt={shlex.quote(prompt)} '
          f'--max_new_tokens={new_tokens} --temperature=0.8 --top_k=40',
          f'  {python} -m laurel.serve.evaluate --workdir={run} --task=held_out --max_items=10   # the first '
          '10 of its held-out documents; text:GLOB, .jsonl and TFDS tasks: docs/evaluation.md']
