"""What a checkpoint's content checksums (laurel.run.checksums) add to its save: the seconds of a save of the full
train state (laurel.run.checkpoint.save until every file is written) and of recording its checksums, at each --preset
of a c4_ablation row (its initial state), on the devices here. The train loop records them in a thread while it
goes on training, so this is their work, not a wait of the loop's.

  python scripts/experiments/benchmark_checksums.py --presets=tiny,paper --saves=3 [--out=results/checksums_cpu.json]
"""

import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # scripts/: common
import common  # noqa: E402  # puts the repo root on sys.path
import flax.linen as nn
import jax
from absl import app, flags
from etils import epath

from laurel import config_lib, step, train
from laurel.run import checkpoint, checksums

_ROW = flags.DEFINE_string('row', 'rw_lr', 'The c4_ablation row.')
_PRESETS = flags.DEFINE_list('presets', ['tiny', 'paper'], 'Presets of the row to measure.')
_SAVES = flags.DEFINE_integer('saves', 3, 'Saves per preset (the median is reported).')
_OUT = flags.DEFINE_string('out', None, 'A JSON file for the figures.')


def measure(preset: str, saves: int) -> dict:
  # Synthetic data: the state's shapes are the preset's; no corpus needed.
  config = config_lib.load(f'c4_ablation:{_ROW.value},preset={preset}', ['data.name=synthetic', 'data.prefetch=0'])
  task = step.validate_config(config)
  with nn.logical_axis_rules(task.config.logical_axis_rules):
    _, init_state, _ = step.make_train_fns(task)
    init = jax.jit(init_state, compiler_options={'xla_backend_optimization_level': 0})
    state = jax.block_until_ready(init(jax.random.key(0)))
  train_iter = iter(train.local_dataset(task, train=True))
  save_s, checksum_s = [], []
  with tempfile.TemporaryDirectory(dir=os.environ.get('TMPDIR')) as folder:
    mngr = checkpoint.manager(epath.Path(folder), keep=2)
    for number in range(1, saves + 1):
      start = time.perf_counter()
      checkpoint.save(mngr, number, state, train_iter, task.config)
      mngr.wait_until_finished()
      save_s.append(time.perf_counter() - start)
      start = time.perf_counter()
      checkpoint.finish(mngr)  # the save is done: this waits for its checksum list, begun as the save completed
      checksum_s.append(time.perf_counter() - start)
    size = sum(p.stat().length for p in checksums._own_files(  # pylint: disable=protected-access
        epath.Path(folder) / 'checkpoints' / str(saves), 0, 1))
    mngr.close()
  save, checksum = statistics.median(save_s), statistics.median(checksum_s)
  return {'preset': preset, 'params': task.num_params(state.params), 'state_file_bytes': size,
          'save_s': save, 'checksum_s': checksum, 'checksum_fraction': checksum / save, 'saves_s': save_s,
          'checksums_s': checksum_s}


def main():
  rows = [measure(preset, _SAVES.value) for preset in _PRESETS.value]
  device = f'{jax.devices()[0].device_kind} x{jax.device_count()} ({jax.devices()[0].platform})'
  for r in rows:
    print(f'{r["preset"]}: {r["params"]:,} params, {r["state_file_bytes"] / 2**20:,.1f} MiB of state files: save '
          f'{r["save_s"]:.2f} s, checksums {r["checksum_s"]:.3f} s ({100 * r["checksum_fraction"]:.1f}% of the save; '
          f'median of {_SAVES.value}) on {device}', flush=True)
  if _OUT.value:
    common.write_json(_OUT.value, {'command': common.command(), 'device': device, 'rows': rows})


if __name__ == '__main__':
  app.run(common.main(main))
