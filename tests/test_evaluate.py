"""laurel.serve.evaluate: log-likelihoods against the LM's own logits, the metrics' arithmetic, and the CLI."""

import json
import math
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT, call_main, cli_env
from laurel import data, lm
from laurel.serve import evaluate
from laurel.designs.laurel import LaurelSpec

CFG = lm.LMConfig(vocab_size=258, d_model=16, num_heads=2, d_ff=32, num_layers=2,
                  stream=LaurelSpec(variant='rw+lr', rank=4))


@pytest.fixture(scope='module')
def scorer():
  @jax.jit  # one program, not one per operation
  def init():
    params = lm.LM(CFG).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))['params']
    return jax.tree.map(lambda p: p.unbox() + 0.2 * jax.random.normal(jax.random.key(1), p.value.shape), params,
                        is_leaf=lambda p: hasattr(p, 'unbox'))

  params = init()
  return evaluate.Scorer(lm.LM(CFG), params, seq_len=12, batch_size=3, pad_id=0), params


# Compiled once per sequence length: op by op, each forward pass compiled some 80 programs.
_forward = jax.jit(lambda params, ids: lm.LM(CFG).apply({'params': params}, ids))


def _direct_loglik(params, ids, first):
  """Σ_{t ≥ first} log p(ids[t] | ids[:t]) from one forward pass over the whole sequence, in float64."""
  logits = np.asarray(_forward(params, jnp.asarray([ids], jnp.int32))[0], np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
      -1, keepdims=True)
  return sum(logp[t - 1, ids[t]] for t in range(first, len(ids)))


@pytest.mark.slow
def test_scorer_sums_the_log_likelihood_of_the_scored_tokens(scorer):
  scorer, params = scorer
  rng = np.random.default_rng(0)
  sequences = [(list(rng.integers(1, 257, n)), first) for n, first in ((12, 1), (5, 3), (9, 8), (2, 1), (7, 4))]
  got, _ = scorer(sequences)  # two batches of three, the second padded
  want = [_direct_loglik(params, s, f) for s, f in sequences]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_scorer_tells_whether_every_scored_token_is_the_argmax(scorer):
  scorer, params = scorer
  logits = np.asarray(_forward(params, jnp.asarray([[5, 9]], jnp.int32))[0])
  after_5, after_9 = int(np.argmax(logits[0])), int(np.argmax(logits[1]))
  other = 1 + after_9 % 256  # any token but the argmax
  sequences = [([5, 9, after_9], 2), ([5, 9, other], 2), ([5, 9, after_9], 1), ([5, after_5], 1)]
  logliks, greedy = scorer(sequences)  # the second batch padded: padding is never scored
  assert list(greedy) == [True, False, after_5 == 9, True]
  np.testing.assert_allclose(logliks, [_direct_loglik(params, s, f) for s, f in sequences], rtol=1e-4, atol=1e-4)


def test_choice_sequence_cuts_the_context_and_scores_after_eos_when_it_is_empty():
  tokenizer = data.ByteTokenizer()
  assert evaluate.choice_sequence(tokenizer, 12, '', 'ab') == ([tokenizer.eos_id, 98, 99], 1)
  assert evaluate.choice_sequence(tokenizer, 4, 'abcdef', 'xy') == ([102, 103, 121, 122], 2)
  assert evaluate.choice_sequence(tokenizer, 4, 'a', 'vwxyz') == ([98, 119, 120, 121], 1)


def test_text_task_scores_every_token_but_the_first_once(scorer, tmp_path):
  scorer, params = scorer
  tokenizer = data.ByteTokenizer()
  texts = ['short', 'a longer document that spans several windows of twelve tokens each']
  for i, text in enumerate(texts):
    (tmp_path / f'{i}.txt').write_text(text)
  result = evaluate.text_task(scorer, tokenizer, str(tmp_path / '*.txt'), 0)
  ids = [list(tokenizer.document(t)) for t in texts]
  assert result['tokens'] == sum(len(i) - 1 for i in ids) and result['bytes'] == sum(len(t) - 1 for t in texts)
  # Windows restart the context every 11 tokens, so compare with the same windows scored directly.
  nll = -sum(_direct_loglik(params, i[s:s + 12], 1) for i in ids for s in range(0, len(i) - 1, 11))
  assert result['nll_per_token'] == pytest.approx(nll / result['tokens'], rel=1e-5)
  assert result['bits_per_byte'] == pytest.approx(nll / math.log(2) / result['bytes'], rel=1e-5)
  assert result['perplexity'] == pytest.approx(math.exp(result['nll_per_token']), rel=1e-9)


class _FixedScores:
  seq_len = 64

  def __init__(self, scores):
    self.scores, self.seen = np.asarray(scores, np.float64), []

  def __call__(self, sequences):
    self.seen = sequences
    return self.scores, None


def test_choice_task_metrics(tmp_path):
  items = [{'context': 'ab', 'choices': ['x', 'yyyy'], 'label': 1},  # ll: -2 vs -3 -> acc wrong, per byte right
           {'context': 'c', 'choices': ['p', 'q', 'r'], 'label': 0}]  # -1, -5, -6 -> both right
  path = tmp_path / 'mc.jsonl'
  path.write_text('\n'.join(json.dumps(i) for i in items) + '\n')
  fake = _FixedScores([-2.0, -3.0, -1.0, -5.0, -6.0])
  result = evaluate.choice_task(fake, data.ByteTokenizer(), evaluate.jsonl_items(str(path), 0))
  assert result == {'items': 2, 'accuracy': 0.5, 'accuracy_norm': 1.0, 'correct_loglik': (-3.0 + -1.0) / 2}
  assert fake.seen[0] == ([98, 99, 121], 2)  # context and choice tokenised apart; the choice is scored
  path.write_text('{"context": "a", "choices": ["b"], "label": 3}\n')
  with pytest.raises(ValueError, match=r'line 1: label 3 is not an index of its 1 choices'):
    evaluate.jsonl_items(str(path), 0)


@pytest.mark.parametrize('name', list(evaluate.TFDS_TASKS))
def test_tfds_tasks_read_prepared_data_only(name, tmp_path):
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=6):
    items = evaluate.tfds_items(name, '', 0)
  assert items and all(0 <= label < len(pairs) and all(isinstance(c, str) and isinstance(x, str) for c, x in pairs)
                       for pairs, label in items)
  with pytest.raises(ValueError, match=rf'--task={name}: no prepared .* in --tfds_data_dir='):
    evaluate.tfds_items(name, str(tmp_path), 0)  # nothing prepared there, and nothing is downloaded


def test_winogrande_scores_the_words_after_the_blank():
  pairs, label = evaluate._winogrande({'sentence': 'The cup fell off _ table.', 'option1': 'the', 'option2': 'a',
                                       'label': 1})
  assert pairs == [('The cup fell off the', ' table.'), ('The cup fell off a', ' table.')] and label == 1


@pytest.mark.slow
def test_evaluate_cli(trained_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(trained_run, workdir)  # conftest's; the eval writes its scores beside the checkpoints
  (tmp_path / 'held_out.txt').write_text('def f(x):\n  return x + 1\n' * 20)
  (tmp_path / 'mc.jsonl').write_text(json.dumps({'context': 'def f', 'choices': ['(x):', ' = 3'], 'label': 0}))
  command = [f'--workdir={workdir}', f'--task=text:{tmp_path}/*.txt', f'--task={tmp_path}/mc.jsonl']
  # One device needs a process of its own (this one has 8): the reference the sharded scores are compared with.
  out = subprocess.run([sys.executable, '-m', 'laurel.serve.evaluate', *command], env=cli_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  text, mc = (json.loads(l) for l in out.stdout.splitlines())
  assert text['tokens'] > 0 and 0 < text['bits_per_byte'] < 20 and mc['items'] == 1
  assert json.loads((workdir / 'eval_mc.json').read_text()) == mc
  # Over 8 devices the batch of 3 is padded to 8 rows sharded over the mesh: the same scores.
  status, stdout, stderr = call_main(evaluate.main, *command, '--batch_size=3')
  assert status == 0, stderr[-2000:]
  for one, eight in zip((text, mc), (json.loads(l) for l in stdout.splitlines())):
    numbers = {k for k, v in one.items() if isinstance(v, float)}
    assert numbers and {k: eight[k] for k in numbers} == pytest.approx({k: one[k] for k in numbers}, rel=1e-5)
    assert {k: v for k, v in eight.items() if k not in numbers} == {k: v for k, v in one.items() if k not in numbers}
  status, _, stderr = call_main(evaluate.main, *command[:1], '--task=missing.jsonl')
  assert status == 2 and stderr.strip().splitlines() == [
      "error: --task='missing.jsonl': not held_out, text:GLOB, an existing .jsonl file, nor one of hellaswag, piqa, "
      'arc_easy, arc_challenge, winogrande']


class _TokenCounts:
  """A scorer whose log-likelihood of a window is minus its scored tokens: nll_per_token is then exactly 1."""
  seq_len = 12

  def __init__(self):
    self.windows = []

  def __call__(self, windows):
    self.windows += windows
    return -np.array([len(tokens) - first for tokens, first in windows], np.float64), None


def test_held_out_scores_the_run_s_own_held_out_files(tmp_path):
  """--task=held_out of a text run: the files its split held out, and no other, each one document."""
  for i in range(20):
    (tmp_path / f'{i}.txt').write_text(f'file {i} ' * (i + 1))
  data_cfg = data.LMDataConfig(name='text', path=str(tmp_path / '*.txt'), validation_fraction=0.2)
  held_out = data.split_files(data_cfg.path, data_cfg.validation_fraction)[1]
  result = evaluate.held_out_task(_TokenCounts(), data.ByteTokenizer(), data_cfg, 0)
  texts = [open(f, encoding='utf-8').read() for f in held_out]
  assert 0 < result['documents'] == len(held_out) < 20 and result['nll_per_token'] == 1.0
  assert result['tokens'] == sum(len(t.encode()) for t in texts) == result['bytes'] + len(held_out)
  first = evaluate.held_out_task(_TokenCounts(), data.ByteTokenizer(), data_cfg, 1)
  assert first['documents'] == 1 and first['tokens'] == len(texts[0].encode())


def test_held_out_of_a_synthetic_run_scores_its_validation_documents():
  data_cfg = data.LMDataConfig(name='synthetic')
  result = evaluate.held_out_task(_TokenCounts(), data.ByteTokenizer(), data_cfg, 3)
  documents = [data.SyntheticSource(512, split=1)[i] for i in range(3)]
  assert result['documents'] == 3 and result['tokens'] == sum(len(d.encode()) for d in documents)
  assert evaluate.task_name('held_out') == 'held_out'
  evaluate.check_task('held_out')  # no file of that name needed


@pytest.mark.parametrize('task, name', [('text:/data/held_out/*.txt', 'held_out'), ('text:c4/**/*.txt', 'c4'),
                                        ('text:/data/wiki.valid.txt', 'wiki.valid'), ('text:*.txt', 'text'),
                                        ('tasks/my mc.jsonl', 'my_mc'), ('hellaswag', 'hellaswag')])
def test_task_names_are_short_and_safe_file_names(task, name):
  assert evaluate.task_name(task) == name
