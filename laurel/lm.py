"""Decoder-only transformer LM whose residual stream is one design of laurel.designs (`model.stream.design`).

Pre-norm (or post-norm) blocks of causal multi-head attention and a GELU (or SwiGLU) MLP, RoPE (or learned
positions), tied (or untied) embeddings. A design's sites sit per block (f the whole block), per sublayer, or on
attention only. Orthogonal to the stream: value residual (ResFormer, in Attention) and ResidualTransformer's weight
sharing (`model.share`, in Dense and SharedKernels). Sites form one chain in push form, so a layer scan keeps nothing
extra; the chain-level weights (whose init depends on the site) live outside the scan.
Shapes: B batch, L length, D model width, H heads, K head width, F MLP width, V vocabulary, N layers.
"""

import dataclasses
import functools
import inspect
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laurel import designs
from laurel.designs.laurel import LaurelSpec
from laurel.config_lib import (BOOL, DTYPES, NON_NEGATIVE_INT, POSITIVE_INT, InputError, build, field, is_number,
                               one_of, require)

# `model.attention`: 'xla' is the reference (einsums, the L×L logits materialised); 'dot_product' is
# jax.nn.dot_product_attention's XLA implementation (the same maths under a boolean mask; never cuDNN); 'cudnn' cuDNN's
# fused flash attention with packed documents as per-row offsets and lengths (NVIDIA Hopper or newer, bf16/fp16, a
# bound `max_segments` on documents per row); 'splash' the Pallas splash-attention kernel (TPU; interpreted elsewhere,
# which only tests use); 'auto' splash on TPU where the length allows it, cudnn on GPU where it can serve (see
# cudnn_unsupported), else xla.
ATTENTION = ('xla', 'dot_product', 'cudnn', 'splash', 'auto')
AUTO_ATTENTION = {'tpu': 'splash', 'gpu': 'cudnn', 'cuda': 'cudnn'}
# What the backward pass keeps of a layer (`model.remat`); the rest it recomputes. The named activations are tagged
# with checkpoint_name below: q, k, v after RoPE ('query_proj', 'key_proj', 'value_proj'), the attention output
# before its projection ('attention_out'), the projected output ('out_proj'), the MLP's normed input ('mlp_input')
# and its up-projection before the activation ('mlp_hidden'). 'minimal' saves every projection that the backward
# pass reads (as dots_no_batch, by name).
_saving = jax.checkpoint_policies.save_only_these_names
REMAT_POLICIES = {'none': None, 'full': jax.checkpoint_policies.nothing_saveable,
                  'dots': jax.checkpoint_policies.checkpoint_dots,
                  'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  'minimal': _saving('query_proj', 'key_proj', 'value_proj', 'out_proj', 'mlp_hidden'),
                  'save_qkv': _saving('query_proj', 'key_proj', 'value_proj'),
                  'save_qkv_attention': _saving('query_proj', 'key_proj', 'value_proj', 'attention_out'),
                  'save_qkv_mlp': _saving('query_proj', 'key_proj', 'value_proj', 'mlp_hidden'),
                  'save_out_proj': _saving('out_proj'),
                  'save_attention_mlp': _saving('attention_out', 'mlp_hidden')}


@dataclasses.dataclass(frozen=True)
class ShareSpec:
  """`model.share`: ResidualTransformer (arXiv 2310.02489, §3.2–3.3). Groups of K consecutive layers share every
  attention and MLP matrix W; layer l uses W + A_l·B_l + D_l (rank R, and a diagonal; norms stay per layer)."""
  group_size: int = field(1, POSITIVE_INT)  # K; 1 = no sharing
  rank: int = field(16, POSITIVE_INT)  # R
  diagonal: bool = field(True, BOOL)  # D_l


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """`config.model` of an LM run."""
  vocab_size: int = field(256, POSITIVE_INT)
  d_model: int = field(128, POSITIVE_INT)
  num_heads: int = field(4, POSITIVE_INT)
  d_ff: int = field(512, POSITIVE_INT)
  num_layers: int = field(4, POSITIVE_INT)
  max_len: int = field(2048, POSITIVE_INT)  # only used by learned positions
  norm_position: str = field('pre', one_of('pre', 'post'))
  positional: str = field('rope', one_of('rope', 'learned'))
  rope_base: float = field(10_000.0, (lambda v: is_number(v) and v > 1, 'must be a number > 1'))
  mlp: str = field('gelu', one_of('gelu', 'swiglu'))
  tie_embeddings: bool = field(True, BOOL)
  dtype: str = field('float32', one_of(*DTYPES))  # compute
  param_dtype: str = field('float32', one_of(*DTYPES))
  scan_layers: bool = field(True, BOOL)
  scan_unroll: int = field(1, POSITIVE_INT)  # scanned layers per loop iteration
  remat: str = field('none', one_of(*REMAT_POLICIES))
  loss_chunk: int = field(256, NON_NEGATIVE_INT)  # positions whose logits the loss computes at once; 0 = all
  attention: str = field('xla', one_of(*ATTENTION))
  attention_scores: str = field('float32', one_of('float32', 'bfloat16'))  # L×L scores of the xla path and decoding
  # Most documents the loader packs into one row (grain's max_sequences_per_bin); 0 = as many as fit. cudnn attention
  # needs a bound: it keeps softmax statistics for max_segments + 1 runs per row (the documents and the padding).
  max_segments: int = field(0, NON_NEGATIVE_INT)
  stream: Any = designs.stream_field(LaurelSpec())  # the residual design's config (laurel.designs)
  value_residual: bool = field(False, BOOL)  # ResFormer (arXiv 2410.17897)
  share: ShareSpec = ShareSpec()

  # Residual sites per layer (a plain residual is none)
  sites_per_layer = property(lambda self: sum(name is not None for name, _ in designs.layer_sites(
      *designs.select(self))))
  num_sites = property(lambda self: self.num_layers * self.sites_per_layer)

  def check(self, prefix: str) -> None:
    require(self.d_model % self.num_heads == 0, f'{prefix}.num_heads', self.num_heads,
            f'must divide d_model={self.d_model}')
    require(self.positional != 'rope' or (self.d_model // self.num_heads) % 2 == 0, f'{prefix}.num_heads',
            self.num_heads, 'RoPE needs an even head width')
    designs.check(self, prefix, self.num_layers, self.d_model, self.num_sites)
    require(designs.select(self)[0].post_norm or self.norm_position == 'pre', f'{prefix}.norm_position',
            self.norm_position, f"stream design '{self.stream.design}' is defined on pre-norm sublayers")
    k = self.share.group_size
    require(self.num_layers % k == 0, f'{prefix}.share.group_size', k, f'must divide num_layers={self.num_layers}')
    require(not self.scan_layers or self.num_layers % self.scan_unroll == 0, f'{prefix}.scan_unroll',
            self.scan_unroll, f'must divide num_layers={self.num_layers}')
    require(k == 1 or self.share.rank <= min(self.d_model, self.d_ff), f'{prefix}.share.rank', self.share.rank,
            f'must be <= min(d_model, d_ff)={min(self.d_model, self.d_ff)}')

  def unused_fields(self, prefix: str) -> dict[str, str]:
    """{field: why} of the fields that change nothing given the others (design sections and share.* included)."""
    no_sharing = f'{prefix}.share.group_size=1 shares nothing'
    checks = {'max_len': (self.positional != 'learned', f'{prefix}.positional={self.positional!r}: only learned '
                          'positions read it'),
              'rope_base': (self.positional != 'rope', f'{prefix}.positional={self.positional!r}: only RoPE reads it'),
              'scan_unroll': (not self.scan_layers, f'{prefix}.scan_layers=False'),
              'share.rank': (self.share.group_size == 1, no_sharing),
              'share.diagonal': (self.share.group_size == 1, no_sharing)}
    unused = {f'{prefix}.{name}': why for name, (no_effect, why) in checks.items() if no_effect}
    return {**unused, **designs.unused_fields(self.stream, prefix)}

  @classmethod
  def from_config(cls, model_cfg: Any, field: str = 'model') -> 'LMConfig':
    return build(cls, model_cfg, field)


def layer_kernels(cfg: LMConfig) -> dict:
  """name -> (shape, logical axes, input axes, init scale) of every matrix of a layer: the one place they are
  declared, for Dense and for ResidualTransformer's shared copies (SharedKernels)."""
  h, k, d, f = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.d_model, cfg.d_ff
  out_scale = 1.0 / (2 * cfg.num_layers)  # keeps the residual stream's variance flat with depth
  qkv = ((d, h, k), ('embed', 'heads', 'kv'), 1, 1.0)
  kernels = {'query': qkv, 'key': qkv, 'value': qkv, 'out': ((h, k, d), ('heads', 'kv', 'embed'), 2, out_scale),
             'up': ((d, f), ('embed', 'mlp'), 1, 1.0), 'down': ((f, d), ('mlp', 'embed'), 1, out_scale)}
  if cfg.mlp == 'swiglu':
    kernels['gate'] = kernels['up']
  return kernels


def kernel_param(module, name, spec, cfg, stack=0):
  """A kernel of `spec`, or `stack` of them along a leading 'layers' axis, each initialised as one."""
  shape, names, n_in, scale = spec
  lead = (stack,) if stack else ()
  axes = lambda lo, hi: tuple(range(len(lead) + lo, len(lead) + hi))
  init = nn.initializers.variance_scaling(scale, 'fan_in', 'truncated_normal', in_axis=axes(0, n_in),
                                          out_axis=axes(n_in, len(shape)), batch_axis=axes(-len(lead), 0))
  return module.param(name, nn.with_logical_partitioning(init, ('layers',) * len(lead) + names), lead + shape,
                      DTYPES[cfg.param_dtype])


class Dense(nn.Module):
  """Bias-free linear map of x's last `spec[2]` axes by a kernel of `spec` = (shape, logical axes, input axes,
  init scale). (flax's DenseGeneral initialises a flattened kernel, which breaks logical sharding.)"""
  spec: tuple
  cfg: LMConfig

  @nn.compact
  def __call__(self, x, out_scale=None, shared=None):
    """`out_scale` (a scalar or a vector over the last output axis) multiplies the kernel, not the output.
    `shared`: ResidualTransformer's kernel of this layer's group; the layer adds its own A·B + D to it."""
    shape, names, n_in, _ = self.spec
    kernel = kernel_param(self, 'kernel', self.spec, self.cfg) if shared is None else shared + self.layer_delta()
    dtype = DTYPES[self.cfg.dtype]
    kernel = kernel.astype(dtype) if out_scale is None else (kernel * out_scale).astype(dtype)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x.astype(dtype), kernel, (contract, ((), ())))

  def layer_delta(self):
    """ResidualTransformer's A_l·B_l + D_l over the kernel seen as an M×N matrix (§3.3; D_l is M×N diagonal).
    B = D = 0 at init (A as a fan-in normal): the layers of a group start equal, as weight sharing alone."""
    (shape, names, n_in, _), share = self.spec, self.cfg.share
    m, n = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    param = lambda name, init, s, ax: self.param(name, nn.with_logical_partitioning(init, ax), s,
                                                 DTYPES[self.cfg.param_dtype])
    a = param('share_a', nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=tuple(range(n_in))),
              shape[:n_in] + (share.rank,), names[:n_in] + ('share_rank',))
    b = param('share_b', nn.initializers.zeros, (share.rank,) + shape[n_in:], ('share_rank',) + names[n_in:])
    delta_MxN = a.reshape(m, share.rank) @ b.reshape(share.rank, n)
    if share.diagonal:
      d = param('share_diag', nn.initializers.zeros, (min(m, n),), ('share_diag',))
      delta_MxN = delta_MxN + jnp.eye(m, n, dtype=d.dtype) * jnp.pad(d, (0, n - d.shape[0]))
    return delta_MxN.reshape(shape)


def _norm(cfg, name):
  return nn.RMSNorm(dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], name=name,
                    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('embed',)))


def rope(x_BxLxHxK, positions_BxL, base):
  half = x_BxLxHxK.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BxLx1xK = (positions_BxL[..., None].astype(jnp.float32) * freq)[:, :, None, :]
  sin, cos = jnp.sin(angle_BxLx1xK), jnp.cos(angle_BxLx1xK)
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
  """Causal multi-head attention over packed segments; with `value_residual`, ResFormer's (arXiv 2410.17897,
  §3) values V'_n = λ_1·V_1 + λ_2·V_n for layers n > 1, V_1 being the first layer's, λ learned from ½ each
  (the paper's U_n = ½·A_n(V_n + V_1)). Returns (output, V_1).

  The input is one normed x, or a (query, key, value) triple of normed inputs, each projected by its own kernel
  (designs whose attention reads separate streams: MUDDFormer, DCA). V_1 is layer 0's v whatever its input; the KV
  cache holds k and v as projected, so decoding needs nothing more."""
  cfg: LMConfig

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, out_scale=None, shared=None, first_values=None,
               layer_index=0, decode=False):
    cfg, kernels, shared = self.cfg, layer_kernels(self.cfg), shared or {}
    inputs = x_BxLxD if isinstance(x_BxLxD, tuple) else (x_BxLxD,) * 3
    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (Dense(kernels[n], cfg, name=n)(x, shared=shared.get(n))
                                       for n, x in zip(('query', 'key', 'value'), inputs))
    if cfg.value_residual:
      lam = self.param('value_mix', nn.with_logical_partitioning(nn.initializers.constant(0.5), (None,)), (2,),
                       DTYPES[cfg.param_dtype]).astype(v_BxLxHxK.dtype)
      first = layer_index == 0
      first_values = jnp.where(first, v_BxLxHxK, first_values)
      v_BxLxHxK = jnp.where(first, v_BxLxHxK, lam[0] * first_values + lam[1] * v_BxLxHxK)
    if cfg.positional == 'rope':
      q_BxLxHxK = rope(q_BxLxHxK, positions_BxL, cfg.rope_base)
      k_BxLxHxK = rope(k_BxLxHxK, positions_BxL, cfg.rope_base)
    q_BxLxHxK = nn.with_logical_constraint(q_BxLxHxK, ('act_batch', 'act_len', 'act_heads', None))
    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (checkpoint_name(a, f'{n}_proj') for a, n in (
        (q_BxLxHxK, 'query'), (k_BxLxHxK, 'key'), (v_BxLxHxK, 'value')))
    scores = DTYPES[cfg.attention_scores]
    if decode:  # keys and values of every position so far live in the cache; row b's token t sits at slot t
      k_BxSxHxK, v_BxSxHxK = self.cached(k_BxLxHxK, v_BxLxHxK, positions_BxL)
      slots_S = jnp.arange(k_BxSxHxK.shape[1])  # the reference path: fused kernels take training shapes
      mask_Bx1xLxS = (slots_S[None, None, :] <= positions_BxL[:, :, None])[:, None]
      out_BxLxHxK = xla_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, segment_ids_BxL, mask_Bx1xLxS, scores)
    else:
      attend = {'xla': functools.partial(xla_attention, scores_dtype=scores), 'dot_product': dot_product_attention,
                'splash': splash_attention, 'cudnn': functools.partial(cudnn_attention, max_segments=cfg.max_segments)}
      impl = attention_impl(cfg, positions_BxL.shape[1])  # x may be a (q, k, v) triple
      out_BxLxHxK = attend[impl](q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL)
    out_BxLxHxK = checkpoint_name(out_BxLxHxK, 'attention_out')
    out_BxLxD = Dense(kernels['out'], cfg, name='out')(out_BxLxHxK, out_scale, shared.get('out'))
    return checkpoint_name(out_BxLxD, 'out_proj'), first_values

  def cached(self, k_BxLxHxK, v_BxLxHxK, positions_BxL):
    """Writes the new keys and values at their positions into the 'cache' collection (whose length, the most
    positions a sequence may reach, is set by the first call) and returns the whole cache. Values are cached
    after value-residual mixing, which is per position, as is every residual design: decoding needs nothing
    else across positions."""
    cache = lambda name, x: self.variable('cache', name, jnp.zeros, x.shape, x.dtype)
    keys, values = cache('keys', k_BxLxHxK), cache('values', v_BxLxHxK)
    rows_Bx1 = jnp.arange(k_BxLxHxK.shape[0])[:, None]
    keys.value = keys.value.at[rows_Bx1, positions_BxL].set(k_BxLxHxK, mode='drop')
    values.value = values.value.at[rows_Bx1, positions_BxL].set(v_BxLxHxK, mode='drop')
    return keys.value, values.value


def attention_impl(cfg: LMConfig, length: int) -> str:
  """`cfg.attention` with 'auto' resolved for the platform the step is compiled for (the mesh's devices', a TPU
  slice's abstract ones included; else the default backend's): splash on TPU where the length allows it, cudnn on GPU
  where it can serve `cfg` (cudnn_unsupported), else xla."""
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
  """The reference: causal softmax attention within each packed segment (or under `mask`). The softmax is
  normalised after the value product, so one L×L buffer of exponentials is all it keeps (not the logits, the
  probabilities and their cast copy). Scores and exponentials in `scores_dtype` (bfloat16 halves those L×L
  buffers, as MaxText's default float32_qk_product=False does); the row sums and the value product in float32."""
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


# cuDNN's packed ("ragged") attention is reached through jax's private module jax._src.cudnn.fused_attention_stablehlo
# (q_offsets/kv_offsets with q_seqlen/kv_seqlen, jax PR #25812; checked on jax 0.10.2). cudnn_unsupported checks that
# the installed jax still has it; tests/test_attention.py pins the API used here.
CUDNN_PACKED_ARGS = ('q_seqlen', 'kv_seqlen', 'q_offsets', 'kv_offsets', 'scale', 'mask_type', 'qkv_layout')
CUDNN_MIN_VERSION = 90600  # packed layout: jax's own test of it asks for cuDNN 9.6
CUDNN_MAX_HEAD_WIDTH = 256  # on Hopper and newer, which the packed layout needs anyway


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


def cudnn_unsupported(cfg: LMConfig, platform: str | None = None) -> str | None:
  """Why cudnn attention cannot serve `cfg` on `platform` (default: the step's, see _platform) as a one-line error
  naming the field and value, or None when it can. The config first, then the machine: an NVIDIA GPU of compute
  capability 9.0 or newer (the packed layout), cuDNN 9.6 or newer, and a jax that has the API."""
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
  length and first position of each run of equal segment ids (each document, and the padding after them as a run of
  its own, so that every token lies in one; -1 in unused slots, and in offsets' extra last column), and the rows
  that hold more than M runs. Documents are contiguous runs, as packing makes them: an id that recurs after another
  starts a new run."""
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
  """cuDNN's fused flash attention, causal within each packed document given as offsets and lengths (cudnn_segments;
  never a dense mask). A row with more than `max_segments` documents (the loader never makes one) comes out NaN, so
  its step fails loudly instead of being wrong. LMTask.validate calls cudnn_unsupported before anything compiles."""
  seqlens_BxM, offsets_BxM1, overflow_B = cudnn_segments(segment_ids_BxL, max_segments)
  seqlens_BxM, offsets_BxM1 = (nn.with_logical_constraint(x, ('act_batch', None)) for x in (seqlens_BxM, offsets_BxM1))
  module = _cudnn_module()
  out_BxLxHxK = module.dot_product_attention(
      q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, q_seqlen=seqlens_BxM, kv_seqlen=seqlens_BxM, q_offsets=offsets_BxM1,
      kv_offsets=offsets_BxM1, scale=float(q_BxLxHxK.shape[-1]) ** -0.5, mask_type=module.MaskType.PADDING_CAUSAL,
      qkv_layout='BTNH')
  return jnp.where(overflow_B[:, None, None, None], jnp.nan, out_BxLxHxK)


def splash_block(length: int) -> int:
  """Splash attention's query/key tile: the largest of 512, 256, 128 that divides the length (0: none does; the
  kernel's key tiles are whole 128-lane vectors)."""
  return next((b for b in (512, 256, 128) if length % b == 0), 0)


def splash_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, segment_ids_BxL):
  """The Pallas splash-attention kernel (causal mask, segment ids), per device under shard_map since the SPMD
  partitioner cannot split a kernel; interpreted off TPU. Never materialises the L×L logits. q, k and v are laid
  out sequence-minor (K×L tiles), so a head width of 64 is not padded to the 128 lanes.

  Under a mesh it always runs sharded: rows over the batch axes (a batch that does not divide them, e.g. init's
  batch of one, is padded with empty rows and cut back), heads over theirs; heads that do not divide, or a sharded
  sequence axis (each device would attend within its own slice only), are a ValueError while tracing."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=import-outside-toplevel
  mesh, (batch, length, heads, _) = jax.sharding.get_abstract_mesh(), q_BxLxHxK.shape
  block, interpret = splash_block(length), _platform() != 'tpu'
  if not block:  # LMTask.validate checks data.seq_len; this catches a direct call
    raise InputError(f"model.attention='splash': needs a length that is a multiple of 128, not {length}")
  seq_minor = splash.QKVLayout.SEQ_MINOR
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
                            q_layout=seq_minor, k_layout=seq_minor, v_layout=seq_minor)

  def attend(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK, segment_ids_BxL):  # this device's rows and heads
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * q_BxHxLxK.shape[1])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    segments = splash.SegmentIds(segment_ids_BxL, segment_ids_BxL)
    return jax.vmap(kernel)(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK, segments)

  heads_first = lambda x: x.swapaxes(1, 2)
  q_BxHxLxK = heads_first(q_BxLxHxK / jnp.sqrt(q_BxLxHxK.shape[-1]).astype(q_BxLxHxK.dtype))
  args = (q_BxHxLxK, heads_first(k_BxLxHxK), heads_first(v_BxLxHxK), segment_ids_BxL)
  if mesh.empty:
    return heads_first(attend(*args))
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
  attend = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, jax.P(spec[0], None)), out_specs=spec,
                         check_vma=False)
  return heads_first(attend(*args)[:batch])


def attention_flops(batch: int, length: int, heads: int, head_width: int, causal: bool = True,
                    train: bool = True) -> float:
  """FLOPs of attention's two matmuls (Q·Kᵀ and P·V, 2 FLOPs per multiply-add) for `batch` rows of `length`, per
  layer; the compiler's count leaves out a Pallas kernel's own. causal: only the L(L+1)/2 query-key pairs the mask
  keeps (the work a kernel needs, not what it spends on whole tiles); else all L². train: forward and backward, the
  backward's four matmuls (dV, dP, dQ, dK) twice the forward's, without the recomputation of P that flash kernels
  add (as 6·N per token counts the rest of the step)."""
  pairs = length * (length + 1) // 2 if causal else length * length
  forward = 2 * 2 * batch * heads * pairs * head_width
  return 3.0 * forward if train else float(forward)


class Mlp(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, x_BxLxD, out_scale=None, shared=None):
    cfg, kernels, shared = self.cfg, layer_kernels(self.cfg), shared or {}
    x_BxLxD = checkpoint_name(x_BxLxD, 'mlp_input')
    up = lambda n: checkpoint_name(Dense(kernels[n], cfg, name=n)(x_BxLxD, shared=shared.get(n)), 'mlp_hidden')
    if cfg.mlp == 'swiglu':
      h_BxLxF = jax.nn.silu(up('gate')) * up('up')
    else:
      h_BxLxF = jax.nn.gelu(up('up'))
    h_BxLxF = nn.with_logical_constraint(h_BxLxF, ('act_batch', 'act_len', 'act_mlp'))
    return Dense(kernels['down'], cfg, name='down')(h_BxLxF, out_scale, shared.get('down'))


class Block(nn.Module):
  """One transformer block: attention and MLP around the residual design's sites. Carry: (the design's carry, V_1
  for value residual); `layer_xs` = (layer index, this layer's slice of the chain weights); `shared_G`:
  ResidualTransformer's kernels of every group (SharedKernels), of which the layer takes its own group's."""
  cfg: LMConfig
  decode: bool = False

  @nn.compact
  def __call__(self, carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G=None):
    cfg, (design, spec) = self.cfg, designs.select(self.cfg)
    stream, values = carry
    layer_index, chain_l = layer_xs
    shared = {k: w[layer_index // cfg.share.group_size] for k, w in (shared_G or {}).items()}
    pick = lambda prefix: {k[len(prefix):]: v for k, v in shared.items() if k.startswith(prefix)}
    attn, mlp = Attention(cfg, name='attn'), Mlp(cfg, name='mlp')

    def attn_f(x, xn, scale):
      nonlocal values  # V_1 leaves through the carry; the sites only see f's output
      out, values = attn(xn, positions_BxL, segment_ids_BxL, scale, pick('attn_'), values, layer_index, self.decode)
      return out

    sublayers = self.sublayers(attn_f, lambda x, xn, scale: mlp(xn, scale, pick('mlp_')))
    for t, (name, part) in enumerate(designs.layer_sites(design, spec)):
      f, norm_in, norm_out = sublayers[part]
      site = (designs.PlainSite if name is None else design.site)(
          spec, cfg.d_model, t, cfg.sites_per_layer, DTYPES[cfg.param_dtype], decode=self.decode, name=name)
      stream = site(stream, f, norm_in, norm_out, chain_l)
    return (stream, values), None

  def sublayers(self, attn_f, mlp_f):
    """{sublayer: (f, norm_in, norm_out)}: f(x, xn, scale) = scale·f(x) reads xn = norm_in(x), norm_out follows the
    sum; pre-norm or post-norm, the other an identity. The scale multiplies f's last kernel, so autodiff keeps no
    activation for it (when decoding, f's output: a scale folded into a kernel costs a multiply per entry)."""
    cfg = self.cfg
    norm_attn, norm_mlp = _norm(cfg, 'norm_attn'), _norm(cfg, 'norm_mlp')
    if self.decode:
      on_output = lambda f: lambda x, xn, scale: designs.scaled(f(x, xn, None), scale)
      attn_f, mlp_f = on_output(attn_f), on_output(mlp_f)

    def block_f(x, xn, alpha):  # f(x) = block(x) − x: attention + MLP (plus the post-norm shift of h)
      attn_BxLxD = attn_f(x, xn, None)
      h_BxLxD = x + attn_BxLxD
      if cfg.norm_position == 'pre':
        return designs.scaled(attn_BxLxD, alpha) + mlp_f(None, norm_mlp(h_BxLxD), alpha)
      h_BxLxD = norm_attn(h_BxLxD)
      # h − x in float32, exact for bfloat16 h and x: the site's x + f(x) (in float32) gives back h + MLP(h)
      return designs.scaled(h_BxLxD.astype(jnp.float32) - x, alpha) + mlp_f(None, h_BxLxD, alpha)

    identity = lambda x: x
    parts = {'attn': (attn_f, norm_attn, norm_attn), 'mlp': (mlp_f, norm_mlp, norm_mlp),
             'block': (block_f, norm_attn, norm_mlp)}
    pre = cfg.norm_position == 'pre'
    return {k: (f, n_in if pre else identity, identity if pre else n_out) for k, (f, n_in, n_out) in parts.items()}


def _stack_rebuilding_buffer(stack, cfg: LMConfig, index: int | None, policy, carry, positions_BxL, segment_ids_BxL,
                             layer_xs, shared_G):
  """The scanned layers with a backward that keeps no copy of a design's write-once buffer (its carry's entry
  `index`, Design.buffer; None: none): layer i starts with slots 0..i filled and writes slot i + 1, so the buffer at
  layer i is the final one with the later slots zeroed. A scan's own backward saves the buffer at every layer, N
  copies of N + 1 slots; this one saves the final buffer and each layer's carry without it. Value residual's V_1 (the
  carry's values, written once by layer 0) is rebuilt the same way: zeros at layer 0, the final V_1 after. The remat
  `policy` (None: 'none') is honoured: each layer's forward keeps what its vjp under that policy keeps, less the
  layer's own inputs, which the backward has (the buffer and V_1 rebuilt), so the backward recomputes only what the
  policy does not save."""
  def layer(params_l, carry, chain_l, shared, layer_index):
    return Block(cfg, parent=None).apply({'params': params_l}, carry, positions_BxL, segment_ids_BxL,
                                         (layer_index, chain_l), shared)[0]

  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
  structure = {}  # the vjp's tree and which of its leaves are the layer's inputs: the same at every layer

  def put(carry, buffer, first_values):
    """The carry with the buffer and (with value residual) V_1 in place; None: left out."""
    (stream, values) = carry
    if index is not None:
      stream = stream[:index] + (buffer,) + stream[index + 1:]
    return stream, first_values if cfg.value_residual else values

  def run(mdl, carry, layer_xs, shared_G):
    return mdl(carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G)[0]

  def forward(mdl, carry, layer_xs, shared_G):
    params = mdl.variables['params']

    def one(carry, xs):
      params_l, (layer_index, chain_l) = xs
      inputs = (params_l, carry, chain_l, shared_G)
      out, vjp = jax.vjp(lambda p, c, w, s: layer(p, c, w, s, layer_index), *inputs)
      leaves, structure['tree'] = jax.tree.flatten(vjp)
      input_leaves = jax.tree.leaves(inputs)
      # A residual that is one of the layer's inputs (the buffer, the parameters) is not kept: the backward has it.
      structure['input'] = [next((k for k, a in enumerate(input_leaves) if a is leaf), None) for leaf in leaves]
      kept = [leaf for leaf, k in zip(leaves, structure['input']) if k is None]
      return out, (put(carry, None, None), kept)
    out, saved = jax.lax.scan(one, carry, (params, layer_xs), unroll=cfg.scan_unroll)
    return out, (params, saved, None if index is None else out[0][index], out[1], layer_xs, shared_G)

  def backward(residuals, g_out):
    params, saved, final_JxBxLxD, final_values, layer_xs, shared_G = residuals

    def one(grads, xs):
      g_carry, g_shared = grads
      params_l, (carry, kept), (layer_index, chain_l) = xs
      buffer = None if index is None else jnp.where(
          (jnp.arange(final_JxBxLxD.shape[0]) <= layer_index)[:, None, None, None], final_JxBxLxD, 0)
      first_values = None if final_values is None else jnp.where(layer_index > 0, final_values, 0)
      carry = put(carry, buffer, first_values)
      input_leaves, kept = jax.tree.leaves((params_l, carry, chain_l, shared_G)), iter(kept)
      vjp = jax.tree.unflatten(structure['tree'], [next(kept) if k is None else input_leaves[k]
                                                   for k in structure['input']])
      g_params, g_carry, g_chain, g_shared_l = vjp(g_carry)
      return (g_carry, jax.tree.map(jnp.add, g_shared, g_shared_l)), (g_params, g_chain)
    (g_carry, g_shared), (g_params, g_chain) = jax.lax.scan(
        one, (g_out, jax.tree.map(jnp.zeros_like, shared_G)), (params, saved, layer_xs), reverse=True,
        unroll=cfg.scan_unroll)
    return {'params': g_params}, g_carry, (None, g_chain), g_shared

  return nn.custom_vjp(run, forward, backward)(stack, carry, layer_xs, shared_G)


class SharedKernels(nn.Module):
  """ResidualTransformer's shared weights (arXiv 2310.02489, §3.2): every attention and MLP kernel W_g once per
  group of K consecutive layers, stacked over the groups. The layers stay one scan, each taking its group's W_g
  (a scan iteration of K unrolled blocks lets the compiler keep all K blocks' recomputed activations at once)."""
  cfg: LMConfig

  @nn.compact
  def __call__(self):
    cfg = self.cfg
    groups = cfg.num_layers // cfg.share.group_size
    return {f'{part}_{name}': kernel_param(self, f'{part}_{name}', spec, cfg, stack=groups)
            for part, names in (('attn', ('query', 'key', 'value', 'out')), ('mlp', ('up', 'gate', 'down')))
            for name, spec in layer_kernels(cfg).items() if name in names}


def output_kernel(cfg: LMConfig, params) -> tuple[jax.Array, str]:
  """(the vocabulary projection's kernel, its einsum axes): the tied embedding (V×D) or the unembedding (D×V)."""
  return (params['embed']['embedding'], 'vd') if cfg.tie_embeddings else (params['unembed']['kernel'], 'dv')


class LM(nn.Module):
  """`LM(cfg).apply(variables, tokens_BxL, positions_BxL, segment_ids_BxL)` -> float32 logits (B, L, V).

  decode=True reads and writes a KV cache (the 'cache' collection, mutable): prefill the prompts, then one
  token per row at a time, each at its own position (laurel.generate)."""
  cfg: LMConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, hidden=False):
    """hidden=True returns the final-normed hidden states (B, L, D) instead, for a loss that projects them onto the
    vocabulary itself (laurel.cross_entropy, with `output_kernel`)."""
    cfg = self.cfg
    b, length = tokens_BxL.shape
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(length), (b, length))
    if segment_ids_BxL is None:
      segment_ids_BxL = jnp.ones((b, length), jnp.int32)
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype],
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(cfg.d_model ** -0.5), ('vocab', 'embed')), name='embed')
    x_BxLxD = embed(tokens_BxL)
    if cfg.positional == 'learned':
      pos_embed = self.param('pos_embed', nn.with_logical_partitioning(
          nn.initializers.normal(cfg.d_model ** -0.5), (None, 'embed')),
          (cfg.max_len, cfg.d_model), DTYPES[cfg.param_dtype])
      x_BxLxD = x_BxLxD + pos_embed[positions_BxL].astype(x_BxLxD.dtype)
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ('act_batch', 'act_len', 'act_embed'))
    values = None
    if cfg.value_residual:
      h = cfg.num_heads
      values = jnp.zeros((b, length, h, cfg.d_model // h), DTYPES[cfg.dtype])
    design, spec = designs.select(cfg)
    chain_N = design.chain(spec, cfg.num_layers, cfg.sites_per_layer, cfg.d_model, DTYPES[cfg.param_dtype],
                           name=design.chain.module_name)()
    layer_xs = (jnp.arange(cfg.num_layers), chain_N)

    shared_G = SharedKernels(cfg, name='shared')() if cfg.share.group_size > 1 else None
    block, policy = Block, None
    if cfg.remat != 'none':
      policy = REMAT_POLICIES[cfg.remat]
      if design.saved_names:  # what the design's backward needs that it cannot recompute from the layer's input
        policy = jax.checkpoint_policies.save_from_both_policies(policy, _saving(*design.saved_names))
      block = nn.remat(Block, policy=policy, prevent_cse=not cfg.scan_layers)
    carry = (design.start(spec, x_BxLxD, cfg.num_layers), values)
    if cfg.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0, 'cache': 0}, split_rngs={'params': True},
                      in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast), length=cfg.num_layers,
                      unroll=cfg.scan_unroll, metadata_params={nn.PARTITION_NAME: 'layers'})
      stack = stack(cfg, self.decode, name='layers')
      args = (carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G)
      if (design.buffer is None and not cfg.value_residual) or self.decode or self.is_initializing():
        carry, _ = stack(*args)
      else:
        carry = _stack_rebuilding_buffer(stack, cfg, design.buffer, policy, *args)
    else:
      for i in range(cfg.num_layers):
        carry, _ = block(cfg, self.decode, name=f'layers_{i}')(
            carry, positions_BxL, segment_ids_BxL, jax.tree.map(lambda a, i=i: a[i], layer_xs), shared_G)
    x_BxLxD = design.read_out(spec, carry[0], _norm(cfg, 'final_norm'))
    if hidden:
      return x_BxLxD
    if cfg.tie_embeddings:
      logits_BxLxV = embed.attend(x_BxLxD)
    else:
      logits_BxLxV = Dense(((cfg.d_model, cfg.vocab_size), ('embed', 'vocab'), 1, 1.0), cfg, name='unembed')(x_BxLxD)
    return nn.with_logical_constraint(logits_BxLxV.astype(jnp.float32), ('act_batch', 'act_len', 'act_vocab'))
