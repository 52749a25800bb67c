"""Per-token mixing of n streams, out_k = Σ_i a[i, k]·H_i (+ b_k·y): the residual update of Hyper-Connections and
their kin (laurel.designs.hyper). On TPU two Pallas kernels, forward and backward, each one pass over the streams
(the mHC paper's fused kernels, arXiv 2512.24880 §4.3.1): as XLA ops the TPU compiler ran the token-batched n×n
products on the MXU, summed over the stream axis at a fraction of the HBM's rate and kept float32 copies of the
streams for the backward. Elsewhere the einsums (the kernels' tests compare the two, interpreted on CPU).

Shapes: N streams in, K out, B batch, L length, D width, C coefficient rows (N·K, then K with y; padded to 8), T
tokens of a grid step. The coefficients are float32 and per token with the stream axes first, the tokens in the
minor dimensions: a kernel reads them as (C, T) rows and transposes them to per-token columns.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laurel import sharding

F32 = jnp.float32
SUBLANES = 8
BLOCK_BYTES = 6 << 20  # the streams one grid step reads and writes (most tokens a step takes within this)


def mix(a_NxKxBxL, h_NxBxLxD, b_KxBxL=None, y_BxLxD=None, kernel=None, through=False):
  """Σ_i a[i, k]·H_i (+ b_k·y) per token, summed in float32: (K, B, L, D) in H's dtype, or (B, L, D) for
  coefficients a (N, B, L); `through`: (that, H), H passed on unchanged so that the backward kernel adds this mix's
  gradient of H to the one H gets downstream in place (XLA's sum of the two would be one more pass over both).
  `kernel`: the Pallas kernels, interpreted off TPU (None: on TPU, where the length is a multiple of 128)."""
  tpu, single = sharding.platform() == 'tpu', a_NxKxBxL.ndim == 3
  a_NxKxBxL = a_NxKxBxL[:, None] if single else a_NxKxBxL
  if not (tpu and h_NxBxLxD.shape[2] % 128 == 0 if kernel is None else kernel):
    out = jnp.einsum('nkbl,nbld->kbld', a_NxKxBxL.astype(h_NxBxLxD.dtype), h_NxBxLxD, preferred_element_type=F32)
    if y_BxLxD is not None:
      out = out + b_KxBxL[..., None] * y_BxLxD.astype(F32)
    out = out.astype(h_NxBxLxD.dtype)
    out = out.reshape(out.shape[1:]) if single else out
    return (out, h_NxBxLxD) if through else out
  n, k = a_NxKxBxL.shape[:2]
  rows = [a_NxKxBxL.reshape((n * k,) + a_NxKxBxL.shape[2:])] + ([] if y_BxLxD is None else [b_KxBxL])
  c_CxBxL = jnp.concatenate(rows).astype(F32)
  c_BxCxL = jnp.pad(c_CxBxL, ((0, -len(c_CxBxL) % SUBLANES), (0, 0), (0, 0))).transpose(1, 0, 2)
  local = functools.partial(_mix, k=0 if single else k, interpret=not tpu, through=through)
  args = (c_BxCxL, h_NxBxLxD) + (() if y_BxLxD is None else (y_BxLxD,))
  stream = (None,) + ACT
  out = ACT if single else stream
  return _per_device(local, args, (('act_batch', None, 'act_len'), stream, ACT)[:len(args)],
                     (out, stream) if through else out)


ACT = ('act_batch', 'act_len', 'act_embed')


def _per_device(fn, args, axes, out_axes):
  """sharding.per_device for kernels that take whole rows: only the batch may be sharded."""
  if not jax.sharding.get_abstract_mesh().empty:
    for names in (*axes, *(out_axes if isinstance(out_axes[0], tuple) else (out_axes,))):
      spec = nn.logical_to_mesh_axes(names)
      if any(p is not None for p, name in zip(spec, names) if name != 'act_batch'):
        raise ValueError(f'laurel.designs.mixing: the kernels take whole rows, but the logical axis rules shard '
                         f'{names} as {spec}')
  return sharding.per_device(fn, args, axes, out_axes)


def _tokens(length: int, width: int, streams: int, itemsize: int) -> int:
  """Tokens per grid step: the largest of 512, 256, 128 that divides the length and keeps `streams` blocks within
  BLOCK_BYTES (else 128)."""
  fits = [t for t in (512, 256, 128) if length % t == 0 and streams * t * width * itemsize <= BLOCK_BYTES]
  return max(fits, default=128)


def _call(kernel, grid_tokens, h, ins, outs, cost, interpret, aliases=None, accumulates=False):
  """pallas_call over (batch, token blocks) of `ins` and `outs`, each named by kind: 'c' (B, C, L) coefficients,
  'h' (X, B, L, D) streams, 'y' (B, L, D), 'w' a whole array every step sees (`accumulates`: an output summed over
  the grid, which then runs in order)."""
  t, d = grid_tokens, h.shape[-1]
  spec = {'c': lambda a: pl.BlockSpec((1, a.shape[1], t), lambda b, l: (b, 0, l)),
          'h': lambda a: pl.BlockSpec((a.shape[0], 1, t, d), lambda b, l: (0, b, l, 0)),
          'y': lambda a: pl.BlockSpec((1, t, d), lambda b, l: (b, l, 0)),
          'w': lambda a: pl.BlockSpec(a.shape, lambda b, l: (0,) * a.ndim)}
  block_bytes = sum(math.prod(s.block_shape) * a.dtype.itemsize
                    for s, a in [(spec[kind](a), a) for kind, a in list(ins) + list(outs)])
  return pl.pallas_call(
      kernel, grid=(h.shape[1], h.shape[2] // t), in_specs=[spec[kind](a) for kind, a in ins],
      out_specs=[spec[kind](a) for kind, a in outs], out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for _, a in outs],
      interpret=interpret, cost_estimate=cost, input_output_aliases=aliases or {},
      compiler_params=pltpu.CompilerParams(dimension_semantics=('arbitrary' if accumulates else 'parallel',) * 2,
                                           vmem_limit_bytes=max(32 << 20, 4 * block_bytes)),
  )(*[a for _, a in ins])


def _cost(h, k: int, y, flops_per_element: int, streams: int) -> pl.CostEstimate:
  """`streams` (B, L, D) arrays of H's dtype read or written, `flops_per_element` per (stream, output, element)."""
  n, b, length, d = h.shape
  coefficient_bytes = 2 * b * length * (n * k + (k if y is not None else 0)) * 4  # read, and written back
  return pl.CostEstimate(flops=int(flops_per_element * (n + (y is not None)) * k * b * length * d), transcendentals=0,
                         bytes_accessed=int(streams * b * length * d * h.dtype.itemsize + coefficient_bytes))


def _columns(c_ref):
  """The coefficients of one grid step as per-token columns (T, C)."""
  return jnp.transpose(c_ref[0])


def _output(ref, j):
  """Output j's block of one grid step, of an (X, B, L, D) array or of a single (B, L, D) one."""
  return ref.at[0] if len(ref.shape) == 3 else ref.at[j, 0]


def _forward_kernel(c_ref, h_ref, *refs, n, k):
  """out_j = Σ_i c[i·K + j]·H_i (+ c[N·K + j]·y)."""
  *y_ref, o_ref = refs
  c_TxC = _columns(c_ref)
  for j in range(k):
    terms = [(i * k + j, h_ref[i, 0]) for i in range(n)] + [(n * k + j, y_ref[0][0]) for _ in y_ref]
    out_TxD = sum(c_TxC[:, r:r + 1] * x.astype(F32) for r, x in terms)
    _output(o_ref, j)[...] = out_TxD.astype(o_ref.dtype)


def _backward_kernel(c_ref, h_ref, g_ref, *refs, n, k, with_y, through):
  """g_H_i = Σ_j c[i·K + j]·g_j (+ H's gradient downstream, `through`), and each coefficient's gradient Σ_d x·g_j per
  token (x = H_i, or y)."""
  refs = list(refs)
  y_ref = refs.pop(0) if with_y else None
  g_down_ref = refs.pop(0) if through else None
  g_c_ref, g_h_ref, g_y_ref = refs + [None] * (3 - len(refs))
  c_TxC = _columns(c_ref)
  lane_1xC = jax.lax.broadcasted_iota(jnp.int32, (1, c_TxC.shape[1]), 1)
  g_c_TxC = jnp.zeros(c_TxC.shape, F32)
  sources = [(h_ref.at[i, 0], g_h_ref.at[i, 0], i * k, None if g_down_ref is None else g_down_ref.at[i, 0])
             for i in range(n)]
  if with_y:
    sources.append((y_ref.at[0], g_y_ref.at[0], n * k, None))
  for x_ref, g_x_ref, first, down_ref in sources:
    x_TxD, g_x_TxD = x_ref[...].astype(F32), 0.0 if down_ref is None else down_ref[...].astype(F32)
    for j in range(k):
      g_TxD = _output(g_ref, j)[...].astype(F32)
      g_x_TxD = g_x_TxD + c_TxC[:, first + j:first + j + 1] * g_TxD
      g_c_TxC = jnp.where(lane_1xC == first + j, jnp.sum(x_TxD * g_TxD, axis=1, keepdims=True), g_c_TxC)
    g_x_ref[...] = g_x_TxD.astype(g_x_ref.dtype)
  g_c_ref[0] = jnp.transpose(g_c_TxC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _mix(c_BxCxL, h_NxBxLxD, y_BxLxD=None, k=1, interpret=False, through=False):
  """k = 0: one output, (B, L, D)."""
  return _mix_forward(c_BxCxL, h_NxBxLxD, y_BxLxD, k, interpret, through)[0]


def _mix_forward(c_BxCxL, h_NxBxLxD, y_BxLxD, k, interpret, through):
  n, b, length, d = h_NxBxLxD.shape
  with_y, single, k = y_BxLxD is not None, k == 0, max(k, 1)
  out = jax.ShapeDtypeStruct((b, length, d) if single else (k, b, length, d), h_NxBxLxD.dtype)
  t = _tokens(length, d, 2 * n + k + 2 * with_y, h_NxBxLxD.dtype.itemsize)
  ins = [('c', c_BxCxL), ('h', h_NxBxLxD)] + ([('y', y_BxLxD)] if with_y else [])
  out_KxBxLxD, = _call(functools.partial(_forward_kernel, n=n, k=k), t, h_NxBxLxD, ins,
                       [('y' if single else 'h', out)], _cost(h_NxBxLxD, k, y_BxLxD, 2, n + with_y + k), interpret)
  out = (out_KxBxLxD, h_NxBxLxD) if through else out_KxBxLxD
  return out, (c_BxCxL, h_NxBxLxD, y_BxLxD)


def _mix_backward(k, interpret, through, saved, g):
  c_BxCxL, h_NxBxLxD, y_BxLxD = saved
  g_KxBxLxD, g_down_NxBxLxD = g if through else (g, None)
  n, _, length, d = h_NxBxLxD.shape
  with_y, single, k = y_BxLxD is not None, k == 0, max(k, 1)
  t = _tokens(length, d, 2 * n + k + 2 * with_y + through * n, h_NxBxLxD.dtype.itemsize)
  ins = [('c', c_BxCxL), ('h', h_NxBxLxD), ('y' if single else 'h', g_KxBxLxD.astype(h_NxBxLxD.dtype))] + (
      [('y', y_BxLxD)] if with_y else []) + ([('h', g_down_NxBxLxD.astype(h_NxBxLxD.dtype))] if through else [])
  outs = [('c', c_BxCxL), ('h', h_NxBxLxD)] + ([('y', y_BxLxD)] if with_y else [])
  kernel = functools.partial(_backward_kernel, n=n, k=k, with_y=with_y, through=through)
  grads = _call(kernel, t, h_NxBxLxD, ins, outs,
                _cost(h_NxBxLxD, k, y_BxLxD, 4, 2 * (n + with_y) + k + through * n), interpret,
                aliases={len(ins) - 1: 1} if through else {})
  return tuple(grads) + (() if with_y else (None,))


_mix.defvjp(_mix_forward, _mix_backward)


def normed_product(h_NxBxLxD, phi_NxDxC, kernel=None, through=False):
  """RMSNorm(vec H)·φ per token over its n·D, (C, B, L) float32: the product of H itself, divided by the RMS after
  (the mHC paper's reordering, §4.3.1), so that one pass over the n streams gives both; `through`, `kernel`: as
  `mix`'s. mHC's coefficients before their biases (eq. 7), DeepSeek-V4's read-out weights'."""
  tpu = sharding.platform() == 'tpu'
  if not (tpu and h_NxBxLxD.shape[2] % 128 == 0 if kernel is None else kernel):
    h32 = h_NxBxLxD.astype(F32)
    n, d = h32.shape[0], h32.shape[-1]
    inv_rms_BxL = jax.lax.rsqrt(sum((h32[i] * h32[i]).sum(-1) for i in range(n)) / (n * d) + EPS)
    c_CxBxL = jnp.einsum('nbld,ndc->cbl', h32, phi_NxDxC.astype(F32)) * inv_rms_BxL
    return (c_CxBxL, h_NxBxLxD) if through else c_CxBxL
  c = phi_NxDxC.shape[-1]
  phi_NxDxC = jnp.pad(phi_NxDxC.astype(F32), ((0, 0), (0, 0), (0, -c % SUBLANES)))
  local = functools.partial(_normed, interpret=not tpu, through=through)
  stream = (None,) + ACT
  rows = ('act_batch', None, 'act_len')
  out = _per_device(local, (h_NxBxLxD, phi_NxDxC), (stream, (None, None, None)), (rows, stream) if through else rows)
  c_BxCxL, h_NxBxLxD = out if through else (out, None)
  c_CxBxL = c_BxCxL[:, :c].transpose(1, 0, 2)
  return (c_CxBxL, h_NxBxLxD) if through else c_CxBxL


EPS = 1e-6  # the RMSNorm's (flax's)


def _normed_columns(h_ref, phi_ref, n):
  """(H·φ, 1/rms) of one grid step's tokens: (T, C) before the norm, (T, 1)."""
  raw_TxC = sum(jax.lax.dot_general(h_ref[i, 0], phi_ref[i].astype(h_ref.dtype), (((1,), (0,)), ((), ())),
                                    preferred_element_type=F32) for i in range(n))
  squares_Tx1 = sum(jnp.sum(jnp.square(h_ref[i, 0].astype(F32)), axis=1, keepdims=True) for i in range(n))
  return raw_TxC, jax.lax.rsqrt(squares_Tx1 / (n * h_ref.shape[-1]) + EPS)


def _normed_kernel(h_ref, phi_ref, c_ref, *, n):
  raw_TxC, inv_Tx1 = _normed_columns(h_ref, phi_ref, n)
  c_ref[0] = jnp.transpose(raw_TxC * inv_Tx1)


def _normed_backward_kernel(h_ref, phi_ref, g_c_ref, *refs, n, through):
  """g_H_i = (g·inv)·φ_iᵀ − H_i·inv³·Σ_c g·raw/(n·D) (+ H's gradient downstream); g_φ_i = H_iᵀ·(g·inv), summed over
  the grid."""
  g_down_ref, g_h_ref, g_phi_ref = refs if through else (None, *refs)

  @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
  def _():
    g_phi_ref[...] = jnp.zeros(g_phi_ref.shape, F32)

  raw_TxC, inv_Tx1 = _normed_columns(h_ref, phi_ref, n)
  g_TxC = jnp.transpose(g_c_ref[0])
  g_raw_TxC = g_TxC * inv_Tx1
  g_squares_Tx1 = -0.5 * inv_Tx1 ** 3 * jnp.sum(g_TxC * raw_TxC, axis=1, keepdims=True) / (n * h_ref.shape[-1])
  for i in range(n):
    h_TxD = h_ref[i, 0]
    g_h_TxD = jax.lax.dot_general(g_raw_TxC.astype(h_TxD.dtype), phi_ref[i].astype(h_TxD.dtype),
                                  (((1,), (1,)), ((), ())), preferred_element_type=F32)
    g_h_TxD = g_h_TxD + 2 * g_squares_Tx1 * h_TxD.astype(F32)
    if through:
      g_h_TxD = g_h_TxD + g_down_ref[i, 0].astype(F32)
    g_h_ref[i, 0] = g_h_TxD.astype(g_h_ref.dtype)
    g_phi_ref[i] += jax.lax.dot_general(h_TxD, g_raw_TxC.astype(h_TxD.dtype), (((0,), (0,)), ((), ())),
                                        preferred_element_type=F32)


def _normed_cost(h, phi, products: int, streams: int) -> pl.CostEstimate:
  n, b, length, d = h.shape
  tokens = b * length
  return pl.CostEstimate(flops=int(products * 2 * tokens * n * d * phi.shape[-1] + 3 * tokens * n * d),
                         transcendentals=tokens, bytes_accessed=int(streams * tokens * d * h.dtype.itemsize
                                                                    + 2 * tokens * phi.shape[-1] * 4))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _normed(h_NxBxLxD, phi_NxDxC, interpret=False, through=False):
  return _normed_forward(h_NxBxLxD, phi_NxDxC, interpret, through)[0]


def _normed_forward(h_NxBxLxD, phi_NxDxC, interpret, through):
  n, b, length, d = h_NxBxLxD.shape
  t = _tokens(length, d, 3 * n, h_NxBxLxD.dtype.itemsize)
  c = jax.ShapeDtypeStruct((b, phi_NxDxC.shape[-1], length), F32)
  c_BxCxL, = _call(functools.partial(_normed_kernel, n=n), t, h_NxBxLxD, [('h', h_NxBxLxD), ('w', phi_NxDxC)],
                   [('c', c)], _normed_cost(h_NxBxLxD, phi_NxDxC, 1, n), interpret)
  return (c_BxCxL, h_NxBxLxD) if through else c_BxCxL, (h_NxBxLxD, phi_NxDxC)


def _normed_backward(interpret, through, saved, g):
  h_NxBxLxD, phi_NxDxC = saved
  g_c_BxCxL, g_down_NxBxLxD = g if through else (g, None)
  n, _, length, d = h_NxBxLxD.shape
  t = _tokens(length, d, 3 * n, h_NxBxLxD.dtype.itemsize)
  ins = [('h', h_NxBxLxD), ('w', phi_NxDxC), ('c', g_c_BxCxL)] + (
      [('h', g_down_NxBxLxD.astype(h_NxBxLxD.dtype))] if through else [])
  kernel = functools.partial(_normed_backward_kernel, n=n, through=through)
  g_h, g_phi = _call(kernel, t, h_NxBxLxD, ins, [('h', h_NxBxLxD), ('w', phi_NxDxC)],
                     _normed_cost(h_NxBxLxD, phi_NxDxC, 3, (3 if through else 2) * n), interpret,
                     aliases={3: 0} if through else {}, accumulates=True)
  return g_h, g_phi


_normed.defvjp(_normed_forward, _normed_backward)
