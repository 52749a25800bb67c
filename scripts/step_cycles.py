"""Where a train step's time goes by the TPU compiler's own schedule: one config compiled for a slice on this machine
(no TPU), its estimated cycles per chip by group and its most expensive instructions, a layer loop's per trip.

  python scripts/step_cycles.py --config=configs/c4_ablation.py:rw_lr_pa [--topology=v6e:4x4]
      [--top=30] [--save_text=step.hlo] [--config.model.remat=full ...]

Each instruction: cycles per step (per trip × trips), trips, result shape and layout, op_name. laurel.plan.schedule
counts; laurel.plan.aot compiles (libtpu).
"""

import sys

import cli  # puts the repo root on sys.path
from absl import app, flags
from ml_collections import config_flags

from laurel.plan import aot

_CONFIG = config_flags.DEFINE_config_file('config', None, 'A config file and its row, as laurel.main takes it.')
_TOPOLOGY = flags.DEFINE_string('topology', 'v6e:4x4', 'The slice to compile for.')
_TOP = flags.DEFINE_integer('top', 30, 'Instructions to list.')
_SAVE = flags.DEFINE_string('save_text', '', "Also write the compiled program's text here.")


def main():
  aot.compile_only_process()
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from laurel import sharding, step, train_config  # pylint: disable=import-outside-toplevel
  from laurel.plan import hardware, schedule  # pylint: disable=import-outside-toplevel
  config = train_config.build_config(_CONFIG.value)  # the data is not read: the step is only lowered
  accel = hardware.parse_accelerator(_TOPOLOGY.value, flag='--topology')
  chip, devices = hardware.TPUS[accel['generation']], aot.slice_devices(_TOPOLOGY.value)
  task = train_config.validate_config(config, len(devices), accel['hosts'])
  mesh = sharding.make_mesh(task.config.mesh, devices)
  with jax.set_mesh(mesh), nn.logical_axis_rules(task.config.logical_axis_rules):
    lowered = step.lower_step(task, mesh)[0]
    kernel_flops = task.unestimated_kernel_flops(task.config.batch_size // len(devices))
  text = lowered.compile().as_text()
  if _SAVE.value:
    with open(_SAVE.value, 'w', encoding='utf-8') as f:
      f.write(text)
  rate = aot.matmul_rate(devices)
  est = schedule.estimate(text, rate, chip.hbm_bytes_per_s / chip.clock_hz, kernel_flops)
  share = task.model_flops(task.config.batch_size) / len(devices) / est.cycles / rate
  print(f'{_TOPOLOGY.value}: {est.cycles / 1e6:,.1f}M cycles per chip and step ({est.cycles / chip.clock_hz:.4f} s at '
        f'{chip.clock_hz / 1e9:.2f} GHz; kernels {est.kernel_cycles / 1e6:,.1f}M), {100 * share:.1f}% of the '
        f"compiler's matmul rate ({rate:,.0f} FLOPs per cycle); {schedule.group_shares(est.groups, 9)}")
  ops, _ = schedule.executed_ops(text)
  _, comps = schedule.computations(text)
  shapes = {m.group(1): m.group(2) for lines in comps.values() for line in lines
            if (m := schedule._INSTRUCTION.match(line))}  # pylint: disable=protected-access
  costed = sorted((op for op in ops if op.cycles or op.kernel_flops), key=lambda op: -(op.cycles or 0) * op.trips)
  for op in costed[:_TOP.value]:
    print(f'{(op.cycles or 0) * op.trips / 1e6:8.2f}M x{op.trips:<3} {shapes.get(op.name, "")[:60]:60} '
          f'{op.group:15} {op.op_name[-90:]}')
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(cli.main(main))
