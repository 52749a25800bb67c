"""Parameter counts from shapes alone, beside the paper's figures.

  python scripts/params.py --config=configs/c4_ablation.py:rw_lr [--json]
  python scripts/params.py --table=c4_ablation [--preset=paper] [--json]     # every row (make params)

Prints a Markdown table, results/README.md's: per row the total count (and how far it is from the paper's), what it
adds to the config's baseline row (beside the paper's figure), and its LAuReL parameters beside the closed form of
§2 / Table 4. --json prints one JSON object per row instead.
"""

import json
import sys

import cli  # puts the repo root on sys.path
import jax
import paper
from absl import app, flags
from ml_collections import config_flags

from laurel import command_line, sharding, tasks
from laurel.config_lib import InputError
from laurel.designs.laurel import closed_form_params

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/<file>.py:<arg>', lock_config=True)
_TABLE = flags.DEFINE_enum('table', None, command_line.TABLES, 'Every row of configs/<table>.py (instead of --config).')
_PRESET = flags.DEFINE_enum('preset', 'paper', ['paper', 'tiny'], "With --table: the rows' preset.")
_JSON = flags.DEFINE_bool('json', False, 'One JSON object per row instead of the table.')


def count(config) -> dict:
  """Total (unique: shared weights once; without a design's scan padding, `padded_params`), layer (stored), LAuReL
  and model-state sizes of `config`'s model, from shapes."""
  task = tasks.get_task(config)
  variables = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))
  params = jax.tree_util.tree_leaves_with_path(variables['params'])
  size = lambda leaves: sharding.num_params([x for _, x in leaves])
  laurel = [(p, x) for p, x in params if 'laurel' in jax.tree_util.keystr(p)]
  layers = [(p, x) for p, x in params  # ResidualTransformer's shared kernels once
            if jax.tree_util.keystr(p).startswith(("['layers", "['shared']"))]
  state = [(p, x) for k, v in variables.items() if k != 'params' for p, x in jax.tree_util.tree_leaves_with_path(v)]
  widths = task.laurel_site_widths()
  spec = task.model_cfg.stream
  laurel_sites = spec.design == 'laurel'
  total = task.num_params([x for _, x in params])
  return {'total_params': total, 'layer_params': size(layers), 'padded_params': size(params) - total,
          'laurel_params': size(laurel),
          'model_state_size': size(state),
          'laurel_sites': len(widths) if laurel_sites else 0,
          'closed_form_laurel_params': sum(closed_form_params(spec, d) for d in widths) if laurel_sites else 0}


def report(config, config_file: str) -> dict:
  """`count` of the config, and of its baseline row (in `config_file`) with the share LAuReL adds, beside the
  paper's figures."""
  out = {'row': config.row, 'preset': config.preset, **count(config)}
  if config.baseline_row:
    base = count(command_line.load(f'{config_file}:{config.baseline_row},preset={config.preset}'))['total_params']
    out.update(baseline_row=config.baseline_row, baseline_params=base, added_params=out['total_params'] - base,
               added_pct=round(100.0 * (out['total_params'] - base) / base, 4))
  table = paper.TABLE5 if config.task == 'lm' else paper.TABLE1
  published = table.get(config.row, {}) if config.preset == 'paper' else {}
  out.update({f'paper_{k}': v for k, v in published.items() if k in ('params_m', 'params_added_pct', 'top1')})
  return out


def markdown(reports: list[dict]) -> str:
  """results/README.md's table of `report`s."""
  base = next((r['baseline_row'] for r in reports if r.get('baseline_row')), None)
  published = {r['row']: r.get('paper_params_m') for r in reports}

  def row(r):
    total, paper_m = r['total_params'], r.get('paper_params_m')
    off = f' ({100 * (total / (paper_m * 1e6) - 1):+.2f}%)' if paper_m else ''
    added = '—' if r['row'] == base or 'added_params' not in r else f'{r["added_params"]:,} ({r["added_pct"]:.3f}%)'
    if 'paper_params_added_pct' in r:
      paper_added = '—' if r['row'] == base else f'{r["paper_params_added_pct"]}%'
    elif paper_m and published.get(base) and r['row'] != base:
      paper_added = f'{paper_m - published[base]:.2f}M'
    else:
      paper_added = '—'
    laurel = f'{r["laurel_params"]:,}' + ('' if r['laurel_params'] == r['closed_form_laurel_params']
                                          else f' (closed form {r["closed_form_laurel_params"]:,})')
    return (f'| {r["row"]} | {total:,}{off} | {f"{paper_m:.2f}M" if paper_m else "—"} | {added} | {paper_added} '
            f'| {laurel} | {r["laurel_sites"]} |')

  lines = [f'| row | params | paper | added to {base or "the baseline"} | paper added | LAuReL params (= closed '
           'form unless shown) | LAuReL sites |', '|---' * 7 + '|']
  return '\n'.join(lines + [row(r) for r in reports])


def main():
  if (_CONFIG.value is None) == (_TABLE.value is None):
    raise InputError('give --config=configs/<file>.py:<row> or --table=<name> (one of them)')
  if _TABLE.value:
    config_file = str(command_line.REPO / 'configs' / f'{_TABLE.value}.py')
    reports = [report(command_line.load(f'{config_file}:{row},preset={_PRESET.value}'), config_file)
               for row in command_line.table_rows(config_file)]
  else:
    config_file = command_line.resolve_spec(command_line.config_spec(sys.argv)).split(':')[0]
    reports = [report(_CONFIG.value, config_file)]
  print('\n'.join(map(json.dumps, reports)) if _JSON.value else markdown(reports))


if __name__ == '__main__':
  app.run(cli.main(main), flags_parser=command_line.parse_flags)
