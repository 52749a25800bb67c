"""laurel.designs.mixing, the TPU kernels that mix n streams per token, interpreted on this CPU against the
einsums: the output and the gradients of the coefficients, the streams and y at random inputs; then lowered by the
TPU compiler (libtpu) with their cost estimates."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import needs_libtpu
from laurel import train_config
from laurel.designs import mixing
from laurel.plan import aot, schedule


def _inputs(n, k, batch, length, width, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (normal(n, k, batch, length), normal(n, batch, length, width), normal(k, batch, length),
          normal(batch, length, width), normal(k, batch, length, width))


@pytest.mark.parametrize('n, k, with_y, length, through', [(3, 3, True, 256, False), (4, 1, False, 384, True),
                                                             (2, 4, True, 128, True), (3, 0, False, 128, False)])
def test_kernels_match_the_einsums_with_their_gradients(n, k, with_y, length, through):
  """Forward and the vector-Jacobian product in float32 over one or several token blocks, H passed on (`through`)
  with a gradient of its own downstream, or one output (B, L, D) of coefficients (N, B, L) (k = 0): as the einsums."""
  a, h, b, y, grad = _inputs(n, max(k, 1), 2, length, 128, seed=n + k)
  a, grad = (a[:, 0], grad[0]) if k == 0 else (a, grad)
  args = (a, h, b, y) if with_y else (a, h)
  mixed = lambda kernel: lambda *x: mixing.mix(*x, kernel=kernel, through=through)
  got, want = (jax.vjp(mixed(kernel), *args) for kernel in (True, False))
  grad = (grad, jnp.cos(h)) if through else grad
  for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  for name, g, w in zip('ahby', got[1](grad), want[1](grad)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)


def test_kernels_run_per_device_on_a_mesh():
  """Under a (data 2) mesh of this CPU's devices each device mixes its own rows (shard_map), an odd batch padded."""
  a, h, b, y, _ = _inputs(2, 2, 3, 128, 128)
  mesh = jax.make_mesh((2, 1, 1), ('data', 'fsdp', 'tensor'), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(train_config.LOGICAL_AXIS_RULES):
    run = jax.jit(lambda *x: mixing.mix(*x, kernel=True))
    assert 'shard_map' in str(jax.make_jaxpr(run)(a, h, b, y))
    got = run(a, h, b, y)
  np.testing.assert_allclose(got, mixing.mix(a, h, b, y, kernel=False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('through, devices', [(False, 1), (True, 1), (True, 2)])
def test_normed_product_kernels_match_the_einsum_with_their_gradients(through, devices):
  """RMSNorm(vec H)·φ and its vector-Jacobian product (φ's summed over the devices' rows) as the einsum's."""
  rng = np.random.default_rng(devices)
  h, phi, h_grad = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((3, 3, 128, 128), (3, 128, 12),
                                                                           (3, 3, 128, 128)))
  grad = jnp.asarray(rng.normal(size=(12, 3, 128)), jnp.float32)

  def run(kernel):
    out, vjp = jax.vjp(lambda *x: mixing.normed_product(*x, kernel=kernel, through=through), h, phi)
    return out, vjp((grad, h_grad) if through else grad)

  want = run(False)
  mesh = jax.make_mesh((devices, 1, 1), ('data', 'fsdp', 'tensor'), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(train_config.LOGICAL_AXIS_RULES):
    got = jax.jit(lambda: run(True))()
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@needs_libtpu
def test_the_tpu_compiler_lowers_the_kernels_each_with_its_cost_estimate():
  """Forward and backward in bfloat16 at Table 5's width compile for a v6e chip, each kernel with a cost estimate of
  the streams it reads and writes once."""
  jax.config.update('jax_enable_compilation_cache', False)
  mesh = jax.sharding.Mesh(np.array(aot.slice_devices('v6e:1x1')).reshape(1, 1, 1), ('data', 'fsdp', 'tensor'))
  n, k, batch, length, width = 4, 4, 2, 1024, 768
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=jax.NamedSharding(mesh, jax.P()))
  loss = lambda *x: jnp.vdot(mixing.mix(*x).astype(jnp.float32), jnp.arange(k * batch * length * width).reshape(
      k, batch, length, width).astype(jnp.float32))
  args = (shape(n, k, batch, length, dtype=jnp.float32), shape(n, batch, length, width),
          shape(k, batch, length, dtype=jnp.float32), shape(batch, length, width))
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(train_config.LOGICAL_AXIS_RULES):
      text = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3))).lower(*args).compile().as_text()
  finally:
    jax.config.update('jax_enable_compilation_cache', True)
  ops = [op for op in schedule.executed_ops(text)[0] if op.target == 'tpu_custom_call']
  stream = batch * length * width * 2
  # forward: n + 1 streams in, k out; backward: those, k gradients in and n + 1 out
  assert sorted(op.kernel_bytes // stream for op in ops) == [n + 1 + k, 2 * (n + 1) + k]
