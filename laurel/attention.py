"""Causal attention within packed documents, q, k, v (B, L, H, K) and segment ids (B, L), by `model.attention`:
'xla' the reference (einsums, the L×L logits materialised); 'dot_product' jax.nn.dot_product_attention's XLA
implementation (the same maths under a boolean mask; never cuDNN); 'cudnn' cuDNN's fused flash attention with the
documents as per-row offsets and lengths (NVIDIA Hopper or newer, bf16/fp16, a bound `max_segments` on documents per
row); 'splash' the Pallas splash-attention kernel (TPU; interpreted elsewhere, which only tests use); 'auto' splash
on TPU where the length allows it, cudnn on GPU where it can serve (cudnn_unsupported), else xla.
"""

import inspect
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from laurel.config_lib import DTYPES, InputError

ATTENTION = ('xla', 'dot_product', 'cudnn', 'splash', 'auto')
AUTO_ATTENTION = {'tpu': 'splash', 'gpu': 'cudnn', 'cuda': 'cudnn'}
# cuDNN's packed ("ragged") attention lives in jax's private jax._src.cudnn.fused_attention_stablehlo (jax PR #25812;
# checked on jax 0.10.2): cudnn_unsupported checks that the installed jax still has it, tests/test_attention.py pins it.
CUDNN_PACKED_ARGS = ('q_seqlen', 'kv_seqlen', 'q_offsets', 'kv_offsets', 'scale', 'mask_type', 'qkv_layout')
CUDNN_MIN_VERSION = 90600  # packed layout: jax's own test of it asks for cuDNN 9.6
CUDNN_MAX_HEAD_WIDTH = 256  # on Hopper and newer, which the packed layout needs anyway


def attend(cfg, q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL, mask_Bx1xLxS=None):
  """Attention by the implementation attention_impl resolves for `cfg` (an LMConfig); under a `mask` (decoding from
  a KV cache of S slots), the reference's."""
  qkv = (q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
  impl = 'xla' if mask_Bx1xLxS is not None else attention_impl(cfg, q_BxLxHxK.shape[1])
  if impl == 'xla':
    return xla_attention(*qkv, segment_ids_BxL, mask_Bx1xLxS, DTYPES[cfg.attention_scores])
  if impl == 'cudnn':
    return cudnn_attention(*qkv, segment_ids_BxL, cfg.max_segments)
  return {'dot_product': dot_product_attention, 'splash': splash_attention}[impl](*qkv, segment_ids_BxL)


def attention_impl(cfg, length: int) -> str:
  """`cfg.attention` with 'auto' resolved for the platform the step is compiled for (the mesh's devices', a TPU
  slice's abstract ones included; else the default backend's)."""
  if cfg.attention != 'auto':
    return cfg.attention
  platform = _platform()
  impl = AUTO_ATTENTION.get(platform, 'xla')
  if impl == 'splash' and not splash_block(length) or impl == 'cudnn' and cudnn_unsupported(cfg, platform):
    return 'xla'
  return impl


def _platform() -> str:
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device.platform if device else jax.default_backend()


def xla_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL, mask_Bx1xLxL=None, scores_dtype=jnp.float32):
  """The reference: causal softmax attention within each packed segment (or under `mask`), normalised after the
  value product so that one L×L buffer, the exponentials, is all it keeps. Scores and exponentials in `scores_dtype`
  (bfloat16 halves that buffer, as MaxText's float32_qk_product=False); row sums and value product in float32."""
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
  """jax.nn.dot_product_attention's XLA implementation, causal, with the segments as a boolean mask."""
  same_segment_Bx1xLxL = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, mask=same_segment_Bx1xLxL, is_causal=True,
                                      implementation='xla')


def _cudnn_module():
  """jax's private cuDNN attention module; a one-line ValueError if the installed jax lacks its packed layout."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as module  # pylint: disable=import-outside-toplevel
  except ImportError:
    module = None
  if module is None or not set(CUDNN_PACKED_ARGS) <= set(inspect.signature(module.dot_product_attention).parameters):
    raise ValueError(f"model.attention='cudnn': jax {jax.__version__} lacks the packed cuDNN attention API of "
                     'jax._src.cudnn.fused_attention_stablehlo (checked on jax 0.10.2)')
  return module


def cudnn_unsupported(cfg, platform: str | None = None) -> str | None:
  """Why cudnn attention cannot serve `cfg` on `platform` (default: the step's), as a one-line error naming the
  field and value, or None: the config first, then the machine (Hopper or newer, cuDNN 9.6, a jax with the API)."""
  head_width = cfg.d_model // cfg.num_heads
  if cfg.dtype not in ('bfloat16', 'float16'):
    return f"model.dtype={cfg.dtype!r}: model.attention='cudnn' needs bfloat16 or float16 compute"
  if head_width % 8 or head_width > CUDNN_MAX_HEAD_WIDTH:
    return (f'model.num_heads={cfg.num_heads}: a head width of {head_width} (d_model/num_heads); '
            f"model.attention='cudnn' needs a multiple of 8, at most {CUDNN_MAX_HEAD_WIDTH}")
  if not cfg.max_segments:
    return ("model.max_segments=0: model.attention='cudnn' needs a bound on the documents packed per row (cuDNN "
            'keeps softmax statistics for each); set one, e.g. 16, and the loader packs at most that many')
  platform = platform or _platform()
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
  """Packed rows in cuDNN's form, M = max_segments + 1 slots per row: (seqlens_BxM, offsets_BxM1, overflow_B), the
  length and start of each run of equal ids (each document, and the padding as a run of its own, so every token is
  in one; -1 in unused slots and offsets' extra column), and the rows of more than M runs."""
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
  """cuDNN's fused flash attention, causal within each document given as offsets and lengths (never a dense mask).
  A row of more than `max_segments` documents (the loader never makes one) comes out NaN: its step fails loudly."""
  seqlens_BxM, offsets_BxM1, overflow_B = cudnn_segments(segment_ids_BxL, max_segments)
  seqlens_BxM, offsets_BxM1 = (nn.with_logical_constraint(x, ('act_batch', None)) for x in (seqlens_BxM, offsets_BxM1))
  module = _cudnn_module()
  out_BxLxHxK = module.dot_product_attention(
      q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, q_seqlen=seqlens_BxM, kv_seqlen=seqlens_BxM, q_offsets=offsets_BxM1,
      kv_offsets=offsets_BxM1, scale=float(q_BxLxHxK.shape[-1]) ** -0.5, mask_type=module.MaskType.PADDING_CAUSAL,
      qkv_layout='BTNH')
  return jnp.where(overflow_B[:, None, None, None], jnp.nan, out_BxLxHxK)


def splash_block(length: int) -> int:
  """Splash attention's tile: the largest of 512, 256, 128 that divides the length (0: none; keys need 128 lanes)."""
  return next((b for b in (512, 256, 128) if length % b == 0), 0)


def splash_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL):
  """The Pallas splash-attention kernel (causal, segment ids), interpreted off TPU, per device under shard_map (the
  SPMD partitioner cannot split a kernel): rows over the batch axes (padded with empty rows to divide), heads over
  theirs; heads that do not divide, or a sharded length, are a ValueError. q, k, v are sequence-minor (K×L tiles),
  so a head width of 64 is not padded to the 128 lanes."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=import-outside-toplevel
  mesh, (batch, length, heads, _) = jax.sharding.get_abstract_mesh(), q_BxLxHxK.shape
  block, interpret = splash_block(length), _platform() != 'tpu'
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
  if mesh.empty:
    return heads_first(attend_here(*args))
  spec = nn.logical_to_mesh_axes(('act_batch', 'act_heads', 'act_len', None))
  parts = [math.prod(mesh.shape[a] for a in ((p,) if isinstance(p, str) else p or ())) for p in spec]
  if parts[2] > 1:
    raise ValueError(f"model.attention='splash': needs each row's whole sequence on a device, but the logical axis "
                     f"rules shard act_len over {spec[2]} ({parts[2]} ways)")
  if heads % parts[1]:
    raise ValueError(f"model.num_heads={heads}: model.attention='splash' shards heads over {spec[1]} "
                     f'({parts[1]} ways), which must divide them')
  pad = -batch % parts[0]  # empty rows (segment 0) that make the batch divide; their outputs are cut off
  args = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in args]
  sharded = jax.shard_map(attend_here, mesh=mesh, in_specs=(spec, spec, spec, jax.P(spec[0], None)), out_specs=spec,
                          check_vma=False)
  return heads_first(sharded(*args)[:batch])


def attention_flops(batch: int, length: int, heads: int, head_width: int, causal: bool = True,
                    train: bool = True) -> float:
  """FLOPs of attention's two matmuls (Q·Kᵀ and P·V, 2 per multiply-add) for `batch` rows of `length`, per layer
  (the compiler's count leaves out a Pallas kernel's own). causal: only the L(L+1)/2 pairs the mask keeps; else all
  L². train: with the backward's four matmuls (twice the forward), without a flash kernel's recomputation of P."""
  pairs = length * (length + 1) // 2 if causal else length * length
  forward = 2 * 2 * batch * heads * pairs * head_width
  return 3.0 * forward if train else float(forward)
