"""What a run will cost, as the pre-flight states it: from the step's model FLOPs and either an assumed MFU (--mfu, a
flag of laurel.main and scripts/launch_tpu.py) or the TPU compiler's roofline step time."""

from absl import flags

from laurel.config_lib import InputError
from laurel.run.console import duration

_MFU = flags.DEFINE_float(
    'mfu', None, 'With --compile_only (and the launcher\'s pre-flight): the model FLOPs utilisation, in (0, 1], '
    "that the cost estimate assumes. Default: the TPU compiler's roofline step time (a lower bound).")


def mfu_flag() -> float | None:
  """--mfu, checked: a one-line InputError unless it is in (0, 1]."""
  mfu = _MFU.value if flags.FLAGS.is_parsed() else None
  if mfu is not None and not 0 < mfu <= 1:
    raise InputError(f'mfu={mfu}: must be a fraction in (0, 1], e.g. 0.4 for 40% of the chips\' peak FLOP/s')
  return mfu


def estimate(*, model_flops: float, units_per_step: int, steps: int, chips: int, peak_flops: float,
             mfu: float | None = None, roofline_s: float | None = None) -> dict:
  """Training steps only: each takes model_flops / (chips · peak_flops · mfu), else `roofline_s` (the MFU implied)."""
  step_s = model_flops / (chips * peak_flops * mfu) if mfu is not None else roofline_s
  wall_s = steps * step_s
  return {'units_per_step': units_per_step, 'step_s': step_s, 'steps': steps, 'wall_s': wall_s,
          'chip_hours': chips * wall_s / 3600, 'chips': chips, 'basis': 'mfu' if mfu is not None else 'roofline',
          'mfu': mfu or model_flops / (chips * peak_flops * step_s)}


def line(est: dict, unit: str) -> str:
  """`cost: 524,288 tokens per step; 0.812 s per step, 500 steps in 6m46s on 16 chips: 1.80 chip-hours (...)`."""
  basis = (f"an MFU of {100 * est['mfu']:.3g}% (--mfu)" if est['basis'] == 'mfu' else
           "the TPU compiler's roofline, max(FLOPs / peak FLOP/s, bytes accessed / HBM bandwidth) per chip: a "
           f"lower bound, as an MFU of {100 * est['mfu']:.3g}%; --mfu=F assumes a measured one")
  return (f"cost: {est['units_per_step']:,} {unit} per step; {est['step_s']:.3g} s per step, {est['steps']:,} steps "
          f"in {duration(est['wall_s'])} on {est['chips']} chip{'s' * (est['chips'] > 1)}: "
          f"{est['chip_hours']:.3g} chip-hours (estimated from {basis}; training steps only: not compiling, "
          'evaluation or checkpoints)')
