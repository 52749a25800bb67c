"""Sweeps config fields over values (one field, or several as a grid), one training run per point; collects a table
and a plot.

  python scripts/sweep.py --config=configs/c4_ablation.py:rw_lr,preset=tiny --field=model.laurel.rank \
      --values=4,8,16,32,64 [--field=model.laurel.k --values=1,2,3,4] --workdir=runs/sweep [--seeds=0,1,2] \
      [--metric=eval_top1] [--reduce=best] [--reference=<value>[,...]] [--set=<field>=<value> ...] \
      [--collect_only] [--time_limit=10m] [--jobs=2] \
      [--launch=local|print|tpu --tpu=NAME --zone=ZONE --accelerator=v6e-16 [--nosetup]]

Each --field takes the --values given in the same position; several fields sweep their grid (every combination).
Point WORKDIR/<field's last part>=<value>[,...][,seed=<s>] (WORKDIR local or gs://) trains with those values,
config.seed and the --set overrides; every point's config is loaded and checked (for the slice with --launch=tpu)
before the first one runs. --launch=local trains the points here in turn (log: <point>/sweep.log); --launch=tpu
trains each on a TPU slice through scripts/launch_tpu.py (after setting the slice up, unless --nosetup), and
--launch=print prints those commands (without --tpu the local ones: a dry run of the points). A failed point is
marked failed and the rest go on (one that another process finished meanwhile is reported as finished by it);
rerunning skips finished points and resumes the others. One sweep at a time writes in a local workdir: a second is
refused in one line naming the first. Collecting writes WORKDIR/sweep.{csv,json,md,png}: each point's final.json and
best evaluation, and per combination the mean ± std over seeds (no ± for one run) and the paired difference to the
--reference point (default: the first) on the same seeds, with its 95% Student-t interval and whether it excludes zero;
plotted against the value as in Figure 3 (one field) or as a heatmap of the first two fields (averaged over any
others) whose colours span at least the noise (the widest interval of a difference), as its title says; with one run
per point there is no such interval, and the cells are not coloured by rank.
"""

import functools
import itertools
import json
import math
import re
import statistics

import cli  # puts the repo root on sys.path
import launching
import numpy as np
import tables
from absl import app, flags
from etils import epath

from laurel import command_line
from laurel.config_lib import InputError

_CONFIG = flags.DEFINE_string('config', None, 'configs/<file>.py:<arg>, as for laurel.main.')
_FIELD = flags.DEFINE_multi_string('field', [], 'Dotted config field to sweep, e.g. model.laurel.rank (repeatable).')
_VALUES = flags.DEFINE_multi_string('values', [], "Comma-separated values of the --field in the same position.")
_WORKDIR = flags.DEFINE_string('workdir', None, 'One subdirectory per point, and the collected results.')
_METRIC = flags.DEFINE_string('metric', 'eval_loss', 'final.json key to plot, e.g. eval_loss, eval_top1.')
_REDUCE = flags.DEFINE_enum('reduce', 'final', ['final', 'best'], "Plot the final or the run's best evaluation.")
_SEEDS = flags.DEFINE_list('seeds', [], "Seeds per point (config.seed); default: one run at the config's seed.")
_SET = flags.DEFINE_multi_string('set', [], '<field>=<value> override for every point (repeatable).')
_COLLECT_ONLY = flags.DEFINE_bool('collect_only', False, 'Only collect finished points into the results.')
_REFERENCE = flags.DEFINE_string('reference', None, 'The values (one per --field, comma-separated) of the point every '
                                 'other is compared with on the same seeds; default: the first.')
_LAUNCH = launching.define_launch_flags()


def parse_grid(fields, values) -> dict[str, list[str]]:
  """{field: its values}, in the order given; one-line InputError for a mismatch."""
  if not fields or len(fields) != len(values):
    raise InputError(f'--field and --values: give one --values list per --field (got {len(fields)} fields and '
                     f'{len(values)} lists)')
  grid = {f: [v.strip() for v in vs.split(',') if v.strip()] for f, vs in zip(fields, values)}
  for f, vs in grid.items():
    if not vs or len(set(vs)) != len(vs):
      raise InputError(f'--values={",".join(vs)!r} (--field={f}): give distinct values')
  if len(grid) != len(fields):
    raise InputError(f'--field={fields!r}: a field is given twice')
  return grid


def check_fields(config_spec: str, fields, sets) -> None:
  """A one-line InputError for a --field the config lacks, naming the field most like it."""
  known = command_line.dotted_fields(command_line.load(config_spec, cli.config_flags(sets)))
  for f in fields:
    if f not in known:
      raise InputError(f'--field={f}: unknown config field{command_line.did_you_mean(f, {k: k for k in known})}')


def plan_points(workdir: str, config_spec: str, grid: dict, seeds, sets, launcher) -> list[dict]:
  """Every point's name, dir, values, seed, --config.* overrides and the values they give: each point's config is
  loaded and checked here, so that a bad field or value fails before anything runs."""
  check_fields(config_spec, grid, sets)
  points = []
  for combination in itertools.product(*grid.values()):
    values = dict(zip(grid, combination))
    for seed in (seeds or [None]):
      seed_part = [] if seed is None else [f'seed={seed}']
      overrides = cli.config_flags([*sets, *(f'{f}={v}' for f, v in values.items()), *seed_part])
      config = json.loads(launcher.load(config_spec, overrides).to_json_best_effort())
      name = re.sub(r'[^\w.,=+-]', '_', ','.join([*(f'{f.split(".")[-1]}={v}' for f, v in values.items()),
                                                  *seed_part]))
      fields = [o.removeprefix('--config.').split('=')[0] for o in overrides]
      points.append({'name': name, 'dir': epath.Path(workdir) / name, 'config': command_line.resolve_spec(config_spec),
                     'values': values, 'seed': seed, 'overrides': overrides,
                     'expected': {f: _get(config, f) for f in fields}})
  return points


def _get(config, dotted: str):
  """config.<dotted>, or None where a part is missing."""
  return functools.reduce(lambda c, part: c.get(part) if hasattr(c, 'get') else None, dotted.split('.'), config)


def check_not_another_run(point: dict):
  """A finished point is only skipped if its config.json has this point's overrides."""
  path = point['dir'] / 'config.json'
  saved = json.loads(path.read_text()) if path.exists() else {}
  for dotted, value in point['expected'].items():
    if (found := _get(saved, dotted)) not in (None, value):
      raise InputError(f'{point["dir"]} holds a run with {dotted}={found!r}, not {value!r}; use another --workdir')


def best_evaluation(point_dir: epath.Path, metric: str, final_value):
  """The best finite `metric` in the run's metrics.jsonl (the highest for accuracies), else `final_value`."""
  path = point_dir / 'metrics.jsonl'
  rows = map(json.loads, filter(None, path.read_text().splitlines())) if path.exists() else []
  values = [r[metric] for r in rows if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
  return (max if any(w in metric for w in ('top1', 'top5', 'acc')) else min)(values) if values else final_value


def collect(points, fields: list[str], metric: str) -> dict:
  """One row per point (its final.json, best evaluation and status) and per combination of values the mean ± std
  over its runs."""
  rows, best = [], f'best_{metric}'
  for p in points:
    row = {**p['values'], 'seed': p['seed'], 'point': p['name'], 'status': launching.point_status(p['dir'])}
    if row['status'] == 'done':
      final = json.loads((p['dir'] / 'final.json').read_text())
      row.update({metric: final.get(metric), best: best_evaluation(p['dir'], metric, final.get(metric))})
      row.update({k: v for k, v in final.items() if k not in row})
    rows.append(row)
  done = [r for r in rows if r['status'] == 'done']
  if done and all(r.get(metric) is None for r in done):
    keys = sorted({k for r in done for k, v in r.items() if k.startswith('eval_') and v is not None})
    raise InputError(f'--metric={metric!r}: not in final.json of any finished point (it has: {", ".join(keys)})')
  combinations = combinations_of(points)
  reference = reference_combination(combinations, fields)
  by_seed = lambda values: {str(r['seed']): r[metric] for r in done
                            if all(r[f] == v for f, v in values) and r.get(metric) is not None}
  summary = []
  for values in combinations:
    group = [r for r in done if all(r[f] == v for f, v in values) and r.get(metric) is not None]
    entry = {**dict(values), 'runs': len(group), 'reference': values == reference}
    for key in (metric, best):
      entry[key], entry[f'{key}_std'] = tables.mean_and_spread(r[key] for r in group if r.get(key) is not None)
    entry.update(tables.paired_columns(by_seed(values), by_seed(reference), metric))
    for key in ('params', 'median_step_time_s'):
      xs = [r[key] for r in group if isinstance(r.get(key), (int, float))]
      entry[key] = statistics.median(xs) if xs else None
    entry['params'] = entry['params'] and round(entry['params'])  # a count, even as the median of two
    summary.append(entry)
  return {'config': _CONFIG.value, 'fields': fields, 'grid': {f: list(dict.fromkeys(p['values'][f] for p in points))
                                                              for f in fields},
          'seeds': _SEEDS.value, 'metric': metric, 'reduce': _REDUCE.value, 'set': _SET.value,
          'reference': dict(reference), 'points': rows, 'summary': summary}


def combinations_of(points) -> list[tuple]:
  """The points' distinct ((field, value), ...) combinations, in order."""
  return list(dict.fromkeys(tuple(p['values'].items()) for p in points))


def reference_combination(combinations: list[tuple], fields: list[str]) -> tuple:
  """The combination every other is compared with, seed by seed: --reference's values, else the first."""
  if not _REFERENCE.value:
    return combinations[0]
  wanted = tuple(zip(fields, (v.strip() for v in _REFERENCE.value.split(','))))
  if wanted not in combinations:
    raise InputError(f'--reference={_REFERENCE.value!r}: not a point of the grid (give one value per --field, in '
                     f'order, e.g. {",".join(v for _, v in combinations[0])})')
  return wanted


def markdown(result: dict) -> str:
  def fmt(x, std=None):
    text = ('–' if x is None else tables.integer(x) if isinstance(x, int) else f'{x:.4f}' if isinstance(x, float)
            else str(x))
    return text + ('' if std is None else f' ± {std:.4f}')
  fields, metric, best = result['fields'], result['metric'], f'best_{result["metric"]}'
  head = ' | '.join(fields)
  reference = ', '.join(f'{f}={v}' for f, v in result['reference'].items())
  lines = [f'# Sweep of {" × ".join(f"`{f}`" for f in fields)}: `{result["config"]}`', '',
           f'`{metric}` (final evaluation) and `{best}` (best evaluation of the run), mean ± std over runs (no ± for '
           f'one run). Δ: `{metric}` minus the reference point\'s ({reference}) on the same seeds, with the '
           f'{tables.CI_PERCENT} Student-t interval over those seeds (pairs); resolved: the interval excludes zero.'
           + (f' Overrides: {", ".join(f"`{s}`" for s in result["set"])}.' if result['set'] else ''), '',
           f'| {head} | runs | {metric} | Δ {metric} ({tables.CI_PERCENT} CI) | pairs | resolved | {best} | params '
           '| step (s) |', '|---' * (len(fields) + 8) + '|']
  lines += [f'| {" | ".join(s[f] for f in fields)} | {s["runs"]} | {fmt(s[metric], s[metric + "_std"])} '
            f'| {" | ".join(tables.paired_cells(s, metric, reference=s["reference"]))} '
            f'| {fmt(s[best], s[best + "_std"])} | {fmt(s["params"])} | {fmt(s["median_step_time_s"])} |'
            for s in result['summary']]
  if noise := tables.eval_noise([r.get('held_out') for r in result['points']]):
    lines += ['', f'Eval noise: {noise} (over the points\' runs).']
  lines += ['', f'| point | status | {metric} |', '|---|---|---|']
  lines += [f'| {r["point"]} | {r["status"]} | {fmt(r.get(metric))} |' for r in result['points']]
  return '\n'.join(lines) + '\n'


def plot(result: dict):
  """One field: the metric against its values, evenly spaced (ranks 4..64 as in Figure 3), with the std over runs.
  Several: a heatmap of the first two fields, each cell the mean over its runs (and over the other fields)."""
  fields, grid = result['fields'], result['grid']
  key = result['metric'] if result['reduce'] == 'final' else f'best_{result["metric"]}'
  label = key.replace('best_', 'best ')
  summary = [s for s in result['summary'] if s[key] is not None]
  fig, ax = tables.plt.subplots(figsize=(5, 3.5) if len(fields) == 1 else (6, 4.5))
  if len(fields) == 1:
    values, runs = grid[fields[0]], {s['runs'] for s in summary}
    ax.errorbar([values.index(s[fields[0]]) for s in summary], [s[key] for s in summary],
                yerr=[s[f'{key}_std'] or 0 for s in summary], marker='o', capsize=3)
    ax.set(xticks=range(len(values)), xticklabels=values, xlabel=fields[0],
           ylabel=label + (f' (mean of {runs.pop()})' if len(runs) == 1 and runs != {1} else ''))
    ax.ticklabel_format(axis='y', useOffset=False)
    ax.grid(alpha=0.3)
  else:
    (y_field, ys), (x_field, xs) = list(grid.items())[:2]
    cells = np.full((len(ys), len(xs)), np.nan)
    for i, y in enumerate(ys):
      for j, x in enumerate(xs):
        if found := [s[key] for s in summary if s[y_field] == y and s[x_field] == x]:
          cells[i, j] = statistics.fmean(found)
    noise, paired = colour_noise(result)
    if paired:  # colours rank the cells, over at least the noise
      low = np.nanmin(cells) if np.isfinite(cells).any() else 0.0
      high = max(np.nanmax(cells) if np.isfinite(cells).any() else 0.0, low + noise)
      image = ax.imshow(cells, cmap='viridis_r' if 'loss' in key else 'viridis', aspect='auto', vmin=low, vmax=high)
      fig.colorbar(image, ax=ax, label=label + (' (mean over the other fields)' if len(fields) > 2 else ''))
    else:  # one run per point: nothing tells a difference from the seeds' noise, so one colour for all cells
      image = ax.imshow(np.where(np.isnan(cells), np.nan, 0.0), cmap='Greys', aspect='auto', vmin=0.0, vmax=1.0)
    for (i, j), value in np.ndenumerate(cells):  # black or white text, whichever contrasts more with the cell
      shade = image.get_array()[i, j]
      light = np.isnan(value) or tables.luminance(image.cmap(image.norm(shade))) > tables.EQUAL_CONTRAST_LUMINANCE
      ax.text(j, i, '–' if np.isnan(value) else f'{value:.4f}', ha='center', va='center', fontsize=8,
              color='black' if light else 'white')
    ax.set(xticks=range(len(xs)), xticklabels=xs, xlabel=x_field, yticks=range(len(ys)), yticklabels=ys,
           ylabel=y_field)
  title = result['config'].split('/')[-1]
  if len(fields) > 1:
    eval_noise = f" (the eval's own {tables.CI_PERCENT} interval is {noise:.4f} wide)" if noise else ''
    title += (f': the colours span at least {noise:.4f}, the widest {tables.CI_PERCENT} interval of a Δ (the noise), '
              'so cells of one colour are not told apart' if paired else
              f': no interval of a Δ (it needs two seeds or more per point){eval_noise}, so the cells are not '
              'coloured by rank; --seeds=0,1,2 gives intervals')
  tables.fit_title(ax, title, fontsize=8)
  fig.tight_layout()
  return fig


def colour_noise(result: dict) -> tuple[float | None, bool]:
  """(a width, whether it is paired): the widest interval of a point's Δ to the reference (its seeds paired), which a
  heatmap's colours span at least, so that noise never looks like a winner; else, with one run per point, the eval
  loss's own interval (1.96 standard errors either side), which leaves the seeds' noise out; else None."""
  key = result['metric']  # the paired differences are of the final metric
  widths = [s[f'{key}_diff_high'] - s[f'{key}_diff_low'] for s in result['summary']
            if s.get(f'{key}_diff_low') is not None]
  if widths:
    return max(widths), True
  errors = [h['loss_se'] for h in (r.get('held_out') for r in result.get('points', [])) if (h or {}).get('loss_se')]
  return (2 * 1.96 * max(errors) if errors and 'loss' in key else None), False


def sweep():
  cli.require(config=_CONFIG, field=_FIELD, values=_VALUES, workdir=_WORKDIR)
  launcher, grid = launching.Launcher(_LAUNCH), parse_grid(_FIELD.value, _VALUES.value)
  points = plan_points(_WORKDIR.value, _CONFIG.value, grid, _SEEDS.value, _SET.value, launcher)
  reference_combination(combinations_of(points), list(grid))  # a bad --reference fails before anything runs
  if launcher.launch == 'print' and not _COLLECT_ONLY.value:  # the commands only; nothing is read or written
    launcher.run(points, 'sweep.log')
    return
  launching.hold_folder(_WORKDIR.value, 'workdir')  # one sweep at a time in a workdir
  if not _COLLECT_ONLY.value:
    for point in points:
      check_not_another_run(point)
    launcher.run(points, 'sweep.log')
  result = collect(points, list(grid), _METRIC.value)
  tables.write_results(_WORKDIR.value, 'sweep', result, result['points'], markdown(result), plot(result))
  counts = {s: sum(r['status'] == s for r in result['points']) for s in ('done', 'partial', 'failed', 'missing')}
  print(f'collected {len(points)} points ({", ".join(f"{n} {s}" for s, n in counts.items() if n)}) into '
        f'{_WORKDIR.value}/sweep.{{csv,json,md,png}}', flush=True)
  if counts['failed']:
    cli.fail(f'{counts["failed"]} point(s) failed: '
                f'{", ".join(r["point"] for r in result["points"] if r["status"] == "failed")}', code=1)


if __name__ == '__main__':
  app.run(cli.main(sweep))
