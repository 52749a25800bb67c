"""NumPy references for the LAuReL equations (arXiv 2411.07501, §2, eqs. 2–6), written from the paper and from
Gemma 3n's LAuReL block, not from laurel/residual.py. Shared by the residual and LM tests.
"""

import math

import flax.linen as nn
import jax
import numpy as np



def np_softmax(w, axis=0):
  e = np.exp(w - w.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def np_sigmoid(w):
  return 1.0 / (1.0 + np.exp(-w))


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
  comps = set() if spec.variant == 'none' else set(spec.variant.split('+'))

  if not comps:  # eq. 1
    return fx + x

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
  (LaurelResidual.push). Terms from before the first site do not exist: their γ is 0.
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
