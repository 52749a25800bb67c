"""Bottleneck ResNet (ResNet-50 by default) whose residual connections are LAuReL sites (laurel.residual).

Architecture (He et al. 2016, "v1.5" with the stride on the 3×3): stem 7×7/2 conv + BN + ReLU + max-pool 3×3/2;
stages of bottleneck blocks 1×1 f → 3×3 f (stride) → 1×1 4f, BN after each conv, ReLU after the first two; the
last BN of every block starts with scale 0; a 1×1 conv + BN projects the shortcut where the shape changes (the
first block of every stage); no conv bias; global average pool; Dense head with bias. Stage s has width
f = base_width·2^s and the first block of stages s > 0 has stride 2. With stage_sizes (3, 4, 6, 3), base_width 64
and 1000 classes this has exactly 25,557,032 parameters and 53,120 batch statistics.

LAuReL (one site per bottleneck block, 16 in ResNet-50): the block's residual `relu(f(x) + shortcut(x))` becomes
`relu(LaurelResidual(α·f(x), x=shortcut(x), ...))`. In a projection block g acts on the projected shortcut: it
is that block's x_i. The LAuReL width D of a block is its output channels 4f (256, 512, 1024, 2048), so every
block has exactly `residual.closed_form_params(spec, 4f)` extra parameters.

Each stage's sites form one chain (laurel.residual): activations of another stage have another shape and
cannot be added, so PA's running sums start at zero at every stage's first block and what the last blocks
of a stage send onwards is dropped. Block j of a stage therefore receives min(j, k−1) real earlier terms, as
the first blocks of the LM do. Every block still owns all k (γ, A, B) entries, so parameter counts match the
closed form; the entries whose terms are dropped get zero gradient (only weight decay moves them).

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
from laurel.config_lib import BOOL, POSITIVE, POSITIVE_INT, field, in_range, is_int, one_of, require

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
EXPANSION = 4  # bottleneck output channels = 4·f
ACT_AXES = ('act_batch', None, None, 'act_channels')  # NHWC activations
KERNEL_AXES = (None, None, 'conv_in', 'conv_out')  # flax forbids one logical name twice in an array


def _is_stage_sizes(v) -> bool:
  return isinstance(v, (list, tuple)) and bool(v) and all(is_int(n) and n >= 1 for n in v)


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """`config.model` of a classification run."""
  num_classes: int = field(1000, POSITIVE_INT)
  stage_sizes: tuple = field((3, 4, 6, 3), (_is_stage_sizes, 'must be a non-empty sequence of positive integers'))
  base_width: int = field(64, POSITIVE_INT)  # stem channels and f of stage 0; stage s uses f = base_width·2^s
  dtype: str = field('float32', one_of(*DTYPES))  # compute
  param_dtype: str = field('float32', one_of(*DTYPES))
  bn_momentum: float = field(0.9, in_range(0, 1, closed=(True, False)))
  bn_epsilon: float = field(1e-5, POSITIVE)
  zero_init_last_bn: bool = field(True, BOOL)  # each block starts as its shortcut (Goyal et al. 2017)
  laurel: residual.LaurelSpec = residual.LaurelSpec(a_init='xavier')

  def __post_init__(self):
    object.__setattr__(self, 'stage_sizes', tuple(self.stage_sizes))

  @property
  def num_blocks(self) -> int:
    return sum(self.stage_sizes)

  @property
  def block_channels(self) -> tuple:
    """Output channels 4f of every block in order; the LAuReL width D of each site."""
    return tuple(EXPANSION * self.base_width * 2 ** s for s, n in enumerate(self.stage_sizes) for _ in range(n))

  def check(self, prefix: str) -> None:
    lfield = f'{prefix}.laurel'
    require(self.laurel.site == 'block', f'{lfield}.site', self.laurel.site,
            "the ResNet has one LAuReL site per bottleneck block; only 'block' is supported")
    require(self.laurel.form != 'gemma3n', f'{lfield}.form', self.laurel.form,
            "Gemma 3n's form reads a pre-norm input the ResNet does not have; use 'paper'")
    # The rank must fit the narrowest block (stage 0, D = 4·base_width); k may span the whole network.
    self.laurel.check_sizes(min(self.block_channels), self.num_blocks, lfield)

  @classmethod
  def from_config(cls, model_cfg: Any, field: str = 'model') -> 'ResNetConfig':
    return config_lib.build(cls, model_cfg, field)


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
  """1×1 f → 3×3 f (stride) → 1×1 4f with a LAuReL residual. Carry and returns (x, PA's pending sums)."""
  cfg: ResNetConfig
  width: int  # f
  strides: int

  @nn.compact
  def __call__(self, x_BxHxWxC, pending: tuple | None, rw, train: bool):
    cfg = self.cfg
    out_ch = EXPANSION * self.width
    y = nn.relu(_bn(cfg, train, 'bn1')(_conv(cfg, self.width, 1, 1, 'conv1')(x_BxHxWxC)))
    y = nn.relu(_bn(cfg, train, 'bn2')(_conv(cfg, self.width, 3, self.strides, 'conv2')(y)))
    fx_BxHxWxC = _bn(cfg, train, 'bn3', zero_scale=cfg.zero_init_last_bn)(_conv(cfg, out_ch, 1, 1, 'conv3')(y))
    if x_BxHxWxC.shape[-1] != out_ch or self.strides != 1:  # the first block of a stage
      x_BxHxWxC = _bn(cfg, train, 'proj_bn')(_conv(cfg, out_ch, 1, self.strides, 'proj_conv')(x_BxHxWxC))
    if pending is None:  # a stage's first site starts its chain: PA's sums start at zero
      pending = tuple(jnp.zeros_like(x_BxHxWxC) for _ in range(cfg.laurel.history_len))
    alpha, beta_K = rw or (None, None)
    out_BxHxWxC, pending = residual.LaurelResidual(cfg.laurel, out_ch, DTYPES[cfg.param_dtype], axes=ACT_AXES,
                                                   embed_axis='conv_out', name='laurel')(
                                                       residual.scaled(fx_BxHxWxC, alpha), x_BxHxWxC, pending, beta_K)
    return nn.with_logical_constraint(nn.relu(out_BxHxWxC), ACT_AXES), pending


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

    for s, blocks in enumerate(cfg.stage_sizes):
      width, pending = cfg.base_width * 2 ** s, None
      rw_S = None
      if cfg.laurel.rw:
        rw_S = residual.ChainRW(cfg.laurel, blocks, EXPANSION * width, DTYPES[cfg.param_dtype],
                                embed_axis='conv_out', name=f'stage{s + 1}_laurel_rw')()
      for j in range(blocks):
        x_BxHxWxC, pending = Bottleneck(cfg, width, 2 if s > 0 and j == 0 else 1, name=f'stage{s + 1}_block{j}')(
            x_BxHxWxC, pending, residual.site_rw(rw_S, j), train)

    # Pool and classify in float32: cheap, and keeps the logits exact under bfloat16 compute.
    pooled_BxC = jnp.mean(x_BxHxWxC.astype(jnp.float32), axis=(1, 2))
    logits_BxK = nn.Dense(cfg.num_classes, dtype=jnp.float32, param_dtype=DTYPES[cfg.param_dtype], name='head',
                          kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                   ('conv_in', 'classes')),
                          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('classes',)))(pooled_BxC)
    return nn.with_logical_constraint(logits_BxK.astype(jnp.float32), ('act_batch', 'classes'))
