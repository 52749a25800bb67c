"""Residual-stream designs the LM can use instead of `x + f(x)`; equation numbers are each paper's.

  ReZero       x_{i+1} = x_i + α_i·F(x_i), α_i = 0 (no pre-norm)       Bachlechner et al., arXiv 2003.04887, eq. 1
  LayerScale   x' = x + diag(λ)·F(η(x)), λ = ε                          CaiT, Touvron et al., arXiv 2103.17239, §2
  HC           h_0ᵀ = A_mᵀH, H' = A_rᵀH, Ĥ = Bᵀ(F h_0)ᵀ + H'           Zhu et al., arXiv 2409.19606, eqs. 3–5
    dynamic    H̄ = norm(H); B(H) = s_β∘tanh(H̄W_β)ᵀ + B,                eqs. 10–13
               A_m(H) = s_α∘tanh(H̄W_m) + A_m, A_r(H) = s_α∘tanh(H̄W_r) + A_r
  mHC          x_{l+1} = H_res·x_l + H_postᵀ·F(H_pre·x_l)               Xie et al., arXiv 2512.24880, eq. 3
               H̃ = α·(RMSNorm(vec x_l)·φ) + b (pre, post, res)          eq. 7
               H_pre = σ(H̃_pre), H_post = 2σ(H̃_post), H_res = SK(H̃_res) eq. 8
               SK: M⁽⁰⁾ = exp(H̃_res), M⁽ᵗ⁾ = T_r(T_c(M⁽ᵗ⁻¹⁾)), t_max = sinkhorn_iters   eq. 9
  DenseFormer  X_i = B_i(Y_{i−1}); after every p-th block                Pagliardini et al., arXiv 2402.02622,
               Y_i = Σ_{j ≤ i, j ≡ i (mod k)} α_{i,j}·X_j, else Y_i = X_i  §3, §3.2–3.3 (k = dilation, p = period)

Initialisation, against the pre-norm chain x + F(norm(x)):
  * ReZero: α = 0, the identity. LayerScale: λ = layerscale_init, x + ε·F(norm(x)) (CaiT's ε: 0.1 up to depth 18,
    1e-5 at depth 24, the default, 1e-6 deeper).
  * HC, eq. 14: A_m = e_{k mod n} (k the global site index; in `Chain`), A_r = I, B = 1, W = 0; s_α = s_β = 0.01 and
    norm = LayerNorm per stream (Algorithm 2). H⁰ is n copies of the embedding, the readout sums the streams (§2.1):
    n·(plain chain), a factor the final RMSNorm removes.
  * mHC: α = 0.01 (Table 5); the paper leaves φ and b open. φ = 0, H_post = 2σ(0) = 1, H_pre = (1/n + e_{k mod n})/2
    (b_pre in `Chain`), H_res = (I + 11ᵀ/n)/2: the streams stay equal and the (HC) readout is n·(plain chain) up to
    rounding. Not H_pre = 1/n: with equal streams and φ = 0 every stream would get the same gradient and never part;
    the tilt to stream k mod n breaks that, as HC's A_m does. H_res only half-way to HC's A_r = I, where the Sinkhorn
    gradient would vanish. Needs n ≥ 2. The RMSNorm weight is absorbed into φ, as in the paper's kernel (§4.3.1).
  * DenseFormer: α_{i,i} = 1, the rest 0 (§3): exactly the plain chain.
HC/mHC carry their streams stream-leading, h_NxBxLxD, logical axes (None, 'act_batch', 'act_len', 'act_embed').
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel.config_lib import BOOL, POSITIVE, POSITIVE_INT, build, field, one_of, require

DESIGNS = ('residual', 'rezero', 'layerscale', 'hc', 'mhc', 'denseformer')
ACT = ('act_batch', 'act_len', 'act_embed')
STREAM_ACT = (None,) + ACT
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  """`model.stream`: the residual-stream design ('residual' = plain or LAuReL, handled by laurel.residual)."""
  design: str = field('residual', one_of(*DESIGNS))
  expansion: int = field(4, POSITIVE_INT)  # HC/mHC n
  hc_dynamic: bool = field(False, BOOL)  # HC eqs. 10–13
  sinkhorn_iters: int = field(20, POSITIVE_INT)  # mHC t_max (eq. 9)
  layerscale_init: float = field(1e-5, POSITIVE)  # CaiT's ε for depth 24
  dwa_dilation: int = field(1, POSITIVE_INT)  # DenseFormer k
  dwa_period: int = field(1, POSITIVE_INT)  # DenseFormer p

  def check(self, prefix: str) -> None:
    require(self.design != 'mhc' or self.expansion >= 2, f'{prefix}.expansion', self.expansion,
            "must be >= 2 for design 'mhc' (σ(b_pre) < 1 cannot start as the plain residual with one stream)")

  def check_sizes(self, num_layers: int, prefix: str) -> None:
    for name in ('dwa_dilation', 'dwa_period') if self.design == 'denseformer' else ():
      require(getattr(self, name) <= num_layers, f'{prefix}.{name}', getattr(self, name),
              f'must be <= num_layers={num_layers}')

  def unused_fields(self, prefix: str) -> dict[str, str]:
    """{field: why} of the fields of designs other than the selected one."""
    designs = {'expansion': ('hc', 'mhc'), 'hc_dynamic': ('hc',), 'sinkhorn_iters': ('mhc',),
               'layerscale_init': ('layerscale',), 'dwa_dilation': ('denseformer',), 'dwa_period': ('denseformer',)}
    return {f'{prefix}.{name}': f"only design {' or '.join(map(repr, used))} reads it, not "
            f'{prefix}.design={self.design!r}' for name, used in designs.items() if self.design not in used}

  @classmethod
  def from_config(cls, cfg: Any, num_layers: int, field: str = 'model.stream') -> 'StreamSpec':
    spec = build(cls, cfg, field)
    spec.check_sizes(num_layers, field)
    return spec


def start(spec: StreamSpec, x_BxLxD, num_layers: int | None = None):
  """The stream after the embedding: x; HC/mHC's n copies; DenseFormer's (x, zero running sums), which needs
  `num_layers` (one running sum per block that may read a later output)."""
  x_BxLxD = nn.with_logical_constraint(x_BxLxD, ACT)
  if spec.design in ('hc', 'mhc'):
    return nn.with_logical_constraint(jnp.broadcast_to(x_BxLxD, (spec.expansion,) + x_BxLxD.shape), STREAM_ACT)
  if spec.design == 'denseformer':
    if num_layers is None:
      raise ValueError("streams.start: design 'denseformer' needs num_layers")
    return x_BxLxD, nn.with_logical_constraint(jnp.zeros((num_layers,) + x_BxLxD.shape, x_BxLxD.dtype), STREAM_ACT)
  return x_BxLxD


def finish(spec: StreamSpec, carry):
  """The readout before the final norm: HC/mHC sum their streams (HC §2.1), DenseFormer returns Y_d."""
  if spec.design in ('hc', 'mhc'):
    return carry.sum(axis=0, dtype=F32).astype(carry.dtype)
  return carry[0] if spec.design == 'denseformer' else carry


def _const(value):
  return lambda key, shape, dtype=F32: jnp.broadcast_to(jnp.asarray(value, dtype), shape)


def _param(module, name, init, shape, names):
  return module.param(name, nn.with_logical_partitioning(init, names), shape, module.param_dtype)


@functools.partial(jax.checkpoint, static_argnums=(1,))
def sinkhorn(logits, iters: int):
  """mHC eq. 9 over the last two axes, in float32: exp, then `iters` × (columns, then rows, sum to 1). The backward
  pass recomputes the iterations (as the paper's kernel does, §4.3.1) instead of keeping 2·iters n×n per token."""
  def step(_, m):
    m = m / m.sum(-2, keepdims=True)  # T_c
    return m / m.sum(-1, keepdims=True)  # T_r

  # The shift cancels in the first normalisation: no gradient through max (whose rule divides by the tie count,
  # NaN under a layer scan when XLA recomputes the logits with other rounding).
  shift = jax.lax.stop_gradient(logits.max(axis=(-2, -1), keepdims=True))
  return jax.lax.fori_loop(0, iters, step, jnp.exp(logits - shift))


class Chain(nn.Module):
  """The parameters whose init depends on the layer or site index, leading axis `num_layers`, so the scanned layer
  needs no index: HC's A_m, mHC's b_pre (N×T×n), DenseFormer's α in push layout; None for ReZero and LayerScale."""
  spec: StreamSpec
  num_layers: int
  sites_per_layer: int
  features: int
  param_dtype: Any = F32

  @nn.compact
  def __call__(self):
    s, n, shape = self.spec, self.spec.expansion, (self.num_layers, self.sites_per_layer, self.spec.expansion)
    onehot_NxTxN = np.eye(n)[np.arange(shape[0] * shape[1]).reshape(shape[:2]) % n]  # e_{k mod n}, eq. 14
    names = ('layers', 'stream_sites', 'stream')
    if s.design == 'hc':
      return _param(self, 'a_m', _const(onehot_NxTxN), shape, names).astype(F32)
    if s.design == 'mhc':
      p_NxTxN = (1.0 / n + onehot_NxTxN) / 2  # σ(b_pre): sums to 1, tilted to stream k mod n
      return _param(self, 'b_pre', _const(np.log(p_NxTxN / (1 - p_NxTxN))), shape, names).astype(F32)
    return self.dwa_push_weights() if s.design == 'denseformer' else None

  def dwa_push_weights(self):
    """(u_NxR, w_NxR), R = N: what layer j adds to running sum r (block j + r's DWA): u[0, r] = α_{r,0} (the embedding),
    w[j, r] = α_{j+r, j+1} (block j's output); a block without DWA passes its output on (w[j, 0] = 1). α is flat: the
    DWA blocks i ((i+1) % p == 0) in order, each over j = (i+1) % k, …, i+1 step k (DWAModules' weights, joined)."""
    s, big_n = self.spec, self.num_layers
    pairs = [(i, j) for i in range(big_n) if (i + 1) % s.dwa_period == 0
             for j in range((i + 1) % s.dwa_dilation, i + 2, s.dwa_dilation)]
    i_P, j_P = np.array(pairs).T
    alpha_P = _param(self, 'dwa_alpha', _const(j_P == i_P + 1), (len(pairs),), ('layers_dwa',)).astype(F32)
    sender_P, emb_P = np.maximum(j_P - 1, 0), j_P == 0
    passthrough = np.zeros((big_n, big_n))
    passthrough[[i for i in range(big_n) if (i + 1) % s.dwa_period], 0] = 1.0
    u = jnp.zeros((big_n, big_n), F32).at[0, i_P[emb_P]].set(alpha_P[emb_P])
    w = jnp.asarray(passthrough, F32).at[sender_P[~emb_P], (i_P - sender_P)[~emb_P]].set(alpha_P[~emb_P])
    return u, w


class _Site(nn.Module):
  """One residual site: `__call__(carry, fn, norm_in, chain_l) -> carry`, fn(xn, scale) = scale·F(xn)."""
  spec: StreamSpec
  features: int
  t: int  # the site's index in its layer: 0 attention, 1 MLP
  sites_per_layer: int
  param_dtype: Any = F32


class ReZeroSite(_Site):
  """eq. 1: x + α·F(x). ReZero drops the pre-norm, so norm_in is not called; α is folded into F's output."""

  @nn.compact
  def __call__(self, x_BxLxD, fn, norm_in, chain_l):
    alpha = _param(self, 'rezero_alpha', nn.initializers.zeros, (), ())
    return nn.with_logical_constraint(x_BxLxD + fn(x_BxLxD, alpha.astype(F32)), ACT)


class LayerScaleSite(_Site):
  """CaiT §2: x + diag(λ)·F(norm(x)), λ folded into F's output projection."""

  @nn.compact
  def __call__(self, x_BxLxD, fn, norm_in, chain_l):
    lam_D = _param(self, 'layerscale', _const(self.spec.layerscale_init), (self.features,), ('embed',))
    return nn.with_logical_constraint(x_BxLxD + fn(norm_in(x_BxLxD), lam_D.astype(F32)), ACT)


def _hyper_update(h_NxBxLxD, a_m_BxLxN, a_r_BxLxNxN, b_BxLxN, fn, norm_in):
  """HC eqs. 3–5 with per-token weights: h_0 = Σ_i A_m[i]·H_i, Ĥ_j = B_j·F(norm(h_0)) + Σ_i A_r[i, j]·H_i.
  mHC eq. 3 is the same with A_m = H_preᵀ, A_r = H_resᵀ, B = H_post."""
  cast = lambda a: a.astype(h_NxBxLxD.dtype)
  x_BxLxD = jnp.einsum('bln,nbld->bld', cast(a_m_BxLxN), h_NxBxLxD)
  y_BxLxD = fn(norm_in(x_BxLxD), None)  # B is per stream: it cannot fold into F's kernel
  out = (jnp.einsum('blnm,nbld->mbld', cast(a_r_BxLxNxN), h_NxBxLxD)
         + jnp.einsum('bln,bld->nbld', cast(b_BxLxN), cast(y_BxLxD)))
  return nn.with_logical_constraint(out, STREAM_ACT)


class HCSite(_Site):
  """Hyper-connections, static (eqs. 3–5) or dynamic (eqs. 10–13); A_m comes from `Chain` (chain_l[t])."""

  @nn.compact
  def __call__(self, h_NxBxLxD, fn, norm_in, chain_l):
    n, d, tokens = self.spec.expansion, self.features, h_NxBxLxD.shape[1:3]
    a_r = _param(self, 'a_r', _const(np.eye(n)), (n, n), ('stream', None)).astype(F32)
    b = _param(self, 'b', nn.initializers.ones, (n,), ('stream',)).astype(F32)
    a_m, a_r, b = (jnp.broadcast_to(a, tokens + a.shape) for a in (chain_l[self.t].astype(F32), a_r, b))
    if self.spec.hc_dynamic:
      ones, zeros = nn.initializers.ones, nn.initializers.zeros
      hbar_NxBxLxD = nn.LayerNorm(dtype=F32, param_dtype=self.param_dtype, name='norm',
                                  scale_init=nn.with_logical_partitioning(ones, ('embed',)),
                                  bias_init=nn.with_logical_partitioning(zeros, ('embed',)))(h_NxBxLxD)
      w_alpha = _param(self, 'w_alpha', zeros, (d, n + 1), ('embed', 'stream_coeff')).astype(F32)  # (W_m, W_r)
      w_beta = _param(self, 'w_beta', zeros, (d,), ('embed',)).astype(F32)
      s_alpha, s_beta = (_param(self, k, _const(0.01), (), ()).astype(F32) for k in ('s_alpha', 's_beta'))
      dyn_BxLxNxC = s_alpha * jnp.tanh(jnp.einsum('nbld,dc->blnc', hbar_NxBxLxD, w_alpha))
      a_m, a_r = a_m + dyn_BxLxNxC[..., 0], a_r + dyn_BxLxNxC[..., 1:]
      b = b + s_beta * jnp.tanh(jnp.einsum('nbld,d->bln', hbar_NxBxLxD, w_beta))
    return _hyper_update(h_NxBxLxD, a_m, a_r, b, fn, norm_in)


class MHCSite(_Site):
  """Manifold-constrained hyper-connections, eqs. 3 and 7–9; b_pre comes from `Chain` (chain_l[t])."""

  def setup(self):
    n, d = self.spec.expansion, self.features
    self.phi = _param(self, 'phi', nn.initializers.zeros, (n, d, n * n + 2 * n), ('stream', 'embed', 'stream_coeff'))
    self.alpha_3 = _param(self, 'alpha', _const(0.01), (3,), (None,))  # α_pre, α_post, α_res
    self.b_post = _param(self, 'b_post', nn.initializers.zeros, (n,), ('stream',))
    self.b_res = _param(self, 'b_res', _const(np.log((np.eye(n) + 1.0 / n) / 2)), (n, n), ('stream', None))

  def coefficients(self, h_NxBxLxD, b_pre_N):
    """(H_pre, H_post, H_res) per token, float32: (B, L, n), (B, L, n), (B, L, n, n)."""
    n, alpha_3 = self.spec.expansion, self.alpha_3.astype(F32)
    h32 = h_NxBxLxD.astype(F32)
    xn = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=(0, 3), keepdims=True) + 1e-6)  # RMSNorm(vec x_l)
    c_BxLxC = jnp.einsum('nbld,ndc->blc', xn, self.phi.astype(F32))
    pre, post, res = c_BxLxC[..., :n], c_BxLxC[..., n:2 * n], c_BxLxC[..., 2 * n:].reshape(c_BxLxC.shape[:2] + (n, n))
    return (jax.nn.sigmoid(alpha_3[0] * pre + b_pre_N.astype(F32)),
            2 * jax.nn.sigmoid(alpha_3[1] * post + self.b_post.astype(F32)),
            sinkhorn(alpha_3[2] * res + self.b_res.astype(F32), self.spec.sinkhorn_iters))

  def __call__(self, h_NxBxLxD, fn, norm_in, chain_l):
    h_pre, h_post, h_res = self.coefficients(h_NxBxLxD, chain_l[self.t])
    return _hyper_update(h_NxBxLxD, h_pre, jnp.swapaxes(h_res, -1, -2), h_post, fn, norm_in)


class DenseFormerSite(_Site):
  """x + F(norm(x)); the last site of layer j then applies DWA_j (§3) in push form: running sums S_r (block j + r's
  DWA so far); the first site adds u_j[r]·X_j (non-zero for the embedding, j = 0), the last adds w_j[r]·X_{j+1}, reads
  S_0 as Y_j and shifts the queue. All linear in S: a layer scan's backward keeps only each block's input and output
  (kept anyway), never the history X_0 … X_j per step that a pull form would (O(N²) activations)."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, chain_l):
    x_BxLxD, s_RxBxLxD = carry
    u_R, w_R = chain_l
    push = lambda s, c_R, v: s + c_R.astype(v.dtype)[:, None, None, None] * v
    if self.t == 0:
      s_RxBxLxD = push(s_RxBxLxD, u_R, x_BxLxD)
    x_BxLxD = nn.with_logical_constraint(x_BxLxD + fn(norm_in(x_BxLxD), None), ACT)
    if self.t == self.sites_per_layer - 1:
      s_RxBxLxD = push(s_RxBxLxD, w_R, x_BxLxD)
      x_BxLxD, s_RxBxLxD = s_RxBxLxD[0], jnp.pad(s_RxBxLxD[1:], ((0, 1),) + ((0, 0),) * 3)
    return nn.with_logical_constraint(x_BxLxD, ACT), nn.with_logical_constraint(s_RxBxLxD, STREAM_ACT)


SITES: dict[str, type] = {'rezero': ReZeroSite, 'layerscale': LayerScaleSite, 'hc': HCSite, 'mhc': MHCSite,
                          'denseformer': DenseFormerSite}
