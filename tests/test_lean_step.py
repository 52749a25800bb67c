"""Tests of the lean train step: the chunked cross-entropy (laurel.cross_entropy) and the named remat policies."""

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import load_config, needs_libtpu
from laurel import cross_entropy, lm, tasks
from laurel.plan import aot, schedule

VOCAB, D, LEN, BATCH = 37, 8, 12, 3
# Row 0: two documents, then padding; row 1: one document; row 2: three documents.
SEGMENTS_BxL = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 3 + [2] * 6 + [3] * 3], np.int32)


def _np_loss_sums(x_BxLxD, w_VxD, tokens_BxL, segments_BxL):
  """Σ weight·nll and Σ weight·[target's logit = the largest] from the full logits, in float64: position t predicts
  token t+1 where both lie in the same document (segment > 0)."""
  logits_BxLxV = np.einsum('bld,vd->blv', np.float64(x_BxLxD), np.float64(w_VxD))[:, :-1]
  targets_BxL = tokens_BxL[:, 1:]
  weights_BxL = (segments_BxL[:, 1:] == segments_BxL[:, :-1]) & (segments_BxL[:, 1:] > 0)
  top_BxL = logits_BxLxV.max(-1)
  lse_BxL = top_BxL + np.log(np.exp(logits_BxLxV - top_BxL[..., None]).sum(-1))
  label_BxL = np.take_along_axis(logits_BxLxV, targets_BxL[..., None], -1)[..., 0]
  correct_BxL = label_BxL == top_BxL  # a tie for the largest counts
  return ((lse_BxL - label_BxL) * weights_BxL).sum(), (correct_BxL * weights_BxL).sum()


def _random(seed):
  rng = np.random.default_rng(seed)
  x_BxLxD = rng.normal(size=(BATCH, LEN, D)).astype(np.float32)
  w_VxD = rng.normal(size=(VOCAB, D)).astype(np.float32)
  tokens_BxL = rng.integers(0, VOCAB, size=(BATCH, LEN)).astype(np.int32)
  return x_BxLxD, w_VxD, tokens_BxL


@pytest.fixture(params=['default', 'tpu'])
def platform_form(request, monkeypatch):
  """The loss's form for other platforms, and its TPU form (platform_dependent's `tpu` branch) run here on the CPU."""
  if request.param == 'tpu':
    monkeypatch.setattr(jax.lax, 'platform_dependent', lambda *args, tpu, default: tpu(*args))
  return request.param


@pytest.mark.parametrize('chunk', [0, 1, 4, 5, 12, 64])  # all at once, dividing, not dividing, longer than L
def test_chunked_cross_entropy_equals_full_logits_with_packing_and_padding(chunk, platform_form):
  x_BxLxD, w_VxD, tokens_BxL = _random(chunk)
  targets_BxL, weights_BxL = cross_entropy.shifted_targets(tokens_BxL, SEGMENTS_BxL)
  nll, correct = cross_entropy.chunked(x_BxLxD, w_VxD, 'vd', targets_BxL, weights_BxL, chunk)
  want_nll, want_correct = _np_loss_sums(x_BxLxD, w_VxD, tokens_BxL, SEGMENTS_BxL)
  np.testing.assert_allclose(nll, want_nll, rtol=1e-5)
  assert correct == want_correct
  assert weights_BxL.sum() == 7 + 11 + 9  # every position but document ends and padding
  # The same kernel laid out D×V gives the same sums.
  nll_dv, _ = cross_entropy.chunked(x_BxLxD, w_VxD.T, 'dv', targets_BxL, weights_BxL, chunk)
  np.testing.assert_allclose(nll_dv, nll, rtol=1e-6)


def test_chunked_cross_entropy_counts_a_tie_for_the_largest_logit_as_correct(platform_form):
  x_BxLxD, w_VxD, tokens_BxL = _random(2)
  x_BxLxD[:, :4] = 0.0  # every logit 0: the target ties for the largest, though argmax picks entry 0
  targets_BxL, weights_BxL = cross_entropy.shifted_targets(tokens_BxL, SEGMENTS_BxL)
  _, correct = cross_entropy.chunked(x_BxLxD, w_VxD, 'vd', targets_BxL, weights_BxL, 5)
  right_BxL = np.einsum('bld,vd->blv', x_BxLxD, w_VxD).argmax(-1) == np.asarray(targets_BxL)
  right_BxL[:, :4] = True
  assert correct == (right_BxL * weights_BxL).sum() == _np_loss_sums(x_BxLxD, w_VxD, tokens_BxL, SEGMENTS_BxL)[1]


def test_chunked_cross_entropy_gradients_equal_full_logits(platform_form):
  x_BxLxD, w_VxD, tokens_BxL = _random(1)
  targets_BxL, weights_BxL = cross_entropy.shifted_targets(tokens_BxL, SEGMENTS_BxL)

  def full(x, w):  # today's formulation: slice the float32 logits and take the label's log-probability
    logits_BxLxV = jnp.einsum('bld,vd->blv', x, w)[:, :-1]
    logp_BxL = jnp.take_along_axis(jax.nn.log_softmax(logits_BxLxV), jnp.asarray(tokens_BxL)[:, 1:, None], -1)[..., 0]
    return -(logp_BxL * weights_BxL[:, :-1]).sum()

  want = jax.grad(full, (0, 1))(x_BxLxD, w_VxD)
  for chunk in (0, 5):
    got = jax.grad(lambda x, w: cross_entropy.chunked(x, w, 'vd', targets_BxL, weights_BxL, chunk)[0], (0, 1))(
        x_BxLxD, w_VxD)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _temp_bytes_of_loss_gradient(chunk, batch=2, length=256, vocab=4096, d=16):
  x = jax.ShapeDtypeStruct((batch, length, d), jnp.float32)
  w = jax.ShapeDtypeStruct((vocab, d), jnp.float32)
  targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  weights = jax.ShapeDtypeStruct((batch, length), jnp.float32)
  grad = jax.grad(lambda x, w, t, m: cross_entropy.chunked(x, w, 'vd', t, m, chunk)[0], (0, 1))
  return jax.jit(grad).lower(x, w, targets, weights).compile().memory_analysis().temp_size_in_bytes


def test_chunked_cross_entropy_keeps_one_chunk_of_logits_live():
  logits_bytes = 2 * 256 * 4096 * 4  # float32 (B, L, V): 8 MiB
  assert _temp_bytes_of_loss_gradient(0) >= logits_bytes
  # 8 chunks of 32 positions: forward and backward hold a chunk's logits and their gradient (and the compiler's
  # copies of them), never all of them.
  assert _temp_bytes_of_loss_gradient(32) < logits_bytes / 2


def test_a_chunk_longer_than_the_rows_computes_no_padding():
  """A loss_chunk above the sequence length (the default 256 for short rows) is one chunk of the rows' own length:
  no padded positions' logits computed and thrown away."""
  flops = lambda chunk: jax.jit(lambda x, w, t, m: cross_entropy.chunked(x, w, 'vd', t, m, chunk)[0]).lower(
      jax.ShapeDtypeStruct((2, 32, 16), jnp.float32), jax.ShapeDtypeStruct((512, 16), jnp.float32),
      jax.ShapeDtypeStruct((2, 32), jnp.int32), jax.ShapeDtypeStruct((2, 32), jnp.float32)).cost_analysis()['flops']
  assert flops(256) == flops(0) > 2 * 2 * 32 * 16 * 512  # at least the logits' product


@needs_libtpu
def test_on_a_tpu_a_second_product_sums_the_exponentials_and_the_schedule_counts_it_as_the_loss():
  mesh = jax.sharding.Mesh(np.array(aot.slice_devices('v6e:1x1')), ('data',))
  spec = lambda *shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
  batch, length, vocab, d = 2, 128, 2048, 128
  loss = lambda x, w, t, m: cross_entropy.chunked(x, w, 'vd', t, m, 32, jnp.bfloat16)
  compiled = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)).lower(
      spec(batch, length, d, dtype=jnp.bfloat16), spec(vocab, d, dtype=jnp.float32),
      spec(batch, length, dtype=jnp.int32), spec(batch, length, dtype=jnp.float32)).compile()
  ops, _ = schedule.executed_ops(compiled.as_text())
  assert {op.group for op in ops if op.cycles} == {'loss'}
  logits = [op.trips for op in ops if op.opcode == 'fusion' and op.op_name.endswith('bcd,vd->bcv/dot_general')]
  assert logits == [4, 4]  # each chunk's, twice


# The LM task's loss on a tiny model at random parameters, packed batches, tied and untied embeddings.

TINY = {'model.d_model': 16, 'model.num_heads': 2, 'model.d_ff': 32, 'model.num_layers': 2, 'model.vocab_size': 40,
        'data.name': 'synthetic', 'data.seq_len': LEN, 'model.scan_layers': False}


def _task_and_params(tie, seed, **overrides):
  config = load_config('configs/c4_ablation.py:rw_lr,preset=tiny',
                       {**TINY, 'model.tie_embeddings': tie, **overrides})
  task = tasks.get_task(config)
  shapes = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params']
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype), nn.unbox(shapes))
  return task, params


def _packed_batch(seed):
  tokens_BxL = np.random.default_rng(seed).integers(1, 40, size=(BATCH, LEN)).astype(np.int32)
  positions_BxL = np.concatenate([np.arange(5), np.arange(4), np.zeros(3)]).astype(np.int32)
  positions_BxL = np.stack([positions_BxL, np.arange(LEN), np.r_[np.arange(3), np.arange(6), np.arange(3)]])
  return {'tokens': tokens_BxL, 'segment_ids': SEGMENTS_BxL, 'positions': positions_BxL.astype(np.int32)}


@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
@pytest.mark.slow
def test_lm_loss_and_gradients_equal_the_full_logits_loss(tie):
  task, params = _task_and_params(tie, seed=int(tie), **{'model.loss_chunk': 5})
  batch = _packed_batch(2)

  def full_logits_loss(params):  # the loss as computed from the model's own logits, all positions at once
    logits_BxLxV = task.model.apply({'params': params}, batch['tokens'], batch['positions'], batch['segment_ids'])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxLxV[:, :-1]), batch['tokens'][:, 1:, None], -1)[..., 0]
    segments_BxL = batch['segment_ids']
    weights_BxL = (segments_BxL[:, 1:] == segments_BxL[:, :-1]) & (segments_BxL[:, 1:] > 0)
    return (nll * weights_BxL).sum() / weights_BxL.sum()

  loss = jax.jit(jax.value_and_grad(task.loss, has_aux=True), static_argnums=3)  # one compile, not op by op
  (value, (metrics, _)), grads = loss(params, {}, batch, True)
  want_value, want_grads = jax.jit(jax.value_and_grad(full_logits_loss))(params)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  np.testing.assert_allclose(metrics['loss'][0] / metrics['loss'][1], want_value, rtol=1e-5)
  assert metrics['loss'][1] == 27
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6), grads, want_grads)


# Remat policies: each keeps what it names, and none changes the gradients.

def _block_residuals(policy):
  """Shapes of what the backward pass keeps of one rematerialised block (flax.linen.remat), beyond its inputs."""
  cfg = lm.LMConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_layers=2, scan_layers=False)
  block = nn.remat(lm.Block, policy=lm.REMAT_POLICIES[policy])(cfg)
  x_BxLxD = jnp.ones((2, 8, 16))
  positions_BxL, segments_BxL = jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
  carry = ((x_BxLxD, ()), None)
  variables = block.init(jax.random.key(0), carry, positions_BxL, segments_BxL, (0, None))

  def f(params, x_BxLxD):
    return block.apply({'params': params}, ((x_BxLxD, ()), None), positions_BxL, segments_BxL, (0, None))[0][0][0]

  printed = io.StringIO()  # jax prints them ('f32[2,8,16] from ...'); only the printing form is public
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(f, variables['params'], x_BxLxD)
  kept = [re.match(r'\w+\[([\d,]*)\] (.*)', line).groups() for line in printed.getvalue().splitlines()]
  shapes = [tuple(int(n) for n in dims.split(',') if n) for dims, why in kept if 'from the argument' not in why]
  return sorted(s for s in shapes if len(s) > 2)


@pytest.mark.parametrize('policy,kept', [
    ('full', []),
    ('save_qkv', [(2, 8, 16)] * 3),
    ('save_qkv_attention', [(2, 8, 16)] * 4),
    ('save_qkv_mlp', [(2, 8, 16)] * 3 + [(2, 8, 24)]),
    ('save_out_proj', [(2, 8, 16)]),
    ('minimal', [(2, 8, 16)] * 3 + [(2, 8, 16), (2, 8, 24)]),
])
def test_remat_policy_keeps_exactly_what_it_names(policy, kept):
  assert _block_residuals(policy) == sorted(kept)


@pytest.mark.parametrize('policy', ['save_qkv', 'minimal', 'full'])
@pytest.mark.slow
def test_remat_policies_give_the_same_gradients(policy):
  task, params = _task_and_params(True, seed=3, **{'model.scan_layers': True, 'model.remat': 'none'})
  remat_task = tasks.get_task(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {
      **TINY, 'model.scan_layers': True, 'model.remat': policy}))
  batch = _packed_batch(4)
  grad = lambda t: jax.grad(lambda p: t.loss(p, {}, batch, True)[0])(params)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), grad(remat_task), grad(task))


@needs_libtpu
@pytest.mark.slow
def test_compiler_costs_count_every_loss_chunk():
  """XLA counts the chunk loop's body once; laurel.plan.aot adds the other chunks. The chunked loss makes all its
  products in the forward pass (its backward only scales saved gradients), so the step costs what the unchunked one
  does."""
  # One layer: a layer stack of several would compile twice more (scan_unroll 1 and 2), not the subject here.
  shape = {**TINY, 'model.num_layers': 1, 'model.scan_layers': True, 'model.dtype': 'bfloat16', 'data.seq_len': 128,
           'batch_size': 8, 'model.vocab_size': 512}
  costs = {chunk: aot.compile_for_slice(load_config('configs/c4_ablation.py:baseline_24,preset=tiny', {
      **shape, 'model.loss_chunk': chunk}), 'v6e:2x2')['flops_per_step'] for chunk in (0, 32)}
  # The loss is most of this tiny step's FLOPs: counted once, its 4 chunks would fall short by more than half.
  assert costs[32] == pytest.approx(costs[0], rel=0.03)


@pytest.mark.slow
@needs_libtpu
def test_bfloat16_scores_put_one_bfloat16_score_buffer_at_the_peak_on_the_tpu_compiler():
  """With full remat the peak is one layer's backward, whose largest buffers are the L×L scores: bfloat16 scores
  (model.attention_scores) hold the peak between one bfloat16 L×L buffer and one float32 one (float32 scores: 139.6
  MB here against 70.5 MB, libtpu 0.0.42.1). One compile: each costs about 15 CPU-s."""
  shape = {**TINY, 'model.d_model': 64, 'model.num_heads': 4, 'model.d_ff': 128, 'model.num_layers': 1,
           'model.scan_layers': True, 'model.remat': 'full', 'model.dtype': 'bfloat16', 'data.seq_len': 1024,
           'batch_size': 8, 'model.vocab_size': 512, 'model.attention_scores': 'bfloat16'}
  # One chip: the same rows per chip as a larger slice, without partitioning the step.
  peak = aot.compile_for_slice(load_config('configs/c4_ablation.py:baseline_24,preset=tiny', shape), 'v6e:1x1',
                               costs=False)['temp_bytes']
  scores = 8 * 4 * 1024 * 1024  # a chip's rows × heads × L × L (smaller ones the compiler never materialises)
  assert 2 * scores <= peak < 4 * scores, peak  # the bfloat16 buffer is there; a float32 one would not fit below
