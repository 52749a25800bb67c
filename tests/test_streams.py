"""Tests of the stream designs (laurel/designs: scale, hyper, denseformer) beyond their registry tests
(test_designs.py runs every design's chain against its NumPy reference and its init claim): gradients through the
layer scan, the site-dependent inits, mHC's manifold, and the validation of each design's section `model.<design>`.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from design_chain import BATCH, D, LAYERS, LEN, T, Net, inputs, randomize, rms, stacked, toy_fn
from design_chain import init as chain_init
from laurel import designs, lm, train_config
from laurel.designs import StreamSpec
from laurel.designs.hyper import MHCSite, sinkhorn
from reference import STREAM_CASES, np_sigmoid, np_sinkhorn

N_STREAMS = 3


def _build(design='residual', **sections):
  """The design config an LM of LAYERS layers builds from `model.stream.design` and the sections `model.<name>`."""
  return lm.LMConfig.from_config({'num_layers': LAYERS, 'stream': {'design': design}, **sections}).stream


def _init(spec):
  return chain_init(spec.design, spec)


# ---------------------------------------------------------------------------------------------------
# Gradients through the layer scan.

@pytest.mark.parametrize('name', ['hc_dynamic', 'mhc_n2_iters5', 'denseformer_2x2'])
@pytest.mark.slow
def test_scan_gradients_match_loop(name):
  spec = STREAM_CASES[name]
  params = randomize(_init(spec), seed=2)
  x, ws = inputs()
  def grad(p, scan):  # one compile each, not op by op
    loss = lambda p: jnp.sum(Net(spec.design, spec, scan).apply({'params': p}, x, ws) ** 2)
    return jax.jit(jax.grad(loss))(p)
  loop, scanned = stacked(grad(params, False)), grad(stacked(params), True)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(scanned))
  # float32 sums of large terms: compare against each array's largest entry
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(a).max()), loop, scanned)


# ---------------------------------------------------------------------------------------------------
# Initialisation whose values depend on the site.

def test_hc_chain_init_is_onehot_at_global_site_mod_n_NxTxN():
  # eq. 14: A_m^k = e_{k mod n}, k the site index over the whole network (two sites per layer).
  a_m = np.asarray(_init(StreamSpec(design='hc', expansion=3))['chain']['a_m'])
  assert a_m.shape == (LAYERS, T, 3)
  np.testing.assert_array_equal(a_m.argmax(-1), [[0, 1], [2, 0], [1, 2], [0, 1]])
  np.testing.assert_array_equal(a_m.sum(-1), 1.0)
  site = _init(StreamSpec(design='hc', expansion=3))['layers_2']['site1']
  np.testing.assert_array_equal(site['a_r'], np.eye(3))
  np.testing.assert_array_equal(site['b'], np.ones(3))


def test_mhc_init_coefficients_NxTxN():
  spec = StreamSpec(design='mhc', expansion=4)
  params = _init(spec)
  h_pre = np_sigmoid(np.asarray(params['chain']['b_pre'], np.float64))
  np.testing.assert_allclose(h_pre.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(h_pre.argmax(-1), np.arange(LAYERS * T).reshape(LAYERS, T) % 4)
  np.testing.assert_allclose(h_pre.max(-1), (1 / 4 + 1) / 2, rtol=1e-6)
  site = params['layers_0']['site0']
  np.testing.assert_array_equal(site['phi'], 0.0)
  np.testing.assert_allclose(site['alpha'], 0.01)  # Table 5's gating factor init
  np.testing.assert_allclose(np_sinkhorn(np.asarray(site['b_res'], np.float64), 20), (np.eye(4) + 0.25) / 2,
                             rtol=1e-6)


@pytest.mark.slow
def test_mhc_init_tilt_breaks_stream_symmetry():
  # Why H_pre starts tilted to stream k mod n: with equal streams, φ = 0 and a uniform H_pre = 1/n, every stream
  # gets the same gradient (b_post's entries agree), so the streams would never part.
  spec = StreamSpec(design='mhc', expansion=N_STREAMS, sinkhorn_iters=4)  # H_res's iterations play no part here
  x, ws = inputs()
  grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(Net(spec.design, spec).apply({'params': p}, x, ws)))))
  spread = lambda p: np.ptp(grad(p)['layers_1']['site0']['b_post'])  # one compile for both, not op by op
  params = _init(spec)
  uniform = {**params, 'chain': {'b_pre': jnp.full_like(params['chain']['b_pre'], -np.log(N_STREAMS - 1))}}
  assert spread(params) > 0.1 and spread(uniform) < 1e-5


@pytest.mark.parametrize('k,p', [(1, 1), (2, 1), (1, 3), (2, 2), (3, 2), (4, 4)])
def test_denseformer_param_count_and_init(k, p):
  # §3.1: a full DenseFormer of depth d has d(d+3)/2 weights; DWAModules gives block i (i+1+k)//k of them.
  alpha = np.asarray(_init(StreamSpec(design='denseformer', dwa_dilation=k, dwa_period=p))['chain']['dwa_alpha'])
  assert alpha.size == sum((i + 1 + k) // k for i in range(LAYERS) if (i + 1) % p == 0)
  assert (k, p) != (1, 1) or alpha.size == LAYERS * (LAYERS + 3) // 2
  assert alpha.sum() == len([i for i in range(LAYERS) if (i + 1) % p == 0])  # one 1 per DWA block, at α_{i,i}


# ---------------------------------------------------------------------------------------------------
# mHC's manifold (eqs. 6 and 8).

def test_mhc_coefficients_are_on_the_manifold_NxBxL():
  spec = StreamSpec(design='mhc', expansion=4)
  rng = np.random.default_rng(3)
  h_NxBxLxD = jnp.asarray(rng.normal(size=(4, BATCH, LEN, D)), jnp.float32)
  site = MHCSite(spec, D, 0, T)
  fn = functools.partial(toy_fn, jnp.eye(D))
  params = randomize(nn.unbox(site.init(jax.random.key(0), h_NxBxLxD, fn, rms, None, jnp.zeros((1, 2, 4)))['params']),
                     seed=4, scale=0.3)
  b_pre = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
  h_pre, h_post, h_res = (np.asarray(a) for a in site.apply({'params': params}, h_NxBxLxD, b_pre,
                                                              method=MHCSite.coefficients))
  assert h_res.shape == (4, 4, BATCH, LEN) and h_pre.shape == h_post.shape == (4, BATCH, LEN)
  assert h_res.min() >= 0 and h_pre.min() >= 0 and h_post.min() >= 0 and h_pre.max() <= 1 and h_post.max() <= 2
  np.testing.assert_allclose(h_res.sum(0), 1.0, atol=1e-3)
  np.testing.assert_allclose(h_res.sum(1), 1.0, atol=1e-3)


def test_sinkhorn_matches_eq9_NxNxB():
  logits = np.random.default_rng(5).normal(size=(BATCH, 4, 4))
  got = np.moveaxis(np.asarray(sinkhorn(jnp.asarray(np.moveaxis(logits, 0, -1), jnp.float32), 20)), -1, 0)
  np.testing.assert_allclose(got, np_sinkhorn(logits, 20), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-3)


# ---------------------------------------------------------------------------------------------------
# Design sections: one-line ValueErrors naming `model.<section>.<field>` and the value.

BAD = [
    ('design', dict(design='dense'), 'stream.design', "'dense'"),
    ('design_module', dict(design='no_such_module:gated'), 'stream.design', "'no_such_module:gated'"),
    ('expansion_0', dict(design='hc', hc=dict(expansion=0)), 'hc.expansion', '0'),
    ('expansion_bool', dict(design='hc', hc=dict(expansion=True)), 'hc.expansion', 'True'),
    ('expansion_float', dict(design='mhc', mhc=dict(expansion=4.0)), 'mhc.expansion', '4.0'),
    ('mhc_expansion_1', dict(design='mhc', mhc=dict(expansion=1)), 'mhc.expansion', '1'),
    ('hc_dynamic_string', dict(design='hc', hc=dict(hc_dynamic='yes')), 'hc.hc_dynamic', "'yes'"),
    ('sinkhorn_iters_0', dict(design='mhc', mhc=dict(sinkhorn_iters=0)), 'mhc.sinkhorn_iters', '0'),
    ('layerscale_init_0', dict(layerscale=dict(layerscale_init=0.0)), 'layerscale.layerscale_init', '0.0'),
    ('layerscale_init_negative', dict(layerscale=dict(layerscale_init=-1e-5)), 'layerscale.layerscale_init',
     '-1e-05'),
    ('dwa_dilation_0', dict(denseformer=dict(dwa_dilation=0)), 'denseformer.dwa_dilation', '0'),
    ('dwa_period_float', dict(denseformer=dict(dwa_period=1.5)), 'denseformer.dwa_period', '1.5'),
    ('dwa_dilation_above_layers', dict(design='denseformer', denseformer=dict(dwa_dilation=LAYERS + 1)),
     'denseformer.dwa_dilation', '5'),
    ('dwa_period_above_layers', dict(design='denseformer', denseformer=dict(dwa_period=LAYERS + 1)),
     'denseformer.dwa_period', '5'),
]


@pytest.mark.parametrize('sections,name,value', [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_spec_rejects_bad_value(sections, name, value):
  with pytest.raises(ValueError) as info:
    _build(**sections)
  message = str(info.value)
  assert message.startswith(f'model.{name}={value}: ') and '\n' not in message


def test_spec_expansion_message_pinned():
  with pytest.raises(ValueError, match=r'^model\.hc\.expansion=0: must be a positive integer$'):
    _build('hc', hc={'expansion': 0})


@pytest.mark.parametrize('sections,message', [
    (dict(hc={'expanson': 2}), r'^model\.hc\.expanson: unknown field'),
    (dict(stream={'design': 'hc', 'expanson': 2}), r'^model\.stream\.expanson: unknown field \(known: design\)'),
    (dict(gated={'gate': 'scalar'}), r'^model\.gated: unknown field')], ids=['field', 'stream_field', 'section'])
def test_spec_rejects_unknown_field(sections, message):
  with pytest.raises(ValueError, match=message):
    lm.LMConfig.from_config({'num_layers': LAYERS, **sections})


@pytest.mark.parametrize('design,sections', [
    ('residual', {}), ('residual', dict(denseformer=dict(dwa_period=100))), ('hc', dict(hc=dict(expansion=1))),
    ('laurel', dict(laurel=dict(variant='pa', k=3))),
    ('denseformer', dict(denseformer=dict(dwa_dilation=LAYERS, dwa_period=LAYERS)))],
                         ids=['defaults', 'dwa_unused', 'hc_n1', 'laurel_pa', 'dwa_equal_layers'])
def test_spec_accepts(design, sections):
  assert _build(design, **sections) == StreamSpec(design, **sections.get(design, {}))


def _saved(**model):
  """The design config an LM builds from a saved config of `model`, upgraded as a resume and --config=WORKDIR read
  it."""
  return _build(**train_config.upgrade({'model': model})['model'])


def test_a_config_saved_with_every_field_in_model_stream_still_builds():
  old = {'design': 'mhc', 'expansion': 3, 'hc_dynamic': False, 'sinkhorn_iters': 5, 'mhc_readout': 'authors',
         'mhc_lite_init': 'plain', 'fractions': 2, 'layerscale_init': 1e-5, 'dwa_dilation': 1, 'dwa_period': 1,
         'attnres_block': 2, 'attnres_heads': 1, 'attnres_delta': False, 'mudd_streams': 'qkvr', 'dca_k': 8}
  laurel = {'variant': 'none', 'rank': 4}
  assert _saved(stream=old, laurel=laurel) == StreamSpec('mhc', expansion=3, sinkhorn_iters=5)
  assert _saved(stream={**old, 'design': 'residual'}, laurel={**laurel, 'variant': 'rw'}) == StreamSpec(
      'laurel', variant='rw', rank=4)
  assert _saved(stream={**old, 'design': 'residual'}, laurel=laurel) == StreamSpec('residual')


def test_a_config_saved_with_every_section_and_laurel_as_design_residual_still_builds():
  """Runs saved before LAuReL was a design of its own name: design 'residual' with `laurel.variant` ('none': the
  plain residual), beside every other design's section."""
  every = {d.section: {} for d in designs.REGISTRY.values() if d.name != 'residual'}
  old = lambda **laurel: {**every, 'stream': {'design': 'residual'}, 'laurel': {'variant': 'none', 'k': 2, **laurel}}
  assert _saved(**old()) == StreamSpec('residual')
  assert _saved(**old(variant='rw+pa')) == StreamSpec('laurel', variant='rw+pa', k=2)
  assert train_config.upgrade({'model': old(variant='lr')})['model'] == {
      'stream': {'design': 'laurel'}, 'laurel': {'variant': 'lr', 'k': 2}}
  assert train_config.upgrade({'model': {**every, 'stream': {'design': 'hc'}, 'hc': {'expansion': 2}}})['model'] == {
      'stream': {'design': 'hc'}, 'hc': {'expansion': 2}}


def test_unused_sections_are_every_other_designs_fields():
  unused = lm.LMConfig(stream=StreamSpec('hc')).unused_fields('model')
  assert unused['model.mhc.sinkhorn_iters'] == "only design 'mhc' reads it, not model.stream.design='hc'"
  assert 'model.laurel.rank' in unused and not any(name.startswith('model.hc.') for name in unused)


def test_layerscale_default_is_caits_eps_at_depth_24():
  assert StreamSpec('layerscale').layerscale_init == 1e-5
