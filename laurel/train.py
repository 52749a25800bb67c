"""The train loop of every task (laurel.tasks): `setup` returns the run (its mesh, compiled step, state, checkpoint
manager and metrics log), and `loop` runs the step, then each action's `after_step(run, step, metrics)`. Logging
(with the residual design's own diagnostics), eval, checkpointing, steps per second, the profiler and the watchdog
are actions; `actions()` lists them, the one place to add another (an object with `after_step`, and `close` where
it holds something). What runs a job but is no action (the workdir's lock, checkpoints, the metrics log) is in
laurel.run; signals and exit statuses in laurel.cli.process."""

import collections
import contextlib
import dataclasses
import faulthandler
import hashlib
import json
import math
import os
import signal
import statistics
import sys
import time
from typing import Any

import flax.linen as nn
import grain
import jax
import numpy as np
from etils import epath
from flax import traverse_util

from laurel import sharding
from laurel.config_lib import to_dict
from laurel.plan import hardware
from laurel.cli import console, process
from laurel.run import checkpoint, lock
from laurel.run.checkpoint import run_dir
from laurel.cli.files import remove_temporaries, utc, write_text_atomic
from laurel.run.metrics_log import MetricsLog, code_commit, config_line, interval_mean, median_step_time, summary
from laurel.plan.preflight import check_fits_host, check_inputs
from laurel.stats import weighted_mean_se
from laurel.step import compile_step
from laurel.train_config import num_data_shards, signature, validate_config


class TrainingDiverged(RuntimeError):
  """The loss, or a state about to be saved, is not finite."""
  exit_status = process.DIVERGED


class SaveFailed(RuntimeError):
  """A checkpoint could not be written (a full disk): the run stops at once, naming the cause."""
  exit_status = process.ERROR


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


@dataclasses.dataclass
class Run:
  """A run as setup() leaves it: what the loop and its actions read, and the state they change."""
  task: Any
  workdir: epath.Path
  mesh: Any
  step: Any  # the train step, compiled
  state: Any
  start: int  # the checkpoint it resumed from; 0 from scratch
  mngr: checkpoint.Manager  # orbax's, with the saves it started
  log: MetricsLog
  train_iter: Any
  state_shardings: Any
  info: dict  # what identifies the run (commit, config hash, start), on the first line it logs and in final.json
  signature: dict  # what each checkpoint records of the config
  peak_memory: int
  num_params: int
  requested: list  # the signals that asked it to stop (laurel.cli.process.stop_requests)
  progress: list = dataclasses.field(default_factory=list)  # called on progress within a step (an eval batch)
  paused_s: float = 0.0  # seconds spent evaluating and saving, left out of the step time
  stopping: bool = False  # a signal or a preemption: this step's checkpoint, then the loop ends

  @property
  def config(self):
    return self.task.config

  @contextlib.contextmanager
  def paused(self):
    start = time.perf_counter()
    try:
      yield
    finally:
      self.paused_s += time.perf_counter() - start

  def last_good(self) -> str:
    good = self.mngr.latest_step()
    return f'last good checkpoint: {"none" if good is None else good} in {self.workdir / "checkpoints"}'


def train(config, workdir: str, devices=None, allow_config_change: bool = False, hold_lock: bool = False) -> dict:
  """Trains (or resumes) to config.steps; returns what it writes to WORKDIR/final.json ({'step', 'preempted'} where
  a signal stopped it). `config` is typed (train_config.TrainConfig) or a ConfigDict, built here. Bad input is refused
  before anything compiles. With `hold_lock` process 0 holds WORKDIR/lock throughout."""
  started, devices = time.perf_counter(), jax.devices() if devices is None else devices
  task = validate_config(config, num_devices=len(devices))
  workdir = run_dir(workdir)
  check_inputs(task, workdir)
  check_fits_host(task)  # before anything is written or compiled: compiling alone can exhaust the host
  record_config = checkpoint.guard_config(task.config, workdir, allow_config_change)  # refused: nothing written
  with contextlib.ExitStack() as stack:
    if hold_lock:
      stack.enter_context(lock.held(workdir, jax.process_index(), jax.process_count()))
      if jax.process_index() == 0:  # of writes a kill cut short: this run alone writes the workdir
        remove_temporaries(workdir, RUN_FILES)
    run = setup(task, workdir, devices, allow_config_change, record_config, stack)
    if isinstance(run, dict):  # finished already
      return run
    after_each_step = actions(run)
    for action in after_each_step:
      if hasattr(action, 'close'):
        stack.callback(action.close)
    final = loop(run, after_each_step)
  if 'finished_at' in final and jax.process_index() == 0:
    with process.deferred():
      write_text_atomic(workdir / 'final.json', json.dumps(final, indent=2) + '\n')
    print(summary(task.config, workdir, final, time.perf_counter() - started), flush=True)
  return final


RUN_FILES = ('config.json', 'config_history.jsonl', 'metrics.jsonl', 'final.json')


def setup(task, workdir: epath.Path, devices, allow_config_change: bool, record_config,
          stack: contextlib.ExitStack) -> Run | dict:
  """The run, resumed from its newest good checkpoint or initialised; final.json's figures where it finished.
  `record_config` writes config.json and its history (checkpoint.guard_config): before compiling where there is no
  checkpoint, else once the checkpoint is restored."""
  cfg = task.config
  print(config_line(cfg, workdir), flush=True)
  config_dict = to_dict(cfg)  # once: the hash, the writers' hyperparameters, each checkpoint's record
  info = {'commit': code_commit(), 'started_at': utc(),
          'config_hash': hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]}
  mesh = sharding.make_mesh(cfg.mesh, devices)
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(cfg.logical_axis_rules))
  mngr = checkpoint.manager(workdir, cfg)
  stack.callback(checkpoint.close, mngr)
  if fresh := not mngr.all_steps():  # no checkpoint that could refuse the config: it is written before compiling
    with process.deferred():
      record_config()
  with console.phase(f'compiling the train step for {len(devices)} device{"s" * (len(devices) > 1)}'):
    compiled, init_state, abstract_state, state_shardings = compile_step(task, mesh)
  check_fits_host(task, compiled, len(devices))
  train_iter, requested = iter(local_dataset(task, train=True)), []
  with console.phase('restoring the latest checkpoint') if not fresh else contextlib.nullcontext():
    state, start, moved_aside = checkpoint.restore_latest(mngr, workdir, cfg, abstract_state, train_iter,
                                                          allow_change=allow_config_change)
  if not fresh:
    with process.deferred():  # only now: a refused checkpoint leaves config.json and its history as they were
      record_config()
  if state is None:
    if moved_aside:  # a fresh start is fresh: a failed restore may have moved the input's position
      train_iter = iter(local_dataset(task, train=True))
    with console.phase('initialising the model'):
      state = init_state(jax.random.key(cfg.seed))
  elif start >= cfg.steps and (workdir / 'final.json').exists():
    print(f'already finished: checkpoint {start} in {workdir}', flush=True)
    return json.loads((workdir / 'final.json').read_text())
  else:
    print(f'resumed from checkpoint {start} in {workdir}', flush=True)
  if moved_aside:  # the first line logged says why the steps after `start` come again
    info['moved_aside'] = moved_aside
  with process.deferred():  # it rewrites metrics.jsonl
    log = MetricsLog(workdir, cfg, start, info, traverse_util.flatten_dict(config_dict, sep='.'))
  stack.callback(log.writer.close)
  num_params, peak_memory = task.num_params(abstract_state.params), hardware.peak_memory_bytes(compiled)
  print(f'{num_params:,} params | {mesh.size} device{"s" * (mesh.size > 1)}, mesh '
        f'{dict(mesh.shape)} | peak memory of the compiled step {peak_memory / 2**20:,.1f} MiB', flush=True)
  stack.enter_context(process.stop_requests(jax.process_count(), requested))  # from here a signal saves first
  return Run(task, workdir, mesh, compiled, state, start, mngr, log, train_iter, state_shardings, info,
             signature(config_dict, cfg), peak_memory, num_params, requested)


def actions(run: Run) -> list:
  """What follows each step, in order. A new action (say, LAuReL's α per layer to a file of its own) goes here."""
  return [Logging(run), Eval(run), Checkpointing(), Progress(run.log.writer, run.config.log_every, run.config.steps),
          Profiler(run.workdir / 'profile', run.config.profile_steps), Watchdog(run)]


def loop(run: Run, after_each_step: list) -> dict:
  """Steps from run.start to config.steps, each followed by every action; what final.json holds, or {'step',
  'preempted'} where a signal or a preemption stopped it (its checkpoint saved)."""
  cfg = run.config
  for done in range(run.start + 1, cfg.steps + 1):
    run.state, metrics = run.step(run.state, sharding.global_batch(next(run.train_iter), run.mesh))
    # One process: a signal; several: orbax's preemption sync point (JAX's service), where every host agrees.
    run.stopping = bool(run.requested) or run.mngr.reached_preemption(done)
    for action in after_each_step:
      action.after_step(run, done, metrics)
    if run.stopping:
      _finish_saves(run)
      print(f'{process.stop_reason(run.requested)}: saved checkpoint {done} in {run.workdir}; rerun the same command '
            'to resume', flush=True)
      return {'step': done, 'preempted': True}
  evaluation = next(a for a in after_each_step if isinstance(a, Eval))
  if evaluation.metrics is None:  # resumed at the last step: nothing trained, but final.json needs the eval
    evaluation.after_step(run, cfg.steps, None)
  _finish_saves(run)
  if not evaluation.metrics:  # a signal cut it
    print(f'{process.stop_reason(run.requested)}: checkpoint {cfg.steps} in {run.workdir} is not evaluated yet; '
          'rerun the same command', flush=True)
    return {'step': cfg.steps, 'preempted': True}
  final = {'step': cfg.steps, **evaluation.metrics, 'held_out': evaluation.noise, 'params': run.num_params,
           'peak_memory_bytes': run.peak_memory, **median_step_time(run.log.step_times()), **run.info,
           'finished_at': utc()}
  run.log.writer.write_summary(final)
  return final


def _finish_saves(run: Run) -> None:
  """Waits for the save in flight; SaveFailed where it or another failed."""
  with _save_failure(run):
    run.mngr.wait_until_finished()


@contextlib.contextmanager
def _save_failure(run: Run):
  """orbax's error of a failed save as SaveFailed, one line naming the cause and the last good checkpoint."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  # whatever orbax raised from its background save
    if (cause := checkpoint.io_cause(e)) is None:
      raise
    run.mngr.failed = e
    with contextlib.suppress(Exception):  # the failed save's threads end (each that waits may raise its error)
      run.mngr.wait_until_finished()
    run.mngr.reload()  # the steps on disk, not orbax's list of those it started
    failed = next((s for s in run.mngr.saving if s not in run.mngr.all_steps()), '?')
    raise SaveFailed(f'checkpoint {failed} could not be saved ({cause}); {run.last_good()}') from None


class Logging:
  """Every `log_every` steps, at the last and where the run stops: the means of the interval's metrics, the residual
  design's own diagnostics (LAuReL's α, β, ...: read from the parameters here, outside the step), step time,
  throughput and MFU, to metrics.jsonl, the writers and the console. A loss that is not finite stops the run."""

  def __init__(self, run: Run):
    cfg, self.interval, self.since = run.config, [], (time.perf_counter(), run.start, 0.0)
    self.report = jax.jit(run.task.design_report, out_shardings=jax.sharding.NamedSharding(run.mesh, jax.P()))
    self.device = run.mesh.local_devices[0]  # the run's: train() may run on some of the host's devices
    self.peak_flops = hardware.PEAK_FLOPS.get(self.device.device_kind, 0) * run.mesh.size
    # 0 where the backend counts no FLOPs (a ResNet under the CUDA and TPU plug-ins): no MFU.
    self.model_flops = run.task.model_flops(cfg.batch_size) if self.peak_flops else 0

  def after_step(self, run: Run, step: int, metrics: dict):
    cfg, task = run.config, run.task
    self.interval.append(metrics)  # on the device until logged
    if step % cfg.log_every and step != cfg.steps and not run.stopping:
      return
    rows, self.interval = jax.device_get(self.interval), []
    for i, row in enumerate(rows):
      if not math.isfinite(loss := float(row['loss'])):
        raise TrainingDiverged(f'loss is {loss} at step {step - len(rows) + 1 + i}; {run.last_good()}')
    t0, first, paused = self.since
    dt = (time.perf_counter() - t0 - (run.paused_s - paused)) / (step - first)  # steps only: no eval, no save
    row = {**interval_mean(rows), **task.design_metrics(jax.device_get(self.report(run.state.params))),
           'step_time_s': dt, f'{task.unit}_per_s': cfg.batch_size * task.units_per_example() / dt,
           'peak_memory_bytes': run.peak_memory, 'params': run.num_params}
    if self.model_flops > 0:
      row['mfu'] = hardware.utilisation(self.model_flops, dt, self.peak_flops)
    if 'peak_bytes_in_use' in (stats := self.device.memory_stats() or {}):
      row['device_peak_bytes'] = stats['peak_bytes_in_use']
    run.log.write(step, row)
    print(console.step_line(step, cfg.steps, row, task.unit), flush=True)
    self.since = (time.perf_counter(), step, run.paused_s)


class Eval:
  """Every `eval_every` steps and at the last: the eval metrics, weighted means over `eval_steps` batches, logged and
  printed; `noise`, final.json's held_out (the eval set's size and eval_loss's standard error over its batches).
  With one process a signal cuts it after the batch in flight (metrics {}); several finish it together (each batch
  is a collective step)."""

  def __init__(self, run: Run):
    self.metrics, self.noise, task = None, {}, run.task
    self.step = jax.jit(lambda s, b: task.loss(s.params, s.model_state, b, False)[1][0],
                        in_shardings=(run.state_shardings, sharding.batch_sharding(run.mesh)))

  def after_step(self, run: Run, step: int, metrics: dict | None):
    cfg = run.config
    if step % cfg.eval_every and step != cfg.steps:
      return
    it, totals, loss_batches = iter(local_dataset(run.task, train=False)), {}, []
    with run.paused(), console.phase(f'evaluating on {cfg.eval_steps} batches') as phase:
      for _ in range(cfg.eval_steps):
        if run.requested and jax.process_count() == 1:
          phase.cut(signal.Signals(run.requested[0]).name)  # its line must not say done
          self.metrics, run.stopping = {}, True  # this step's checkpoint, then exit; a rerun evaluates it
          return
        batch_metrics = jax.device_get(self.step(run.state, sharding.global_batch(next(it), run.mesh)))
        for name, sum_and_weight in batch_metrics.items():
          totals[name] = totals.get(name, 0.0) + np.asarray(sum_and_weight, np.float64)
        loss_batches.append(batch_metrics['loss'])
        for beat in run.progress:
          beat()
    self.noise = {'loss_se': weighted_mean_se(*zip(*loss_batches)), 'batches': len(loss_batches),
                  run.task.unit: int(totals['loss'][1])}
    self.metrics = {f'eval_{k}': float(s / max(w, 1.0)) for k, (s, w) in totals.items()}
    run.log.write(step, self.metrics)
    print(console.eval_line(step, cfg.steps, self.metrics), flush=True)


class Checkpointing:
  """Saves where orbax's policies say (laurel.run.checkpoint.manager) or where the run stops (one process has no JAX
  preemption service: a signal), a finite state only; stops the run at the first step after a save failed (once
  orbax's saving ends): steps trained past it would be lost on a rerun."""

  def after_step(self, run: Run, step: int, metrics: dict):
    with _save_failure(run):
      # A failed save raises here once orbax's finalize thread has taken its error. Taking it first (its error check)
      # would leave that thread to finish the save as good: its preservation policy would delete a good checkpoint.
      if not run.mngr.is_saving_in_progress():
        run.mngr.wait_until_finished()
      if not (run.stopping or run.mngr.should_save(step)):
        return
      if not checkpoint.is_finite(run.state):  # only a finite state is a checkpoint
        raise TrainingDiverged(f'the state (parameters or optimizer state) is not finite (loss '
                               f'{float(metrics["loss"]):.4f}) at step {step}; not saved; {run.last_good()}')
      with run.paused():
        checkpoint.save(run.mngr, step, run.state, run.train_iter, run.signature)


class Progress:
  """steps_per_sec and uptime every `every` steps and at the last, as clu's ReportProgress wrote them."""

  def __init__(self, writer, every: int, total: int):
    self.writer, self.every, self.total = writer, every, total
    self.t0, self.last = time.monotonic(), None

  def after_step(self, run, step: int, metrics):
    del run, metrics
    now = time.monotonic()
    if self.last is None:
      self.last = (step, now)
    elif step != self.last[0] and (step % self.every == 0 or step == self.total):
      self.writer.write_scalars(step, {'steps_per_sec': (step - self.last[0]) / (now - self.last[1]),
                                       'uptime': now - self.t0})
      self.last = (step, now)


class Profiler:
  """A jax.profiler trace into `logdir` of the steps numbered start + 1 to stop, as clu's Profile took them."""

  def __init__(self, logdir, profile_steps: tuple):
    self.logdir, (self.start, self.stop) = os.fspath(logdir), profile_steps or (None, None)
    self.running = False

  def after_step(self, run, step: int, metrics):
    del run, metrics
    if step == self.start and not self.running:
      jax.profiler.start_trace(self.logdir)
      self.running = True
    elif self.running and step >= self.stop:
      self.close()

  def close(self):
    if self.running:
      self.running = False
      jax.profiler.stop_trace()


class Watchdog:
  """faulthandler's watchdog, re-armed at every step and eval batch: where none finishes within the limit, every
  thread's stack goes to stderr and the process exits with status 1, for a supervisor to restart it from its last
  checkpoint (a collective one host never entered would hang forever). The limit: `watchdog_s`, and once three steps
  have run max(`watchdog_factor` × the median step time, `watchdog_min_s`); 0 turns either off."""
  WARMUP = 3

  def __init__(self, run: Run):
    self.config, self.times, self.last = run.config, collections.deque(maxlen=200), time.monotonic()
    run.progress.append(self.beat)
    self._arm()

  def after_step(self, run, step: int, metrics):
    del run, step, metrics
    self.beat(stepped=True)

  def beat(self, stepped: bool = False):
    now = time.monotonic()
    if stepped:
      self.times.append(now - self.last)
    self.last = now
    self._arm()

  def _arm(self):
    cfg = self.config
    limits = [cfg.watchdog_s] if cfg.watchdog_s else []
    if cfg.watchdog_factor and len(self.times) > self.WARMUP:
      limits.append(max(cfg.watchdog_factor * statistics.median(list(self.times)[self.WARMUP:]), cfg.watchdog_min_s))
    if limits:
      faulthandler.dump_traceback_later(min(limits), exit=True, file=sys.__stderr__)

  def close(self):
    faulthandler.cancel_dump_traceback_later()
