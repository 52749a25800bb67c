"""laurel.flash, the TPU attention kernels over heads side by side, interpreted on this CPU against the einsum
reference (laurel.attention.xla_attention after laurel.attention.rope): outputs and the gradients of q, k and v at
random inputs, on rows of packed documents with padding, over several blocks and head groups; then lowered by the TPU
compiler (libtpu), each kernel with its cost estimate."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import needs_libtpu
from laurel import attention, flash, lm, train_config
from laurel.plan import aot, schedule


@pytest.fixture(scope='module')
def tpu_chip():
  """A sharding on one compile-only v6e chip (libtpu's compiler on this CPU machine); JAX's persistent cache off
  meanwhile (a compile-only client cannot load an executable back from it)."""
  jax.config.update('jax_enable_compilation_cache', False)
  yield jax.sharding.NamedSharding(jax.sharding.Mesh(aot.slice_devices('v6e:1x1'), ('chip',)), jax.P())
  jax.config.update('jax_enable_compilation_cache', True)


def _packed(rng, rows, length):
  """Segment ids 1, 2, ... of random documents, padding (0) at the end of most rows, and each document's positions."""
  segments, positions = np.zeros((rows, length), np.int32), np.zeros((rows, length), np.int32)
  for segment_row, position_row in zip(segments, positions):
    start = 0
    for doc in range(1, rng.integers(1, 5) + 1):
      end = min(length, start + int(rng.integers(1, length // 2)))
      segment_row[start:end], position_row[start:end] = doc, np.arange(end - start)
      start = end
    position_row[start:] = np.arange(length - start)  # padding attends within itself
  return jnp.asarray(segments), jnp.asarray(positions)


def _attention(impl, cfg, q, k, v, segments, positions):
  return attention.attend(dataclasses.replace(cfg, attention=impl), q, k, v, segments, positions)


CASES = {  # (batch, length, heads, head width): blocks of 128 (2 or 3 per row); one head group, or two of 8 heads
    'two_blocks': (1, 256, 2, 64), 'three_blocks_two_rows': (2, 384, 4, 32), 'two_head_groups': (1, 256, 16, 64)}
SLOW = pytest.mark.slow  # interpreted kernels: seconds a case


@pytest.mark.parametrize('case, rotate', [('two_blocks', True), pytest.param('two_blocks', False, marks=SLOW),
                                          pytest.param('three_blocks_two_rows', True, marks=SLOW),
                                          pytest.param('two_head_groups', True, marks=SLOW)])
def test_flash_matches_the_reference_with_its_gradients(case, rotate):
  """Forward and the vector-Jacobian product in float32, q and k rotated in the kernel (or not): the kernels' blocks,
  causal skipping, document masks and head groups give the reference's numbers."""
  batch, length, heads, width = CASES[case]
  cfg = lm.LMConfig(d_model=heads * width, num_heads=heads, rope_base=500.0)
  rng = np.random.default_rng(len(case) + rotate)
  q, k, v, grad = (jnp.asarray(rng.normal(size=(batch, length, heads * width)), jnp.float32) for _ in range(4))
  segments, positions = _packed(rng, batch, length)
  positions = positions if rotate else None
  got, want = ({'out': out, **dict(zip('qkv', vjp(grad)))}
               for out, vjp in (jax.vjp(lambda *x, i=impl: _attention(i, cfg, *x, segments, positions), q, k, v)
                                for impl in ('flash', 'xla')))
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-5, err_msg=name)


def test_the_tiling_fills_whole_lane_tiles_and_skips_the_blocks_above_the_diagonal():
  """Table 5's shape: 512-position blocks, 3 of 4 block pairs visited, 12 heads of 64 in two groups of 384 lanes."""
  t = flash.tiling(1024, 768, 64)
  assert (t.block, t.heads, t.groups, t.blocks, t.visited) == (512, 6, 2, 2, 3)
  assert (flash.tiling(384, 128, 32).block, flash.tiling(200, 128, 32).block) == (128, 0)


def test_flash_runs_per_device_on_a_mesh():
  """Under a (data 2, tensor 2) mesh of this CPU's devices the kernel runs on each device's rows and heads
  (shard_map), an odd batch padded to divide the data axis; the result is the reference's."""
  cfg = lm.LMConfig(d_model=128, num_heads=4)
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(3, 128, 128)), jnp.float32) for _ in range(3))
  segments, positions = _packed(rng, 3, 128)
  mesh = jax.make_mesh((2, 1, 2), ('data', 'fsdp', 'tensor'), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(train_config.LOGICAL_AXIS_RULES):
    run = jax.jit(lambda *x: _attention('flash', cfg, *x, segments, positions))
    assert 'shard_map' in str(jax.make_jaxpr(run)(q, k, v))
    got = run(q, k, v)
  np.testing.assert_allclose(got, _attention('xla', cfg, q, k, v, segments, positions), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@needs_libtpu
def test_the_tpu_compiler_lowers_the_kernels_each_with_its_cost_estimate(tpu_chip):
  """Forward and backward in bfloat16 at 512-position blocks compile for a v6e chip; the step's three kernel calls
  carry cost estimates (laurel.plan.schedule counts none as missing), and what they estimate is what they compute:
  the visited blocks' products."""
  batch, length, width, head_width = 2, 1024, 768, 64
  shape = jax.ShapeDtypeStruct((batch, length, width), jnp.bfloat16, sharding=tpu_chip)
  ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=tpu_chip)
  rotary = flash.Rotary(head_width, 0.125, 10_000.0)
  loss = lambda q, k, v, s, p: flash.flash_attention(q, k, v, s, p, rotary).astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(shape, shape, shape, ids, ids).compile().as_text()
  ops = [op for op in schedule.executed_ops(text)[0] if op.target == 'tpu_custom_call']
  assert len(ops) == 3 and all(op.kernel_flops for op in ops)
  # per visited (query, key) block pair and head: 2 products in the forward, 4 in each backward kernel
  pairs = batch * 3 * (width // head_width) * 512 * 512
  assert sorted(op.kernel_flops // (pairs * 2 * head_width) for op in ops) == [2, 4, 4]
