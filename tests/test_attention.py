"""Fused attention on packed rows, against the einsum reference (laurel.attention.xla_attention).

cuDNN: its packed form (per-row run offsets and lengths) is built and evaluated in NumPy on this CPU, the call into
jax's private cuDNN module is checked with that evaluation standing in for the kernel, and the kernel itself runs
only where an NVIDIA GPU is (test_cudnn_attention_matches_the_reference_on_gpu). Splash: sequence-minor q, k, v and
its sharding rule under a mesh of this CPU's devices (the Pallas kernel interpreted). Rows hold documents as
contiguous runs of segment ids 1, 2, ... with padding (0) at the end, as laurel.data packs them.
"""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_LM, load_config, on_gpu
from laurel import attention, lm, tasks, train_config
from laurel.plan import hardware

LEN = 128  # splash attention's key tiles are 128 tokens


def _packed_segment_ids(rng, rows, length=LEN, max_docs=6):
  """Rows of 1..max_docs documents of random lengths, padding (0) after them in most rows."""
  out = np.zeros((rows, length), np.int32)
  for row in out:
    docs = rng.integers(1, max_docs + 1)
    used = rng.integers(docs, length + 1) if rng.random() < 0.75 else length
    cuts = np.sort(rng.choice(np.arange(1, used), size=docs - 1, replace=False))
    row[:used] = np.repeat(np.arange(1, docs + 1), np.diff(np.r_[0, cuts, used]))
  return out


def _np_runs(segment_ids_L):
  """[(first position, length)] of each run of equal ids, padding included."""
  runs, start = [], 0
  for _, group in itertools.groupby(segment_ids_L.tolist()):
    n = len(list(group))
    runs.append((start, n))
    start += n
  return runs


def _qkv(rng, batch, heads=2, head_width=8, dtype=jnp.float32):
  return tuple(jnp.asarray(rng.normal(size=(batch, LEN, heads, head_width)), dtype) for _ in range(3))


def _np_packed_attention(q, k, v, seqlens_BxM, offsets_BxM1):
  """Causal softmax attention inside each [offset, offset + seqlen) of each row, in float64; positions outside
  every run stay NaN."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.full(q.shape, np.nan)
  for b in range(q.shape[0]):
    for start, n in zip(offsets_BxM1[b], seqlens_BxM[b]):
      if n < 0:
        continue
      logits = np.einsum('qhk,shk->hqs', q[b, start:start + n], k[b, start:start + n]) / np.sqrt(q.shape[-1])
      logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      out[b, start:start + n] = np.einsum('hqs,shk->qhk', probs / probs.sum(-1, keepdims=True), v[b, start:start + n])
  return out


# ---------------------------------------------------------------------------------------------------
# cuDNN's packed form.

def test_cudnn_segments_are_the_runs_of_each_row():
  rng, max_segments = np.random.default_rng(0), 4
  segments_BxL = np.concatenate([
      _packed_segment_ids(rng, 12, max_docs=max_segments),
      [np.repeat([3, 8, 0], [50, 60, 18])],  # ids need not be 1, 2, ...: runs are what count
      [np.repeat([1, 2, 3, 4, 0], [10, 20, 30, 40, 28])],  # max_segments documents and padding: every slot used
      [np.repeat([1, 2, 3, 4, 5], [10, 20, 30, 40, 28])],  # one more document and no padding: as many runs
      [np.repeat([1, 2, 3, 4, 5, 0], [10, 20, 30, 40, 20, 8])],  # one run too many
      [np.zeros(LEN, np.int32)]])
  packed = attention.cudnn_segments(jnp.asarray(segments_BxL), max_segments)
  seqlens_BxM, offsets_BxM1, overflow_B = map(np.asarray, packed)
  assert seqlens_BxM.shape == (len(segments_BxL), max_segments + 1) and offsets_BxM1.shape[1] == max_segments + 2
  for row, seqlens, offsets, overflow in zip(segments_BxL, seqlens_BxM, offsets_BxM1, overflow_B):
    runs = _np_runs(row)
    assert overflow == (len(runs) > max_segments + 1)
    if overflow:
      continue
    want = np.full((2, max_segments + 2), -1)
    want[:, :len(runs)] = np.asarray(runs).T
    np.testing.assert_array_equal(offsets, want[0])
    np.testing.assert_array_equal(seqlens, want[1, :-1])
  assert overflow_B.tolist() == [False] * (len(segments_BxL) - 2) + [True, False]


def test_attention_over_offsets_and_lengths_is_the_reference():
  """The representation handed to cuDNN, evaluated in NumPy, equals xla_attention at every position, padding too."""
  rng = np.random.default_rng(1)
  segments_BxL = jnp.asarray(_packed_segment_ids(rng, 4))
  q, k, v = _qkv(rng, 4)
  seqlens_BxM, offsets_BxM1, overflow_B = map(np.asarray, attention.cudnn_segments(segments_BxL, 6))
  assert not overflow_B.any()
  np.testing.assert_allclose(_np_packed_attention(q, k, v, seqlens_BxM, offsets_BxM1),
                             attention.xla_attention(q, k, v, segments_BxL), rtol=1e-5, atol=1e-5)


def test_bfloat16_scores_stay_within_bfloat16_error_of_the_reference():
  """model.attention_scores=bfloat16 (scores and exponentials in bfloat16, sums and the value product in float32)
  stays within bfloat16's error of the float64 reference on packed rows, padding included (what it saves:
  test_lean_step.test_bfloat16_scores_put_one_bfloat16_score_buffer_at_the_peak_on_the_tpu_compiler)."""
  rng = np.random.default_rng(2)
  segments_BxL = jnp.asarray(_packed_segment_ids(rng, 4))
  q, k, v = _qkv(rng, 4, heads=4, head_width=16, dtype=jnp.bfloat16)
  seqlens_BxM, offsets_BxM1, _ = map(np.asarray, attention.cudnn_segments(segments_BxL, 6))
  want = _np_packed_attention(q, k, v, seqlens_BxM, offsets_BxM1)
  got = {d: attention.xla_attention(q, k, v, segments_BxL, scores_dtype=d).astype(jnp.float32)
         for d in (jnp.float32, jnp.bfloat16)}
  scale = np.abs(want).max()
  assert np.abs(got[jnp.float32] - want).max() < 0.01 * scale
  assert 0 < np.abs(got[jnp.bfloat16] - want).max() < 0.05 * scale


def test_jax_lays_out_the_packed_form_for_cudnn_as_expected():
  """Pins the private helper of jax._src.cudnn.fused_attention_stablehlo that turns the per-row slots (-1 unused)
  into cuDNN's ragged form: every row's runs in order, offsets counted in elements from the batch's start."""
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=import-outside-toplevel
  rng, max_segments, heads, width = np.random.default_rng(2), 3, 2, 8
  segments_BxL = _packed_segment_ids(rng, 5, max_docs=max_segments)
  seqlens, offsets, _ = attention.cudnn_segments(jnp.asarray(segments_BxL), max_segments)
  q = jnp.zeros((5, LEN, heads, width), jnp.bfloat16)
  flat_seqlens, _, flat_offsets, _ = map(np.asarray, fused_attention_stablehlo._fix_seqlen_offsets(  # pylint: disable=protected-access
      seqlens, seqlens, offsets, offsets, q, q))
  runs = [(b * LEN + start, n) for b, row in enumerate(segments_BxL) for start, n in _np_runs(row)]
  starts, lengths = np.asarray(runs).T
  np.testing.assert_array_equal(flat_offsets.ravel()[:len(runs) + 1], np.r_[starts, 5 * LEN] * heads * width)
  np.testing.assert_array_equal(flat_seqlens.ravel(), np.r_[lengths, np.zeros(flat_seqlens.size - len(runs))])


def test_the_private_cudnn_api_is_the_one_called():
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=import-outside-toplevel
  assert attention._cudnn_module() is fused_attention_stablehlo  # pylint: disable=protected-access
  assert fused_attention_stablehlo.MaskType.PADDING_CAUSAL
  assert callable(fused_attention_stablehlo.check_cudnn_version)
  assert callable(fused_attention_stablehlo.check_compute_capability)


def test_cudnn_attention_hands_cudnn_the_packed_rows(monkeypatch):
  """cudnn_attention's call, with the NumPy evaluation standing in for the kernel: causal with lengths, the query
  scale, the B×L×H×K layout; and a row with more documents than max_segments comes out NaN."""
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=import-outside-toplevel
  calls = []

  def kernel(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None,
             kv_offsets=None, *, scale, mask_type, qkv_layout):
    calls.append(dict(scale=scale, mask_type=mask_type, qkv_layout=qkv_layout, bias=bias, mask=mask))
    np.testing.assert_array_equal(q_seqlen, kv_seqlen)
    np.testing.assert_array_equal(q_offsets, kv_offsets)
    return jnp.asarray(_np_packed_attention(query, key, value, np.asarray(q_seqlen), np.asarray(q_offsets)),
                       query.dtype)

  monkeypatch.setattr(fused_attention_stablehlo, 'dot_product_attention', kernel)
  rng = np.random.default_rng(3)
  segments_BxL = _packed_segment_ids(rng, 3, max_docs=3)
  segments_BxL[2] = np.repeat([1, 2, 3, 4, 0], [30, 30, 30, 30, 8])  # four documents, a bound of three
  q, k, v = _qkv(rng, 3)
  got = np.asarray(attention.cudnn_attention(q, k, v, jnp.asarray(segments_BxL), max_segments=3))
  assert calls == [dict(scale=8 ** -0.5, mask_type=fused_attention_stablehlo.MaskType.PADDING_CAUSAL,
                        qkv_layout='BTNH', bias=None, mask=None)]
  np.testing.assert_allclose(got[:2], attention.xla_attention(q, k, v, jnp.asarray(segments_BxL))[:2], rtol=1e-5,
                             atol=1e-5)
  assert np.isnan(got[2]).all()


def _validate(**model):
  overrides = {**TINY_LM, 'data.seq_len': LEN, **{f'model.{k}': v for k, v in model.items()}}
  return train_config.validate_config(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', overrides), 1, 1)


CUDNN_READY = dict(attention='cudnn', dtype='bfloat16', max_segments=8)  # all cudnn needs but the machine


@pytest.mark.parametrize('model,message', [
    (dict(CUDNN_READY, dtype='float32'),
     "model.dtype='float32': model.attention='cudnn' needs bfloat16 or float16 compute"),
    (dict(CUDNN_READY, d_model=48, num_heads=4),
     "model.num_heads=4: a head width of 12 (d_model/num_heads); model.attention='cudnn' needs a multiple of 8, "
     'at most 256'),
    (dict(CUDNN_READY, d_model=512, num_heads=1),
     "model.num_heads=1: a head width of 512 (d_model/num_heads); model.attention='cudnn' needs a multiple of 8, "
     'at most 256'),
    (dict(CUDNN_READY, max_segments=0),
     "model.max_segments=0: model.attention='cudnn' needs a bound on the documents packed per row (cuDNN keeps "
     'softmax statistics for each); set one, e.g. 16, and the loader packs at most that many'),
    (CUDNN_READY, "model.attention='cudnn': needs an NVIDIA GPU; the step is compiled for cpu"),
    (dict(max_segments=LEN + 1), 'model.max_segments=129: a row of data.seq_len=128 tokens holds at most 128 '
                                 'documents'),
], ids=['dtype', 'head_width', 'head_too_wide', 'no_bound', 'not_a_gpu', 'bound_above_length'])
def test_attention_the_platform_cannot_serve_is_one_line_before_tracing(model, message):
  with pytest.raises(ValueError, match='^' + message.replace('(', r'\(').replace(')', r'\)') + '$'):
    _validate(**model)


def test_the_loader_packs_at_most_max_segments_documents_per_row():
  def most_documents(max_segments):
    task = tasks.get_task(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {
        **TINY_LM, 'data.seq_len': 512, 'model.max_segments': max_segments}))
    it = iter(task.dataset(train=True, batch_size=8, seed=0, process_index=0, process_count=1))
    return max(len({s for s in row if s}) for _ in range(4) for row in next(it)['segment_ids'])
  assert most_documents(0) > 2 >= most_documents(2)


@on_gpu
def test_cudnn_attention_matches_the_reference_on_gpu():
  """cuDNN's kernel against xla_attention on packed rows with padding, forward and gradients, in bfloat16."""
  max_segments, heads, width = 6, 4, 64
  cfg = lm.LMConfig(d_model=heads * width, num_heads=heads, dtype='bfloat16', max_segments=max_segments)
  if reason := attention.cudnn_unsupported(cfg, 'gpu'):
    pytest.skip(reason)
  rng = np.random.default_rng(4)
  segments_BxL = jnp.asarray(_packed_segment_ids(rng, 4, max_docs=max_segments))
  q, k, v = _qkv(rng, 4, heads, width, jnp.bfloat16)
  cudnn = jax.jit(functools.partial(attention.cudnn_attention, max_segments=max_segments))
  reference = jax.jit(lambda *qkv: attention.xla_attention(*(x.astype(jnp.float32) for x in qkv), segments_BxL))
  np.testing.assert_allclose(np.asarray(cudnn(q, k, v, segments_BxL), np.float32), reference(q, k, v),
                             rtol=2e-2, atol=2e-2)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  loss = lambda f: lambda *qkv: (f(*qkv).astype(jnp.float32) * w).sum()
  got = jax.grad(loss(lambda *qkv: cudnn(*qkv, segments_BxL)), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=5e-2, atol=5e-2)


# ---------------------------------------------------------------------------------------------------
# Splash attention: sequence-minor layouts, and always sharded under a mesh.

def _pallas_operand_shapes(jaxpr):
  """Shapes of every pallas_call's operands, in the jaxpr and the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call':
      yield [tuple(x.aval.shape) for x in eqn.invars]
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          yield from _pallas_operand_shapes(getattr(sub, 'jaxpr', sub))


def test_splash_lays_q_k_v_out_sequence_minor():
  """The kernel's q, k and v operands are K×L tiles per head (a 64-wide head is not padded to 128 lanes)."""
  q, k, v = _qkv(np.random.default_rng(5), 2, heads=2, head_width=8)
  jaxpr = jax.make_jaxpr(attention.splash_attention)(q, k, v, jnp.ones((2, LEN), jnp.int32))
  forward = next(_pallas_operand_shapes(jaxpr.jaxpr))
  assert forward.count((2, 2, 8, LEN)) == 3 and (2, 2, LEN, 8) not in forward


def _splash_on_mesh(batch, heads=2, rules=train_config.LOGICAL_AXIS_RULES, data=2, tensor=2):
  rng = np.random.default_rng(6)
  q, k, v = _qkv(rng, batch, heads)
  segments_BxL = jnp.asarray(_packed_segment_ids(rng, batch))
  mesh = jax.make_mesh((data, 1, tensor), ('data', 'fsdp', 'tensor'), devices=jax.devices()[:data * tensor],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    attend = jax.jit(attention.splash_attention)
    text = str(jax.make_jaxpr(attend)(q, k, v, segments_BxL))
    return attend(q, k, v, segments_BxL), attention.xla_attention(q, k, v, segments_BxL), text


@pytest.mark.parametrize('batch', [1, 3], ids=['init_batch_of_one', 'odd_batch'])
def test_splash_runs_sharded_when_the_batch_does_not_divide_the_mesh(batch):
  """A batch that does not divide data×fsdp (init's batch of one; an evaluation's odd batch) is padded to one that
  does, so the kernel still runs per device under shard_map; the outputs are the reference's."""
  got, want, jaxpr = _splash_on_mesh(batch)
  assert 'shard_map' in jaxpr
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _first_line_of_error(**kwargs) -> str:
  """Raised while tracing, so JAX appends a note on its traceback after the message's line."""
  with pytest.raises(ValueError) as error:
    _splash_on_mesh(2, **kwargs)
  return str(error.value).splitlines()[0]


def test_splash_heads_that_do_not_divide_the_mesh_are_an_error():
  assert _first_line_of_error(heads=3) == ("model.num_heads=3: model.attention='splash' shards heads over tensor "
                                           '(2 ways), which must divide them')


def test_splash_with_the_sequence_sharded_is_an_error():
  rules = tuple(('act_len', 'tensor') if name == 'act_len' else (name, axes)
                for name, axes in train_config.LOGICAL_AXIS_RULES)
  assert _first_line_of_error(rules=rules) == ("model.attention='splash': needs each row's whole sequence on a "
                                               'device, but the logical axis rules shard act_len over tensor (2 ways)')


# ---------------------------------------------------------------------------------------------------
# Attention's FLOPs, counted analytically (a Pallas kernel's own matmuls are missing from the compiler's count).

def test_attention_flops_are_the_compilers_count_of_the_einsums():
  """Non-causal: XLA's count of attention's two matmuls and, for training, of their four backward matmuls."""
  batch, heads, width = 2, 3, 8
  q, k, v = (jnp.ones((batch, heads, LEN, width)) for _ in range(3))
  p = jnp.ones((batch, heads, LEN, LEN))
  forward = lambda q, k, p, v: (jnp.einsum('bhqk,bhsk->bhqs', q, k), jnp.einsum('bhqs,bhsk->bhqk', p, v))
  step = lambda *x: jax.vjp(forward, *x)[1](forward(*x))
  count = lambda f: hardware.xla_costs(jax.jit(f).lower(q, k, p, v))[0]
  assert attention.attention_flops(batch, LEN, heads, width, causal=False, train=False) == count(forward)
  assert attention.attention_flops(batch, LEN, heads, width, causal=False) == count(step)


def test_attention_flops_causal_and_the_model_flops_term():
  b, length, heads, width = 4, 1024, 12, 64
  full = attention.attention_flops(b, length, heads, width, causal=False)
  causal = attention.attention_flops(b, length, heads, width)
  assert causal == full * (length + 1) / (2 * length)
  assert attention.attention_flops(b, length, heads, width, train=False) * 3 == causal
  # LMTask.model_flops per token is 6N + 12·layers·D·T (PaLM): its term in T is the non-causal count of every layer.
  per_token = lambda t: tasks.get_task(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {
      'data.seq_len': t})).model_flops(b) / (b * t)
  cfg = tasks.get_task(load_config('configs/c4_ablation.py:rw_lr,preset=tiny')).model_cfg
  per_layer_and_position = (per_token(2 * LEN) - per_token(LEN)) / LEN / cfg.num_layers
  assert attention.attention_flops(b, LEN, cfg.num_heads, cfg.d_model // cfg.num_heads, causal=False) == (
      b * LEN * LEN * per_layer_and_position)
