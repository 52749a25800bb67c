"""Attention Residuals (Kimi Team, arXiv 2603.15031, §3; reference code `modeling_qwen3_attnres.py`).

Site s reads h_s = Σ_{j ≤ s} softmax_j(w_sᵀ RMSNorm_s(v_j))·v_j over the embedding and the earlier outputs (Block: the
finished blocks' sums and the current partial one); read out by a final site S. `attnres_delta`: over the increments,
added to the ordinary stream (arXiv 2605.18855; at site 0 the formula's 2·x_0 where its code takes x_0, equal after
the pre-norm); `attnres_heads`: one softmax per channel group (arXiv 2607.27230). Push form (docs/designs.md): each
source joins the online-softmax sums (U, Z, M) of every later receiver.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from laurel.config_lib import BOOL, POSITIVE_INT, field, require
from laurel.designs.protocol import ACT, F32, STREAM_ACT, Chain, Design, Site, register, unit_rms

SAVED = 'attnres_input'  # each site's input h_s, which every remat policy keeps (Design.saved_names)
NEG = -1e30  # the logit of an absent source (exp underflows to 0; never -inf, so no inf − inf)


@dataclasses.dataclass(frozen=True)
class AttnResSpec:
  """`model.attnres` (Full AttnRes)."""
  attnres_heads: int = field(1, POSITIVE_INT)  # independent depth softmaxes over channel groups
  attnres_delta: bool = field(False, BOOL)  # over the increments, added to the ordinary stream
  block_size = 1  # sites per block

  def receivers(self, sites: int) -> int:
    """The sites, and the read-out site S but with delta (which reads out the stream x)."""
    return sites + (0 if self.attnres_delta else 1)


@dataclasses.dataclass(frozen=True)
class AttnResBlockSpec(AttnResSpec):
  """`model.attnres_block` (Block AttnRes)."""
  attnres_block: int = field(2, POSITIVE_INT)  # sites (attention, MLP) per block
  block_size = property(lambda self: self.attnres_block)


class AttnResChain(Chain):
  """(w̃_NxTxKxD, boundary_NxT, site_NxT): w̃[l, t, r] = w_r ⊙ γ_r of every receiver r at each site s = T·l + t;
  boundary marks a block's first site."""

  @nn.compact
  def __call__(self):
    big_n, t_sites, d = self.num_layers, self.sites_per_layer, self.features
    sites = big_n * t_sites
    k = self.spec.receivers(sites)
    make = lambda name, init: self.make(name, init, (k, d), ('attnres_sites', self.embed_axis)).astype(F32)
    w_KxD = make('attnres_query', nn.initializers.zeros) * make('attnres_key_scale', nn.initializers.ones)
    s_NxT = np.arange(sites).reshape(big_n, t_sites)
    w_NxTxKxD = jnp.broadcast_to(w_KxD, (big_n, t_sites, k, d))
    return w_NxTxKxD, jnp.asarray(s_NxT % self.spec.block_size == 0, F32), jnp.asarray(s_NxT, F32)


def _unit_rms(v_BxLxD, heads):
  """v / rms(v) over each head's channels, float32: (B, L, H, D/H)."""
  return unit_rms(v_BxLxD.reshape(v_BxLxD.shape[:-1] + (heads, -1)))


def _per_head(a_XxH, v_XxD):
  """a·v with a's head h scaling v's channels of group h (v broadcast over a's leading axes)."""
  heads, width = a_XxH.shape[-1], v_XxD.shape[-1]
  if heads == 1:  # no reshape: XLA then keeps fewer copies of the sums (16.8 against 19.8 activations per layer)
    return a_XxH.astype(v_XxD.dtype) * v_XxD
  out = a_XxH.astype(v_XxD.dtype)[..., None] * v_XxD.reshape(v_XxD.shape[:-1] + (heads, width // heads))
  return out.reshape(out.shape[:-2] + (width,))


def _push(sums, v_BxLxD, logit_KxBxLxH):
  """Adds exp(ℓ − M)·v to every receiver's sums, rescaled to the new max M (online softmax), per head."""
  u_KxBxLxD, z_KxBxLxH, m_KxBxLxH = sums
  m_new = jax.lax.stop_gradient(jnp.maximum(m_KxBxLxH, logit_KxBxLxH))
  # A constant factor: otherwise the carry's (zero, but not symbolically zero) tangent of M keeps U for the backward.
  keep, add = jax.lax.stop_gradient(jnp.exp(m_KxBxLxH - m_new)), jnp.exp(logit_KxBxLxH - m_new)
  return _per_head(keep, u_KxBxLxD) + _per_head(add, v_BxLxD), keep * z_KxBxLxH + add, m_new


@jax.custom_jvp
def _average(u_BxLxD, z_BxLxH):
  return _per_head(1 / z_BxLxH, u_BxLxD)


@_average.defjvp
def _average_jvp(primals, tangents):
  """d(u/z) = (du − h·dz)/z through the output h, named: saving h (D-wide) under remat spares keeping U (K·D)."""
  (u, z), (du, dz) = primals, tangents
  h = checkpoint_name(_average(u, z), SAVED)
  return h, _per_head(1 / z, du - _per_head(dz, h))


def _read(sums, receiver, p_BxLxD, logit_p_BxLxH):
  """A receiver's softmax average, the partial block p one more source of logit ℓ_p (NEG: absent)."""
  u, z, m = (jax.lax.dynamic_slice_in_dim(a, receiver, 1) for a in sums)
  u, z, _ = _push((u, z, m), p_BxLxD, logit_p_BxLxH[None])
  return _average(u[0], z[0]).astype(p_BxLxD.dtype)


SUMS_ACT = (STREAM_ACT, STREAM_ACT[:3] + (None,), STREAM_ACT[:3] + (None,))  # U, and Z, M per head


class AttnResSite(Site):
  """Carry (p, x, U, Z, M, ℓ): p the sources not yet pushed (x_0, the partial block); x the ordinary stream with
  delta, else None; U_KxBxLxD, Z_KxBxLxH, M_KxBxLxH every receiver's sums at its own index (so each push is
  elementwise); ℓ the logit of p to the read-out. A block's first site pushes p and restarts it; the others read
  p as one more source."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    p_BxLxD, x_BxLxD, *sums, logit_next = carry
    w_TxKxD, boundary_T, site_T = chain_l
    heads, k, s = self.spec.attnres_heads, w_TxKxD.shape[1], site_T[self.t].astype(jnp.int32)
    w_KxHxE, boundary = w_TxKxD[self.t].reshape(k, heads, -1), boundary_T[self.t] > 0
    full = self.spec.block_size == 1
    logit_KxBxLxH = jnp.einsum('blhe,khe->kblh', _unit_rms(p_BxLxD, heads), w_KxHxE)
    sums = _push(sums, p_BxLxD, logit_KxBxLxH if full else jnp.where(boundary, logit_KxBxLxH, NEG))
    if full:  # every site is a block's first: p is pushed, never read
      p_BxLxD, logit_p = jnp.zeros_like(p_BxLxD), jnp.full(logit_KxBxLxH.shape[1:], NEG, F32)
    else:
      p_BxLxD = jnp.where(boundary, jnp.zeros_like(p_BxLxD), p_BxLxD)
      logit_p = jnp.where(boundary, NEG, jax.lax.dynamic_index_in_dim(logit_KxBxLxH, s, keepdims=False))
    h_BxLxD = nn.with_logical_constraint(_read(sums, s, p_BxLxD, logit_p), ACT)
    if x_BxLxD is not None:  # delta: the attended increments join the ordinary stream
      h_BxLxD = x_BxLxD + h_BxLxD
    y_BxLxD = fn(h_BxLxD, norm_in(h_BxLxD), None)
    p_BxLxD = nn.with_logical_constraint(p_BxLxD + y_BxLxD, ACT)
    if x_BxLxD is not None:
      x_BxLxD = nn.with_logical_constraint(x_BxLxD + y_BxLxD, ACT)
    sums = [nn.with_logical_constraint(a, axes) for a, axes in zip(sums, SUMS_ACT)]
    if self.t == self.sites_per_layer - 1 and x_BxLxD is None:  # delta reads out x, not receiver S
      w_HxE = jax.lax.dynamic_index_in_dim(w_KxHxE, s + 1, keepdims=False)
      logit_next = jnp.einsum('blhe,he->blh', _unit_rms(p_BxLxD, heads), w_HxE)
    return (p_BxLxD, x_BxLxD, *sums, logit_next)


def _start(spec, x_BxLxD, num_layers):
  k, heads = spec.receivers(2 * num_layers), spec.attnres_heads  # the sublayer placement: 2 sites per layer
  per_head = x_BxLxD.shape[:2] + (heads,)
  return (x_BxLxD, x_BxLxD if spec.attnres_delta else None, jnp.zeros((k,) + x_BxLxD.shape, x_BxLxD.dtype),
          jnp.zeros((k,) + per_head, F32), jnp.full((k,) + per_head, NEG, F32), jnp.zeros(per_head, F32))


def _finish(spec, carry):
  """The read-out h_S (receiver S); with delta the stream x_S (the delta code has no final mix)."""
  p_BxLxD, x_BxLxD, *sums, logit_p = carry
  return _read(sums, sums[0].shape[0] - 1, p_BxLxD, logit_p) if x_BxLxD is None else x_BxLxD


def _check(spec, prefix, num_layers, width, sites):
  require(width % spec.attnres_heads == 0, f'{prefix}.attnres_heads', spec.attnres_heads,
          f'must divide d_model={width} (each head mixes its own channels)')
  if spec.design == 'attnres_block':
    require(2 * num_layers % spec.attnres_block == 0, f'{prefix}.attnres_block', spec.attnres_block,
            f'sites per block must divide the 2·num_layers={2 * num_layers} sites (attention and MLP per layer)')


def _diagnostics(spec, chain, sites) -> dict:
  """Per receiver (every site, then the read-out but with delta), ‖w_r ⊙ γ_r‖: 0 at init, where a receiver averages
  its sources evenly; the larger, the more its depth softmax can single sources out."""
  w_KxD = chain[0][0, 0].astype(F32)  # the same at every layer and site: broadcast for the scan
  return {'query_norm': jnp.sqrt(jnp.sum(jnp.square(w_KxD), axis=-1))}


_ATTNRES = dict(site=AttnResSite, chain=AttnResChain, start=_start, finish=_finish, check=_check,
                no_decay=('attnres_query', 'attnres_key_scale'), logical_axes=(('attnres_sites', None),),
                saved_names=(SAVED,), diagnostics=_diagnostics)
register(Design('attnres', config=AttnResSpec, **_ATTNRES),
         Design('attnres_block', config=AttnResBlockSpec, **_ATTNRES))
