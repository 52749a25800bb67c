"""Per-site scales of f, folded into F's output projection: ReZero and LayerScale."""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from laurel.config_lib import POSITIVE, field
from laurel.designs.protocol import F32, Design, Site, const, per_site, register


@dataclasses.dataclass(frozen=True)
class LayerScaleSpec:
  """`model.layerscale`."""
  layerscale_init: float = field(1e-5, POSITIVE)  # CaiT's ε: 0.1 up to depth 18, 1e-5 at 24, 1e-6 deeper


class ReZeroSite(Site):
  """ReZero (Bachlechner et al., arXiv 2003.04887, eq. 1): x + α·F(x), α = 0, without the pre-norm."""

  @nn.compact
  def __call__(self, x, fn, norm_in, norm_out, chain_l):
    alpha = self.make('rezero_alpha', nn.initializers.zeros, (), ())
    return nn.with_logical_constraint(norm_out(x + fn(x, x, alpha.astype(F32))), self.axes)


class LayerScaleSite(Site):
  """LayerScale (CaiT, Touvron et al., arXiv 2103.17239, §2): x + diag(λ)·F(norm(x)), λ = ε."""

  @nn.compact
  def __call__(self, x, fn, norm_in, norm_out, chain_l):
    lam_D = self.make('layerscale', const(self.spec.layerscale_init), (self.features,), (self.embed_axis,))
    return nn.with_logical_constraint(norm_out(x + fn(x, norm_in(x), lam_D.astype(F32))), self.axes)


register(Design('rezero', ReZeroSite, per_bottleneck=True, no_decay=('rezero_alpha',),
                diagnostics=lambda spec, chain, sites: {'alpha': per_site(sites['rezero_alpha'].astype(F32))}),
         Design('layerscale', LayerScaleSite, config=LayerScaleSpec, per_bottleneck=True, no_decay=('layerscale',),
                diagnostics=lambda spec, chain, sites: {
                    'mean_abs_lambda': per_site(jnp.abs(sites['layerscale'].astype(F32)).mean(-1))}))
