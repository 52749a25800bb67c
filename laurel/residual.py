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
from typing import Any, Optional, Sequence

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
    """How many activations before x_i a site needs (x_{i−1} … x_{i−k+1})."""
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
    if not isinstance(self.rw_scale, (int, float)) or not self.rw_scale > 0:
      bad('rw_scale', 'must be a positive number')
    uses_rank = self.lr or (self.pa and self.pa_h == 'low_rank') or self.form == 'gemma3n'
    if uses_rank and not (isinstance(self.rank, int) and 1 <= self.rank <= d_model):
      bad('rank', f'must be an integer in [1, d_model={d_model}]')
    if self.pa and not (isinstance(self.k, int) and 1 <= self.k <= num_sites):
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


class LaurelResidual(nn.Module):
  """x_{i+1} = α·f(x_i) + g(x_i, …), a drop-in for `x + f(x)` (eq. 2).

  Call with `fx` = f(x_i) and `x` = x_i, both (..., D) with D = `features`. PA also takes `history`: a
  sequence of k−1 arrays x_{i−1}, …, x_{i−k+1} (zeros where the network has none yet). form='gemma3n' takes
  `x_normed`, the normalised input f read. `axes` names the logical axes of x for sharding.

  Memory: a scalar times an activation makes autodiff keep that activation for the scalar's gradient. So β
  is folded into B (β·xAB = xA·(βB)), and a model may fold α into f's last linear map itself: it reads
  `alpha()` and passes `alpha_applied=True`, and α's gradient then flows through weights, not activations.
  """
  spec: LaurelSpec
  features: int
  param_dtype: Any = jnp.float32
  axes: tuple = ('act_batch', 'act_len', 'act_embed')
  embed_axis: str = 'embed'

  def setup(self):
    s, d = self.spec, self.features
    param = lambda name, init, shape, names: self.param(
        name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)
    low_rank = lambda name, lead, lead_names: (
        param(f'{name}_a', _a_init(s.a_init), lead + (d, s.rank), lead_names + (self.embed_axis, 'laurel_rank')),
        param(f'{name}_b', nn.initializers.zeros, lead + (s.rank, d), lead_names + ('laurel_rank', self.embed_axis)))
    if s.rw:  # §2.1: w = 0 at init
      per_dim = ((d,), (self.embed_axis,)) if s.rw_per_dim else ((), ())
      two = ((2,), ('laurel_rw',)) if s.rw_norm == 'softmax' else ((), ())
      self.rw_w = param('rw_w', nn.initializers.zeros, two[0] + per_dim[0], two[1] + per_dim[1])
    if s.pa:
      low_rank_h = s.lr or s.pa_h == 'low_rank'
      self.pa_gamma = param('pa_gamma', nn.initializers.ones if low_rank_h else nn.initializers.zeros,
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

  def alpha(self):
    """α of eq. 2 (a scalar, or a D-vector with rw_per_dim), or None where it is fixed at 1."""
    return self._residual_weights()[0] if self.spec.rw else None

  def __call__(self, fx, x, history: Optional[Sequence[jax.Array]] = None, x_normed=None,
               alpha_applied: bool = False):
    s = self.spec
    if not s.components:
      return fx + x
    alpha, beta = self._residual_weights() if s.rw else (None, None)
    cast = lambda v: v.astype(x.dtype)
    scale_b = (lambda b: b) if beta is None else (lambda b: b * cast(beta))  # β·(…B) = …(βB)

    g_rest = None  # the part of g that is not x_i: β applies to it through B or γ
    if s.pa:
      stack = [x] + list(history or [])
      if len(stack) != s.k:
        raise ValueError(f'PA needs k-1={s.k - 1} previous activations, got {len(stack) - 1}')
      # Per-j terms, never jnp.stack: autodiff would keep the stacked copy on top of the carries it holds anyway.
      gamma_K = cast(self.pa_gamma)
      if beta is not None and not (s.lr or s.pa_h == 'low_rank') and not s.rw_per_dim:
        gamma_K = gamma_K * cast(beta)
      weighted_sum = lambda: sum(gamma_K[j] * x_j for j, x_j in enumerate(stack))
      if s.lr:  # eq. 6: Σ_j γ_j·x_{i-j} A_j B_j, as one contraction over (j, r)
        a_KxDxR = cast(self.pa_a)
        xa_KxR = jnp.stack([x_j @ a_KxDxR[j] for j, x_j in enumerate(stack)], axis=-2)  # (..., k, r): small
        g_rest = jnp.einsum('...kr,krd->...d', xa_KxR, scale_b(cast(self.pa_b) * gamma_K[:, None, None]))
      elif s.pa_h == 'low_rank':  # eq. 4, shared h_i: (Σ_j γ_j x_{i-j}) A B
        g_rest = weighted_sum() @ cast(self.pa_a) @ scale_b(cast(self.pa_b))
      else:  # eq. 4, identity h_i
        g_rest = weighted_sum()
        if beta is not None and s.rw_per_dim:
          g_rest = g_rest * cast(beta)
    elif s.lr and s.form == 'gemma3n':  # Gemma 3n: x + norm(x) + RMSNorm(norm(x) A B), all over √2 below
      lr_out = self.lr_norm(x_normed @ cast(self.lr_a) @ cast(self.lr_b)).astype(x.dtype)
      g_rest = x_normed + lr_out if beta is None else (x_normed + lr_out) * cast(beta)
    elif s.lr:  # eq. 3 / eq. 5
      g_rest = x @ cast(self.lr_a) @ scale_b(cast(self.lr_b))

    out = x if beta is None else cast(beta) * x
    out = out + (fx if alpha is None or alpha_applied else cast(alpha) * fx)
    if g_rest is not None:
      out = out + g_rest
    if s.form == 'gemma3n':
      out = out * (1.0 / math.sqrt(2.0))
    return nn.with_logical_constraint(out, self.axes)

  def _residual_weights(self):
    """§2.1: α, β = rw_scale·softmax(w) or rw_scale·(σ(w), σ(−w)), in float32."""
    s = self.spec
    w = self.rw_w.astype(jnp.float32)
    if s.rw_norm == 'softmax':
      ab = s.rw_scale * jax.nn.softmax(w, axis=0)
      return ab[0], ab[1]
    return s.rw_scale * jax.nn.sigmoid(w), s.rw_scale * jax.nn.sigmoid(-w)
