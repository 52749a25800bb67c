"""On an NVIDIA GPU (marker `gpu`, skipped without one; `make gpu-check` runs them): cuDNN attention on packed rows
against the reference, `auto` choosing cuDNN on Hopper, train steps with cuDNN against the same steps with `xla`
attention, the chunked loss against the full one, and no scatter in the compiled step adding in bfloat16.

Tolerances are relative errors of whole tensors, ‖got − want‖ / ‖want‖: bfloat16 operands (8 mantissa bits) with
float32 accumulation land between 1e-3 and 1e-2, so cuDNN's bfloat16 output and gradients against a float32
reference must stay under 1e-2 and 2e-2 (the gradients pass through two more bfloat16 products). The chunked
loss computes the same sums in another order: in float32 at full matmul precision (XLA's GPU default for float32
is TF32, 10 mantissa bits) 1e-5 for the loss and 1e-4 for its gradients; in bfloat16, where the GPU rounds each
product's output differently for each shape (2.3e-3 on an H200), the bfloat16 bounds above.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from helpers import TINY_LM, load_config, metrics, on_gpu
from laurel import attention, lm, sharding, step, tasks, train, train_config

LEN, HEADS, HEAD_WIDTH, MAX_SEGMENTS = 1024, 4, 64, 16
# Table 5's rows shrunk (the tiny preset) with cuDNN's needs: bfloat16 compute (the paper's dtypes: float32
# parameters), head width 64, a bound on documents per row; the local text corpus packs several per row.
GPU_TINY = {**TINY_LM, 'model.d_model': 128, 'model.num_heads': 2, 'model.d_ff': 384, 'model.dtype': 'bfloat16',
            'model.max_segments': MAX_SEGMENTS, 'data.name': 'text', 'data.seq_len': 256, 'batch_size': 8,
            'steps': 3, 'log_every': 1, 'eval_every': 3, 'eval_steps': 1}


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isfinite(got).all(), 'not finite'
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def packed_rows(rng) -> np.ndarray:
  """Rows of LEN positions: many short documents, short documents then padding, one document filling the row,
  MAX_SEGMENTS - 1 documents then padding (every slot cuDNN has)."""
  def row(lengths):
    ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return np.pad(ids, (0, LEN - len(ids)))
  many = rng.multinomial(LEN - MAX_SEGMENTS, np.ones(MAX_SEGMENTS) / MAX_SEGMENTS) + 1
  return np.stack([row(many), row([3, 100, 1, 250]), row([LEN]),
                   row(rng.integers(1, 60, MAX_SEGMENTS - 1))]).astype(np.int32)


@on_gpu
def test_cudnn_attention_matches_the_reference_on_packed_rows():
  cfg = lm.LMConfig(d_model=HEADS * HEAD_WIDTH, num_heads=HEADS, dtype='bfloat16', max_segments=MAX_SEGMENTS)
  if reason := attention.cudnn_unsupported(cfg, 'gpu'):
    pytest.skip(reason)
  rng = np.random.default_rng(7)
  segments_BxL = jnp.asarray(packed_rows(rng))
  q, k, v = (jnp.asarray(rng.normal(size=(len(segments_BxL), LEN, HEADS, HEAD_WIDTH)), jnp.bfloat16)
             for _ in range(3))
  cudnn = jax.jit(lambda *qkv: attention.cudnn_attention(*qkv, segments_BxL, max_segments=MAX_SEGMENTS))
  reference = jax.jit(lambda *qkv: attention.xla_attention(*(x.astype(jnp.float32) for x in qkv), segments_BxL))
  got, want = cudnn(q, k, v), reference(q, k, v)
  for b in range(len(segments_BxL)):  # each kind of row on its own
    assert relative_error(got[b], want[b]) < 1e-2, b
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  loss = lambda f: lambda *qkv: (f(*qkv).astype(jnp.float32) * w).sum()
  got = jax.grad(loss(cudnn), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for name, g, r in zip('qkv', got, want):
    for b in range(len(segments_BxL)):
      assert relative_error(g[b], r[b]) < 2e-2, (name, b)


def _hopper() -> bool:
  return attention._cudnn_module().check_compute_capability('9.0')  # pylint: disable=protected-access


@on_gpu
def test_auto_attention_is_cudnn_on_hopper_and_the_step_calls_it():
  if not _hopper():
    pytest.skip(f'not a Hopper GPU or newer: {jax.devices()[0].device_kind}')
  config = load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {**GPU_TINY, 'model.attention': 'auto'})
  task = train_config.validate_config(config, num_devices=1)
  assert attention.attention_impl(task.model_cfg, LEN) == 'cudnn'
  mesh = sharding.make_mesh(task.config.mesh, jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(task.config.logical_axis_rules):
    compiled = step.compile_step(task, mesh)[0]
  assert '__cudnn$fmha' in compiled.as_text()  # cuDNN's fused attention custom calls
  no_bound = train_config.validate_config(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {
      **GPU_TINY, 'model.attention': 'auto', 'model.max_segments': 0}), num_devices=1)
  assert attention.attention_impl(no_bound.model_cfg, LEN) == 'xla'  # cuDNN needs the bound


def _three_steps(workdir, **overrides) -> list[dict]:
  config = load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {**GPU_TINY, **overrides})
  train.train(config, str(workdir), devices=jax.devices()[:1])
  return [r for r in metrics(workdir) if 'loss' in r]


@on_gpu
def test_train_steps_with_cudnn_attention_match_xla_attention(tmp_path):
  """Three steps of the same run: the loss and the gradient norm within bfloat16's error (2e-2: the updates of
  earlier steps carry each step's error forward)."""
  if not _hopper():
    pytest.skip(f'not a Hopper GPU or newer: {jax.devices()[0].device_kind}')
  cudnn = _three_steps(tmp_path / 'cudnn', **{'model.attention': 'cudnn'})
  xla = _three_steps(tmp_path / 'xla', **{'model.attention': 'xla'})
  assert [r['step'] for r in cudnn] == [r['step'] for r in xla] == [1, 2, 3]
  for a, b in zip(cudnn, xla):
    assert a['loss'] == pytest.approx(b['loss'], rel=2e-2), a['step']
    assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=2e-2), a['step']


@on_gpu
@pytest.mark.parametrize('dtype, loss_bound, grad_bound', [('float32', 1e-5, 1e-4), ('bfloat16', 1e-2, 2e-2)])
def test_the_chunked_loss_equals_the_full_loss(dtype, loss_bound, grad_bound):
  def task_of(chunk):
    return tasks.get_task(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {
        **GPU_TINY, 'model.attention': 'xla', 'model.dtype': dtype, 'model.loss_chunk': chunk}))
  chunked, full = task_of(256), task_of(0)
  rng = np.random.default_rng(3)
  shapes = jax.eval_shape(full.init, jax.random.key(0), full.example_batch(1))['params']
  params = jax.tree.map(lambda s: jnp.asarray(0.05 * rng.normal(size=s.shape), s.dtype), nn.unbox(shapes))
  batch = full.example_batch(8)
  batch['tokens'] = rng.integers(1, 264, batch['tokens'].shape).astype(np.int32)
  batch['segment_ids'] = np.tile(packed_rows(rng)[:, ::4], (2, 1))  # runs of a quarter of the length
  loss = lambda task: jax.jit(jax.value_and_grad(functools.partial(task.loss, train=True), has_aux=True))
  with jax.default_matmul_precision('highest'):
    (got, _), got_grads = loss(chunked)(params, {}, batch)
    (want, _), want_grads = loss(full)(params, {}, batch)
  assert relative_error(got, want) < loss_bound
  flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
  assert relative_error(flat(got_grads), flat(want_grads)) < grad_bound


@on_gpu
def test_the_compiled_step_adds_no_scatter_in_low_precision():
  """The token lookup's gradient is a float32 scatter-add in the program XLA:GPU compiled (tests/test_scatter.py
  checks the lowered program on the CPU): a bfloat16 one is a compare-and-swap loop, ~20x slower."""
  config = load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {**GPU_TINY, 'model.attention': 'xla'})
  task = train_config.validate_config(config, num_devices=1)
  mesh = sharding.make_mesh(task.config.mesh, jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(task.config.logical_axis_rules):
    text = step.compile_step(task, mesh)[0].as_text()
  scatters = re.findall(r'=\s*(\w+)\[[^\]]*\]\S*\s+scatter\(', text)
  assert scatters and not set(scatters) & {'bf16', 'f16'}, scatters
