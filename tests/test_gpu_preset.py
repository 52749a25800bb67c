"""configs/c4_ablation.py's gpu preset: its size, FLOPs and eval set, as its docstring states them; and
scripts/reproduce_c4_ablation.py end to end on it, shrunk."""
import json
import sys

import jax
import pytest

from helpers import ROOT, run_script
from laurel import command_line, data, train_config

sys.path.insert(0, str(ROOT / 'configs'))
import c4_ablation  # noqa: E402  pylint: disable=wrong-import-position

ROWS = {'baseline_24': (15.87e6, 7.48e12), 'baseline_28': (18.49e6, 8.71e12),
        'rw_lr_pa': (None, 7.59e12)}  # params, model FLOPs per step
DOC = ' '.join(c4_ablation.__doc__.split())


def gpu_config(row):
  return command_line.load(f'configs/c4_ablation.py:{row},preset=gpu', [])


@pytest.mark.parametrize('row', list(ROWS))
def test_gpu_preset_params_and_flops_are_the_docstrings(row):
  config = gpu_config(row)
  task = train_config.validate_config(config, 1, 1)
  params = task.num_params(jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params'])
  flops = task.model_flops(config.batch_size)
  want_params, want_flops = ROWS[row]
  if want_params:
    assert params == pytest.approx(want_params, abs=0.005e6)
    assert f'({want_params / 1e6:.2f}M' in DOC
  assert flops == pytest.approx(want_flops, abs=0.005e12)
  assert f'{want_flops / 1e12:.2f}' in DOC


def test_gpu_preset_reaches_the_stated_tokens():
  config = gpu_config('baseline_24')
  tokens = config.batch_size * config.data.seq_len * config.steps
  assert tokens == 32_768_000 and round(tokens / ROWS['baseline_24'][0], 1) == 2.1
  assert '32.8M tokens: 2.1 tokens per parameter' in DOC


def test_gpu_preset_reads_the_installed_sources_and_a_large_fixed_eval_set():
  gpu, tiny = gpu_config('baseline_24'), command_line.load('configs/c4_ablation.py:baseline_24,preset=tiny', [])
  assert (gpu.data.name, gpu.data.path) == ('text', data.INSTALLED)
  eval_tokens = lambda c: c.eval_steps * c.batch_size * c.data.seq_len
  assert eval_tokens(gpu) == 2_097_152 == 64 * eval_tokens(tiny)
  assert gpu.eval_every == gpu.checkpoint_every == gpu.steps  # one eval and one checkpoint, at the end
  assert gpu_config('baseline_28').model.num_layers == 7 and gpu.model.num_layers == 6


# The gpu preset shrunk to run on CPU in seconds: its rows, corpus (the installed sources), schedule and eval as set.
SHRUNK = {'model.d_model': 32, 'model.num_heads': 4, 'model.d_ff': 64, 'model.laurel.rank': 4, 'data.seq_len': 32,
          'batch_size': 8, 'steps': 2, 'log_every': 1, 'eval_every': 2, 'eval_steps': 3, 'checkpoint_every': 2,
          'optimizer.warmup_steps': 1, 'tensorboard': False}


@pytest.mark.slow
def test_reproduce_end_to_end_as_the_gpu_command_shrunk_with_evaluations_and_resumable(tmp_path):
  """scripts/reproduce_c4_ablation.py end to end, as the one command a GPU session runs, shrunk: two of its rows and
  two seeds (four runs, each in a process of its own) and laurel.serve.evaluate's tasks on each; the tables get their
  intervals and eval columns, and a rerun trains nothing that finished and evaluates only the task whose file is
  gone. (A run that did not finish resumes: test_scripts.py's test_local_sweep_end_to_end_and_resumable, the same
  launching.run_points.) The script runs in this process (helpers.run_script): its runs are the processes."""
  from test_scripts import fast_env  # pylint: disable=import-outside-toplevel
  runs, out = tmp_path / 'runs', tmp_path / 'out'
  (tmp_path / 'held_out').mkdir()
  (tmp_path / 'held_out' / 'a.txt').write_text('The quick brown fox jumps over the lazy dog. ' * 3)
  (tmp_path / 'mc.jsonl').write_text('{"context": "One, two,", "choices": [" three", " blue"], "label": 0}\n')
  args = ['--preset=gpu', '--rows=baseline_24,rw_lr_pa', '--seeds=2', f'--workdir={runs}', f'--out={out}',
          f'--evaluate=text:{tmp_path}/held_out/*.txt', f'--evaluate={tmp_path}/mc.jsonl',
          *(f'--set={k}={v}' for k, v in SHRUNK.items())]
  run = lambda: run_script('reproduce_c4_ablation.py', *args, env=fast_env())
  r = run()
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.count('laurel.main') == 4 and r.stdout.count('= evaluate') == 4  # one evaluation per run
  for suffix in ('md', 'csv', 'json', 'png'):
    assert (out / f'c4_ablation_gpu.{suffix}').exists() and f'  {out}/c4_ablation_gpu.{suffix}\n' in r.stdout, suffix
  assert json.loads((runs / 'rw_lr_pa' / 'seed0' / 'provenance.json').read_text())['device'] == 'cpu'
  final = json.loads((runs / 'rw_lr_pa' / 'seed1' / 'final.json').read_text())
  assert final['held_out']['tokens'] <= 3 * 8 * 32 and final['held_out']['batches'] == 3
  assert final['held_out']['loss_se'] > 0
  rows = {r['name']: r for r in json.loads((out / 'c4_ablation_gpu.json').read_text())['rows']}
  assert list(rows) == ['baseline_24', 'rw_lr_pa']
  row, base = rows['rw_lr_pa'], rows['baseline_24']
  assert row['params_m'] > base['params_m'] and base['test_loss_ratio'] == 1.0 and row['peak_memory_gb'] > 0
  assert row['test_loss_diff_n'] == 2
  assert row['test_loss_diff_low'] < row['test_loss_diff'] < row['test_loss_diff_high']
  pairs = [row['test_losses'][s] - base['test_losses'][s] for s in ('seed0', 'seed1')]
  assert row['test_loss_diff'] == pytest.approx(sum(pairs) / 2)
  for name, table_row in rows.items():  # the table's eval columns: the mean of the runs' own eval files
    held_out, mc = ([json.loads((runs / name / s / f'eval_{task}.json').read_text()) for s in ('seed0', 'seed1')]
                    for task in ('held_out', 'mc'))
    assert table_row['eval_held_out_bits_per_byte'] == pytest.approx(
        (held_out[0]['bits_per_byte'] + held_out[1]['bits_per_byte']) / 2) and held_out[0]['bits_per_byte'] > 0
    assert (table_row['eval_mc_accuracy'], table_row['eval_mc_correct_loglik']) == pytest.approx(
        ((mc[0]['accuracy'] + mc[1]['accuracy']) / 2, (mc[0]['correct_loglik'] + mc[1]['correct_loglik']) / 2))
  assert row['eval_mc_correct_loglik_ratio'] == pytest.approx(
      row['eval_mc_correct_loglik'] / base['eval_mc_correct_loglik'])
  text = (out / 'c4_ablation_gpu.md').read_text()
  assert '| rw_lr_pa | 2 |' in text and 'Eval noise: the eval set is ' in text and '(reference)' in text
  assert '| held_out_bits_per_byte | × |' in text
  # Rerun: every run finished, so none trains; the eval files that are there hold, the one deleted is redone.
  mc_file = runs / 'rw_lr_pa' / 'seed0' / 'eval_mc.json'
  mc_before = json.loads(mc_file.read_text())
  mc_file.unlink()
  r = run()
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.count('finished, skipped') == 4 and r.stdout.count('laurel.main') == 0
  assert r.stdout.count('= evaluate') == 1 and f'= evaluate {runs}/rw_lr_pa/seed0: {tmp_path}/mc.jsonl' in r.stdout
  mc_after = json.loads(mc_file.read_text())
  assert (mc_after['accuracy'], mc_after['correct_loglik']) == pytest.approx(
      (mc_before['accuracy'], mc_before['correct_loglik']))
  assert json.loads((out / 'c4_ablation_gpu.json').read_text())['rows'][1]['test_loss'] == pytest.approx(
      row['test_loss'])
