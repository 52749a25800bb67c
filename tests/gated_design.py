"""A gated residual, x + σ(g)·f(x): a design kept outside the package, as docs/designs.md's "Adding a design" says.

This project's example of the protocol, not a published design: the gate g is a learned scalar or per-feature
vector and σ the logistic sigmoid, the transform gate of Highway networks (Srivastava et al., arXiv 1505.00387)
without their carry gate, or ReZero's learned scale bounded to (0, 1). g starts at `init`: σ(0) = ½.
A run selects it with `--config.model.stream.design=tests.gated_design:gated` and sets `--config.model.gated.*`.
"""

import dataclasses

import flax.linen as nn
import jax

from laurel.config_lib import field, is_number, one_of
from laurel.designs import F32, Design, Site, const, register


@dataclasses.dataclass(frozen=True)
class GatedSpec:
  """`model.gated`."""
  gate: str = field('per_feature', one_of('per_feature', 'scalar'))  # g's shape: (D,) or ()
  init: float = field(0.0, (is_number, 'must be a finite number'))  # g at init


class GatedSite(Site):
  """x + σ(g)·f(norm(x)); σ(g) folds into f's last kernel like any scale."""

  @nn.compact
  def __call__(self, x, fn, norm_in, norm_out, chain_l):
    per_feature = self.spec.gate == 'per_feature'
    g = self.make('gate', const(self.spec.init), (self.features,) if per_feature else (),
                  (self.embed_axis,) if per_feature else ())
    return nn.with_logical_constraint(norm_out(x + fn(x, norm_in(x), jax.nn.sigmoid(g.astype(F32)))), self.axes)


register(Design('gated', GatedSite, config=GatedSpec, post_norm=True, per_bottleneck=True, no_decay=('gate',)))
