"""Bottleneck ResNet (ResNet-50 by default) whose residual connections are LAuReL sites (laurel.residual).

Architecture (He et al. 2016, "v1.5" with the stride on the 3×3): stem 7×7/2 conv + BN + ReLU + max-pool 3×3/2;
stages of bottleneck blocks 1×1 f → 3×3 f (stride) → 1×1 4f, BN after each conv, ReLU after the first two; the
last BN of every block starts with scale 0; a 1×1 conv + BN projects the shortcut where the shape changes (the
first block of every stage); no conv bias; global average pool; Dense head with bias. Stage s has width
f = base_width·2^s and the first block of stages s > 0 has stride 2. With stage_sizes (3, 4, 6, 3), base_width 64
and 1000 classes this has exactly 25,557,032 parameters and 53,120 batch statistics.

LAuReL (one site per bottleneck block, 16 in ResNet-50): the block's residual `relu(f(x) + shortcut(x))` becomes
`relu(LaurelResidual(fx=f(x), x=shortcut(x), history))`. In a projection block g acts on the projected shortcut:
it is that block's x_i. The LAuReL width D of a block is its output channels 4f (256, 512, 1024, 2048), so every
block has exactly `residual.closed_form_params(spec, 4f)` extra parameters.

PA history across stages: history holds the x_i (the possibly projected shortcut) of the previous k−1 blocks,
newest first. Activations of another stage have another shape and cannot be added, so at every projection
block (a stage boundary) the history is reset to zeros and the projected shortcut becomes the first entry for
the next block. Inside a stage, block j therefore sees min(j, k−1) real previous activations and zeros for the
rest, exactly as the first blocks of the LM do. Every block still owns all k (γ, A, B) entries, so parameter
counts match the closed form; the entries that only ever meet zeros (e.g. x_{i−2} in a stage's second block)
get zero gradient (only weight decay moves them). Nothing else is carried across a stage boundary.

BatchNorm keeps running statistics in the 'batch_stats' collection (`use_running_average=not train`,
momentum 0.9, epsilon 1e-5); under SPMD jax.jit it needs no axis_name (XLA reduces over the global batch).
Shapes: B batch, H×W spatial, C channels, K classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from laurel import config_lib, residual

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
EXPANSION = 4  # bottleneck output channels = 4·f
ACT_AXES = ('act_batch', None, None, 'act_channels')  # NHWC activations
KERNEL_AXES = (None, None, 'conv_in', 'conv_out')  # flax forbids one logical name twice in an array


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  num_classes: int = 1000
  stage_sizes: tuple = (3, 4, 6, 3)  # bottleneck blocks per stage; ResNet-50
  base_width: int = 64  # stem channels and f of the first stage; stage s uses f = base_width·2^s
  dtype: str = 'float32'  # compute
  param_dtype: str = 'float32'
  bn_momentum: float = 0.9
  bn_epsilon: float = 1e-5
  zero_init_last_bn: bool = True  # each block starts as its shortcut (Goyal et al. 2017)
  laurel: residual.LaurelSpec = residual.LaurelSpec()

  @property
  def num_blocks(self) -> int:
    return sum(self.stage_sizes)

  @property
  def block_channels(self) -> tuple:
    """Output channels 4f of every block in order; the LAuReL width D of each site."""
    return tuple(EXPANSION * self.base_width * 2 ** s for s, n in enumerate(self.stage_sizes) for _ in range(n))

  def laurel_params(self) -> int:
    """Closed-form count of all LAuReL parameters (§2, Table 4), summed over the blocks."""
    return sum(residual.closed_form_params(self.laurel, d) for d in self.block_channels)

  @classmethod
  def from_config(cls, model_cfg: Any, field: str = 'model') -> 'ResNetConfig':
    """Validates `config.model`; errors name the field and the value."""
    values = config_lib.known_fields(cls, model_cfg, field)
    is_int, is_number, require = config_lib.is_int, config_lib.is_number, config_lib.require
    a_dtype = (lambda v: v in DTYPES, f'must be one of {", ".join(DTYPES)}')
    positive_int = (lambda v: is_int(v) and v >= 1, 'must be a positive integer')
    checks = {
        'dtype': a_dtype, 'param_dtype': a_dtype, 'num_classes': positive_int, 'base_width': positive_int,
        'stage_sizes': (lambda v: isinstance(v, (list, tuple)) and v and all(is_int(n) and n >= 1 for n in v),
                        'must be a non-empty sequence of positive integers'),
        'bn_momentum': (lambda v: is_number(v) and 0 <= v < 1, 'must be a number in [0, 1)'),
        'bn_epsilon': (lambda v: is_number(v) and v > 0, 'must be a positive number'),
        'zero_init_last_bn': (lambda v: isinstance(v, bool), 'must be a bool'),
    }
    for name, (ok, why) in checks.items():
      if name in values:
        require(bool(ok(values[name])), f'{field}.{name}', values[name], why)
    if 'stage_sizes' in values:
      values['stage_sizes'] = tuple(values['stage_sizes'])
    cfg = cls(**values)

    laurel_cfg = model_cfg.get('laurel', {})
    lfield = f'{field}.laurel'
    require(laurel_cfg.get('site', 'block') == 'block', f'{lfield}.site', laurel_cfg.get('site'),
            "the ResNet has one LAuReL site per bottleneck block; only 'block' is supported")
    require(laurel_cfg.get('form', 'paper') != 'gemma3n', f'{lfield}.form', 'gemma3n',
            "Gemma 3n's form reads a pre-norm input the ResNet does not have; use 'paper'")
    # The rank must fit the narrowest block (stage 1, D = 4·base_width); k may span the whole network.
    spec = residual.LaurelSpec.from_config(laurel_cfg, min(cfg.block_channels), cfg.num_blocks, lfield)
    return dataclasses.replace(cfg, laurel=spec)


def _conv(cfg, features, kernel, strides, name):
  # He (fan-out) init as torchvision; symmetric padding k//2 as in the reference ResNet.
  init = nn.initializers.variance_scaling(2.0, 'fan_out', 'normal')
  return nn.Conv(features, (kernel, kernel), (strides, strides), padding=[(kernel // 2, kernel // 2)] * 2,
                 use_bias=False, dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], name=name,
                 kernel_init=nn.with_logical_partitioning(init, KERNEL_AXES))


def _bn(cfg, train, name, zero_scale=False):
  scale_init = nn.initializers.zeros if zero_scale else nn.initializers.ones
  return nn.BatchNorm(use_running_average=not train, momentum=cfg.bn_momentum, epsilon=cfg.bn_epsilon,
                      dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], name=name,
                      scale_init=nn.with_logical_partitioning(scale_init, ('conv_out',)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('conv_out',)))


class Bottleneck(nn.Module):
  """1×1 f → 3×3 f (stride) → 1×1 4f with a LAuReL residual. Returns (output, updated PA history)."""
  cfg: ResNetConfig
  width: int  # f
  strides: int

  @nn.compact
  def __call__(self, x_BxHxWxC, history: tuple, train: bool):
    cfg = self.cfg
    out_ch = EXPANSION * self.width
    y = nn.relu(_bn(cfg, train, 'bn1')(_conv(cfg, self.width, 1, 1, 'conv1')(x_BxHxWxC)))
    y = nn.relu(_bn(cfg, train, 'bn2')(_conv(cfg, self.width, 3, self.strides, 'conv2')(y)))
    fx_BxHxWxC = _bn(cfg, train, 'bn3', zero_scale=cfg.zero_init_last_bn)(_conv(cfg, out_ch, 1, 1, 'conv3')(y))

    if x_BxHxWxC.shape[-1] != out_ch or self.strides != 1:
      shortcut_BxHxWxC = _bn(cfg, train, 'proj_bn')(_conv(cfg, out_ch, 1, self.strides, 'proj_conv')(x_BxHxWxC))
      # Stage boundary: earlier activations have another shape, so PA starts afresh (module docstring).
      history = tuple(jnp.zeros_like(shortcut_BxHxWxC) for _ in history)
    else:
      shortcut_BxHxWxC = x_BxHxWxC

    out_BxHxWxC = residual.LaurelResidual(cfg.laurel, out_ch, DTYPES[cfg.param_dtype], axes=ACT_AXES,
                                          embed_axis='conv_out', name='laurel')(
                                              fx_BxHxWxC, shortcut_BxHxWxC, history)
    history = ((shortcut_BxHxWxC,) + history[:-1]) if history else history
    out_BxHxWxC = nn.with_logical_constraint(nn.relu(out_BxHxWxC), ACT_AXES)
    return out_BxHxWxC, history


class ResNet(nn.Module):
  """`ResNet(cfg).apply(variables, images_BxHxWx3, train)` -> float32 logits (B, num_classes).

  train=True normalises with batch statistics and needs `mutable=['batch_stats']` to update the running ones.
  """
  cfg: ResNetConfig

  @nn.compact
  def __call__(self, images_BxHxWx3, train: bool):
    cfg = self.cfg
    x = images_BxHxWx3.astype(DTYPES[cfg.dtype])
    x = nn.relu(_bn(cfg, train, 'stem_bn')(_conv(cfg, cfg.base_width, 7, 2, 'stem_conv')(x)))
    x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    x_BxHxWxC = nn.with_logical_constraint(x, ACT_AXES)

    history = tuple(jnp.zeros_like(x_BxHxWxC) for _ in range(cfg.laurel.history_len))
    for s, blocks in enumerate(cfg.stage_sizes):
      for j in range(blocks):
        strides = 2 if s > 0 and j == 0 else 1
        x_BxHxWxC, history = Bottleneck(cfg, cfg.base_width * 2 ** s, strides, name=f'stage{s + 1}_block{j}')(
            x_BxHxWxC, history, train)

    # Pool and classify in float32: cheap, and keeps the logits exact under bfloat16 compute.
    pooled_BxC = jnp.mean(x_BxHxWxC.astype(jnp.float32), axis=(1, 2))
    logits_BxK = nn.Dense(cfg.num_classes, dtype=jnp.float32, param_dtype=DTYPES[cfg.param_dtype], name='head',
                          kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                   ('conv_in', 'classes')),
                          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('classes',)))(pooled_BxC)
    return nn.with_logical_constraint(logits_BxK.astype(jnp.float32), ('act_batch', 'classes'))


def laurel_site_widths(cfg: ResNetConfig) -> list[int]:
  """The width D of every LAuReL site (one per block, in order), for parameter accounting."""
  return list(cfg.block_channels)


def param_counts(cfg: ResNetConfig, image_size: int = 32) -> tuple[int, int]:
  """(parameters, batch statistics) of `ResNet(cfg)`, from shapes only (jax.eval_shape allocates nothing)."""
  images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  shapes = jax.eval_shape(lambda x: ResNet(cfg).init(jax.random.key(0), x, train=False), images)
  count = lambda tree: sum(int(leaf.size) for leaf in jax.tree.leaves(tree))
  return count(shapes['params']), count(shapes.get('batch_stats', {}))
