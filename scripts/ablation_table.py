"""The tables of scripts/reproduce_c4_ablation.py, without its flags (so that tests call them in-process): each row's
figures collected from its runs, their statistics against Baseline-24, the provenance of every seed, the Markdown
whose first line says what the table can claim, and the chart."""

import json
import re
import statistics

import cli  # puts the repo root on sys.path  # noqa: F401
import launching
import paper
import tables
from etils import epath

from laurel.cli import files
from laurel.config_lib import InputError

BASELINE = 'baseline_24'
KEYS = ('params_m', 'test_loss', 'peak_memory_gb', 'step_time_s')  # measured beside the paper's, with ratios
# A row's figures as collect reads them from its runs (summarise derives the rest; eval_* are laurel.serve.evaluate's).
MEASURED = ('name', 'seeds', 'failed', 'params', 'test_losses', 'peak_memory_gb', 'step_time_s', 'held_out',
            'held_out_loss_se', 'runs')
PROVENANCE = 'provenance.json'  # in each run: the commit, device and corpus it trained on (written as it starts)
EVAL_METRICS = ('bits_per_byte', 'accuracy', 'accuracy_norm', 'correct_loglik')  # of laurel.serve.evaluate's results

def collect(workdir: epath.Path, rows_in_order, with_paper: bool) -> list[dict]:
  """Each row's finished runs (their final.json) with the table's statistics (summarise)."""
  def median(values):  # over the runs that report it (one resumed at its last step times no step)
    return statistics.median(values) if (values := [v for v in values if v is not None]) else None

  rows = []
  for row in rows_in_order:
    runs = {p.name: launching.point_status(p) for p in sorted((workdir / row).glob('seed*'))}
    if not runs:
      continue
    paths = [workdir / row / seed / 'final.json' for seed, status in runs.items() if status == 'done']
    finals = [json.loads(p.read_text()) for p in paths]
    provenance = {p.parent.name: run_provenance(p.parent, f) for p, f in zip(paths, finals)}
    held_out = [f['held_out'] for f in finals if (f.get('held_out') or {}).get('loss_se') is not None]
    held_out = {**held_out[0], 'loss_se': median([h['loss_se'] for h in held_out])} if held_out else None
    peak = median([f.get('peak_memory_bytes') for f in finals])
    rows.append({'name': row, 'seeds': len(finals), 'failed': [s for s, status in runs.items() if status == 'failed'],
                 'params': finals[0]['params'] if finals else None,
                 'test_losses': {p.parent.name: f['eval_loss'] for p, f in zip(paths, finals)},
                 'peak_memory_gb': peak and peak / 1e9, 'step_time_s': median([f.get('median_step_time_s')
                                                                                for f in finals]),
                 'held_out': held_out, 'held_out_loss_se': held_out and held_out['loss_se'], 'runs': provenance})
  add_evals(workdir, rows)
  check_one_corpus(rows, f'--workdir={workdir}')
  return summarise(rows, with_paper)


def run_provenance(run: epath.Path, final: dict) -> dict:
  """The commit (final.json's: the code that finished it), device and corpus fingerprint a run trained on."""
  path = run / PROVENANCE
  recorded = json.loads(path.read_text()) if path.exists() else {}
  return {'commit': final.get('commit') or recorded.get('commit'), 'device': recorded.get('device'),
          'corpus': recorded.get('corpus')}


def check_one_corpus(rows: list[dict], where: str):
  """One-line InputError where the rows' runs trained on different corpora: their losses do not compare."""
  seen = {}
  for r in rows:
    for seed, run in (r.get('runs') or {}).items():
      seen.setdefault(run.get('corpus'), f"{r['name']}/{seed}")
  seen.pop(None, None)  # runs that recorded none (remote data, or trained before the fingerprint)
  if len(seen) > 1:
    (first, a), (second, b) = list(seen.items())[:2]
    raise InputError(f'{where}: {a} trained on corpus {first}, {b} on corpus {second}: losses on different data do '
                     'not compare; merge only tables of one corpus')


def summarise(rows: list[dict], with_paper: bool) -> list[dict]:
  """The statistics of rows holding their runs' figures (collect's, or a table's JSON): test loss mean ± std over
  seeds, ratios to Baseline-24 (the loss ratio paired by seed), and the paired difference to Baseline-24 with its
  t-interval over seeds and whether it excludes zero."""
  losses = {r['name']: r['test_losses'] for r in rows}
  for r in rows:
    r['params_m'] = r['params'] / 1e6 if r['params'] is not None else None
    r['test_loss'], r['test_loss_std'] = tables.mean_and_spread(r['test_losses'].values())
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
    r.update(tables.paired_columns(own, losses.get(BASELINE, {}), 'test_loss'))
  return rows


def from_json(path: str, with_paper: bool, reruns=()) -> tuple[dict, list[dict]]:
  """A table's JSON (a previous run of this script) with its statistics recomputed by summarise; the seeds of each
  table in `reruns` (another machine's, or rows rerun) merge into its rows (merge_row), and its command joins
  `result['reruns']`. Tables whose runs trained on different corpora are refused."""
  result = json.loads(epath.Path(path).read_text())
  rows = {r['name']: r for r in result['rows']}
  for rerun in map(json.loads, map(epath.Path.read_text, map(epath.Path, reruns))):
    result.setdefault('reruns', []).append({'rows': [r['name'] for r in rerun['rows']], 'command': rerun['command']})
    rows.update((r['name'], merge_row(rows.get(r['name']), r)) for r in rerun['rows'])
  for r in rows.values():  # tables written before the integer count kept params_m only
    r.setdefault('params', None if r.get('params_m') is None else round(r['params_m'] * 1e6))
  rows = [{k: v for k, v in r.items() if k in MEASURED or k.startswith('eval_')} for r in rows.values()]
  check_one_corpus(rows, f'--from_json={",".join([path, *reruns])}')
  return result, summarise(rows, with_paper)


def merge_row(earlier: dict | None, later: dict) -> dict:
  """One row from two tables' rows of it: every seed's loss and provenance (a seed in both: the later's), the
  later's figures where it has them."""
  if earlier is None:
    return later
  merged = {**earlier, **{k: v for k, v in later.items() if v is not None}}
  merged['test_losses'] = {**earlier['test_losses'], **later['test_losses']}
  merged['runs'] = {**(earlier.get('runs') or {}), **(later.get('runs') or {})}
  merged['seeds'] = len(merged['test_losses'])
  failed = dict.fromkeys([*earlier['failed'], *later['failed']])
  merged['failed'] = [s for s in failed if s not in merged['test_losses']]
  return merged


def add_evals(workdir: epath.Path, rows):
  """eval_<task>_<metric> (mean over the done runs' eval_<task>.json) and its ratio to Baseline-24, per row."""
  for r in rows:
    per_task = {}
    for path in sorted(workdir.glob(f"{r['name']}/seed*/eval_*.json")):
      if launching.point_status(path.parent) == 'done':
        result = json.loads(path.read_text())
        for metric in EVAL_METRICS:
          if metric in result:
            per_task.setdefault(f"eval_{result['task']}_{metric}", []).append(result[metric])
    r.update({key: statistics.fmean(values) for key, values in per_task.items()})
  base = next((r for r in rows if r['name'] == BASELINE), {})
  for key in dict.fromkeys(k for r in rows for k in r if k.startswith('eval_') and not k.endswith('_ratio')):
    for r in rows:
      r[f'{key}_ratio'] = r[key] / base[key] if key in r and base.get(key) else None


# What a preset's table can show, before what its intervals show (claim).
SCALES = {'tiny': ('**A pipeline check, not a result** (tiny preset: runs thousands of times smaller than the '
                   "paper's, on CPU): it shows that every row trains and the table builds, not how the rows rank at "
                   "the paper's scale"),
          'gpu': "**What this table can claim** (gpu preset: runs hundreds of times smaller than the paper's)"}


def claim(rows, preset: str) -> str:
  """The table's first line: what its preset can show, and which rows' intervals exclude zero."""
  resolved = [f"{r['name']} ({'lower' if r['test_loss_diff'] < 0 else 'higher'})" for r in rows
              if r['name'] != BASELINE and r['test_loss_resolved']]
  intervals = [r for r in rows if r['name'] != BASELINE and r['test_loss_diff_low'] is not None]
  if not intervals:
    found = f'no row has two seeds paired with {BASELINE}, so no interval, and no difference is shown'
  elif resolved:
    found = (f"the {tables.CI_PERCENT} interval of the paired Δ loss against {BASELINE} excludes zero for "
             f"{', '.join(resolved)} only; the other rows are not told apart from it")
  else:
    found = (f"no row's {tables.CI_PERCENT} interval of the paired Δ loss against {BASELINE} excludes zero: no "
             'row is told apart from it')
  return f"{SCALES.get(preset, f'**What this table can claim** ({preset} preset)')}; at this scale {found}."


def markdown(rows, command: str, with_paper: bool, preset: str) -> str:
  ratio = lambda v, digits=3: '—' if v is None else f'{v:.{digits}f}'  # a run resumed at its end times no step
  seeds = lambda r: f"{r['seeds']}" + (f" (failed: {', '.join(r['failed'])})" if r['failed'] else '')
  lines = [claim(rows, preset), '', f'Command: `{command}`', '',
           f'| row | seeds | params | test loss | Δ loss vs {BASELINE} ({tables.CI_PERCENT} CI) | pairs | resolved '
           '| peak mem (GB) | step (s) | params × | loss × | mem × | step × |', '|---' * 13 + '|']
  lines += [f"| {r['name']} | {seeds(r)} | {tables.integer(r['params'])} "
            f"| {tables.with_spread(r['test_loss'], r['test_loss_std'])} "
            f"| {' | '.join(tables.paired_cells(r, 'test_loss', reference=r['name'] == BASELINE))} "
            f"| {ratio(r['peak_memory_gb'], 4)} | {ratio(r['step_time_s'])} | {ratio(r['params_m_ratio'])} "
            f"| {ratio(r['test_loss_ratio'])} | {ratio(r['peak_memory_gb_ratio'])} | {ratio(r['step_time_s_ratio'])} |"
            for r in rows]
  if evals := list(dict.fromkeys(k for r in rows for k in r if k.startswith('eval_') and not k.endswith('_ratio'))):
    lines += ['', '| row | ' + ' | '.join(f'{k[5:]} | ×' for k in evals) + ' |', '|---' * (1 + 2 * len(evals)) + '|']
    lines += [f"| {r['name']} | " + ' | '.join(f"{ratio(r.get(k), 4)} | {ratio(r.get(k + '_ratio'))}" for k in evals)
              + ' |' for r in rows]
  lines += ['', f'× columns are ratios to {BASELINE} in the same table. Test loss is the mean ± sample std over '
            'seeds of the final eval loss on the held-out split (no ± for one seed). Δ loss is paired: each row '
            f"minus {BASELINE} on the seeds both have (pairs), with the {tables.CI_PERCENT} Student-t interval over "
            'those seeds; resolved: the interval excludes zero (— below two pairs). loss × is the paired ratio. '
            'Peak memory is the compiled train step.'
            + (' eval_<task>_<metric>: laurel.serve.evaluate on the last checkpoint, mean over seeds.' if evals else ''),
            '', noise_line(rows)]
  if with_paper:
    lines += ['', "The paper's Table 5, at its own scale (157–179M parameters, ~10B tokens of C4, TPU v6e 4×4; one "
              'run per row, no interval): not comparable with the figures above, only the direction of its ratios.', '',
              "| row | paper's params (M) | paper's test loss | paper's mem × | paper's step × |", '|---' * 5 + '|']
    lines += [f"| {r['name']} | {r['paper_params_m']:.2f} | {r['paper_test_loss']:.4f} "
              f"| {r['paper_peak_memory_gb_ratio']:.3f} | {r['paper_step_time_s_ratio']:.3f} |" for r in rows]
  return '\n'.join(lines) + '\n'


def noise_line(rows) -> str:
  """The eval set's size and its own sampling noise beside the seeds' (what a paired difference must clear)."""
  base = next((r for r in rows if r['name'] == BASELINE), {})
  diff_sds = [r['test_loss_diff_sd'] for r in rows if r['name'] != BASELINE and r['test_loss_diff_sd'] is not None]
  seeds = (f"{BASELINE}'s seed-to-seed std {base['test_loss_std']:.4f}" if base.get('test_loss_std') is not None
           else f'no seed-to-seed std of {BASELINE} (one seed)')
  paired = (f', the paired differences\' std {min(diff_sds):.4f}–{max(diff_sds):.4f}' if diff_sds else '')
  if not (noise := tables.eval_noise([r.get('held_out') for r in rows])):
    return (f'Eval noise: not recorded by these runs (final.json\'s held_out, written since laurel.stats); '
            f'{seeds}{paired}.')
  return (f"Eval noise: {noise} (each row's median over its seeds; the same eval set for every run), beside "
          f'{seeds}{paired}.')


def plot(rows, with_paper: bool, title: str):
  """Test loss per row, one line per seed (rows compare within a colour; the spread between colours is seed
  noise); the paired difference to Baseline-24 with its interval; the paper's losses beside them."""
  width = max(4.5, 0.55 * len(rows))  # per panel, so that the rotated row names do not overlap
  panels = 2 + with_paper
  fig, axes = tables.plt.subplots(1, panels, figsize=(width * panels, 4.8), squeeze=False)
  ours, diffs = axes[0, 0], axes[0, 1]
  for i, seed in enumerate(sorted({s for r in rows for s in r['test_losses']})):
    xs = [j for j, r in enumerate(rows) if seed in r['test_losses']]
    ours.plot(xs, [rows[j]['test_losses'][seed] for j in xs], 'o-', color=f'C{i}', label=seed, alpha=0.8)
  if ours.lines:  # no run finished yet: no line, and no legend
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
            (diffs, f'paired Δ and its {tables.CI_PERCENT} t-interval over seeds (green: excludes 0)')]
  if with_paper:  # bars from zero: the difference itself, never a loss on a cut axis
    theirs = axes[0, 2]
    theirs.bar(range(len(rows)), [r['paper_test_loss'] - paper.TABLE5[BASELINE]['test_loss'] for r in rows],
               color='tab:gray')
    theirs.axhline(0, color='black', linewidth=0.8)
    theirs.set_ylabel(f'Δ test loss vs {BASELINE}')
    titled.append((theirs, "the paper's Δ (Table 5, at its scale: 157–179M params, ~10B tokens; one run, no "
                           'interval)'))
  for ax, text in titled:
    tables.fit_title(ax, text)
    ax.set_xticks(range(len(rows)), [r['name'] for r in rows], rotation=35, ha='right', rotation_mode='anchor')
  fig.tight_layout()
  return fig


def tables_written(paths) -> str:
  """The closing lines: each file the tables went to."""
  return 'tables written:\n' + ''.join(f'  {path}\n' for path in paths)


def provenance_recorder(launcher, configs: dict):
  """before(point) for run_points: <run>/provenance.json (the commit, device and corpus) as a run first starts."""
  from laurel.run import metrics_log  # pylint: disable=import-outside-toplevel  # jax: only where needed
  corpora = {row: launching.corpus_fingerprint(config.data) if not launcher.on_slice else None
             for row, config in configs.items()}

  def record(point):
    path = point['dir'] / PROVENANCE
    if not path.exists():
      device = launcher.accelerator if launcher.on_slice else launching.local_device_kind()
      files.write_text_atomic(path, json.dumps({'commit': metrics_log.code_commit(), 'device': device,
                                                'corpus': corpora[point['row']]}) + '\n')
  return record, corpora


def check_corpora(workdir: epath.Path, corpora: dict):
  """One-line InputError before anything trains where a run in `workdir` started on another corpus than this
  machine's (the installed Python sources differ between machines): resuming it would mix two corpora."""
  for row, here in corpora.items():
    for run in sorted((workdir / row).glob('seed*')):
      recorded = json.loads((run / PROVENANCE).read_text()).get('corpus') if (run / PROVENANCE).exists() else None
      if None not in (here, recorded) and recorded != here:
        raise InputError(f'--workdir={workdir}: {row}/{run.name} trained on corpus {recorded}, this machine\'s is '
                         f'{here}: continue it where its corpus is, or give another --workdir and merge the tables '
                         'with --from_json')


def preset_of(command: str, default: str) -> str:
  """The preset a table's command trained (tables written before the JSON kept a `preset` hold it only there)."""
  found = re.search(r'--preset[= ](\w+)', command)
  return found[1] if found else default
