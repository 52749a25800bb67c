"""Trains a table of rows on Table 5's setup: results/<table>_<preset>.{md,csv,json,png}.

  python scripts/reproduce_c4_ablation.py --preset=tiny|gpu|paper --seeds=3 [--out=results] [--table=residual_designs]
      [--rows=...] [--set=<field>=<value>] [--workdir=gs://BUCKET/c4_ablation] [--data_path=gs://BUCKET/c4]
      [--first_seed=3] [--time_limit=10m] [--jobs=2]
      [--launch=local|print|tpu --tpu=NAME --zone=ZONE --accelerator=v6e-16 [--nosetup]]
      [--evaluate=text:held_out/*.txt --evaluate=tasks/mc.jsonl --evaluate=hellaswag [--tfds_data_dir=DIR]]

--table=c4_ablation (default) is Table 5, the LAuReL variants, with the paper's figures in a table of their own
(labelled as the paper's, at its scale); residual_designs the other residual-stream designs
(configs/residual_designs.py), one field apart from Baseline-24. A table's first line says what it can claim (at
the tiny preset: a pipeline check) and which rows' intervals exclude zero. --preset=paper needs --data_path, the C4
that laurel.prepare.c4 prepared (docs/data.md).

The tables go to --out, by default the --workdir (runs/<table>_<preset>): the committed results/ only with
--out=results. Every row trains with the same data order, steps and seeds in --workdir/<row>/seed<s> (local or
gs://; log: train.log), here or, with --launch=tpu, on a TPU slice through scripts/launch_tpu.py (--launch=print
prints those commands). A run that fails is marked failed (failed.json) and the others go on; rerunning skips
finished runs and resumes the others, and the tables are rewritten after every run (the closing lines name each
file). Peak memory is each run's compiled step; step time its median step, as noisy as the machine: quote
scripts/benchmark.py for overhead. One script at a time writes in a local --workdir and --out: a second is
refused in one line naming the first.

Seeds add up across machines and days: --first_seed=S trains seeds S.. S+--seeds-1; --time_limit stops the script
cleanly (the runs in flight save a checkpoint; the same command continues); each run's provenance.json records the
commit, device and a fingerprint of its training corpus, kept per seed in the table's JSON; a workdir of another
corpus is refused. --jobs=N trains N runs at once here, each with 0.9/N of one accelerator's memory.

Every row's test loss is compared with Baseline-24's seed by seed: the table gives the mean paired difference, its
95% Student-t interval over the seeds both have, their count, and whether the interval excludes zero (resolved); and
the eval set's size and its own noise (final.json's held_out: the eval loss's standard error over its batches)
beside the seed-to-seed spread. --from_json=<table>.json recomputes those from a table's JSON, which holds every
run's test loss, and rewrites the table without training; --from_json=<table>.json,<other>.json,... merges the
seeds of several tables (other machines or days, or rows retrained: a seed in two is the later table's), names
each one's command, and refuses tables of different corpora.

--preset=gpu is sized for one GPU (configs/c4_ablation.py says why); what one H200 measured: results/README.md.
  python scripts/reproduce_c4_ablation.py --preset=gpu --rows=baseline_24,baseline_28,rw_lr_pa --seeds=3

--evaluate scores every finished run's last checkpoint on laurel.serve.evaluate's tasks, here (from gs:// too), once per
run and task (<run>/eval_<task>.json is kept); the tables gain each task's metrics, averaged over seeds, with
ratios to Baseline-24: bits per byte for text, accuracy, length-normalised accuracy and the correct choice's mean
log-likelihood for multiple choice.
"""

import json
import os

import cli  # puts the repo root on sys.path
import ablation_table
import launching
import tables
from absl import app, flags
from ablation_table import collect, from_json, markdown, plot
from etils import epath

from laurel import command_line
from laurel.serve import evaluate
from laurel.config_lib import InputError

_TABLE = flags.DEFINE_enum('table', 'c4_ablation', cli.TABLES, 'configs/<table>.py: whose rows to train.')
_PRESET = flags.DEFINE_enum('preset', 'tiny', ['tiny', 'gpu', 'paper'], "Preset of the table's config.")
_SEEDS = flags.DEFINE_integer('seeds', 2, 'Seeds per row.')
_FIRST_SEED = flags.DEFINE_integer('first_seed', 0, 'The first seed: seeds --first_seed, +1, ... (--seeds of them), so '
                                   'that machines and days add seeds to one table (--from_json merges them).')
_DATA_PATH = flags.DEFINE_string('data_path', None, "data.path of every row: the prepared C4 (laurel.prepare.c4's "
                                 '--output) for --preset=paper, which needs it.')
_ROWS = flags.DEFINE_list('rows', None, "Rows to run; default: all of the table's.")
_OUT = flags.DEFINE_string('out', None, 'Where the tables and chart go; default: the --workdir. The committed '
                           'results/ only when asked: --out=results.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directories; default runs/<table>_<preset>.')
_SET = flags.DEFINE_multi_string('set', [], 'Extra config override <field>=<value> for every run it changes '
                                 'something in (repeatable).')
_COLLECT_ONLY = flags.DEFINE_bool('collect_only', False, 'Only rebuild the tables from finished runs.')
_FROM_JSON = flags.DEFINE_list('from_json', None, "Only recompute a table's statistics from its JSON (which holds "
                               "every run's test loss) and rewrite it; --out: default the first JSON's folder. "
                               "Several: their seeds merged, row by row (a seed in two: the later table's); "
                               'tables of different corpora are refused.')
_EVALUATE = flags.DEFINE_multi_string('evaluate', [], "A laurel.serve.evaluate task for every finished run (repeatable).")
_TFDS_DATA_DIR = flags.DEFINE_string('tfds_data_dir', '', "TFDS's data_dir for --evaluate's TFDS tasks.")
_LAUNCH = launching.define_launch_flags()


def evaluate_runs(workdir: epath.Path, rows_in_order):
  """Scores each finished run on the --evaluate tasks it has no eval_<task>.json for."""
  for run in (p for row in rows_in_order for p in sorted((workdir / row).glob('seed*'))):
    todo = [t for t in _EVALUATE.value if not (run / f'eval_{evaluate.task_name(t)}.json').exists()]
    if todo and launching.point_status(run) == 'done':
      print(f'= evaluate {run}: {", ".join(todo)}', flush=True)
      for result in evaluate.evaluate_run(str(run), todo, tfds_data_dir=_TFDS_DATA_DIR.value):
        print(json.dumps(result), flush=True)


def restate(table: str, all_rows, with_paper: bool):
  """--from_json: the table of a previous run of this script, its statistics recomputed (from_json), rewritten."""
  result, rows = from_json(_FROM_JSON.value[0], with_paper, _FROM_JSON.value[1:])
  if unknown := [r['name'] for r in rows if r['name'] not in all_rows]:
    raise InputError(f'--from_json={_FROM_JSON.value[0]}: row {unknown[0]!r} is not in --table={table}')
  out = epath.Path(_OUT.value or epath.Path(_FROM_JSON.value[0]).parent)
  launching.hold_folder(out, 'out')
  preset = result.get('preset') or ablation_table.preset_of(result['command'], _PRESET.default)
  stem, command, reruns = f'{table}_{preset}', cli.command(), result.get('reruns', [])
  text = markdown(rows, result['command'], with_paper, preset)
  text += ''.join(f"\nSeeds of rows {', '.join(r['rows'])} from: `{r['command']}`\n" for r in reruns)
  text += f'\nStatistics recomputed from the JSON: `{command}`\n'
  written = tables.write_results(out, stem, {'command': result['command'], 'preset': preset, 'reruns': reruns,
                                             'statistics_command': command, 'rows': rows}, rows, text,
                                 plot(rows, with_paper, f'{table}, this repo ({preset} preset)'))
  print(text + ablation_table.tables_written(written))


def reproduce():
  table, all_rows = _TABLE.value, command_line.table_rows(_TABLE.value)
  chosen, with_paper = _ROWS.value or all_rows, table == 'c4_ablation'
  if unknown := sorted(set(chosen) - set(all_rows)):
    raise InputError(f'--rows={unknown[0]!r}: unknown (known: {", ".join(all_rows)})')
  if _FROM_JSON.value:
    restate(table, all_rows, with_paper)
    return
  if _SEEDS.value < 1 or _FIRST_SEED.value < 0:
    raise InputError(f'--seeds={_SEEDS.value} --first_seed={_FIRST_SEED.value}: give 1 or more seeds from 0 or more')
  launcher, preset = launching.Launcher(_LAUNCH), _PRESET.value
  table_sets = [*([f'data.path={_DATA_PATH.value}'] if _DATA_PATH.value else []), *_SET.value]
  if preset == 'paper' and 'data.path' not in map(cli.override_field, table_sets) and not _COLLECT_ONLY.value:
    raise InputError("--data_path is required with --preset=paper: the folder of C4 shards that "
                     "python -m laurel.prepare.c4 writes (docs/data.md), e.g. --data_path=gs://BUCKET/c4")
  specs = {row: command_line.resolve_spec(f'{table}:{row},preset={preset}') for row in chosen}
  sets = {row: launching.sets_that_apply(spec, table_sets) for row, spec in specs.items()}
  # A bad --set, or a batch the devices cannot take, fails here, before anything runs.
  configs = {row: launcher.load(spec, sets[row]) for row, spec in specs.items()}
  for task in _EVALUATE.value:
    evaluate.check_task(task)
  workdir = epath.Path(_WORKDIR.value or f'runs/{table}_{preset}')  # local or gs://
  out, stem, command = epath.Path(_OUT.value or workdir), f'{table}_{preset}', cli.command()
  title = f'{table}, this repo ({preset} preset)'
  written = []

  def write_tables():
    if rows := collect(workdir, all_rows, with_paper):
      written[:] = tables.write_results(out, stem, {'command': command, 'preset': preset, 'rows': rows}, rows,
                                        markdown(rows, command, with_paper, preset), plot(rows, with_paper, title))
    return rows

  seeds = [] if _COLLECT_ONLY.value else range(_FIRST_SEED.value, _FIRST_SEED.value + _SEEDS.value)
  # Seed-major, so that every row has a first seed early. Every row of a seed has its data order (config.seed).
  points = [{'name': f'{row}/seed{seed}', 'row': row, 'dir': workdir / row / f'seed{seed}', 'config': specs[row],
             'overrides': cli.config_flags([f'seed={seed}', *sets[row]])} for seed in seeds for row in chosen]
  record = lambda point: None
  if launcher.launch != 'print' or _COLLECT_ONLY.value:  # it writes: one script at a time in these folders
    for folder, flag in {os.fspath(out): 'out', os.fspath(workdir): 'workdir'}.items():
      launching.hold_folder(folder, flag)
    record, corpora = ablation_table.provenance_recorder(launcher, configs)
    ablation_table.check_corpora(workdir, corpora)
  failed = launcher.run(points, 'train.log', write_tables, record)
  if launcher.launch == 'print' and not _COLLECT_ONLY.value:
    return
  if _EVALUATE.value:
    evaluate_runs(workdir, all_rows)
  if write_tables():
    print((out / f'{stem}.md').read_text() + ablation_table.tables_written(written))
  if failed:
    cli.fail(f'{len(failed)} run(s) failed: {", ".join(failed)}', code=1)


if __name__ == '__main__':
  app.run(cli.main(reproduce))
