"""`python -m laurel.params --config=configs/c4_ablation.py:rw_lr`: parameter accounting from shapes alone.

Prints one JSON object: total and LAuReL parameter counts beside the closed form of §2 / Table 4, and the count of
the config's baseline row with the share LAuReL adds, beside the paper's figure.
"""

import json

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from laurel import config_lib, paper, residual, tasks

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/<file>.py:<arg>', lock_config=True)


def count(config) -> dict:
  """Total (unique: shared weights once), layer, LAuReL and model-state sizes of `config`'s model, from shapes."""
  task = tasks.get_task(config)
  variables = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))
  params = jax.tree_util.tree_leaves_with_path(variables['params'])
  size = lambda leaves: int(sum(np.prod(x.shape) for _, x in leaves))
  laurel = [(p, x) for p, x in params if 'laurel' in jax.tree_util.keystr(p)]
  layers = [(p, x) for p, x in params  # ResidualTransformer's shared kernels once
            if jax.tree_util.keystr(p).startswith(("['layers", "['shared']"))]
  state = [(p, x) for k, v in variables.items() if k != 'params' for p, x in jax.tree_util.tree_leaves_with_path(v)]
  widths = task.laurel_site_widths()
  spec = task.model_cfg.laurel
  return {'total_params': size(params), 'layer_params': size(layers), 'laurel_params': size(laurel),
          'model_state_size': size(state),
          'laurel_sites': len(widths) if spec.components else 0,
          'closed_form_laurel_params': sum(residual.closed_form_params(spec, d) for d in widths)}


def report(config) -> dict:
  """`count` of the config, and of its baseline row with the share LAuReL adds, beside the paper's figures."""
  out = {'row': config.row, 'preset': config.preset, **count(config)}
  if config.baseline_row:
    spec = config_flags.get_config_filename(flags.FLAGS['config']).split(':')[0]
    base = count(config_lib.load(f'{spec}:{config.baseline_row},preset={config.preset}'))['total_params']
    out.update(baseline_row=config.baseline_row, baseline_params=base, added_params=out['total_params'] - base,
               added_pct=round(100.0 * (out['total_params'] - base) / base, 4))
  table = paper.TABLE5 if config.task == 'lm' else paper.TABLE1
  published = table.get(config.row, {}) if config.preset == 'paper' else {}
  out.update({f'paper_{k}': v for k, v in published.items() if k in ('params_m', 'params_added_pct', 'top1')})
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    out = report(_CONFIG.value)
  except config_lib.InputError as e:
    config_lib.fail(str(e))
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main, flags_parser=config_lib.parse_flags)
