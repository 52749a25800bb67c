"""Residual designs behind one protocol (`Design`), and their registry; `model.stream.design` picks one.

A site is one residual connection: `site(carry, fn, norm_in, norm_out, chain_l) -> carry`, fn(x, xn, scale) =
scale·f(x) reading xn = norm_in(x) (scale None, or folded into f's last kernel), norm_out the post-norm (identity
for pre-norm; a ResNet's ReLU), chain_l this layer's slice of the design's chain parameters (those whose init
depends on the site index: LAuReL's RW, HC's A_m, DenseFormer's α). An LM's attention fn also takes xn as a
(query, key, value) triple of normed inputs, each projected from its own (MUDDFormer's X^Q, X^K, X^V). Each family
file registers its designs.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from laurel.config_lib import BOOL, POSITIVE, POSITIVE_INT, field, one_of, require
from laurel.designs.buffer import start_buffer, write_slot  # noqa: F401  # mudd's and dca's

ACT = ('act_batch', 'act_len', 'act_embed')
STREAM_ACT = (None,) + ACT  # a stack of activations: n streams, or DenseFormer's running sums
F32 = jnp.float32
# placement -> the sites of a layer, (name suffix, sublayer); suffix None: a plain residual x + f(x) there
PLACEMENTS = {'block': (('', 'block'),), 'sublayer': (('_attn', 'attn'), ('_mlp', 'mlp')),
              'attention': (('_attn', 'attn'), (None, 'mlp'))}


def const(value):
  return lambda key, shape, dtype=F32: jnp.broadcast_to(jnp.asarray(value, dtype), shape)


def scaled(y, scale):
  """scale·y, or y where scale is None. Autodiff keeps y for the scale's gradient: where f ends in a linear map,
  fold the scale into its kernel instead (as the LM does)."""
  return y if scale is None else scale.astype(y.dtype) * y


class Site(nn.Module):
  """One residual connection of a chain: `__call__(carry, fn, norm_in, norm_out, chain_l) -> carry`."""
  spec: Any
  features: int
  t: int = 0  # the site's index in its layer
  sites_per_layer: int = 1
  param_dtype: Any = F32
  axes: tuple = ACT  # logical axes of x
  embed_axis: str = 'embed'  # logical axis of x's features, for per-feature parameters
  decode: bool = False

  def make(self, name, init, shape, names):
    return self.param(name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)

  def attention_inputs(self, norm_in, q, k, v):
    """The (query, key, value) triple of an attention fn, each input normed: q by the block's attention norm, k and
    v by this site's own RMSNorms (MUDDFormer's and DCA's separate input norms)."""
    norm = lambda name, x: nn.RMSNorm(epsilon=1e-6, dtype=x.dtype, param_dtype=self.param_dtype, name=name,
                                      scale_init=nn.with_logical_partitioning(nn.initializers.ones,
                                                                              (self.embed_axis,)))(x)
    return norm_in(q), norm('norm_key', k), norm('norm_value', v)


class PlainSite(Site):
  """x + f(x) around a sublayer the design leaves alone (Gemma 3n's MLP); the rest of the carry passes on."""

  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    x, *rest = carry
    return (norm_out(x + fn(x, norm_in(x), None)), *rest)


class Chain(nn.Module):
  """A design's chain parameters, leading axis num_layers so a layer scan slices them; None if it has none."""
  spec: Any
  num_layers: int
  sites_per_layer: int
  features: int
  param_dtype: Any = F32
  embed_axis: str = 'embed'

  def __call__(self):
    return None


@dataclasses.dataclass(frozen=True)
class Design:
  name: str  # its `model.stream.design`
  site: type  # a Site
  section: str = 'stream'  # the config section it reads
  fields: tuple = ()  # the `model.stream` fields it reads (others are unused with it)
  placement: Callable[[Any], str] = lambda spec: 'sublayer'  # a key of PLACEMENTS
  chain: type = Chain
  chain_name: str = 'stream_chain'
  prefix: str = ''  # site names: prefix + PLACEMENTS' suffix; '' = the design's name
  start: Callable = lambda spec, x, num_layers: x  # the carry after the embedding
  finish: Callable = lambda spec, carry: carry  # the read-out before the final norm
  norm_first: Callable = lambda spec: False  # the final norm applies to each stream before `finish` (mHC-lite's)
  check: Callable = lambda spec, num_layers, prefix: None  # checks across fields (one-line InputError)
  check_width: Callable = lambda spec, d_model, prefix: None  # checks against the model width
  post_norm: bool = False  # defined on post-norm sublayers too
  per_bottleneck: bool = False  # a ResNet bottleneck's residual (carry: x, or x first)
  no_decay: tuple = ()  # parameter names kept out of weight decay
  logical_axes: tuple = ()  # (logical axis, mesh axes) rules of its parameters
  buffer: int | None = None  # index in the carry of a buffer whose slot i + 1 layer i writes once (MUDDFormer's)
  saved_names: tuple = ()  # checkpoint names every remat policy saves (AttnRes's push form: its site inputs)
  # (spec, num_layers, d_model) -> stored parameters that are structurally 0 (per-layer shapes padded for a scan)
  padded_params: Callable = lambda spec, num_layers, d_model: 0

  def site_name(self, suffix):
    return (self.prefix or self.name) + suffix

  def read_out(self, spec, carry, final_norm):
    """The final-normed read-out: `finish`, then the final norm; or with `norm_first`, the final norm on each stream,
    then `finish`."""
    return self.finish(spec, final_norm(carry)) if self.norm_first(spec) else final_norm(self.finish(spec, carry))


REGISTRY: dict[str, Design] = {}


def register(*designs: Design) -> None:
  for d in designs:
    REGISTRY[d.name] = d


# The families register themselves, in the order `model.stream.design` lists them.
from laurel.designs import (  # pylint: disable=wrong-import-position  # noqa: E402,F401
    laurel, scale, hyper, denseformer, attnres, mudd, dca)


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  """`model.stream`: the residual design ('residual' = plain or LAuReL, configured in `model.laurel`)."""
  design: str = field('residual', one_of(*REGISTRY))
  expansion: int = field(4, POSITIVE_INT)  # HC/mHC n
  hc_dynamic: bool = field(False, BOOL)  # HC eqs. 10–13
  sinkhorn_iters: int = field(20, POSITIVE_INT)  # mHC t_max (eq. 9)
  # mHC's streams -> one: each design's authors' ('sum' for mhc, 'norm_sum' for mhc_lite); HC §2.1's sum, then the
  # final norm; the final norm on each stream, then the sum (mHC-lite's code); or DeepSeek-V4's weighted sum
  mhc_readout: str = field('authors', one_of('authors', 'sum', 'norm_sum', 'v4'))
  mhc_lite_init: str = field('plain', one_of('plain', 'authors'))  # mHC-lite's start: mHC's plain one, or its code's
  fractions: int = field(2, POSITIVE_INT)  # Frac-Connections m
  layerscale_init: float = field(1e-5, POSITIVE)  # CaiT's ε for depth 24
  dwa_dilation: int = field(1, POSITIVE_INT)  # DenseFormer k
  dwa_period: int = field(1, POSITIVE_INT)  # DenseFormer p
  attnres_block: int = field(2, POSITIVE_INT)  # Block AttnRes: sites (attention, MLP) per block
  attnres_heads: int = field(1, POSITIVE_INT)  # AttnRes: independent depth softmaxes over channel groups
  attnres_delta: bool = field(False, BOOL)  # AttnRes over the increments, added to the ordinary stream
  mudd_streams: str = field('qkvr', one_of('qkvr', 'r'))  # MUDDFormer's dense streams: Q, K, V, R, or R alone
  dca_k: int = field(8, POSITIVE_INT)  # k-DCA: the last k layers their own columns, the intermediate ones summed

  def check_sizes(self, num_layers: int, prefix: str, d_model: int | None = None) -> None:
    REGISTRY[self.design].check(self, num_layers, prefix)
    if d_model is not None:
      REGISTRY[self.design].check_width(self, d_model, prefix)

  def unused_fields(self, prefix: str) -> dict[str, str]:
    """{field: why} of the fields only other designs read."""
    readers = {f.name: [d.name for d in REGISTRY.values() if f.name in d.fields] for f in dataclasses.fields(self)}
    return {f'{prefix}.{name}': f"only design {' or '.join(map(repr, used))} reads it, not "
            f'{prefix}.design={self.design!r}' for name, used in readers.items() if used and self.design not in used}


def select(model_cfg) -> tuple[Design, Any]:
  """(the design `model_cfg.stream.design` names, its config section)."""
  design = REGISTRY[model_cfg.stream.design]
  return design, getattr(model_cfg, design.section)


def check(model_cfg, prefix: str) -> None:
  """Checks across a model's design sections: a LAuReL variant needs design 'residual'."""
  name = model_cfg.stream.design
  require(REGISTRY[name].section == 'laurel' or not model_cfg.laurel.components, f'{prefix}.laurel.variant',
          model_cfg.laurel.variant, f"LAuReL replaces the residual sum, which stream design '{name}' also replaces; "
          "use variant 'none'")


def layer_sites(design: Design, spec) -> tuple:
  """((site name or None for a plain residual, sublayer), ...) of one layer."""
  return tuple((None if s is None else design.site_name(s), part) for s, part in PLACEMENTS[design.placement(spec)])


def _union(*groups):
  return tuple(dict.fromkeys(x for g in groups for x in g))


# Norms, biases and value residual's mix, then every design's scales and mixing weights.
NO_DECAY = _union(('scale', 'bias', 'value_mix'), *(d.no_decay for d in REGISTRY.values()))
# Logical axis -> mesh axes. Parameters shard over fsdp (and tensor for the wide dims); activations shard their
# batch over data x fsdp. Override `logical_axis_rules` in a config to try other layouts.
LOGICAL_AXIS_RULES = _union(
    (('act_batch', ('data', 'fsdp')), ('act_len', None), ('act_embed', None), ('act_heads', 'tensor'),
     ('act_mlp', 'tensor'), ('act_vocab', 'tensor'), ('act_channels', None), ('embed', 'fsdp'), ('vocab', 'tensor'),
     ('mlp', 'tensor'), ('heads', 'tensor'), ('kv', None), ('layers', None), ('conv_in', None), ('conv_out', 'fsdp'),
     ('classes', None), ('spatial', None), ('share_rank', None), ('share_diag', None)),
    *(d.logical_axes for d in REGISTRY.values()))
