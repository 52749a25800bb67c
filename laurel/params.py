"""Parameter accounting without allocating anything (jax.eval_shape).

  python -m laurel.params --config=configs/c4_ablation.py:rw_lr

Prints one JSON object: total and LAuReL parameter counts, the closed form of §2 / Table 4 for comparison,
and the count of the config's baseline row with the share LAuReL adds, beside the paper's figure.
"""

import importlib.util
import json
import sys

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from laurel import residual, tasks

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/<file>.py:<arg>', lock_config=True)


def count(config) -> dict:
  """Total, LAuReL and model-state sizes of `config`'s model, from shapes only."""
  task = tasks.get_task(config)
  variables = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))
  params = jax.tree_util.tree_leaves_with_path(variables['params'])
  size = lambda leaves: int(sum(np.prod(x.shape) for _, x in leaves))
  laurel = [(p, x) for p, x in params if 'laurel' in jax.tree_util.keystr(p)]
  state = [(p, x) for k, v in variables.items() if k != 'params' for p, x in jax.tree_util.tree_leaves_with_path(v)]
  widths = task.laurel_site_widths()
  spec = task.model_cfg.laurel
  return {'total_params': size(params), 'laurel_params': size(laurel), 'model_state_size': size(state),
          'laurel_sites': len(widths) if spec.components else 0,
          'closed_form_laurel_params': sum(residual.closed_form_params(spec, d) for d in widths)}


def _load_config_module(filename):
  module_spec = importlib.util.spec_from_file_location('config_module', filename)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def report(config, config_filename: str) -> dict:
  out = {'row': config.get('row'), 'preset': config.get('preset'), **count(config)}
  baseline_row = config.get('baseline_row')
  if baseline_row:
    arg = baseline_row + (f',preset={config.preset}' if config.get('preset') else '')
    base = count(_load_config_module(config_filename).get_config(arg))['total_params']
    out.update(baseline_row=baseline_row, baseline_params=base, added_params=out['total_params'] - base,
               added_pct=round(100.0 * (out['total_params'] - base) / base, 4))
  for key in ('paper_params_m', 'paper_params_added_pct', 'paper_top1'):
    if config.get(key) is not None:
      out[key] = config[key]
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    config = _CONFIG.value
    out = report(config, config_flags.get_config_filename(flags.FLAGS['config']).split(':')[0])
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
