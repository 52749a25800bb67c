"""The train loop shared by every task (laurel.tasks): sharded jit step, orbax checkpoints, metrics.

  state   = TrainState(step, params, opt_state, model_state), sharded by the logical-axis rules
  step    = jax.jit(train_step, in/out shardings, donated state), compiled ahead of time
  resume  = latest readable checkpoint in WORKDIR/checkpoints (model state + grain iterator state)
  outputs = WORKDIR/metrics.jsonl, WORKDIR/tensorboard/, WORKDIR/final.json
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any

import flax
import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from laurel import config_lib, sharding, tasks

# Dense bf16 peak FLOP/s per chip, for MFU; devices not listed report no MFU (e.g. CPU).
PEAK_FLOPS = {'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12, 'TPU v5p': 459e12, 'TPU v5': 459e12,
              'TPU v6 lite': 918e12, 'TPU v6e': 918e12, 'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H200': 989e12,
              'NVIDIA A100-SXM4-80GB': 312e12, 'NVIDIA A100-SXM4-40GB': 312e12}
NO_DECAY = ('scale', 'bias', 'rw_w', 'pa_gamma')  # norms, biases and LAuReL scalars


class TrainingDiverged(RuntimeError):
  pass


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any  # non-trained variables, e.g. BatchNorm statistics; {} for the LM


def validate_config(config, num_devices: int | None = None, process_count: int | None = None):
  """Every check that needs no tracing; returns the task. Errors are one line naming field and value."""
  def need(ok, field, why):
    if not ok:
      raise ValueError(f'{field}={_get(config, field)!r}: {why}')

  for field in ('steps', 'batch_size', 'log_every', 'eval_every', 'eval_steps', 'checkpoint_every',
                'keep_checkpoints', 'optimizer.grad_accum_steps'):
    value = _get(config, field)
    need(config_lib.is_int(value) and value >= 1, field, 'must be a positive integer')
  o = config.optimizer
  for field in ('learning_rate', 'warmup_steps', 'min_lr_ratio', 'weight_decay', 'grad_clip'):
    need(config_lib.is_number(o[field]), f'optimizer.{field}', 'must be a number')
  need(o.learning_rate > 0, 'optimizer.learning_rate', 'must be positive')
  need(0 <= o.warmup_steps, 'optimizer.warmup_steps', 'must be >= 0')
  need(0 <= o.min_lr_ratio <= 1, 'optimizer.min_lr_ratio', 'must be in [0, 1]')
  need(o.weight_decay >= 0, 'optimizer.weight_decay', 'must be >= 0')
  need(o.grad_clip > 0, 'optimizer.grad_clip', 'must be positive')
  task = tasks.get_task(config)
  task.validate()
  num_devices = jax.device_count() if num_devices is None else num_devices
  process_count = jax.process_count() if process_count is None else process_count
  data, fsdp, _ = sharding.mesh_shape(config.mesh, num_devices)
  micro = config.batch_size // o.grad_accum_steps
  need(config.batch_size % o.grad_accum_steps == 0, 'batch_size',
       f'must be divisible by optimizer.grad_accum_steps={o.grad_accum_steps}')
  need(micro % (data * fsdp) == 0, 'batch_size',
       f'each micro-batch ({micro}) must divide over the data-parallel size data*fsdp={data * fsdp}')
  need(config.batch_size % process_count == 0, 'batch_size', f'must divide over {process_count} processes')
  need(config_lib.is_int(config.data_shards) and config.data_shards >= 0 and config.data_shards % process_count == 0,
       'data_shards', f'must be 0 (one per process) or a multiple of the {process_count} processes')
  need(config.batch_size % max(config.data_shards, 1) == 0, 'batch_size',
       f'must divide over data_shards={config.data_shards}')
  return task


class ShardedBatches(grain.IterDataset):
  """Batches made of several independent input shards, concatenated along the batch axis.

  Shard s of `num_shards` belongs to process s % process_count, so the global batch (all processes'
  rows in process order) is the same whatever the number of processes: config.data_shards fixes it.
  """

  def __init__(self, shards):
    super().__init__(shards)

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


def local_dataset(task, config, *, train: bool):
  nproc, pid = jax.process_count(), jax.process_index()
  num_shards = config.data_shards or nproc
  mine = range(pid, num_shards, nproc)
  return ShardedBatches([task.dataset(train=train, batch_size=config.batch_size // num_shards, seed=config.seed,
                                      process_index=s, process_count=num_shards) for s in mine])


def _get(config, dotted):
  for part in dotted.split('.'):
    config = config[part]
  return config


def make_optimizer(o, steps):
  schedule = optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, o.warmup_steps,
                                                max(steps, o.warmup_steps + 1), o.learning_rate * o.min_lr_ratio)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim >= 2 and path[-1].key not in NO_DECAY, params)
  tx = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                   optax.adamw(schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask))
  return tx, schedule


def make_train_step(task, tx, schedule, grad_accum_steps):
  grad_fn = jax.value_and_grad(task.loss, has_aux=True)

  def micro_step(params, model_state, batch):
    (_, (metrics, model_state)), grads = grad_fn(params, model_state, batch, True)
    return grads, metrics, model_state

  def train_step(state, batch):
    if grad_accum_steps == 1:
      grads, metrics, model_state = micro_step(state.params, state.model_state, batch)
    else:  # row i*k+j goes to micro-batch j, so each device's shard feeds every micro-batch equally
      k = grad_accum_steps
      micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)

      def body(carry, mb):  # grads weighted by each micro-batch's loss weight: exactly the full batch's mean
        g, m, ms = micro_step(state.params, carry[2], mb)
        g = jax.tree.map(lambda x: x * m['loss'][1], g)
        return (jax.tree.map(jnp.add, carry[0], g), jax.tree.map(jnp.add, carry[1], m), ms), None

      zeros = jax.eval_shape(micro_step, state.params, state.model_state, jax.tree.map(lambda x: x[0], micro))
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros[:2])
      (grads, metrics, model_state), _ = jax.lax.scan(body, (*zeros, state.model_state), micro)
      grads = jax.tree.map(lambda g: g / jnp.maximum(metrics['loss'][1], 1.0), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    out = {name: s / jnp.maximum(w, 1.0) for name, (s, w) in metrics.items()}
    out.update(grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step))
    return TrainState(state.step + 1, params, opt_state, model_state), out

  return train_step


class MetricsWriter:
  """metrics.jsonl (one object per logged step) and TensorBoard scalars; process 0 only."""

  def __init__(self, workdir: epath.Path, tensorboard: bool, resume_step: int):
    self.active = jax.process_index() == 0
    self.path = workdir / 'metrics.jsonl'
    self.tb = None
    if not self.active:
      return
    if self.path.exists():  # drop lines a killed run logged past the checkpoint we resume from
      kept = [l for l in self.path.read_text().splitlines() if l and json.loads(l)['step'] <= resume_step]
      self.path.write_text(''.join(l + '\n' for l in kept))
    if tensorboard:
      from tensorboard.summary.writer.event_file_writer import EventFileWriter
      self.tb = EventFileWriter(os.fspath(workdir / 'tensorboard'))

  def write(self, step: int, values: dict):
    if not self.active:
      return
    row = {'step': step, **{k: (float(v) if isinstance(v, (float, np.floating, jax.Array)) else v)
                            for k, v in values.items()}}
    with self.path.open('a') as f:
      f.write(json.dumps(row) + '\n')
    if self.tb:
      from tensorboard.compat.proto import event_pb2, summary_pb2
      scalars = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
                 if k != 'step' and isinstance(v, (int, float)) and math.isfinite(v)]
      self.tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=scalars)))
      self.tb.flush()

  def close(self):
    if self.tb:
      self.tb.close()


def _model_signature(config) -> dict:
  return json.loads(ml_collections.ConfigDict({'task': config.task, 'model': config.model}).to_json())


def _restore_latest(mngr, workdir, config, abstract_state, train_iter):
  """Latest readable checkpoint, or (None, 0). Unreadable ones are moved aside with a warning, never deleted;
  a checkpoint of a different model is an error, and nothing in the workdir is touched."""
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      saved = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    except Exception as e:  # pylint: disable=broad-except
      saved, error = None, e
    if saved is not None and saved != _model_signature(config):
      raise ValueError(f'--workdir={os.fspath(workdir)!r}: holds checkpoints of a different task/model '
                       f'(step {step}); use a new workdir or the original config')
    if saved is not None:
      try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(train_iter)))
        return restored['state'], step
      except Exception as e:  # pylint: disable=broad-except
        error = e
    aside = workdir / 'unreadable_checkpoints' / f'{step}.{int(time.time())}'
    logging.warning('checkpoint %d is unreadable (%s: %s); moving it to %s and trying the previous one',
                    step, type(error).__name__, str(error).splitlines()[0][:200], aside)
    print(f'warning: checkpoint {step} is unreadable; moved to {aside}', file=sys.stderr)
    if jax.process_index() == 0:
      aside.parent.mkdir(parents=True, exist_ok=True)
      shutil.move(os.fspath(epath.Path(mngr.directory) / str(step)), os.fspath(aside))
    mngr.reload()
  return None, 0


def peak_memory_bytes(compiled) -> int:
  """Peak bytes of the compiled step. XLA's CPU backend reports only the arguments as its peak, so take
  the larger of that and arguments + outputs + temporaries - aliased (donated) buffers."""
  m = compiled.memory_analysis()
  buffers = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return int(max(getattr(m, 'peak_memory_in_bytes', 0) or 0, buffers))


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else f'{seconds // 60}m{seconds % 60:02d}s'


def make_init_state(task, tx, example):
  def init_state(rng):
    variables = nn.unbox(task.init(rng, example))
    params = variables.pop('params')
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), dict(variables))
  return init_state


def step_flops(config) -> float:
  """FLOPs of one train step on the global batch: XLA's count of the step traced with the layers unrolled,
  since it counts a scanned body once. Lowered only, never compiled."""
  config = ml_collections.ConfigDict(config.to_dict())
  if 'scan_layers' in config.model:
    config.model.scan_layers = False
  task = tasks.get_task(config)
  tx, schedule = make_optimizer(config.optimizer, config.steps)
  example = task.example_batch(config.batch_size)
  with nn.logical_axis_rules(config.logical_axis_rules):
    abstract = jax.eval_shape(make_init_state(task, tx, task.example_batch(1)), jax.random.key(0))
    step = make_train_step(task, tx, schedule, config.optimizer.grad_accum_steps)
    return xla_flops(jax.jit(step).lower(abstract, example))


def xla_flops(lowered_or_compiled) -> float:
  """XLA's FLOP count of a lowered or compiled computation (per device; a scanned body counted once)."""
  cost = lowered_or_compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float((cost or {}).get('flops', 0.0))


def compile_step(task, config, mesh):
  """Shardings, the ahead-of-time compiled train step and the state initialiser (nothing allocated yet)."""
  rules = config.logical_axis_rules
  tx, schedule = make_optimizer(config.optimizer, config.steps)
  example = task.example_batch(1)
  rng = jax.random.key(config.seed)
  var_shardings = sharding.logical_shardings(jax.eval_shape(task.init, rng, example), mesh, rules)

  init_state = make_init_state(task, tx, example)
  abstract = jax.eval_shape(init_state, rng)
  repl = sharding.replicated(mesh)
  opt_shardings = optax.tree_utils.tree_map_params(
      tx, lambda _, s: s, abstract.opt_state, var_shardings['params'], transform_non_params=lambda _: repl)
  state_shardings = TrainState(repl, var_shardings['params'], opt_shardings,
                               {k: v for k, v in var_shardings.items() if k != 'params'})
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings)
  batch_sh = sharding.batch_sharding(mesh)
  abstract_batch = {k: jax.ShapeDtypeStruct((config.batch_size, *v.shape[1:]), v.dtype, sharding=batch_sh)
                    for k, v in example.items()}
  step_fn = jax.jit(make_train_step(task, tx, schedule, config.optimizer.grad_accum_steps),
                    in_shardings=(state_shardings, batch_sh), out_shardings=(state_shardings, repl),
                    donate_argnums=0)
  compiled = step_fn.lower(abstract, abstract_batch).compile()
  # Initialisation runs once and its RNG code compiles slowly on CPU at full optimisation; values are the same.
  init = jax.jit(init_state, out_shardings=state_shardings,
                 compiler_options={'xla_backend_optimization_level': 0})
  return compiled, init, abstract, state_shardings


def compiled_peak_memory(config, devices=None) -> int:
  """Peak bytes of `config`'s train step, compiled on `devices` (default: one) and never run."""
  task = validate_config(config, num_devices=len(devices or [None]))
  mesh = sharding.make_mesh(config.mesh, devices or jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    return peak_memory_bytes(compile_step(task, config, mesh)[0])


def train(config, workdir: str, devices=None) -> dict:
  """Trains (or resumes) to config.steps; returns what it writes to WORKDIR/final.json."""
  devices = jax.devices() if devices is None else devices
  task = validate_config(config, num_devices=len(devices))
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh, devices)
  pid, nproc = jax.process_index(), jax.process_count()

  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    compiled, init_state, abstract_state, state_shardings = compile_step(task, config, mesh)
    eval_step = jax.jit(lambda s, b: task.loss(s.params, s.model_state, b, False)[1][0],
                        in_shardings=(state_shardings, sharding.batch_sharding(mesh)))
    train_iter = iter(local_dataset(task, config, train=True))
    mngr = ocp.CheckpointManager(workdir / 'checkpoints', options=ocp.CheckpointManagerOptions(
        max_to_keep=config.keep_checkpoints, create=True))
    state, start = _restore_latest(mngr, workdir, config, abstract_state, train_iter)
    if state is None:
      state = init_state(jax.random.key(config.seed))
    elif start >= config.steps and (workdir / 'final.json').exists():
      print(f'already finished: checkpoint {start} in {workdir}', flush=True)
      mngr.close()
      return json.loads((workdir / 'final.json').read_text())
    else:
      print(f'resumed from checkpoint {start} in {workdir}', flush=True)

    num_params = sum(x.size for x in jax.tree.leaves(abstract_state.params))
    peak_memory = peak_memory_bytes(compiled)
    peak_flops = PEAK_FLOPS.get(jax.devices()[0].device_kind)
    flops_per_step = step_flops(config) if peak_flops else 0.0  # MFU only where the chip's peak is known
    units_per_step = config.batch_size * task.units_per_example()
    writer = MetricsWriter(workdir, config.tensorboard and pid == 0, start)
    if pid == 0:
      (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2))
    print(f'{num_params:,} params | {jax.device_count()} devices, mesh {dict(mesh.shape)} | '
          f'peak memory of the compiled step {peak_memory / 2**20:,.1f} MiB', flush=True)

    def evaluate():
      it = iter(local_dataset(task, config, train=False))
      totals = {}
      for _ in range(config.eval_steps):
        for name, (s, w) in jax.device_get(eval_step(state, sharding.global_batch(next(it), mesh))).items():
          ts, tw = totals.get(name, (0.0, 0.0))
          totals[name] = (ts + float(s), tw + float(w))
      return {f'eval_{k}': s / max(w, 1.0) for k, (s, w) in totals.items()}

    def check_finite(step, metrics):
      loss = float(metrics['loss'])
      if not math.isfinite(loss):
        raise TrainingDiverged(f'loss is {loss} at step {step}; last good checkpoint: '
                               f'{mngr.latest_step() if mngr.latest_step() is not None else "none"} in '
                               f'{os.fspath(workdir / "checkpoints")}')

    def save(step):
      mngr.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train_iter),
          config=ocp.args.JsonSave(_model_signature(config))))

    # One process: our own SIGTERM flag. Several: only orbax's reached_preemption, which every host agrees on
    # (JAX's preemption service catches the signal), so no host starts a collective save alone.
    preempted = []
    previous = signal.signal(signal.SIGTERM, lambda *_: preempted.append(True)) if nproc == 1 else None
    eval_metrics, pending, step_times = {}, None, []
    t0, interval_start = time.time(), start
    try:
      for step in range(start, config.steps):
        batch = sharding.global_batch(next(train_iter), mesh)
        state, metrics = compiled(state, batch)
        if pending is not None:  # one step behind, so the host never waits on the step in flight
          check_finite(*pending)
        pending, done = (step + 1, metrics), step + 1
        last = done == config.steps
        stop = mngr.reached_preemption(done) if nproc > 1 else bool(preempted)
        if done % config.log_every == 0 or last or stop:
          check_finite(*pending)
          dt = (time.time() - t0) / (done - interval_start)
          step_times.append(dt)
          row = {k: float(v) for k, v in jax.device_get(metrics).items()}
          row.update(step_time_s=dt, **{f'{task.unit}_per_s': units_per_step / dt},
                     peak_memory_bytes=peak_memory, params=num_params)
          if peak_flops and flops_per_step:
            row['mfu'] = flops_per_step / dt / (peak_flops * jax.device_count())
          stats = jax.local_devices()[0].memory_stats()
          if stats and 'peak_bytes_in_use' in stats:
            row['device_peak_bytes'] = stats['peak_bytes_in_use']
          writer.write(done, row)
          if pid == 0:
            print(f'step {done}/{config.steps} | loss {row["loss"]:.4f} | lr {row["learning_rate"]:.2e} | '
                  f'{units_per_step / dt:,.0f} {task.unit}/s | {dt:.3f} s/step | '
                  f'ETA {_format_eta(dt * (config.steps - done))}', flush=True)
        if done % config.eval_every == 0 or last:
          eval_metrics = evaluate()
          writer.write(done, eval_metrics)
          if pid == 0:
            print(f'step {done} | ' + ' | '.join(f'{k} {v:.4f}' for k, v in eval_metrics.items()), flush=True)
        if done % config.checkpoint_every == 0 or last or stop:
          check_finite(*pending)
          save(done)
        if done % config.log_every == 0 or done % config.eval_every == 0 or done % config.checkpoint_every == 0:
          t0, interval_start = time.time(), done
        if stop:
          mngr.wait_until_finished()
          print(f'preempted: saved checkpoint {done} in {workdir}; rerun the same command to resume', flush=True)
          return {'step': done, 'preempted': True}
      if not eval_metrics:  # resumed at the last step: nothing trained, but final.json needs the eval
        eval_metrics = evaluate()
      mngr.wait_until_finished()
    finally:
      if previous is not None:
        signal.signal(signal.SIGTERM, previous)
      writer.close()
      mngr.close()

  final = {'step': config.steps, **eval_metrics, 'params': num_params, 'peak_memory_bytes': peak_memory,
           'avg_step_time_s': float(np.median(step_times)) if step_times else None}
  if pid == 0:
    (workdir / 'final.json').write_text(json.dumps(final, indent=2) + '\n')
  return final
