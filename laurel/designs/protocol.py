"""The residual-design protocol (`Design`, `Site`, `Chain`) and the registry; laurel.designs re-exports it."""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from laurel import sharding
from laurel.config_lib import InputError, build, config_dict, import_module_of, require, to_dict

ACT = ('act_batch', 'act_len', 'act_embed')
STREAM_ACT = (None,) + ACT  # a stack of activations: n streams, or DenseFormer's running sums
F32 = jnp.float32
# placement -> the sites of a layer, (name suffix, sublayer); suffix None: a plain residual x + f(x) there
PLACEMENTS = {'block': (('', 'block'),), 'sublayer': (('_attn', 'attn'), ('_mlp', 'mlp')),
              'attention': (('_attn', 'attn'), (None, 'mlp'))}


def const(value):
  return lambda key, shape, dtype=F32: jnp.broadcast_to(jnp.asarray(value, dtype), shape)


def make_param(module, name, init, shape, names):
  """A parameter of logical axes `names`, in the module's param_dtype."""
  return module.param(name, nn.with_logical_partitioning(init, names), shape, module.param_dtype)


def scaled(y, scale):
  """scale·y (y where scale is None). Autodiff keeps y for the scale's gradient: fold it into a kernel instead."""
  return y if scale is None else scale.astype(y.dtype) * y


def unit_rms(x, axis=-1):
  """x / rms(x) over `axis` in float32: an RMSNorm without weight (eps 1e-6, flax's)."""
  x32 = x.astype(F32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + 1e-6)


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
  make = make_param

  def attention_inputs(self, norm_in, q, k, v):
    """(norm_in(q), k, v with their own RMSNorms): MUDDFormer's and DCA's separate attention input norms."""
    scale_init = nn.with_logical_partitioning(nn.initializers.ones, (self.embed_axis,))
    norm = lambda name, x: nn.RMSNorm(epsilon=1e-6, dtype=x.dtype, param_dtype=self.param_dtype, name=name,
                                      scale_init=scale_init)(x)
    return norm_in(q), norm('norm_key', k), norm('norm_value', v)


class ResidualSite(Site):
  """x + f(x) (He et al., arXiv 1512.03385): design 'residual', and the plain residual around a sublayer a design
  leaves alone (Gemma 3n's MLP; the rest of its carry passes on). In f's dtype where wider (post-norm's f = block(x)
  − x in float32, which x + f(x) then undoes exactly), rounded to x's once."""

  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    x, *rest = carry if isinstance(carry, tuple) else (carry,)
    fx = fn(x, norm_in(x), None)
    x = nn.with_logical_constraint(norm_out((x.astype(jnp.result_type(x, fx)) + fx).astype(x.dtype)), self.axes)
    return (x, *rest) if isinstance(carry, tuple) else x


class Chain(nn.Module):
  """A design's chain parameters, leading axis num_layers so a layer scan slices them; None if it has none."""
  spec: Any
  num_layers: int
  sites_per_layer: int
  features: int
  param_dtype: Any = F32
  embed_axis: str = 'embed'
  module_name = 'stream_chain'  # its name in the model's parameters
  make = make_param

  def __call__(self):
    return None


@dataclasses.dataclass(frozen=True)
class Design:
  name: str  # its `model.stream.design`
  site: type  # a Site
  config: type | None = None  # its frozen config dataclass, read from `model.<section>`; None: no fields
  section: str = ''  # '' = the design's name; also its sites' name prefix
  placement: Callable[[Any], str] = lambda spec: 'sublayer'  # a key of PLACEMENTS
  chain: type = Chain
  start: Callable = lambda spec, x, num_layers: x  # the carry after the embedding
  finish: Callable = lambda spec, carry: carry  # the read-out before the final norm
  norm_first: Callable = lambda spec: False  # the final norm applies to each stream before `finish` (mHC-lite's)
  # checks against the model (one-line InputError): (spec, its section's prefix, num_layers, width D, sites)
  check: Callable = lambda spec, prefix, num_layers, width, sites: None
  post_norm: bool = False  # defined on post-norm sublayers too
  per_bottleneck: bool = False  # a ResNet bottleneck's residual (carry: x, or x first)
  no_decay: tuple = ()  # parameter names kept out of weight decay
  logical_axes: tuple = ()  # (logical axis, mesh axes) rules of its parameters
  buffer: int | None = None  # index in the carry of a buffer whose slot i + 1 layer i writes once (MUDDFormer's)
  mirror: int | None = None  # index in the carry of what equals the buffer's slot i at layer i's input (MUDDFormer's x)
  saved_names: tuple = ()  # checkpoint names every remat policy saves (AttnRes's push form: its site inputs)
  # (spec, num_layers, d_model) -> stored parameters that are structurally 0 (per-layer shapes padded for a scan)
  padded_params: Callable = lambda spec, num_layers, d_model: 0
  # What the design reports of itself, from its parameters alone: (spec, chain, sites) -> {name: values, one per site
  # or layer along the first axis}, `chain` its chain module's output (what the layers read, leading axis the layer),
  # `sites` its sites' parameters stacked (layers, sites per layer, ...). The loop logs them on its logging steps as
  # training metrics `<section>/<name>_<index>` (never evaluated), outside the step; None: nothing to report.
  diagnostics: Callable | None = None

  def read_out(self, spec, carry, final_norm):
    """`finish`, then the final norm; with `norm_first`, the other way round."""
    return self.finish(spec, final_norm(carry)) if self.norm_first(spec) else final_norm(self.finish(spec, carry))


REGISTRY: dict[str, Design] = {}


def register(*designs: Design) -> None:
  """Adds designs to the registry; each config class (an empty one where None) learns its design's name."""
  for d in designs:
    config = d.config or dataclasses.make_dataclass(f'{d.name}_config', [], frozen=True)
    config.design = d.name  # spec.design: which design a config instance configures
    REGISTRY[d.name] = dataclasses.replace(d, config=config, section=d.section or d.name)


def lookup(name: str, field_name: str = 'model.stream.design') -> Design:
  """A registered design, or 'module:name' whose module (imported here) registers it."""
  module, _, short = name.rpartition(':') if isinstance(name, str) else ('', '', name)
  if module:
    import_module_of(module, field_name, name)
  require(short in REGISTRY, field_name, name,
          f"must be one of {', '.join(REGISTRY)}, or 'module:name' of a design that module registers")
  return REGISTRY[short]


def StreamSpec(design: str = 'residual', **fields):  # pylint: disable=invalid-name  # tests/reference.py's name
  return REGISTRY[design].config(**fields)


def qualified_name(spec) -> str:
  """The `model.stream.design` of a design config: 'module:name' for a design from outside the package."""
  module = REGISTRY[spec.design].site.__module__
  return spec.design if module.startswith('laurel.') else f'{module}:{spec.design}'


def label(spec) -> str:
  """A design config as a run's first line names it: its `label()` where it has one, else qualified_name."""
  return spec.label() if hasattr(spec, 'label') else qualified_name(spec)


def _sections(default, overrides: dict) -> dict:
  """config_lib.config_dict of a model's `stream`: `stream.design` and every section, popped from `overrides`."""
  stream = dict(overrides.pop('stream', {}))
  name = stream.pop('design', qualified_name(default))
  lookup(name)
  if stream:
    raise InputError(f'stream: unknown fields {", ".join(sorted(stream))} (a design reads model.<its section>)')
  out = {'stream': ml_collections.ConfigDict({'design': name})}
  for d in list(REGISTRY.values()):
    if dataclasses.fields(d.config):
      out[d.section] = config_dict(default if type(default) is d.config else d.config,
                                   **overrides.pop(d.section, {}))
  return out


def _build(default, values: dict, prefix: str):
  """config_lib.build of a model's `stream`: the chosen design's config; pops `stream` and every section."""
  stream = values.pop('stream', None)
  if dataclasses.is_dataclass(stream):  # a config already built
    return stream
  stream = dict(stream or {})
  design = lookup(stream.pop('design', default.design), f'{prefix}.stream.design')
  if stream:
    raise InputError(f'{prefix}.stream.{sorted(stream)[0]}: unknown field (known: design)')
  spec = default if type(default) is design.config else design.config()
  for d in list(REGISTRY.values()):
    if d.section in values:
      built = build(d.config, values.pop(d.section), f'{prefix}.{d.section}')
      spec = built if d is design else spec
  return spec


def _to_dict(spec) -> dict:
  """config_lib.to_dict of a model's `stream`: `stream.design` and the chosen design's section."""
  section = {REGISTRY[spec.design].section: to_dict(spec)} if dataclasses.fields(spec) else {}
  return {'stream': {'design': qualified_name(spec)}, **section}


def stream_field(default):
  """A model config's `stream`: the chosen design's config, `default` unless set."""
  return dataclasses.field(default=default, metadata={'sections': _sections, 'build': _build, 'to_dict': _to_dict})


def select(model_cfg) -> tuple[Design, Any]:
  return REGISTRY[model_cfg.stream.design], model_cfg.stream


def check(model_cfg, prefix: str, num_layers: int, width: int, sites: int) -> None:
  design, spec = select(model_cfg)
  design.check(spec, f'{prefix}.{design.section}', num_layers, width, sites)


def unused_fields(spec, prefix: str) -> dict[str, str]:
  """{field: why} of the other designs' fields, and the chosen config's own `unused_fields`."""
  chosen = REGISTRY[spec.design]
  out = {f'{prefix}.{d.section}.{f.name}': f'only design {d.name!r} reads it, not {prefix}.stream.design='
         f'{spec.design!r}' for d in REGISTRY.values() if d is not chosen for f in dataclasses.fields(d.config)}
  if hasattr(spec, 'unused_fields'):
    out.update(spec.unused_fields(f'{prefix}.{chosen.section}'))
  return out


def per_site(values):
  """(layers, sites per layer, ...) -> (sites, ...), the sites in chain order."""
  return values.reshape((-1,) + values.shape[2:])


def distance_from_identity(m_NxTxNxN):
  """‖M − I‖_F over the last two axes, per site: how far a mixing of streams is from keeping them apart."""
  m = m_NxTxNxN.astype(F32)
  return per_site(jnp.sqrt(jnp.sum(jnp.square(m - jnp.eye(m.shape[-1], dtype=F32)), axis=(-2, -1))))


def scalars(section: str, values: dict) -> dict[str, float]:
  """A report's values ({name: array}, fetched) as scalars `<section>/<name>_<i>[_<j>]`: i along the first axis (a
  site or a layer), j along the rest."""
  out = {}
  for name, value in values.items():
    value = np.asarray(value, np.float64)
    rows = value.reshape(value.shape[0], -1) if value.ndim else value.reshape(1, 1)
    for (i, j), number in np.ndenumerate(rows):
      out[f'{section}/{name}_{i:02d}' + (f'_{j}' if rows.shape[1] > 1 else '')] = float(number)
  return out


def layer_sites(design: Design, spec) -> tuple:
  """((site name, or None for a plain residual, sublayer), ...) of one layer."""
  return tuple((None if s is None else design.section + s, part) for s, part in PLACEMENTS[design.placement(spec)])


def _union(*groups):
  return tuple(dict.fromkeys(x for g in groups for x in g))


def no_decay() -> tuple:
  return _union(*(d.no_decay for d in REGISTRY.values()))


def logical_axis_rules(base: tuple = sharding.LOGICAL_AXIS_RULES) -> tuple:
  """`base`, then every registered design's rules (flax takes the first rule of a name)."""
  return _union(base, *(d.logical_axes for d in REGISTRY.values()))


register(Design('residual', ResidualSite, placement=lambda spec: 'block', post_norm=True, per_bottleneck=True))
