"""The tables' statistics and printed forms (scripts/tables.py, sweep.py, reproduce_c4_ablation.py): paired
differences with their intervals and resolved marks, no ± for one seed, integer parameter counts, titles that fit;
the configs' rows against the paper's tables; the links into results/."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, cli_env, run_script
from laurel import command_line, config_lib
from scripts import paper

sys.path.insert(0, str(ROOT / 'scripts'))
import ablation_table  # noqa: E402  (scripts/ablation_table.py: reproduce_c4_ablation.py's tables)
import launching  # noqa: E402  (scripts/launching.py: where the runs of a table train)
import tables  # noqa: E402  (scripts/tables.py: the tables' statistics, figures and files)


def titles_outside(figure):
  """The axes titles of `figure` that reach outside it once drawn."""
  renderer = figure.canvas.get_renderer()
  bounds = figure.bbox
  out = []
  for ax in figure.axes:
    box = ax.title.get_window_extent(renderer)
    if box.x0 < bounds.x0 - 0.5 or box.x1 > bounds.x1 + 0.5 or box.y1 > bounds.y1 + 0.5:
      out.append(ax.get_title())
  return out


def test_paired_columns_and_cells_by_hand():
  # Differences 0.1, 0.2, 0.3 (tests/test_stats.py's hand case): [-0.0484, +0.4484], not resolved.
  row = tables.paired_columns({'seed0': 2.1, 'seed1': 2.7, 'seed2': 3.3}, {'seed0': 2.0, 'seed1': 2.5, 'seed2': 3.0},
                              'test_loss')
  assert row['test_loss_diff_n'] == 3 and not row['test_loss_resolved']
  assert tables.paired_cells(row, 'test_loss') == ['+0.2000 [−0.0484, +0.4484]', '3', 'no']
  row = tables.paired_columns({'a': 0.9, 'b': 0.88, 'c': 0.89}, {'a': 1.0, 'b': 1.0, 'c': 1.0}, 'x')
  assert tables.paired_cells(row, 'x') == ['−0.1100 [−0.1348, −0.0852]', '3', 'yes']
  one = tables.paired_columns({'seed0': 1.5}, {'seed0': 1.25}, 'x')
  assert tables.paired_cells(one, 'x') == ['+0.2500', '1', '—']
  assert tables.paired_cells(tables.paired_columns({'s': 1.0}, {}, 'x'), 'x') == ['—', '0', '—']
  assert tables.paired_cells(one, 'x', reference=True) == ['(reference)', '—', '—']


def test_one_seed_prints_no_spread_and_counts_print_as_integers():
  assert tables.mean_and_spread([2.5]) == (2.5, None)
  assert tables.with_spread(*tables.mean_and_spread([2.5])) == '2.5000'
  assert tables.with_spread(*tables.mean_and_spread([1.0, 3.0])) == '2.0000 ± 1.4142'
  assert tables.with_spread(None, None) == '—'
  assert tables.integer(1024652.0) == tables.integer(1024652) == '1,024,652'


def test_long_titles_are_wrapped_to_fit_the_figure():
  fig, axes = tables.plt.subplots(1, 2, figsize=(4, 3))
  for ax in axes:
    tables.fit_title(ax, 'residual_designs, this repo (tiny preset): one line per seed, and a few words more')
  fig.tight_layout()
  fig.canvas.draw()
  assert not titles_outside(fig) and '\n' in axes[0].get_title()
  tables.plt.close(fig)


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
  assert not titles_outside(fig)


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


@pytest.mark.parametrize('seeds, row', [
    # baseline_28 - baseline_24 = 0.1, 0.2, 0.3: the hand case, +0.2000 [−0.0484, +0.4484].
    (([2.0, 2.5, 3.0], [2.1, 2.7, 3.3]),
     '| baseline_28 | 3 | 1,182,592 | 2.7000 ± 0.6000 | +0.2000 [−0.0484, +0.4484] | 3 | no |'),
    (([2.0], [1.9]), '| baseline_28 | 1 | 1,182,592 | 1.9000 | −0.1000 | 1 | — |')])
def test_reproduce_restates_a_tables_json_with_intervals(tmp_path, seeds, row):
  tiny_table(tmp_path / 'c4_ablation_tiny.json', seeds)
  r = run_script('reproduce_c4_ablation.py', f'--from_json={tmp_path / "c4_ablation_tiny.json"}')
  assert r.returncode == 0, r.stderr[-2000:]
  text = (tmp_path / 'c4_ablation_tiny.md').read_text()
  assert row in text and '± 0.0000' not in text and '| baseline_24 | ' in text
  assert 'Command: `python scripts/reproduce_c4_ablation.py --preset=tiny`' in text
  assert 'Statistics recomputed from the JSON' in text and 'Eval noise: not recorded' in text
  result = json.loads((tmp_path / 'c4_ablation_tiny.json').read_text())
  assert result['rows'][0]['params'] == 1018496 and 'statistics_command' in result


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
  r = run_script('reproduce_c4_ablation.py', f'--from_json={tables}')
  assert r.returncode == 0, r.stderr[-2000:]
  text = (tmp_path / 'c4_ablation_tiny.md').read_text()
  assert '| baseline_28 | 3 | 1,182,592 | 2.7000 ± 0.6000 | +0.2000 [−0.0484, +0.4484] | 3 | no |' in text, text
  assert 'Seeds of rows baseline_28 from: `python scripts/reproduce_c4_ablation.py --rows=baseline_28`' in text
  result = json.loads((tmp_path / 'c4_ablation_tiny.json').read_text())
  assert result['reruns'] == [{'rows': ['baseline_28'], 'command': rerun['command']}]


@pytest.mark.slow
def test_reproduce_plot_titles_fit_their_figure():
  """The chart of the 28-row residual designs' table and of a two-row table: every title inside its figure."""
  for path, with_paper in (('results/residual_designs_tiny.json', False), ('results/c4_ablation_tiny.json', True)):
    rows = ablation_table.from_json(str(ROOT / path), with_paper)[1]
    for n in (2, len(rows)):
      fig = ablation_table.plot(rows[:n], with_paper, 'residual_designs, this repo (tiny preset)')
      fig.canvas.draw()
      assert not titles_outside(fig), (path, n, titles_outside(fig))
      tables.plt.close(fig)


def test_sweep_bad_reference_is_one_line_before_anything_runs(tmp_path):
  r = run_script('sweep.py', '--config=configs/c4_ablation.py:rw_lr,preset=tiny', '--field=model.laurel.rank',
                 '--values=4,8', '--reference=16', f'--workdir={tmp_path}')
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
      "error: --reference='16': not a point of the grid (give one value per --field, in order, e.g. 4)")
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('table, published', [('c4_ablation', paper.TABLE5), ('imagenet_resnet50', paper.TABLE1)])
def test_a_paper_table_s_config_has_exactly_its_rows(table, published):
  assert set(command_line.table_rows(table)) == set(published)


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


def test_several_runs_on_one_accelerator_each_get_their_share_of_its_memory(tmp_path, monkeypatch):
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in launching.child_env(1, {})
  assert launching.child_env(3, {})['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.300'
  kept = launching.child_env(3, {'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'})  # one's own memory setting stays
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in kept and kept['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'
  # What the runs get: each child of a --jobs=2 table writes its environment's share into its folder.
  for name in launching.MEMORY_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  points = [{'name': f'p{i}', 'dir': epath_of(tmp_path / f'p{i}')} for i in range(2)]
  show = "import os, sys; open(sys.argv[1], 'w').write(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
  failed = launching.run_points(points, 'run.log', lambda p: [sys.executable, '-c', show, str(p['dir'] / 'share')],
                             jobs=2)
  assert failed == [] and [(p['dir'] / 'share').read_text() for p in points] == ['0.450', '0.450']


def epath_of(path):
  from etils import epath  # pylint: disable=import-outside-toplevel
  return epath.Path(path)


@pytest.mark.parametrize('text, seconds', [('600', 600), ('90s', 90), ('10m', 600), ('1h30m', 5400), ('2h', 7200)])
def test_time_limits_read_as_seconds_or_durations(text, seconds):
  assert launching.parse_duration(text) == seconds


@pytest.mark.parametrize('text', ['', 'soon', '10x', '0', '-5'])
def test_a_bad_time_limit_is_one_line(text):
  with pytest.raises(config_lib.InputError, match=r'^--time_limit=.*: (not a duration|must be more than 0 s)'):
    launching.parse_duration(text)


# A run that saves on SIGTERM (as laurel.train does), after setting off its table's time limit (SIGALRM to the
# script: the limit's timer as it fires), so that the limit comes while it trains, whatever the machine's speed.
SAVES_ON_SIGTERM = '''
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('saved'), sys.exit(0)))
os.kill(os.getppid(), signal.SIGALRM)
time.sleep(300)
'''


def test_the_time_limit_stops_the_running_point_with_a_checkpoint_and_starts_no_other(tmp_path, capsys):
  points = [{'name': f'p{i}', 'dir': epath_of(tmp_path / f'p{i}')} for i in range(2)]
  failed = launching.run_points(points, 'run.log',
                             lambda p: [sys.executable, '-c', SAVES_ON_SIGTERM, str(p['dir'] / 'checkpoint')],
                             time_limit=600)
  assert failed == [] and (tmp_path / 'p0' / 'checkpoint').read_text() == 'saved'
  assert not (tmp_path / 'p1').exists()  # no further point started
  assert 'time limit of 600 s reached: the running points were stopped' in capsys.readouterr().out


def test_a_point_another_process_finished_is_reported_finished_not_failed(tmp_path, capsys):
  """The other sweep's run finished the point while this one's attempt was refused (the lock's exit 2) or failed."""
  finish_elsewhere = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text('{}'); sys.exit(int(sys.argv[2]))"
  points = [{'name': f'p{code}', 'dir': epath_of(tmp_path / f'p{code}')} for code in (2, 1)]
  failed = launching.run_points(points, 'run.log', lambda p: [sys.executable, '-c', finish_elsewhere,
                                                           str(p['dir'] / 'final.json'), p['name'][1:]])
  out = capsys.readouterr().out
  assert failed == [] and out.count('finished by another process') == 2 and 'failed' not in out
  assert not list(tmp_path.glob('*/failed.json'))
  # A failed.json an earlier attempt left in a point that is finished now goes as the point is skipped.
  (tmp_path / 'p1' / 'failed.json').write_text('{"exit": 1}')
  assert launching.run_points(points, 'run.log', lambda p: ['false']) == []
  assert not (tmp_path / 'p1' / 'failed.json').exists() and launching.point_status(points[1]['dir']) == 'done'


def test_a_second_script_on_one_folder_is_refused_naming_the_first(tmp_path):
  launching.hold_folder(tmp_path, 'workdir')
  with pytest.raises(config_lib.InputError) as refused:
    launching.hold_folder(tmp_path / '.', 'out')  # another spelling of the folder
  message = str(refused.value)
  assert message.startswith(f'--out={tmp_path}: pid {os.getpid()} on ') and message.count('\n') == 0
  assert 'writes there; wait until it ends, or give another --out' in message
  assert list(tmp_path.iterdir()) == []  # no lock file in the folder (results/ is committed)


def table_rows(tmp_path, seeds, preset='tiny'):
  """ablation_table's rows of tiny_table's JSON (baseline_24 and baseline_28 at the given seeds' losses)."""
  tiny_table(tmp_path / f'{preset}.json', seeds)
  return ablation_table.from_json(str(tmp_path / f'{preset}.json'), True)[1]


def test_a_tables_first_line_says_what_its_preset_can_claim(tmp_path):
  unresolved = table_rows(tmp_path, ([2.0, 2.5, 3.0], [2.1, 2.7, 3.3]))
  first = ablation_table.markdown(unresolved, 'cmd', True, 'tiny').splitlines()[0]
  assert first.startswith('**A pipeline check, not a result** (tiny preset: ')
  assert "no row's 95% interval of the paired Δ loss against baseline_24 excludes zero" in first
  resolved = table_rows(tmp_path, ([2.0, 2.5, 3.0], [1.9, 2.41, 2.89]), 'gpu')
  first = ablation_table.markdown(resolved, 'cmd', True, 'gpu').splitlines()[0]
  assert first.startswith('**What this table can claim** (gpu preset: ')
  assert 'excludes zero for baseline_28 (lower) only' in first


def test_the_papers_figures_stand_apart_labelled_as_the_papers_at_its_scale(tmp_path):
  lines = ablation_table.markdown(table_rows(tmp_path, ([2.0, 2.5], [2.1, 2.4])), 'cmd', True, 'tiny').splitlines()
  ours = next(line for line in lines if line.startswith('| row | seeds |'))
  assert 'paper' not in ours.lower() and 'test loss' in ours
  theirs = next(i for i, line in enumerate(lines) if "paper's test loss" in line)
  assert lines[theirs].startswith("| row | paper's params (M) | paper's test loss |")
  assert lines[theirs - 2].startswith("The paper's Table 5, at its own scale (")
  assert '| baseline_28 | 179.23 | 2.9963 | 1.136 | 1.105 |' in lines


def test_the_papers_bars_start_at_zero_on_an_axis_that_holds_zero(tmp_path):
  fig = ablation_table.plot(table_rows(tmp_path, ([2.0, 2.5], [2.1, 2.4])), True, 'title')
  theirs = fig.axes[2]
  low, high = theirs.get_ylim()
  heights = [bar.get_height() for bar in theirs.patches]
  assert low <= min(heights) <= 0 <= high and all(bar.get_y() == 0 for bar in theirs.patches)
  gap = paper.TABLE5['baseline_28']['test_loss'] - paper.TABLE5['baseline_24']['test_loss']
  assert heights[1] == pytest.approx(gap)
  assert "the paper's Δ (Table 5, at its scale" in theirs.get_title().replace('\n', ' ')
  tables.plt.close(fig)


def provenance(seeds, corpus):
  return {f'seed{s}': {'commit': 'abc', 'device': 'NVIDIA H200', 'corpus': corpus} for s in seeds}


def write_table(path, losses: dict, runs: dict):
  rows = [{'name': name, 'seeds': len(seeds), 'failed': [], 'params': 1000, 'test_losses': seeds,
           'peak_memory_gb': 0.2, 'step_time_s': 0.3, 'runs': runs} for name, seeds in losses.items()]
  path.write_text(json.dumps({'command': f'python scripts/reproduce_c4_ablation.py # {path.name}', 'rows': rows}))
  return str(path)


def test_tables_of_several_machines_merge_seed_by_seed_and_refuse_another_corpus(tmp_path):
  first = write_table(tmp_path / 'a.json', {'baseline_24': {'seed0': 3.0, 'seed1': 3.1},
                                            'baseline_28': {'seed0': 2.9, 'seed1': 3.0}}, provenance([0, 1], 'c1'))
  later = write_table(tmp_path / 'b.json', {'baseline_24': {'seed2': 3.2, 'seed3': 3.3},
                                            'baseline_28': {'seed2': 3.1, 'seed3': 3.2}}, provenance([2, 3], 'c1'))
  result, rows = ablation_table.from_json(first, True, [later])
  base, deeper = rows
  assert list(deeper['test_losses']) == ['seed0', 'seed1', 'seed2', 'seed3'] and deeper['seeds'] == 4
  assert deeper['test_loss_diff_n'] == 4 and deeper['test_loss_diff'] == pytest.approx(-0.1)
  assert base['runs']['seed3'] == {'commit': 'abc', 'device': 'NVIDIA H200', 'corpus': 'c1'}
  assert result['reruns'] == [{'rows': ['baseline_24', 'baseline_28'], 'command': json.loads(
      (tmp_path / 'b.json').read_text())['command']}]
  other = write_table(tmp_path / 'c.json', {'baseline_24': {'seed4': 3.0}}, provenance([4], 'c2'))
  with pytest.raises(config_lib.InputError) as refused:
    ablation_table.from_json(first, True, [later, other])
  assert str(refused.value) == (f'--from_json={first},{later},{other}: baseline_24/seed0 trained on corpus c1, '
                                'baseline_24/seed4 on corpus c2: losses on different data do not compare; merge only '
                                'tables of one corpus')


def test_each_run_records_its_commit_device_and_corpus_and_a_workdir_of_another_corpus_is_refused(tmp_path,
                                                                                                 monkeypatch):
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(launching, 'local_device_kind', lambda: 'cpu')
  record, corpora = ablation_table.provenance_recorder(SimpleNamespace(on_slice=False),
                                                       {'baseline_24': SimpleNamespace(data=SimpleNamespace(
                                                           name='synthetic', path=''))})
  run = tmp_path / 'baseline_24' / 'seed0'
  run.mkdir(parents=True)
  record({'row': 'baseline_24', 'dir': epath_of(run)})
  (run / 'final.json').write_text(json.dumps({'eval_loss': 3.0, 'params': 1000, 'commit': 'f00d'}))
  rows = ablation_table.collect(epath_of(tmp_path), ['baseline_24'], False)
  assert corpora == {'baseline_24': 'synthetic'}
  assert rows[0]['runs'] == {'seed0': {'commit': 'f00d', 'device': 'cpu', 'corpus': 'synthetic'}}
  ablation_table.check_corpora(epath_of(tmp_path), corpora)  # the same corpus: it continues
  with pytest.raises(config_lib.InputError, match=r'baseline_24/seed0 trained on corpus synthetic, this machine'):
    ablation_table.check_corpora(epath_of(tmp_path), {'baseline_24': '0123456789abcdef'})


def test_a_corpus_fingerprint_follows_its_files_names_and_sizes(tmp_path):
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  for folder, size in (('a', 10), ('b', 10), ('c', 11)):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / 'one.txt').write_text('x' * size)
  prints = [launching.corpus_fingerprint(SimpleNamespace(name='text', path=f'{tmp_path}/{folder}/*.txt'))
            for folder in 'abc']
  assert prints[0] == prints[1] != prints[2] and len(prints[0]) == 16


def test_rows_of_one_seed_share_the_data_order_and_seeds_differ():
  """Every row of a table at one seed reads the same batches (config.seed seeds the data order and the
  initialisation alike; the rows differ in the model only), and another seed reads others."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from laurel import tasks  # pylint: disable=import-outside-toplevel

  def first_batch(row, seed):
    config = command_line.load(f'configs/c4_ablation.py:{row},preset=tiny', [f'--config.seed={seed}'])
    return next(iter(tasks.get_task(config).dataset(train=True, batch_size=4, seed=config.seed)))['tokens']
  seed0 = first_batch('baseline_24', 0)
  assert all(np.array_equal(seed0, first_batch(row, 0)) for row in ('baseline_28', 'rw_lr_pa'))
  assert not np.array_equal(seed0, first_batch('baseline_24', 1))


def test_the_sweep_heatmaps_colours_span_at_least_the_noise():
  """Cells 0.004 apart whose paired intervals are 0.13 wide: the colour range is the interval's, not 0.004."""
  import sweep  # pylint: disable=import-outside-toplevel  # scripts/sweep.py
  ranks, ks = ['4', '8'], ['2', '3']
  summary = [{'model.laurel.rank': r, 'model.laurel.k': k, 'eval_loss': 3.0 + 0.001 * (2 * i + j),
              'eval_loss_diff_low': -0.065, 'eval_loss_diff_high': 0.065}
             for i, r in enumerate(ranks) for j, k in enumerate(ks)]
  result = {'fields': ['model.laurel.rank', 'model.laurel.k'], 'grid': {'model.laurel.rank': ranks,
                                                                       'model.laurel.k': ks},
            'metric': 'eval_loss', 'reduce': 'final', 'config': 'configs/c4_ablation.py:rw_lr_pa', 'summary': summary,
            'points': []}
  figure = sweep.plot(result)
  norm = figure.axes[0].images[0].norm
  assert norm.vmax - norm.vmin == pytest.approx(0.13) and norm.vmin == pytest.approx(3.0)
  title = figure.axes[0].get_title().replace('\n', ' ')
  assert 'the colours span at least 0.1300, the widest 95% interval of a Δ (the noise)' in title
  tables.plt.close(figure)


def test_a_one_seed_sweep_heatmap_ranks_no_cell_and_says_why():
  """One run per point: no interval of a Δ, and the eval loss's own interval leaves out the seeds' noise; colours
  ranked inside it would show noise as winners, and the title cited the interval of a Δ it did not have."""
  import sweep  # pylint: disable=import-outside-toplevel  # scripts/sweep.py
  ranks, ks = ['4', '8'], ['2', '3']
  summary = [{'model.laurel.rank': r, 'model.laurel.k': k, 'eval_loss': 3.0 + 0.01 * (2 * i + j)}
             for i, r in enumerate(ranks) for j, k in enumerate(ks)]
  result = {'fields': ['model.laurel.rank', 'model.laurel.k'], 'grid': {'model.laurel.rank': ranks,
                                                                       'model.laurel.k': ks},
            'metric': 'eval_loss', 'reduce': 'final', 'config': 'configs/c4_ablation.py:rw_lr_pa', 'summary': summary,
            'points': [{'held_out': {'loss_se': 0.001}}]}
  figure = sweep.plot(result)
  ax = figure.axes[0]
  image = ax.images[0]
  assert len({tuple(image.cmap(image.norm(v))) for v in np.ravel(image.get_array())}) == 1  # one colour
  assert len(figure.axes) == 1  # and no colour bar
  assert sorted(t.get_text() for t in ax.texts) == ['3.0000', '3.0100', '3.0200', '3.0300']
  title = ax.get_title().replace('\n', ' ')
  assert 'interval of a Δ (the noise)' not in title
  assert title.endswith(": no interval of a Δ (it needs two seeds or more per point) (the eval's own 95% interval is "
                        '0.0039 wide), so the cells are not coloured by rank; --seeds=0,1,2 gives intervals')
  tables.plt.close(figure)


@pytest.mark.slow
def test_the_paper_preset_needs_its_data_path_and_prints_it_in_every_command():
  """The commands in a subprocess: what a fresh process prints on stderr as JAX picks its platform (not libtpu's
  noise)."""
  args = ['--preset=paper', '--launch=print', '--rows=baseline_24,rw', '--seeds=2', '--first_seed=3']
  r = run_script('reproduce_c4_ablation.py', *args)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      'error: --data_path is required with --preset=paper: the folder of C4 shards that python -m laurel.prepare.c4 '
      'writes (docs/data.md), e.g. --data_path=gs://BUCKET/c4']
  shell = {k: v for k, v in cli_env().items() if k != 'JAX_PLATFORMS'}  # JAX picks its platform, libtpu's included
  r = subprocess.run([sys.executable, 'scripts/reproduce_c4_ablation.py', *args, '--data_path=gs://bucket/c4'],
                     cwd=ROOT, capture_output=True, text=True, env=shell, timeout=300)
  assert r.returncode == 0 and r.stderr == '', r.stderr[-2000:]  # not libtpu's `E0000 ... INVALID_ARGUMENT` lines
  lines = r.stdout.splitlines()
  assert len(lines) == 4 and all(line.endswith(' --config.data.path=gs://bucket/c4') for line in lines)
  assert lines[0].startswith('python -m laurel.main --config=configs/c4_ablation.py:baseline_24,preset=paper ')
  assert [re.search(r'--config\.seed=(\d+)', line).group(1) for line in lines] == ['3', '3', '4', '4']


def test_a_table_written_before_the_json_kept_its_preset_is_restated_under_the_preset_its_command_trained():
  committed = json.loads((ROOT / 'results' / 'c4_ablation_gpu.json').read_text())
  assert ablation_table.preset_of(committed['command'], 'tiny') == 'gpu'
  assert ablation_table.preset_of('python scripts/reproduce_c4_ablation.py --seeds=3', 'tiny') == 'tiny'
