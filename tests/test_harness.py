"""laurel.serve.harness: lm-evaluation-harness scores an LM run as laurel.serve.evaluate, laurel.serve.generate and a direct
computation do, offline, on tasks defined here from local JSONL files."""

import contextlib
import importlib.metadata
import io
import json
import pathlib
import shutil
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from absl import logging

pytest.importorskip('lm_eval', reason="lm-evaluation-harness is an optional extra: pip install -e '.[lm_eval]'")

from helpers import ROOT, TINY_LM, cli_env, load_config  # pylint: disable=wrong-import-position
from laurel import data, train  # pylint: disable=wrong-import-position
from laurel.serve import loader
from laurel.serve import evaluate, generate, harness
from lm_eval.api import registry  # pylint: disable=wrong-import-position
from lm_eval.api.instance import Instance  # pylint: disable=wrong-import-position
from lm_eval.tasks import TaskManager  # pylint: disable=wrong-import-position
from laurel.config_lib import InputError  # pylint: disable=wrong-import-position

SEQ_LEN = TINY_LM['data.seq_len']  # 32: a window scores up to 31 tokens
MC = [{'context': 'the ', 'choices': ['dog', ' d d', 'bbb'], 'label': 1},
      {'context': 'import os\n', 'choices': ['a', 'id d'], 'label': 0},
      {'context': '', 'choices': ['ab', 'd da'], 'label': 1}]  # empty: scored after the end-of-document token
TEXTS = ['short', 'x' * 20 + ' id d da d bbb the end'.ljust(30, '.')]  # 5 tokens: one window; 50: two
PROMPTS = ['the ', 'ab', 'hello wor', '']
MAX_GEN = 12
EXAMPLE = ROOT / 'configs' / 'lm_eval'  # the shipped offline task: python_syntax.yaml over python_syntax.jsonl


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A tiny run trained long enough (40 steps) that its greedy continuations vary, on one device, in this process."""
  workdir = tmp_path_factory.mktemp('harness') / 'run'
  config = load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {**TINY_LM, 'steps': 40, 'log_every': 40})
  train.train(config, str(workdir), devices=jax.devices()[:1])
  return workdir


# Compiled once per model and sequence length: op by op, each forward pass compiled some 80 programs.
_apply = jax.jit(lambda model, params, ids: model.apply({'params': params}, ids), static_argnums=0)


def _logp(model, params, ids) -> np.ndarray:
  """log p(ids[t] | ids[:t]) for t >= 1 from one forward pass, in float64."""
  logits = np.asarray(_apply(model, params, jnp.asarray([ids], jnp.int32))[0, :-1], np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return logits[np.arange(len(ids) - 1), ids[1:]] - logz


def _direct_rolling(model, params, ids, eos) -> float:
  """Each token once: the first window predicts ids[:31] after EOS; the rest (at most 31 more here) are the last
  tokens of one window that ends at the text's end with a full 32 tokens of context."""
  total = _logp(model, params, ([eos] + ids)[:SEQ_LEN]).sum()
  rest = len(ids) - (SEQ_LEN - 1)
  assert rest <= SEQ_LEN - 1
  return float(total + (_logp(model, params, ids[-SEQ_LEN:])[-rest:].sum() if rest > 0 else 0.0))


def _jsonl(path: pathlib.Path, rows) -> str:
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


def _task(directory: pathlib.Path, name: str, data_file: str, output_type: str, **fields):
  """A task YAML (written as JSON, which YAML reads) over a local JSONL file: HF datasets' json builder, offline."""
  spec = {'task': name, 'dataset_path': 'json', 'dataset_kwargs': {'data_files': {'test': data_file}},
          'test_split': 'test', 'output_type': output_type, **fields}
  (directory / f'{name}.yaml').write_text(json.dumps(spec, indent=1) + '\n')


def _example_task(directory: pathlib.Path, name: str, data_file: str):
  """The shipped example's multiple-choice task (prompt, choices, metrics) over another JSONL file."""
  spec = yaml.safe_load((EXAMPLE / 'python_syntax.yaml').read_text())
  spec.update(task=name, dataset_kwargs={'data_files': {'test': data_file}})
  (directory / f'{name}.yaml').write_text(json.dumps(spec, indent=1) + '\n')


def _offline_env(tmp_path, num_devices):
  env = cli_env(num_devices)
  env.update(HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1', HF_EVALUATE_OFFLINE='1', HF_HOME=str(tmp_path / 'hf'))
  return env


class _OwnTasksOnly(TaskManager):
  """lm_eval's task index of --include_path alone: its thousands of own tasks cost some 7 CPU-s to index."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **{**kwargs, 'include_defaults': False})


def _lm_eval_here(*args) -> tuple[int, str]:
  """laurel-lm-eval's command line `args` (laurel.serve.harness.run: lm_eval's, our errors in one line) in this process,
  its tasks those of --include_path: (exit status, stderr)."""
  err, verbosity = io.StringIO(), logging.get_verbosity()
  with contextlib.ExitStack() as stack:
    stack.enter_context(mock.patch.object(sys, 'argv', ['laurel-lm-eval', *map(str, args)]))
    stack.enter_context(mock.patch('lm_eval.tasks.TaskManager', _OwnTasksOnly))
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(err))
    try:
      harness.run()
      status = 0
    except SystemExit as e:
      status = e.code
    finally:
      logging.set_verbosity(verbosity)
  return status, err.getvalue()


def _stop_after(text: str, until) -> str:
  return text[:min([text.find(s) for s in until if s in text], default=len(text))]


@pytest.mark.slow
def test_lm_eval_cli_scores_as_laurel_evaluate_generate_and_a_direct_computation_and_the_shipped_task_offline(
    run, tmp_path):
  """Our tasks, and configs/lm_eval's shipped task as its YAML and docs/evaluation.md give it (from the repository
  root: its data_files is relative to it), in one lm_eval command: lm_eval indexes its thousands of tasks at every
  start. The shipped task's accuracies are laurel.serve.evaluate's on the same JSONL."""
  with loader.lm_run_on_mesh(run) as (task, params, _, _):  # laurel.serve.generate as its command line runs it
    tokenizer = data.make_tokenizer(task.config.data)
    eos = tokenizer.eos_id
    new_BxN, _ = generate.generate(task.model_cfg, params, [tokenizer.encode(p) or [eos] for p in PROMPTS], MAX_GEN)
  choice_logliks = [[_logp(task.model, params, (tokenizer.encode(item['context']) or [eos]) + tokenizer.encode(c))
                     [-len(c.encode()):].sum() for c in item['choices']] for item in MC]
  rolling = [_direct_rolling(task.model, params, tokenizer.encode(t), eos) for t in TEXTS]
  greedy = [tokenizer.decode(list(row)[:list(row).index(eos)] if eos in row else list(row)) for row in new_BxN]
  until = [greedy[0][4:6], greedy[2][7:8], 'no such text']  # stop strings the continuations meet
  expected = [_stop_after(g, until) for g in greedy]
  assert any(0 < len(e) < len(g) for e, g in zip(expected, greedy)), greedy  # the stop strings cut

  tasks = tmp_path / 'tasks'
  tasks.mkdir()
  mc_file = _jsonl(tmp_path / 'mc.jsonl', MC)
  _example_task(tasks, 'laurel_mc', mc_file)
  _task(tasks, 'laurel_text', _jsonl(tmp_path / 'text.jsonl', [{'text': t} for t in TEXTS]), 'loglikelihood_rolling',
        doc_to_text='', doc_to_target='{{text}}', metric_list=[{'metric': 'bits_per_byte'}])
  _task(tasks, 'laurel_gen', _jsonl(tmp_path / 'gen.jsonl', [{'prompt': p} for p in PROMPTS]), 'generate_until',
        doc_to_text='{{prompt}}', doc_to_target='{{prompt}}', metric_list=[{'metric': 'exact_match'}],
        generation_kwargs={'until': until, 'max_gen_toks': MAX_GEN, 'do_sample': False})
  shutil.copy(EXAMPLE / 'python_syntax.yaml', tasks)
  # 8 devices: the batch of 3 is padded to 8 rows sharded over the run's mesh, as laurel.serve.evaluate does.
  command = [sys.executable, '-m', 'laurel.serve.harness', '--model', 'laurel', '--model_args', f'workdir={run}',
             '--tasks', 'laurel_mc,laurel_text,laurel_gen,laurel_python_syntax', '--include_path', str(tasks),
             '--batch_size', '3', '--output_path', str(tmp_path / 'out'), '--log_samples']
  out = subprocess.run(command, env=_offline_env(tmp_path, 8), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert '|laurel_mc' in out.stdout and '|laurel_python_syntax' in out.stdout  # lm_eval's table

  [results_file] = (tmp_path / 'out').glob('*/results_*.json')
  results = json.loads(results_file.read_text())['results']
  samples = {name: [json.loads(l) for l in next((tmp_path / 'out').glob(f'*/samples_{name}_*.jsonl')).read_text()
                    .splitlines()] for name in ('laurel_mc', 'laurel_text', 'laurel_gen')}
  for rows in samples.values():
    rows.sort(key=lambda r: r['doc_id'])

  mc_logliks = [[float(ll) for ll, _ in s['filtered_resps']] for s in samples['laurel_mc']]
  for got, want in zip(mc_logliks, choice_logliks):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # laurel.serve.evaluate on the same items, and on the shipped task's JSONL
  ours, shipped = evaluate.evaluate_run(run, [mc_file, str(EXAMPLE / 'python_syntax.jsonl')], batch_size=3)
  assert results['laurel_mc']['acc,none'] == ours['accuracy']
  assert results['laurel_mc']['acc_bytes,none'] == ours['accuracy_norm']  # both normalise by the choice's bytes
  assert np.mean([ll[item['label']] for ll, item in zip(mc_logliks, MC)]) == pytest.approx(ours['correct_loglik'],
                                                                                        rel=1e-5)

  np.testing.assert_allclose([float(s['filtered_resps'][0]) for s in samples['laurel_text']], rolling, rtol=1e-4)
  assert [s['filtered_resps'][0] for s in samples['laurel_gen']] == expected
  assert shipped['items'] == 24
  assert (results['laurel_python_syntax']['acc,none'], results['laurel_python_syntax']['acc_bytes,none']) == (
      shipped['accuracy'], shipped['accuracy_norm'])

  # Not a run: one line and status 2 (in this process: lm_eval's command line started once above).
  status, stderr = _lm_eval_here(*command[3:5], '--model_args', f'workdir={tmp_path}', *command[7:11])
  assert status == 2 and 'Traceback' not in stderr, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == f"error: --workdir='{tmp_path}': no config.json; is it a laurel run?"


@pytest.mark.slow
def test_laurel_lm_from_python_greedy_flags_and_refused_generation_kwargs(trained_run):
  """The backend lm_eval resolves `--model laurel` to, called from Python on conftest's shared run (the same context
  of 32 tokens as `run`'s; nothing here needs varied continuations)."""
  run = trained_run
  assert registry.get_model('laurel') is harness.LaurelLM
  assert registry.get_model('dummy').__name__ == 'DummyLM'  # the built-in backends stay registered
  [entry] = [e for e in importlib.metadata.entry_points(group='lm_eval.models') if e.name == 'laurel']
  assert entry.load() is harness.LaurelLM  # what lm-eval releases with plug-ins resolve `--model laurel` to

  model = harness.LaurelLM(workdir=str(run), batch_size='auto')
  [best] = model.generate_until([Instance('generate_until', {}, ('the ', {'max_gen_toks': 2}), 0)], disable_tqdm=True)
  other = best[0] + ('q' if best[1] != 'q' else 'z')
  requests = [Instance('loglikelihood', {}, ('the ', c), i) for i, c in enumerate((best, other, best[:1]))]
  results = model.loglikelihood(requests, disable_tqdm=True)
  assert [g for _, g in results] == [True, False, True]
  assert results[2][0] > results[0][0] > results[1][0]  # one more token costs; a worse second token costs more

  assert model.rolling_windows('') == []
  windows = model.rolling_windows('y' * 40)  # 40 tokens: 31 after EOS, then 9 with 23 tokens before them
  assert [(len(t), first) for t, first in windows] == [(32, 1), (32, 23)]
  assert windows[0][0][0] == model.tokenizer.eos_id

  assert model.generation_settings({'until': '\n\n', 'max_gen_toks': 8, 'temperature': 0.0}) == (('\n\n',), 8)
  for kwargs, message in [({'do_sample': True}, 'do_sample=True, temperature=0.0: the laurel backend decodes greedily'),
                          ({'top_p': 0.9}, "top_p=0.9: not supported by the laurel backend"),
                          ({'max_gen_toks': 32}, r'max_gen_toks=32: must be in \[1, 32\)')]:
    with pytest.raises(InputError, match=message):
      model.generation_settings(kwargs)
  with pytest.raises(InputError, match='--model_args pretrained=x: the laurel backend takes workdir=RUN and '
                     'trust_design_file=True only'):
    harness.LaurelLM(workdir=str(run), pretrained='x')
  with pytest.raises(InputError, match='--batch_size=.0.: a positive integer or auto'):
    harness.LaurelLM(workdir=str(run), batch_size='0')
