"""Hyper-connections and their kin: n residual streams (or m fractions of the width) mixed at every site.

  HC        Zhu et al., arXiv 2409.19606, eqs. 3–5; dynamic, eqs. 10–13
  mHC       Xie et al., arXiv 2512.24880, eqs. 3, 7–9
  mHC-lite  arXiv 2601.05732: mHC with H_res = Σ_r a_r P_rᵀ over the n! permutation matrices, no Sinkhorn
  Frac      Zhu et al., arXiv 2503.14125: HC over m fractions of one stream
Each starts as the plain pre-norm chain up to a factor the final RMSNorm removes (docs/designs.md says how).
"""

import dataclasses
import functools
import itertools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel.config_lib import BOOL, POSITIVE_INT, field, is_int, one_of, require
from laurel.designs.protocol import (ACT, F32, STREAM_ACT, Chain, Design, Site, const, distance_from_identity,
                                     make_param, register)
from laurel.designs.mixing import mix, normed_product

V4_HC_EPS = 1e-6  # DeepSeek-V4's hc_eps
MHC_LITE_MAX_N = 5  # 5! = 120 logits per token and site; 6! = 720 would dwarf the layer's own mixing


_expansion = lambda: field(4, POSITIVE_INT)  # HC/mHC n
_hc_dynamic = lambda: field(False, BOOL)  # HC eqs. 10–13
# the streams -> one: each design's authors' (`readout`); HC §2.1's sum, then the final norm; the final norm on
# each stream, then the sum (mHC-lite's code); or DeepSeek-V4's weighted sum (`V4Readout`)
_readout = lambda: field('authors', one_of('authors', 'sum', 'norm_sum', 'v4'))


@dataclasses.dataclass(frozen=True)
class HCSpec:
  """`model.hc`."""
  expansion: int = _expansion()
  hc_dynamic: bool = _hc_dynamic()


@dataclasses.dataclass(frozen=True)
class MHCSpec:
  """`model.mhc`."""
  expansion: int = _expansion()
  sinkhorn_iters: int = field(20, POSITIVE_INT)  # t_max (eq. 9)
  mhc_readout: str = _readout()


@dataclasses.dataclass(frozen=True)
class MHCLiteSpec:
  """`model.mhc_lite`."""
  expansion: int = _expansion()
  mhc_readout: str = _readout()
  mhc_lite_init: str = field('plain', one_of('plain', 'authors'))  # mHC's plain start, or the authors' code's


@dataclasses.dataclass(frozen=True)
class FracSpec:
  """`model.frac`."""
  fractions: int = field(2, POSITIVE_INT)  # m
  hc_dynamic: bool = _hc_dynamic()


@functools.partial(jax.checkpoint, static_argnums=(1,))
def sinkhorn(logits, iters: int):
  """mHC eq. 9 over the first two axes (the n×n matrix; the tokens after, in the minor dimensions), in float32. The
  backward recomputes the iterations (as the paper's kernel, §4.3.1) instead of keeping 2·iters n×n per token. The
  iterations and the sums over n are unrolled: elementwise over the tokens, XLA fuses them into a few passes (a loop
  of reductions over a major axis took 40 launches an iteration)."""
  def normalized(m, axis):
    return m / sum(jax.lax.slice_in_dim(m, i, i + 1, axis=axis) for i in range(m.shape[axis]))

  # The shift cancels in the first normalisation: no gradient through max (whose rule divides by the tie count,
  # NaN under a layer scan when XLA recomputes the logits with other rounding).
  m = jnp.exp(logits - jax.lax.stop_gradient(logits.max(axis=(0, 1), keepdims=True)))
  for _ in range(iters):
    m = normalized(normalized(m, 0), 1)  # T_c, then T_r
  return m


class HyperChain(Chain):
  """HC's A_m (N×T×n), or mHC's b_pre stacked with a constant shift of b_post (N×T×2×n): inits that depend on the
  global site index k. The shift is 0 but for mHC-lite's authors' init (±1 tilted to stream l mod n)."""

  @nn.compact
  def __call__(self):
    s, n, shape = self.spec, self.spec.expansion, (self.num_layers, self.sites_per_layer, self.spec.expansion)
    onehot_NxTxN = np.eye(n)[np.arange(shape[0] * shape[1]).reshape(shape[:2]) % n]  # e_{k mod n}, eq. 14
    param = lambda name, value: self.make(name, const(value), shape, ('layers', 'stream_sites', 'stream')).astype(F32)
    if s.design == 'hc':
      return param('a_m', onehot_NxTxN)
    if s.design == 'mhc_lite' and s.mhc_lite_init == 'authors':
      b_pre = shift = np.broadcast_to(2 * np.eye(n)[np.arange(shape[0]) % n][:, None] - 1, shape)
    else:
      p_NxTxN = (1.0 / n + onehot_NxTxN) / 2  # σ(b_pre): sums to 1, tilted to stream k mod n
      b_pre, shift = np.log(p_NxTxN / (1 - p_NxTxN)), np.zeros(shape)
    return jnp.stack([param('b_pre', b_pre), jnp.asarray(shift, F32)], axis=-2)


def _hyper_update(h_NxBxLxD, a_m_N, a_r_NxN, b_N, fn, norm_in):
  """HC eqs. 3–5 per token: h_0 = Σ_i A_m[i]·H_i, Ĥ_j = B_j·F(norm(h_0)) + Σ_i A_r[i, j]·H_i. mHC eq. 3 is the
  same with A_m = H_preᵀ, A_r = H_resᵀ, B = H_post. The coefficients are static, or per token (n, B, L); each mix is
  one pass over the n streams (laurel.designs.mixing)."""
  tokens = h_NxBxLxD.shape[1:3]
  per_token = lambda c, axes: jnp.broadcast_to(c if c.ndim > axes else c[..., None, None], c.shape[:axes] + tokens)
  x_BxLxD, h_NxBxLxD = mix(per_token(a_m_N, 1), h_NxBxLxD, through=True)  # one sum of H's gradients
  y_BxLxD = fn(x_BxLxD, norm_in(x_BxLxD), None)  # B is per stream: it cannot fold into F's kernel
  return nn.with_logical_constraint(mix(per_token(a_r_NxN, 2), h_NxBxLxD, per_token(b_N, 1), y_BxLxD), STREAM_ACT)


def _dynamic(site, h, h_axes: str, out_axes: str, axis: str, coeffs: int):
  """HC eqs. 10–13's terms (s_α∘tanh(H̄W_α), s_β∘tanh(H̄w_β)), H̄ = LayerNorm over h's last axis (logical `axis`),
  W_α with `coeffs` columns; einsum axes `h_axes` of h, `out_axes` of W_α's columns (c), the tokens and streams
  (s_β's: the same without c)."""
  ones, zeros = nn.initializers.ones, nn.initializers.zeros
  hbar = nn.LayerNorm(dtype=F32, param_dtype=site.param_dtype, name='norm',
                      scale_init=nn.with_logical_partitioning(ones, (axis,)),
                      bias_init=nn.with_logical_partitioning(zeros, (axis,)))(h)
  w_alpha = site.make('w_alpha', zeros, (h.shape[-1], coeffs), (axis, 'stream_coeff')).astype(F32)
  w_beta = site.make('w_beta', zeros, h.shape[-1:], (axis,)).astype(F32)
  s_alpha, s_beta = (site.make(k, const(0.01), (), ()).astype(F32) for k in ('s_alpha', 's_beta'))
  w = h_axes[-1]
  return (s_alpha * jnp.tanh(jnp.einsum(f'{h_axes},{w}c->{out_axes}', hbar, w_alpha)),
          s_beta * jnp.tanh(jnp.einsum(f'{h_axes},{w}->{out_axes.replace("c", "")}', hbar, w_beta)))


class HCSite(Site):
  """HC, static (eqs. 3–5) or dynamic (eqs. 10–13); A_m from `HyperChain`."""

  @nn.compact
  def __call__(self, h_NxBxLxD, fn, norm_in, norm_out, chain_l):
    n = self.spec.expansion
    a_r = self.make('a_r', const(np.eye(n)), (n, n), ('stream', None)).astype(F32)
    b = self.make('b', nn.initializers.ones, (n,), ('stream',)).astype(F32)
    a_m = chain_l[self.t].astype(F32)
    if self.spec.hc_dynamic:
      dyn_CxNxBxL, dyn_b_NxBxL = _dynamic(self, h_NxBxLxD, 'nbld', 'cnbl', 'embed', n + 1)  # (W_m, W_r), W_β
      a_m, b = a_m[:, None, None] + dyn_CxNxBxL[0], b[:, None, None] + dyn_b_NxBxL
      a_r = a_r[..., None, None] + jnp.swapaxes(dyn_CxNxBxL[1:], 0, 1)  # W_r's column j mixes into stream j
    return _hyper_update(h_NxBxLxD, a_m, a_r, b, fn, norm_in)


class MHCSite(Site):
  """mHC, eqs. 3 and 7–9: H̃ = α·(RMSNorm(vec x_l)·φ) + b, H_pre = σ(H̃_pre), H_post = 2σ(H̃_post), H_res =
  Sinkhorn(H̃_res); b_pre from `HyperChain`."""

  def b_res_init(self):
    n = self.spec.expansion
    return np.log((np.eye(n) + 1.0 / n) / 2)

  def h_res(self, logits_RxX):
    """Sinkhorn (eq. 9) over the logits as row-major n×n: (n, n, ...)."""
    n = self.spec.expansion
    return sinkhorn(logits_RxX.reshape((n, n) + logits_RxX.shape[1:]), self.spec.sinkhorn_iters)

  def setup(self):
    n, d = self.spec.expansion, self.features
    b_res = self.b_res_init()
    self.phi = self.make('phi', nn.initializers.zeros, (n, d, 2 * n + b_res.size), ('stream', 'embed', 'stream_coeff'))
    self.alpha_3 = self.make('alpha', const(0.01), (3,), (None,))  # α_pre, α_post, α_res
    self.b_post = self.make('b_post', nn.initializers.zeros, (n,), ('stream',))
    self.b_res = self.make('b_res', const(b_res), b_res.shape, ('stream', None)[:b_res.ndim])

  def coefficients(self, h_NxBxLxD, b_pre_N, b_post_shift_N=0.0):
    """(H_pre, H_post, H_res) per token, float32, the tokens last: (n, B, L), (n, B, L), (n, n, B, L)."""
    return self.mapped(normed_product(h_NxBxLxD, self.phi), b_pre_N, b_post_shift_N)

  def mapped(self, c_CxBxL, b_pre_N, b_post_shift_N):
    """The coefficients (eq. 8) of RMSNorm(vec x_l)·φ (eq. 7; φ absorbs the norm's weight)."""
    n, alpha_3 = self.spec.expansion, self.alpha_3.astype(F32)
    pre, post, res = c_CxBxL[:n], c_CxBxL[n:2 * n], c_CxBxL[2 * n:]
    bias = lambda b: jnp.asarray(b, F32).reshape(-1, 1, 1)
    return (jax.nn.sigmoid(alpha_3[0] * pre + bias(b_pre_N)),
            2 * jax.nn.sigmoid(alpha_3[1] * post + bias(self.b_post) + bias(b_post_shift_N)),
            self.h_res(alpha_3[2] * res + bias(self.b_res)))

  def __call__(self, h_NxBxLxD, fn, norm_in, norm_out, chain_l):
    b_pre, b_post_shift = chain_l[self.t]
    c_CxBxL, h_NxBxLxD = normed_product(h_NxBxLxD, self.phi, through=True)
    h_pre, h_post, h_res = self.mapped(c_CxBxL, b_pre, b_post_shift)
    return _hyper_update(h_NxBxLxD, h_pre, jnp.swapaxes(h_res, 0, 1), h_post, fn, norm_in)


def permutations(n: int) -> np.ndarray:
  """The n! permutation matrices P_r = I[σ_r] (itertools order, the identity first), P_r[i, σ_r(i)] = 1: (n!, n, n)."""
  return np.stack([np.eye(n)[list(p)] for p in itertools.permutations(range(n))])


class MHCLiteSite(MHCSite):
  """mHC-lite: H_res = Σ_r a_r P_rᵀ, a = softmax(logits). b_res starts H_res at mHC's (I + 11ᵀ/n)/2 exactly;
  `mhc_lite_init='authors'`: their code's b_res = (0, −8, …)."""

  def b_res_init(self):
    k = math.factorial(self.spec.expansion)
    if self.spec.mhc_lite_init == 'authors':
      return np.where(np.arange(k) == 0, 0.0, -8.0)
    return np.log(np.full(k, 0.5 / k) + np.eye(k)[0] / 2)  # over the permutations: logical axis 'stream'

  def h_res(self, logits_RxX):
    return lite_h_res(logits_RxX, self.spec.expansion)


def lite_h_res(logits_RxX, n: int):
  """mHC-lite's H_res = Σ_r a_r P_rᵀ, a = softmax(logits) over the n! permutations (the first axis): (n, n, ...)."""
  return jnp.einsum('r...,rji->ij...', jax.nn.softmax(logits_RxX, axis=0), jnp.asarray(permutations(n), F32))


class V4Readout(nn.Module):
  """DeepSeek-V4's read-out (`hc_head`): Σ_k w_k X_k, w = σ(s·(RMSNorm(vec X)·φ_head) + b) + ε."""
  spec: Any
  features: int
  param_dtype: Any = F32
  make = make_param

  @nn.compact
  def __call__(self, h_NxBxLxD):
    n, d = self.spec.expansion, self.features
    phi = self.make('readout_phi', nn.initializers.zeros, (n, d, n), ('stream', 'embed', 'stream_coeff'))
    b = self.make('readout_b', nn.initializers.zeros, (n,), ('stream',))
    s = self.make('readout_scale', const(0.01), (), ())
    w_NxBxL = jax.nn.sigmoid(s * normed_product(h_NxBxLxD, phi) + b[:, None, None]) + V4_HC_EPS
    return mix(w_NxBxL, h_NxBxLxD)


class FracSite(Site):
  """Frac-Connections over H = split(x) (m × D/m): x_in = merge(ΓᵀH), H' = diag(β)·split(F(norm(x_in))) + AᵀH;
  dynamic as HC eqs. 10–13 per fraction."""

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
      dyn_BxLxMxC, dyn_beta_BxLxM = _dynamic(self, h_BxLxMxW, 'blfw', 'blfc', 'frac_width', 2 * m)  # (W_Γ, W_A), w_β
      gamma, a, beta = gamma + dyn_BxLxMxC[..., :m], a + dyn_BxLxMxC[..., m:], beta + dyn_beta_BxLxM
    x_in = jnp.einsum('blfg,blfw->blgw', cast(gamma), h_BxLxMxW).reshape(x_BxLxD.shape)
    # A static β folds into F's last kernel (a D-vector); a per-token one multiplies F's output.
    y_BxLxD = fn(x_in, norm_in(x_in), None if self.spec.hc_dynamic else jnp.repeat(beta, d // m))
    if self.spec.hc_dynamic:
      y_BxLxD = (cast(beta)[..., None] * y_BxLxD.reshape(h_BxLxMxW.shape)).reshape(x_BxLxD.shape)
    out = jnp.einsum('blfg,blfw->blgw', cast(a), h_BxLxMxW).reshape(x_BxLxD.shape) + y_BxLxD
    return nn.with_logical_constraint(out, ACT)


def _check_mhc(spec, prefix, num_layers, width, sites):
  require(spec.expansion >= 2, f'{prefix}.expansion', spec.expansion, f"must be >= 2 for design '{spec.design}' "
          '(σ(b_pre) < 1 cannot start as the plain residual with one stream)')
  require(spec.design != 'mhc_lite' or spec.expansion <= MHC_LITE_MAX_N, f'{prefix}.expansion', spec.expansion,
          f"must be <= {MHC_LITE_MAX_N} for design 'mhc_lite': it mixes all n! permutations "
          f'({math.factorial(spec.expansion) if is_int(spec.expansion) else "?"} logits per token and site)')


def _check_frac(spec, prefix, num_layers, width, sites):
  require(spec.fractions >= 2, f'{prefix}.fractions', spec.fractions,
          "must be >= 2 for design 'frac' (one fraction is the plain residual)")
  require(width % spec.fractions == 0, f'{prefix}.fractions', spec.fractions, f'must divide d_model={width}')


def readout(spec) -> str:
  """`mhc_readout`, 'authors' resolved: mHC's sum (HC §2.1), mHC-lite's code's norm_sum."""
  if spec.mhc_readout == 'authors':
    return 'norm_sum' if spec.design == 'mhc_lite' else 'sum'
  return spec.mhc_readout


def _sum_streams(spec, h_NxBxLxD):
  """HC §2.1's read-out, the sum of the streams."""
  return h_NxBxLxD.sum(axis=0, dtype=F32).astype(h_NxBxLxD.dtype)


def _finish(spec, h_NxBxLxD):
  if readout(spec) == 'v4':
    return V4Readout(spec, h_NxBxLxD.shape[-1], name='stream_readout')(h_NxBxLxD)
  return _sum_streams(spec, h_NxBxLxD)  # with 'norm_sum' each stream is final-normed already


def _hc_diagnostics(spec, chain, sites) -> dict:
  """Per site, ‖A_r − I‖_F: how far HC's static mixing of the streams is from keeping them apart (0 at init)."""
  return {'mixing': distance_from_identity(sites['a_r'])}


def _mhc_diagnostics(spec, chain, sites) -> dict:
  """Per site, ‖H_res − I‖_F of H_res's static part (b_res alone, the input's term left out)."""
  b_res = sites['b_res'].astype(F32)  # the sites first; H_res's axes first in lite_h_res and sinkhorn
  if spec.design == 'mhc_lite':
    h_res = lite_h_res(jnp.moveaxis(b_res, -1, 0), spec.expansion)
  else:
    h_res = sinkhorn(jnp.moveaxis(b_res, (-2, -1), (0, 1)), spec.sinkhorn_iters)
  return {'mixing': distance_from_identity(jnp.moveaxis(h_res, (0, 1), (-2, -1)))}


def _frac_diagnostics(spec, chain, sites) -> dict:
  """Per site, ‖A − I‖_F and ‖Γ − I‖_F of the static mixings of the fractions (0 at init)."""
  return {'mixing': distance_from_identity(sites['frac_a']),
          'input_mixing': distance_from_identity(sites['frac_gamma'])}


_AXES = (('stream', None), ('stream_sites', None), ('stream_coeff', None))
_HYPER = dict(chain=HyperChain, logical_axes=_AXES,
              start=lambda spec, x, num_layers: nn.with_logical_constraint(
                  jnp.broadcast_to(x, (spec.expansion,) + x.shape), STREAM_ACT))
_MHC = dict(check=_check_mhc, finish=_finish, norm_first=lambda spec: readout(spec) == 'norm_sum',
            diagnostics=_mhc_diagnostics,
            no_decay=('b_pre', 'b_post', 'b_res', 'alpha', 'readout_b', 'readout_scale'), **_HYPER)
register(Design('hc', HCSite, config=HCSpec, no_decay=('a_m', 'a_r', 'b', 's_alpha', 's_beta'), finish=_sum_streams,
                diagnostics=_hc_diagnostics, **_HYPER),
         Design('mhc', MHCSite, config=MHCSpec, **_MHC),
         Design('mhc_lite', MHCLiteSite, config=MHCLiteSpec, **_MHC),
         Design('frac', FracSite, config=FracSpec, check=_check_frac,
                no_decay=('frac_gamma', 'frac_a', 'frac_beta', 's_alpha', 's_beta'),
                logical_axes=_AXES + (('frac_width', None),), diagnostics=_frac_diagnostics))
