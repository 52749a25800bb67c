"""LAuReL, the learned augmented residual layer (Menghani et al., arXiv 2411.07501, §2, eqs. 2–6).

x_{i+1} = α·f(x_i) + g(x_i, …, x_0): RW (§2.1), LR (eq. 3), PA (eq. 4) and their combinations (eqs. 5, 6); A is
D×r and B r×D (the paper's "B A x" is `x @ A @ B`). docs/designs.md has the variants, their init and the push form.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel.config_lib import BOOL, POSITIVE, field, is_int, one_of, require
from laurel.designs.protocol import Chain, Design, Site, per_site, register, scaled

COMPONENTS = ('rw', 'lr', 'pa')


def _is_variant(v) -> bool:
  parts = v.split('+') if isinstance(v, str) else [None]
  return all(p in COMPONENTS for p in parts) and len(set(parts)) == len(parts)


@dataclasses.dataclass(frozen=True)
class LaurelSpec:
  """`model.laurel`, the config of design 'laurel'."""
  variant: str = field('rw+lr', (_is_variant, f"must be a '+'-joined subset of {', '.join(COMPONENTS)}"))
  rank: int = 32  # r, for LR and low-rank PA; checked against d_model in check_sizes
  k: int = 3  # number of previous activations for PA (x_i counts as one)
  rw_norm: str = field('softmax', one_of('softmax', 'sigmoid'))  # over (α, β), or one parameter
  rw_scale: float = field(2.0, POSITIVE)  # α, β = rw_scale·normalise(w); 2 makes α = β = 1 at init
  rw_per_dim: bool = field(False, BOOL)  # §2.4: α, β are D-vectors
  a_init: str = field('column_orthogonal', one_of('column_orthogonal', 'xavier'))  # §3.3
  pa_h: str = field('identity', one_of('identity', 'low_rank'))  # h_i of eq. 4; with LR, eq. 6's pairs
  # 'gemma3n': LR on the normed input, RMSNorm on its output, the sum scaled by 1/√2, A and B from N(0, 0.02²)
  form: str = field('paper', one_of('paper', 'gemma3n'))
  # LM: one site per block, per sublayer, or on attention only with a plain residual around the MLP (Gemma 3n)
  site: str = field('block', one_of('block', 'sublayer', 'attention'))

  components = property(lambda self: frozenset(self.variant.split('+')))
  rw = property(lambda self: 'rw' in self.components)
  lr = property(lambda self: 'lr' in self.components)
  pa = property(lambda self: 'pa' in self.components)
  low_rank = property(lambda self: self.lr or (self.pa and self.pa_h == 'low_rank'))  # reads rank and a_init
  history_len = property(lambda self: self.k - 1 if self.pa else 0)  # running sums a chain carries: PA's k − 1

  def check(self, prefix: str) -> None:
    require(self.form != 'gemma3n' or (self.lr and not self.pa), f'{prefix}.form', self.form,
            "'gemma3n' needs a variant with lr and without pa")

  def check_sizes(self, d_model: int, num_sites: int, prefix: str) -> None:
    require(not self.low_rank or (is_int(self.rank) and 1 <= self.rank <= d_model), f'{prefix}.rank', self.rank,
            f'must be an integer in [1, d_model={d_model}]')
    require(not self.pa or (is_int(self.k) and 1 <= self.k <= num_sites), f'{prefix}.k', self.k,
            f'must be an integer in [1, number of LAuReL sites={num_sites}]')

  def label(self) -> str:
    """How a run's first line names it: 'laurel rw+lr r=8'."""
    details = [f'r={self.rank}'] * self.low_rank + [f'k={self.k}'] * self.pa
    return ' '.join(['laurel', self.variant, *details, *[f'form={self.form}'] * (self.form != 'paper')])

  def unused_fields(self, prefix: str) -> dict[str, str]:
    """{field: why} of the fields that change nothing for this variant, so a sweep over one can be refused."""
    variant = f'{prefix}.variant={self.variant!r}'
    checks = {'k': (not self.pa, f'{variant} has no pa'),
              'pa_h': (not self.pa or self.lr, f"{variant}: h is used by pa without lr (with lr, eq. 6's pairs)"),
              'rank': (not self.low_rank, f"{variant} has no low-rank part (lr, or pa with pa_h='low_rank')"),
              'a_init': (not self.low_rank, f'{variant} has no low-rank part'),
              **{name: (not self.rw, f'{variant} has no rw') for name in ('rw_norm', 'rw_scale', 'rw_per_dim')}}
    if self.low_rank and self.form == 'gemma3n':
      checks['a_init'] = (True, f"{prefix}.form='gemma3n' draws A from N(0, 0.02²)")
    return {f'{prefix}.{name}': why for name, (no_effect, why) in checks.items() if no_effect}


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


def _xavier_init(key, shape, dtype=jnp.float32):
  """Xavier over A's last two axes; leading ones (eq. 6's k) are batch axes."""
  return nn.initializers.xavier_uniform(in_axis=-2, out_axis=-1, batch_axis=tuple(range(len(shape) - 2)))(
      key, shape, dtype)


def pending_start(spec: LaurelSpec, x):
  """A chain's `pending` at its first site, all zero: PA's k − 1 running sums (B, L, D), or under eq. 6 what sites
  0, …, k − 2 got from before the chain, messages (B, L, (k−1−t)·r) and their γ·B matrices ((k−1−t)·r, D)."""
  if spec.pa and spec.lr:
    width = lambda t: (spec.k - 1 - t) * spec.rank
    return tuple((jnp.zeros(x.shape[:-1] + (width(t),), x.dtype), jnp.zeros((width(t), x.shape[-1]), jnp.float32))
                 for t in range(spec.k - 1))
  return tuple(jnp.zeros_like(x) for _ in range(spec.history_len))


class ChainRW(Chain):
  """RW's weights of a chain's sites, (α_NxT, β_NxTxK): β[i, j] = β_{i+j}, the receiver's β of site i's term j (0
  past the end); K = k under PA, else 1. None without RW."""
  module_name = 'laurel_rw'

  @nn.compact
  def __call__(self):
    s = self.spec
    if not s.rw:
      return None
    num_sites = self.num_layers * self.sites_per_layer
    shape, names = (num_sites,), ('laurel_sites',)
    if s.rw_norm == 'softmax':  # one weight for α, one for β
      shape, names = shape + (2,), names + ('laurel_rw',)
    if s.rw_per_dim:
      shape, names = shape + (self.features,), names + (self.embed_axis,)
    w = self.make('rw_w', nn.initializers.zeros, shape, names).astype(jnp.float32)
    if s.rw_norm == 'softmax':  # §2.1: α, β = rw_scale·softmax(w), or rw_scale·(σ(w), σ(−w))
      alpha_S, beta_S = jnp.moveaxis(s.rw_scale * jax.nn.softmax(w, axis=1), 1, 0)
    else:
      alpha_S, beta_S = s.rw_scale * jax.nn.sigmoid(w), s.rw_scale * jax.nn.sigmoid(-w)
    k = s.k if s.pa else 1
    padded = jnp.concatenate([beta_S, jnp.zeros((k - 1,) + beta_S.shape[1:], beta_S.dtype)])
    beta_SxK = jnp.stack([padded[j:j + num_sites] for j in range(k)], axis=1)
    return tuple(a.reshape((self.num_layers, self.sites_per_layer) + a.shape[1:]) for a in (alpha_S, beta_SxK))


class LaurelSite(Site):
  """x_{i+1} = α·f(x_i) + g(x_i, …, x_0) (eq. 2); carry (x_i, pending), α folded into f.

  PA runs in push form: site i sends γ_j·h_j(x_i) to sites i, …, i+k−1 through `pending`, the k − 1 running sums
  the chain carries, so its γ_j, A_j, B_j are the paper's γ_{i+j,j}, A_{i+j,j}, B_{i+j,j}. β is folded into B and γ
  (autodiff would keep an activation it multiplies), but for decode, where it scales the few tokens instead of B.
  """

  def setup(self):
    s, d, param = self.spec, self.features, self.make
    # Gemma 3n draws A and B as every linear map: with B = 0 the RMSNorm on x·A·B would start at its 1/√eps slope.
    a_init, b_init = ((nn.initializers.normal(0.02),) * 2 if s.form == 'gemma3n'
                      else (column_orthogonal_init if s.a_init == 'column_orthogonal' else _xavier_init,
                            nn.initializers.zeros))
    low_rank = lambda name, lead, lead_names: (
        param(f'{name}_a', a_init, lead + (d, s.rank), lead_names + (self.embed_axis, 'laurel_rank')),
        param(f'{name}_b', b_init, lead + (s.rank, d), lead_names + ('laurel_rank', self.embed_axis)))
    if s.pa:
      # Identity h starts with γ = 0, low-rank h with γ = 1 and B = 0 (both 0 would leave both without gradient).
      self.pa_gamma = param('pa_gamma', nn.initializers.ones if s.low_rank else nn.initializers.zeros,
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

  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    x, pending = carry
    alpha, beta_K = (None, None) if chain_l is None else (chain_l[0][self.t], chain_l[1][self.t])
    x_normed = norm_in(x)
    out, pending = self.residual(fn(x, x_normed, alpha), x, pending, beta_K, x_normed)
    return nn.with_logical_constraint(norm_out(out), self.axes), pending

  def residual(self, afx, x, pending, beta_K, x_normed):
    """(x_{i+1}, pending') from afx = α·f(x_i)."""
    beta = None if beta_K is None else beta_K[0]
    g_rest = None  # g besides β·x_i; without PA, pending passes on (a plain spec inside a PA chain)
    if self.spec.pa:
      g_rest, pending = self._pa_term(x, pending, beta_K)
    elif self.spec.lr and self.spec.form == 'gemma3n':  # β·(norm(x) + RMSNorm(norm(x) A B))
      lr_out = self.lr_norm(x_normed @ self.lr_a.astype(x.dtype) @ self.lr_b.astype(x.dtype)).astype(x.dtype)
      g_rest = scaled(x_normed + lr_out, beta)
    elif self.spec.lr:  # eq. 3/5: x A (βB)
      g_rest = self._low_rank(x, self.lr_a, self.lr_b, beta)
    return self._combine(afx, x, beta, g_rest), pending

  def _pa_term(self, x, pending, beta_K):
    """(the PA sum site i receives, pending')."""
    s = self.spec
    if len(pending) != s.k - 1:
      raise ValueError(f'PA needs k-1={s.k - 1} pending sums, got {len(pending)}')
    if s.lr:
      return self._pa_pairs(x, pending, None if beta_K is None else beta_K[0])
    receiver_beta = lambda j: None if beta_K is None else beta_K[j]
    # eq. 4; identity h: β folded into γ; low-rank h: the receiver applies h (and β) to the sum
    identity = s.pa_h != 'low_rank'
    sent = [self._gamma(j, receiver_beta(j) if identity else None).astype(x.dtype) * x for j in range(s.k)]
    received = sent[0] + pending[0] if pending else sent[0]
    pending = tuple(p + c for p, c in zip(pending[1:], sent[1:-1])) + tuple(sent[-1:]) if s.k > 1 else ()
    if s.pa_h == 'low_rank':  # h reads the whole received sum: one activation kept per site
      received = self._low_rank(received, self.pa_a, self.pa_b, receiver_beta(0))
    return received, pending

  def _pa_pairs(self, x, pending, beta):
    """Eq. 6's β_i·Σ_j γ_{i,j} (x_{i−j} A_{i,j}) B_{i,j} at site i as one (…, k·r) @ (k·r, D) product. x_{i−j} enters
    only through its rank-r message x_{i−j} A_{i,j}, so site i sends x_i A_j with γ_j B_j (j < k); pending[t] holds
    the messages and matrices site i + t got from the sites before i, (…, (k−1−t)·r) and ((k−1−t)·r, D)."""
    k, a_KxDxR = self.spec.k, self.pa_a.astype(x.dtype)
    if self.decode:  # k products batched over k: one D → k·r product would copy A to D × k·r per step
      xa_Kx_R = jnp.einsum('k...d,kdr->k...r', jnp.broadcast_to(x, (k,) + x.shape), a_KxDxR)
      sent = [xa_Kx_R[j] for j in range(k)]
    else:
      xa_KxR = jnp.einsum('...d,kdr->...kr', x, a_KxDxR)
      sent = [xa_KxR[..., j, :] for j in range(k)]
    gb_KxRxD = self.pa_gamma.astype(jnp.float32)[:, None, None] * self.pa_b.astype(jnp.float32)
    messages = jnp.concatenate([sent[0], *[m for m, _ in pending[:1]]], axis=-1)
    gb = jnp.concatenate([gb_KxRxD[0], *[b for _, b in pending[:1]]], axis=0)
    received = (scaled(messages @ gb.astype(x.dtype), beta) if self.decode
                else messages @ (gb if beta is None else gb * beta).astype(x.dtype))
    later = tuple(pending[1:]) + ((x[..., :0], gb[:0]),)  # what sites i + 1, … got before, then their share of i's
    pending = tuple((jnp.concatenate([m, sent[t + 1]], axis=-1), jnp.concatenate([b, gb_KxRxD[t + 1]], axis=0))
                    for t, (m, b) in enumerate(later[:k - 1]))
    return received, pending

  def _gamma(self, j, beta):
    """γ_j (times β where given) in float32: a scalar, or a D-vector when β is per dimension."""
    gamma = self.pa_gamma[j].astype(jnp.float32)
    return gamma if beta is None else gamma * beta

  def _low_rank(self, x, a, b, beta):
    """β·(x A B). On TPU x (A βB), one D × D product: the two thin products' backward makes its compiler lay the
    stream's gradient out two ways and copy it, and a rank-r product fills the MXU no better than a wider one (281M
    estimated cycles for the paper's LR row instead of 293M on v6e). Elsewhere (x A)(βB), 2r/D of the FLOPs; for
    decode (x A) B on the few tokens, times β."""
    if self.decode:
      return scaled(x @ a.astype(x.dtype) @ b.astype(x.dtype), beta)
    b = b if beta is None else b * beta
    folded = lambda: x @ (a @ b).astype(x.dtype)
    thin = lambda: x @ a.astype(x.dtype) @ b.astype(x.dtype)
    return jax.lax.platform_dependent(tpu=folded, default=thin)

  def _combine(self, afx, x, beta, g_rest):
    """β·x_i + α·f(x_i) + the rest of g, times Gemma 3n's 1/√2. In f's dtype where wider (post-norm's f = block(x) −
    x in float32, which x + f(x) then undoes exactly), rounded to x's once."""
    dtype = jnp.result_type(x, afx)
    out = scaled(x.astype(dtype), beta) + afx
    if g_rest is not None:
      out = out + g_rest.astype(dtype)
    if self.spec.form == 'gemma3n':
      out = out * (1.0 / math.sqrt(2.0))
    return nn.with_logical_constraint(out.astype(x.dtype), self.axes)


def _diagnostics(spec, chain, sites) -> dict:
  """Per site: RW's α and the site's own β (per-dimension ones as their mean over D), and PA's γ_j, what site i
  sends to site i + j (the paper's γ_{i+j,j})."""
  out = {}
  if chain is not None:  # RW: ChainRW's (α_NxT, β_NxTxK), per dimension with a last axis D
    alpha, beta = chain[0].astype(jnp.float32), chain[1][:, :, 0].astype(jnp.float32)
    if spec.rw_per_dim:
      alpha, beta = alpha.mean(-1), beta.mean(-1)
    out.update(alpha=per_site(alpha), beta=per_site(beta))
  if spec.pa:
    out['gamma'] = per_site(sites['pa_gamma'].astype(jnp.float32))
  return out


register(Design('laurel', LaurelSite, config=LaurelSpec, placement=lambda spec: spec.site,
                chain=ChainRW, post_norm=True, per_bottleneck=True,
                check=lambda spec, prefix, num_layers, width, sites: spec.check_sizes(width, sites, prefix),
                start=lambda spec, x, num_layers: (x, pending_start(spec, x)),
                finish=lambda spec, carry: carry[0], no_decay=('rw_w', 'pa_gamma'), diagnostics=_diagnostics,
                logical_axes=(('laurel_rank', None), ('laurel_k', None), ('laurel_rw', None), ('laurel_sites', None))))
