"""Causal flash attention within packed documents for TPUs, with the heads side by side: q, k, v and the output are
(B, L, E = H·K) as the projections make them, so a 64-wide head pads nothing and nothing is transposed. The kernels
apply the rotary embedding and the 1/√K scale to the blocks they load (the rotation's half-head shift is a lane
rotation there), so q and k reach HBM once, as projected, and their gradients leave as such.

Three Pallas kernels (forward, dk/dv, dq), each tiled over (batch, head group, one block axis) with the other block
axis innermost, and each with a pl.CostEstimate of the blocks it visits: the TPU compiler schedules no cycles for a
kernel, so laurel.plan.schedule counts it from that estimate. Every kernel works on scores transposed, keys by
queries, so that a query's statistics (its log-sum-exp, the backward's rowsum(dO·O)) are rows, not columns. Blocks
above the diagonal are neither computed nor fetched. Off TPU the kernels are interpreted (the tests compare them with
laurel.attention's xla path).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
MASKED = -0.7 * float(np.finfo(np.float32).max)  # a score that exp() makes 0, with no inf − inf
GROUP_WIDTH = 512  # most lanes of q, k and v a grid step holds: several heads, so VMEM stays small at any width
NN, NT, TN = ((1,), (0,)), ((1,), (1,)), ((0,), (0,))  # contracted dims of dot_general (no batch dims)


@dataclasses.dataclass(frozen=True)
class Rotary:
  """What the kernels do to q and k as they load them: q·scale and both rotated, if rope_base, as laurel.lm.rope."""
  head_width: int
  scale: float
  rope_base: float | None

  def __call__(self, x_NxW, positions_8xN, scale=1.0, inverse=False):
    """x's heads rotated by their positions (`inverse`: back), times `scale`, in float32."""
    x_NxW = x_NxW.astype(jnp.float32) * scale
    if self.rope_base is None:
      return x_NxW
    n, width = x_NxW.shape
    half = self.head_width // 2
    lane_1xW = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    freq_1xW = jnp.exp((lane_1xW % half).astype(jnp.float32) * (-math.log(self.rope_base) / half))
    angle_NxW = jnp.transpose(positions_8xN)[:, :1].astype(jnp.float32) * freq_1xW
    sin_NxW = jnp.sin(angle_NxW)
    # rotate_half per head, (−x2, x1): x shifted by half a head either way (a lane rotation)
    first_half_1xW = lane_1xW % self.head_width < half
    rotated_NxW = jnp.where(first_half_1xW, -pltpu.roll(x_NxW, width - half, 1), pltpu.roll(x_NxW, half, 1))
    return x_NxW * jnp.cos(angle_NxW) + rotated_NxW * (-sin_NxW if inverse else sin_NxW)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Block sizes of one call: `block` positions of queries and of keys, `heads` heads of width `head_width`."""
  length: int
  width: int  # E = heads in all · head_width
  head_width: int
  block: int
  heads: int  # per grid step

  @property
  def blocks(self) -> int:
    return self.length // self.block

  @property
  def groups(self) -> int:
    return self.width // (self.heads * self.head_width)

  @property
  def visited(self) -> int:
    """(query block, key block) pairs on or below the diagonal."""
    return self.blocks * (self.blocks + 1) // 2


def block_size(length: int) -> int:
  """The largest of 512, 256, 128 that divides the length, else 0 (the kernels need one)."""
  return next((b for b in (512, 256, 128) if length % b == 0), 0)


def tiling(length: int, width: int, head_width: int) -> Tiling:
  """A group is as many heads as fit GROUP_WIDTH lanes and fill whole 128-lane tiles (else every head at once)."""
  heads = width // head_width
  fits = [g for g in range(1, heads + 1) if heads % g == 0 and g * head_width <= GROUP_WIDTH
          and g * head_width % LANES == 0]
  return Tiling(length, width, head_width, block_size(length), max(fits, default=heads))


def _cost(t: Tiling, batch: int, matmuls: int, itemsize: int, streamed: int, once: int) -> pl.CostEstimate:
  """`matmuls` products of block × block × head_width per visited pair and head; `streamed` (B, L, E) arrays read
  once per visited pair, `once` read or written once."""
  pairs = batch * t.groups * t.visited
  per_pair = t.heads * t.block * t.block
  array = batch * t.length * t.width * itemsize
  return pl.CostEstimate(flops=int(pairs * per_pair * (2 * matmuls * t.head_width + 8)),
                         transcendentals=int(pairs * per_pair),
                         bytes_accessed=int(streamed * array * (t.blocks + 1) // 2 + once * array))


def _mask(q_segments_8xQ, kv_segments_8xK, q_block, kv_block, block):
  """keys × queries: key position ≤ query position, same document."""
  kv_segments_Kx1 = jnp.transpose(kv_segments_8xK)[:, :1]
  shape = (block, block)
  q_pos = q_block * block + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  kv_pos = kv_block * block + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  return (kv_pos <= q_pos) & (kv_segments_Kx1 == q_segments_8xQ[:1])


def _dot(a, b, contract):
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, o_ref, lse_ref, q_scr, m_scr,
                    l_scr, acc_scr, *, t, rotary):
  i, j = pl.program_id(2), pl.program_id(3)  # query block, key block (innermost)

  @pl.when(j == 0)
  def _():
    q_scr[...] = rotary(q_ref[0], q_pos_ref[0], rotary.scale).astype(q_scr.dtype)
    m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(j <= i)
  def _():
    mask_KxQ = _mask(q_seg_ref[0], kv_seg_ref[0], i, j, t.block)
    k_KxW = rotary(k_ref[0], kv_pos_ref[0]).astype(k_ref.dtype)
    for h in range(t.heads):
      cols = slice(h * t.head_width, (h + 1) * t.head_width)
      s_KxQ = jnp.where(mask_KxQ, _dot(k_KxW[:, cols], q_scr[:, cols], NT), MASKED)
      m_prev_1xQ = m_scr[h]
      m_1xQ = jnp.maximum(m_prev_1xQ, s_KxQ.max(axis=0, keepdims=True))
      p_KxQ = jnp.where(mask_KxQ, jnp.exp(s_KxQ - m_1xQ), 0.0)
      alpha_1xQ = jnp.exp(m_prev_1xQ - m_1xQ)
      l_scr[h] = alpha_1xQ * l_scr[h] + p_KxQ.sum(axis=0, keepdims=True)
      m_scr[h] = m_1xQ
      acc_scr[h] = alpha_1xQ * acc_scr[h] + _dot(v_ref[0, :, cols], p_KxQ.astype(v_ref.dtype), TN)  # K × queries

  @pl.when(j == i)  # the diagonal is a query block's last
  def _():
    for h in range(t.heads):
      cols = slice(h * t.head_width, (h + 1) * t.head_width)
      o_ref[0, :, cols] = jnp.transpose(acc_scr[h] / l_scr[h]).astype(o_ref.dtype)
      lse_ref[0, 0, h:h + 1] = m_scr[h] + jnp.log(l_scr[h])


def _specs(t: Tiling, causal_index):
  """BlockSpecs of the (B, L, E) arrays, the segment-id and position rows (B, 8, L) and the per-head rows (B, groups,
  heads per group, L), for a grid (batch, group, outer block, inner block); `causal_index(outer, inner)` maps to
  (query block, key block)."""
  def rows(which):
    return pl.BlockSpec((1, t.block, t.heads * t.head_width),
                        lambda b, g, o, n: (b, causal_index(o, n)[which], g))

  def seg(which):
    return pl.BlockSpec((1, SUBLANES, t.block), lambda b, g, o, n: (b, 0, causal_index(o, n)[which]))

  def stats(which):  # a group's heads are the whole second-minor axis
    return pl.BlockSpec((1, 1, t.heads, t.block), lambda b, g, o, n: (b, g, 0, causal_index(o, n)[which]))

  return rows, seg, stats


def _call(kernel, t: Tiling, batch, causal_index, inputs, outputs, scratch, cost, interpret):
  """pallas_call over (batch, group, outer block, inner block) of inputs q, k, v, [dO, lse, Δ,] segment ids and
  positions as queries and as keys; `outputs` ((shape, dtype, spec kind, which), ...)."""
  rows, seg, stats = _specs(t, causal_index)
  kinds = {'rows': rows, 'stats': stats}
  in_specs = [rows(0), rows(1), rows(1)] + ([rows(0), stats(0), stats(0)] if len(inputs) > 7 else [])
  in_specs += [seg(0), seg(1), seg(0), seg(1)]
  return pl.pallas_call(
      kernel, grid=(batch, t.groups, t.blocks, t.blocks), in_specs=in_specs,
      out_specs=[kinds[kind](which) for _, _, kind, which in outputs],
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _, _ in outputs],
      scratch_shapes=scratch, interpret=interpret, cost_estimate=cost,
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary')),
  )(*inputs)


def _forward(q, k, v, rows_8xL, t: Tiling, rotary: Rotary, interpret: bool):
  """(o, log-sum-exp per head (B, groups, heads per group, L))."""
  batch, width = q.shape[0], t.heads * t.head_width
  segments, positions = rows_8xL
  # query block i, key block j; a key block past the diagonal is not fetched (the previous one stays)
  causal = lambda i, j: (i, jnp.minimum(i, j))
  stats_shape = (batch, t.groups, t.heads, t.length)
  return _call(functools.partial(_forward_kernel, t=t, rotary=rotary), t, batch, causal,
               (q, k, v, segments, segments, positions, positions),
               [(q.shape, q.dtype, 'rows', 0), (stats_shape, jnp.float32, 'stats', 0)],
               [pltpu.VMEM((t.block, width), q.dtype), pltpu.VMEM((t.heads, 1, t.block), jnp.float32),
                pltpu.VMEM((t.heads, 1, t.block), jnp.float32),
                pltpu.VMEM((t.heads, t.head_width, t.block), jnp.float32)],
               _cost(t, batch, 2, q.dtype.itemsize, streamed=2, once=2), interpret)


def _scores(q_KxW, k_KxW, v_ref, do_ref, lse_ref, di_ref, mask_KxQ, h, t):
  """(head h's columns, pᵀ and dsᵀ: keys × queries) of one visited block pair, from the rotated and scaled q, k."""
  cols = slice(h * t.head_width, (h + 1) * t.head_width)
  p_KxQ = jnp.where(mask_KxQ, jnp.exp(_dot(k_KxW[:, cols], q_KxW[:, cols], NT) - lse_ref[0, 0, h:h + 1]), 0.0)
  dp_KxQ = _dot(v_ref[0, :, cols], do_ref[0, :, cols], NT)
  return cols, p_KxQ, p_KxQ * (dp_KxQ - di_ref[0, 0, h:h + 1])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, dk_ref,
                dv_ref, k_scr, dk_scr, dv_scr, *, t, rotary):
  j, i = pl.program_id(2), pl.program_id(3)  # key block, query block (innermost)

  @pl.when(i == 0)
  def _():
    k_scr[...] = rotary(k_ref[0], kv_pos_ref[0]).astype(k_scr.dtype)
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  @pl.when(i >= j)
  def _():
    mask_KxQ = _mask(q_seg_ref[0], kv_seg_ref[0], i, j, t.block)
    q_QxW = rotary(q_ref[0], q_pos_ref[0], rotary.scale).astype(q_ref.dtype)
    for h in range(t.heads):
      cols, p_KxQ, ds_KxQ = _scores(q_QxW, k_scr, v_ref, do_ref, lse_ref, di_ref, mask_KxQ, h, t)
      dv_scr[:, cols] += jnp.dot(p_KxQ.astype(do_ref.dtype), do_ref[0, :, cols], preferred_element_type=jnp.float32)
      dk_scr[:, cols] += jnp.dot(ds_KxQ.astype(q_ref.dtype), q_QxW[:, cols], preferred_element_type=jnp.float32)

  @pl.when(i == t.blocks - 1)
  def _():
    dk_ref[0] = rotary(dk_scr[...], kv_pos_ref[0], inverse=True).astype(dk_ref.dtype)
    dv_ref[0] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, dq_ref,
               q_scr, dq_scr, *, t, rotary):
  i, j = pl.program_id(2), pl.program_id(3)  # query block, key block (innermost)

  @pl.when(j == 0)
  def _():
    q_scr[...] = rotary(q_ref[0], q_pos_ref[0], rotary.scale).astype(q_scr.dtype)
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  @pl.when(j <= i)
  def _():
    mask_KxQ = _mask(q_seg_ref[0], kv_seg_ref[0], i, j, t.block)
    k_KxW = rotary(k_ref[0], kv_pos_ref[0]).astype(k_ref.dtype)
    for h in range(t.heads):
      cols, _, ds_KxQ = _scores(q_scr, k_KxW, v_ref, do_ref, lse_ref, di_ref, mask_KxQ, h, t)
      dq_scr[:, cols] += _dot(ds_KxQ.astype(k_ref.dtype), k_KxW[:, cols], TN)

  @pl.when(j == i)  # d(q·scale) rotated back, times the scale
  def _():
    dq_ref[0] = rotary(dq_scr[...], q_pos_ref[0], rotary.scale, inverse=True).astype(dq_ref.dtype)


def _backward(q, k, v, do, lse, di, rows_8xL, t: Tiling, rotary: Rotary, interpret: bool):
  batch, width = q.shape[0], t.heads * t.head_width
  segments, positions = rows_8xL
  inputs = (q, k, v, do, lse, di, segments, segments, positions, positions)
  block = lambda dtype: pltpu.VMEM((t.block, width), dtype)
  # dk, dv: key block j outer, query block i inner from j on (one before j is not fetched: block j stays)
  dk, dv = _call(functools.partial(_dkv_kernel, t=t, rotary=rotary), t, batch, lambda j, i: (jnp.maximum(i, j), j),
                 inputs, [(k.shape, k.dtype, 'rows', 1), (v.shape, v.dtype, 'rows', 1)],
                 [block(k.dtype), block(jnp.float32), block(jnp.float32)],
                 _cost(t, batch, 4, q.dtype.itemsize, streamed=2, once=4), interpret)
  dq = _call(functools.partial(_dq_kernel, t=t, rotary=rotary), t, batch, lambda i, j: (i, jnp.minimum(i, j)),
             inputs, [(q.shape, q.dtype, 'rows', 0)], [block(q.dtype), block(jnp.float32)],
             _cost(t, batch, 4, q.dtype.itemsize, streamed=2, once=3), interpret)[0]
  return dq, dk, dv


def _rows(ids_BxL):
  """(B, 8, L) int32: the layout a kernel reads a per-position row in (and transposes to a column)."""
  return jnp.broadcast_to(ids_BxL[:, None, :].astype(jnp.int32), (ids_BxL.shape[0], SUBLANES, ids_BxL.shape[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def flash_attention(q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, positions_BxL, rotary: Rotary,
                    interpret: bool = False):
  """softmax(q′·k′ᵀ) v per head, q′ = rotary(q)·scale and k′ = rotary(k), causal within each run of equal segment
  ids. The length must be a multiple of 128, E of the head width."""
  return _flash_forward(q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, positions_BxL, rotary, interpret)[0]


def _flash_forward(q, k, v, segment_ids_BxL, positions_BxL, rotary, interpret):
  t = tiling(q.shape[1], q.shape[2], rotary.head_width)
  if not t.block or q.shape[2] % rotary.head_width:
    raise ValueError(f'flash attention: a length of {q.shape[1]} (must be a multiple of 128) and a width of '
                     f'{q.shape[2]} (must be a multiple of the head width {rotary.head_width})')
  rows = (_rows(segment_ids_BxL), _rows(positions_BxL))
  o, lse = _forward(q, k, v, rows, t, rotary, interpret)
  return o, (q, k, v, rows, o, lse)


def _flash_backward(rotary, interpret, saved, do_BxLxE):
  q, k, v, rows, o, lse_BxGxHxL = saved
  b, length, width = q.shape
  t = tiling(length, width, rotary.head_width)
  # rowsum(dO·O) per head as a product with the heads' indicator: XLA sums 64-lane runs of a row slowly
  heads_ExH = jnp.repeat(jnp.eye(width // rotary.head_width, dtype=jnp.float32), rotary.head_width, axis=0)
  di_BxLxH = jnp.einsum('ble,eh->blh', do_BxLxE.astype(jnp.float32) * o.astype(jnp.float32), heads_ExH)
  di_BxGxHxL = di_BxLxH.reshape(b, length, t.groups, t.heads).transpose(0, 2, 3, 1)
  dq, dk, dv = _backward(q, k, v, do_BxLxE.astype(q.dtype), lse_BxGxHxL, di_BxGxHxL, rows, t, rotary, interpret)
  return dq, dk, dv, None, None


flash_attention.defvjp(_flash_forward, _flash_backward)
