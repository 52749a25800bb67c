"""What a step and a run cost: a train step's FLOPs and bytes as XLA counts them (step_costs, step_flops), and a
run's cost as the pre-flight states it, from the TPU compiler's estimate of the step (laurel.plan.schedule) or an
assumed MFU (--mfu, a flag of laurel.main and scripts/launch_tpu.py)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import flags

from laurel import cross_entropy, sharding
from laurel.config_lib import DTYPES, InputError
from laurel.cli.console import duration
from laurel.plan.hardware import xla_costs
from laurel.step import make_train_fns

MFU_HELP = ("With --compile_only (and the launcher's pre-flight): the model FLOPs utilisation, in (0, 1], that the "
            "cost estimate assumes. Default: the step time the TPU compiler's schedule estimates.")
_MFU = flags.DEFINE_float('mfu', None, MFU_HELP)


def mfu_flag() -> float | None:
  """--mfu, checked: a one-line InputError unless it is in (0, 1]."""
  return checked_mfu(_MFU.value if flags.FLAGS.is_parsed() else None)


def checked_mfu(mfu: float | None) -> float | None:
  """A one-line InputError unless `mfu` is None or in (0, 1]."""
  if mfu is not None and not 0 < mfu <= 1:
    raise InputError(f'mfu={mfu}: must be a fraction in (0, 1], e.g. 0.4 for 40% of the chips\' peak FLOP/s')
  return mfu


def estimate(*, model_flops: float, units_per_step: int, steps: int, chips: int, peak_flops: float,
             mfu: float | None = None, cycles: float | None = None, clock_hz: float | None = None) -> dict:
  """Training steps only: each takes model_flops / (chips · peak_flops · mfu), else the compiler's estimated `cycles`
  per chip at `clock_hz` (the MFU implied)."""
  step_s = model_flops / (chips * peak_flops * mfu) if mfu is not None else cycles / clock_hz
  wall_s = steps * step_s
  return {'units_per_step': units_per_step, 'step_s': step_s, 'steps': steps, 'wall_s': wall_s,
          'chip_hours': chips * wall_s / 3600, 'chips': chips, 'basis': 'mfu' if mfu is not None else 'schedule',
          'mfu': mfu or model_flops / (chips * peak_flops * step_s), 'cycles': cycles, 'clock_hz': clock_hz}


def line(est: dict, unit: str) -> str:
  """`cost: 524,288 tokens per step; 0.167 s per step (3.14M tokens/s), 19,073 steps in 53m on 16 chips: 14.2
  chip-hours (...)`."""
  basis = (f"an MFU of {100 * est['mfu']:.3g}% (--mfu)" if est['basis'] == 'mfu' else
           f"the TPU compiler's schedule, {est['cycles'] / 1e6:,.1f}M cycles per chip at {est['clock_hz'] / 1e9:.2f} "
           f"GHz: an MFU of {100 * est['mfu']:.3g}%; --mfu=F assumes a measured one")
  per_s = est['units_per_step'] / est['step_s']
  return (f"cost: {est['units_per_step']:,} {unit} per step; {est['step_s']:.3g} s per step ({per_s:,.0f} {unit}/s), "
          f"{est['steps']:,} steps in {duration(est['wall_s'])} on {est['chips']} chip{'s' * (est['chips'] > 1)}: "
          f"{est['chip_hours']:.3g} chip-hours (estimated from {basis}; training steps only: not compiling, "
          'evaluation or checkpoints)')


def step_costs(task, costs_of, mesh=None, lowered_costs=None) -> tuple[float, float]:
  """(FLOPs, bytes accessed) of one train step of `task`, from `costs_of(t)`, XLA's costs of the step of a task t
  (per device of `mesh`). XLA counts a loop's body once, so: one micro-batch per step; a scanned layer stack at
  scan_unroll 1 and 2, the difference added for every further layer (odd: all unrolled); the loss's chunks after the
  first compiled alone, their costs by `lowered_costs(lowered)` where given (laurel.plan.aot keeps them)."""
  task = _with(task, scan_unroll=1)
  totals = costs_of(task)
  if not any(totals):  # the backend gives no count (a lowered step under the CUDA and TPU plug-ins): nor do we
    return 0.0, 0.0
  layers = getattr(task.model_cfg, 'num_layers', 1)
  if getattr(task.model_cfg, 'scan_layers', False) and layers > 1:
    if layers % 2:  # one iteration of every layer
      totals = costs_of(_with(task, scan_unroll=layers))
    else:
      twice = costs_of(_with(task, scan_unroll=2))
      totals = [c + (layers - 1) * (c2 - c) for c, c2 in zip(totals, twice)]
  if task.config.task == 'lm':
    totals = [c + extra for c, extra in zip(totals, _uncounted_loss_chunks(task.config, mesh, lowered_costs))]
  return tuple(totals)


def _with(task, scan_unroll: int):
  """The task with one micro-batch per step and its layer scan (if any) unrolled `scan_unroll` times."""
  config, model = task.config, task.model_cfg
  if hasattr(model, 'scan_unroll'):
    model = dataclasses.replace(model, scan_unroll=scan_unroll)
  return type(task)(dataclasses.replace(config, model=model,
                                        optimizer=dataclasses.replace(config.optimizer, grad_accum_steps=1)))


def _uncounted_loss_chunks(config, mesh, lowered_costs=None) -> tuple[float, float]:
  """(FLOPs, bytes) of the loss's chunks after the first, from one chunk compiled alone (`mesh` None: one device)."""
  model = config.model
  chunk = min(model.loss_chunk or config.data.seq_len, config.data.seq_len)
  chunks = -(-config.data.seq_len // chunk)
  if chunks == 1:
    return 0.0, 0.0
  dtype = DTYPES[model.dtype]
  batch = None if mesh is None else sharding.batch_sharding(mesh)
  kernel = jax.ShapeDtypeStruct((model.vocab_size, model.d_model), DTYPES[model.param_dtype],
                                sharding=None if mesh is None else jax.sharding.NamedSharding(mesh, jax.P()))
  shape = lambda *tail, dtype: jax.ShapeDtypeStruct((config.batch_size, chunk, *tail), dtype, sharding=batch)
  grads = jax.grad(lambda x, w, t, m: cross_entropy.chunked(x, w, 'vd', t, m, chunk, dtype)[0], (0, 1))
  lowered = jax.jit(grads).lower(shape(model.d_model, dtype=dtype), kernel, shape(dtype=jnp.int32),
                                 shape(dtype=jnp.float32))
  one = (lowered_costs or (lambda l: xla_costs(l.compile())))(lowered)
  return tuple((chunks - 1) * c for c in one)


def step_flops(task) -> float:
  """FLOPs of one train step on the global batch, lowered for one device."""
  def lowered_costs(t):
    with nn.logical_axis_rules(t.config.logical_axis_rules):
      _, init_state, train_step = make_train_fns(t)
      abstract = jax.eval_shape(init_state, jax.random.key(0))
      return xla_costs(jax.jit(train_step).lower(abstract, t.example_batch(t.config.batch_size)))
  return step_costs(task, lowered_costs)[0]
