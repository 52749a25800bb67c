"""NumPy references of every residual design, written from the papers, not from laurel/designs, and the registry
of what each design is tested against (`REFERENCES`: cases, its chain in float64, its init claim).

  residual     x + f(x) (arXiv 1512.03385; LAuReL's eq. 1)
  LAuReL       arXiv 2411.07501, §2, eqs. 2–6, and Gemma 3n's LAuReL block
  ReZero       eq. 1 (arXiv 2003.04887); LayerScale: CaiT §2 (2103.17239)
  HC           eqs. 3–5, 10–14 and Algorithm 2 (2409.19606); mHC: eqs. 3, 7–9 (2512.24880), DeepSeek-V4's read-out
  mHC-lite     2601.05732 and the authors' code (FFTYYY/mhc-lite, hyper_conn/mhc_lite.py and model.py): the streams
               mixed by a softmax-weighted sum of the n! matrices I[σ_r] as the code applies it, the final norm on
               each stream before their sum; the authors' init: b_res = (0, −8, …), b_pre and b_post ±1 tilted to
               stream l mod n
  Frac         2503.14125: HC over m fractions of the width (the dynamic form as HC eqs. 10–13)
  DenseFormer  §3, §3.2–3.3 (2402.02622), the pull form of epfml/DenseFormer's DWAModules
  AttnRes      §3 (2603.15031), Full and Block, the pull form: every source kept, one softmax per site (per head);
               delta: 2605.18855; heads: 2607.27230 (one softmax per group of D/H channels, each its own RMSNorm)
  MUDDFormer   2502.12170 and the authors' pytorch/muddformer/modeling_muddformer.py: dynamic dense weights
               per stream (Q, K, V, R) from the layer's output, over every earlier layer's output
  DCA          2502.06785, §3.1 (GRN-v3), §3.2 and Fig. 4 (the block: u^Q the FFN's skip), §4.1 (a GRN as the
               read-out): per-dimension, input-dependent sums of every earlier block output as q, k, v inputs;
               k-DCA (§3.1): the stack [y_0, Σ_{1≤j≤i−k} y_j, y_{i−k+1}, …, y_i]
A chain is tests/design_chain.py's: LAYERS layers × T sites, site (l, t) with F = tanh(norm(x) W_{l,t}).
"""

import dataclasses
import itertools
import math
from typing import Callable

import flax.linen as nn
import jax
import numpy as np

from design_chain import BATCH, D, EPS, LAYERS, LEN, T, plain
from laurel.designs import StreamSpec
from laurel.designs.laurel import LaurelSpec



def np_softmax(w, axis=0):
  e = np.exp(w - w.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def np_sigmoid(w):
  return 1.0 / (1.0 + np.exp(-w))


def np_rms(x):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def np_rmsnorm(y, scale, eps=1e-6):
  # flax.linen.RMSNorm: y * rsqrt(mean(y², -1) + epsilon) * scale, epsilon = 1e-6 by default.
  return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps) * scale


def np_rw(spec, w):
  """§2.1: (α, β) = rw_scale·softmax(w), or rw_scale·(σ(w), σ(−w)) for one parameter."""
  w = np.asarray(w, np.float64)
  if spec.rw_norm == 'softmax':
    ab = spec.rw_scale * np_softmax(w, axis=0)
    return ab[0], ab[1]
  return spec.rw_scale * np_sigmoid(w), spec.rw_scale * np_sigmoid(-w)


def np_reference(spec, params, fx, x, history, xn):
  """x_{i+1} = α·f(x_i) + g(x_i, …, x_{i−k+1}) evaluated in float64, one equation at a time."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(params))
  fx, x, xn = (np.asarray(a, np.float64) for a in (fx, x, xn))
  xs = [x] + [np.asarray(h, np.float64) for h in history]  # xs[j] = x_{i-j}
  comps = set(spec.variant.split('+'))

  # §2.1: α, β = rw_scale·softmax(w) or rw_scale·σ(w), rw_scale·σ(−w); §2.4: D-vectors if per-dim.
  alpha, beta = np_rw(spec, p['rw_w']) if 'rw' in comps else (1.0, 1.0)

  if spec.form == 'gemma3n':  # Gemma 3n: (α f + β (x + xn + RMSNorm(xn A B))) / √2
    low_rank = xn @ p['lr_a'] @ p['lr_b']
    inner = x + xn + np_rmsnorm(low_rank, p['lr_norm']['scale'])
    return (alpha * fx + beta * inner) / math.sqrt(2.0)

  inner = x.copy()
  if 'lr' in comps and 'pa' not in comps:  # eq. 3 (β = 1) and eq. 5: x + B A x, i.e. x + x @ A @ B
    inner = inner + x @ p['lr_a'] @ p['lr_b']
  if 'pa' in comps:  # eq. 4: x_i + Σ_j γ_j h(x_{i−j}); eq. 6: h_j = A_j B_j
    gamma = p['pa_gamma']
    for j in range(spec.k):
      if 'lr' in comps:
        h = xs[j] @ p['pa_a'][j] @ p['pa_b'][j]
      elif spec.pa_h == 'low_rank':
        h = xs[j] @ p['pa_a'] @ p['pa_b']
      else:
        h = xs[j]
      inner = inner + gamma[j] * h
  return alpha * fx + beta * inner


def pull_params(spec, sent_params, i):
  """The paper's (receiver-indexed) params of site i, from the push form's sender-indexed ones.

  `sent_params[s]` are site s's params, where γ_j, A_j, B_j belong to the term site s sends to site s + j
  (LaurelSite.residual). Terms from before the first site do not exist: their γ is 0.
  """
  p = dict(jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(sent_params[i])))
  if not spec.pa:
    return p
  sender = lambda j: jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(sent_params[i - j]))
  p['pa_gamma'] = np.array([sender(j)['pa_gamma'][j] if i >= j else 0.0 for j in range(spec.k)])
  if spec.lr:  # eq. 6: the pair (A_j, B_j) of the term x_{i−j} → x_{i+1}
    p['pa_a'] = np.stack([sender(j)['pa_a'][j] if i >= j else 0 * p['pa_a'][j] for j in range(spec.k)])
    p['pa_b'] = np.stack([sender(j)['pa_b'][j] if i >= j else 0 * p['pa_b'][j] for j in range(spec.k)])
  return p


def np_chain_reference(spec, sent_params, rw_w_S, fx_fns, x0, xn_fn=lambda x: x):
  """x_1, …, x_S of a chain of sites x_{i+1} = LAuReL(f_i(x_i), x_i, x_{i−1}, …), evaluated site by site with
  `np_reference` (the pull form, zeros before x_0), params mapped by `pull_params`."""
  xs = [np.asarray(x0, np.float64)]
  for i, fx_fn in enumerate(fx_fns):
    p = pull_params(spec, sent_params, i)
    if spec.rw:
      p['rw_w'] = np.asarray(rw_w_S[i], np.float64)
    history = [xs[i - j] if i >= j else np.zeros_like(xs[0]) for j in range(1, spec.history_len + 1)]
    xs.append(np_reference(spec, p, fx_fn(xs[i]), xs[i], history, xn_fn(xs[i])))
  return xs[1:]


# ---------------------------------------------------------------------------------------------------
# Chains of design_chain.Net: (spec, params in the loop's layout, x, ws) -> the output, float64.

def _sites(params, ws):
  """(layer, site, its params, F) of every site in order."""
  return [(l, t, params.get(f'layers_{l}', {}).get(f'site{t}'), lambda v, w=ws[l, t]: np.tanh(v @ w))
          for l in range(LAYERS) for t in range(T)]


def _f64(params, x, ws):
  return (jax.tree.map(lambda a: np.asarray(a, np.float64), params), np.asarray(x, np.float64),
          np.asarray(ws, np.float64))


def laurel_chain(spec, params, x, ws):
  p, x, ws = _f64(params, x, ws)
  sites = _sites(p, ws)
  rw_w_S = p['chain']['rw_w'] if spec.rw else None
  fx_fns = [lambda v, f=f: f(np_rms(v)) for *_, f in sites]
  return np_chain_reference(spec, [q or {} for _, _, q, _ in sites], rw_w_S, fx_fns, x, np_rms)[-1]


def np_sinkhorn(logits, iters):
  m = np.exp(logits)
  for _ in range(iters):  # mHC eq. 9: T_c, then T_r
    m = m / m.sum(axis=-2, keepdims=True)
    m = m / m.sum(axis=-1, keepdims=True)
  return m


def scale_chain(spec, params, x, ws):
  p, x, ws = _f64(params, x, ws)
  for _, _, q, f in _sites(p, ws):
    x = x + (q['rezero_alpha'] * f(x) if spec.design == 'rezero'  # eq. 1, no pre-norm
             else q['layerscale'] * f(np_rms(x)))  # CaiT §2
  return x


def _authors_tilt(n, l):
  """mHC-lite's code: +1 on stream l mod n (l the layer), −1 on the others."""
  return 2 * np.eye(n)[l % n] - 1


def _b_post_tilt(spec, l):
  """mHC-lite's authors' init of b_post, carried as a constant shift of a parameter starting at 0."""
  return _authors_tilt(spec.expansion, l) if getattr(spec, 'mhc_lite_init', 'plain') == 'authors' else 0.0


def hyper_chain(spec, params, x, ws):
  """Token-major streams (B, L, n, D)."""
  p, x, ws = _f64(params, x, ws)
  n = spec.expansion
  h = np.repeat(x[:, :, None, :], n, axis=2)  # HC §2.1: H⁰ = n copies of h⁰
  for l, t, q, f in _sites(p, ws):
    if spec.design == 'hc':
      a_m, a_r, b = p['chain']['a_m'][l, t], q['a_r'], q['b']
      if spec.hc_dynamic:  # eqs. 10–13, norm = LayerNorm per stream (Algorithm 2)
        hbar = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + EPS)
        hbar = hbar * q['norm']['scale'] + q['norm']['bias']
        b = q['s_beta'] * np.tanh(hbar @ q['w_beta']) + b
        a_m = q['s_alpha'] * np.tanh(hbar @ q['w_alpha'][:, 0]) + a_m
        a_r = q['s_alpha'] * np.tanh(hbar @ q['w_alpha'][:, 1:]) + a_r
      else:
        a_m, a_r, b = (np.broadcast_to(a, (BATCH, LEN) + a.shape) for a in (a_m, a_r, b))
      h0 = np.einsum('bln,blnd->bld', a_m, h)  # eq. 3
      h = b[..., None] * f(np_rms(h0))[:, :, None, :] + np.einsum('blij,blid->bljd', a_r, h)  # eqs. 4–5
    else:  # mHC eqs. 7–8 with vec(x_l) row-major over (n, D), mat() row-major over (n, n)
      xv = np_rms(h.reshape(BATCH, LEN, n * D))
      phi, alpha = q['phi'].reshape(n * D, -1), q['alpha']
      h_pre = np_sigmoid(alpha[0] * (xv @ phi[:, :n]) + p['chain']['b_pre'][l, t])
      h_post = 2 * np_sigmoid(alpha[1] * (xv @ phi[:, n:2 * n]) + q['b_post'] + _b_post_tilt(spec, l))
      res = alpha[2] * (xv @ phi[:, 2 * n:])
      x_in = np.einsum('bln,blnd->bld', h_pre, h)
      if spec.design == 'mhc':
        h_res = np_sinkhorn(res.reshape(BATCH, LEN, n, n) + q['b_res'], spec.sinkhorn_iters)
        mixed = np.einsum('blij,bljd->blid', h_res, h)
      else:  # mHC-lite: a convex combination of the n! permutation matrices, as its code mixes
        mixed = mhc_lite_mix(np_softmax(res + q['b_res'], axis=-1), h)
      h = mixed + h_post[..., None] * f(np_rms(x_in))[:, :, None, :]  # eq. 3
  if _readout(spec) == 'norm_sum':  # mHC-lite's model.py: the final norm (here unweighted) on each stream, then sum
    return np_rms(h).sum(axis=2)
  if _readout(spec) == 'v4':  # DeepSeek-V4: Σ_k (σ(s·(RMSNorm(vec X) φ)_k + b_k) + ε) X_k
    r = p['stream_readout']
    xv = np_rms(h.reshape(BATCH, LEN, n * D))
    w = np_sigmoid(r['readout_scale'] * (xv @ r['readout_phi'].reshape(n * D, n)) + r['readout_b']) + 1e-6
    return np.einsum('bln,blnd->bld', w, h)
  return h.sum(axis=2)  # HC §2.1: sum the rows of the last hyper hidden matrix


def mhc_lite_mix(c_BxLxR, h_BxLxNxD):
  """mHC-lite's residual mix as its code applies it: the matrices eye(n)[σ_r] over itertools.permutations, weighed
  by the softmax c and summed to α (from stream s, to stream t), the new stream t = Σ_s α[s, t]·h_s."""
  n = h_BxLxNxD.shape[2]
  perms = np.eye(n)[np.array(list(itertools.permutations(range(n))))]
  alpha = np.einsum('blr,rst->blst', c_BxLxR, perms)
  return np.einsum('blst,blsd->bltd', alpha, h_BxLxNxD)


def _readout(spec):
  """mHC's read-out by default the paper's sum (HC §2.1), mHC-lite's its code's norm on each stream, then the sum."""
  if getattr(spec, 'mhc_readout', 'sum') == 'authors':
    return 'norm_sum' if spec.design == 'mhc_lite' else 'sum'
  return getattr(spec, 'mhc_readout', 'sum')


def frac_chain(spec, params, x, ws):
  """Frac-Connections: m fractions of D as HC's streams; the layer reads merge(ΓᵀH), H' = β·split(F) + AᵀH."""
  p, x, ws = _f64(params, x, ws)
  m, w = spec.fractions, D // spec.fractions
  h = x.reshape(BATCH, LEN, m, w)
  for _, _, q, f in _sites(p, ws):
    gamma, a, beta = (np.broadcast_to(q[k], (BATCH, LEN) + q[k].shape) for k in ('frac_gamma', 'frac_a', 'frac_beta'))
    if spec.hc_dynamic:  # HC eqs. 10–13 per fraction, LayerNorm over its D/m channels
      hbar = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + EPS)
      hbar = hbar * q['norm']['scale'] + q['norm']['bias']
      gamma = gamma + q['s_alpha'] * np.tanh(hbar @ q['w_alpha'][:, :m])
      a = a + q['s_alpha'] * np.tanh(hbar @ q['w_alpha'][:, m:])
      beta = beta + q['s_beta'] * np.tanh(hbar @ q['w_beta'])
    x_in = np.einsum('blfg,blfw->blgw', gamma, h).reshape(BATCH, LEN, D)
    y = f(np_rms(x_in)).reshape(BATCH, LEN, m, w)
    h = np.einsum('blfg,blfw->blgw', a, h) + beta[..., None] * y
  return h.reshape(BATCH, LEN, D)


def denseformer_chain(spec, params, x, ws):
  """Pull form: keep X_0 … X_i; after block i (0-based), if (i+1) % p == 0, Y = Σ α_{i,j} X_j over j ≤ i+1 with
  j ≡ i+1 (mod k). The flat α lists the DWA blocks in order, each over increasing j (DWAModules' weights)."""
  p, x, ws = _f64(params, x, ws)
  k, period, alpha, flat = spec.dwa_dilation, spec.dwa_period, {}, iter(p['chain']['dwa_alpha'])
  for i in range(LAYERS):
    if (i + 1) % period == 0:
      alpha.update({(i, j): next(flat) for j in range(i + 2) if j % k == (i + 1) % k})
  assert next(flat, None) is None
  outs, sites = [x], _sites(p, ws)
  for l in range(LAYERS):
    for _, _, _, f in sites[l * T:(l + 1) * T]:
      x = x + f(np_rms(x))
    outs.append(x)
    if (l + 1) % period == 0:
      x = sum(alpha[l, j] * outs[j] for j in range(l + 2) if (l, j) in alpha)
  return x


def _attnres_sources(spec, x, ws, mix):
  """(every site's input, then the read-out) of Full or Block AttnRes in pull form: h_s = mix(sources, s).
  Full: sources v_0 = x, v_1, … (each site's output). Block (b sites per block): the finished block sums, then the
  current block's partial sum unless the site starts a block (Kimi's order: the finished block joins first).
  delta (arXiv 2605.18855): the same sources are the stream's increments, and the input is x_s + h_s; the read-out
  is the stream x_S (wdlctc/delta-attention-residuals-code: its 'delta' modes route nothing after the last layer)."""
  b = spec.attnres_block if spec.design == 'attnres_block' else 1
  blocks, partial, sites, hs, stream = [x], None, _sites({}, ws), [], x
  plus_stream = lambda h: stream + h if spec.attnres_delta else h
  for s, (*_, f) in enumerate(sites):
    if s % b == 0 and partial is not None:
      blocks, partial = blocks + [partial], None
    hs.append(plus_stream(mix(blocks + ([] if partial is None else [partial]), s)))
    v = f(np_rms(hs[-1]))
    partial, stream = (v if partial is None else partial + v), stream + v
  # The read-out: the last receiver's mix; with delta the stream itself (the delta code has no final routing).
  return hs + [stream if spec.attnres_delta else mix(blocks + [partial], len(sites))]


def attnres_chain(spec, params, x, ws, site_inputs=False):
  """The read-out (or every site's input, then it); α_{j→s} = softmax_j(w_sᵀ RMSNorm_s(v_j)), the RMSNorm flax's
  (eps 1e-6) with scale γ_s; with H heads each group of D/H channels has its own RMSNorm, logits and softmax."""
  p, x, ws = _f64(params, x, ws)
  w, gamma = p['chain']['attnres_query'], p['chain']['attnres_key_scale']
  groups = np.split(np.arange(x.shape[-1]), spec.attnres_heads)

  def mix(vs, s):
    out = np.zeros_like(vs[0])
    for g in groups:
      alpha = np_softmax(np.stack([np_rmsnorm(v[..., g], gamma[s, g]) @ w[s, g] for v in vs]))
      out[..., g] = sum(a[..., None] * v[..., g] for a, v in zip(alpha, vs))
    return out
  hs = _attnres_sources(spec, x, ws, mix)
  return hs if site_inputs else hs[-1]


def delta_attnres_authors(spec, params, x, ws):
  """A transcription of wdlctc/delta-attention-residuals-code (Attention-Residuals/modeling_qwen3_attnres.py),
  attnres_mode 'delta' with one head, no null source and gate 'bias': each sublayer reads h = partial +
  Σ_n softmax_n(q·RMSNorm(V_n))·V_n over the list `blocks` (h = partial while it is empty), `blocks` starting as
  [the embedding] after the first attention and growing by each sublayer's output; the model reads out norm(partial)
  with no final routing. Its first input is x_0 where the paper's formula gives 2·x_0: equal after the pre-norm."""
  del spec
  p, x, ws = _f64(params, x, ws)
  query, key_scale = p['chain']['attnres_query'], p['chain']['attnres_key_scale']

  def delta_attn_res(deltas, partial, s):
    if not deltas:
      return partial
    v = np.stack(deltas)
    weights = np_softmax(np.einsum('d,nbtd->nbt', query[s], np_rmsnorm(v, key_scale[s])), axis=0)
    return partial + np.einsum('nbt,nbtd->btd', weights, v)
  blocks, partial = [], x
  for l in range(LAYERS):
    attn_out = np.tanh(np_rms(delta_attn_res(blocks, partial, 2 * l)) @ ws[l, 0])
    blocks = blocks or [partial]
    partial, blocks = partial + attn_out, blocks + [attn_out]
    mlp_out = np.tanh(np_rms(delta_attn_res(blocks, partial, 2 * l + 1)) @ ws[l, 1])
    partial, blocks = partial + mlp_out, blocks + [mlp_out]
  return partial


def attnres_init(spec, x, ws, params):  # documented: w = 0 makes every site a uniform average of its sources
  # (with delta, plus the stream: x_s·(s+2)/(s+1) for Full, the plain input after the pre-norm up to its epsilon)
  return _attnres_sources(spec, np.asarray(x, np.float64), ws, lambda vs, s: sum(vs) / len(vs))[-1], False


def np_gelu(z):
  return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))  # exact GELU (PyTorch's nn.GELU)


def mudd_chain(spec, params, x, ws):
  """MUDDFormer in pull form, the per-layer shapes unpadded (the stored weights sliced to them): after layer i,
  A = GELU(RMSNorm(X_{i+1}) W1) W2 + a over the C streams × i + 2 sources (the last layer: R only), K_i hidden
  units (C·(i+2), ×4 at the last layer, rounded as (n // 64 + 1)·64); X^c = Σ_j A[c, j] X_j. Layer i+1:
  h = X^R + F(norm(X^Q), norm_k(X^K), norm_v(X^V)), out = h + F'(norm(h)); the toy F reads q + 2(k − v)."""
  p, x, ws = _f64(params, x, ws)
  c = len(spec.mudd_streams)
  xs, ins = [x], (x,) * c
  for l in range(LAYERS):
    site0, site1 = p[f'layers_{l}'].get('site0', {}), p[f'layers_{l}']['site1']
    if c == 4:
      xq, xk, xv, xr = ins
      attn_in = np_rms(xq) + 2 * (np_rmsnorm(xk, site0['norm_key']['scale']) -
                                  np_rmsnorm(xv, site0['norm_value']['scale']))
    else:
      (xr,) = ins
      attn_in = np_rms(xr)
    h = xr + np.tanh(attn_in @ ws[l, 0])
    y = h + np.tanh(np_rms(h) @ ws[l, 1])
    xs.append(y)
    last = l == LAYERS - 1
    ci, si = (1 if last else c), l + 2
    k = (ci * si * (4 if last else 1) // 64 + 1) * 64
    w2 = site1['mudd_w2'][:k, c - ci:, :si]
    a = np.einsum('blk,kcj->blcj', np_gelu(np_rms(y) @ site1['mudd_w1'][:, :k]), w2)
    a = a + p['chain']['mudd_bias'][l, c - ci:, :si]
    ins = tuple(sum(a[..., s, j, None] * xs[j] for j in range(si)) for s in range(ci))
  return ins[-1]


def dca_chain(spec, params, x, ws):
  """DCA in pull form: every block output kept (y_0 = x, y_{j+1} = layer j's attn + mlp); a GRN over the stack
  [y_0, Σ_{1 ≤ j ≤ i−k} y_j, y_i, y_{i−1}, …, y_{i−k+1}] (an empty sum, or a y_j with j < 1, a zero column) is
  Σ_n ReLU(b_n + wᵀ g_n) ⊙ g_n over its columns g_n; layer i's inputs u^c = GRN^c_i for c = Q, K, V, the
  attention's skip u^Q, the toy attention reading q + 2(k − v); the read-out a GRN over the stack of y_0, …, y_N.
  k-DCA keeps the last k apart; DCA every layer (k = N: the merged column stays empty)."""
  p, x, ws = _f64(params, x, ws)
  k = LAYERS if spec.design == 'dca' else spec.dca_k

  def stack(ys):
    i = len(ys) - 1
    return [ys[0], sum(ys[1:max(i - k + 1, 1)], np.zeros_like(x))] + [ys[i - r] if i - r >= 1 else np.zeros_like(x)
                                                                        for r in range(k)]

  grn = lambda b, w, cols: sum(np.maximum(b[n] + (g @ w)[..., None], 0.0) * g for n, g in enumerate(cols))
  b, w = p['chain']['dca_bias'], p['chain']['dca_query']
  ys = [x]
  for l in range(LAYERS):
    u = [grn(b[l, c], w[l, c], stack(ys)) for c in range(3)]
    norms = p[f'layers_{l}']['site0']
    attn = np.tanh((np_rms(u[0]) + 2 * (np_rmsnorm(u[1], norms['norm_key']['scale']) -
                                        np_rmsnorm(u[2], norms['norm_value']['scale']))) @ ws[l, 0])
    h = u[0] + attn
    ys.append(attn + np.tanh(np_rms(h) @ ws[l, 1]))
  out = p['dca_readout']
  return grn(out['dca_bias'][0], out['dca_query'][0], stack(ys))


def np_plain(x, ws, alpha=1.0, beta=1.0):
  """The pre-norm chain β·x + α·F(norm(x)), site by site, float64."""
  x, ws = np.asarray(x, np.float64), np.asarray(ws, np.float64)
  for l in range(LAYERS):
    for t in range(T):
      x = beta * x + alpha * np.tanh(np_rms(x) @ ws[l, t])
  return x


# ---------------------------------------------------------------------------------------------------
# Init claims: (spec, x, ws, params at init) -> (what the chain gives at init, whether exactly).

def laurel_init(spec, x, ws, params):
  if spec.form == 'gemma3n':  # documented: A, B drawn as Gemma 3n draws them, N(0, 0.02²), not B = 0
    return laurel_chain(spec, params, x, ws), False
  if spec.rw and spec.rw_scale != 2.0:  # documented: α + β = rw_scale, so (x + f(x))·rw_scale/2 per site
    return np_plain(x, ws, spec.rw_scale / 2, spec.rw_scale / 2), False
  return plain(x, ws), True  # the plain residual, bit for bit


def scale_init(spec, x, ws, params):
  if spec.design == 'rezero':  # α = 0: the identity
    return np.asarray(x), True
  return np_plain(x, ws, alpha=spec.layerscale_init), False  # x + ε·F(norm(x))


def hyper_init(spec, x, ws, params):  # n equal streams summed: n·(plain chain), removed by the final RMSNorm
  if getattr(spec, 'mhc_lite_init', 'plain') == 'authors':  # the code's start, not the plain chain: its chain there
    n, k = spec.expansion, math.factorial(spec.expansion)
    site = lambda q: {**q, 'phi': np.zeros_like(q['phi']), 'alpha': np.full(3, 0.01), 'b_post': np.zeros(n),
                      'b_res': np.where(np.arange(k) == 0, 0.0, -8.0)}
    start = {f'layers_{l}': {f'site{t}': site(params[f'layers_{l}'][f'site{t}']) for t in range(T)}
             for l in range(LAYERS)}
    b_pre = np.stack([[_authors_tilt(n, l)] * T for l in range(LAYERS)])
    return hyper_chain(spec, {**params, **start, 'chain': {'b_pre': b_pre}}, x, ws), False
  if _readout(spec) == 'norm_sum':  # n equal streams, each normed, summed
    return spec.expansion * np_rms(np.asarray(plain(x, ws), np.float64)), False
  weight = 0.5 + 1e-6 if _readout(spec) == 'v4' else 1.0  # V4: σ(0) + ε per stream
  return weight * spec.expansion * plain(x, ws), False


@dataclasses.dataclass(frozen=True)
class Reference:
  cases: dict  # id -> spec
  chain: Callable  # (spec, params, x, ws) -> output, float64
  init: Callable  # (spec, x, ws, params at init) -> (output at init, exact?)
  tol: float = 1e-5
  scan: tuple = ()  # cases also run under nn.scan


def _laurel(variant, **kw):
  return LaurelSpec(variant=variant, **{'rank': 4, **kw})


LAUREL_RW_PA = _laurel('rw+pa', k=3)  # RW with identity-h PA: α, β and γ (tests/test_diagnostics.py too)
STREAM_CASES = {
    'rezero': StreamSpec(design='rezero'), 'layerscale': StreamSpec(design='layerscale', layerscale_init=0.1),
    'hc': StreamSpec(design='hc', expansion=3), 'hc_dynamic': StreamSpec(design='hc', expansion=3, hc_dynamic=True),
    'hc_n1': StreamSpec(design='hc', expansion=1), 'mhc': StreamSpec(design='mhc', expansion=3),
    'mhc_n2_iters5': StreamSpec(design='mhc', expansion=2, sinkhorn_iters=5),
    'mhc_v4_readout': StreamSpec(design='mhc', expansion=3, mhc_readout='v4'),
    'mhc_lite': StreamSpec(design='mhc_lite', expansion=3),
    'mhc_lite_n4': StreamSpec(design='mhc_lite', expansion=4),
    'mhc_lite_sum_readout': StreamSpec(design='mhc_lite', expansion=3, mhc_readout='sum'),
    'mhc_norm_sum_readout': StreamSpec(design='mhc', expansion=2, mhc_readout='norm_sum'),
    'mhc_lite_n2_v4_readout': StreamSpec(design='mhc_lite', expansion=2, mhc_readout='v4'),
    'mhc_lite_authors': StreamSpec(design='mhc_lite', expansion=3, mhc_lite_init='authors'),
    'frac': StreamSpec(design='frac'), 'frac_m4': StreamSpec(design='frac', fractions=4),
    'frac_dynamic': StreamSpec(design='frac', hc_dynamic=True),
    'frac_m8_dynamic': StreamSpec(design='frac', fractions=8, hc_dynamic=True),
    'denseformer': StreamSpec(design='denseformer'),
    'denseformer_2x1': StreamSpec(design='denseformer', dwa_dilation=2),
    'denseformer_1x3': StreamSpec(design='denseformer', dwa_period=3),
    'denseformer_2x2': StreamSpec(design='denseformer', dwa_dilation=2, dwa_period=2),
    'denseformer_3x2': StreamSpec(design='denseformer', dwa_dilation=3, dwa_period=2),
    'attnres': StreamSpec(design='attnres'), 'attnres_heads2': StreamSpec(design='attnres', attnres_heads=2),
    'attnres_delta': StreamSpec(design='attnres', attnres_delta=True),
    'attnres_heads4_delta': StreamSpec(design='attnres', attnres_heads=4, attnres_delta=True),
    **{f'attnres_block{b}': StreamSpec(design='attnres_block', attnres_block=b) for b in (1, 2, 4, 8)},
    'attnres_block2_heads2': StreamSpec(design='attnres_block', attnres_heads=2),
    'attnres_block4_delta': StreamSpec(design='attnres_block', attnres_block=4, attnres_delta=True),
    'attnres_block4_heads8_delta': StreamSpec(design='attnres_block', attnres_block=4, attnres_heads=8,
                                              attnres_delta=True),
    'mudd': StreamSpec(design='mudd'), 'mudd_r': StreamSpec(design='mudd', mudd_streams='r'),
    'dca': StreamSpec(design='dca'),
    **{f'dca_k{k}': StreamSpec(design='dca_k', dca_k=k) for k in (1, 2, 5)}}
_streams = lambda *designs: {k: s for k, s in STREAM_CASES.items() if s.design in designs}

REFERENCES = {
    'residual': Reference({'plain': StreamSpec('residual')}, lambda spec, params, x, ws: np_plain(x, ws),  # eq. 1
                          lambda spec, x, ws, params: (plain(x, ws), True), scan=('plain',)),
    'laurel': Reference({  # every variant of §2, eqs. 3–6, §2.4's per-dimension RW and the Gemma 3n form
        'rw_softmax': _laurel('rw'), 'rw_sigmoid': _laurel('rw', rw_norm='sigmoid'),
        'rw_softmax_per_dim': _laurel('rw', rw_per_dim=True),
        'rw_sigmoid_per_dim': _laurel('rw', rw_norm='sigmoid', rw_per_dim=True),
        'lr': _laurel('lr'), 'lr_xavier': _laurel('lr', a_init='xavier'), 'lr_rank1': _laurel('lr', rank=1),
        **{f'pa_identity_k{k}': _laurel('pa', k=k) for k in (1, 2, 3)},
        **{f'pa_low_rank_k{k}': _laurel('pa', pa_h='low_rank', k=k) for k in (1, 2, 4)},
        'rw_lr': _laurel('rw+lr'),  # eq. 5
        'rw_lr_sigmoid_per_dim': _laurel('rw+lr', rw_norm='sigmoid', rw_per_dim=True),
        'rw_pa_identity': LAUREL_RW_PA, 'rw_pa_low_rank': _laurel('rw+pa', pa_h='low_rank', k=2),
        'rw_lr_pa_k1': _laurel('rw+lr+pa', k=1), 'rw_lr_pa_k3': _laurel('rw+lr+pa', k=3),  # eq. 6
        'rw_lr_pa_k3_xavier': _laurel('rw+lr+pa', k=3, a_init='xavier'),
        'rw_lr_pa_per_dim': _laurel('rw+lr+pa', k=2, rw_per_dim=True), 'lr_pa_k2': _laurel('lr+pa', k=2),
        'pa_lr_order': _laurel('pa+lr', k=3),  # component order does not matter
        'gemma3n_lr': _laurel('lr', form='gemma3n'), 'gemma3n_rw_lr': _laurel('rw+lr', form='gemma3n'),
        # the paper's literal normalisation (α + β = 1)
        **{f'{v.replace("+", "_")}_{norm}_scale1': _laurel(v, rw_norm=norm, rw_scale=1.0, k=2)
           for v in ('rw', 'rw+lr', 'rw+pa', 'rw+lr+pa') for norm in ('softmax', 'sigmoid')},
    }, laurel_chain, laurel_init, tol=1e-4, scan=('rw_lr_pa_k3', 'pa_low_rank_k4', 'rw_pa_identity')),
    'rezero': Reference(_streams('rezero'), scale_chain, scale_init, scan=('rezero',)),
    'layerscale': Reference(_streams('layerscale'), scale_chain, scale_init, scan=('layerscale',)),
    'hc': Reference(_streams('hc'), hyper_chain, hyper_init, scan=tuple(_streams('hc'))),
    'mhc': Reference(_streams('mhc'), hyper_chain, hyper_init, scan=tuple(_streams('mhc'))),
    'mhc_lite': Reference(_streams('mhc_lite'), hyper_chain, hyper_init, scan=tuple(_streams('mhc_lite'))),
    'frac': Reference(_streams('frac'), frac_chain, lambda spec, x, ws, p: (plain(x, ws), True),
                      tol=1e-4, scan=tuple(_streams('frac'))),  # its chain grows to |x| ~ 70 here
    'denseformer': Reference(_streams('denseformer'), denseformer_chain, lambda spec, x, ws, p: (plain(x, ws), True),
                             scan=tuple(_streams('denseformer'))),
    'attnres': Reference(_streams('attnres'), attnres_chain, attnres_init, scan=('attnres', 'attnres_heads4_delta')),
    'attnres_block': Reference(_streams('attnres_block'), attnres_chain, attnres_init,
                               scan=('attnres_block2', 'attnres_block4', 'attnres_block4_heads8_delta')),
    'mudd': Reference(_streams('mudd'), mudd_chain, lambda spec, x, ws, p: (plain(x, ws), True), tol=1e-4,
                      scan=tuple(_streams('mudd'))),  # exactly plain; at random weights its chain grows to |x| ~ 10³
    # b = 1, w = 0: every input is Σ_j y_j = x_i, the plain stream up to the rounding of that sum; at random
    # weights its unnormalised gates grow the chain to |x| ~ 20
    'dca': Reference(_streams('dca'), dca_chain, lambda spec, x, ws, p: (plain(x, ws), False), tol=1e-4,
                     scan=('dca',)),
    'dca_k': Reference(_streams('dca_k'), dca_chain, lambda spec, x, ws, p: (plain(x, ws), False), tol=1e-4,
                       scan=('dca_k1', 'dca_k2')),
}
