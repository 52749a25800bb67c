"""Reproduces Table 5 (the C4 ablation of LAuReL variants) and writes results/c4_ablation_<preset>.*

  python scripts/reproduce_c4_ablation.py --preset=tiny --seeds=2 --out=results/

Every row trains with the same data order, steps and seeds (seed s drives init and shuffling). Runs live in
--workdir/<row>/seed<s>: finished ones (final.json) are skipped and interrupted ones resume from their last
checkpoint, so the script can be stopped and rerun across sessions. The tables are rewritten after every run.
Step time here is the training run's own median and is as noisy as the machine; scripts/benchmark.py times
the rows interleaved in one process, which is the measurement to quote for overhead.
"""

import csv
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from configs import c4_ablation  # noqa: E402

ROWS = list(c4_ablation.ROWS)
PAPER = {'baseline_24': (157.20, 3.0159, 11.65, 0.095), 'baseline_28': (179.23, 2.9963, 13.23, 0.105),
         'rw': (157.20, 2.9557, 11.93, 0.095), 'lr': (158.40, 2.9624, 12.29, 0.098),
         'pa': (157.22, 2.9512, 12.55, 0.100), 'rw_lr': (158.40, 2.9531, 12.57, 0.099),
         'rw_lr_pa': (160.83, 2.9499, 12.90, 0.104)}  # params (M), test loss, peak memory (GB), step (s)

_PRESET = flags.DEFINE_enum('preset', 'tiny', ['tiny', 'paper'], 'Table 5 preset of configs/c4_ablation.py.')
_SEEDS = flags.DEFINE_integer('seeds', 2, 'Seeds per row.')
_ROWS = flags.DEFINE_list('rows', ROWS, 'Rows to run.')
_OUT = flags.DEFINE_string('out', 'results', 'Where the tables and chart go.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directories; default runs/c4_ablation_<preset>.')
_SET = flags.DEFINE_multi_string('set', [], 'Extra config overrides FIELD=VALUE for every run.')
_COLLECT_ONLY = flags.DEFINE_bool('collect_only', False, 'Only rebuild the tables from finished runs.')


def run_point(row, seed, workdir):
  cmd = [sys.executable, '-m', 'laurel.main', f'--config=configs/c4_ablation.py:{row},preset={_PRESET.value}',
         f'--workdir={workdir}', f'--config.seed={seed}'] + [f'--config.{s}' for s in _SET.value]
  print('+ ' + ' '.join(cmd), flush=True)
  subprocess.run(cmd, cwd=ROOT, check=True)


def compiled_peak_memory(row, workdir: pathlib.Path) -> int:
  """Peak bytes of the row's compiled train step with today's code: one definition for every row, whichever
  code version its training run happened with. Cached in the row's directory, keyed by laurel/'s source and --set."""
  sources = b''.join(p.read_bytes() for p in sorted((ROOT / 'laurel').glob('*.py')))
  code = hashlib.sha256(sources + repr(_SET.value).encode()).hexdigest()
  cache = workdir / row / 'compiled_memory.json'
  if not cache.exists() or json.loads(cache.read_text()).get('code') != code:
    from laurel import train  # pylint: disable=g-import-not-at-top
    config = c4_ablation.get_config(f'{row},preset={_PRESET.value}')
    for assignment in _SET.value:
      common.set_field(config, *common.parse_assignment(assignment))
    cache.write_text(json.dumps({'code': code, 'peak_memory_bytes': train.compiled_peak_memory(config)}) + '\n')
  return json.loads(cache.read_text())['peak_memory_bytes']


def _median(values):
  """Median of the runs that timed any step (a run resumed at its last step times none), else None."""
  values = [v for v in values if v is not None]
  return float(np.median(values)) if values else None


def collect(workdir: pathlib.Path):
  rows, by_seed = [], {}
  for row in ROWS:
    paths = sorted((workdir / row).glob('seed*/final.json'))
    if not paths:
      continue
    finals = [json.loads(p.read_text()) for p in paths]
    by_seed[row] = {p.parent.name: f['eval_loss'] for p, f in zip(paths, finals)}
    losses = np.array(list(by_seed[row].values()))
    rows.append({'name': row, 'seeds': len(finals), 'params_m': finals[0]['params'] / 1e6,
                 'test_loss': float(losses.mean()), 'test_loss_std': float(losses.std(ddof=1)) if len(losses) > 1 else 0.0,
                 'test_losses': by_seed[row],
                 'peak_memory_gb': compiled_peak_memory(row, workdir) / 1e9,
                 'step_time_s': _median([f['avg_step_time_s'] for f in finals]),
                 'paper_params_m': PAPER[row][0], 'paper_test_loss': PAPER[row][1],
                 'paper_peak_memory_gb': PAPER[row][2], 'paper_step_time_s': PAPER[row][3]})
  base = next((r for r in rows if r['name'] == 'baseline_24'), None)
  for r in rows:
    for key in ('params_m', 'test_loss', 'peak_memory_gb', 'step_time_s'):
      r[f'{key}_ratio'] = r[key] / base[key] if base and None not in (r[key], base[key]) else None
      r[f'paper_{key}_ratio'] = r[f'paper_{key}'] / PAPER['baseline_24'][('params_m', 'test_loss', 'peak_memory_gb',
                                                                           'step_time_s').index(key)]
    # Seed noise dwarfs the differences between rows, so compare each row with Baseline-24 on the same seeds.
    shared = sorted(set(by_seed[r['name']]) & set(by_seed.get('baseline_24', {})))
    r['test_loss_ratio'] = (float(np.mean([by_seed[r['name']][s] / by_seed['baseline_24'][s] for s in shared]))
                            if shared else None)
    r['paired_seeds'] = len(shared)
  return rows


def write_tables(rows, out: pathlib.Path, stem: str, command: str):
  out.mkdir(parents=True, exist_ok=True)
  (out / f'{stem}.json').write_text(json.dumps({'command': command, 'rows': rows}, indent=2) + '\n')
  keys = [k for k in rows[0] if k != 'test_losses']
  with (out / f'{stem}.csv').open('w', newline='') as f:
    w = csv.DictWriter(f, keys, extrasaction='ignore')
    w.writeheader()
    w.writerows(rows)
  ratio = lambda v: '—' if v is None else f'{v:.3f}'  # also step times: a run resumed at its end has none
  lines = [f'Command: `{command}`', '',
           '| row | seeds | params (M) | test loss | peak mem (GB) | step (s) | params × | loss × | mem × | step × '
           '| paper params (M) | paper loss | paper mem × | paper step × |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(f"| {r['name']} | {r['seeds']} | {r['params_m']:.3f} | {r['test_loss']:.4f} ± {r['test_loss_std']:.4f} "
                 f"| {r['peak_memory_gb']:.4f} | {ratio(r['step_time_s'])} | {ratio(r['params_m_ratio'])} "
                 f"| {ratio(r['test_loss_ratio'])} | {ratio(r['peak_memory_gb_ratio'])} | {ratio(r['step_time_s_ratio'])} "
                 f"| {r['paper_params_m']:.2f} | {r['paper_test_loss']:.4f} | {r['paper_peak_memory_gb_ratio']:.3f} "
                 f"| {r['paper_step_time_s_ratio']:.3f} |")
  lines += ['', '× columns are ratios to baseline_24 in the same table. Test loss is the mean ± sample std over '
            'seeds of the final eval loss on the held-out split; its ratio (loss ×) is paired: each row against '
            'baseline_24 on the seeds both have, averaged. Peak memory is the compiled train step.']
  (out / f'{stem}.md').write_text('\n'.join(lines) + '\n')
  plot(rows, out / f'{stem}.png')


def plot(rows, path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  names = [r['name'] for r in rows]
  fig, (ours, paper) = plt.subplots(1, 2, figsize=(11, 4))
  # One point per seed, coloured by seed: rows compare within a colour; the spread between colours is seed noise.
  seeds = sorted({s for r in rows for s in r['test_losses']})
  for i, seed in enumerate(seeds):
    xs = [j for j, r in enumerate(rows) if seed in r['test_losses']]
    ys = [rows[j]['test_losses'][seed] for j in xs]
    ours.plot(xs, ys, 'o-', color=f'C{i}', label=seed, alpha=0.8)
  ours.set_xticks(range(len(names)), names)
  ours.legend()
  ours.set_title(f"this repo ({_PRESET.value} preset), one line per seed")
  paper.bar(names, [r['paper_test_loss'] for r in rows], color='tab:gray')
  paper.set_title('paper, Table 5')
  for ax, vals in ((ours, [v for r in rows for v in r['test_losses'].values()]),
                   (paper, [r['paper_test_loss'] for r in rows])):
    lo, hi = min(vals), max(vals)
    ax.set_ylim(lo - 0.6 * (hi - lo + 1e-3), hi + 0.6 * (hi - lo + 1e-3))
    ax.set_ylabel('test loss')
    ax.tick_params(axis='x', rotation=30)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  workdir = pathlib.Path(_WORKDIR.value or f'runs/c4_ablation_{_PRESET.value}').resolve()
  unknown = sorted(set(_ROWS.value) - set(ROWS))
  if unknown:
    sys.exit(f'error: --rows={unknown[0]!r}: unknown (known: {", ".join(ROWS)})')
  command = ' '.join(['python', os.path.relpath(__file__, ROOT)] + sys.argv[1:])
  stem = f'c4_ablation_{_PRESET.value}'
  for seed in ([] if _COLLECT_ONLY.value else range(_SEEDS.value)):
    for row in _ROWS.value:  # seed-major, so every row has a first seed early
      point = workdir / row / f'seed{seed}'
      if not (point / 'final.json').exists():
        run_point(row, seed, point)
      rows = collect(workdir)
      write_tables(rows, pathlib.Path(_OUT.value), stem, command)
  rows = collect(workdir)
  if rows:
    write_tables(rows, pathlib.Path(_OUT.value), stem, command)
    print((pathlib.Path(_OUT.value) / f'{stem}.md').read_text())


if __name__ == '__main__':
  app.run(main)
