"""Sweeps one config field over values, one laurel.main run per point, and collects a table and a plot.

  python scripts/sweep.py --config=configs/imagenet_resnet50.py:rw_lr,preset=tiny --field=model.laurel.rank \
      --values=4,8,16,32,64 --workdir=runs/sweep_rank [--metric=eval_top1] [--seeds=0,1,2,3,4] [--reduce=best] \
      [--launch=local|print] [--set=<field>=<value> ...] [--tpu=NAME --zone=ZONE --accelerator=v6e-16] \
      [--collect_only]

Any config file and any field (LM or ResNet). Each point runs in WORKDIR/<last part of the field>=<value> (with
--seeds: ...=<value>,seed=<s>, seed s set as config.seed), with the field and every --set as --config.* overrides.

--launch=local (default) runs the points one after another as `python -m laurel.main` subprocesses, their output
echoed and kept in <point>/sweep.log. A point whose final.json exists is skipped; an interrupted one resumes from
its last checkpoint (laurel.main does that), so rerunning the same command finishes the sweep. SIGTERM is passed
to the running point, which saves a checkpoint; the sweep then stops.
--launch=print prints, one line per point, the command that runs it on every host of a TPU slice (gcloud ... ssh
--worker=all --command='cd laurel && .venv/bin/python -m laurel.main ...'; the code and venv come from
scripts/launch_tpu.py) and runs nothing. Run them one after another, then --collect_only.

Collecting (after a local sweep, or --collect_only) reads each point's final.json (and metrics.jsonl for the best
evaluation) and writes WORKDIR/sweep.csv (one row per point), sweep.json, sweep.md (mean ± std over seeds per
value) and sweep.png: the metric against the value, as in the paper's Figure 3 (average best top-1 against r:
--metric=eval_top1 --reduce=best --seeds=0,1,2,3,4). The workdir may be on GCS (gs://) for collecting.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys

import common  # puts the repo root on sys.path
from absl import app, flags, logging
from etils import epath

_CONFIG = flags.DEFINE_string('config', None, 'configs/<file>.py:<arg>, as for laurel.main.')
_FIELD = flags.DEFINE_string('field', None, 'Dotted config field to sweep, e.g. model.laurel.rank.')
_VALUES = flags.DEFINE_list('values', None, 'Values of the field, e.g. 4,8,16,32,64.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'One subdirectory per point, and the collected results.')
_METRIC = flags.DEFINE_string('metric', 'eval_loss', 'final.json key to plot, e.g. eval_loss, eval_top1.')
_REDUCE = flags.DEFINE_enum('reduce', 'final', ['final', 'best'],
                            'Plot the final evaluation, or the best one of the run (Figure 3 uses the best).')
_SEEDS = flags.DEFINE_list('seeds', [], 'Seeds per value (config.seed); default: one run at the config\'s seed.')
_LAUNCH = flags.DEFINE_enum('launch', 'local', ['local', 'print'], 'Run the points here, or print TPU commands.')
_SET = flags.DEFINE_multi_string('set', [], '<field>=<value> override for every point (repeatable).')
_COLLECT_ONLY = flags.DEFINE_bool('collect_only', False, 'Only collect finished points into the results.')
_TPU = flags.DEFINE_string('tpu', None, '--launch=print: TPU VM name.')
_ZONE = flags.DEFINE_string('zone', None, '--launch=print: its zone.')
_PROJECT = flags.DEFINE_string('project', None, "--launch=print: Google Cloud project; default: gcloud's.")
_ACCELERATOR = flags.DEFINE_string('accelerator', None, '--launch=print: the slice, e.g. v6e-16 (host count).')


def point_name(field: str, value: str, seed: str | None) -> str:
  name = f'{field.split(".")[-1]}={value}' + (f',seed={seed}' if seed is not None else '')
  return re.sub(r'[^\w.,=+-]', '_', name)  # keeps the name one safe path component


def plan_points(config_spec: str, field: str, values, seeds, sets) -> list[dict]:
  """Every point's name, value, seed and --config.* overrides, each checked against the config here."""
  config = common.load_config(config_spec)
  for assignment in sets:
    common.set_field(config, *common.parse_assignment(assignment))
  common.get_field(config, field)
  points = []
  for value in values:
    for seed in (seeds or [None]):
      common.set_field(config, field, value)  # a bad value fails here, before anything runs
      overrides = [f'--config.{s.removeprefix("--").removeprefix("config.")}' for s in sets]
      overrides.append(f'--config.{field}={value}')
      if seed is not None:
        common.set_field(config, 'seed', seed)
        overrides.append(f'--config.seed={seed}')
      points.append({'name': point_name(field, value, seed), 'value': value, 'seed': seed,
                     'expected': {k.removeprefix('--config.'): v for k, v in (o.split('=', 1) for o in overrides)},
                     'overrides': overrides})
  if len({p['name'] for p in points}) != len(points):
    raise ValueError(f'--values={",".join(values)}: two values give the same point directory')
  return points


def check_not_another_run(point_dir: epath.Path, point: dict):
  """A finished point is only skipped if its config.json has this point's overrides."""
  saved = point_dir / 'config.json'
  if not saved.exists():
    return
  config = json.loads(saved.read_text())
  for dotted, text in point['expected'].items():
    node = config
    for part in dotted.split('.'):
      node = node.get(part) if isinstance(node, dict) else None
    if node is not None and str(node).lower() != text.lower() and _as_number(node) != _as_number(text):
      raise ValueError(f'{point_dir} holds a run with {dotted}={node!r}, not {text!r}; use another --workdir')


def _as_number(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return None


def run_local(points, workdir: epath.Path) -> list[str]:
  """Runs the unfinished points in turn; returns the names of those that failed."""
  failed, stop, running = [], [], []

  def on_sigterm(*_):  # the running point saves a checkpoint and exits; no further point starts
    stop.append(True)
    for proc in running:
      proc.send_signal(signal.SIGTERM)

  previous = signal.signal(signal.SIGTERM, on_sigterm)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(common.ROOT), os.environ.get('PYTHONPATH'))
                                                     if p))
  try:
    for i, point in enumerate(points):
      point_dir = workdir / point['name']
      tag = f'[{i + 1}/{len(points)} {point["name"]}]'
      if (point_dir / 'final.json').exists():
        print(f'{tag} finished, skipped', flush=True)
        continue
      if stop:
        break
      point_dir.mkdir(parents=True, exist_ok=True)
      cmd = [sys.executable, '-m', 'laurel.main', f'--config={common.runnable_spec(_CONFIG.value)}',
             f'--workdir={point_dir}', *point['overrides']]
      print(f'{tag} {common.shell_line(cmd)}', flush=True)
      with (point_dir / 'sweep.log').open('a') as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        running.append(proc)
        try:
          for line in proc.stdout:
            log.write(line)
            print(f'{tag} {line}', end='', flush=True)
        finally:
          code = proc.wait()
          running.clear()
      if code:
        print(f'{tag} failed (exit {code}); see {point_dir / "sweep.log"}', flush=True)
        failed.append(point['name'])
  finally:
    signal.signal(signal.SIGTERM, previous)
  if stop:
    print('stopped by SIGTERM; rerun the same command to resume', flush=True)
  return failed


def evaluations(point_dir: epath.Path, metric: str) -> dict[int, float]:
  """{step: value} of `metric` in the run's metrics.jsonl."""
  path = point_dir / 'metrics.jsonl'
  rows = map(json.loads, filter(None, path.read_text().splitlines())) if path.exists() else []
  return {r['step']: r[metric] for r in rows if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])}


def higher_is_better(metric: str) -> bool:
  return any(word in metric for word in ('top1', 'top5', 'accuracy', 'acc'))


def collect(points, workdir: epath.Path, field: str, metric: str, failed=()) -> dict:
  """One row per point (its final.json, best evaluation and status) and the mean ± std per value."""
  rows = []
  for point in points:
    point_dir = workdir / point['name']
    row = {field: point['value'], 'seed': point['seed'], 'point': point['name']}
    if (point_dir / 'final.json').exists():
      final = json.loads((point_dir / 'final.json').read_text())
      evals = evaluations(point_dir, metric)
      value = final.get(metric)
      best = (max if higher_is_better(metric) else min)(evals.values()) if evals else value
      row.update(status='done', **{metric: value, f'best_{metric}': best})
      row.update({k: v for k, v in final.items() if k not in row})
    else:
      row['status'] = 'failed' if point['name'] in failed else (
          'partial' if (point_dir / 'metrics.jsonl').exists() else 'missing')
    rows.append(row)
  done = [r for r in rows if r['status'] == 'done']
  if done and all(r.get(metric) is None for r in done):
    keys = sorted({k for r in done for k, v in r.items() if k.startswith('eval_') and v is not None})
    raise ValueError(f'--metric={metric!r}: not in final.json of any finished point (it has: {", ".join(keys)})')

  summary = []
  for value in dict.fromkeys(p['value'] for p in points):
    group = [r for r in done if r[field] == value and r.get(metric) is not None]
    entry = {field: value, 'runs': len(group)}
    for key in (metric, f'best_{metric}'):
      xs = [r[key] for r in group if r.get(key) is not None]
      entry[key] = statistics.fmean(xs) if xs else None
      entry[f'{key}_std'] = statistics.stdev(xs) if len(xs) > 1 else 0.0 if xs else None
    for key in ('params', 'avg_step_time_s'):
      xs = [r[key] for r in group if isinstance(r.get(key), (int, float))]
      entry[key] = statistics.median(xs) if xs else None
    summary.append(entry)
  return {'config': _CONFIG.value, 'field': field, 'values': list(dict.fromkeys(p['value'] for p in points)),
          'seeds': _SEEDS.value, 'metric': metric, 'reduce': _REDUCE.value, 'set': _SET.value,
          'points': rows, 'summary': summary}


def write_results(result: dict, workdir: epath.Path):
  rows = result['points']
  workdir.mkdir(parents=True, exist_ok=True)
  columns = list(dict.fromkeys(k for r in rows for k in r))
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, columns, lineterminator='\n')
  writer.writeheader()
  writer.writerows(rows)
  (workdir / 'sweep.csv').write_text(buffer.getvalue())
  (workdir / 'sweep.json').write_text(json.dumps(result, indent=2) + '\n')
  (workdir / 'sweep.md').write_text(markdown(result))
  (workdir / 'sweep.png').write_bytes(plot(result))
  counts = {s: sum(r['status'] == s for r in rows) for s in ('done', 'partial', 'failed', 'missing')}
  print(f'collected {len(rows)} points ({", ".join(f"{n} {s}" for s, n in counts.items() if n)}) into '
        f'{workdir}/sweep.{{csv,json,md,png}}', flush=True)


def _fmt(x, std=None):
  if x is None:
    return '–'
  text = f'{x:.4f}' if isinstance(x, float) else str(x)
  return text + (f' ± {std:.4f}' if std else '')


def markdown(result: dict) -> str:
  field, metric = result['field'], result['metric']
  lines = [f'# Sweep of `{field}`: `{result["config"]}`', '',
           f'`{metric}` (final evaluation) and `best_{metric}` (best evaluation of the run), mean ± std over runs.'
           + (f' Overrides: {", ".join(f"`{s}`" for s in result["set"])}.' if result['set'] else ''), '',
           f'| {field} | runs | {metric} | best_{metric} | params | step (s) |', '|---|---|---|---|---|---|']
  for s in result['summary']:
    best = f'best_{metric}'
    params = f'{s["params"]:,}' if s['params'] is not None else '–'
    lines.append(f'| {s[field]} | {s["runs"]} | {_fmt(s[metric], s[metric + "_std"])} | '
                 f'{_fmt(s[best], s[best + "_std"])} | {params} | {_fmt(s["avg_step_time_s"])} |')
  lines += ['', '| point | status | ' + metric + ' |', '|---|---|---|']
  lines += [f'| {r["point"]} | {r["status"]} | {_fmt(r.get(metric))} |' for r in result['points']]
  return '\n'.join(lines) + '\n'


def plot(result: dict) -> bytes:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  field, metric = result['field'], result['metric']
  key = metric if result['reduce'] == 'final' else f'best_{metric}'
  summary = [s for s in result['summary'] if s[key] is not None]
  values = [s[field] for s in result['summary']]
  numeric = all(_as_number(v) is not None for v in values)
  fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
  if numeric:
    xs = [_as_number(s[field]) for s in summary]
    positive = [_as_number(v) for v in values if _as_number(v) > 0]
    if len(positive) == len(values) and max(positive) / min(positive) >= 8:
      ax.set_xscale('log', base=2)  # ranks 4..64 evenly spaced, as in Figure 3
    ax.set_xticks([_as_number(v) for v in values], values)
    ax.minorticks_off()
  else:
    xs = [values.index(s[field]) for s in summary]
    ax.set_xticks(range(len(values)), values)
  ax.errorbar(xs, [s[key] for s in summary], yerr=[s[f'{key}_std'] or 0 for s in summary], marker='o', capsize=3)
  ax.ticklabel_format(axis='y', useOffset=False)
  for x, s in zip(xs, summary):
    ax.annotate(f'{s[key]:.4f}', (x, s[key]), textcoords='offset points', xytext=(0, 6), ha='center', fontsize=7)
  runs = sorted({s['runs'] for s in summary})
  ax.set_xlabel(field)
  ax.set_ylabel(('best ' if result['reduce'] == 'best' else '') + metric +
                (f' (mean of {runs[0]})' if runs and runs != [1] and len(runs) == 1 else ''))
  ax.set_title(os.path.basename(result['config'].split(':')[0]) + ':' + result['config'].partition(':')[2],
               fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  out = io.BytesIO()
  fig.savefig(out, format='png')
  plt.close(fig)
  return out.getvalue()


def print_commands(points):
  for name, flag in (('tpu', _TPU), ('zone', _ZONE), ('accelerator', _ACCELERATOR)):
    if not flag.value:
      raise ValueError(f'--launch=print needs --{name} (the host count comes from --accelerator)')
  accel = common.parse_accelerator(_ACCELERATOR.value)
  if '://' not in _WORKDIR.value and accel['hosts'] > 1:
    print(f'warning: --workdir={_WORKDIR.value!r} is not on GCS; all hosts must see the same directory',
          file=sys.stderr)
  print(f'# {len(points)} points, to run one after another. Code and venv first: python scripts/launch_tpu.py '
        f'--tpu={_TPU.value} --zone={_ZONE.value} --accelerator={_ACCELERATOR.value} --notrain', file=sys.stderr)
  for point in points:
    workdir = f'{_WORKDIR.value.rstrip("/")}/{point["name"]}'
    command = common.train_command(_CONFIG.value, workdir, accel['hosts'], point['overrides'])
    print(common.shell_line(common.ssh(_TPU.value, _ZONE.value, _PROJECT.value, command)), flush=True)


def main(argv):
  if len(argv) > 1:
    common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  logging.set_verbosity(logging.WARNING)
  for name, flag in (('config', _CONFIG), ('field', _FIELD), ('values', _VALUES), ('workdir', _WORKDIR)):
    if not flag.value:
      common.fail(f'--{name} is required')
  try:
    points = plan_points(_CONFIG.value, _FIELD.value, _VALUES.value, _SEEDS.value, _SET.value)
    if _LAUNCH.value == 'print' and not _COLLECT_ONLY.value:
      print_commands(points)
      return
    workdir = epath.Path(_WORKDIR.value)
    failed = []
    if not _COLLECT_ONLY.value:
      for point in points:
        check_not_another_run(workdir / point['name'], point)
      workdir.mkdir(parents=True, exist_ok=True)
      failed = run_local(points, workdir)
    write_results(collect(points, workdir, _FIELD.value, _METRIC.value, failed), workdir)
  except ValueError as e:
    common.fail(str(e))
  if failed:
    common.fail(f'{len(failed)} point(s) failed: {", ".join(failed)}', code=1)


if __name__ == '__main__':
  app.run(main)
