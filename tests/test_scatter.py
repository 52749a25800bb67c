"""No train step sums a scatter-add in bfloat16 or float16. A gather's gradient is a scatter-add, and XLA:GPU adds a
contended bfloat16 scatter by a compare-and-swap loop, about 20 times slower than float32's (openxla/xla#26371): the
token lookup's gradient (65,536 rows into 264 a step at the `gpu` preset) is the case that matters. The lowered
program (StableHLO, what every backend compiles) is scanned for each scatter's combiner; and the lookup's forms
(laurel.lm.lookup) give today's numbers within bfloat16's error."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from helpers import TINY_LM, load_config
from laurel import lm, sharding, step, train_config

LOW_PRECISION = ('bf16', 'f16')


def scatter_add_dtypes(stablehlo: str) -> list[str]:
  """The element type each scatter-add of a lowered module adds in (its combiner's add); scatters that set, none."""
  dtypes = []
  for op in stablehlo.split('"stablehlo.scatter"')[1:]:
    combiner = op.split('}) : (')[0]
    dtypes += re.findall(r'stablehlo\.add [^:]*: tensor<(\w+)>', combiner)
  return dtypes


def lowered_step(spec: str, overrides: dict) -> str:
  config = load_config(spec, {'data.name': 'synthetic', **overrides})
  task = train_config.validate_config(config, num_devices=1)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    return step.lower_step(task, mesh)[0].as_text()


def test_the_scan_reads_each_scatter_adds_type():
  table, ids = jnp.ones((8, 4), jnp.bfloat16), jnp.array([1, 1, 2])
  grad_of = lambda f: jax.jit(jax.grad(lambda t: f(t).astype(jnp.float32).sum())).lower(table).as_text()
  assert scatter_add_dtypes(grad_of(lambda t: jnp.take(t, ids, axis=0))) == ['bf16']
  assert scatter_add_dtypes(grad_of(lambda t: t.at[ids].set(0))) == []  # a scatter that sets adds nothing
  assert scatter_add_dtypes(grad_of(lambda t: lm.lookup(t, ids, jnp.bfloat16))) == ['f32']
  assert scatter_add_dtypes(grad_of(lambda t: lm.lookup(t, ids, jnp.bfloat16, 'one_hot'))) == []


@pytest.mark.slow  # about 3 s each alone, lowered and not compiled
@pytest.mark.parametrize('preset', ['gpu', 'paper'])
def test_the_presets_train_steps_add_no_scatter_in_low_precision(preset):
  """Table 5's `gpu` and paper presets (bfloat16 compute): the token lookup's gradient adds in float32."""
  dtypes = scatter_add_dtypes(lowered_step(f'configs/c4_ablation.py:rw_lr_pa,preset={preset}', {}))
  assert dtypes and not set(dtypes) & set(LOW_PRECISION), dtypes


# One row of each design (and value residual, shared weights), all in bfloat16, parameters too, with learned
# positions: every gather of a parameter whose gradient is a scatter.
DESIGN_ROWS = ['laurel_rw_lr_pa', 'rezero', 'layerscale', 'hc_dynamic', 'mhc_v4_readout', 'mhc_lite', 'frac',
               'denseformer', 'attnres_block_delta', 'attnres_heads', 'mudd', 'dca', 'dca_8',
               'laurel_rw_lr_value_residual', 'residual_transformer', 'gemma3n_laurel']


@pytest.mark.slow
@pytest.mark.parametrize('row', DESIGN_ROWS)
def test_no_design_adds_a_scatter_in_low_precision(row):
  low = {'model.dtype': 'bfloat16', 'model.param_dtype': 'bfloat16', 'model.positional': 'learned',
         'model.max_len': TINY_LM['data.seq_len']}
  dtypes = scatter_add_dtypes(lowered_step(f'configs/residual_designs.py:{row},preset=tiny', {**TINY_LM, **low}))
  assert len(dtypes) >= 2 and not set(dtypes) & set(LOW_PRECISION), dtypes  # the tokens' and the positions'


def _lookup_and_grad(f, table_VxD, ids, weights):
  return jax.jit(jax.value_and_grad(lambda t: (f(t).astype(jnp.float32) * weights).sum()))(table_VxD)


@pytest.mark.parametrize('form', ['gather', 'one_hot'])
def test_the_lookup_gives_the_bfloat16_gathers_numbers(form):
  """At random parameters, against the lookup before it summed in float32 (a gather from the bfloat16 table): the
  rows exactly, the gradient within bfloat16's error; and nearer the float64 sum of the rows' gradients, as 512
  repeats of each of 8 tokens add up."""
  rng = np.random.default_rng(0)
  vocab, width = 8, 16
  table_VxD = jnp.asarray(rng.normal(size=(vocab, width)), jnp.float32)
  ids_BxL = jnp.asarray(rng.integers(0, vocab, (8, 512)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(8, 512, width)), jnp.float32)
  old = lambda t: jnp.take(t.astype(jnp.bfloat16), ids_BxL, axis=0)
  new = lambda t: lm.lookup(t.astype(jnp.bfloat16), ids_BxL, jnp.bfloat16, form)
  np.testing.assert_array_equal(np.asarray(new(table_VxD), np.float32), np.asarray(old(table_VxD), np.float32))
  (_, old_grad), (_, new_grad) = (_lookup_and_grad(f, table_VxD, ids_BxL, weights) for f in (old, new))
  exact = np.zeros((vocab, width))
  np.add.at(exact, np.asarray(ids_BxL), np.asarray(weights, np.float64))
  error = lambda g: np.linalg.norm(np.asarray(g, np.float64) - exact) / np.linalg.norm(exact)
  assert error(new_grad) < 2 ** -8 < error(old_grad), (error(new_grad), error(old_grad))  # one rounding, not 512
  difference = np.linalg.norm(np.asarray(new_grad) - np.asarray(old_grad)) / np.linalg.norm(np.asarray(old_grad))
  assert difference < 4e-2  # today's numbers within the error of 512 bfloat16 additions (2.5e-2 here)


def test_the_lm_is_the_same_with_either_lookup_form():
  cfg = lm.LMConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_layers=1, dtype='bfloat16')
  tokens_BxL = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)), jnp.int32)
  params = nn.unbox(jax.jit(lm.LM(cfg).init)(jax.random.key(0), tokens_BxL))
  logits = {form: jax.jit(lm.LM(dataclasses.replace(cfg, embed_lookup=form)).apply)(params, tokens_BxL)
            for form in ('gather', 'one_hot')}
  np.testing.assert_array_equal(logits['gather'], logits['one_hot'])
