"""Hyper-connections: n residual streams mixed at every site; equation numbers are each paper's.

  HC           h_0ᵀ = A_mᵀH, H' = A_rᵀH, Ĥ = Bᵀ(F h_0)ᵀ + H'           Zhu et al., arXiv 2409.19606, eqs. 3–5
    dynamic    H̄ = norm(H); B(H) = s_β∘tanh(H̄W_β)ᵀ + B,                eqs. 10–13
               A_m(H) = s_α∘tanh(H̄W_m) + A_m, A_r(H) = s_α∘tanh(H̄W_r) + A_r
  mHC          x_{l+1} = H_res·x_l + H_postᵀ·F(H_pre·x_l)               Xie et al., arXiv 2512.24880, eq. 3
               H̃ = α·(RMSNorm(vec x_l)·φ) + b (pre, post, res)          eq. 7
               H_pre = σ(H̃_pre), H_post = 2σ(H̃_post), H_res = SK(H̃_res) eq. 8
               SK: M⁽⁰⁾ = exp(H̃_res), M⁽ᵗ⁾ = T_r(T_c(M⁽ᵗ⁻¹⁾)), t_max = sinkhorn_iters   eq. 9
    read-out   'sum' (the paper's, HC §2.1): Σ_k X_k, then the final norm. 'v4' (`mhc_readout`): DeepSeek-V4's
               hc_head before the final norm, Σ_k (σ(s·(RMSNorm(vec X)·φ_head)_k + b_k) + ε)·X_k (`V4Readout`). V4's
               other changes are not here: ε added to H_pre and H_post, Sinkhorn from softmax + ε, projections
               ordered (pre, post, comb). 'norm_sum': Σ_k norm(X_k), the final norm on each stream (mHC-lite's).
  mHC-lite     H_res = Σ_{r=1}^{n!} a_r P_rᵀ, a = softmax(α_res·(x̂φ_res) + b_res), P_r = I[σ_r] the permutation
               matrices in itertools order: exactly doubly stochastic, no Sinkhorn   arXiv 2601.05732
               (reference code: FFTYYY/mhc-lite, hyper_conn/mhc_lite.py, whose mix of the streams by Σ_r a_r P_r
               reads as H_res = Σ_r a_r P_rᵀ here); the rest as mHC. Its read-out (the code's model.py): the final
               norm on each stream, then their sum ('norm_sum', the default `mhc_readout='authors'` for mhc_lite)
  Frac         H = split(x) into m fractions of D/m; x_in = merge(ΓᵀH),   Zhu et al., arXiv 2503.14125
               H' = diag(β)·split(F(norm(x_in))) + AᵀH; dynamic: HC eqs. 10–13 per fraction. Carried as x (B, L, D):
               no stream copies.

Initialisation, against the pre-norm chain x + F(norm(x)):
  * HC, eq. 14: A_m = e_{k mod n} (k the global site index; in `HyperChain`), A_r = I, B = 1, W = 0; s_α = s_β = 0.01
    and norm = LayerNorm per stream (Algorithm 2). H⁰ is n copies of the embedding, the readout sums the streams
    (§2.1): n·(plain chain), a factor the final RMSNorm removes.
  * mHC: α = 0.01 (Table 5); the paper leaves φ and b open. φ = 0, H_post = 2σ(0) = 1, H_pre = (1/n + e_{k mod n})/2
    (b_pre in `HyperChain`), H_res = (I + 11ᵀ/n)/2: the streams stay equal and the (HC) readout is n·(plain chain) up
    to rounding. Not H_pre = 1/n: with equal streams and φ = 0 every stream would get the same gradient and never
    part; the tilt to stream k mod n breaks that, as HC's A_m does. H_res only half-way to HC's A_r = I, where the
    Sinkhorn gradient would vanish. Needs n ≥ 2. The RMSNorm weight is absorbed into φ, as in the paper's kernel
    (§4.3.1). V4's read-out at φ_head = 0, b = 0 weighs each stream ½ + ε: (½ + ε)·n·(plain chain).
  * mHC-lite: mHC's, with H_res at exactly mHC's (I + 11ᵀ/n)/2, reached as a = ½e_I + ½/n!; its read-out of n
    equal streams normed, then summed, is n·(the plain model's final-normed stream). The authors' code starts
    elsewhere (b_res = (0, −8, …), H_res ≈ 0.99·I; b_pre, b_post ±1 tilted to stream l mod n), which does not
    start as the plain chain: `mhc_lite_init='authors'` offers it. n ≤ 5: n! logits per token and site.
  * Frac: Γ = A = I, β = 1, W = 0: exactly the plain chain. Needs m ≥ 2 dividing D.
The streams are carried stream-leading, h_NxBxLxD, logical axes (None, 'act_batch', 'act_len', 'act_embed').
"""

import functools
import itertools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel.config_lib import is_int, require
from laurel.designs import ACT, F32, STREAM_ACT, Chain, Design, Site, const, register

V4_HC_EPS = 1e-6  # DeepSeek-V4's hc_eps
MHC_LITE_MAX_N = 5  # 5! = 120 logits per token and site; 6! = 720 would dwarf the layer's own mixing


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


class HyperChain(Chain):
  """HC's A_m (N×T×n), or mHC's b_pre stacked with a constant shift of b_post (N×T×2×n): inits that depend on the
  global site index k. The shift is 0 but for mHC-lite's authors' init, where b_pre and the shift are ±1 tilted to
  stream l mod n, l the layer: b_post = 0 + shift trains as b_post initialised at the shift would (no weight
  decay)."""

  @nn.compact
  def __call__(self):
    s, n, shape = self.spec, self.spec.expansion, (self.num_layers, self.sites_per_layer, self.spec.expansion)
    onehot_NxTxN = np.eye(n)[np.arange(shape[0] * shape[1]).reshape(shape[:2]) % n]  # e_{k mod n}, eq. 14
    make = lambda name, value: self.param(name, nn.with_logical_partitioning(
        const(value), ('layers', 'stream_sites', 'stream')), shape, self.param_dtype).astype(F32)
    if s.design == 'hc':
      return make('a_m', onehot_NxTxN)
    if s.design == 'mhc_lite' and s.mhc_lite_init == 'authors':
      b_pre = shift = np.broadcast_to(2 * np.eye(n)[np.arange(shape[0]) % n][:, None] - 1, shape)
    else:
      p_NxTxN = (1.0 / n + onehot_NxTxN) / 2  # σ(b_pre): sums to 1, tilted to stream k mod n
      b_pre, shift = np.log(p_NxTxN / (1 - p_NxTxN)), np.zeros(shape)
    return jnp.stack([make('b_pre', b_pre), jnp.asarray(shift, F32)], axis=-2)


def _flat_rms(h_NxBxLxD):
  """RMSNorm(vec x_l) over the flattened n·D, unweighted (mHC eq. 7 absorbs the weight into φ), float32."""
  h32 = h_NxBxLxD.astype(F32)
  return h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=(0, 3), keepdims=True) + 1e-6)


def _hyper_update(h_NxBxLxD, a_m_BxLxN, a_r_BxLxNxN, b_BxLxN, fn, norm_in):
  """HC eqs. 3–5 with per-token weights: h_0 = Σ_i A_m[i]·H_i, Ĥ_j = B_j·F(norm(h_0)) + Σ_i A_r[i, j]·H_i.
  mHC eq. 3 is the same with A_m = H_preᵀ, A_r = H_resᵀ, B = H_post."""
  cast = lambda a: a.astype(h_NxBxLxD.dtype)
  x_BxLxD = jnp.einsum('bln,nbld->bld', cast(a_m_BxLxN), h_NxBxLxD)
  y_BxLxD = fn(x_BxLxD, norm_in(x_BxLxD), None)  # B is per stream: it cannot fold into F's kernel
  out = (jnp.einsum('blnm,nbld->mbld', cast(a_r_BxLxNxN), h_NxBxLxD)
         + jnp.einsum('bln,bld->nbld', cast(b_BxLxN), cast(y_BxLxD)))
  return nn.with_logical_constraint(out, STREAM_ACT)


class HCSite(Site):
  """Hyper-connections, static (eqs. 3–5) or dynamic (eqs. 10–13); A_m comes from `HyperChain` (chain_l[t])."""

  @nn.compact
  def __call__(self, h_NxBxLxD, fn, norm_in, norm_out, chain_l):
    n, d, tokens = self.spec.expansion, self.features, h_NxBxLxD.shape[1:3]
    a_r = self.make('a_r', const(np.eye(n)), (n, n), ('stream', None)).astype(F32)
    b = self.make('b', nn.initializers.ones, (n,), ('stream',)).astype(F32)
    a_m, a_r, b = (jnp.broadcast_to(a, tokens + a.shape) for a in (chain_l[self.t].astype(F32), a_r, b))
    if self.spec.hc_dynamic:
      ones, zeros = nn.initializers.ones, nn.initializers.zeros
      hbar_NxBxLxD = nn.LayerNorm(dtype=F32, param_dtype=self.param_dtype, name='norm',
                                  scale_init=nn.with_logical_partitioning(ones, ('embed',)),
                                  bias_init=nn.with_logical_partitioning(zeros, ('embed',)))(h_NxBxLxD)
      w_alpha = self.make('w_alpha', zeros, (d, n + 1), ('embed', 'stream_coeff')).astype(F32)  # (W_m, W_r)
      w_beta = self.make('w_beta', zeros, (d,), ('embed',)).astype(F32)
      s_alpha, s_beta = (self.make(k, const(0.01), (), ()).astype(F32) for k in ('s_alpha', 's_beta'))
      dyn_BxLxNxC = s_alpha * jnp.tanh(jnp.einsum('nbld,dc->blnc', hbar_NxBxLxD, w_alpha))
      a_m, a_r = a_m + dyn_BxLxNxC[..., 0], a_r + dyn_BxLxNxC[..., 1:]
      b = b + s_beta * jnp.tanh(jnp.einsum('nbld,d->bln', hbar_NxBxLxD, w_beta))
    return _hyper_update(h_NxBxLxD, a_m, a_r, b, fn, norm_in)


class MHCSite(Site):
  """Manifold-constrained hyper-connections, eqs. 3 and 7–9; b_pre comes from `HyperChain` (chain_l[t])."""

  def res_logits(self) -> int:
    return self.spec.expansion ** 2

  def b_res_init(self):
    n = self.spec.expansion
    return np.log((np.eye(n) + 1.0 / n) / 2)

  def h_res(self, logits_BxLxR):
    """H_res per token from its logits: Sinkhorn (eq. 9) over mat(logits), row-major n×n."""
    n = self.spec.expansion
    return sinkhorn(logits_BxLxR.reshape(logits_BxLxR.shape[:-1] + (n, n)), self.spec.sinkhorn_iters)

  def setup(self):
    n, d = self.spec.expansion, self.features
    self.phi = self.make('phi', nn.initializers.zeros, (n, d, self.res_logits() + 2 * n),
                         ('stream', 'embed', 'stream_coeff'))
    self.alpha_3 = self.make('alpha', const(0.01), (3,), (None,))  # α_pre, α_post, α_res
    self.b_post = self.make('b_post', nn.initializers.zeros, (n,), ('stream',))
    b_res = self.b_res_init()
    self.b_res = self.make('b_res', const(b_res), b_res.shape, ('stream', None)[:b_res.ndim])

  def coefficients(self, h_NxBxLxD, b_pre_N, b_post_shift_N=0.0):
    """(H_pre, H_post, H_res) per token, float32: (B, L, n), (B, L, n), (B, L, n, n)."""
    n, alpha_3 = self.spec.expansion, self.alpha_3.astype(F32)
    c_BxLxC = jnp.einsum('nbld,ndc->blc', _flat_rms(h_NxBxLxD), self.phi.astype(F32))
    pre, post, res = c_BxLxC[..., :n], c_BxLxC[..., n:2 * n], c_BxLxC[..., 2 * n:]
    return (jax.nn.sigmoid(alpha_3[0] * pre + b_pre_N.astype(F32)),
            2 * jax.nn.sigmoid(alpha_3[1] * post + self.b_post.astype(F32) + b_post_shift_N),
            self.h_res(alpha_3[2] * res + self.b_res.astype(F32).reshape(-1)))

  def __call__(self, h_NxBxLxD, fn, norm_in, norm_out, chain_l):
    b_pre, b_post_shift = chain_l[self.t]  # HyperChain
    h_pre, h_post, h_res = self.coefficients(h_NxBxLxD, b_pre, b_post_shift)
    return _hyper_update(h_NxBxLxD, h_pre, jnp.swapaxes(h_res, -1, -2), h_post, fn, norm_in)


def permutations(n: int) -> np.ndarray:
  """The n! permutation matrices P_r = I[σ_r] (itertools order, the identity first), P_r[i, σ_r(i)] = 1: (n!, n, n)."""
  return np.stack([np.eye(n)[list(p)] for p in itertools.permutations(range(n))])


class MHCLiteSite(MHCSite):
  """mHC-lite: mHC with H_res = Σ_r a_r P_rᵀ over the n! permutation matrices, a = softmax(α_res·x̂φ_res + b_res)
  (exactly doubly stochastic, no Sinkhorn): the authors' labels, a_r on P_r = I[σ_r] moves stream i to σ_r(i).
  b_res starts H_res at mHC's (I + 11ᵀ/n)/2 exactly: J/n is the mean of all n! permutations, so a_I = ½ + ½/n!,
  a_{k≠I} = ½/n!. `mhc_lite_init='authors'`: their code's start, b_res = (0, −8, …) on (I, the others):
  H_res ≈ 0.99·I at n = 4, and ±1 tilts of b_pre, b_post (HyperChain)."""

  def res_logits(self) -> int:
    return math.factorial(self.spec.expansion)

  def b_res_init(self):
    k = self.res_logits()
    if self.spec.mhc_lite_init == 'authors':
      return np.where(np.arange(k) == 0, 0.0, -8.0)
    return np.log(np.full(k, 0.5 / k) + np.eye(k)[0] / 2)  # over the permutations: logical axis 'stream'

  def h_res(self, logits_BxLxR):
    return jnp.einsum('...r,rji->...ij', jax.nn.softmax(logits_BxLxR, axis=-1),
                      jnp.asarray(permutations(self.spec.expansion), F32))


class V4Readout(nn.Module):
  """DeepSeek-V4's read-out of the n streams before the final norm (its `hc_head`): Σ_k w_k X_k with
  w = σ(s·(RMSNorm(vec X)·φ_head) + b) + ε, ε = hc_eps = 1e-6, the RMSNorm unweighted. φ_head = 0, b = 0 and
  s = 0.01 (mHC's α, Table 5) at init: w = ½ + ε, (½ + ε)·(the streams' sum), which the final RMSNorm removes."""
  spec: Any
  features: int

  @nn.compact
  def __call__(self, h_NxBxLxD):
    n, d = self.spec.expansion, self.features
    param = lambda name, init, shape, names: self.param(
        name, nn.with_logical_partitioning(init, names), shape, F32)
    phi = param('readout_phi', nn.initializers.zeros, (n, d, n), ('stream', 'embed', 'stream_coeff'))
    b = param('readout_b', nn.initializers.zeros, (n,), ('stream',))
    s = param('readout_scale', const(0.01), (), ())
    w_BxLxN = jax.nn.sigmoid(s * jnp.einsum('nbld,ndk->blk', _flat_rms(h_NxBxLxD), phi) + b) + V4_HC_EPS
    return jnp.einsum('bln,nbld->bld', w_BxLxN.astype(h_NxBxLxD.dtype), h_NxBxLxD)


class FracSite(Site):
  """Frac-Connections: hyper-connections over m fractions of the width, H = split(x) (m × D/m), carried as x itself.
  x_in = merge(ΓᵀH), H' = diag(β)·split(F(norm(x_in))) + AᵀH; dynamic (`hc_dynamic`) as HC eqs. 10–13 per fraction,
  H̄ = LayerNorm over each fraction's D/m: Γ(H) = Γ + s_α∘tanh(H̄W_Γ), A(H) = A + s_α∘tanh(H̄W_A),
  β(H) = β + s_β∘tanh(H̄w_β). Γ = A = I, β = 1, W = 0 at init: exactly the plain residual."""

  @nn.compact
  def __call__(self, x_BxLxD, fn, norm_in, norm_out, chain_l):
    m, d = self.spec.fractions, self.features
    h_BxLxMxW = x_BxLxD.reshape(x_BxLxD.shape[:-1] + (m, d // m))
    eye = const(np.eye(m))
    gamma = self.make('frac_gamma', eye, (m, m), ('stream', None)).astype(F32)  # fractions -> the layer's input
    a = self.make('frac_a', eye, (m, m), ('stream', None)).astype(F32)  # fractions -> the carried fractions
    beta = self.make('frac_beta', nn.initializers.ones, (m,), ('stream',)).astype(F32)
    cast = lambda c: c.astype(x_BxLxD.dtype)
    # Per token, as HC's: a token-batched einsum is no dot that `dots_no_batch` remat would save (3 D-wide a layer).
    gamma, a = (jnp.broadcast_to(c, x_BxLxD.shape[:-1] + c.shape) for c in (gamma, a))
    if self.spec.hc_dynamic:
      ones, zeros = nn.initializers.ones, nn.initializers.zeros
      hbar_BxLxMxW = nn.LayerNorm(dtype=F32, param_dtype=self.param_dtype, name='norm',
                                  scale_init=nn.with_logical_partitioning(ones, ('frac_width',)),
                                  bias_init=nn.with_logical_partitioning(zeros, ('frac_width',)))(h_BxLxMxW)
      w_alpha = self.make('w_alpha', zeros, (d // m, 2 * m), ('frac_width', 'stream_coeff')).astype(F32)  # W_Γ, W_A
      w_beta = self.make('w_beta', zeros, (d // m,), ('frac_width',)).astype(F32)
      s_alpha, s_beta = (self.make(k, const(0.01), (), ()).astype(F32) for k in ('s_alpha', 's_beta'))
      dyn_BxLxMxC = s_alpha * jnp.tanh(jnp.einsum('blfw,wc->blfc', hbar_BxLxMxW, w_alpha))
      gamma, a = gamma + dyn_BxLxMxC[..., :m], a + dyn_BxLxMxC[..., m:]
      beta = beta + s_beta * jnp.tanh(jnp.einsum('blfw,w->blf', hbar_BxLxMxW, w_beta))
    x_in = jnp.einsum('blfg,blfw->blgw', cast(gamma), h_BxLxMxW).reshape(x_BxLxD.shape)
    # A static β folds into F's last kernel (a D-vector); a per-token one multiplies F's output.
    y_BxLxD = fn(x_in, norm_in(x_in), None if self.spec.hc_dynamic else jnp.repeat(beta, d // m))
    if self.spec.hc_dynamic:
      y_BxLxD = (cast(beta)[..., None] * y_BxLxD.reshape(h_BxLxMxW.shape)).reshape(x_BxLxD.shape)
    out = jnp.einsum('blfg,blfw->blgw', cast(a), h_BxLxMxW).reshape(x_BxLxD.shape) + y_BxLxD
    return nn.with_logical_constraint(out, ACT)


def _check_mhc(spec, num_layers, prefix):
  require(spec.expansion >= 2, f'{prefix}.expansion', spec.expansion,
          f"must be >= 2 for design '{spec.design}' (σ(b_pre) < 1 cannot start as the plain residual with one "
          'stream)')
  require(spec.design != 'mhc_lite' or spec.expansion <= MHC_LITE_MAX_N, f'{prefix}.expansion', spec.expansion,
          f"must be <= {MHC_LITE_MAX_N} for design 'mhc_lite': it mixes all n! permutations "
          f'({math.factorial(spec.expansion) if is_int(spec.expansion) else "?"} logits per token and site)')


def _check_frac(spec, d_model, prefix):
  require(spec.fractions >= 2, f'{prefix}.fractions', spec.fractions,
          "must be >= 2 for design 'frac' (one fraction is the plain residual)")
  require(d_model % spec.fractions == 0, f'{prefix}.fractions', spec.fractions, f'must divide d_model={d_model}')


def readout(spec) -> str:
  """`mhc_readout`, 'authors' resolved: mHC's sum (HC §2.1), mHC-lite's code's norm_sum."""
  if spec.mhc_readout == 'authors':
    return 'norm_sum' if spec.design == 'mhc_lite' else 'sum'
  return spec.mhc_readout


def _finish(spec, h_NxBxLxD):
  """HC §2.1's read-out, the sum of the streams (mHC's; with 'norm_sum' each stream already final-normed, mHC-lite's),
  or DeepSeek-V4's weighted one (`mhc_readout='v4'`)."""
  if readout(spec) == 'v4':
    return V4Readout(spec, h_NxBxLxD.shape[-1], name='stream_readout')(h_NxBxLxD)
  return h_NxBxLxD.sum(axis=0, dtype=F32).astype(h_NxBxLxD.dtype)


_norm_first = lambda spec: readout(spec) == 'norm_sum'
_AXES = (('stream', None), ('stream_sites', None), ('stream_coeff', None))
_HYPER = dict(chain=HyperChain, logical_axes=_AXES,
              start=lambda spec, x, num_layers: nn.with_logical_constraint(
                  jnp.broadcast_to(x, (spec.expansion,) + x.shape), STREAM_ACT))
_MHC_NO_DECAY = ('b_pre', 'b_post', 'b_res', 'alpha', 'readout_b', 'readout_scale')
register(Design('hc', HCSite, fields=('expansion', 'hc_dynamic'), no_decay=('a_m', 'a_r', 'b', 's_alpha', 's_beta'),
                finish=lambda spec, h: h.sum(axis=0, dtype=F32).astype(h.dtype), **_HYPER),  # HC §2.1
         Design('mhc', MHCSite, fields=('expansion', 'sinkhorn_iters', 'mhc_readout'), check=_check_mhc,
                finish=_finish, norm_first=_norm_first, no_decay=_MHC_NO_DECAY, **_HYPER),
         Design('mhc_lite', MHCLiteSite, fields=('expansion', 'mhc_readout', 'mhc_lite_init'), check=_check_mhc,
                finish=_finish, norm_first=_norm_first, no_decay=_MHC_NO_DECAY, **_HYPER),
         Design('frac', FracSite, fields=('fractions', 'hc_dynamic'), check_width=_check_frac,
                no_decay=('frac_gamma', 'frac_a', 'frac_beta', 's_alpha', 's_beta'),
                logical_axes=_AXES + (('frac_width', None),)))
