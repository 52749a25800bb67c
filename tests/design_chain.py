"""A chain of residual sites run through the design protocol (laurel.designs), for the design tests.

LAYERS layers × T sites (attention, MLP), each site's f a toy scale·tanh(norm(x) W), chain parameters from the
design's Chain, the carry from its start to its finish; a Python loop over the layers, or nn.scan.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel.designs import REGISTRY

D, BATCH, LEN, LAYERS, T, EPS = 8, 2, 3, 4, 2, 1e-6


def toy_fn(w_DxD, x, xn, scale):
  """scale·F(xn) with F = tanh(xn W): the scale multiplies F's output, as the LM's folded kernel does. A (q, k, v)
  triple of inputs (an attention site of MUDDFormer, DCA) reads F(q + 2(k − v)): each input with its own weight,
  and exactly F(q) where the three are equal."""
  del x
  if isinstance(xn, tuple):
    q, k, v = xn
    xn = q + 2 * (k - v)
  y = jnp.tanh(xn @ w_DxD)
  return y if scale is None else y * scale.astype(y.dtype)


def rms(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)


class _Layer(nn.Module):
  design: str
  spec: Any

  @nn.compact
  def __call__(self, carry, w_TxDxD, chain_l):
    site = REGISTRY[self.design].site
    for t in range(T):
      carry = site(self.spec, D, t, T, name=f'site{t}')(carry, functools.partial(toy_fn, w_TxDxD[t]), rms,
                                                         lambda y: y, chain_l)
    return carry, None


class Net(nn.Module):
  design: str
  spec: Any
  scan: bool = False

  @nn.compact
  def __call__(self, x_BxLxD, ws_NxTxDxD):
    design = REGISTRY[self.design]
    chain = design.chain(self.spec, LAYERS, T, D, name='chain')()
    carry = design.start(self.spec, x_BxLxD, LAYERS)
    if self.scan:
      stack = nn.scan(_Layer, variable_axes={'params': 0}, split_rngs={'params': True}, length=LAYERS)
      carry, _ = stack(self.design, self.spec, name='layers')(carry, ws_NxTxDxD, chain)
    else:
      for l in range(LAYERS):
        carry, _ = _Layer(self.design, self.spec, name=f'layers_{l}')(carry, ws_NxTxDxD[l],
                                                                      jax.tree.map(lambda a, l=l: a[l], chain))
    # The final norm (rms) where the design reads out after it (mHC-lite's); else the read-out before it.
    return design.read_out(self.spec, carry, rms if design.norm_first(self.spec) else lambda y: y)


def inputs(seed=0):
  """x (B, L, D) and the toy f's weights (N, T, D, D)."""
  rng = np.random.default_rng(seed)
  x_BxLxD = jnp.asarray(rng.normal(size=(BATCH, LEN, D)), jnp.float32)
  return x_BxLxD, jnp.asarray(rng.normal(0, 0.5, (LAYERS, T, D, D)), jnp.float32)


def init(design, spec, boxed=False):
  params = jax.tree.map(lambda a: a, _boxed_init(design, spec))  # new containers: a test may change its tree
  return params if boxed else nn.unbox(params)


@functools.lru_cache(maxsize=None)
def _boxed_init(design, spec):
  """Computed once per design and spec, for the several tests that start from it: run op by op, an init costs
  about eight compiles."""
  return Net(design, spec).init(jax.random.key(0), *inputs()).get('params', {})


def randomize(params, seed=1, scale=0.5):
  """Every parameter moved off its init by N(0, scale²) noise."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: p + jnp.asarray(rng.normal(0, scale, p.shape), p.dtype), params)


def stacked(params):
  """The loop's params (layers_0 … layers_{N−1}) in nn.scan's layout (one 'layers' tree, leading axis N)."""
  params = dict(params)
  layers = [params.pop(f'layers_{l}', None) for l in range(LAYERS)]
  return params if layers[0] is None else {**params, 'layers': jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def run(design, spec, params, scan=False):
  return np.asarray(Net(design, spec, scan).apply({'params': stacked(params) if scan else params}, *inputs()))


def plain(x, ws):
  """The plain pre-norm chain x + F(norm(x)) with the very ops the sites run (float32), for exact comparisons."""
  for l in range(LAYERS):
    for t in range(T):
      x = x + toy_fn(ws[l, t], x, rms(x), None)
  return np.asarray(x)
