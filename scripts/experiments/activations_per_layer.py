"""What each row of a table keeps per layer for its backward pass, in D-wide activations (compiled, not run).

  python scripts/experiments/activations_per_layer.py [--table=residual_designs] [--rows=...] [--layers=6,12[,24...]]
      [--d_model=<its tiny preset's>] [--batch=8] [--seq_len=128] [--remat=dots_no_batch]
      [--out=results/activations_per_layer.json]

Each row at its tiny preset's width (or --d_model), scanned, float32, with the given remat policy: XLA's temporary
bytes of the compiled loss gradient at each layer count; the difference per added layer between consecutive counts
(`activations_per_layer` the last), divided by the bytes of one (batch, seq_len, d_model) float32 activation.
Parameters and optimizer state do not enter (no optimizer step), so this isolates what a design's layer adds to
the activation memory that dominates at the full shape. A compiler figure: noise cannot move it.
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # scripts/: common
import common  # noqa: E402  # puts the repo root on sys.path
import flax.linen as nn
import jax
from absl import app, flags

from laurel import config_lib, lm, step
from laurel.config_lib import InputError

_TABLE = flags.DEFINE_enum('table', 'residual_designs', common.TABLES, 'configs/<table>.py: whose rows to measure.')
_ROWS = flags.DEFINE_list('rows', None, "Rows (default: all of the table's).")
_LAYERS = flags.DEFINE_list('layers', ['6', '12'], 'The layer counts compared, ascending.')
_D_MODEL = flags.DEFINE_integer('d_model', None, "Width of every row (default: its tiny preset's).", lower_bound=2)
_BATCH = flags.DEFINE_integer('batch', 8, 'Sequences.', lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer('seq_len', 128, 'Tokens per sequence.', lower_bound=2)
_REMAT = flags.DEFINE_enum('remat', 'dots_no_batch', list(lm.REMAT_POLICIES), 'Remat policy of every row.')
_OUT = flags.DEFINE_string('out', '', 'Write the results as JSON here.')


def temp_bytes(row: str, layers: int) -> tuple[int, int]:
  """(XLA's temporary bytes of the row's compiled loss gradient at `layers` layers, its d_model)."""
  overrides = [f'model.num_layers={layers}', 'model.scan_layers=True', f'model.remat={_REMAT.value}',
               'model.dtype=float32', 'model.param_dtype=float32', f'data.seq_len={_SEQ_LEN.value}']
  overrides += [f'model.d_model={_D_MODEL.value}'] if _D_MODEL.value else []
  task = step.validate_config(config_lib.load(f'configs/{_TABLE.value}.py:{row},preset=tiny', overrides))
  batch = task.example_batch(_BATCH.value)
  variables = nn.unbox(jax.eval_shape(task.init, jax.random.key(0), batch))
  params, model_state = variables.pop('params'), variables
  grad = jax.grad(lambda p, b: task.loss(p, model_state, b, train=True)[0])
  compiled = jax.jit(grad).lower(params, batch).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes), task.model_cfg.d_model


def main():
  rows = _ROWS.value or config_lib.table_rows(_TABLE.value)
  layers = [int(n) for n in _LAYERS.value]
  if len(layers) < 2 or layers != sorted(set(layers)):
    raise InputError(f'--layers={",".join(_LAYERS.value)}: give two or more ascending layer counts')
  result = {'command': common.command(), 'layers': layers, 'batch': _BATCH.value,
            'seq_len': _SEQ_LEN.value, 'remat': _REMAT.value, 'rows': []}
  for row in rows:
    temps, d = zip(*(temp_bytes(row, n) for n in layers))
    activation = _BATCH.value * _SEQ_LEN.value * d[0] * 4
    per_layer = [(t1 - t0) / (n1 - n0) / activation for t0, t1, n0, n1 in zip(temps, temps[1:], layers, layers[1:])]
    result['rows'].append({'name': row, 'd_model': d[0], 'temp_bytes': list(temps), 'activation_bytes': activation,
                           'activations_per_layer': per_layer[-1], 'per_interval': per_layer})
    print(f"{row:30s} {' '.join(f'{p:6.2f}' for p in per_layer)} activations per layer", flush=True)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  app.run(common.main(main))
