"""ResNet with LAuReL (or ReZero, LayerScale) residuals: exact parameter counts, shapes, BatchNorm modes, each design
= baseline at init, PA restarting at each stage, and every stage's chain against a NumPy evaluation of its
equations (LAuReL's eqs. 2–6, ReZero's eq. 1, CaiT's LayerScale) at random parameters."""

import dataclasses
import functools
import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import imagenet_resnet50
from laurel import resnet
from laurel.designs import StreamSpec, logical_axis_rules
from laurel.designs.laurel import LaurelSpec, closed_form_params
from scripts import paper

RESNET50 = 25_557_032
RESNET50_BATCH_STATS = 53_120
# A small net with a stage boundary and a two-block stage, so PA sees real and reset history.
SMALL = resnet.ResNetConfig(num_classes=5, stage_sizes=(1, 2), base_width=4)
VARIANTS = {
    'rw': dict(variant='rw'),
    'rw_sigmoid_per_dim': dict(variant='rw', rw_norm='sigmoid', rw_per_dim=True),
    'lr': dict(variant='lr'),
    'pa': dict(variant='pa'),
    'pa_low_rank': dict(variant='pa', pa_h='low_rank'),
    'rw_lr': dict(variant='rw+lr'),
    'rw_pa': dict(variant='rw+pa'),
    'rw_lr_pa': dict(variant='rw+lr+pa'),
}


def paper_cfg(row, preset='paper'):
  return resnet.ResNetConfig.from_config(imagenet_resnet50.get_config(f'{row},preset={preset}').model)


def small_cfg(**laurel):
  return dataclasses.replace(SMALL, stream=LaurelSpec(a_init='xavier', rank=2, k=3, **laurel))


def images(n=4, size=16, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n, size, size, 3)), jnp.float32)


# Small models run eagerly: XLA:CPU compiles a whole init (threefry per parameter) slowly on 2 cores, while
# op-by-op compiles are cached across variants (same conv/BN shapes). unsafe_rbg compiles faster than threefry.
@functools.cache
def init_vars(cfg):
  """Boxed variables; parameters and statistics do not depend on the input's batch or image size."""
  return resnet.ResNet(cfg).init(jax.random.key(0, impl='unsafe_rbg'), jnp.zeros((1, 16, 16, 3)), train=False)


def apply_fn(cfg, train):
  """(logits, {'batch_stats': ...}): train=True updates the statistics, train=False must leave them."""
  return lambda v, x: resnet.ResNet(cfg).apply(v, x, train=train, mutable=['batch_stats'])


def param_counts(cfg, image_size=32):
  """(parameters, batch statistics) of `ResNet(cfg)`, from shapes only (jax.eval_shape allocates nothing)."""
  x = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  shapes = jax.eval_shape(lambda x: resnet.ResNet(cfg).init(jax.random.key(0), x, train=False), x)
  count = lambda tree: sum(int(leaf.size) for leaf in jax.tree.leaves(tree))
  return count(shapes['params']), count(shapes.get('batch_stats', {}))


def flat(tree):
  return flax.traverse_util.flatten_dict(nn.unbox(tree))


def unflat(d):
  return flax.traverse_util.unflatten_dict(d)


# --- parameter counts (shapes only: jax.eval_shape allocates nothing) ---

def test_resnet50_baseline_count_is_exact():
  assert param_counts(paper_cfg('baseline')) == (RESNET50, RESNET50_BATCH_STATS)


def test_baseline_plus_one_block_adds_one_identity_bottleneck():
  params, stats = param_counts(paper_cfg('baseline_plus_1'))
  assert params - RESNET50 == 1_117_184  # 1024·256 + 9·256² + 256·1024 + 2·(256+256+1024)
  assert round(100 * (params - RESNET50) / RESNET50, 2) == 4.37  # Table 1
  assert stats - RESNET50_BATCH_STATS == 2 * (256 + 256 + 1024)


@pytest.mark.parametrize('row,added', [('rw', 32), ('rw_lr', 483_360), ('rw_lr_pa', 1_450_064)])
def test_table1_laurel_rows_add_the_closed_form(row, added):
  cfg = paper_cfg(row)
  assert cfg.stream.a_init == 'xavier'
  closed = sum(closed_form_params(cfg.stream, d) for d in (256,) * 3 + (512,) * 4 + (1024,) * 6 + (2048,) * 3)
  assert closed == sum(closed_form_params(cfg.stream, d) for d in cfg.block_channels) == added
  assert param_counts(cfg) == (RESNET50 + added, RESNET50_BATCH_STATS)


@pytest.mark.parametrize('name', VARIANTS)
def test_every_variant_adds_the_closed_form_per_block(name):
  cfg = small_cfg(**VARIANTS[name])
  base, base_stats = param_counts(SMALL)
  params, stats = param_counts(cfg)
  assert params - base == sum(closed_form_params(cfg.stream, d) for d in (16, 32, 32)) > 0
  assert stats == base_stats


def test_every_parameter_has_logical_axis_names():
  cfg = paper_cfg('rw_lr_pa')
  shapes = jax.eval_shape(lambda x: resnet.ResNet(cfg).init(jax.random.key(0), x, train=False),
                          jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32))
  leaves = jax.tree.leaves(shapes['params'], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert all(isinstance(p, nn.Partitioned) and len(p.names) == p.value.ndim for p in leaves)
  names = flax.traverse_util.flatten_dict(shapes['params'])
  assert names[('stage1_block0', 'conv2', 'kernel')].names == resnet.KERNEL_AXES
  assert names[('stage4_block2', 'laurel', 'pa_a')].names == ('laurel_k', 'conv_out', 'laurel_rank')
  # RW: one ChainRW per stage holds every block's (w_α, w_β), a row per block.
  rw = {k: v for k, v in names.items() if k[-1] == 'rw_w'}
  assert {k: v.value.shape for k, v in rw.items()} == {
      (f'stage{s + 1}_laurel_rw', 'rw_w'): (n, 2) for s, n in enumerate(cfg.stage_sizes)}
  assert all(v.names == ('laurel_sites', 'laurel_rw') for v in rw.values())


# --- forward ---

@pytest.mark.parametrize('size,dtype', [(32, 'float32'), (48, 'bfloat16')])
def test_forward_shapes(size, dtype):
  cfg = dataclasses.replace(paper_cfg('rw_lr_pa', 'tiny'), dtype=dtype)
  x = jax.ShapeDtypeStruct((3, size, size, 3), jnp.float32)
  for train in (False, True):
    def fwd(x, train=train):
      model = resnet.ResNet(cfg)
      variables = model.init(jax.random.key(0), x, train=False)
      return model.apply(variables, x, train=train, mutable=['batch_stats'] if train else False)
    out = jax.eval_shape(fwd, x)
    logits = out[0] if train else out
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32


def test_resnet50_forward_shape_at_224():
  out = jax.eval_shape(lambda x: resnet.ResNet(paper_cfg('rw_lr')).init_with_output(
      jax.random.key(0), x, train=False)[0], jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32))
  assert out.shape == (2, 1000) and out.dtype == jnp.float32


@pytest.mark.slow
def test_batchnorm_train_updates_statistics_and_eval_uses_them():
  cfg = small_cfg(variant='rw+lr+pa')
  x = images()
  variables = init_vars(cfg)
  stats0 = variables['batch_stats']
  logits, updates = apply_fn(cfg, True)(variables, x)
  assert logits.shape == (4, 5)
  s0, s1 = flat(stats0), flat(updates['batch_stats'])
  moved = [k for k in s0 if not np.allclose(s0[k], s1[k])]
  assert len(moved) == len(s0)  # every mean and var moved, momentum 0.9 of the batch statistics
  mean_key = ('stem_bn', 'mean')
  stem_out = nn.Conv(4, (7, 7), 2, padding=[(3, 3)] * 2, use_bias=False).apply(
      {'params': {'kernel': nn.unbox(variables['params'])['stem_conv']['kernel']}}, x)
  np.testing.assert_allclose(s1[mean_key], 0.1 * stem_out.mean((0, 1, 2)), rtol=1e-4, atol=1e-6)

  # Eval: batch-independent, a function of the running statistics, and leaves them as they are.
  eval_fn = apply_fn(cfg, False)
  new = {**variables, 'batch_stats': updates['batch_stats']}
  full, state = eval_fn(new, x)
  assert jax.tree.all(jax.tree.map(np.array_equal, state['batch_stats'], new['batch_stats']))
  # The same two images in another batch (of the same size: eager ops compiled once).
  mixed = jnp.concatenate([x[:2], images(seed=1)[:2]])
  np.testing.assert_allclose(full[:2], eval_fn(new, mixed)[0][:2], rtol=1e-5, atol=1e-5)
  assert not np.allclose(full, eval_fn(variables, x)[0], atol=1e-5)
  # Train mode normalises with the batch: the same image scores differently in another batch.
  other, _ = apply_fn(cfg, True)(variables, mixed)
  assert not np.allclose(logits[:2], other[:2], atol=1e-5)


# --- LAuReL at initialisation equals the plain residual ---

def shared_weights(variables, seed=0):
  """Gives the zero-initialised last BN scales random values, so f(x) != 0 and the comparison means something."""
  rng = np.random.default_rng(seed)
  params = {k: (rng.normal(size=v.shape).astype(v.dtype) if k[-2] == 'bn3' and k[-1] == 'scale' else v)
            for k, v in flat(variables['params']).items()}
  return {'params': unflat(params), 'batch_stats': nn.unbox(variables['batch_stats'])}


def is_laurel(key):
  """A LAuReL parameter: under a block's 'laurel' site or a stage's 'stage<s>_laurel_rw' (ChainRW)."""
  return any('laurel' in part for part in key)


def without_laurel(variables):
  return {'params': unflat({k: v for k, v in flat(variables['params']).items() if not is_laurel(k)}),
          'batch_stats': variables['batch_stats']}


@pytest.mark.parametrize('name', VARIANTS)
def test_laurel_at_init_equals_baseline(name):
  cfg = small_cfg(**VARIANTS[name])
  x = images()
  variables = shared_weights(init_vars(cfg))
  base = without_laurel(variables)
  small_shapes = jax.eval_shape(lambda x: resnet.ResNet(SMALL).init(jax.random.key(0), x, train=False), x)
  assert flat(base['params']).keys() == flat(small_shapes['params']).keys()
  np.testing.assert_allclose(apply_fn(cfg, False)(variables, x)[0], apply_fn(SMALL, False)(base, x)[0],
                             rtol=1e-5, atol=1e-5)
  if name == 'rw_lr_pa':  # train mode (batch statistics) too, for the full combination
    np.testing.assert_allclose(apply_fn(cfg, True)(variables, x)[0], apply_fn(SMALL, True)(base, x)[0],
                               rtol=1e-5, atol=1e-5)
  # The comparison is not vacuous: moving one LAuReL parameter off its init changes the output.
  params = flat(variables['params'])
  key = next(k for k in sorted(params) if k[0] in ('stage2_block1', 'stage2_laurel_rw')
             and k[-1] in ('rw_w', 'lr_b', 'pa_b', 'pa_gamma'))
  # rw_w is (blocks, 2) or (blocks, D): move block 1's first entry (not a whole softmax row, which is inert).
  params[key] = params[key].at[(1, 0) if key[-1] == 'rw_w' else 0].add(0.5)
  moved = apply_fn(cfg, False)({**variables, 'params': unflat(params)}, x)[0]
  assert not np.allclose(moved, apply_fn(cfg, False)(variables, x)[0], atol=1e-4)


SCALE_DESIGNS = {'rezero': 'rezero_alpha', 'layerscale': 'layerscale'}  # design: its parameter


@pytest.mark.parametrize('design', SCALE_DESIGNS)
def test_scale_designs_start_as_the_baseline_and_add_one_scale_per_block(design):
  # The last BN's scale starts at 0, so f(x) = 0 and every block starts as relu(shortcut(x)): exactly the baseline.
  cfg = dataclasses.replace(SMALL, stream=StreamSpec(design=design))
  variables = {'params': nn.unbox(init_vars(cfg)['params']), 'batch_stats': nn.unbox(init_vars(cfg)['batch_stats'])}
  base = {'params': unflat({k: v for k, v in flat(variables['params']).items() if k[1] != design}),
          'batch_stats': variables['batch_stats']}
  x = images()
  np.testing.assert_array_equal(apply_fn(cfg, False)(variables, x)[0], apply_fn(SMALL, False)(base, x)[0])
  added = param_counts(cfg)[0] - param_counts(SMALL)[0]
  assert added == (sum(SMALL.stage_sizes) if design == 'rezero' else sum(SMALL.block_channels))


@pytest.mark.parametrize('design', SCALE_DESIGNS)
def test_scale_designs_follow_their_equation_at_random_params(design):
  # Every block's output against relu(x_i + s·f(x_i)), s = ReZero's α (eq. 1) or LayerScale's λ (CaiT §2), with f
  # and s at random values; x_i the (projected) shortcut.
  cfg = dataclasses.replace(SMALL, stream=StreamSpec(design=design), stage_sizes=(1, 3))
  variables = shared_weights(init_vars(cfg))
  rng = np.random.default_rng(4)
  params = {k: v + rng.normal(size=v.shape).astype(v.dtype) if k[-1] == SCALE_DESIGNS[design] else v
            for k, v in flat(variables['params']).items()}
  _, state = resnet.ResNet(cfg).apply({**variables, 'params': unflat(params)}, images(), train=False,
                                      capture_intermediates=True, mutable=['intermediates'])
  inter = state['intermediates']
  for s, n in enumerate(cfg.stage_sizes):
    for i in range(n):
      name = f'stage{s + 1}_block{i}'
      x_i = inter[name]['proj_bn']['__call__'][0] if i == 0 else inter[f'stage{s + 1}_block{i - 1}']['__call__'][0]
      fx, x_i = (np.asarray(a, np.float64) for a in (inter[name]['bn3']['__call__'][0], x_i))
      scale = np.asarray(params[(name, design, SCALE_DESIGNS[design])], np.float64)
      got = np.asarray(inter[name]['__call__'][0], np.float64)
      np.testing.assert_allclose(got, np.maximum(x_i + scale * fx, 0), rtol=1e-5, atol=1e-5, err_msg=name)
      assert not np.allclose(got, np.maximum(x_i + fx, 0), atol=1e-3)  # the scale is used


def block_outputs(cfg, variables, x):
  """(logits, {block: its LAuReL output, before the ReLU}, {block: (f(x_i), x_i)}) in eval mode."""
  logits, state = resnet.ResNet(cfg).apply(variables, x, train=False, mutable=['intermediates'],
                                           capture_intermediates=lambda _, method: method in ('__call__', 'residual'))
  inter = state['intermediates']
  outs, inputs = {}, {}
  for s, n in enumerate(cfg.stage_sizes):
    for i in range(n):
      block = inter[f'stage{s + 1}_block{i}']
      outs[(s, i)] = np.asarray(block['laurel']['residual'][0][0], np.float64)
      x_i = block['proj_bn']['__call__'][0] if i == 0 else inter[f'stage{s + 1}_block{i - 1}']['__call__'][0][0]
      inputs[(s, i)] = (np.asarray(block['bn3']['__call__'][0], np.float64), np.asarray(x_i, np.float64))
  return np.asarray(logits), outs, inputs


def test_pa_history_restarts_at_each_stage():
  # Identity h: x_{i+1} = f(x_i) + x_i + Σ_j γ_{i,j} x_{i−j}, γ = 0 at init. In push form block i's γ_j weighs
  # the term x_i it sends to block i + j of its own stage; terms past a stage's last block are dropped.
  cfg = small_cfg(variant='pa')  # stages (1, 2), k = 3
  x = images()
  variables = shared_weights(init_vars(cfg))
  ref_logits, ref, _ = block_outputs(cfg, variables, x)

  def changed_by(block, j):
    """The blocks whose LAuReL output moves when `block`'s γ_j is set to 1, and whether the logits move."""
    params = flat(variables['params'])
    params[(block, 'laurel', 'pa_gamma')] = params[(block, 'laurel', 'pa_gamma')].at[j].set(1.0)
    logits, outs, _ = block_outputs(cfg, {**variables, 'params': unflat(params)}, x)
    moved = {b for b in outs if not np.allclose(outs[b], ref[b], atol=1e-5)}
    assert (not moved) == np.array_equal(logits, ref_logits)
    return moved

  # Stage 1's only block: x_0 sent to x_0+1, x_0+2 would reach stage 2's blocks; the chain restarts, so
  # nothing moves, in particular not stage 2's first block.
  assert changed_by('stage1_block0', 1) == changed_by('stage1_block0', 2) == set()
  # Stage 2's first block sends its projected shortcut to the next block (only), and nothing past the stage.
  assert changed_by('stage2_block0', 1) == {(1, 1)}
  assert changed_by('stage2_block0', 2) == set()
  assert changed_by('stage2_block1', 1) == changed_by('stage2_block1', 2) == set()
  # γ_0 weighs x_i itself, in every block, and moves that block and those after it.
  assert changed_by('stage1_block0', 0) == {(0, 0), (1, 0), (1, 1)}
  assert changed_by('stage2_block1', 0) == {(1, 1)}


def np_stage_outputs(spec, site_params, rw_w_S, inputs):
  """A stage's LAuReL outputs from the paper's equations in float64, site by site, given each block's f(x_i), x_i.

  eq. 2 x_{i+1} = α_i·f(x_i) + β_i·(x_i + ...): eq. 3/5 adds x_i A_i B_i; eq. 4 adds Σ_{j<k} γ_{i,j}·h_i(x_{i−j}),
  eq. 6 Σ_{j<k} γ_{i,j}·x_{i−j} A_{i,j} B_{i,j}; terms with i − j before the stage's first block do not exist.
  The push form's parameters are the sender's: (γ_{i,j}, A_{i,j}, B_{i,j}) = block (i−j)'s (γ_j, A_j, B_j).
  """
  p = [jax.tree.map(lambda a: np.asarray(a, np.float64), sp) for sp in site_params]
  outs = []
  for i, (fx, x_i) in enumerate(inputs):
    alpha, beta = 1.0, 1.0
    if spec.rw:
      w = np.asarray(rw_w_S[i], np.float64)
      if spec.rw_norm == 'softmax':
        e = np.exp(w - w.max(0))
        alpha, beta = spec.rw_scale * e / e.sum(0)
      else:
        alpha, beta = spec.rw_scale / (1 + np.exp(-w)), spec.rw_scale / (1 + np.exp(w))
    inner = x_i.copy()
    if spec.lr and not spec.pa:
      inner += x_i @ p[i]['lr_a'] @ p[i]['lr_b']
    if spec.pa:
      for j in range(min(spec.k, i + 1)):
        sender, x_ij = p[i - j], inputs[i - j][1]
        if spec.lr:
          h = x_ij @ sender['pa_a'][j] @ sender['pa_b'][j]
        elif spec.pa_h == 'low_rank':
          h = x_ij @ p[i]['pa_a'] @ p[i]['pa_b']  # h_i belongs to the receiving block
        else:
          h = x_ij
        inner += sender['pa_gamma'][j] * h
    outs.append(alpha * fx + beta * inner)
  return outs


@pytest.mark.parametrize('name', ['rw_lr_pa', 'pa', 'pa_low_rank', 'rw_sigmoid_per_dim', 'rw_lr'])
def test_stages_match_numpy_paper_equations_at_random_params(name):
  """Every block of every stage (stages (1, 3), so k = 3 terms reach the third block) against eqs. 2–6."""
  cfg = dataclasses.replace(small_cfg(**VARIANTS[name]), stage_sizes=(1, 3))
  x = images()
  variables = shared_weights(init_vars(cfg))
  rng = np.random.default_rng(1)
  params = {k: (v + 0.5 * rng.normal(size=v.shape).astype(v.dtype) if is_laurel(k) else v)
            for k, v in flat(variables['params']).items()}
  variables = {**variables, 'params': unflat(params)}
  _, outs, inputs = block_outputs(cfg, variables, x)
  p = variables['params']
  for s, n in enumerate(cfg.stage_sizes):
    site_params = [p[f'stage{s + 1}_block{i}'].get('laurel', {}) for i in range(n)]
    rw_w_S = p[f'stage{s + 1}_laurel_rw']['rw_w'] if cfg.stream.rw else None
    want = np_stage_outputs(cfg.stream, site_params, rw_w_S, [inputs[(s, i)] for i in range(n)])
    for i in range(n):
      np.testing.assert_allclose(outs[(s, i)], want[i], rtol=1e-4, atol=1e-4, err_msg=f'stage {s + 1} block {i}')
      fx, x_i = inputs[(s, i)]
      assert not np.allclose(outs[(s, i)], fx + x_i, atol=1e-3)  # the random LAuReL parameters are used


# --- config validation ---

@pytest.mark.parametrize('path,value,match', [
    (('laurel', 'site'), 'sublayer', "model.laurel.site='sublayer'"),
    (('laurel', 'form'), 'gemma3n', "model.laurel.form='gemma3n'"),
    (('laurel', 'rank'), 33, 'model.laurel.rank=33'),  # tiny: the narrowest block has D = 32
    (('laurel', 'variant'), 'rw+xx', "model.laurel.variant='rw+xx'"),
    (('stream', 'design'), 'hc',
     "model.stream.design='hc': the ResNet takes one of residual, laurel, rezero, layerscale"),
    (('stage_sizes',), (), 'model.stage_sizes=()'),
    (('stage_sizes',), (2, 0), 'model.stage_sizes=(2, 0)'),
    (('base_width',), 0, 'model.base_width=0'),
    (('num_classes',), -1, 'model.num_classes=-1'),
    (('dtype',), 'float16', "model.dtype='float16'"),
    (('bn_momentum',), 1.0, 'model.bn_momentum=1.0'),
    (('bn_epsilon',), 0.0, 'model.bn_epsilon=0.0'),
    (('zero_init_last_bn',), 1, 'model.zero_init_last_bn=1'),
    (('bogus',), 1, 'model.bogus: unknown field'),
])
def test_from_config_errors_name_field_and_value(path, value, match):
  model = imagenet_resnet50.get_config('rw_lr_pa,preset=tiny').model.to_dict()
  node = model
  for p in path[:-1]:
    node = node[p]
  node[path[-1]] = value
  with pytest.raises(ValueError, match=re.escape(match)) as err:
    resnet.ResNetConfig.from_config(model)
  assert '\n' not in str(err.value)


@pytest.mark.parametrize('preset', ['paper', 'tiny'])
@pytest.mark.parametrize('row', imagenet_resnet50.ROWS)
def test_config_rows(row, preset):
  c = imagenet_resnet50.get_config(f'{row},preset={preset}')
  cfg = resnet.ResNetConfig.from_config(c.model)
  assert c.task == 'classification' and c.row == row
  assert set(c.model.keys()) >= {f.name for f in dataclasses.fields(resnet.ResNetConfig)} | {'laurel'}
  assert set(c.model.laurel.keys()) == {f.name for f in dataclasses.fields(LaurelSpec)}
  assert row in paper.TABLE1 and c.baseline_row == 'baseline'
  if row != 'baseline_plus_1':  # LAuReL sits on the baseline's network
    assert cfg.stage_sizes == resnet.ResNetConfig.from_config(imagenet_resnet50.get_config(
        f'baseline,preset={preset}').model).stage_sizes
  assert cfg.num_classes == c.data.num_classes
  if preset == 'paper':
    assert (c.data.image_size, c.data.name, c.batch_size) == (224, 'imagenet', 1024)
  else:
    assert (c.data.image_size, c.data.name, c.batch_size, cfg.base_width) == (32, 'synthetic', 32, 8)
  with pytest.raises(ValueError, match="config row 'nope'"):
    imagenet_resnet50.get_config('nope')


# --- SPMD: BatchNorm needs no axis_name ---

@pytest.mark.slow
def test_sharded_train_step_matches_single_device():
  """Batch over data x fsdp, parameters by their logical names: same logits and global-batch statistics."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = jax.device_count()
  fsdp = 2 if n % 2 == 0 else 1
  mesh = jax.make_mesh((n // fsdp, fsdp, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  cfg = small_cfg(variant='rw+lr+pa')
  x = images(n=2 * n)
  variables = init_vars(cfg)
  want_logits, want_state = apply_fn(cfg, True)(variables, x)

  rules = logical_axis_rules()
  param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    sharded = jax.device_put(variables, param_shardings)
    xs = jax.device_put(x, NamedSharding(mesh, P(('data', 'fsdp'))))
    # Unoptimised XLA code: compiling is what costs here, and numerics do not depend on it.
    train_fn = jax.jit(lambda v, x: resnet.ResNet(cfg).apply(v, x, train=True, mutable=['batch_stats']),
                       compiler_options={'xla_backend_optimization_level': 0})
    logits, state = train_fn(sharded, xs)
  assert sharded['params']['stage2_block1']['conv3']['kernel'].value.sharding.spec == P(None, None, None, 'fsdp')
  np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
