"""Tests of laurel.lm: the decoder LM whose residual connections are LAuReL sites.

Tiny shapes (D = 16, 2 layers, 8 tokens) except the Table 5 parameter counts, which use jax.eval_shape.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import c4_ablation
from laurel import attention, train_config
from laurel.designs import StreamSpec
from laurel.lm import LM, LMConfig
from laurel.designs.laurel import LaurelSite, LaurelSpec, closed_form_params
from scripts import paper
from reference import np_reference, np_rmsnorm, np_rw, pull_params

VOCAB, D, HEADS, FF, LAYERS, LEN, BATCH, RANK = 32, 16, 2, 32, 2, 8, 4, 4



def _cfg(variant=None, site='block', k=2, laurel=None, **model):
  """A tiny LMConfig of LAuReL's `variant` (None: design 'residual'); `laurel` holds extra LaurelSpec fields.

  Layers are unrolled unless a test asks for scan: on CPU the op-by-op path reuses compiled ops across
  tests, while every scanned or jitted model compiles from scratch (seconds each on 2 cores).
  """
  spec = LaurelSpec(variant=variant, rank=RANK, k=k, site=site, **(laurel or {})) if variant else StreamSpec()
  fields = dict(vocab_size=VOCAB, d_model=D, num_heads=HEADS, d_ff=FF, num_layers=LAYERS, max_len=16,
                scan_layers=False)
  fields.update(model)
  cfg = LMConfig(**fields, stream=spec)
  cfg.check('model')
  return cfg


# (id, LMConfig): the residual variants the LM-level tests sweep. Block sites: k ≤ 2 = layers.
LM_VARIANTS = [
    ('baseline', _cfg()),
    ('rw', _cfg('rw')),
    ('rw_sigmoid_per_dim', _cfg('rw', laurel=dict(rw_norm='sigmoid', rw_per_dim=True))),
    ('lr', _cfg('lr')),
    ('pa_identity', _cfg('pa')),
    ('pa_low_rank_sublayer', _cfg('pa', 'sublayer', k=3, laurel=dict(pa_h='low_rank'))),
    ('rw_lr', _cfg('rw+lr')),
    ('rw_lr_pa_block', _cfg('rw+lr+pa')),
    ('rw_lr_pa_sublayer', _cfg('rw+lr+pa', 'sublayer', k=3)),
    ('lr_pa_sublayer', _cfg('lr+pa', 'sublayer', k=4)),
    ('gemma3n_sublayer', _cfg('rw+lr', 'sublayer', laurel=dict(form='gemma3n'))),
]
BY_ID = dict(LM_VARIANTS)


def _pick(*names):
  return pytest.mark.parametrize('cfg', [BY_ID[n] for n in names], ids=list(names))


def _tokens(seed=0, shape=(BATCH, LEN)):
  return np.random.default_rng(seed).integers(1, VOCAB, size=shape).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _boxed_shapes(cfg):
  """The LM's params as boxed ShapeDtypeStructs (nothing initialised or compiled)."""
  return jax.eval_shape(lambda: LM(cfg).init(jax.random.key(0), jnp.zeros((1, LEN), jnp.int32)))['params']


def _random_params(cfg, seed):
  """Random values for every parameter, LAuReL ones included (so none sits at its init).

  Drawn in NumPy from the abstract shapes: the real initialisers cost many seconds of XLA compiles here.
  """
  rng = np.random.default_rng(seed)

  def draw(path, s):
    if 'scale' in jax.tree_util.keystr(path):  # RMSNorm scales around 1
      value = 1.0 + 0.1 * rng.normal(size=s.shape)
    else:
      value = 0.3 * rng.normal(size=s.shape)
    return jnp.asarray(value, s.dtype)
  return jax.tree_util.tree_map_with_path(draw, nn.unbox(_boxed_shapes(cfg)))


def _logits(cfg, params, tokens, positions=None, segment_ids=None):
  return np.asarray(LM(cfg).apply({'params': params}, tokens, positions, segment_ids))


def _laurel_leaves(params):
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(p): v for p, v in flat if 'laurel' in jax.tree_util.keystr(p)}


def _stacked(unrolled, num_layers):
  """Per-layer 'layers_{i}' params (unrolled) -> stacked 'layers' params (scan): stack on axis 0."""
  out = {k: v for k, v in unrolled.items() if not k.startswith('layers_')}
  out['layers'] = jax.tree.map(lambda *a: jnp.stack(a), *[unrolled[f'layers_{i}'] for i in range(num_layers)])
  return out


def _unrolled(stacked, num_layers):
  """Stacked 'layers' (scan) params -> per-layer 'layers_{i}' params: slice axis 0."""
  out = {k: v for k, v in stacked.items() if k != 'layers'}
  for i in range(num_layers):
    out[f'layers_{i}'] = jax.tree.map(lambda a, i=i: a[i], stacked['layers'])
  return out


def _same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), a) == jax.tree.map(lambda x: (x.shape, x.dtype), b)


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _xent(cfg, params, tokens_BxL):
  logits_BxLxV = LM(cfg).apply({'params': params}, tokens_BxL[:, :-1])
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV)
  return -jnp.mean(jnp.take_along_axis(logp_BxLxV, tokens_BxL[:, 1:, None], axis=-1))


# ---------------------------------------------------------------------------------------------------
# Masking: causality and packed documents.

@_pick('baseline', 'lr', 'pa_identity', 'rw_lr_pa_block', 'rw_lr_pa_sublayer', 'gemma3n_sublayer')
def test_causal_BxLxV(cfg):
  params = _random_params(cfg, 0)
  row_L = _tokens(1, (LEN,))
  changed_at = (1, 4, LEN - 1)
  tokens_BxL = np.stack([row_L] + [np.where(np.arange(LEN) == t, row_L % (VOCAB - 1) + 1, row_L)
                                   for t in changed_at])  # row b > 0: token t changed
  logits_BxLxV = _logits(cfg, params, tokens_BxL)
  assert logits_BxLxV.shape == (BATCH, LEN, VOCAB) and logits_BxLxV.dtype == np.float32
  for b, t in enumerate(changed_at, start=1):
    np.testing.assert_allclose(logits_BxLxV[b, :t], logits_BxLxV[0, :t], rtol=0, atol=1e-6)
    assert np.abs(logits_BxLxV[b, t] - logits_BxLxV[0, t]).max() > 1e-3


def _check_packed_documents(cfg):
  # Row 0: document 1 (3 tokens) then document 2 (5 tokens), positions restarting at 0.
  # Row 1: the same with another document 1. Rows 2 and 3: document 2 alone, first or after a filler.
  params = _random_params(cfg, 2)
  doc1_3, other1_3, doc2_5, filler_3 = (_tokens(s, (n,)) for s, n in ((3, 3), (4, 3), (5, 5), (6, 3)))
  tokens_BxL = np.stack([np.r_[doc1_3, doc2_5], np.r_[other1_3, doc2_5], np.r_[doc2_5, filler_3],
                         np.r_[filler_3, doc2_5]])
  segments_BxL = np.asarray([[1] * 3 + [2] * 5, [1] * 3 + [2] * 5, [1] * 5 + [2] * 3, [7] * 3 + [9] * 5],
                            np.int32)
  positions_BxL = np.asarray([[0, 1, 2, 0, 1, 2, 3, 4]] * 2 + [[0, 1, 2, 3, 4, 0, 1, 2]]
                             + [[0, 1, 2, 0, 1, 2, 3, 4]], np.int32)
  logits_BxLxV = _logits(cfg, params, tokens_BxL, positions_BxL, segments_BxL)
  np.testing.assert_allclose(logits_BxLxV[1, 3:], logits_BxLxV[0, 3:], rtol=0, atol=1e-6)
  assert np.abs(logits_BxLxV[1, :3] - logits_BxLxV[0, :3]).max() > 1e-3
  np.testing.assert_allclose(logits_BxLxV[2, :5], logits_BxLxV[0, 3:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits_BxLxV[3, 3:], logits_BxLxV[0, 3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('cfg', [c for _, c in LM_VARIANTS], ids=[i for i, _ in LM_VARIANTS])
def test_segment_ids_isolate_packed_documents_BxL(cfg):
  _check_packed_documents(cfg)


@_pick('baseline', 'rw_lr_pa_sublayer', 'gemma3n_sublayer')
def test_segment_ids_isolate_packed_documents_learned_positions_BxL(cfg):
  _check_packed_documents(dataclasses.replace(cfg, positional='learned'))


# ---------------------------------------------------------------------------------------------------
# Attention implementations against the einsum reference (the Pallas kernel interpreted on this CPU).

ATTN_LEN = 128  # splash attention's key tiles are 128 tokens


def _packed_qkv_segments(seed=0, batch=2, heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, ATTN_LEN, heads, head_dim)), jnp.float32) for _ in range(3))
  # Row 0: three documents and padding (segment 0); row 1: one document.
  segments_BxL = np.ones((batch, ATTN_LEN), np.int32)
  segments_BxL[0] = np.repeat([1, 2, 3, 0], [40, 50, 30, 8])
  return q, k, v, jnp.asarray(segments_BxL)


@pytest.mark.parametrize('impl', ['dot_product', 'splash'])
@pytest.mark.slow
def test_attention_implementations_match_the_reference_BxLxHxK(impl):
  q, k, v, segments_BxL = _packed_qkv_segments()
  attend = {'dot_product': attention.dot_product_attention, 'splash': attention.splash_attention}[impl]
  np.testing.assert_allclose(attend(q, k, v, segments_BxL), attention.xla_attention(q, k, v, segments_BxL),
                             rtol=1e-5, atol=1e-5)
  # Gradients too (splash has its own backward kernels); a loss that weighs every output differently.
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  grads = lambda f: jax.grad(lambda *qkv: (f(*qkv, segments_BxL) * w).sum(), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(grads(attend), grads(attention.xla_attention)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_splash_attention_in_the_lm_keeps_packed_documents_apart_BxLxV():
  cfg = dataclasses.replace(BY_ID['rw_lr_pa_block'], attention='splash')
  params = _random_params(BY_ID['rw_lr_pa_block'], 3)  # the same parameters; shapes drawn at an 8-token length
  tokens_BxL = np.stack([_tokens(4, (ATTN_LEN,))] * 2)
  tokens_BxL[1, :40] = _tokens(5, (40,))  # another first document in row 1
  segments_BxL = np.asarray([np.repeat([1, 2], [40, 88])] * 2, np.int32)
  positions_BxL = np.asarray([np.r_[np.arange(40), np.arange(88)]] * 2, np.int32)
  got = _logits(cfg, params, tokens_BxL, positions_BxL, segments_BxL)
  want = _logits(BY_ID['rw_lr_pa_block'], params, tokens_BxL, positions_BxL, segments_BxL)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got[1, 40:], got[0, 40:], rtol=0, atol=1e-5)
  assert np.abs(got[1, :40] - got[0, :40]).max() > 1e-3


def test_auto_attention_is_the_reference_on_cpu():
  auto = _cfg(attention='auto', dtype='bfloat16', max_segments=4)  # cudnn could serve it on a GPU
  assert attention.attention_impl(auto, ATTN_LEN) == 'xla'
  assert attention.attention_impl(_cfg(attention='splash'), 100) == 'splash'


# ---------------------------------------------------------------------------------------------------
# What each LAuReL site computes: the paper's pull form of eqs. 2–6 over the LM's own activations.

def _site_calls(cfg, params, tokens_BxL):
  """(name, fx, x, x_normed, out) of every LAuReL site call, in network order."""
  calls = []

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, LaurelSite) and context.method_name == 'residual':
      fx, x, _, _, xn = args
      calls.append((context.module.name, np.asarray(fx), np.asarray(x), np.asarray(xn), np.asarray(out[0])))
    return out
  with nn.intercept_methods(record):
    LM(cfg).apply({'params': params}, tokens_BxL)
  return calls


SITE_CASES = [('rw_lr_pa_block', 'pre'), ('rw_lr_pa_sublayer', 'pre'), ('lr_pa_sublayer', 'pre'),
              ('pa_low_rank_sublayer', 'post'), ('pa_identity', 'pre'), ('rw_sigmoid_per_dim', 'post'),
              ('gemma3n_sublayer', 'pre'), ('gemma3n_sublayer', 'post')]


@pytest.mark.parametrize('name,norm_position', SITE_CASES, ids=[f'{n}-{p}' for n, p in SITE_CASES])
def test_sites_follow_the_paper_equations_BxLxD(name, norm_position):
  # Each site's output against a NumPy evaluation of eqs. 2–6 with x_{i−1}, …, x_{i−k+1} taken from the
  # inputs of the sites before it (zeros before the first), and the sender-indexed PA params mapped back.
  cfg = dataclasses.replace(BY_ID[name], norm_position=norm_position)
  params = _random_params(cfg, 13)
  calls = _site_calls(cfg, params, _tokens(14))
  per_block = ['laurel'] if cfg.stream.site == 'block' else ['laurel_attn', 'laurel_mlp']
  assert [c[0] for c in calls] == per_block * cfg.num_layers and len(calls) == cfg.num_sites
  site_params = [params[f'layers_{i // len(per_block)}'].get(n, {}) for i, n in enumerate(per_block * cfg.num_layers)]
  rw_w_S = np.asarray(params['laurel_rw']['rw_w']) if cfg.stream.rw else None
  xs = [c[2] for c in calls]  # x_i, the input of site i
  for i, (site, fx, x, xn, out) in enumerate(calls):
    p = pull_params(cfg.stream, site_params, i)
    if cfg.stream.rw:  # the LM folds α into f's last projection: the site receives α·f(x_i)
      p['rw_w'] = rw_w_S[i]
      fx = fx / np_rw(cfg.stream, rw_w_S[i])[0]
    history = [xs[i - j] if i >= j else np.zeros_like(x) for j in range(1, cfg.stream.history_len + 1)]
    np.testing.assert_allclose(out, np_reference(cfg.stream, p, fx, x, history, xn), rtol=2e-5, atol=2e-5,
                               err_msg=f'site {i}')
    if norm_position == 'pre' and i > 0:  # pre-norm: a site's output is the next site's input
      np.testing.assert_array_equal(x, calls[i - 1][4])
    if cfg.stream.form == 'gemma3n':  # the normed input f read: RMSNorm(x) pre-norm, x itself post-norm
      layer = params[f'layers_{i // len(per_block)}']
      norm = 'norm_attn' if site in ('laurel', 'laurel_attn') else 'norm_mlp'
      want = np_rmsnorm(x, np.asarray(layer[norm]['scale'])) if norm_position == 'pre' else x
      np.testing.assert_allclose(xn, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Scan vs unrolled layers, remat.

@_pick('baseline', 'rw_lr_pa_block', 'rw_lr_pa_sublayer')
def test_scan_and_unrolled_layers_agree_BxLxV(cfg):
  scan_cfg = dataclasses.replace(cfg, scan_layers=True)
  stacked = _random_params(scan_cfg, 3)
  unrolled = _unrolled(stacked, cfg.num_layers)
  _same_tree(unrolled, nn.unbox(_boxed_shapes(cfg)))
  _same_tree(_stacked(unrolled, cfg.num_layers), stacked)
  tokens_BxL = _tokens(4)
  np.testing.assert_allclose(_logits(cfg, unrolled, tokens_BxL), _logits(scan_cfg, stacked, tokens_BxL),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('remat', ['dots_no_batch', 'full'])
def test_remat_gives_same_logits_BxLxV(remat):
  # Scanned remat, as the paper preset runs it (unrolled remat compiles slowly op by op on CPU).
  cfg = BY_ID['rw_lr_pa_sublayer']  # unrolled, no remat: the reference
  remat_cfg = dataclasses.replace(cfg, remat=remat, scan_layers=True)
  params = _random_params(cfg, 5)
  remat_params = _stacked(params, cfg.num_layers)
  tokens_BxL = _tokens(6)
  np.testing.assert_allclose(_logits(remat_cfg, remat_params, tokens_BxL), _logits(cfg, params, tokens_BxL),
                             rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Initial equivalence and gradients.

PAPER_FORM_CASES = [(n, 'pre') for n in ('rw', 'rw_sigmoid_per_dim', 'lr', 'pa_identity', 'pa_low_rank_sublayer',
                                          'rw_lr', 'rw_lr_pa_block', 'rw_lr_pa_sublayer', 'lr_pa_sublayer')]
PAPER_FORM_CASES += [(n, 'post') for n in ('rw', 'rw_lr_pa_block', 'rw_lr_pa_sublayer')]


@pytest.mark.parametrize('name,norm_position', PAPER_FORM_CASES, ids=[f'{n}-{p}' for n, p in PAPER_FORM_CASES])
def test_paper_form_lm_starts_as_baseline_BxLxV(name, norm_position):
  # LAuReL parameters at their init, every other weight shared with the baseline: the same logits.
  cfg = dataclasses.replace(BY_ID[name], norm_position=norm_position)
  base_cfg = dataclasses.replace(cfg, stream=StreamSpec())
  base = _random_params(base_cfg, 7)
  init = nn.unbox(LM(cfg).init(jax.random.key(0), _tokens(8))['params'])
  graft = lambda b, i: {k: graft(b[k], v) if k in b and isinstance(v, dict) else b.get(k, v) for k, v in i.items()}
  params = graft(base, init)  # the baseline's weights, plus the LAuReL params at their init
  _same_tree(params, nn.unbox(_boxed_shapes(cfg)))
  assert _count(params) - _count(base) == _count(_laurel_leaves(params)) > 0
  tokens_BxL = _tokens(8)
  np.testing.assert_allclose(_logits(cfg, params, tokens_BxL), _logits(base_cfg, base, tokens_BxL),
                             rtol=1e-5, atol=1e-5)


def _split_laurel(params):
  """(LAuReL params, the rest), each a tree shaped like `params` with None in the other's leaves."""
  is_laurel = lambda path: 'laurel' in jax.tree_util.keystr(path)
  laurel = jax.tree_util.tree_map_with_path(lambda p, v: v if is_laurel(p) else None, params)
  rest = jax.tree_util.tree_map_with_path(lambda p, v: None if is_laurel(p) else v, params)
  return laurel, rest


def _merge(a, b):
  return jax.tree.map(lambda x, y: y if x is None else x, a, b, is_leaf=lambda x: x is None)


@_pick('pa_identity', 'pa_low_rank_sublayer', 'rw_lr_pa_sublayer', 'gemma3n_sublayer')
def test_gradients_reach_every_laurel_param(cfg):
  laurel, rest = _split_laurel(_random_params(cfg, 9))
  # Differentiating the LAuReL params only still backpropagates through every layer, without weight grads.
  # (Jitted: one compile is cheaper here than the op-by-op backward's many.)
  grad_fn = jax.jit(jax.grad(lambda l, r, t: _xent(cfg, _merge(l, r), t)))
  grads = _laurel_leaves(grad_fn(laurel, rest, _tokens(10)))
  assert len(grads) == len(_laurel_leaves(laurel)) > 0
  for path, g in grads.items():
    g = np.asarray(g)
    assert np.all(np.isfinite(g)), path
    assert np.any(g != 0), path
  if cfg.stream.pa and cfg.stream.site == 'block':
    # PA's params are indexed by the sending site: the last site's terms for sites past the end (j ≥ 1)
    # reach nothing and get no gradient.
    key = f"['layers_{cfg.num_layers - 1}']['laurel']['pa_gamma']"
    assert np.all(np.asarray(grads[key])[1:] == 0) and np.asarray(grads[key])[0] != 0


# ---------------------------------------------------------------------------------------------------
# Memory: what a scanned, rematerialised LM keeps per layer for its backward pass.

def _scan_bytes_per_layer(variant):
  """Temp bytes per extra layer of the compiled loss gradient (6 vs 3 scanned layers, dots_no_batch remat)."""
  temp = []
  for layers in (3, 6):
    cfg = _cfg(variant, k=3, num_layers=layers, d_model=64, d_ff=128, scan_layers=True, remat='dots_no_batch')
    params = jax.eval_shape(lambda cfg=cfg: LM(cfg).init(jax.random.key(0), jnp.zeros((1, LEN), jnp.int32)))
    tokens = jax.ShapeDtypeStruct((2, 65), jnp.int32)
    grad_fn = jax.jit(jax.grad(lambda p, t, cfg=cfg: _xent(cfg, p, t)))
    temp.append(grad_fn.lower(nn.unbox(params['params']), tokens).compile().memory_analysis().temp_size_in_bytes)
  return (temp[1] - temp[0]) / 3


@pytest.mark.slow
def test_pa_keeps_no_extra_activation_per_scanned_layer():
  # The paper's form of PA reads x_{i−1}, x_{i−2} at layer i, so a layer scan would keep two more (B, L, D)
  # activations per layer; the push form keeps only rank-r messages, (B, L, k(k−1)/2·r) for eq. 6 (12 wide here,
  # 96 at the paper preset's 768). One activation here: 2·64·64·4 bytes.
  activation = 2 * 64 * 64 * 4
  base = _scan_bytes_per_layer(None)
  assert base > 3 * activation  # the measure sees activations at all
  assert _scan_bytes_per_layer('rw+lr+pa') - base < activation / 2


# ---------------------------------------------------------------------------------------------------
# Model options.

OPTIONS = [
    ('post_norm', dict(norm_position='post')),
    ('learned_positions', dict(positional='learned')),
    ('swiglu', dict(mlp='swiglu')),
    ('untied', dict(tie_embeddings=False)),
    ('bfloat16_compute', dict(dtype='bfloat16')),
    ('bfloat16_params', dict(dtype='bfloat16', param_dtype='bfloat16')),
]


OPTION_CASES = [(i, o, 'rw_lr_pa_sublayer') for i, o in OPTIONS]
OPTION_CASES += [(i, o, 'gemma3n_sublayer') for i, o in OPTIONS if i in ('post_norm', 'bfloat16_params')]


@pytest.mark.parametrize('options,variant', [c[1:] for c in OPTION_CASES], ids=[f'{c[0]}-{c[2]}' for c in OPTION_CASES])
def test_options_run_and_are_finite_BxLxV(options, variant):
  cfg = dataclasses.replace(BY_ID[variant], **options)
  params = _random_params(cfg, 11)
  logits_BxLxV = _logits(cfg, params, _tokens(12))
  assert logits_BxLxV.shape == (BATCH, LEN, VOCAB) and logits_BxLxV.dtype == np.float32
  assert np.all(np.isfinite(logits_BxLxV))
  assert np.std(logits_BxLxV) > 0.1
  param_dtype = jnp.bfloat16 if cfg.param_dtype == 'bfloat16' else jnp.float32
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(param_dtype)}
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  assert any('pos_embed' in n for n in names) == (cfg.positional == 'learned')
  assert any("'gate'" in n for n in names) == (cfg.mlp == 'swiglu')
  assert any("'unembed'" in n for n in names) == (not cfg.tie_embeddings)


# ---------------------------------------------------------------------------------------------------
# Sharding metadata.

RULE_NAMES = {name for name, _ in train_config.LOGICAL_AXIS_RULES}


@pytest.mark.parametrize('scan_layers', [True, False])
@pytest.mark.parametrize('cfg', [c for _, c in LM_VARIANTS] + [_cfg('rw', laurel=dict(rw_norm='sigmoid')),
                                                              _cfg('rw+lr', positional='learned', mlp='swiglu',
                                                                   tie_embeddings=False)],
                         ids=[i for i, _ in LM_VARIANTS] + ['rw_sigmoid_scalar', 'learned_swiglu_untied'])
def test_every_param_has_logical_axis_names(cfg, scan_layers):
  cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  boxed = _boxed_shapes(cfg)
  leaves = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    assert isinstance(leaf, nn.Partitioned), where
    assert len(leaf.names) == leaf.value.ndim, (where, leaf.names, leaf.value.shape)
    assert set(leaf.names) <= RULE_NAMES | {None}, (where, leaf.names)
    if scan_layers and 'layers' in where:
      assert leaf.names[0] == 'layers', where
  specs = nn.get_partition_spec(boxed)
  for (path, spec), (_, leaf) in zip(jax.tree_util.tree_flatten_with_path(specs)[0], leaves):
    assert isinstance(spec, jax.sharding.PartitionSpec), jax.tree_util.keystr(path)
    assert tuple(spec) == tuple(leaf.names)


# ---------------------------------------------------------------------------------------------------
# Parameter counts.

LM_COUNTS = [
    # (id, cfg, LAuReL params in the whole LM, written out: sites × per-site closed form at D=16, r=4)
    ('rw_block', _cfg('rw'), 2 * 2),
    ('rw_sigmoid_per_dim_block', BY_ID['rw_sigmoid_per_dim'], 2 * 16),
    ('lr_block', _cfg('lr'), 2 * 128),
    ('lr_sublayer', _cfg('lr', 'sublayer'), 4 * 128),
    ('pa_identity_block_k2', _cfg('pa'), 2 * 2),
    ('pa_low_rank_sublayer_k3', BY_ID['pa_low_rank_sublayer'], 4 * 131),
    ('rw_lr_block', _cfg('rw+lr'), 2 * 130),
    ('rw_lr_pa_block_k2', _cfg('rw+lr+pa'), 2 * 260),  # 2rkD + k + 2 = 256 + 2 + 2
    ('rw_lr_pa_sublayer_k3', BY_ID['rw_lr_pa_sublayer'], 4 * 389),
    ('lr_pa_sublayer_k4', BY_ID['lr_pa_sublayer'], 4 * 516),  # 2rkD + k = 512 + 4
    ('gemma3n_sublayer', BY_ID['gemma3n_sublayer'], 4 * 146),  # 2rD + 2 + D
]


@pytest.mark.parametrize('scan_layers', [True, False])
@pytest.mark.parametrize('cfg,expected', [(c, n) for _, c, n in LM_COUNTS], ids=[i for i, _, _ in LM_COUNTS])
def test_lm_laurel_param_count_is_sites_times_closed_form(cfg, expected, scan_layers):
  cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  shapes = nn.unbox(_boxed_shapes(cfg))
  assert cfg.num_sites * closed_form_params(cfg.stream, cfg.d_model) == expected
  assert _count(_laurel_leaves(shapes)) == expected
  base = nn.unbox(_boxed_shapes(dataclasses.replace(cfg, stream=StreamSpec())))
  assert _count(shapes) - _count(base) == expected


@pytest.fixture(scope='module')
def table5_counts():
  """Total params of each Table 5 row at the paper preset (abstract init, nothing materialised)."""
  counts = {}
  for row in c4_ablation.ROWS:
    cfg = LMConfig.from_config(c4_ablation.get_config(f'{row},preset=paper').model)
    shapes = jax.eval_shape(lambda cfg=cfg: LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    counts[row] = (cfg, _count(nn.unbox(shapes)), _count(_laurel_leaves(nn.unbox(shapes))))
  return counts


def test_table5_baselines_match_paper(table5_counts):
  # 24/28 × (4D² + 2DF + 2D) + 32768·D + D with D = 768, F = 2048.
  assert table5_counts['baseline_24'][1] == 157_324_032
  assert table5_counts['baseline_28'][1] == 179_350_272
  assert table5_counts['baseline_24'][1] == pytest.approx(157.20e6, rel=2e-3)
  assert table5_counts['baseline_28'][1] == pytest.approx(179.23e6, rel=2e-3)


@pytest.mark.parametrize('row,paper_delta_m,delta', [
    ('rw', 0.0, 24 * 2),
    ('lr', 1.20, 24 * 49_152),
    ('pa', 0.02, 24 * 3),
    ('rw_lr', 1.20, 24 * 49_154),
    ('rw_lr_pa', 3.63, 24 * 147_461),
])
def test_table5_laurel_deltas_match_paper(table5_counts, row, paper_delta_m, delta):
  cfg, total, laurel = table5_counts[row]
  got = total - table5_counts['baseline_24'][1]
  assert got == delta == laurel == cfg.num_sites * closed_form_params(cfg.stream, cfg.d_model)
  assert abs(got / 1e6 - paper_delta_m) <= 0.1
  assert abs(total / 1e6 - paper.TABLE5[row]['params_m']) / paper.TABLE5[row]['params_m'] < 2e-3


# ---------------------------------------------------------------------------------------------------
# Config validation: ValueError naming the field and the value, from the config alone (nothing traced).

def _model_cfg(row='rw_lr', laurel=None, **model):
  """A copy of configs/c4_ablation.py's tiny-preset model config with overrides (6 layers, D = 128)."""
  m = c4_ablation.get_config(f'{row},preset=tiny').model.copy_and_resolve_references()
  with m.unlocked():
    for key, value in model.items():
      m[key] = value
    for key, value in (laurel or {}).items():
      m.laurel[key] = value
  return m


def test_c4_ablation_rows_parse():
  for row, (layers, laurel) in c4_ablation.ROWS.items():
    for preset in ('paper', 'tiny'):
      cfg = LMConfig.from_config(c4_ablation.get_config(f'{row},preset={preset}').model)
      assert cfg.stream.design == ('laurel' if laurel else 'residual')
      assert getattr(cfg.stream, 'variant', None) == laurel.get('variant')
      assert cfg.num_layers == (layers if preset == 'paper' else layers // 4)
  cfg = LMConfig.from_config(_model_cfg(laurel=dict(variant='pa', k=12, site='sublayer')))
  assert cfg.num_sites == 12 and cfg.stream.k == 12


BAD_LAUREL = [
    # (id, model.laurel overrides, message fragment)
    ('rank_0', dict(rank=0), 'model.laurel.rank=0'),
    ('rank_negative', dict(rank=-1), 'model.laurel.rank=-1'),
    ('rank_above_d', dict(rank=129), 'model.laurel.rank=129'),
    ('k_0', dict(variant='pa', k=0), 'model.laurel.k=0'),
    ('k_above_layers', dict(variant='rw+lr+pa', k=7), 'model.laurel.k=7'),
    ('k_above_sublayer_sites', dict(variant='pa', k=13, site='sublayer'), 'model.laurel.k=13'),
    ('variant_rw_xx', dict(variant='rw+xx'), "model.laurel.variant='rw+xx'"),
    ('variant_foo', dict(variant='foo'), "model.laurel.variant='foo'"),
    ('variant_none', dict(variant='none'), "model.laurel.variant='none'"),  # design 'residual' is the plain one
    ('rw_norm', dict(rw_norm='relu'), "model.laurel.rw_norm='relu'"),
    ('a_init', dict(a_init='he'), "model.laurel.a_init='he'"),
    ('pa_h', dict(variant='pa', pa_h='conv'), "model.laurel.pa_h='conv'"),
    ('form', dict(form='gemma4'), "model.laurel.form='gemma4'"),
    ('site', dict(site='layer'), "model.laurel.site='layer'"),
    ('unknown_field', dict(ranks=8), 'model.laurel.ranks: unknown field'),
]


@pytest.mark.parametrize('laurel,message', [b[1:] for b in BAD_LAUREL], ids=[b[0] for b in BAD_LAUREL])
def test_from_config_rejects_bad_laurel(laurel, message):
  with pytest.raises(ValueError) as info:
    LMConfig.from_config(_model_cfg(laurel=laurel))
  assert message in str(info.value)


BAD_MODEL = [
    ('unknown_field', dict(n_layers=4), 'model.n_layers: unknown field'),
    ('norm_position', dict(norm_position='sandwich'), "model.norm_position='sandwich'"),
    ('positional', dict(positional='alibi'), "model.positional='alibi'"),
    ('mlp', dict(mlp='relu'), "model.mlp='relu'"),
    ('dtype', dict(dtype='float16'), "model.dtype='float16'"),
    ('param_dtype', dict(param_dtype='int8'), "model.param_dtype='int8'"),
    ('remat', dict(remat='everything'), "model.remat='everything'"),
    ('num_layers', dict(num_layers=0), 'model.num_layers=0'),
    ('d_model', dict(d_model=-8), 'model.d_model=-8'),
    ('num_heads_divides', dict(num_heads=3), 'model.num_heads=3'),
    ('rope_odd_head_width', dict(num_heads=128), 'model.num_heads=128'),
]


@pytest.mark.parametrize('model,message', [b[1:] for b in BAD_MODEL], ids=[b[0] for b in BAD_MODEL])
def test_from_config_rejects_bad_model(model, message):
  with pytest.raises(ValueError) as info:
    LMConfig.from_config(_model_cfg(**model))
  assert message in str(info.value)


@pytest.mark.parametrize('field,value,message', [
    ('laurel.rank', 4.5, r'model\.laurel\.rank=4\.5'), ('num_layers', True, r'model\.num_layers=True'),
    ('tie_embeddings', 1, r'model\.tie_embeddings=1: must be a bool'),
    ('scan_layers', 'no', r"model\.scan_layers='no': must be a bool"),
    ('rope_base', '1e4', r"model\.rope_base='1e4'")])
def test_from_config_names_bad_types_in_plain_dicts(field, value, message):
  # Types a locked ConfigDict would refuse; from_config still names them.
  m = _model_cfg().to_dict()
  node, leaf = (m['laurel'], 'rank') if field == 'laurel.rank' else (m, field)
  node[leaf] = value
  with pytest.raises(ValueError, match=message):
    LMConfig.from_config(m)
  assert LMConfig.from_config(_model_cfg().to_dict()).stream == LaurelSpec(variant='rw+lr', rank=8, k=3)
