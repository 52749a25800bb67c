"""Trains a table of rows on Table 5's setup: results/<table>_<preset>.{md,csv,json,png}.

  python scripts/reproduce_c4_ablation.py --preset=tiny|gpu|paper --seeds=3 [--out=results] [--table=residual_designs]
      [--rows=...] [--set=<field>=<value>] [--workdir=gs://BUCKET/c4_ablation]
      [--launch=local|print|tpu --tpu=NAME --zone=ZONE --accelerator=v6e-16 [--nosetup]]
      [--evaluate=text:held_out/*.txt --evaluate=tasks/mc.jsonl --evaluate=hellaswag [--tfds_data_dir=DIR]]

--table=c4_ablation (default) is Table 5, the LAuReL variants, beside the paper's figures; residual_designs the
other residual-stream designs (configs/residual_designs.py), one field apart from Baseline-24.

The tables go to --out, by default the --workdir (runs/<table>_<preset>): the committed results/ only with
--out=results. Every row trains with the same data order, steps and seeds in --workdir/<row>/seed<s> (local or
gs://; log: train.log), here or, with --launch=tpu, on a TPU slice through scripts/launch_tpu.py (--launch=print
prints those commands). A run that fails is marked failed (failed.json) and the others go on; rerunning skips
finished runs and resumes the others, and the tables are rewritten after every run. Peak memory is each run's compiled step; step time
its median step, as noisy as the machine: quote scripts/benchmark.py for overhead.

Every row's test loss is compared with Baseline-24's seed by seed: the table gives the mean paired difference, its
95% Student-t interval over the seeds both have, their count, and whether the interval excludes zero (resolved); and
the eval set's size and its own noise (final.json's held_out: the eval loss's standard error over its batches)
beside the seed-to-seed spread. --from_json=<table>.json recomputes those from a table's JSON, which holds every
run's test loss, and rewrites the table without training; --from_json=<table>.json,<rerun>.json takes the rows a
later run retrained (--rows=...) from its table instead, and names its command.

--preset=gpu is sized for one H100 (configs/c4_ablation.py says why):
  python scripts/reproduce_c4_ablation.py --preset=gpu --rows=baseline_24,baseline_28,rw_lr_pa --seeds=3

--evaluate scores every finished run's last checkpoint on laurel.evaluate's tasks, here (from gs:// too), once per
run and task (<run>/eval_<task>.json is kept); the tables gain each task's metrics, averaged over seeds, with
ratios to Baseline-24: bits per byte for text, accuracy, length-normalised accuracy and the correct choice's mean
log-likelihood for multiple choice.
"""

import json
import statistics

import common  # puts the repo root on sys.path
import paper
from absl import app, flags
from etils import epath

from laurel import config_lib, evaluate
from laurel.config_lib import InputError

BASELINE = 'baseline_24'
KEYS = ('params_m', 'test_loss', 'peak_memory_gb', 'step_time_s')  # measured beside the paper's, with ratios
# A row's figures as collect reads them from its runs (summarise derives the rest; eval_* are laurel.evaluate's).
MEASURED = ('name', 'seeds', 'failed', 'params', 'test_losses', 'peak_memory_gb', 'step_time_s', 'held_out',
            'held_out_loss_se')
EVAL_METRICS = ('bits_per_byte', 'accuracy', 'accuracy_norm', 'correct_loglik')  # of laurel.evaluate's results

_TABLE = flags.DEFINE_enum('table', 'c4_ablation', common.TABLES, 'configs/<table>.py: whose rows to train.')
_PRESET = flags.DEFINE_enum('preset', 'tiny', ['tiny', 'gpu', 'paper'], "Preset of the table's config.")
_SEEDS = flags.DEFINE_integer('seeds', 2, 'Seeds per row.')
_ROWS = flags.DEFINE_list('rows', None, "Rows to run; default: all of the table's.")
_OUT = flags.DEFINE_string('out', None, 'Where the tables and chart go; default: the --workdir. The committed '
                           'results/ only when asked: --out=results.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directories; default runs/<table>_<preset>.')
_SET = flags.DEFINE_multi_string('set', [], 'Extra config override <field>=<value> for every run it changes '
                                 'something in (repeatable).')
_COLLECT_ONLY = flags.DEFINE_bool('collect_only', False, 'Only rebuild the tables from finished runs.')
_FROM_JSON = flags.DEFINE_list('from_json', None, "Only recompute a table's statistics from its JSON (which holds "
                               "every run's test loss) and rewrite it; --out: default the first JSON's folder. "
                               "Several: a later table's rows replace the earlier's of the same name (rows rerun).")
_EVALUATE = flags.DEFINE_multi_string('evaluate', [], "A laurel.evaluate task for every finished run (repeatable).")
_TFDS_DATA_DIR = flags.DEFINE_string('tfds_data_dir', '', "TFDS's data_dir for --evaluate's TFDS tasks.")
_LAUNCH = common.define_launch_flags()


def collect(workdir: epath.Path, rows_in_order, with_paper: bool) -> list[dict]:
  """Each row's finished runs (their final.json) with the table's statistics (summarise)."""
  def median(values):  # over the runs that report it (one resumed at its last step times no step)
    return statistics.median(values) if (values := [v for v in values if v is not None]) else None

  rows = []
  for row in rows_in_order:
    runs = {p.name: common.point_status(p) for p in sorted((workdir / row).glob('seed*'))}
    if not runs:
      continue
    paths = [workdir / row / seed / 'final.json' for seed, status in runs.items() if status == 'done']
    finals = [json.loads(p.read_text()) for p in paths]
    held_out = [f['held_out'] for f in finals if (f.get('held_out') or {}).get('loss_se') is not None]
    held_out = {**held_out[0], 'loss_se': median([h['loss_se'] for h in held_out])} if held_out else None
    peak = median([f.get('peak_memory_bytes') for f in finals])
    rows.append({'name': row, 'seeds': len(finals), 'failed': [s for s, status in runs.items() if status == 'failed'],
                 'params': finals[0]['params'] if finals else None,
                 'test_losses': {p.parent.name: f['eval_loss'] for p, f in zip(paths, finals)},
                 'peak_memory_gb': peak and peak / 1e9, 'step_time_s': median([f.get('median_step_time_s')
                                                                                for f in finals]),
                 'held_out': held_out, 'held_out_loss_se': held_out and held_out['loss_se']})
  add_evals(workdir, rows)
  return summarise(rows, with_paper)


def summarise(rows: list[dict], with_paper: bool) -> list[dict]:
  """The statistics of rows holding their runs' figures (collect's, or a table's JSON): test loss mean ± std over
  seeds, ratios to Baseline-24 (the loss ratio paired by seed), and the paired difference to Baseline-24 with its
  t-interval over seeds and whether it excludes zero."""
  losses = {r['name']: r['test_losses'] for r in rows}
  for r in rows:
    r['params_m'] = r['params'] / 1e6 if r['params'] is not None else None
    r['test_loss'], r['test_loss_std'] = common.mean_and_spread(r['test_losses'].values())
    if with_paper:
      r.update({f'paper_{k}': paper.TABLE5[r['name']][k] for k in KEYS})
  base = next((r for r in rows if r['name'] == BASELINE), None)
  for r in rows:
    for key in KEYS:
      r[f'{key}_ratio'] = r[key] / base[key] if base and None not in (r[key], base[key]) else None
      if with_paper:
        r[f'paper_{key}_ratio'] = paper.TABLE5[r['name']][key] / paper.TABLE5[BASELINE][key]
    # Seed noise dwarfs the differences between rows, so compare each row with Baseline-24 on the same seeds.
    shared = sorted(set(losses[r['name']]) & set(losses.get(BASELINE, {})))
    r['test_loss_ratio'] = (statistics.fmean(losses[r['name']][s] / losses[BASELINE][s] for s in shared)
                            if shared else None)
    r['paired_seeds'] = len(shared)
    own = losses[r['name']] if r['name'] != BASELINE else {}  # the reference has no difference of its own
    r.update(common.paired_columns(own, losses.get(BASELINE, {}), 'test_loss'))
  return rows


def from_json(path: str, with_paper: bool, reruns=()) -> tuple[dict, list[dict]]:
  """A table's JSON (a previous run of this script) with its statistics recomputed by summarise; the rows of each
  table in `reruns` replace its rows of the same name, and its command joins `result['reruns']`."""
  result = json.loads(epath.Path(path).read_text())
  rows = {r['name']: r for r in result['rows']}
  for rerun in map(json.loads, map(epath.Path.read_text, map(epath.Path, reruns))):
    replaced = [r['name'] for r in rerun['rows'] if r['name'] in rows]
    result.setdefault('reruns', []).append({'rows': replaced, 'command': rerun['command']})
    rows.update((name, next(r for r in rerun['rows'] if r['name'] == name)) for name in replaced)
  for r in rows.values():  # tables written before the integer count kept params_m only
    r.setdefault('params', None if r.get('params_m') is None else round(r['params_m'] * 1e6))
  rows = [{k: v for k, v in r.items() if k in MEASURED or k.startswith('eval_')} for r in rows.values()]
  return result, summarise(rows, with_paper)


def add_evals(workdir: epath.Path, rows):
  """eval_<task>_<metric> (mean over the done runs' eval_<task>.json) and its ratio to Baseline-24, per row."""
  for r in rows:
    per_task = {}
    for path in sorted(workdir.glob(f"{r['name']}/seed*/eval_*.json")):
      if common.point_status(path.parent) == 'done':
        result = json.loads(path.read_text())
        for metric in EVAL_METRICS:
          if metric in result:
            per_task.setdefault(f"eval_{result['task']}_{metric}", []).append(result[metric])
    r.update({key: statistics.fmean(values) for key, values in per_task.items()})
  base = next((r for r in rows if r['name'] == BASELINE), {})
  for key in dict.fromkeys(k for r in rows for k in r if k.startswith('eval_') and not k.endswith('_ratio')):
    for r in rows:
      r[f'{key}_ratio'] = r[key] / base[key] if key in r and base.get(key) else None


def evaluate_runs(workdir: epath.Path, rows_in_order):
  """Scores each finished run on the --evaluate tasks it has no eval_<task>.json for."""
  for run in (p for row in rows_in_order for p in sorted((workdir / row).glob('seed*'))):
    todo = [t for t in _EVALUATE.value if not (run / f'eval_{evaluate.task_name(t)}.json').exists()]
    if todo and common.point_status(run) == 'done':
      print(f'= evaluate {run}: {", ".join(todo)}', flush=True)
      for result in evaluate.evaluate_run(str(run), todo, tfds_data_dir=_TFDS_DATA_DIR.value):
        print(json.dumps(result), flush=True)


def markdown(rows, command: str, with_paper: bool) -> str:
  ratio = lambda v, digits=3: '—' if v is None else f'{v:.{digits}f}'  # a run resumed at its end times no step
  paper_head = ' paper params (M) | paper loss | paper mem × | paper step × |' if with_paper else ''
  seeds = lambda r: f"{r['seeds']}" + (f" (failed: {', '.join(r['failed'])})" if r['failed'] else '')
  lines = [f'Command: `{command}`', '',
           f'| row | seeds | params | test loss | Δ loss vs {BASELINE} ({common.CI_PERCENT} CI) | pairs | resolved '
           '| peak mem (GB) | step (s) | params × | loss × | mem × | step × |' + paper_head,
           '|---' * (17 if with_paper else 13) + '|']
  lines += [f"| {r['name']} | {seeds(r)} | {common.integer(r['params'])} "
            f"| {common.with_spread(r['test_loss'], r['test_loss_std'])} "
            f"| {' | '.join(common.paired_cells(r, 'test_loss', reference=r['name'] == BASELINE))} "
            f"| {ratio(r['peak_memory_gb'], 4)} | {ratio(r['step_time_s'])} | {ratio(r['params_m_ratio'])} "
            f"| {ratio(r['test_loss_ratio'])} | {ratio(r['peak_memory_gb_ratio'])} | {ratio(r['step_time_s_ratio'])} |"
            + (f" {r['paper_params_m']:.2f} | {r['paper_test_loss']:.4f} | {r['paper_peak_memory_gb_ratio']:.3f} "
               f"| {r['paper_step_time_s_ratio']:.3f} |" if with_paper else '') for r in rows]
  if evals := list(dict.fromkeys(k for r in rows for k in r if k.startswith('eval_') and not k.endswith('_ratio'))):
    lines += ['', '| row | ' + ' | '.join(f'{k[5:]} | ×' for k in evals) + ' |', '|---' * (1 + 2 * len(evals)) + '|']
    lines += [f"| {r['name']} | " + ' | '.join(f"{ratio(r.get(k), 4)} | {ratio(r.get(k + '_ratio'))}" for k in evals)
              + ' |' for r in rows]
  lines += ['', f'× columns are ratios to {BASELINE} in the same table. Test loss is the mean ± sample std over '
            'seeds of the final eval loss on the held-out split (no ± for one seed). Δ loss is paired: each row '
            f"minus {BASELINE} on the seeds both have (pairs), with the {common.CI_PERCENT} Student-t interval over "
            'those seeds; resolved: the interval excludes zero (— below two pairs). loss × is the paired ratio. '
            'Peak memory is the compiled train step.'
            + (' eval_<task>_<metric>: laurel.evaluate on the last checkpoint, mean over seeds.' if evals else ''),
            '', noise_line(rows)]
  return '\n'.join(lines) + '\n'


def noise_line(rows) -> str:
  """The eval set's size and its own sampling noise beside the seeds' (what a paired difference must clear)."""
  base = next((r for r in rows if r['name'] == BASELINE), {})
  diff_sds = [r['test_loss_diff_sd'] for r in rows if r['name'] != BASELINE and r['test_loss_diff_sd'] is not None]
  seeds = (f"{BASELINE}'s seed-to-seed std {base['test_loss_std']:.4f}" if base.get('test_loss_std') is not None
           else f'no seed-to-seed std of {BASELINE} (one seed)')
  paired = (f', the paired differences\' std {min(diff_sds):.4f}–{max(diff_sds):.4f}' if diff_sds else '')
  if not (noise := common.eval_noise([r.get('held_out') for r in rows])):
    return (f'Eval noise: not recorded by these runs (final.json\'s held_out, written since laurel.stats); '
            f'{seeds}{paired}.')
  return (f"Eval noise: {noise} (each row's median over its seeds; the same eval set for every run), beside "
          f'{seeds}{paired}.')


def plot(rows, with_paper: bool, title: str):
  """Test loss per row, one line per seed (rows compare within a colour; the spread between colours is seed
  noise); the paired difference to Baseline-24 with its interval; the paper's losses beside them."""
  width = max(4.5, 0.55 * len(rows))  # per panel, so that the rotated row names do not overlap
  panels = 2 + with_paper
  fig, axes = common.plt.subplots(1, panels, figsize=(width * panels, 4.8), squeeze=False)
  ours, diffs = axes[0, 0], axes[0, 1]
  for i, seed in enumerate(sorted({s for r in rows for s in r['test_losses']})):
    xs = [j for j, r in enumerate(rows) if seed in r['test_losses']]
    ours.plot(xs, [rows[j]['test_losses'][seed] for j in xs], 'o-', color=f'C{i}', label=seed, alpha=0.8)
  ours.legend()
  ours.set_ylabel('test loss')
  shown = [(j, r) for j, r in enumerate(rows) if r['test_loss_diff'] is not None and r['name'] != BASELINE]
  for j, r in shown:
    low, high, mean = r['test_loss_diff_low'], r['test_loss_diff_high'], r['test_loss_diff']
    diffs.errorbar([j], [mean], yerr=None if low is None else [[mean - low], [high - mean]], fmt='o', capsize=4,
                   color='tab:green' if r['test_loss_resolved'] else 'tab:gray')
  diffs.axhline(0, color='black', linewidth=0.8)
  diffs.set_ylabel(f'Δ test loss vs {BASELINE}')
  titled = [(ours, f'{title}: one line per seed'),
            (diffs, f'paired Δ and its {common.CI_PERCENT} t-interval over seeds (green: excludes 0)')]
  if with_paper:
    theirs = axes[0, 2]
    theirs.bar(range(len(rows)), losses := [r['paper_test_loss'] for r in rows], color='tab:gray')
    theirs.set_ylim(min(losses) - (pad := 0.6 * (max(losses) - min(losses)) + 1e-3), max(losses) + pad)
    theirs.set_ylabel('test loss')
    titled.append((theirs, 'paper, Table 5'))
  for ax, text in titled:
    common.fit_title(ax, text)
    ax.set_xticks(range(len(rows)), [r['name'] for r in rows], rotation=35, ha='right', rotation_mode='anchor')
  fig.tight_layout()
  return fig


def restate(table: str, all_rows, with_paper: bool):
  """--from_json: the table of a previous run of this script, its statistics recomputed (from_json), rewritten."""
  result, rows = from_json(_FROM_JSON.value[0], with_paper, _FROM_JSON.value[1:])
  if unknown := [r['name'] for r in rows if r['name'] not in all_rows]:
    raise InputError(f'--from_json={_FROM_JSON.value[0]}: row {unknown[0]!r} is not in --table={table}')
  out = epath.Path(_OUT.value or epath.Path(_FROM_JSON.value[0]).parent)
  stem, command, reruns = f'{table}_{_PRESET.value}', common.command(), result.get('reruns', [])
  text = markdown(rows, result['command'], with_paper)
  text += ''.join(f"\nRows {', '.join(r['rows'])} rerun: `{r['command']}`\n" for r in reruns)
  text += f'\nStatistics recomputed from the JSON: `{command}`\n'
  common.write_results(out, stem, {'command': result['command'], 'reruns': reruns, 'statistics_command': command,
                                   'rows': rows}, rows, text,
                       plot(rows, with_paper, f'{table}, this repo ({_PRESET.value} preset)'))
  print(text)


def reproduce():
  table, all_rows = _TABLE.value, config_lib.table_rows(_TABLE.value)
  chosen, with_paper = _ROWS.value or all_rows, table == 'c4_ablation'
  if unknown := sorted(set(chosen) - set(all_rows)):
    raise InputError(f'--rows={unknown[0]!r}: unknown (known: {", ".join(all_rows)})')
  if _FROM_JSON.value:
    restate(table, all_rows, with_paper)
    return
  launcher = common.Launcher(_LAUNCH)
  specs = {row: config_lib.resolve_spec(f'{table}:{row},preset={_PRESET.value}') for row in chosen}
  sets = {row: common.sets_that_apply(spec, _SET.value) for row, spec in specs.items()}
  for row, spec in specs.items():  # a bad --set, or a batch the devices cannot take, fails here, before anything runs
    launcher.load(spec, sets[row])
  for task in _EVALUATE.value:
    evaluate.check_task(task)
  workdir = epath.Path(_WORKDIR.value or f'runs/{table}_{_PRESET.value}')  # local or gs://
  out, stem, command = epath.Path(_OUT.value or workdir), f'{table}_{_PRESET.value}', common.command()
  title = f'{table}, this repo ({_PRESET.value} preset)'

  def write_tables():
    if rows := collect(workdir, all_rows, with_paper):
      common.write_results(out, stem, {'command': command, 'rows': rows}, rows,
                           markdown(rows, command, with_paper), plot(rows, with_paper, title))
    return rows

  seeds = [] if _COLLECT_ONLY.value else range(_SEEDS.value)  # seed-major, so every row has a first seed early
  points = [{'name': f'{row}/seed{seed}', 'dir': workdir / row / f'seed{seed}', 'config': specs[row],
             'overrides': common.config_flags([f'seed={seed}', *sets[row]])} for seed in seeds for row in chosen]
  failed = launcher.run(points, 'train.log', write_tables)
  if _LAUNCH['launch'].value == 'print' and not _COLLECT_ONLY.value:
    return
  if _EVALUATE.value:
    evaluate_runs(workdir, all_rows)
  if write_tables():
    print((out / f'{stem}.md').read_text())
  if failed:
    common.fail(f'{len(failed)} run(s) failed: {", ".join(failed)}', code=1)


if __name__ == '__main__':
  app.run(common.main(reproduce))
