"""The tables' statistics and printed forms (scripts/common.py, sweep.py, reproduce_c4_ablation.py): paired
differences with their intervals and resolved marks, no ± for one seed, integer parameter counts, titles that fit;
the configs' rows against the paper's tables; the links into results/."""
import json
import re
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env
from laurel import config_lib
from scripts import paper

sys.path.insert(0, str(ROOT / 'scripts'))
import common  # noqa: E402  (scripts/common.py)

# Checks every axes title of `figure` lies inside the figure once drawn (run where the script's module is imported).
TITLES_INSIDE = '''
def titles_outside(figure):
  renderer = figure.canvas.get_renderer()
  bounds = figure.bbox
  out = []
  for ax in figure.axes:
    box = ax.title.get_window_extent(renderer)
    if box.x0 < bounds.x0 - 0.5 or box.x1 > bounds.x1 + 0.5 or box.y1 > bounds.y1 + 0.5:
      out.append(ax.get_title())
  return out
'''
exec(TITLES_INSIDE)  # pylint: disable=exec-used  # the same check in-process


def test_paired_columns_and_cells_by_hand():
  # Differences 0.1, 0.2, 0.3 (tests/test_stats.py's hand case): [-0.0484, +0.4484], not resolved.
  row = common.paired_columns({'seed0': 2.1, 'seed1': 2.7, 'seed2': 3.3}, {'seed0': 2.0, 'seed1': 2.5, 'seed2': 3.0},
                              'test_loss')
  assert row['test_loss_diff_n'] == 3 and not row['test_loss_resolved']
  assert common.paired_cells(row, 'test_loss') == ['+0.2000 [−0.0484, +0.4484]', '3', 'no']
  row = common.paired_columns({'a': 0.9, 'b': 0.88, 'c': 0.89}, {'a': 1.0, 'b': 1.0, 'c': 1.0}, 'x')
  assert common.paired_cells(row, 'x') == ['−0.1100 [−0.1348, −0.0852]', '3', 'yes']
  one = common.paired_columns({'seed0': 1.5}, {'seed0': 1.25}, 'x')
  assert common.paired_cells(one, 'x') == ['+0.2500', '1', '—']
  assert common.paired_cells(common.paired_columns({'s': 1.0}, {}, 'x'), 'x') == ['—', '0', '—']
  assert common.paired_cells(one, 'x', reference=True) == ['(reference)', '—', '—']


def test_one_seed_prints_no_spread_and_counts_print_as_integers():
  assert common.mean_and_spread([2.5]) == (2.5, None)
  assert common.with_spread(*common.mean_and_spread([2.5])) == '2.5000'
  assert common.with_spread(*common.mean_and_spread([1.0, 3.0])) == '2.0000 ± 1.4142'
  assert common.with_spread(None, None) == '—'
  assert common.integer(1024652.0) == common.integer(1024652) == '1,024,652'


def test_long_titles_are_wrapped_to_fit_the_figure():
  fig, axes = common.plt.subplots(1, 2, figsize=(4, 3))
  for ax in axes:
    common.fit_title(ax, 'residual_designs, this repo (tiny preset): one line per seed, and a few words more')
  fig.tight_layout()
  fig.canvas.draw()
  assert not titles_outside(fig) and '\n' in axes[0].get_title()  # pylint: disable=undefined-variable
  common.plt.close(fig)


def sweep_result(tmp_path, seeds):
  """sweep.collect over finished points of ranks 4 and 8 (eval_loss 3.0 and 2.9, + 0.01 per seed; seed None: one
  run without a seed)."""
  import sweep  # pylint: disable=import-outside-toplevel  # scripts/sweep.py (its flags at their defaults)
  from etils import epath  # pylint: disable=import-outside-toplevel
  points = []
  for rank, base in (('4', 3.0), ('8', 2.9)):
    for i, seed in enumerate(seeds):
      point = {'name': f'rank={rank},seed={seed}', 'dir': epath.Path(tmp_path) / f'rank={rank},seed={seed}',
               'values': {'model.laurel.rank': rank}, 'seed': seed}
      point['dir'].mkdir()
      held_out = {'loss_se': 0.01 * (i + 1), 'batches': 4, 'tokens': 1024}
      (point['dir'] / 'final.json').write_text(json.dumps({'eval_loss': base + 0.01 * i, 'params': 1024652,
                                                           'median_step_time_s': 0.5, 'held_out': held_out}))
      points.append(point)
  result = sweep.collect(points, ['model.laurel.rank'], 'eval_loss')
  return sweep, {**result, 'config': 'configs/c4_ablation.py:rw_lr,preset=tiny'}


def test_sweep_table_gives_paired_intervals_no_spread_for_one_seed_and_integer_counts(tmp_path):
  sweep, result = sweep_result(tmp_path, [None])
  text = sweep.markdown(result)
  assert '± 0.0000' not in text and '1,024,652' in text and '1024652.0' not in text
  assert '| 4 | 1 | 3.0000 | (reference) | — | — |' in text
  assert '| 8 | 1 | 2.9000 | −0.1000 | 1 | — |' in text
  fig = sweep.plot(result)
  fig.canvas.draw()
  assert not titles_outside(fig)  # pylint: disable=undefined-variable


def test_sweep_pairs_seeds_with_the_reference_point(tmp_path):
  sweep, result = sweep_result(tmp_path, [0, 1, 2])
  rank8 = result['summary'][1]
  # Every seed is 0.1 lower: the differences have no spread, so the interval is the point and excludes zero.
  assert rank8['eval_loss_diff'] == pytest.approx(-0.1) and rank8['eval_loss_diff_n'] == 3
  assert rank8['eval_loss_resolved'] and result['reference'] == {'model.laurel.rank': '4'}
  assert rank8['params'] == 1024652 and isinstance(rank8['params'], int)
  text = sweep.markdown(result)
  assert '| 8 | 3 | 2.9100 ± 0.0100 | −0.1000 [−0.1000, −0.1000] | 3 | yes |' in text
  assert ("Eval noise: the eval set is 1,024 tokens in 4 batches; the standard error of a run's eval loss over its "
          'batches is 0.0100–0.0300') in text


def tiny_table(path, seeds):
  """A reproduce_c4_ablation.py JSON: baseline_24 and baseline_28 at the given seeds' losses, no `params`."""
  rows = [{'name': name, 'seeds': len(losses), 'failed': [], 'params_m': params_m,
           'test_losses': {f'seed{i}': v for i, v in enumerate(losses)}, 'peak_memory_gb': 0.26,
           'step_time_s': 0.36} for name, params_m, losses in (('baseline_24', 1.018496, seeds[0]),
                                                                 ('baseline_28', 1.182592, seeds[1]))]
  path.write_text(json.dumps({'command': 'python scripts/reproduce_c4_ablation.py --preset=tiny', 'rows': rows}))


@pytest.mark.slow
@pytest.mark.parametrize('seeds, row', [
    # baseline_28 - baseline_24 = 0.1, 0.2, 0.3: the hand case, +0.2000 [−0.0484, +0.4484].
    (([2.0, 2.5, 3.0], [2.1, 2.7, 3.3]),
     '| baseline_28 | 3 | 1,182,592 | 2.7000 ± 0.6000 | +0.2000 [−0.0484, +0.4484] | 3 | no |'),
    (([2.0], [1.9]), '| baseline_28 | 1 | 1,182,592 | 1.9000 | −0.1000 | 1 | — |')])
def test_reproduce_restates_a_tables_json_with_intervals(tmp_path, seeds, row):
  tiny_table(tmp_path / 'c4_ablation_tiny.json', seeds)
  r = subprocess.run([sys.executable, 'scripts/reproduce_c4_ablation.py',
                      f'--from_json={tmp_path / "c4_ablation_tiny.json"}'], cwd=ROOT, capture_output=True, text=True,
                     env=cli_env(), timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  text = (tmp_path / 'c4_ablation_tiny.md').read_text()
  assert row in text and '± 0.0000' not in text and '| baseline_24 | ' in text
  assert 'Command: `python scripts/reproduce_c4_ablation.py --preset=tiny`' in text
  assert 'Statistics recomputed from the JSON' in text and 'Eval noise: not recorded' in text
  result = json.loads((tmp_path / 'c4_ablation_tiny.json').read_text())
  assert result['rows'][0]['params'] == 1018496 and 'statistics_command' in result


@pytest.mark.slow
def test_reproduce_replaces_rerun_rows_and_names_their_command(tmp_path):
  """A second table's baseline_28 replaces the first's: its interval is computed against the first's baseline_24,
  and the table names the command that reran it."""
  tiny_table(tmp_path / 'c4_ablation_tiny.json', ([2.0, 2.5, 3.0], [9.0, 9.0, 9.0]))
  (tmp_path / 'rerun').mkdir()
  tiny_table(tmp_path / 'rerun' / 'c4_ablation_tiny.json', ([0.0, 0.0, 0.0], [2.1, 2.7, 3.3]))
  rerun = json.loads((tmp_path / 'rerun' / 'c4_ablation_tiny.json').read_text())
  rerun.update(command='python scripts/reproduce_c4_ablation.py --rows=baseline_28',
               rows=[r for r in rerun['rows'] if r['name'] == 'baseline_28'])
  (tmp_path / 'rerun' / 'c4_ablation_tiny.json').write_text(json.dumps(rerun))
  tables = f'{tmp_path / "c4_ablation_tiny.json"},{tmp_path / "rerun" / "c4_ablation_tiny.json"}'
  r = subprocess.run([sys.executable, 'scripts/reproduce_c4_ablation.py', f'--from_json={tables}'], cwd=ROOT,
                     capture_output=True, text=True, env=cli_env(), timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  text = (tmp_path / 'c4_ablation_tiny.md').read_text()
  assert '| baseline_28 | 3 | 1,182,592 | 2.7000 ± 0.6000 | +0.2000 [−0.0484, +0.4484] | 3 | no |' in text, text
  assert 'Rows baseline_28 rerun: `python scripts/reproduce_c4_ablation.py --rows=baseline_28`' in text
  result = json.loads((tmp_path / 'c4_ablation_tiny.json').read_text())
  assert result['reruns'] == [{'rows': ['baseline_28'], 'command': rerun['command']}]


@pytest.mark.slow
def test_reproduce_plot_titles_fit_their_figure():
  """The chart of the 28-row residual designs' table and of a two-row table: every title inside its figure."""
  code = TITLES_INSIDE + '''
import json, sys
sys.path.insert(0, 'scripts')
import reproduce_c4_ablation as r
for path, paper in (('results/residual_designs_tiny.json', False), ('results/c4_ablation_tiny.json', True)):
  rows = r.from_json(path, paper)[1]
  for n in (2, len(rows)):
    fig = r.plot(rows[:n], paper, 'residual_designs, this repo (tiny preset)')
    fig.canvas.draw()
    assert not titles_outside(fig), (path, n, titles_outside(fig))
print('ok')
'''
  r = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, env=cli_env(),
                     timeout=300)
  assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stderr[-2000:]


@pytest.mark.slow
def test_sweep_bad_reference_is_one_line_before_anything_runs(tmp_path):
  r = subprocess.run([sys.executable, 'scripts/sweep.py', '--config=configs/c4_ablation.py:rw_lr,preset=tiny',
                      '--field=model.laurel.rank', '--values=4,8', '--reference=16', f'--workdir={tmp_path}'],
                     cwd=ROOT, capture_output=True, text=True, env=cli_env(), timeout=300)
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
      "error: --reference='16': not a point of the grid (give one value per --field, in order, e.g. 4)")
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('table, published', [('c4_ablation', paper.TABLE5), ('imagenet_resnet50', paper.TABLE1)])
def test_a_paper_table_s_config_has_exactly_its_rows(table, published):
  assert set(config_lib.table_rows(table)) == set(published)


def _anchors(markdown: str) -> set:
  """GitHub's anchors of a Markdown file's headings (outside code blocks)."""
  anchors, fenced = set(), False
  for line in markdown.splitlines():
    fenced ^= line.startswith('```')
    if not fenced and line.startswith('#'):
      anchors.add(re.sub(r'[^\w\- ]', '', line.lstrip('#').strip().lower()).replace(' ', '-'))
  return anchors


def test_every_link_between_the_docs_and_results_reaches_its_file_and_heading():
  # results/README.md and HISTORY.md split the figures; the README and docs/ link into both
  broken = []
  for doc in [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md')), *sorted((ROOT / 'results').glob('*.md'))]:
    for path, anchor in re.findall(r'\]\(([^)#\s:]*)(?:#([^)\s]+))?\)', doc.read_text()):
      target = (doc.parent / path).resolve() if path else doc
      if not target.exists():
        broken.append(f'{doc.name}: {path}')
      elif anchor and target.suffix == '.md' and anchor not in _anchors(target.read_text()):
        broken.append(f'{doc.name}: {path}#{anchor}')
  assert not broken, broken
