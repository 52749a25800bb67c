"""Per-site scales of f; equation numbers are each paper's.

  ReZero       x_{i+1} = x_i + α_i·F(x_i), α_i = 0 (no pre-norm)       Bachlechner et al., arXiv 2003.04887, eq. 1
  LayerScale   x' = x + diag(λ)·F(η(x)), λ = ε                          CaiT, Touvron et al., arXiv 2103.17239, §2

At init ReZero is the identity and LayerScale x + ε·F(norm(x)) (CaiT's ε: 0.1 up to depth 18, 1e-5 at depth 24,
the default, 1e-6 deeper). Both scales fold into F's output projection.
"""

import dataclasses

import flax.linen as nn

from laurel.config_lib import POSITIVE, field
from laurel.designs.protocol import F32, Design, Site, const, register


@dataclasses.dataclass(frozen=True)
class LayerScaleSpec:
  """`model.layerscale`."""
  layerscale_init: float = field(1e-5, POSITIVE)  # CaiT's ε for depth 24


class ReZeroSite(Site):
  """eq. 1: x + α·F(x). ReZero drops the pre-norm, so norm_in is not called."""

  @nn.compact
  def __call__(self, x, fn, norm_in, norm_out, chain_l):
    alpha = self.make('rezero_alpha', nn.initializers.zeros, (), ())
    return nn.with_logical_constraint(norm_out(x + fn(x, x, alpha.astype(F32))), self.axes)


class LayerScaleSite(Site):
  """CaiT §2: x + diag(λ)·F(norm(x))."""

  @nn.compact
  def __call__(self, x, fn, norm_in, norm_out, chain_l):
    lam_D = self.make('layerscale', const(self.spec.layerscale_init), (self.features,), (self.embed_axis,))
    return nn.with_logical_constraint(norm_out(x + fn(x, norm_in(x), lam_D.astype(F32))), self.axes)


register(Design('rezero', ReZeroSite, per_bottleneck=True, no_decay=('rezero_alpha',)),
         Design('layerscale', LayerScaleSite, config=LayerScaleSpec, per_bottleneck=True,
                no_decay=('layerscale',)))
