"""Causal attention within packed documents, by `model.attention`: 'xla' (the reference), 'dot_product' (jax.nn's),
'cudnn' (packed flash attention), 'flash' (laurel.flash: Pallas, TPU), 'splash' (jax's Pallas kernel, TPU), or 'auto'
(flash on TPU, cudnn on GPU where each can serve, else xla). `attend` takes q, k, v with their heads side by side,
(B, L, E = H·K), as the projections make them; the kernels of the other paths get them as (B, L, H, K)."""

import inspect
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from laurel import flash, sharding
from laurel.config_lib import DTYPES, InputError

ATTENTION = ('xla', 'dot_product', 'cudnn', 'flash', 'splash', 'auto')
AUTO_ATTENTION = {'tpu': 'flash', 'gpu': 'cudnn', 'cuda': 'cudnn'}
BLOCKED = ('flash', 'splash')  # TPU kernels over blocks of 128, 256 or 512 positions
# cuDNN's packed attention is private to jax (jax._src.cudnn.fused_attention_stablehlo): checked for before use.
CUDNN_PACKED_ARGS = ('q_seqlen', 'kv_seqlen', 'q_offsets', 'kv_offsets', 'scale', 'mask_type', 'qkv_layout')
CUDNN_MIN_VERSION = 90600  # packed layout: jax's own test of it asks for cuDNN 9.6
CUDNN_MAX_HEAD_WIDTH = 256  # on Hopper and newer, which the packed layout needs anyway


def attend(cfg, q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, positions_BxL=None, mask_Bx1xLxS=None):
  """Attention by attention_impl's choice for `cfg` -> (B, L, E), q and k rotated by their `positions` first (none: as
  they are); under a `mask` (decoding from a cache of S slots), 'xla'."""
  impl = 'xla' if mask_Bx1xLxS is not None else attention_impl(cfg, q_BxLxE.shape[1])
  head_width = cfg.d_model // cfg.num_heads
  if impl == 'flash':
    return flash_attention(q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, positions_BxL, head_width, cfg.rope_base)
  heads = lambda x: x.reshape(*x.shape[:2], -1, head_width)
  qkv = (heads(q_BxLxE), heads(k_BxLxE), heads(v_BxLxE))
  if positions_BxL is not None:
    qkv = (rope(qkv[0], positions_BxL, cfg.rope_base), rope(qkv[1], positions_BxL, cfg.rope_base), qkv[2])
  if impl == 'xla':
    out_BxLxHxK = xla_attention(*qkv, segment_ids_BxL, mask_Bx1xLxS, DTYPES[cfg.attention_scores])
  elif impl == 'cudnn':
    out_BxLxHxK = cudnn_attention(*qkv, segment_ids_BxL, cfg.max_segments)
  else:
    out_BxLxHxK = {'dot_product': dot_product_attention, 'splash': splash_attention}[impl](*qkv, segment_ids_BxL)
  return out_BxLxHxK.reshape(q_BxLxE.shape)


def rope(x_BxLxHxK, positions_BxL, base):
  """Rotary positions (RoFormer, arXiv 2104.09864) in the rotate-half form: head pairs (j, j + K/2), j < K/2, rotated
  by position · base^(−2j/K), in float32."""
  half = x_BxLxHxK.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BxLx1xK = (positions_BxL[..., None].astype(jnp.float32) * freq)[:, :, None, :]
  sin, cos = jnp.sin(angle_BxLx1xK), jnp.cos(angle_BxLx1xK)
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxLxHxK.dtype)


def attention_impl(cfg, length: int) -> str:
  """`cfg.attention`, 'auto' resolved for the platform the step is compiled for (the mesh's, else the backend's)."""
  if cfg.attention != 'auto':
    return cfg.attention
  platform = sharding.platform()
  impl = AUTO_ATTENTION.get(platform, 'xla')
  if impl in BLOCKED and not splash_block(length) or impl == 'cudnn' and cudnn_unsupported(cfg, platform):
    return 'xla'
  return impl


def xla_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL, mask_Bx1xLxL=None, scores_dtype=jnp.float32):
  """The reference, normalised after the value product so that it keeps one L×L buffer, the exponentials, in
  `scores_dtype` (bfloat16 halves it); row sums and value product in float32."""
  logits_BxHxLxL = jnp.einsum('bqhk,bshk->bhqs', q_BxLxHxK, k_BxLxHxK, preferred_element_type=scores_dtype)
  logits_BxHxLxL = logits_BxHxLxL / jnp.asarray(math.sqrt(q_BxLxHxK.shape[-1]), scores_dtype)
  if mask_Bx1xLxL is None:
    causal_LxL = jnp.tril(jnp.ones((q_BxLxHxK.shape[1], q_BxLxHxK.shape[1]), bool))
    same_segment_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    mask_Bx1xLxL = (causal_LxL[None] & same_segment_BxLxL)[:, None]
  logits_BxHxLxL = jnp.where(mask_Bx1xLxL, logits_BxHxLxL, jnp.finfo(scores_dtype).min)
  # Every row keeps at least its own position, so the row maximum is a real logit and no row sums to zero.
  exps_BxHxLxL = jnp.exp(logits_BxHxLxL - jax.lax.stop_gradient(logits_BxHxLxL.max(-1, keepdims=True)))
  sums_BxLxHx1 = exps_BxHxLxL.sum(-1, dtype=jnp.float32).swapaxes(1, 2)[..., None]
  out_BxLxHxK = jnp.einsum('bhqs,bshk->bqhk', exps_BxHxLxL.astype(v_BxLxHxK.dtype), v_BxLxHxK,
                           preferred_element_type=jnp.float32)
  return (out_BxLxHxK / sums_BxLxHx1).astype(v_BxLxHxK.dtype)


def dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL):
  """jax.nn.dot_product_attention's XLA implementation (never cuDNN), the segments as a boolean mask."""
  same_segment_Bx1xLxL = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, mask=same_segment_Bx1xLxL, is_causal=True,
                                      implementation='xla')


def _cudnn_module():
  """jax's private cuDNN attention module; a ValueError if it lacks the packed layout."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as module  # pylint: disable=import-outside-toplevel
  except ImportError:
    module = None
  if module is None or not set(CUDNN_PACKED_ARGS) <= set(inspect.signature(module.dot_product_attention).parameters):
    raise ValueError(f"model.attention='cudnn': jax {jax.__version__} lacks the packed cuDNN attention API of "
                     'jax._src.cudnn.fused_attention_stablehlo (checked on jax 0.10.2)')
  return module


def cudnn_unsupported(cfg, platform: str | None = None) -> str | None:
  """Why cudnn attention cannot serve `cfg` on `platform` (default: the step's), as a one-line error, or None."""
  head_width = cfg.d_model // cfg.num_heads
  if cfg.dtype not in ('bfloat16', 'float16'):
    return f"model.dtype={cfg.dtype!r}: model.attention='cudnn' needs bfloat16 or float16 compute"
  if head_width % 8 or head_width > CUDNN_MAX_HEAD_WIDTH:
    return (f'model.num_heads={cfg.num_heads}: a head width of {head_width} (d_model/num_heads); '
            f"model.attention='cudnn' needs a multiple of 8, at most {CUDNN_MAX_HEAD_WIDTH}")
  if not cfg.max_segments:
    return ("model.max_segments=0: model.attention='cudnn' needs a bound on the documents packed per row (cuDNN "
            'keeps softmax statistics for each); set one, e.g. 16, and the loader packs at most that many')
  platform = platform or sharding.platform()
  if platform not in ('gpu', 'cuda'):
    return f"model.attention='cudnn': needs an NVIDIA GPU; the step is compiled for {platform}"
  try:
    module = _cudnn_module()
    version = module.check_cudnn_version()
  except ValueError as e:
    return str(e)
  except RuntimeError as e:  # no cuDNN found
    return f"model.attention='cudnn': {e}"
  if version < CUDNN_MIN_VERSION:
    return f"model.attention='cudnn': packed documents need cuDNN 9.6 or newer, found version {version}"
  if not module.check_compute_capability('9.0'):
    return (f"model.attention='cudnn': packed documents need an NVIDIA GPU of compute capability 9.0 (Hopper) or "
            f'newer, found {jax.devices()[0].device_kind}')
  return None


def cudnn_segments(segment_ids_BxL, max_segments: int):
  """(seqlens_BxM, offsets_BxM1, overflow_B): length and start of each run of equal ids (padding is a run too) in
  M = max_segments + 1 slots, -1 where unused, and the rows of more than M runs."""
  b, length = segment_ids_BxL.shape
  slots = max_segments + 1
  starts_BxL = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)
  run_BxL = jnp.cumsum(starts_BxL, axis=1, dtype=jnp.int32) - 1
  slot_BxL = jnp.where(starts_BxL & (run_BxL < slots), run_BxL, slots + 1)  # slots + 1: out of range, dropped
  offsets_BxM1 = jnp.full((b, slots + 1), -1, jnp.int32).at[jnp.arange(b)[:, None], slot_BxL].set(
      jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)), mode='drop')
  starts_BxM, next_BxM = offsets_BxM1[:, :-1], offsets_BxM1[:, 1:]
  ends_BxM = jnp.where(next_BxM >= 0, next_BxM, length)
  seqlens_BxM = jnp.where(starts_BxM >= 0, ends_BxM - starts_BxM, -1)
  return seqlens_BxM, offsets_BxM1, run_BxL[:, -1] >= slots


def cudnn_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL, max_segments: int):
  """cuDNN's flash attention over documents as offsets and lengths; a row of too many documents comes out NaN."""
  seqlens_BxM, offsets_BxM1, overflow_B = cudnn_segments(segment_ids_BxL, max_segments)
  seqlens_BxM, offsets_BxM1 = (nn.with_logical_constraint(x, ('act_batch', None)) for x in (seqlens_BxM, offsets_BxM1))
  module = _cudnn_module()
  out_BxLxHxK = module.dot_product_attention(
      q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, q_seqlen=seqlens_BxM, kv_seqlen=seqlens_BxM, q_offsets=offsets_BxM1,
      kv_offsets=offsets_BxM1, scale=float(q_BxLxHxK.shape[-1]) ** -0.5, mask_type=module.MaskType.PADDING_CAUSAL,
      qkv_layout='BTNH')
  return jnp.where(overflow_B[:, None, None, None], jnp.nan, out_BxLxHxK)


def _per_device(attend_here, args, axes: tuple, impl: str, heads: int):
  """attend_here(*args) on each device's rows and heads (sharding.per_device): q, k, v and the output with logical
  `axes`, then segment ids and positions by row; each row's whole sequence on one device, the heads divided."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    spec = nn.logical_to_mesh_axes(axes)
    ways = {name: math.prod(mesh.shape[a] for a in ((p,) if isinstance(p, str) else p or ()))
            for name, p in zip(axes, spec)}
    mesh_axes = dict(zip(axes, spec))
    if ways['act_len'] > 1:
      raise ValueError(f"model.attention={impl!r}: needs each row's whole sequence on a device, but the logical "
                       f"axis rules shard act_len over {mesh_axes['act_len']} ({ways['act_len']} ways)")
    if heads % ways['act_heads']:
      raise ValueError(f"model.num_heads={heads}: model.attention={impl!r} shards heads over "
                       f"{mesh_axes['act_heads']} ({ways['act_heads']} ways), which must divide them")
  rows = ('act_batch', None)  # segment ids (padding rows: segment 0, empty), positions
  return sharding.per_device(attend_here, args, (axes,) * 3 + (rows,) * (len(args) - 3), axes)


def flash_attention(q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, positions_BxL, head_width: int, rope_base: float):
  """laurel.flash's kernels, interpreted off TPU, per device: q·(1/√K) and k rotated by their positions (none: as
  they are) inside the kernels."""
  rotary = flash.Rotary(head_width, 1 / math.sqrt(head_width), None if positions_BxL is None else rope_base)
  positions_BxL = jnp.zeros_like(segment_ids_BxL) if positions_BxL is None else positions_BxL
  interpret = sharding.platform() != 'tpu'
  attend_here = lambda q, k, v, s, p: flash.flash_attention(q, k, v, s, p, rotary, interpret)
  return _per_device(attend_here, (q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, positions_BxL),
                     ('act_batch', 'act_len', 'act_heads'), 'flash', q_BxLxE.shape[-1] // head_width)


def splash_block(length: int) -> int:
  """Splash attention's tile: the largest of 512, 256, 128 that divides the length, else 0."""
  return next((b for b in (512, 256, 128) if length % b == 0), 0)


def splash_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL):
  """The Pallas splash-attention kernel, interpreted off TPU, per device under shard_map (the partitioner cannot
  split a kernel). Sequence-minor tiles, so a head width of 64 is not padded to 128 lanes."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=import-outside-toplevel
  _, length, heads, _ = q_BxLxHxK.shape
  block, interpret = splash_block(length), sharding.platform() != 'tpu'
  if not block:  # LMTask.validate checks data.seq_len; this catches a direct call
    raise InputError(f"model.attention='splash': needs a length that is a multiple of 128, not {length}")
  tiles = ('q', 'kv', 'kv_compute', 'q_dkv', 'kv_dkv', 'kv_dkv_compute', 'q_dq', 'kv_dq')
  sizes = splash.BlockSizes(**{f'block_{t}': block for t in tiles},
                            **{f'{x}_layout': splash.QKVLayout.SEQ_MINOR for x in 'qkv'})

  def attend_here(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK, segment_ids_BxL):  # this device's rows and heads
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * q_BxHxLxK.shape[1])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    segments = splash.SegmentIds(segment_ids_BxL, segment_ids_BxL)
    return jax.vmap(kernel)(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK, segments)

  heads_first = lambda x: x.swapaxes(1, 2)
  q_BxHxLxK = heads_first(q_BxLxHxK / jnp.sqrt(q_BxLxHxK.shape[-1]).astype(q_BxLxHxK.dtype))
  args = (q_BxHxLxK, heads_first(k_BxLxHxK), heads_first(v_BxLxHxK), segment_ids_BxL)
  return heads_first(_per_device(attend_here, args, ('act_batch', 'act_heads', 'act_len', None), 'splash', heads))


def attention_flops(batch: int, length: int, heads: int, head_width: int, causal: bool = True,
                    train: bool = True) -> float:
  """FLOPs of one layer's Q·Kᵀ and P·V (the compiler does not count a Pallas kernel's); causal: the L(L+1)/2 pairs
  only; train: with the backward's four matmuls, not a flash kernel's recomputation of P."""
  pairs = length * (length + 1) // 2 if causal else length * length
  forward = 2 * 2 * batch * heads * pairs * head_width
  return 3.0 * forward if train else float(forward)
