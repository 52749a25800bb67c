"""Tests of LAuReL (laurel/designs/laurel.py) beyond its registry tests (test_designs.py runs every variant's
chain against eqs. 2–6 and its init claim): pinned values, the initialisers (§3.3), parameter counts (§2, Table 4)
and `model.laurel` validation.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import design_chain
from laurel import config_lib
from laurel.designs import scaled
from laurel.designs.laurel import (ChainRW, LaurelSite, LaurelSpec, closed_form_params, column_orthogonal_init,
                                   pending_start)
from reference import REFERENCES, np_rmsnorm

D, RANK, BATCH, LEN = 16, 4, 2, 3



def _spec(variant, **kw):
  kw.setdefault('rank', RANK)
  return LaurelSpec(variant=variant, **kw)


class _Site(nn.Module):
  """One site, the first of its chain: RW's weights from a one-site ChainRW, α applied to f(x) by `scaled`, the
  normed input xn given."""
  spec: LaurelSpec

  @nn.compact
  def __call__(self, fx, x, pending, xn):
    chain_l = jax.tree.map(lambda a: a[0], ChainRW(self.spec, 1, 1, x.shape[-1], name='rw')())  # layer 0's
    return LaurelSite(self.spec, x.shape[-1], name='site')(
        (x, tuple(pending)), lambda x, xn, scale: scaled(fx, scale), lambda _: xn, lambda y: y, chain_l)[0]


def _inputs(spec, seed, d=D):
  """Random fx, x and x_normed, each (B, L, D) float32, and PA's pending sums (zero: a chain's start)."""
  rng = np.random.default_rng(seed)
  draw = lambda: rng.normal(size=(BATCH, LEN, d)).astype(np.float32)
  fx_BxLxD, x_BxLxD, xn_BxLxD = draw(), draw(), draw()
  pending = list(pending_start(spec, x_BxLxD))
  return fx_BxLxD, x_BxLxD, pending, xn_BxLxD


def _init(spec, d=D, seed=0):
  """The site's (boxed) params: {'rw': ChainRW's, 'site': LaurelSite's}, each present where used."""
  fx, x, pending, xn = _inputs(spec, 0, d)
  return _Site(spec).init(jax.random.key(seed), fx, x, pending, xn).get('params', {})


def _build(cfg, field='model.laurel'):
  """LaurelSpec from config values, checked as in a model of 4 sites of width D."""
  spec = config_lib.build(LaurelSpec, cfg, field)
  spec.check_sizes(D, 4, field)
  return spec


def _site_params(spec, d=D, seed=0):
  return nn.unbox(_init(spec, d, seed)).get('site', {})


def _apply(spec, params, fx, x, pending, xn):
  return np.asarray(_Site(spec).apply({'params': params}, fx, x, pending, xn))


def _perturb(params, seed, scale=0.5):
  """Moves every parameter away from its initial value by N(0, scale²) noise."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: p + jnp.asarray(rng.normal(0, scale, p.shape), p.dtype), nn.unbox(params))


def _num_params(params):
  return sum(int(np.size(p)) for p in jax.tree.leaves(nn.unbox(params)))


# ---------------------------------------------------------------------------------------------------
# Forward values.

def test_rw_softmax_pinned_value_D():
  # w = (log 3, 0): softmax = (3/4, 1/4); rw_scale 2 gives α = 1.5, β = 0.5.
  spec = _spec('rw')
  params = {'rw': {'rw_w': jnp.asarray([[math.log(3.0), 0.0]], jnp.float32)}}
  fx_D, x_D = np.array([1.0, 2.0], np.float32), np.array([4.0, -8.0], np.float32)
  out_D = _apply(spec, params, fx_D, x_D, [], x_D)
  np.testing.assert_allclose(out_D, [1.5 * 1 + 0.5 * 4, 1.5 * 2 - 0.5 * 8], rtol=1e-6)


def test_rw_sigmoid_alpha_plus_beta_is_scale_D():
  # σ(w) + σ(−w) = 1: with fx = x the output is rw_scale·x for any w.
  spec = _spec('rw', rw_norm='sigmoid', rw_per_dim=True, rw_scale=3.0)
  rng = np.random.default_rng(0)
  params = {'rw': {'rw_w': jnp.asarray(rng.normal(size=(1, D)), jnp.float32)}}
  x_D = rng.normal(size=(D,)).astype(np.float32)
  out_D = _apply(spec, params, x_D, x_D, [], x_D)
  np.testing.assert_allclose(out_D, 3.0 * x_D, rtol=1e-6, atol=1e-6)


def test_pa_needs_k_minus_1_pending_sums():
  spec = _spec('pa', k=3)
  fx, x, pending, xn = _inputs(spec, seed=0)
  with pytest.raises(ValueError, match='k-1=2 pending'):
    _Site(spec).init(jax.random.key(0), fx, x, pending[:1], xn)


# ---------------------------------------------------------------------------------------------------
# The chain.

def test_chain_rw_receiver_betas_pinned_SxK():
  # β_SxK[i, j] = β_{i+j}, zero past the last site; α, β from each site's own w (§2.1).
  spec = _spec('rw+pa', k=3)
  w_Sx2 = jnp.asarray([[math.log(3.0), 0.0], [0.0, 0.0], [0.0, math.log(3.0)]], jnp.float32)
  alpha_NxT, beta_NxTxK = ChainRW(spec, 3, 1, D).apply({'params': {'rw_w': w_Sx2}})
  np.testing.assert_allclose(alpha_NxT[:, 0], [1.5, 1.0, 0.5], rtol=1e-6)
  np.testing.assert_allclose(beta_NxTxK[:, 0], [[0.5, 1.0, 1.5], [1.0, 1.5, 0.0], [1.5, 0.0, 0.0]], rtol=1e-6)
  # Grouped by layer, the flat site index runs across layers: 3 layers of 2 sites, β_{i+j} past a layer's end.
  w_Sx2 = jnp.asarray(np.random.default_rng(0).normal(size=(6, 2)), jnp.float32)
  flat = ChainRW(spec, 6, 1, D).apply({'params': {'rw_w': w_Sx2}})
  grouped = ChainRW(spec, 3, 2, D).apply({'params': {'rw_w': w_Sx2}})
  for a, b in zip(flat, grouped):
    np.testing.assert_array_equal(a.reshape(b.shape), b)


# ---------------------------------------------------------------------------------------------------
# Initialisation.

@pytest.mark.parametrize('variant', ['lr', 'rw+lr'])
def test_gemma3n_starts_as_gemma3n_initialises_it_BxLxD(variant):
  # Gemma 3n draws A and B as N(0, 0.02²) (B = 0 would put the RMSNorm on x·A·B at its 1/√eps slope), so the
  # block starts at (x + f(x) + x_normed + RMSNorm(x_normed·A·B)) / √2: a documented departure.
  spec = _spec(variant, form='gemma3n', rank=8)
  fx, x, history, xn = _inputs(spec, seed=6)
  params = _init(spec)
  site = _site_params(spec)
  a, b = (np.asarray(site[name], np.float64) for name in ('lr_a', 'lr_b'))
  for w in (a, b):
    assert np.all(w != 0) and 0.015 < w.std() < 0.025
  low_rank = np_rmsnorm(xn @ a @ b, np.asarray(site['lr_norm']['scale']))
  out_BxLxD = _apply(spec, params, fx, x, history, xn)
  np.testing.assert_allclose(out_BxLxD, (x + fx + xn + low_rank) / math.sqrt(2.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('d,r', [(4, 2), (16, 4), (10, 3), (8, 8), (5, 1)])
def test_column_orthogonal_init_values_DxR(d, r):
  a_DxR = np.asarray(column_orthogonal_init(jax.random.key(0), (d, r)))
  assert a_DxR.shape == (d, r) and a_DxR.dtype == np.float32
  for i in range(d):
    for j in range(r):
      want = 1.0 / math.sqrt(r * d) if i % r == j else 0.0
      assert a_DxR[i, j] == pytest.approx(want, rel=1e-6, abs=0.0), (i, j)
  gram_RxR = a_DxR.T @ a_DxR  # columns are orthogonal
  np.testing.assert_allclose(gram_RxR - np.diag(np.diag(gram_RxR)), 0.0, atol=1e-7)


def test_column_orthogonal_init_pinned_4x2():
  c = 1.0 / math.sqrt(8.0)
  np.testing.assert_allclose(np.asarray(column_orthogonal_init(None, (4, 2))),
                             [[c, 0], [0, c], [c, 0], [0, c]], rtol=1e-7)


def test_column_orthogonal_init_stacked_KxDxR():
  a_KxDxR = np.asarray(column_orthogonal_init(jax.random.key(0), (3, 16, 4), jnp.bfloat16))
  assert a_KxDxR.shape == (3, 16, 4) and a_KxDxR.dtype == jnp.bfloat16
  want_DxR = np.asarray(column_orthogonal_init(None, (16, 4)), np.float32)
  for j in range(3):
    np.testing.assert_allclose(a_KxDxR[j].astype(np.float32), want_DxR, rtol=1e-2)


@pytest.mark.parametrize('variant,a_name,b_name', [('lr', 'lr_a', 'lr_b'), ('pa', 'pa_a', 'pa_b'),
                                                   ('rw+lr+pa', 'pa_a', 'pa_b')])
def test_init_uses_column_orthogonal_a_and_zero_b(variant, a_name, b_name):
  spec = _spec(variant, k=3, pa_h='low_rank')
  params = _site_params(spec)
  a, b = np.asarray(params[a_name]), np.asarray(params[b_name])
  want_DxR = np.asarray(column_orthogonal_init(None, (D, RANK)))
  np.testing.assert_array_equal(a, np.broadcast_to(want_DxR, a.shape))
  np.testing.assert_array_equal(b, 0.0)
  if spec.pa:  # γ = 1 with low-rank h (B = 0 already zeroes the sum); γ = 0 with identity h
    np.testing.assert_array_equal(np.asarray(params['pa_gamma']), np.ones(spec.k))
  identity = _site_params(_spec('pa', k=3))
  np.testing.assert_array_equal(np.asarray(identity['pa_gamma']), np.zeros(3))


@pytest.mark.parametrize('variant,a_name', [('lr', 'lr_a'), ('rw+lr+pa', 'pa_a')])
def test_xavier_init_scale_DxR(variant, a_name):
  # Xavier uniform on A (D×r): limit sqrt(6 / (D + r)); eq. 6's leading k axis is a batch axis.
  d, r = 64, 8
  spec = _spec(variant, rank=r, k=3, a_init='xavier')
  a = np.asarray(_site_params(spec, d=d, seed=7)[a_name])
  assert a.shape[-2:] == (d, r)
  limit = math.sqrt(6.0 / (d + r))
  assert np.abs(a).max() <= limit
  assert np.abs(a).max() > 0.9 * limit
  assert a.std() == pytest.approx(limit / math.sqrt(3.0), rel=0.15)


# ---------------------------------------------------------------------------------------------------
# Parameter counts (§2, Table 4): numbers written out for D = 16, r = 4.

PARAM_COUNTS = [
    # (id, spec, extra params per site)
    ('rw_softmax', _spec('rw'), 2),
    ('rw_sigmoid', _spec('rw', rw_norm='sigmoid'), 1),
    ('rw_softmax_per_dim', _spec('rw', rw_per_dim=True), 32),  # 2D
    ('rw_sigmoid_per_dim', _spec('rw', rw_norm='sigmoid', rw_per_dim=True), 16),  # D
    ('lr', _spec('lr'), 128),  # 2rD
    ('lr_rank1', _spec('lr', rank=1), 32),
    ('pa_identity_k1', _spec('pa', k=1), 1),  # k
    ('pa_identity_k3', _spec('pa', k=3), 3),
    ('pa_low_rank_k1', _spec('pa', pa_h='low_rank', k=1), 129),  # 2rD + k
    ('pa_low_rank_k3', _spec('pa', pa_h='low_rank', k=3), 131),
    ('rw_lr', _spec('rw+lr'), 130),  # 2rD + 2
    ('rw_pa_identity_k3', _spec('rw+pa', k=3), 5),
    ('rw_pa_low_rank_k3', _spec('rw+pa', pa_h='low_rank', k=3), 133),
    ('lr_pa_k3', _spec('lr+pa', k=3), 387),  # eq. 6 without RW: 2rkD + k
    ('rw_lr_pa_k1', _spec('rw+lr+pa', k=1), 131),  # 2rkD + k + 2
    ('rw_lr_pa_k3', _spec('rw+lr+pa', k=3), 389),
    ('rw_lr_pa_k3_per_dim', _spec('rw+lr+pa', k=3, rw_per_dim=True), 419),  # 2rkD + k + 2D
    ('gemma3n_lr', _spec('lr', form='gemma3n'), 144),  # 2rD + D (RMSNorm scale)
    ('gemma3n_rw_lr', _spec('rw+lr', form='gemma3n'), 146),
]


@pytest.mark.parametrize('spec,expected', [(s, n) for _, s, n in PARAM_COUNTS], ids=[i for i, _, _ in PARAM_COUNTS])
def test_param_count_matches_closed_form(spec, expected):
  assert closed_form_params(spec, D) == expected
  assert _num_params(_init(spec)) == expected


@pytest.mark.parametrize('case', list(REFERENCES['laurel'].cases))
def test_chain_param_count_is_the_closed_form_per_site(case):
  spec = REFERENCES['laurel'].cases[case]
  params = design_chain.init('laurel', spec)
  assert _num_params(params) == design_chain.LAYERS * design_chain.T * closed_form_params(spec, design_chain.D)


def test_param_count_closed_form_table5_shape():
  # D = 768, r = 32, k = 3: the per-site numbers behind Table 5.
  at = lambda variant, **kw: closed_form_params(LaurelSpec(variant=variant, rank=32, k=3, **kw), 768)
  assert at('rw') == 2
  assert at('lr') == 49_152
  assert at('pa') == 3
  assert at('rw+lr') == 49_154
  assert at('rw+lr+pa') == 147_461


# ---------------------------------------------------------------------------------------------------
# Validation: ValueError naming `model.laurel.<field>` and the value.

BAD_SPECS = [
    # (id, overrides, field, value as it appears in the message)
    ('rank_0', dict(variant='lr', rank=0), 'rank', '0'),
    ('rank_negative', dict(variant='rw+lr', rank=-3), 'rank', '-3'),
    ('rank_above_d', dict(variant='lr', rank=D + 1), 'rank', str(D + 1)),
    ('rank_float', dict(variant='lr', rank=4.0), 'rank', '4.0'),
    ('rank_bool', dict(variant='lr', rank=True), 'rank', 'True'),
    ('k_bool', dict(variant='pa', k=True), 'k', 'True'),
    ('rw_per_dim_string', dict(variant='rw', rw_per_dim='yes'), 'rw_per_dim', "'yes'"),
    ('rw_scale_bool', dict(variant='rw', rw_scale=True), 'rw_scale', 'True'),
    ('rank_0_low_rank_pa', dict(variant='pa', pa_h='low_rank', rank=0), 'rank', '0'),
    ('rank_above_d_eq6', dict(variant='rw+lr+pa', k=2, rank=D + 1), 'rank', str(D + 1)),
    ('k_0', dict(variant='pa', k=0), 'k', '0'),
    ('k_above_sites', dict(variant='pa', k=5), 'k', '5'),
    ('k_above_sites_eq6', dict(variant='rw+lr+pa', k=5), 'k', '5'),
    ('variant_unknown_component', dict(variant='rw+xx'), 'variant', "'rw+xx'"),
    ('variant_foo', dict(variant='foo'), 'variant', "'foo'"),
    ('variant_duplicate', dict(variant='rw+rw'), 'variant', "'rw+rw'"),
    ('variant_empty', dict(variant=''), 'variant', "''"),
    ('variant_trailing_plus', dict(variant='lr+'), 'variant', "'lr+'"),
    ('variant_none', dict(variant='none'), 'variant', "'none'"),  # design 'residual' is the plain residual
    ('rw_norm', dict(variant='rw', rw_norm='tanh'), 'rw_norm', "'tanh'"),
    ('rw_scale_0', dict(variant='rw', rw_scale=0.0), 'rw_scale', '0.0'),
    ('a_init', dict(variant='lr', a_init='orthogonal'), 'a_init', "'orthogonal'"),
    ('pa_h', dict(variant='pa', pa_h='mlp'), 'pa_h', "'mlp'"),
    ('form', dict(variant='lr', form='gemma'), 'form', "'gemma'"),
    ('form_gemma3n_without_lr', dict(variant='rw', form='gemma3n'), 'form', "'gemma3n'"),
    ('form_gemma3n_with_pa', dict(variant='lr+pa', k=2, form='gemma3n'), 'form', "'gemma3n'"),
    ('site', dict(variant='lr', site='layer'), 'site', "'layer'"),
]


@pytest.mark.parametrize('overrides,field,value', [b[1:] for b in BAD_SPECS], ids=[b[0] for b in BAD_SPECS])
def test_from_config_rejects_bad_value(overrides, field, value):
  with pytest.raises(ValueError) as info:
    _build({'rank': RANK, **overrides})
  assert f'model.laurel.{field}={value}' in str(info.value)


def test_from_config_rejects_unknown_field():
  with pytest.raises(ValueError, match=r'model\.laurel\.rnak: unknown field'):
    _build({'variant': 'lr', 'rnak': 4})


def test_from_config_names_custom_field_prefix():
  with pytest.raises(ValueError, match=r"model\.blocks\.laurel\.variant='xx'"):
    _build({'variant': 'xx'}, 'model.blocks.laurel')


@pytest.mark.parametrize('overrides', [
    dict(variant='rw', rank=10 * D),  # rank unused without LR or low-rank PA
    dict(variant='pa', pa_h='identity', rank=0),
    dict(variant='lr', k=0),  # k unused without PA
    dict(variant='pa', k=4),  # k equal to the number of sites is allowed
    dict(variant='lr', rank=D),  # r = D is allowed
], ids=['rank_unused_rw', 'rank_unused_pa_identity', 'k_unused_lr', 'k_equals_sites', 'rank_equals_d'])
def test_from_config_accepts_boundary_and_unused_values(overrides):
  overrides = {'rank': RANK, **overrides}
  spec = _build(overrides)
  assert spec == LaurelSpec(**overrides)
