"""Peak memory of each Table 5 row's compiled train step, relative to Baseline-24 (compiles, never runs).

  python scripts/compiled_memory.py --layers=6 --batch_size=4 --seq_len=512 --remat=dots_no_batch

The Table 5 shape at a chosen depth and batch, float32: quick to compile on a CPU, and exact about what each
LAuReL variant adds to what autodiff keeps, since XLA's buffer assignment is the same computation a run uses.
"""

import json
import sys

import common  # puts the repo root on sys.path
from absl import app, flags

from laurel import train

ROWS = ('baseline_24', 'rw', 'lr', 'pa', 'rw_lr', 'rw_lr_pa')
_LAYERS = flags.DEFINE_integer('layers', 6, 'Layers of every row.')
_BATCH = flags.DEFINE_integer('batch_size', 4, 'Sequences per step.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 512, 'Tokens per sequence.')
_REMAT = flags.DEFINE_enum('remat', 'dots_no_batch', ['none', 'full', 'dots', 'dots_no_batch'], 'Remat policy.')


def peak_bytes(row: str) -> int:
  config = common.load_config(f'configs/c4_ablation.py:{row}')
  for field, value in (('model.num_layers', _LAYERS.value), ('batch_size', _BATCH.value),
                       ('data.seq_len', _SEQ_LEN.value), ('model.remat', _REMAT.value),
                       ('model.dtype', 'float32'), ('data.name', 'synthetic')):
    common.set_field(config, field, str(value))
  return train.compiled_peak_memory(config)


def main(argv):
  del argv
  peaks = {row: peak_bytes(row) for row in ROWS}
  rows = [{'name': r, 'peak_memory_bytes': b, 'peak_memory_ratio': round(b / peaks['baseline_24'], 4)}
          for r, b in peaks.items()]
  print(json.dumps({'command': ' '.join(['python'] + sys.argv), 'rows': rows}, indent=1))


if __name__ == '__main__':
  app.run(main)
