"""DenseFormer: depth-weighted averages of the earlier blocks' outputs (Pagliardini et al., arXiv 2402.02622, §3).

X_i = B_i(Y_{i−1}); after every p-th block Y_i = Σ_{j ≤ i, j ≡ i (mod k)} α_{i,j}·X_j, else Y_i = X_i (§3.2–3.3).
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from laurel.config_lib import POSITIVE_INT, field, require
from laurel.designs.protocol import ACT, F32, STREAM_ACT, Chain, Design, Site, const, register


@dataclasses.dataclass(frozen=True)
class DenseFormerSpec:
  """`model.denseformer`."""
  dwa_dilation: int = field(1, POSITIVE_INT)  # k
  dwa_period: int = field(1, POSITIVE_INT)  # p


class DWAChain(Chain):
  """α in push layout, (u_NxR, w_NxR): what layer j adds to running sum r (block j + r's DWA), u[0, r] = α_{r,0}
  (the embedding), w[j, r] = α_{j+r, j+1} (block j's output; 1 at r = 0 without DWA). The parameter is DWAModules'
  weights joined, init α_{i,i} = 1, the rest 0 (§3): exactly the plain chain."""

  @nn.compact
  def __call__(self):
    s, big_n = self.spec, self.num_layers
    dwa_N = (np.arange(big_n) + 1) % s.dwa_period == 0
    pairs = [(i, j) for i in np.flatnonzero(dwa_N)
             for j in range((i + 1) % s.dwa_dilation, i + 2, s.dwa_dilation)]
    i_P, j_P = np.array(pairs).T
    alpha_P = self.make('dwa_alpha', const(j_P == i_P + 1), (len(pairs),), ('layers_dwa',)).astype(F32)
    sender_P, emb_P = np.maximum(j_P - 1, 0), j_P == 0
    u = jnp.zeros((big_n, big_n), F32).at[0, i_P[emb_P]].set(alpha_P[emb_P])
    passthrough = jnp.zeros((big_n, big_n), F32).at[:, 0].set(~dwa_N)
    w = passthrough.at[sender_P[~emb_P], (i_P - sender_P)[~emb_P]].set(alpha_P[~emb_P])
    return u, w


class DenseFormerSite(Site):
  """x + F(norm(x)), then at layer j's last site DWA_j in push form over running sums S_r: the first site adds
  u_j[r]·X_j, the last w_j[r]·X_{j+1}, reads S_0 as Y_j and shifts the queue. Linear in S, so a scan's backward
  keeps no history X_0 … X_j per layer."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    x_BxLxD, s_RxBxLxD = carry
    u_R, w_R = chain_l
    push = lambda s, c_R, v: s + c_R.astype(v.dtype)[:, None, None, None] * v
    if self.t == 0:
      s_RxBxLxD = push(s_RxBxLxD, u_R, x_BxLxD)
    x_BxLxD = nn.with_logical_constraint(x_BxLxD + fn(x_BxLxD, norm_in(x_BxLxD), None), ACT)
    if self.t == self.sites_per_layer - 1:
      s_RxBxLxD = push(s_RxBxLxD, w_R, x_BxLxD)
      x_BxLxD, s_RxBxLxD = s_RxBxLxD[0], jnp.pad(s_RxBxLxD[1:], ((0, 1),) + ((0, 0),) * 3)
    return nn.with_logical_constraint(x_BxLxD, ACT), nn.with_logical_constraint(s_RxBxLxD, STREAM_ACT)


def _check(spec, prefix, num_layers, width, sites):
  for name in ('dwa_dilation', 'dwa_period'):
    require(getattr(spec, name) <= num_layers, f'{prefix}.{name}', getattr(spec, name),
            f'must be <= num_layers={num_layers}')


def _diagnostics(spec, chain, sites) -> dict:
  """Per layer i, the DWA's weight on block i's own output, α_{i,i+1} (1 at init and where no DWA follows), and
  Σ|α_{i,j}| over the embedding and the earlier outputs (0 at init)."""
  u_NxR, w_NxR = (a.astype(F32) for a in chain)
  n = w_NxR.shape[0]
  i_Nx1, j_1xN = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
  earlier_NxN = jnp.where(j_1xN < i_Nx1, w_NxR[j_1xN, jnp.clip(i_Nx1 - j_1xN, 0, n - 1)], 0.0)  # α_{i,j+1}, j < i
  return {'own': w_NxR[:, 0], 'others': jnp.abs(u_NxR[0]) + jnp.abs(earlier_NxN).sum(-1)}


register(Design('denseformer', DenseFormerSite, config=DenseFormerSpec, chain=DWAChain, check=_check,
                start=lambda spec, x, num_layers: (x, nn.with_logical_constraint(
                    jnp.zeros((num_layers,) + x.shape, x.dtype), STREAM_ACT)),
                finish=lambda spec, carry: carry[0], no_decay=('dwa_alpha',), logical_axes=(('layers_dwa', None),),
                diagnostics=_diagnostics))
