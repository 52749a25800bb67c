"""Bottleneck ResNet v1.5 (stride on the 3×3; ResNet-50 by default), each block's residual a site of a residual design:
`relu(site(α·f(x), x=shortcut(x)))`. Each stage is one chain, as shapes change between stages.

Shapes: B batch, H×W spatial, C channels, K classes.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from laurel import designs
from laurel.config_lib import BOOL, DTYPES, POSITIVE, POSITIVE_INT, build, field, in_range, is_int, one_of, require

EXPANSION = 4  # bottleneck output channels = 4·f
ACT_AXES = ('act_batch', None, None, 'act_channels')  # NHWC activations
KERNEL_AXES = (None, None, 'conv_in', 'conv_out')  # flax forbids one logical name twice in an array
STAGE_SIZES = (lambda v: isinstance(v, (list, tuple)) and bool(v) and all(is_int(n) and n >= 1 for n in v),
               'must be a non-empty sequence of positive integers')


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """`config.model` of a classification run."""
  num_classes: int = field(1000, POSITIVE_INT)
  stage_sizes: tuple = field((3, 4, 6, 3), STAGE_SIZES)
  base_width: int = field(64, POSITIVE_INT)  # stem channels and f of stage 0; stage s uses f = base_width·2^s
  dtype: str = field('float32', one_of(*DTYPES))  # compute
  param_dtype: str = field('float32', one_of(*DTYPES))
  bn_momentum: float = field(0.9, in_range(0, 1, closed=(True, False)))
  bn_epsilon: float = field(1e-5, POSITIVE)
  zero_init_last_bn: bool = field(True, BOOL)  # each block starts as its shortcut (Goyal et al. 2017)
  stream: Any = designs.stream_field(designs.StreamSpec('residual'))  # the residual design's config (laurel.designs)

  def __post_init__(self):
    object.__setattr__(self, 'stage_sizes', tuple(self.stage_sizes))

  @property
  def block_channels(self) -> tuple:
    """Output channels 4f of every block in order: each site's D."""
    return tuple(EXPANSION * self.base_width * 2 ** s for s, n in enumerate(self.stage_sizes) for _ in range(n))

  def check(self, prefix: str) -> None:
    design, spec = designs.select(self)
    require(design.per_bottleneck, f'{prefix}.stream.design', design.name, 'the ResNet takes one of ' + ', '.join(
        d.name for d in designs.REGISTRY.values() if d.per_bottleneck) + ' (a carry of x per bottleneck block)')
    if design.name == 'laurel':
      require(spec.site == 'block', f'{prefix}.laurel.site', spec.site,
              "the ResNet has one LAuReL site per bottleneck block; only 'block' is supported")
      require(spec.form != 'gemma3n', f'{prefix}.laurel.form', spec.form,
              "Gemma 3n's form reads a pre-norm input the ResNet does not have; use 'paper'")
    # The rank must fit the narrowest block (stage 0, D = 4·base_width); k may span the whole network.
    blocks = sum(self.stage_sizes)
    designs.check(self, prefix, blocks, min(self.block_channels), blocks)

  def unused_fields(self, prefix: str) -> dict[str, str]:
    return designs.unused_fields(self.stream, prefix)

  @classmethod
  def from_config(cls, model_cfg: Any, field: str = 'model') -> 'ResNetConfig':
    return build(cls, model_cfg, field)


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
  """1×1 f → 3×3 f (stride) → 1×1 4f around a site; `start`: a stage's first block, which gets x, not a carry."""
  cfg: ResNetConfig
  width: int  # f
  strides: int

  @nn.compact
  def __call__(self, carry, chain_l, train: bool, start: bool):
    cfg, (design, spec) = self.cfg, designs.select(self.cfg)
    x_BxHxWxC = carry if start else design.finish(spec, carry)
    out_ch = EXPANSION * self.width
    y = nn.relu(_bn(cfg, train, 'bn1')(_conv(cfg, self.width, 1, 1, 'conv1')(x_BxHxWxC)))
    y = nn.relu(_bn(cfg, train, 'bn2')(_conv(cfg, self.width, 3, self.strides, 'conv2')(y)))
    fx_BxHxWxC = _bn(cfg, train, 'bn3', zero_scale=cfg.zero_init_last_bn)(_conv(cfg, out_ch, 1, 1, 'conv3')(y))
    if start:
      if x_BxHxWxC.shape[-1] != out_ch or self.strides != 1:
        x_BxHxWxC = _bn(cfg, train, 'proj_bn')(_conv(cfg, out_ch, 1, self.strides, 'proj_conv')(x_BxHxWxC))
      carry = design.start(spec, x_BxHxWxC, None)
    site = design.site(spec, out_ch, param_dtype=DTYPES[cfg.param_dtype], axes=ACT_AXES, embed_axis='conv_out',
                       name=design.section)
    return site(carry, lambda x, xn, scale: designs.scaled(fx_BxHxWxC, scale), lambda x: x, nn.relu, chain_l)


class ResNet(nn.Module):
  """-> float32 logits (B, K); train=True needs `mutable=['batch_stats']`."""
  cfg: ResNetConfig

  @nn.compact
  def __call__(self, images_BxHxWx3, train: bool):
    cfg = self.cfg
    x = images_BxHxWx3.astype(DTYPES[cfg.dtype])
    x = nn.relu(_bn(cfg, train, 'stem_bn')(_conv(cfg, cfg.base_width, 7, 2, 'stem_conv')(x)))
    x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    x_BxHxWxC = nn.with_logical_constraint(x, ACT_AXES)

    design, spec = designs.select(cfg)
    for s, blocks in enumerate(cfg.stage_sizes):
      width, carry = cfg.base_width * 2 ** s, x_BxHxWxC
      chain = design.chain(spec, blocks, 1, EXPANSION * width, DTYPES[cfg.param_dtype], embed_axis='conv_out',
                           name=f'stage{s + 1}_{design.chain.module_name}')()
      for j in range(blocks):
        carry = Bottleneck(cfg, width, 2 if s > 0 and j == 0 else 1, name=f'stage{s + 1}_block{j}')(
            carry, jax.tree.map(lambda a, j=j: a[j], chain), train, j == 0)
      x_BxHxWxC = design.finish(spec, carry)

    # Pool and classify in float32: cheap, and keeps the logits exact under bfloat16 compute.
    pooled_BxC = jnp.mean(x_BxHxWxC.astype(jnp.float32), axis=(1, 2))
    logits_BxK = nn.Dense(cfg.num_classes, dtype=jnp.float32, param_dtype=DTYPES[cfg.param_dtype], name='head',
                          kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                   ('conv_in', 'classes')),
                          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('classes',)))(pooled_BxC)
    return nn.with_logical_constraint(logits_BxK.astype(jnp.float32), ('act_batch', 'classes'))
