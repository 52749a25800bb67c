"""Every registered residual design against its NumPy reference and its init claim (tests/reference.py), over a
chain of layers run through the design protocol; then the designs inside the LM: ResidualTransformer's shared
weights, value residual, Gemma 3n's placement, the stream designs, and configs/residual_designs.py.

A new design is tested by adding its entry to `reference.REFERENCES` (cases, float64 chain, init claim): the tests
below fail for a registered design without one.
"""

import ast
import dataclasses
import functools
import itertools
import json
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import residual_designs
import design_chain
from design_chain import LAYERS as CHAIN_LAYERS
from design_chain import D as CHAIN_D
from design_chain import Net, T, init, inputs, randomize, run, stacked
from helpers import TINY_LM, load_config, losses, train_cli
from laurel import config_lib, designs, lm, sharding, tasks
from laurel.designs import StreamSpec, hyper
from laurel.designs.laurel import LaurelSpec
from reference import REFERENCES, attnres_chain, delta_attnres_authors, mhc_lite_mix, np_rmsnorm

VOCAB, D, HEADS, FF, LAYERS, LEN, BATCH = 32, 16, 2, 32, 4, 8, 2


# ---------------------------------------------------------------------------------------------------
# The registry: every design's chain against its NumPy reference at random parameters, and at init its claim.

CASES = [(name, case, scan) for name, ref in REFERENCES.items() if name in designs.REGISTRY
         for case in ref.cases for scan in ((False, True) if case in ref.scan else (False,))]
CASE_IDS = [f'{name}-{case}' + ('-scan' if scan else '') for name, case, scan in CASES]


@pytest.mark.parametrize('name', list(designs.REGISTRY))
def test_every_registered_design_has_a_reference_and_an_init_claim(name):
  ref = REFERENCES.get(name)
  assert ref is not None and ref.cases, f'design {name!r}: add its NumPy reference and init claim to tests/reference.py'
  assert set(ref.scan) <= set(ref.cases)


@pytest.mark.parametrize('name,case,scan', CASES, ids=CASE_IDS)
def test_chain_matches_its_reference_at_random_params_BxLxD(name, case, scan):
  ref = REFERENCES[name]
  spec = ref.cases[case]
  params = randomize(init(name, spec))
  np.testing.assert_allclose(run(name, spec, params, scan), ref.chain(spec, params, *inputs()), rtol=ref.tol,
                             atol=ref.tol)


@pytest.mark.parametrize('name,case,scan', CASES, ids=CASE_IDS)
def test_chain_starts_as_its_init_claim_BxLxD(name, case, scan):
  spec = REFERENCES[name].cases[case]
  params = init(name, spec)
  want, exact = REFERENCES[name].init(spec, *inputs(), params)
  if exact and not scan:  # a layer scan may round differently
    np.testing.assert_array_equal(run(name, spec, params), want)
  else:
    np.testing.assert_allclose(run(name, spec, params, scan), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', list(designs.REGISTRY))
def test_design_declares_its_axes_no_decay_names_and_chain_layout(name):
  design, specs = designs.REGISTRY[name], REFERENCES[name].cases.values()
  rules = {axis for axis, _ in designs.logical_axis_rules()}
  own = {'embed', 'layers'} | {axis for axis, _ in design.logical_axes}
  assert own <= rules
  seen = set()
  for spec in specs:
    boxed = init(name, spec, boxed=True)
    leaves = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda a: isinstance(a, nn.Partitioned))[0]
    for path, leaf in leaves:
      assert isinstance(leaf, nn.Partitioned) and len(leaf.names) == leaf.value.ndim, jax.tree_util.keystr(path)
      assert set(leaf.names) <= own | {None}, (jax.tree_util.keystr(path), leaf.names)
      seen.add(path[-1].key)
    chain = design.chain(spec, CHAIN_LAYERS, T, CHAIN_D).apply({'params': nn.unbox(boxed).get('chain', {})})
    assert (chain is None) == ('chain' not in boxed)
    assert all(a.shape[0] == CHAIN_LAYERS and a.dtype == jnp.float32 for a in jax.tree.leaves(chain))
  assert set(design.no_decay) <= seen  # each declared name is a parameter of the design


# ---------------------------------------------------------------------------------------------------
# AttnRes's push form: a running max under stop_gradient keeps large logits finite and the gradient exact.

ATTNRES_SPECS = [StreamSpec(design='attnres'), StreamSpec(design='attnres_block', attnres_block=4),
                 StreamSpec(design='attnres_block', attnres_block=4, attnres_heads=2, attnres_delta=True)]
_attnres_id = lambda s: s.design + ('_heads2_delta' if s.attnres_delta else '')


@pytest.mark.parametrize('spec', ATTNRES_SPECS, ids=_attnres_id)
def test_attnres_every_site_input_matches_the_reference_BxLxD(spec, monkeypatch):
  # The sublayers' pre-norm hides a site input's scale, so the chain's output alone would not see a wrong weight sum.
  params, seen, toy_fn = randomize(init(spec.design, spec)), [], design_chain.toy_fn
  recording = lambda w, x, xn, scale: seen.append(np.asarray(x)) or toy_fn(w, x, xn, scale)
  monkeypatch.setattr(design_chain, 'toy_fn', recording)
  out = run(spec.design, spec, params)
  want = attnres_chain(spec, params, *inputs(), site_inputs=True)
  assert len(seen) == len(want) - 1 == CHAIN_LAYERS * T
  for s, (got, h) in enumerate(zip(seen + [out], want)):
    np.testing.assert_allclose(got, h, rtol=1e-5, atol=1e-5, err_msg=f'site {s}')


@pytest.mark.parametrize('spec', ATTNRES_SPECS, ids=_attnres_id)
def test_attnres_large_queries_stay_finite_and_match_the_reference_BxLxD(spec):
  # Logits of several hundred: a fixed stabiliser (the bound ‖w̃‖·√D) would underflow every exp to 0 here.
  params = randomize(init(spec.design, spec), scale=30.0)
  got = run(spec.design, spec, params, scan=True)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, attnres_chain(spec, params, *inputs()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('spec', ATTNRES_SPECS, ids=_attnres_id)
@pytest.mark.slow
def test_attnres_gradient_matches_finite_differences_of_the_reference(spec):
  params = randomize(init(spec.design, spec))
  probe = np.random.default_rng(2).normal(size=inputs()[0].shape)
  loss = lambda p: jnp.sum(jnp.asarray(probe, jnp.float32) * Net(spec.design, spec, True).apply(
      {'params': stacked(p)}, *inputs()))
  grads = jax.grad(loss)(params)['chain']
  chain = jax.tree.map(lambda a: np.asarray(a, np.float64), params['chain'])
  for name in ('attnres_query', 'attnres_key_scale'):
    last = len(chain[name]) - 1  # the read-out; with delta the last site
    for index in [(0, 1), (3, 0), (5, 7), (last, 2)]:  # site 0, middle sites, the last receiver
      def ref_loss(delta, name=name, index=index):
        moved = {**chain, name: chain[name].copy()}
        moved[name][index] += delta
        return np.sum(probe * attnres_chain(spec, {**params, 'chain': moved}, *inputs()))
      want = (ref_loss(1e-6) - ref_loss(-1e-6)) / 2e-6
      np.testing.assert_allclose(grads[name][index], want, rtol=1e-3, atol=1e-4, err_msg=f'{name}{index}')


@pytest.mark.parametrize('scan', [False, True])
def test_attnres_delta_matches_a_transcription_of_the_authors_code_BxLxD(scan):
  # The authors' read-out is the stream itself (no final mix over the increments).
  spec = StreamSpec(design='attnres', attnres_delta=True)
  params = randomize(init(spec.design, spec))
  assert params['chain']['attnres_query'].shape[0] == CHAIN_LAYERS * T  # no read-out receiver's w_S
  np.testing.assert_allclose(run(spec.design, spec, params, scan), delta_attnres_authors(spec, params, *inputs()),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('heads', [1, 4])
def test_attnres_delta_starts_with_plain_inputs_scaled_by_s_plus_2_over_s_plus_1_BxLxD(heads, monkeypatch):
  # Uniform weights over the increments add mean(δ_0 … δ_s) = x_s/(s+1) to x_s; the pre-norm then gives the plain
  # model's input up to its epsilon.
  spec = StreamSpec(design='attnres', attnres_delta=True, attnres_heads=heads)
  params, seen, toy_fn = init(spec.design, spec), [], design_chain.toy_fn
  monkeypatch.setattr(design_chain, 'toy_fn', lambda w, x, xn, scale: seen.append(np.asarray(x)) or toy_fn(w, x, xn,
                                                                                                           scale))
  run(spec.design, spec, params)
  assert len(seen) == CHAIN_LAYERS * T
  x, ws = inputs()
  x = np.asarray(x)
  for s, got in enumerate(seen):
    np.testing.assert_allclose(got, x * (s + 2) / (s + 1), rtol=1e-5, atol=1e-5, err_msg=f'site {s}')
    x = x + toy_fn(ws[s // T, s % T], x, design_chain.rms(x), None)


@pytest.mark.parametrize('design,remat', [('attnres', 'dots_no_batch'), ('dca', 'dots_no_batch'),
                                          ('dca_k', 'dots_no_batch'), ('mudd', 'dots_no_batch')])
@pytest.mark.slow
def test_backward_keeps_a_constant_amount_per_layer(design, remat):
  # What a layer adds must not grow with depth. AttnRes's push form saves its site inputs by name: keeping its
  # running sums U (2N + 1 D-wide) per layer, as remat did before the inputs were named, grows it ~1.55x from 4→8 to
  # 8→16. A buffer of N + 1 slots (MUDDFormer, DCA), saved per layer by a scan's own backward, ~2x. AttnRes keeps the
  # logits of every later receiver and MUDDFormer its weights A, O(N) scalars a token per layer, so it is measured
  # where they are small beside D. DCA's columns (k + 2 D-wide) are a batched dot, which dots_no_batch does not keep:
  # as an unbatched dot, ~1.44x here.
  width = 256

  def temp_bytes(layers):
    cfg = lm.LMConfig(vocab_size=64, d_model=width, num_heads=2, d_ff=128, num_layers=layers, scan_layers=True,
                      remat=remat, stream=StreamSpec(design=design))
    params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
    loss = lambda p, t: lm.LM(cfg).apply({'params': p}, t).sum()
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(nn.unbox(params), tokens).compile().memory_analysis().temp_size_in_bytes
  t4, t8, t16 = (temp_bytes(n) for n in (4, 8, 16))
  assert (t16 - t8) / 8 < 1.25 * (t8 - t4) / 4  # measured 1.00 (DCA, k-DCA) to 1.17 (AttnRes)


# ---------------------------------------------------------------------------------------------------
# The designs in the LM.

def _cfg(**model):
  fields = dict(vocab_size=VOCAB, d_model=D, num_heads=HEADS, d_ff=FF, num_layers=LAYERS, max_len=16,
                scan_layers=False, positional='learned')
  cfg = lm.LMConfig(**{**fields, **model})
  cfg.check('model')
  return cfg


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(1, VOCAB, size=(BATCH, LEN)).astype(np.int32)


def _random_params(cfg, seed):
  """Every parameter at a random value, drawn in NumPy from the abstract shapes."""
  rng = np.random.default_rng(seed)
  shapes = nn.unbox(jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), _tokens()))['params'])
  draw = lambda path, s: jnp.asarray(
      (1.0 if 'scale' in jax.tree_util.keystr(path) else 0.0) + 0.3 * rng.normal(size=s.shape), s.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def _logits(cfg, params, tokens):
  return np.asarray(lm.LM(cfg).apply({'params': params}, tokens))


def _calls(cfg, params, tokens, module_type):
  """(module name, args, output) of every call of `module_type` in the LM, in order."""
  calls = []

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, module_type) and context.method_name == '__call__':
      calls.append((context.module.name, args, out))
    return out
  with nn.intercept_methods(record):
    lm.LM(cfg).apply({'params': params}, tokens)
  return calls


# ---------------------------------------------------------------------------------------------------
# ResidualTransformer (arXiv 2310.02489): layer l of group g multiplies by W_g + A_l·B_l + D_l.

@pytest.mark.parametrize('diagonal', [True, False])
def test_residual_transformer_is_the_lm_with_composed_kernels_BxLxV(diagonal):
  cfg = _cfg(share=lm.ShareSpec(group_size=2, rank=3, diagonal=diagonal), mlp='swiglu')
  shared = _random_params(cfg, 1)
  plain = {k: v for k, v in shared.items() if not k.startswith(('layers_', 'shared'))}
  for layer in range(LAYERS):
    own = jax.tree.map(np.asarray, shared[f'layers_{layer}'])
    for part, names in (('attn', ('query', 'key', 'value', 'out')), ('mlp', ('up', 'gate', 'down'))):
      for name in names:
        w = np.asarray(shared['shared'][f'{part}_{name}'][layer // 2])  # W_g of the layer's group g
        delta = own[part].pop(name)
        n_in = 2 if name == 'out' else 1
        m, n = math.prod(w.shape[:n_in]), math.prod(w.shape[n_in:])
        flat = delta['share_a'].reshape(m, -1) @ delta['share_b'].reshape(-1, n)
        if diagonal:
          for i, d in enumerate(delta['share_diag']):
            flat[i, i] += d
        else:
          assert 'share_diag' not in delta
        own[part][name] = {'kernel': w + flat.reshape(w.shape)}
    plain[f'layers_{layer}'] = own
  tokens = _tokens(2)
  np.testing.assert_allclose(_logits(cfg, shared, tokens), _logits(_cfg(mlp='swiglu'), plain, tokens),
                             rtol=2e-5, atol=2e-5)


def test_residual_transformer_shares_scan_and_unrolled_layers_BxLxV():
  cfg = _cfg(share=lm.ShareSpec(group_size=2, rank=3), stream=LaurelSpec(variant='rw+lr', rank=4))
  unrolled = _random_params(cfg, 3)
  stacked = {k: v for k, v in unrolled.items() if not k.startswith('layers_')}
  stacked['layers'] = jax.tree.map(lambda *a: jnp.stack(a), *(unrolled[f'layers_{i}'] for i in range(LAYERS)))
  tokens = _tokens(4)
  np.testing.assert_allclose(_logits(dataclasses.replace(cfg, scan_layers=True, remat='full'), stacked, tokens),
                             _logits(cfg, unrolled, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_residual_transformer_groups_start_as_independent_draws_of_the_baselines_init():
  cfg = _cfg(share=lm.ShareSpec(group_size=2, rank=3), mlp='swiglu')
  params = nn.unbox(lm.LM(cfg).init(jax.random.key(0), _tokens())['params'])
  baseline = nn.unbox(lm.LM(_cfg(mlp='swiglu')).init(jax.random.key(0), _tokens())['params'])
  for name, w_G in params['shared'].items():
    part, kernel = name.split('_')
    assert w_G.shape == (LAYERS // 2,) + baseline['layers_0'][part][kernel]['kernel'].shape
    assert not np.allclose(w_G[0], w_G[1])  # each group its own draw
    # The fan-in scale of one kernel (the stacked axis is not a fan): the baseline layers' std, within sampling.
    stds = [np.std(baseline[f'layers_{i}'][part][kernel]['kernel']) for i in range(LAYERS)]
    np.testing.assert_allclose(np.std(w_G), np.mean(stds), rtol=0.2)


@pytest.mark.slow
def test_residual_transformer_keeps_no_more_activations_than_the_baseline():
  # Fully rematerialised, 6 scanned layers in groups of K = 3: the backward pass must recompute one layer at a time.
  # (A scan iteration of K unrolled blocks let XLA recompute all K at once: 2.4x the baseline's temp bytes here.)
  def temp_bytes(group_size):
    cfg = lm.LMConfig(vocab_size=64, d_model=32, num_heads=2, d_ff=64, num_layers=6, scan_layers=True, remat='full',
                      share=lm.ShareSpec(group_size=group_size, rank=2))
    params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
    xent = lambda p, t: -jnp.mean(jnp.take_along_axis(
        jax.nn.log_softmax(lm.LM(cfg).apply({'params': p}, t[:, :-1])), t[:, 1:, None], axis=-1))
    tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
    return jax.jit(jax.grad(xent)).lower(nn.unbox(params), tokens).compile().memory_analysis().temp_size_in_bytes
  one_layers_logits = 8 * 2 * 128 * 128 * 4  # B·H·L·L float32: the largest buffer a layer recomputes
  base = temp_bytes(1)
  assert base > 3 * one_layers_logits  # the measure sees the activations at all
  assert temp_bytes(3) < base + one_layers_logits / 4


def test_residual_transformer_cuts_layer_weights_about_3x_at_table5_shape():
  # The paper: ~3× smaller encoder at K = 3. Here, 24 layers at D = 768, K = 3, R = 16: the layer weights.
  def layer_params(row):
    task = tasks.get_task(load_config(f'configs/residual_designs.py:{row}'))
    shapes = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params']
    return sum(int(np.prod(x.shape)) for k, v in nn.unbox(shapes).items() if k in ('layers', 'shared')
               for x in jax.tree.leaves(v))
  ratio = layer_params('baseline_24') / layer_params('residual_transformer')
  assert 2.7 < ratio < 3.0, ratio


# ---------------------------------------------------------------------------------------------------
# Value residual (ResFormer, arXiv 2410.17897 §3): V'_n = λ_1·V_1 + λ_2·V_n for n > 1.

def _np_attention(xn, p, values):
  """Causal attention (no RoPE: learned positions) whose values `values(v)` may be mixed; xn one input, or a (query,
  key, value) triple of them."""
  q, k, v = (np.einsum('bld,dhk->blhk', np.asarray(x, np.float64), np.asarray(p[n]['kernel'], np.float64))
             for n, x in zip(('query', 'key', 'value'), xn if isinstance(xn, tuple) else (xn,) * 3))
  v_used = values(v)
  logits = np.einsum('bqhk,bshk->bhqs', q, k) / math.sqrt(q.shape[-1])
  logits = np.where(np.tril(np.ones((LEN, LEN), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum('bhqs,bshk->bqhk', probs, v_used)
  return np.einsum('bqhk,hkd->bqd', out, np.asarray(p['out']['kernel'], np.float64)), v


def test_value_residual_mixes_the_first_layers_values_BxLxD():
  cfg = _cfg(value_residual=True)
  params = _random_params(cfg, 5)
  calls = _calls(cfg, params, _tokens(6), lm.Attention)
  assert len(calls) == LAYERS
  v1 = None
  for layer, (_, args, (out, _)) in enumerate(calls):
    p = params[f'layers_{layer}']['attn']
    lam = np.asarray(p['value_mix'], np.float64)
    mix = (lambda v: v) if layer == 0 else (lambda v, lam=lam, v1=v1: lam[0] * v1 + lam[1] * v)
    want, v = _np_attention(np.asarray(args[0], np.float64), p, mix)
    v1 = v if layer == 0 else v1
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5, err_msg=f'layer {layer}')


def test_attention_projects_query_key_and_value_from_their_own_inputs_BxLxD():
  # MUDDFormer's layers read three streams; value residual's V_1 stays layer 0's v, projected from its value input.
  cfg = _cfg(value_residual=True, stream=StreamSpec(design='mudd'))
  params = _random_params(cfg, 13)
  calls = _calls(cfg, params, _tokens(14), lm.Attention)
  assert len(calls) == LAYERS
  v1 = None
  for layer, (_, args, (out, _)) in enumerate(calls):
    xq, xk, xv = args[0]
    assert layer == 0 or not (np.allclose(xq, xk) or np.allclose(xk, xv))
    p = params[f'layers_{layer}']['attn']
    lam = np.asarray(p['value_mix'], np.float64)
    mix = (lambda v: v) if layer == 0 else (lambda v, lam=lam, v1=v1: lam[0] * v1 + lam[1] * v)
    want, v = _np_attention(args[0], p, mix)
    v1 = v if layer == 0 else v1
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5, err_msg=f'layer {layer}')


# ---------------------------------------------------------------------------------------------------
# Gemma 3n's placement: LAuReL on attention only, (x + attn + laurel(norm(x)))/√2, then a plain MLP residual.

def test_gemma3n_layer_matches_a_transcription_of_gemma3n_BxLxD():
  cfg = _cfg(stream=LaurelSpec(variant='lr', rank=4, form='gemma3n', site='attention'))
  params = _random_params(cfg, 7)
  tokens = _tokens(8)
  blocks = _calls(cfg, params, tokens, lm.Block)
  attn_outs = [out[0] for _, _, out in _calls(cfg, params, tokens, lm.Attention)]
  mlp_calls = _calls(cfg, params, tokens, lm.Mlp)
  for layer, (_, args, out) in enumerate(blocks):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params[f'layers_{layer}'])
    x = np.asarray(args[0][0][0], np.float64)
    xn = np_rmsnorm(x, p['norm_attn']['scale'])
    laurel = xn + np_rmsnorm(xn @ p['laurel_attn']['lr_a'] @ p['laurel_attn']['lr_b'],
                             p['laurel_attn']['lr_norm']['scale'])
    attn_laurel = (x + np.asarray(attn_outs[layer], np.float64) + laurel) / math.sqrt(2.0)
    mlp_in = np.asarray(mlp_calls[layer][1][0], np.float64)
    np.testing.assert_allclose(mlp_in, np_rmsnorm(attn_laurel, p['norm_mlp']['scale']), rtol=1e-4, atol=1e-5)
    want = attn_laurel + np.asarray(mlp_calls[layer][2], np.float64)
    np.testing.assert_allclose(np.asarray(out[0][0][0]), want, rtol=1e-4, atol=1e-5, err_msg=f'layer {layer}')
  assert 'laurel_mlp' not in params['layers_0'] and cfg.num_sites == LAYERS


def test_post_norm_block_gives_back_h_plus_mlp_exactly_in_bfloat16_BxLxD():
  # Post-norm's block site adds f(x) = block(x) − x to x: h − x taken in float32 is exact for bfloat16 h and x, so
  # the sum is h + MLP(h) rounded once, as the post-norm block computes it (h − x in bfloat16 changed 28% of the
  # entries at this shape).
  cfg = _cfg(norm_position='post', dtype='bfloat16', d_model=64, d_ff=128, num_layers=3)
  tokens = np.random.default_rng(0).integers(1, VOCAB, size=(4, 16)).astype(np.int32)
  params = _random_params(cfg, 19)
  norms = {}
  for name, args, out in _calls(cfg, params, tokens, nn.RMSNorm):
    norms.setdefault(name, []).append((args[0], out))
  mlps = [out for *_, out in _calls(cfg, params, tokens, lm.Mlp)]
  assert len(mlps) == len(norms['norm_attn']) == len(norms['norm_mlp']) == 3
  for (_, h), m, (summed, _) in zip(norms['norm_attn'], mlps, norms['norm_mlp']):
    assert h.dtype == summed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(summed, np.float32), np.asarray(h + m, np.float32))


# ---------------------------------------------------------------------------------------------------
# Stream designs in the LM: at init they equal the pre-norm baseline where their papers make it so.

STREAM_SPECS = {
    'hc': StreamSpec(design='hc', expansion=3),
    'hc_dynamic': StreamSpec(design='hc', expansion=3, hc_dynamic=True),
    # 4 Sinkhorn iterations, not 20: the same unrolled loop, a fifth of its compile time
    'mhc': StreamSpec(design='mhc', expansion=3, sinkhorn_iters=4),
    'mhc_v4_readout': StreamSpec(design='mhc', expansion=3, mhc_readout='v4', sinkhorn_iters=4),
    'mhc_lite': StreamSpec(design='mhc_lite', expansion=3),
    'frac': StreamSpec(design='frac', fractions=4),
    'frac_dynamic': StreamSpec(design='frac', hc_dynamic=True),
    'denseformer': StreamSpec(design='denseformer'),
    'denseformer_dilated': StreamSpec(design='denseformer', dwa_dilation=2, dwa_period=2),
    'mudd': StreamSpec(design='mudd'),
    'mudd_r': StreamSpec(design='mudd', mudd_streams='r'),
    'dca': StreamSpec(design='dca'),
    'dca_k': StreamSpec(design='dca_k', dca_k=1),
}


@pytest.mark.parametrize('name', list(STREAM_SPECS))
def test_stream_design_lm_starts_as_baseline_BxLxV(name):
  cfg = _cfg(stream=STREAM_SPECS[name])
  base_cfg = _cfg()
  base = _random_params(base_cfg, 9)
  init = nn.unbox(lm.LM(cfg).init(jax.random.key(0), _tokens()))['params']
  graft = lambda b, i: {k: graft(b[k], v) if k in b and isinstance(v, dict) else b.get(k, v) for k, v in i.items()}
  params = graft(base, init)  # the baseline's weights, plus the design's own at their init
  for layer in range(LAYERS):  # a site's own key and value norms (MUDDFormer, DCA), as the baseline's attention norm
    for own in params[f'layers_{layer}'].values():
      own.update({n: base[f'layers_{layer}']['norm_attn'] for n in ('norm_key', 'norm_value') if n in own})
  tokens = _tokens(10)
  # HC/mHC read out n·(baseline stream); the final RMSNorm removes n up to its epsilon. mHC-lite's authors' read-out
  # norms each of the n equal streams, then sums them: n times the baseline's logits.
  spec = STREAM_SPECS[name]
  times = spec.expansion if spec.design in ('mhc', 'mhc_lite') and hyper.readout(spec) == 'norm_sum' else 1
  np.testing.assert_allclose(_logits(cfg, params, tokens), times * _logits(base_cfg, base, tokens), rtol=2e-5,
                             atol=2e-5 * times)


DESIGN_CFGS = {
    **{n: dict(stream=s) for n, s in STREAM_SPECS.items()},
    'rezero': dict(stream=StreamSpec(design='rezero')),
    'layerscale': dict(stream=StreamSpec(design='layerscale')),
    'attnres': dict(stream=StreamSpec(design='attnres')),
    'attnres_block': dict(stream=StreamSpec(design='attnres_block', attnres_block=4)),
    'value_residual': dict(value_residual=True, stream=LaurelSpec(variant='rw+lr', rank=4)),
    'gemma3n_attention': dict(stream=LaurelSpec(variant='rw+lr', rank=4, form='gemma3n', site='attention')),
    'residual_transformer_laurel': dict(share=lm.ShareSpec(group_size=2, rank=3),
                                        stream=LaurelSpec(variant='rw+lr+pa', rank=4, k=2)),
}
RULE_NAMES = {name for name, _ in designs.logical_axis_rules()}


@pytest.mark.parametrize('name', list(DESIGN_CFGS))
@pytest.mark.slow
def test_design_params_shard_and_all_get_gradients(name):
  cfg = _cfg(scan_layers=True, **DESIGN_CFGS[name])
  boxed = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), _tokens()))['params']
  leaves = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    assert isinstance(leaf, nn.Partitioned) and len(leaf.names) == leaf.value.ndim, where
    assert set(leaf.names) <= RULE_NAMES | {None}, (where, leaf.names)
  params = _random_params(cfg, 11)
  tokens = jnp.asarray(_tokens(12))

  def loss(p):
    logits = lm.LM(cfg).apply({'params': p}, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
  grads = jax.jit(jax.grad(loss))(params)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    g = np.asarray(g)
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    if 'value_mix' not in jax.tree_util.keystr(path):  # layer 0's λ reads nothing
      assert np.any(g != 0), jax.tree_util.keystr(path)


@pytest.mark.parametrize('n', [2, 3, 4, 5])
def test_mhc_lite_h_res_is_exactly_doubly_stochastic_and_starts_at_mhcs_matrix(n):
  site = hyper.MHCLiteSite(StreamSpec(design='mhc_lite', expansion=n), CHAIN_D)
  logits = np.random.default_rng(n).normal(0, 3, (math.factorial(n), 2, 3))
  h_res = np.asarray(site.h_res(jnp.asarray(logits, jnp.float32)), np.float64)
  np.testing.assert_allclose(h_res.sum(0), 1.0, atol=1e-6)
  np.testing.assert_allclose(h_res.sum(1), 1.0, atol=1e-6)
  assert h_res.min() >= 0 and len({p.tobytes() for p in hyper.permutations(n)}) == math.factorial(n)
  start = np.asarray(site.h_res(jnp.asarray(site.b_res_init(), jnp.float32)))
  mhc = hyper.MHCSite(StreamSpec(design='mhc', expansion=n), CHAIN_D)
  np.testing.assert_allclose(start, (np.eye(n) + 1.0 / n) / 2, atol=1e-6)
  np.testing.assert_allclose(start, mhc.h_res(jnp.asarray(mhc.b_res_init(), jnp.float32).reshape(-1)), atol=1e-6)


def test_mhc_lite_labels_its_permutations_as_the_authors_code():
  # All weight on σ = (1, 2, 0, 3), streams (10, 20, 30, 40): the authors' code moves stream i to σ(i), giving
  # (30, 10, 20, 40) (the inverse labels would give (20, 30, 10, 40)). F's output is 0, so the site only mixes.
  n, sigma = 4, (1, 2, 0, 3)
  r = list(itertools.permutations(range(n))).index(sigma)
  c_BxLxR = np.eye(math.factorial(n))[r][None, None]
  streams = np.array([10.0, 20.0, 30.0, 40.0])
  np.testing.assert_array_equal(mhc_lite_mix(c_BxLxR, streams[None, None, :, None])[0, 0, :, 0], [30, 10, 20, 40])
  spec = StreamSpec(design='mhc_lite', expansion=n)
  site = hyper.MHCLiteSite(spec, 1)
  h_NxBxLxD = jnp.asarray(streams[:, None, None, None], jnp.float32)
  chain_l = jnp.zeros((1, 2, n), jnp.float32)
  args = (h_NxBxLxD, lambda x, xn, scale: jnp.zeros_like(x), lambda x: x, lambda x: x, chain_l)
  params = nn.unbox(site.init(jax.random.key(0), *args))['params']
  params['b_res'] = jnp.where(jnp.arange(math.factorial(n)) == r, 0.0, -1e4)  # softmax: exactly one-hot
  np.testing.assert_array_equal(np.asarray(site.apply({'params': params}, *args))[:, 0, 0, 0], [30, 10, 20, 40])


# ---------------------------------------------------------------------------------------------------
# MUDDFormer: per-layer shapes padded for the scan, masked; the effective parameter count.

def _mudd_shapes(streams, layers):
  """(C_i, sources i + 2, K_i) per layer, from the authors' code: the last layer mixes R alone with 4x the hidden
  units (expand_last), and K = (n // 64 + 1)·64 (round64)."""
  out = []
  for i in range(layers):
    last = i == layers - 1
    c = 1 if last else len(streams)
    out.append((c, i + 2, (c * (i + 2) * (4 if last else 1) // 64 + 1) * 64))
  return out


@pytest.mark.slow
def test_mudd_padding_changes_nothing_and_learns_nothing_BxLxV():
  # 16 layers: K_i is 64 up to layer 13 and 128 after (C·(i+2) >= 64), so W1, W2 have padded hidden units too.
  cfg = _cfg(num_layers=16, scan_layers=True, stream=StreamSpec(design='mudd'))
  params = _random_params(cfg, 15)
  shapes = _mudd_shapes('qkvr', 16)
  assert len({k for *_, k in shapes}) == 2
  pad_w1 = np.ones(params['layers']['mudd_mlp']['mudd_w1'].shape, bool)
  pad_w2 = np.ones(params['layers']['mudd_mlp']['mudd_w2'].shape, bool)
  pad_bias = np.ones(params['stream_chain']['mudd_bias'].shape, bool)
  for i, (c, j, k) in enumerate(shapes):
    pad_w1[i, :, :k] = pad_w2[i, :k, 4 - c:, :j] = pad_bias[i, 4 - c:, :j] = False
  pads = {('layers', 'mudd_mlp', 'mudd_w1'): pad_w1, ('layers', 'mudd_mlp', 'mudd_w2'): pad_w2,
          ('stream_chain', 'mudd_bias'): pad_bias}
  moved = jax.tree_util.tree_map_with_path(
      lambda path, a: a + 100.0 * pads.get(tuple(k.key for k in path), 0), params)
  tokens = jnp.asarray(_tokens(16))
  np.testing.assert_array_equal(_logits(cfg, moved, tokens), _logits(cfg, params, tokens))
  grads = jax.grad(lambda p: lm.LM(cfg).apply({'params': p}, tokens).sum())(params)
  for path, pad in pads.items():
    g = functools.reduce(lambda t, k: t[k], path, grads)
    assert np.all(np.asarray(g)[pad] == 0) and np.any(np.asarray(g)[~pad] != 0), path


@pytest.mark.parametrize('stream,model', [
    (StreamSpec(design='mudd'), {}), (StreamSpec(design='mudd'), {'value_residual': True}),
    (StreamSpec(design='mudd'), {'share': lm.ShareSpec(group_size=2, rank=2)}),
    (StreamSpec(design='dca'), {}), (StreamSpec(design='dca_k', dca_k=1), {}),
    (StreamSpec(design='dca_k', dca_k=2), {'value_residual': True}),
    (StreamSpec(design='mudd'), {'remat': 'save_qkv', 'value_residual': True}),
    (StreamSpec(design='mudd', mudd_streams='r'), {'remat': 'full'}),
    (StreamSpec(design='dca'), {'remat': 'dots_no_batch'}),
    (StreamSpec(design='dca_k', dca_k=2), {'remat': 'minimal'}),
    (StreamSpec(), {'value_residual': True}),
    (LaurelSpec(variant='rw+lr+pa', rank=4), {'value_residual': True, 'remat': 'save_qkv'})],
    ids=['mudd', 'mudd_value_residual', 'mudd_shared', 'dca', 'dca_k1', 'dca_k2_value_residual',
         'mudd_save_qkv_value_residual', 'mudd_r_full', 'dca_dots_no_batch', 'dca_k2_minimal', 'value_residual',
         'laurel_value_residual_save_qkv'])
@pytest.mark.slow
def test_backward_rebuilding_a_buffer_is_the_scans_own(stream, model, monkeypatch):
  # The stack's custom backward (the buffer and V_1 rebuilt from the final ones) against a scan's autodiff, at
  # random weights.
  cfg = _cfg(scan_layers=True, stream=stream, **model)
  params, tokens = _random_params(cfg, 17), jnp.asarray(_tokens(18))
  grad = lambda: jax.jit(jax.grad(lambda p: jnp.mean(lm.LM(cfg).apply({'params': p}, tokens) ** 2)))(params)
  got = grad()
  plain_scan = lambda stack, block, cfg, index, mirror, policy, *args: stack(*args)[0]
  monkeypatch.setattr(lm, 'stack_rebuilding_buffer', plain_scan)
  want = grad()
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_value_residual_keeps_no_copy_of_v1_per_layer():
  # V_1 rides in the scan's carry: a scan's own backward would keep it at every layer (one D-wide activation a layer
  # beside save_qkv's four); the stack's backward rebuilds it from the final one, so a layer adds what Baseline's does.
  def temp_bytes(layers, value_residual):
    cfg = lm.LMConfig(vocab_size=64, d_model=256, num_heads=2, d_ff=256, num_layers=layers, scan_layers=True,
                      remat='save_qkv', value_residual=value_residual)
    params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
    loss = lambda p, t: lm.LM(cfg).apply({'params': p}, t).sum()
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(nn.unbox(params), tokens).compile().memory_analysis().temp_size_in_bytes
  per_layer = lambda vr: (temp_bytes(12, vr) - temp_bytes(4, vr)) / 8
  assert per_layer(True) <= per_layer(False) * 1.05


@pytest.mark.slow
def test_mudd_backward_reads_each_layers_input_from_the_buffer(monkeypatch):
  # MUDDFormer's x at layer i's input is the buffer's slot i: the stack keeps no copy of it per layer (one D-wide
  # activation a layer less than with `mirror` off).
  def temp_bytes(layers):
    cfg = lm.LMConfig(vocab_size=64, d_model=256, num_heads=2, d_ff=256, num_layers=layers, scan_layers=True,
                      remat='save_qkv', stream=StreamSpec(design='mudd'))
    params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
    loss = lambda p, t: lm.LM(cfg).apply({'params': p}, t).sum()
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(nn.unbox(params), tokens).compile().memory_analysis().temp_size_in_bytes
  per_layer = lambda: (temp_bytes(12) - temp_bytes(4)) / 8
  mirrored = per_layer()
  monkeypatch.setitem(designs.REGISTRY, 'mudd', dataclasses.replace(designs.REGISTRY['mudd'], mirror=None))
  activation = 4 * 64 * 256 * 4  # B × L × D float32
  assert mirrored <= per_layer() - 0.8 * activation, (mirrored, activation)


@pytest.mark.slow
@pytest.mark.parametrize('design', ['mudd', 'dca'])
def test_buffer_backward_honours_the_remat_policy(design):
  # The backward rebuilding the buffer recomputes what the policy does not save, and only that: the compiled
  # gradient's FLOPs fall from 'full' to 'save_qkv' to 'none' (no recomputation), as the baseline's do.
  def flops(remat):
    cfg = _cfg(scan_layers=True, remat=remat, stream=StreamSpec(design=design))
    params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), _tokens()))['params']
    loss = lambda p, t: lm.LM(cfg).apply({'params': p}, t).sum()
    tokens = jax.ShapeDtypeStruct((BATCH, LEN), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(nn.unbox(params), tokens).compile().cost_analysis()['flops']
  full, save_qkv, none = flops('full'), flops('save_qkv'), flops('none')
  assert full > save_qkv > none, (full, save_qkv, none)


def _count(config) -> dict:
  """scripts/params.py's count's two figures (a test cannot import that command: its flags clash with scripts')."""
  task = tasks.get_task(config)
  shapes = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params']
  total = task.num_params(shapes)
  return {'total_params': total, 'padded_params': sharding.num_params(shapes) - total}


@pytest.mark.parametrize('row,streams', [('mudd', 'qkvr'), ('mudd_r', 'r')])
def test_mudd_effective_params_at_the_paper_shape_are_the_authors_layer_shapes(row, streams):
  # Σ_i D·K_i + K_i·C_i(i+2) + C_i(i+2) (W1, W2, a), plus the key and value inputs' norms (2D a layer) with 'qkvr'.
  config = load_config(f'configs/residual_designs.py:{row}')
  d, layers = config.model.d_model, config.model.num_layers
  want = sum(d * k + k * c * j + c * j for c, j, k in _mudd_shapes(streams, layers))
  want += 2 * d * layers if streams == 'qkvr' else 0
  base_config = load_config('configs/residual_designs.py:baseline_24')
  got, base = _count(config), _count(base_config)
  assert got['total_params'] - base['total_params'] == want
  assert got['padded_params'] > 0 and base['padded_params'] == 0
  tokens = config.data.seq_len  # model FLOPs (6N per token) count the effective parameters too
  flops = tasks.get_task(config).model_flops(1) - tasks.get_task(base_config).model_flops(1)
  assert flops == 6 * tokens * want


@pytest.mark.slow
def test_dca_gates_train_from_their_zero_init():
  # ReLU(b + wᵀy) with b = 1, w = 0: w gets a gradient at init. App. A's literal b + ReLU(wᵀy) gives it none
  # (ReLU'(0) = 0), so the input-dependent part would never leave 0. Every GRN's w, the read-out's included.
  spec = StreamSpec(design='dca')
  params = init('dca', spec)
  x_BxLxD, ws = inputs()
  grads = jax.jit(jax.grad(lambda p: Net('dca', spec).apply({'params': p}, x_BxLxD, ws).sum()))(params)  # one compile
  assert (np.abs(np.asarray(grads['chain']['dca_query'])).sum(-1) > 0).all()
  assert (np.abs(np.asarray(grads['dca_readout']['dca_query'])) > 0).any()


def test_dca_params_at_the_paper_shape_are_its_equations():
  # b^c_{i,j} for j <= i and w^c_i per stream (3) of each layer, the read-out GRN's b_{N,j} for j <= N and w_N, and
  # the key and value inputs' norms (2D a layer).
  d, layers = 768, 24
  base = _count(load_config('configs/residual_designs.py:baseline_24'))
  got = _count(load_config('configs/residual_designs.py:dca'))
  grns = 3 * d * (layers * (layers + 1) // 2 + layers) + d * (layers + 1) + d
  assert got['total_params'] - base['total_params'] == grns + 2 * d * layers
  stored = 3 * d * layers * (layers + 3) + d * (layers + 3)  # N + 2 columns a receiver, the merged one unused
  assert got['padded_params'] == stored - grns


def test_dca_8_params_at_the_paper_shape_are_its_equations():
  # k-DCA, k = 8: per layer b^c over k + 2 columns and w^c (3 streams), the read-out's one GRN, the k and v norms.
  # Stored but never read: the columns still empty at a receiver (the merged one until i > k, y_{i-r} for r >= i).
  d, layers, k = 768, 24, 8
  base = _count(load_config('configs/residual_designs.py:baseline_24'))
  got = _count(load_config('configs/residual_designs.py:dca_8'))
  stored = 3 * d * layers * (k + 2 + 1) + d * (k + 2 + 1)
  assert got['total_params'] - base['total_params'] == stored + 2 * d * layers - got['padded_params']
  empty = lambda i: sum(1 for r in range(k) if i - r < 1) + (i <= k)
  assert got['padded_params'] == d * (3 * sum(empty(i) for i in range(layers)) + empty(layers))


# ---------------------------------------------------------------------------------------------------
# Config checks and the comparison table.

@pytest.mark.parametrize('model,message', [
    (dict(stream=dict(design='mhc'), norm_position='post'),
     "model.norm_position='post': stream design 'mhc' is defined on pre-norm sublayers"),
    (dict(share=dict(group_size=3)), 'model.share.group_size=3: must divide num_layers=4'),
    (dict(stream=dict(design='attnres_block'), attnres_block=dict(attnres_block=3)),
     'model.attnres_block.attnres_block=3: sites per block must divide the 2·num_layers=8 sites'),
    (dict(stream=dict(design='attnres'), attnres=dict(attnres_heads=3)),
     'model.attnres.attnres_heads=3: must divide d_model=16 (each head mixes its own channels)'),
    (dict(stream=dict(design='attnres'), norm_position='post'),
     "model.norm_position='post': stream design 'attnres' is defined on pre-norm sublayers"),
    (dict(share=dict(group_size=2, rank=17)), 'model.share.rank=17: must be <= min(d_model, d_ff)=16'),
    (dict(stream=dict(design='frac'), frac=dict(fractions=3)), 'model.frac.fractions=3: must divide d_model=16'),
    (dict(stream=dict(design='frac'), frac=dict(fractions=1)),
     "model.frac.fractions=1: must be >= 2 for design 'frac'"),
    (dict(stream=dict(design='mhc_lite'), mhc_lite=dict(expansion=6)),
     "model.mhc_lite.expansion=6: must be <= 5 for design 'mhc_lite': it mixes all n! permutations (720 logits"),
    (dict(stream=dict(design='mhc_lite'), mhc_lite=dict(expansion=1)),
     "model.mhc_lite.expansion=1: must be >= 2 for design 'mhc_lite'"),
    (dict(stream=dict(design='mhc'), mhc=dict(mhc_readout='v3')),
     "model.mhc.mhc_readout='v3': must be one of authors, sum, norm_sum, v4"),
    (dict(stream=dict(design='mudd'), norm_position='post'),
     "model.norm_position='post': stream design 'mudd' is defined on pre-norm sublayers"),
    (dict(stream=dict(design='mudd'), mudd=dict(mudd_streams='qkv')),
     "model.mudd.mudd_streams='qkv': must be one of qkvr, r"),
    (dict(stream=dict(design='dca'), norm_position='post'),
     "model.norm_position='post': stream design 'dca' is defined on pre-norm sublayers"),
    (dict(stream=dict(design='lstm')), "model.stream.design='lstm': must be one of residual, laurel, rezero"),
    (dict(laurel=dict(site='mlp')), "model.laurel.site='mlp': must be one of block, sublayer, attention"),
    (dict(value_residual=1), 'model.value_residual=1: must be a bool'),
])
def test_bad_design_settings_are_one_line_errors(model, message):
  fields = dict(vocab_size=VOCAB, d_model=D, num_heads=HEADS, d_ff=FF, num_layers=LAYERS)
  with pytest.raises(ValueError) as e:
    config_lib.build(lm.LMConfig, {**fields, **model}, 'model')
  assert str(e.value).startswith(message) and '\n' not in str(e.value)


def test_residual_designs_rows_differ_from_baseline_in_one_field_only():
  base = load_config('configs/residual_designs.py:baseline_24,preset=tiny').to_dict()
  assert set(residual_designs.ROWS) >= {
      'baseline_24', 'baseline_28', 'laurel_rw_lr', 'laurel_rw_lr_pa', 'rezero', 'layerscale', 'hc', 'hc_dynamic',
      'mhc', 'mhc_v4_readout', 'mhc_lite', 'frac', 'frac_dynamic', 'denseformer', 'attnres', 'attnres_block',
      'attnres_delta', 'attnres_block_delta', 'attnres_heads', 'mudd', 'mudd_r', 'dca', 'dca_8', 'value_residual',
      'laurel_rw_lr_value_residual',
      'gemma3n_laurel', 'residual_transformer', 'residual_transformer_laurel'}
  for row in residual_designs.ROWS:
    for preset in ('tiny', 'paper'):
      config = load_config(f'configs/residual_designs.py:{row},preset={preset}')
      tasks.get_task(config)  # builds and checks the model
      if preset == 'tiny':
        got = config.to_dict()
        assert {k for k in got if got[k] != base[k]} <= {'row', 'model'}, row
        assert {k for k in got['model'] if got['model'][k] != base['model'][k]} <= {  # and the design's own section
            'laurel', 'stream', 'value_residual', 'share', 'num_layers', got['model']['stream']['design']}, row


@pytest.mark.slow
@pytest.mark.parametrize('row', ['mhc', 'residual_transformer_laurel', 'mudd'])
def test_designs_train_through_laurel_main_from_config_flags(row, tmp_path, capsys):
  # laurel.main.main in this process: the command line's flags and files are the subject, not its process.
  tiny = {k: v for k, v in TINY_LM.items() if not k.startswith('model.laurel')}
  overrides = {**tiny, 'model.num_layers': 6, 'steps': 4, **({'model.mhc.sinkhorn_iters': 4} if row == 'mhc' else {})}
  status, _, err = train_cli(capsys, f'configs/residual_designs.py:{row},preset=tiny', tmp_path, overrides)
  assert status == 0, err[-2000:]
  final = json.loads((tmp_path / 'final.json').read_text())
  assert final['step'] == 4 and math.isfinite(final['eval_loss'])
  # the effective count (MUDDFormer's scan padding left out), as scripts/params.py counts it
  assert final['params'] == _count(load_config(f'configs/residual_designs.py:{row},preset=tiny',
                                                         overrides))['total_params']
  assert sorted(losses(tmp_path)) == [1, 2, 3, 4]


def test_no_module_of_laurel_imports_itself_round_a_cycle():
  # Module-level imports only (a function's late import is not a cycle at import time); a submodule import
  # (`from laurel.designs import mudd`) is an edge to the submodule.
  root = pathlib.Path(__file__).resolve().parents[1]
  files = {'.'.join(p.relative_to(root).with_suffix('').parts).removesuffix('.__init__'): p
           for p in (root / 'laurel').rglob('*.py')}
  edges = {m: set() for m in files}
  for module, path in files.items():
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Import):
        edges[module] |= {a.name for a in node.names if a.name in files}
      elif isinstance(node, ast.ImportFrom) and node.module in files:
        subs = {f'{node.module}.{a.name}' for a in node.names} & set(files)
        edges[module] |= subs or {node.module}
  done, cycles = set(), []

  def visit(module, path):
    for nxt in edges[module] - {module}:
      if nxt in path:
        cycles.append(path[path.index(nxt):] + [nxt])
      elif nxt not in done:
        visit(nxt, path + [nxt])
    done.add(module)
  for module in files:
    visit(module, [module])
  assert not cycles, cycles[:3]
