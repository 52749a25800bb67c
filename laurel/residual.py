"""The LAuReL residual family (Menghani et al., arXiv 2411.07501, §2).

Every model in this package calls `LaurelResidual` where it would otherwise write `x + f(x)`.
All the maths of the paper lives here; equation numbers refer to the paper.

  eq. 2   x_{i+1} = α·f(x_i) + g(x_i, …, x_0)
  RW      g = β·x_i, α and β normalised (softmax or one sigmoid parameter)          §2.1
  eq. 3   LR:  x_{i+1} = f(x_i) + B·A·x_i + x_i                                    §2.2
  eq. 4   PA:  x_{i+1} = f(x_i) + x_i + Σ_{j<k} γ_{i,j}·h_i(x_{i−j})               §2.3
  eq. 5   RW+LR:  α·f(x_i) + β·(B·A·x_i + x_i)                                      §2.4
  eq. 6   RW+LR+PA:  α·f(x_i) + β·(x_i + Σ_{j<k} γ_{i,j}·A_{i,j}B_{i,j}·x_{i−j})    §2.4

In code A is the D×r down-projection and B the r×D up-projection (x_D @ A_Dxr @ B_rxD), so the paper's
"B A x" is `x @ A @ B`. Initialisation (§3.3): B = 0, A column-orthogonal (LLMs) or Xavier (ResNet).

Departures from the plain residual at initialisation, by construction:
  * RW uses α, β = rw_scale·normalise(w) with w = 0, and rw_scale = 2 by default, so α = β = 1 at init.
    With rw_scale = 1 (the paper's literal softmax, α + β = 1) the block starts at (x + f(x)) / 2.
  * PA with identity h starts with γ = 0; with low-rank h it starts with γ = 1 and B = 0. Either way the
    PA sum is zero at init. (γ = 0 together with B = 0 would leave both without gradient.)
  * form='gemma3n' (Gemma 3n's LAuReL block: LR reads the normed input, RMSNorm on its output, sum scaled
    by 1/√2) starts at (x + f(x) + norm(x)) / √2, as Gemma 3n does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel import config_lib

COMPONENTS = ('rw', 'lr', 'pa')
RW_NORMS = ('softmax', 'sigmoid')
A_INITS = ('column_orthogonal', 'xavier')
PA_HS = ('identity', 'low_rank')
FORMS = ('paper', 'gemma3n')
SITES = ('block', 'sublayer')


@dataclasses.dataclass(frozen=True)
class LaurelSpec:
  """A validated, hashable view of `model.laurel` (see `from_config`)."""
  variant: str = 'none'  # 'none' or a '+'-joined subset of rw, lr, pa, e.g. 'rw+lr+pa'
  rank: int = 32  # r, for LR and low-rank PA
  k: int = 3  # number of previous activations for PA (x_i counts as one)
  rw_norm: str = 'softmax'  # softmax over (α, β) or one parameter through sigmoid
  rw_scale: float = 2.0  # α, β = rw_scale·normalise(w); 2 makes α = β = 1 at init
  rw_per_dim: bool = False  # §2.4: α, β are D-vectors
  a_init: str = 'column_orthogonal'  # §3.3
  pa_h: str = 'identity'  # h_i for PA without LR (eq. 4); with LR it is eq. 6's per-j low-rank pair
  form: str = 'paper'  # or 'gemma3n'
  site: str = 'block'  # LM only: one site per transformer block, or one per sublayer (attention, MLP)

  @property
  def components(self) -> frozenset:
    return frozenset() if self.variant == 'none' else frozenset(self.variant.split('+'))

  @property
  def rw(self) -> bool:
    return 'rw' in self.components

  @property
  def lr(self) -> bool:
    return 'lr' in self.components

  @property
  def pa(self) -> bool:
    return 'pa' in self.components

  @property
  def history_len(self) -> int:
    """How many activations before x_i a site reads (pull form), or running sums it carries (push form)."""
    return self.k - 1 if self.pa else 0

  @classmethod
  def from_config(cls, cfg: Any, d_model: int, num_sites: int, field: str = 'model.laurel') -> 'LaurelSpec':
    """Builds and validates a spec; raises ValueError naming `field.<name>` and the value."""
    values = config_lib.known_fields(cls, cfg, field, skip=())
    spec = cls(**values)
    spec.validate(d_model, num_sites, field)
    return spec

  def validate(self, d_model: int, num_sites: int, field: str = 'model.laurel') -> None:
    def bad(name, why):
      raise ValueError(f'{field}.{name}={getattr(self, name)!r}: {why}')

    parts = [] if self.variant == 'none' else self.variant.split('+')
    if self.variant != 'none' and (not parts or any(p not in COMPONENTS for p in parts)
                                   or len(set(parts)) != len(parts)):
      bad('variant', f"must be 'none' or a '+'-joined subset of {', '.join(COMPONENTS)}")
    if not isinstance(self.rw_per_dim, bool):
      bad('rw_per_dim', 'must be a bool')
    if self.rw_norm not in RW_NORMS:
      bad('rw_norm', f'must be one of {", ".join(RW_NORMS)}')
    if self.a_init not in A_INITS:
      bad('a_init', f'must be one of {", ".join(A_INITS)}')
    if self.pa_h not in PA_HS:
      bad('pa_h', f'must be one of {", ".join(PA_HS)}')
    if self.form not in FORMS:
      bad('form', f'must be one of {", ".join(FORMS)}')
    if self.site not in SITES:
      bad('site', f'must be one of {", ".join(SITES)}')
    if not config_lib.is_number(self.rw_scale) or not self.rw_scale > 0:
      bad('rw_scale', 'must be a positive number')
    uses_rank = self.lr or (self.pa and self.pa_h == 'low_rank') or self.form == 'gemma3n'
    if uses_rank and not (config_lib.is_int(self.rank) and 1 <= self.rank <= d_model):
      bad('rank', f'must be an integer in [1, d_model={d_model}]')
    if self.pa and not (config_lib.is_int(self.k) and 1 <= self.k <= num_sites):
      bad('k', f'must be an integer in [1, number of LAuReL sites={num_sites}]')
    if self.form == 'gemma3n' and (not self.lr or self.pa):
      bad('form', "'gemma3n' needs a variant with lr and without pa")


def closed_form_params(spec: LaurelSpec, d_model: int) -> int:
  """Extra parameters of one LAuReL site, as counted in §2 and Table 4."""
  r, k, d = spec.rank, spec.k, d_model
  n = 0
  if spec.rw:
    n += (1 if spec.rw_norm == 'sigmoid' else 2) * (d if spec.rw_per_dim else 1)
  if spec.pa and spec.lr:
    n += 2 * r * k * d + k  # eq. 6: one (A, B) pair per previous activation
  elif spec.pa:
    n += k + (2 * r * d if spec.pa_h == 'low_rank' else 0)  # eq. 4
  elif spec.lr:
    n += 2 * r * d  # eq. 3
  if spec.form == 'gemma3n':
    n += d  # RMSNorm scale on the low-rank output
  return n


def column_orthogonal_init(key, shape, dtype=jnp.float32):
  """§3.3 footnote: A[i, j] = 1/sqrt(r·D) if i mod r == j else 0, for A of shape (..., D, r)."""
  del key
  d, r = shape[-2], shape[-1]
  a = (np.arange(d)[:, None] % r == np.arange(r)[None, :]) / math.sqrt(r * d)
  return jnp.broadcast_to(jnp.asarray(a, dtype), shape)


def _a_init(name: str):
  if name == 'column_orthogonal':
    return column_orthogonal_init
  # Leading axes (eq. 6's k) are batch axes; a plain (D, r) A has none.
  return lambda key, shape, dtype=jnp.float32: nn.initializers.xavier_uniform(
      in_axis=-2, out_axis=-1, batch_axis=tuple(range(len(shape) - 2)))(key, shape, dtype)


def rw_weights(w, spec: LaurelSpec, axis: int = 0):
  """§2.1: α, β = rw_scale·softmax(w) over `axis`, or rw_scale·(σ(w), σ(−w)) with one parameter, in float32."""
  w = w.astype(jnp.float32)
  if spec.rw_norm == 'softmax':
    ab = spec.rw_scale * jax.nn.softmax(w, axis=axis)
    return jnp.take(ab, 0, axis=axis), jnp.take(ab, 1, axis=axis)
  return spec.rw_scale * jax.nn.sigmoid(w), spec.rw_scale * jax.nn.sigmoid(-w)


def _rw_param_shape(spec: LaurelSpec, features: int, embed_axis: str):
  per_dim = ((features,), (embed_axis,)) if spec.rw_per_dim else ((), ())
  two = ((2,), ('laurel_rw',)) if spec.rw_norm == 'softmax' else ((), ())
  return two[0] + per_dim[0], two[1] + per_dim[1]


class ChainRW(nn.Module):
  """RW's weights for every site of a chain of `num_sites` sites (the LM), as one (sites, …) array.

  A site evaluated with `LaurelResidual.push` needs the β of the sites it sends to, so the chain's caller
  holds them all. Returns (α_S, β_SxK): α of each site, and β_SxK[i, j] = β_{i+j} (zero past the end), with
  K = k under PA and 1 otherwise.
  """
  spec: LaurelSpec
  num_sites: int
  features: int
  param_dtype: Any = jnp.float32
  embed_axis: str = 'embed'

  @nn.compact
  def __call__(self):
    shape, names = _rw_param_shape(self.spec, self.features, self.embed_axis)
    w = self.param('rw_w', nn.with_logical_partitioning(nn.initializers.zeros, ('laurel_sites',) + names),
                   (self.num_sites,) + shape, self.param_dtype)
    alpha_S, beta_S = rw_weights(w, self.spec, axis=1)
    k = self.spec.k if self.spec.pa else 1
    padded = jnp.concatenate([beta_S, jnp.zeros((k - 1,) + beta_S.shape[1:], beta_S.dtype)])
    beta_SxK = jnp.stack([padded[j:j + self.num_sites] for j in range(k)], axis=1)
    return alpha_S, beta_SxK


class LaurelResidual(nn.Module):
  """x_{i+1} = α·f(x_i) + g(x_i, …), a drop-in for `x + f(x)` (eq. 2), in two forms.

  `__call__` is the equations as written ("pull"): with `fx` = f(x_i) and `x` = x_i, both (..., D), PA also
  takes `history` = (x_{i−1}, …, x_{i−k+1}) (zeros where the network has none). The ResNet uses it.

  `push` (with `chain=True`) computes the same sums for a chain of sites under a layer scan (the LM): site i
  sends γ·h(x_i) to each of sites i, …, i+k−1 through `pending`, running sums that the chain carries. So PA's
  parameters are indexed by the sending site: this site's γ_j, A_j, B_j are the paper's γ_{i+j,j}, A_{i+j,j},
  B_{i+j,j}; a relabelling of the same model. It matters for memory: a scan keeps, for the backward pass,
  whatever each step's gradient reads; the pull form reads k−1 earlier activations per layer, the push form
  only x_i, which the layer keeps anyway. RW's weights then come from the caller (`ChainRW`), because the β
  that multiplies a sent term belongs to the receiving site.

  form='gemma3n' takes `x_normed`, the normalised input f read. `axes` names the logical axes of x.
  Memory: a scalar times an activation makes autodiff keep that activation for the scalar's gradient. So β
  is folded into B and γ, and a model may fold α into f's last linear map itself and pass
  `alpha_applied=True`; α's gradient then flows through weights, not activations.
  """
  spec: LaurelSpec
  features: int
  param_dtype: Any = jnp.float32
  axes: tuple = ('act_batch', 'act_len', 'act_embed')
  embed_axis: str = 'embed'
  chain: bool = False  # evaluated with `push`; RW's weights come from a ChainRW

  def setup(self):
    s, d = self.spec, self.features
    param = lambda name, init, shape, names: self.param(
        name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)
    low_rank = lambda name, lead, lead_names: (
        param(f'{name}_a', _a_init(s.a_init), lead + (d, s.rank), lead_names + (self.embed_axis, 'laurel_rank')),
        param(f'{name}_b', nn.initializers.zeros, lead + (s.rank, d), lead_names + ('laurel_rank', self.embed_axis)))
    if s.rw and not self.chain:  # §2.1: w = 0 at init
      self.rw_w = param('rw_w', nn.initializers.zeros, *_rw_param_shape(s, d, self.embed_axis))
    if s.pa:
      self.pa_gamma = param('pa_gamma', nn.initializers.ones if self._pa_low_rank else nn.initializers.zeros,
                            (s.k,), ('laurel_k',))
      if s.lr:  # eq. 6: one (A_j, B_j) pair per previous activation
        self.pa_a, self.pa_b = low_rank('pa', (s.k,), ('laurel_k',))
      elif s.pa_h == 'low_rank':  # eq. 4 with a shared low-rank h_i
        self.pa_a, self.pa_b = low_rank('pa', (), ())
    elif s.lr:
      self.lr_a, self.lr_b = low_rank('lr', (), ())
      if s.form == 'gemma3n':
        self.lr_norm = nn.RMSNorm(param_dtype=self.param_dtype, scale_init=nn.with_logical_partitioning(
            nn.initializers.ones, (self.embed_axis,)))

  @property
  def _pa_low_rank(self):
    return self.spec.lr or self.spec.pa_h == 'low_rank'

  def __call__(self, fx, x, history: Sequence[jax.Array] = (), x_normed=None, alpha_applied: bool = False):
    """Pull form: x_{i+1} from f(x_i), x_i and history = (x_{i−1}, …, x_{i−k+1})."""
    s = self.spec
    if self.chain:
      raise ValueError('LaurelResidual(chain=True) is evaluated with push()')
    alpha, beta = rw_weights(self.rw_w, s) if s.rw else (None, None)
    if not s.pa:
      return self._combine(fx, x, alpha, beta, self._lr_term(x, x_normed, beta), alpha_applied)
    xs = [x] + list(history)  # xs[j] = x_{i−j}
    if len(xs) != s.k:
      raise ValueError(f'PA needs k-1={s.k - 1} previous activations, got {len(xs) - 1}')
    # Per-j terms, never jnp.stack: autodiff would keep the stacked copy as well.
    if s.lr:  # eq. 6: Σ_j γ_j·x_{i-j} A_j B_j; β·γ_j folded into B_j
      g_rest = sum(x_j @ self._cast(self.pa_a[j], x) @ self._pa_b(j, beta, x) for j, x_j in enumerate(xs))
    elif s.pa_h == 'low_rank':  # eq. 4, shared h_i: (Σ_j γ_j x_{i-j}) A (βB)
      g_rest = self._pa_shared_h(sum(self._cast(self._gamma(j, None), x) * x_j for j, x_j in enumerate(xs)), beta)
    else:  # eq. 4, identity h_i, β folded into γ
      g_rest = sum(self._cast(self._gamma(j, beta), x) * x_j for j, x_j in enumerate(xs))
    return self._combine(fx, x, alpha, beta, g_rest, alpha_applied)

  def push(self, fx, x, pending: Sequence[jax.Array] = (), rw=None, x_normed=None, alpha_applied: bool = False):
    """Push form: returns (x_{i+1}, pending'). pending[m] holds what earlier sites sent to site i+m.

    `rw` = (α_i, β_K) from ChainRW with β_K[j] = β_{i+j}, under RW; pending has k−1 entries under PA.
    """
    s = self.spec
    if not self.chain:
      raise ValueError('push() needs LaurelResidual(chain=True)')
    alpha, beta_K = rw if s.rw else (None, None)
    beta = None if beta_K is None else beta_K[0]
    if not s.pa:
      return self._combine(fx, x, alpha, beta, self._lr_term(x, x_normed, beta), alpha_applied), ()
    if len(pending) != s.k - 1:
      raise ValueError(f'PA needs k-1={s.k - 1} pending sums, got {len(pending)}')
    if s.lr:  # eq. 6: one D → k·r product for all k terms, then each term's B_j scaled by its receiver's β
      xa_KxR = jnp.einsum('...d,kdr->...kr', x, self._cast(self.pa_a, x))
      sent = [xa_KxR[..., j, :] @ self._pa_b(j, None if beta_K is None else beta_K[j], x) for j in range(s.k)]
    elif s.pa_h == 'low_rank':  # the receiver applies its h (and β) to the sum
      sent = [self._cast(self._gamma(j, None), x) * x for j in range(s.k)]
    else:
      sent = [self._cast(self._gamma(j, None if beta_K is None else beta_K[j]), x) * x for j in range(s.k)]
    received = sent[0] + pending[0] if pending else sent[0]
    pending = tuple(p + c for p, c in zip(pending[1:], sent[1:-1])) + tuple(sent[-1:]) if s.k > 1 else ()
    # A shared h reads the whole received sum, so autodiff keeps it: one activation per site.
    g_rest = self._pa_shared_h(received, beta) if s.pa_h == 'low_rank' and not s.lr else received
    return self._combine(fx, x, alpha, beta, g_rest, alpha_applied), pending

  def _cast(self, v, like):
    return v.astype(like.dtype)

  def _gamma(self, j, beta):
    """γ_j (times β where given) in float32: a scalar, or a D-vector when β is per dimension."""
    gamma = self.pa_gamma[j].astype(jnp.float32)
    return gamma if beta is None else gamma * beta

  def _pa_b(self, j, beta, like):
    """γ_j·β·B_j (eq. 6): γ_j and β folded into B_j, so no activation is scaled."""
    return self._cast(self.pa_b[j] * self._gamma(j, beta), like)  # (r, D) × scalar or (D,)

  def _pa_shared_h(self, sum_x, beta):
    b = self.pa_b if beta is None else self.pa_b * beta
    return sum_x @ self._cast(self.pa_a, sum_x) @ self._cast(b, sum_x)

  def _lr_term(self, x, x_normed, beta):
    """The part of g besides x_i without PA: eq. 3/5's x A (βB), or Gemma 3n's norm(x) + RMSNorm(norm(x) A B)."""
    s = self.spec
    if s.lr and s.form == 'gemma3n':
      lr_out = self.lr_norm(x_normed @ self._cast(self.lr_a, x) @ self._cast(self.lr_b, x)).astype(x.dtype)
      return x_normed + lr_out if beta is None else (x_normed + lr_out) * self._cast(beta, x)
    if s.lr:
      b = self.lr_b if beta is None else self.lr_b * beta
      return x @ self._cast(self.lr_a, x) @ self._cast(b, x)
    return None

  def _combine(self, fx, x, alpha, beta, g_rest, alpha_applied):
    """β·x_i + α·f(x_i) + the rest of g (which carries its own β), with Gemma 3n's 1/√2."""
    out = x if beta is None else self._cast(beta, x) * x
    out = out + (fx if alpha is None or alpha_applied else self._cast(alpha, x) * fx)
    if g_rest is not None:
      out = out + g_rest.astype(x.dtype)
    if self.spec.form == 'gemma3n':
      out = out * (1.0 / math.sqrt(2.0))
    return nn.with_logical_constraint(out, self.axes)
