"""The train loop of every task (laurel.tasks): resumes from WORKDIR/checkpoints, trains, evaluates and saves, and
writes metrics.jsonl, tensorboard/ and final.json. What runs it but is not the loop (the lease, checkpoints, the
watchdog, signals, the metrics log) is in laurel.run."""

import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import time

import flax.linen as nn
import grain
import jax
import numpy as np
from etils import epath

from laurel import sharding
from laurel.config_lib import InputError, to_dict
from laurel.run import checkpoint, checksums, console, lease, metric_writers, process
from laurel.plan import hardware
from laurel.run.checkpoint import run_dir
from laurel.run.files import remove_temporaries, utc, write_text_atomic
from laurel.run.metrics_log import MetricsLog, code_commit, config_line, interval_mean, median_step_time, summary
from laurel.run.preflight import check_fits_host, check_inputs
from laurel.run.stats import weighted_mean_se
from laurel.step import compile_step, num_data_shards, validate_config


class TrainingDiverged(RuntimeError):
  """The loss, or a state about to be saved, is not finite."""
  exit_status = process.DIVERGED


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


def train(config, workdir: str, devices=None, allow_config_change: bool = False, allow_fresh_start: bool = False,
          hold_lease: bool = False) -> dict:
  """Trains (or resumes) to config.steps; returns what it writes to WORKDIR/final.json. `config` is typed
  (step.TrainConfig) or a ConfigDict, built here: the loop sees the typed one. Bad input is refused before
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
    return _train_checked(task, workdir, devices, allow_config_change, allow_fresh_start, started,
                          lease.fence(held, nproc))


RUN_FILES = (lease.NAME, 'config.json', 'config_history.jsonl', 'metrics.jsonl', 'final.json')


def _train_checked(task, workdir: epath.Path, devices, allow_config_change: bool, allow_fresh_start: bool,
                   started: float, fence=lease.fence(None)) -> dict:
  cfg = task.config
  check_fits_host(task)  # before anything is written or compiled: compiling alone can exhaust the host
  fence()  # each write of a run file or checkpoint is fenced: it stops where another run took the workdir over
  record_config = checkpoint.guard_config(cfg, workdir, allow_config_change)
  print(config_line(cfg, workdir), flush=True)
  canonical = json.dumps(to_dict(cfg), sort_keys=True)
  info = {'commit': code_commit(), 'config_hash': hashlib.sha256(canonical.encode()).hexdigest()[:16],
          'started_at': utc()}  # what identifies the run
  mesh, nproc = sharding.make_mesh(cfg.mesh, devices), jax.process_count()

  with jax.set_mesh(mesh), nn.logical_axis_rules(cfg.logical_axis_rules), contextlib.ExitStack() as cleanup:
    with console.phase(f'compiling the train step for {len(devices)} device{"s" * (len(devices) > 1)}'):
      compiled, init_state, abstract_state, state_shardings = compile_step(task, mesh)
    check_fits_host(task, compiled, len(devices))
    eval_step = jax.jit(lambda s, b: task.loss(s.params, s.model_state, b, False)[1][0],
                        in_shardings=(state_shardings, sharding.batch_sharding(mesh)))
    # The residual design's own diagnostics (LAuReL's α, β, γ, ...): read from the parameters on logging steps only,
    # outside the step; training metrics, never evaluated.
    design_report = jax.jit(task.design_report, out_shardings=jax.sharding.NamedSharding(mesh, jax.P()))
    train_iter = iter(local_dataset(task, train=True))
    mngr = checkpoint.manager(workdir, cfg.keep_checkpoints)
    cleanup.callback(checkpoint.close, mngr)
    with console.phase('restoring the latest checkpoint') if mngr.all_steps() else contextlib.nullcontext():
      state, start, moved_aside = checkpoint.restore_latest(mngr, workdir, cfg, abstract_state, train_iter,
                                                            allow_change=allow_config_change)
    if state is None and (quarantined := checkpoint.quarantined_steps(workdir)) and not allow_fresh_start:
      raise InputError(f'--workdir={os.fspath(workdir)!r}: no readable checkpoint: step'
                       f'{"s" * (len(quarantined) > 1)} {", ".join(map(str, quarantined))} moved to '
                       f'{workdir / "unreadable_checkpoints"}; pass --allow_fresh_start to train from step 0')
    checkpoint.check_room(mngr, workdir, abstract_state)  # a save would fail: stop before training
    with process.deferred():  # only now: a refused checkpoint leaves config.json and its history as they were
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
    peak_flops = hardware.PEAK_FLOPS.get(jax.devices()[0].device_kind, 0) * jax.device_count()
    # 0 where the backend counts no FLOPs (a ResNet under the CUDA and TPU plug-ins): no MFU.
    model_flops = task.model_flops(cfg.batch_size) if peak_flops else 0
    keep = 'moved_aside' in info or 'fresh_start_after' in info  # lines past `start` stay: the log says why
    with process.deferred():  # it rewrites metrics.jsonl
      log = MetricsLog(workdir, cfg, start, info, keep_later_steps=keep, fence=fence)
    cleanup.callback(log.writer.close)
    where = f'process {jax.process_index()} of {nproc} on host {socket.gethostname()}'
    watchdog = process.Watchdog(cfg.watchdog_factor, cfg.watchdog_min_s, cfg.watchdog_s, where, log.writer.flush)
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
    preempted = cleanup.enter_context(process.stop_requests(nproc))
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
        row.update(task.design_metrics(jax.device_get(design_report(state.params))))
        row.update(step_time_s=dt, **{f'{task.unit}_per_s': cfg.batch_size * task.units_per_example() / dt},
                   peak_memory_bytes=peak_memory, params=num_params,
                   **({'mfu': hardware.utilisation(model_flops, dt, peak_flops)} if model_flops > 0 else {}))
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
        checkpoint.save(mngr, done, state, train_iter, cfg)
      stop_if_a_save_failed()
      if done % cfg.log_every == 0 or done % cfg.eval_every == 0 or done % cfg.checkpoint_every == 0:
        t0, interval_start = time.time(), done  # steps only: not the logging, eval and saving
      watchdog.beat(done)
      if stop:
        stop_if_a_save_failed(wait=True)
        print(f'{process.stop_reason(preempted)}: saved checkpoint {done} in {workdir}; rerun the same command to '
              'resume', flush=True)
        return {'step': done, 'preempted': True}
    if not eval_metrics:  # resumed at the last step: nothing trained, but final.json needs the eval
      eval_metrics = evaluate_and_log(cfg.steps)
    stop_if_a_save_failed(wait=True)
    if eval_metrics is None:
      print(f'{process.stop_reason(preempted)}: checkpoint {cfg.steps} in {workdir} is not evaluated yet; rerun the '
            'same command', flush=True)
      return {'step': cfg.steps, 'preempted': True}
    final = {'step': cfg.steps, **eval_metrics, 'held_out': eval_noise, 'params': num_params,
             'peak_memory_bytes': peak_memory, **median_step_time(log.step_times()), **info, 'finished_at': utc()}
    log.writer.write_summary(final)

  if jax.process_index() == 0:
    with process.deferred():
      fence()
      write_text_atomic(workdir / 'final.json', json.dumps(final, indent=2) + '\n')
    print(summary(cfg, workdir, final, time.perf_counter() - started), flush=True)
  return final


