"""Decoder-only transformer LM whose residual stream is one design of laurel.designs (`model.stream.design`).

Shapes: B batch, L length, D model width, H heads, K head width, F MLP width, V vocabulary, N layers, G groups.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laurel import designs
from laurel.attention import ATTENTION, attend, rope
from laurel.designs.buffer import stack_rebuilding_buffer
from laurel.config_lib import BOOL, DTYPES, NON_NEGATIVE_INT, POSITIVE_INT, build, field, is_number, one_of, require

# What the backward pass keeps of a layer (`model.remat`), by checkpoint_name's names below; the rest is recomputed.
# 'minimal' saves every projection the backward reads (as dots_no_batch does, by name).
_saving = jax.checkpoint_policies.save_only_these_names
_QKV = ('query_proj', 'key_proj', 'value_proj')
REMAT_POLICIES = {'none': None, 'full': jax.checkpoint_policies.nothing_saveable,
                  'dots': jax.checkpoint_policies.checkpoint_dots,
                  'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  'minimal': _saving(*_QKV, 'out_proj', 'mlp_hidden'), 'save_qkv': _saving(*_QKV),
                  'save_qkv_attention': _saving(*_QKV, 'attention_out'), 'save_qkv_mlp': _saving(*_QKV, 'mlp_hidden'),
                  'save_out_proj': _saving('out_proj'), 'save_attention_mlp': _saving('attention_out', 'mlp_hidden')}


@dataclasses.dataclass(frozen=True)
class ShareSpec:
  """`model.share`: ResidualTransformer (arXiv 2310.02489): K layers share W; layer l uses W + A_l·B_l + D_l."""
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
  remat: str = field('none', one_of(*REMAT_POLICIES), resumable=True)
  # positions whose logits the loss computes at once; 0 = all
  loss_chunk: int = field(256, NON_NEGATIVE_INT, resumable=True)
  attention: str = field('xla', one_of(*ATTENTION))
  attention_scores: str = field('float32', one_of('float32', 'bfloat16'))  # L×L scores of the xla path and decoding
  # Most documents the loader packs into a row, 0 = as many as fit; cudnn attention needs a bound (state per document).
  max_segments: int = field(0, NON_NEGATIVE_INT)
  embed_lookup: str = field('gather', one_of('gather', 'one_hot'), resumable=True)  # the token lookup's form: lookup()
  stream: Any = designs.stream_field(designs.StreamSpec('residual'))  # the residual design's config (laurel.designs)
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
  """name -> (shape, logical axes, input axes, init scale) of every matrix of a layer."""
  h, k, d, f = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.d_model, cfg.d_ff
  out_scale = 1.0 / (2 * cfg.num_layers)  # keeps the residual stream's variance flat with depth
  qkv = ((d, h, k), ('embed', 'heads', 'kv'), 1, 1.0)
  kernels = {'query': qkv, 'key': qkv, 'value': qkv, 'out': ((h, k, d), ('heads', 'kv', 'embed'), 2, out_scale),
             'up': ((d, f), ('embed', 'mlp'), 1, 1.0), 'down': ((f, d), ('mlp', 'embed'), 1, out_scale)}
  if cfg.mlp == 'swiglu':
    kernels['gate'] = kernels['up']
  return kernels


def _param(module, name, init, shape, axes):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, DTYPES[module.cfg.param_dtype])


def kernel_param(module, name, spec, stack=0):
  """A kernel of `spec`, or `stack` of them along a leading 'layers' axis."""
  shape, names, n_in, scale = spec
  lead = (stack,) if stack else ()
  axes = lambda lo, hi: tuple(range(len(lead) + lo, len(lead) + hi))
  init = nn.initializers.variance_scaling(scale, 'fan_in', 'truncated_normal', in_axis=axes(0, n_in),
                                          out_axis=axes(n_in, len(shape)), batch_axis=axes(-len(lead), 0))
  return _param(module, name, init, lead + shape, ('layers',) * len(lead) + names)


class Dense(nn.Module):
  """Bias-free map of x's last `spec[2]` axes (flax's DenseGeneral flattens its kernel: no logical sharding). `flat`:
  the kernel as a matrix, its input and output axes each merged (attention's heads side by side, laurel.flash)."""
  spec: tuple
  cfg: LMConfig
  flat: bool = False

  @nn.compact
  def __call__(self, x, out_scale=None, shared=None):
    """`out_scale`: the output times it, with a scaled kernel's gradients (`_scaled_dot`); `shared`: the group's
    kernel, plus this layer's delta."""
    (shape, _, n_in, _), dtype = self.spec, DTYPES[self.cfg.dtype]
    kernel = kernel_param(self, 'kernel', self.spec) if shared is None else shared + self.layer_delta()
    if self.flat:
      kernel, n_in = kernel.reshape(math.prod(shape[:n_in]), -1), 1
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    if out_scale is None:
      return jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), (contract, ((), ())))
    return _scaled_dot(x.astype(dtype), kernel, out_scale, contract)

  def layer_delta(self):
    """A_l·B_l + D_l over the kernel as an M×N matrix; B = D = 0 at init, so a group's layers start equal."""
    (shape, names, n_in, _), rank = self.spec, self.cfg.share.rank
    m, n = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    a_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=tuple(range(n_in)))
    a = _param(self, 'share_a', a_init, shape[:n_in] + (rank,), names[:n_in] + ('share_rank',))
    b = _param(self, 'share_b', nn.initializers.zeros, (rank,) + shape[n_in:], ('share_rank',) + names[n_in:])
    delta_MxN = a.reshape(m, rank) @ b.reshape(rank, n)
    if self.cfg.share.diagonal:
      d = _param(self, 'share_diag', nn.initializers.zeros, (min(m, n),), ('share_diag',))
      delta_MxN = delta_MxN + jnp.eye(m, n, dtype=d.dtype) * jnp.pad(d, (0, n - d.shape[0]))
    return delta_MxN.reshape(shape)


def _folded_dot(x, kernel, scale, contract):
  return jax.lax.dot_general(x, (kernel * scale).astype(x.dtype), (contract, ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scaled_dot(x, kernel, scale, contract):
  """x·(kernel·scale) with the gradients of that form (no activation kept for the scale), but the scale applied to
  the product in float32: the TPU compiler fuses a scaled kernel into the product, on every tile of x."""
  y = jax.lax.dot_general(x, kernel.astype(x.dtype), (contract, ((), ())), preferred_element_type=jnp.float32)
  return (y * scale).astype(x.dtype)


def _scaled_dot_fwd(x, kernel, scale, contract):
  return _scaled_dot(x, kernel, scale, contract), (x, kernel, scale)


def _scaled_dot_bwd(contract, residuals, g):
  return jax.vjp(lambda *a: _folded_dot(*a, contract), *residuals)[1](g)


_scaled_dot.defvjp(_scaled_dot_fwd, _scaled_dot_bwd)


def _norm(cfg, name):
  return nn.RMSNorm(dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], name=name,
                    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('embed',)))


def lookup(table_VxD, ids, dtype, form='gather', mode=None):
  """Rows `ids` of `table_VxD` in `dtype`, their gradients summed in float32: XLA:GPU adds a bfloat16 scatter by a
  compare-and-swap loop, about 20 times slower than float32's (openxla/xla#26371), and bfloat16 sums lose the small
  gradients of frequent tokens. 'gather': from the table in float32 (exact for a bfloat16 table), cast after, so the
  backward pass is a float32 scatter-add. 'one_hot': one-hot rows times the table in `dtype`, a matmul each way with
  float32 sums and no scatter, 2·ids·V·D FLOPs each way: for small vocabularies. `mode`: jnp.take's, for 'gather'."""
  with jax.named_scope('lookup'):  # the profile's embedding group (scripts/step_profile.py)
    if form == 'one_hot':
      return _one_hot_lookup(table_VxD.shape[0], jnp.dtype(dtype), table_VxD.astype(dtype), ids)
    return jnp.take(table_VxD.astype(jnp.float32), ids, axis=0, mode=mode).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _one_hot_lookup(vocab, dtype, table_VxD, ids):
  one_hot = jax.nn.one_hot(ids, vocab, dtype=dtype)
  return jnp.einsum('...v,vd->...d', one_hot, table_VxD, preferred_element_type=jnp.float32).astype(dtype)


def _one_hot_lookup_fwd(vocab, dtype, table_VxD, ids):
  return _one_hot_lookup(vocab, dtype, table_VxD, ids), ids


def _one_hot_lookup_bwd(vocab, dtype, ids, grad):
  # jax's own transpose would multiply in float32 (the product's float32 output makes its cotangent float32)
  one_hot = jax.nn.one_hot(ids, vocab, dtype=dtype)
  return jnp.einsum('...v,...d->vd', one_hot, grad, preferred_element_type=jnp.float32).astype(dtype), None


_one_hot_lookup.defvjp(_one_hot_lookup_fwd, _one_hot_lookup_bwd)


class Attention(nn.Module):
  """Causal attention over packed segments -> (output, V_1); x may be a (query, key, value) triple (MUDDFormer, DCA).
  With `value_residual` (ResFormer), later layers use V'_n = λ_1·V_1 + λ_2·V_n (V_1: the first layer's, λ from ½).
  Queries, keys and values keep their heads side by side, (B, L, E = H·K), from the projections to the output."""
  cfg: LMConfig

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, out_scale=None, shared=None, first_values=None,
               layer_index=0, decode=False):
    cfg, kernels, shared = self.cfg, layer_kernels(self.cfg), shared or {}
    head_width = cfg.d_model // cfg.num_heads
    inputs = x_BxLxD if isinstance(x_BxLxD, tuple) else (x_BxLxD,) * 3
    q_BxLxE, k_BxLxE, v_BxLxE = (Dense(kernels[n], cfg, flat=True, name=n)(x, shared=shared.get(n))
                                 for n, x in zip(('query', 'key', 'value'), inputs))
    if cfg.value_residual:
      lam = _param(self, 'value_mix', nn.initializers.constant(0.5), (2,), (None,)).astype(v_BxLxE.dtype)
      first = layer_index == 0
      first_values = jnp.where(first, v_BxLxE, first_values)
      v_BxLxE = jnp.where(first, v_BxLxE, lam[0] * first_values + lam[1] * v_BxLxE)
    q_BxLxE = nn.with_logical_constraint(q_BxLxE, ('act_batch', 'act_len', 'act_heads'))
    q_BxLxE, k_BxLxE, v_BxLxE = map(checkpoint_name, (q_BxLxE, k_BxLxE, v_BxLxE), _QKV)
    rotated = positions_BxL if cfg.positional == 'rope' else None  # attend rotates q and k (the flash kernel inside)
    if decode:  # keys and values of every position so far live in the cache, rotated; row b's token t at slot t
      if rotated is not None:
        heads = lambda x: x.reshape(*x.shape[:2], cfg.num_heads, head_width)
        q_BxLxE, k_BxLxE = (rope(heads(x), positions_BxL, cfg.rope_base).reshape(x.shape) for x in (q_BxLxE, k_BxLxE))
      k_BxSxE, v_BxSxE = self.cached(k_BxLxE, v_BxLxE, positions_BxL)
      slots_S = jnp.arange(k_BxSxE.shape[1])  # the reference path: fused kernels take training shapes
      mask_Bx1xLxS = (slots_S[None, None, :] <= positions_BxL[:, :, None])[:, None]
      out_BxLxE = attend(cfg, q_BxLxE, k_BxSxE, v_BxSxE, segment_ids_BxL, mask_Bx1xLxS=mask_Bx1xLxS)
    else:
      out_BxLxE = attend(cfg, q_BxLxE, k_BxLxE, v_BxLxE, segment_ids_BxL, rotated)
    out_BxLxE = checkpoint_name(out_BxLxE, 'attention_out')
    out_BxLxD = Dense(kernels['out'], cfg, flat=True, name='out')(out_BxLxE, out_scale, shared.get('out'))
    return checkpoint_name(out_BxLxD, 'out_proj'), first_values

  def cached(self, k_BxLxE, v_BxLxE, positions_BxL):
    """The 'cache' collection (sized by the first call) with the new keys and values written in."""
    cache = lambda name, x: self.variable('cache', name, jnp.zeros, x.shape, x.dtype)
    keys, values = cache('keys', k_BxLxE), cache('values', v_BxLxE)
    rows_Bx1 = jnp.arange(k_BxLxE.shape[0])[:, None]
    keys.value = keys.value.at[rows_Bx1, positions_BxL].set(k_BxLxE, mode='drop')
    values.value = values.value.at[rows_Bx1, positions_BxL].set(v_BxLxE, mode='drop')
    return keys.value, values.value


class Mlp(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, x_BxLxD, out_scale=None, shared=None):
    cfg, kernels, shared = self.cfg, layer_kernels(self.cfg), shared or {}
    x_BxLxD = checkpoint_name(x_BxLxD, 'mlp_input')
    up = lambda n: checkpoint_name(Dense(kernels[n], cfg, name=n)(x_BxLxD, shared=shared.get(n)), 'mlp_hidden')
    h_BxLxF = jax.nn.silu(up('gate')) * up('up') if cfg.mlp == 'swiglu' else jax.nn.gelu(up('up'))
    h_BxLxF = nn.with_logical_constraint(h_BxLxF, ('act_batch', 'act_len', 'act_mlp'))
    return Dense(kernels['down'], cfg, name='down')(h_BxLxF, out_scale, shared.get('down'))


class Block(nn.Module):
  """Attention and MLP around the design's sites. Carry: (design carry, V_1); `layer_xs`: (index, chain slice)."""
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
      site = (designs.ResidualSite if name is None else design.site)(
          spec, cfg.d_model, t, cfg.sites_per_layer, DTYPES[cfg.param_dtype], decode=self.decode, name=name)
      stream = site(stream, f, norm_in, norm_out, chain_l)
    return (stream, values), None

  def sublayers(self, attn_f, mlp_f):
    """{sublayer: (f, norm_in, norm_out)}: f(x, xn, scale) = scale·f(x), one norm an identity. The scale goes into
    f's last kernel (autodiff keeps no activation for it), but onto f's output when decoding (cheaper per token)."""
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


class SharedKernels(nn.Module):
  """ResidualTransformer's W_g of each group, stacked, so the layers stay one scan."""
  cfg: LMConfig

  @nn.compact
  def __call__(self):
    groups = self.cfg.num_layers // self.cfg.share.group_size
    return {f'{part}_{name}': kernel_param(self, f'{part}_{name}', spec, stack=groups)
            for part, names in (('attn', ('query', 'key', 'value', 'out')), ('mlp', ('up', 'gate', 'down')))
            for name, spec in layer_kernels(self.cfg).items() if name in names}


def output_kernel(cfg: LMConfig, params) -> tuple[jax.Array, str]:
  """(the vocabulary projection's kernel, its einsum axes 'vd' or 'dv')."""
  return (params['embed']['embedding'], 'vd') if cfg.tie_embeddings else (params['unembed']['kernel'], 'dv')


class LM(nn.Module):
  """-> float32 logits (B, L, V), or with hidden=True the final-normed (B, L, D) (laurel.cross_entropy projects them).
  decode=True reads and writes a KV cache (the mutable 'cache')."""
  cfg: LMConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, hidden=False):
    cfg, (b, length), (design, spec) = self.cfg, tokens_BxL.shape, designs.select(self.cfg)
    positions_BxL = jnp.broadcast_to(jnp.arange(length), (b, length)) if positions_BxL is None else positions_BxL
    segment_ids_BxL = jnp.ones((b, length), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
    embed_init = nn.initializers.normal(cfg.d_model ** -0.5)
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype],
                     embedding_init=nn.with_logical_partitioning(embed_init, ('vocab', 'embed')), name='embed')
    # Gathering the embed axis first: from an fsdp-sharded table XLA would replicate the looked-up rows.
    table_VxD = nn.with_logical_constraint(embed.embedding.astype(DTYPES[cfg.dtype]), ('vocab', None))
    x_BxLxD = lookup(table_VxD, tokens_BxL, table_VxD.dtype, cfg.embed_lookup)
    if cfg.positional == 'learned':
      pos_embed = _param(self, 'pos_embed', embed_init, (cfg.max_len, cfg.d_model), (None, 'embed'))
      x_BxLxD = x_BxLxD + lookup(pos_embed, positions_BxL, x_BxLxD.dtype, mode='clip')
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ('act_batch', 'act_len', 'act_embed'))
    values_BxLxE = jnp.zeros((b, length, cfg.d_model), DTYPES[cfg.dtype]) if cfg.value_residual else None  # V_1
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
    carry = (design.start(spec, x_BxLxD, cfg.num_layers), values_BxLxE)
    if cfg.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0, 'cache': 0}, split_rngs={'params': True},
                      in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast), length=cfg.num_layers,
                      unroll=cfg.scan_unroll, metadata_params={nn.PARTITION_NAME: 'layers'})
      stack = stack(cfg, self.decode, name='layers')
      args = (carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G)
      if (design.buffer is None and not cfg.value_residual) or self.decode or self.is_initializing():
        carry, _ = stack(*args)
      else:
        carry = stack_rebuilding_buffer(stack, Block(cfg, parent=None), cfg, design.buffer, design.mirror, policy,
                                        *args)
    else:
      for i in range(cfg.num_layers):
        carry, _ = block(cfg, self.decode, name=f'layers_{i}')(
            carry, positions_BxL, segment_ids_BxL, jax.tree.map(lambda a, i=i: a[i], layer_xs), shared_G)
    x_BxLxD = design.read_out(spec, carry[0], _norm(cfg, 'final_norm'))
    if hidden:
      return x_BxLxD
    unembed = Dense(((cfg.d_model, cfg.vocab_size), ('embed', 'vocab'), 1, 1.0), cfg, name='unembed')
    logits_BxLxV = embed.attend(x_BxLxD) if cfg.tie_embeddings else unembed(x_BxLxD)
    return nn.with_logical_constraint(logits_BxLxV.astype(jnp.float32), ('act_batch', 'act_len', 'act_vocab'))
