"""What the write-once buffer designs (MUDDFormer, DCA) cost beyond what they compute: the compiled backward
recomputes no more of a layer than Baseline's, sharded sampling compiles without XLA's involuntary
rematerialization, and value residual's V_1, written once and rebuilt in the backward, keeps no activation a layer
more than Baseline-24."""

import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from helpers import ROOT, cli_env
from laurel import command_line, lm, train_config
from laurel.designs import StreamSpec


def _grad_hlo(stream):
  cfg = lm.LMConfig(vocab_size=64, d_model=32, num_heads=2, d_ff=64, num_layers=3, remat='save_qkv',
                    stream=stream)
  params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
  loss = lambda p, t: lm.LM(cfg).apply({'params': p}, t).sum()
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  return jax.jit(jax.grad(loss)).lower(nn.unbox(params), tokens).compile().as_text()


def _dots(hlo, name):
  return len(re.findall(rf'= \S+ dot\(.*op_name="[^"]*{name}/dot_general', hlo))


@pytest.mark.slow
def test_mudd_backward_recomputes_no_more_projections_than_baselines():
  # MUDDFormer's weights A are computed from the layer's output: without it saved (mudd_out, taken from the next
  # layer's input), save_qkv's backward recomputed the MLP's down projection, 7% of the step at the paper shape.
  base, mudd = _grad_hlo(StreamSpec()), _grad_hlo(StreamSpec(design='mudd'))
  for name in ('mlp/down', 'mlp/up', 'attn/out', 'attn/query'):
    assert _dots(mudd, name) == _dots(base, name), name


@pytest.mark.slow
def test_dca_reads_its_columns_without_a_selection_matmul():
  # DCA's k + 2 columns are a slice of its buffer (and y_0), not a (k + 2) x (N + 1) matmul over every slot.
  hlo = _grad_hlo(StreamSpec(design='dca'))
  assert re.search(r'= \S+ dot\(', hlo)  # the pattern finds dots at all
  assert not re.search(r'= \S+ dot\(.*op_name="[^"]*dca_attn/[a-z]+j,jbld', hlo)


def _activations_per_layer(row: str, layers=(2, 4), batch=2, seq_len=16) -> list[float]:
  """What a residual_designs row keeps per scanned layer for its backward, in D-wide float32 activations: XLA's
  temporaries of its compiled loss gradient at each layer count, their difference per added layer (between
  consecutive counts) over the bytes of one activation."""
  temps = []
  for n in layers:
    overrides = [f'model.num_layers={n}', 'model.scan_layers=True', 'model.remat=dots_no_batch', 'model.dtype=float32',
                 'model.param_dtype=float32', f'data.seq_len={seq_len}']
    config = command_line.load(f'residual_designs:{row},preset=tiny', overrides)
    task = train_config.validate_config(config, num_devices=1)
    example = task.example_batch(batch)
    variables = nn.unbox(jax.eval_shape(task.init, jax.random.key(0), example))
    params, model_state = variables.pop('params'), variables
    grad = jax.grad(lambda p, b: task.loss(p, model_state, b, train=True)[0])  # pylint: disable=cell-var-from-loop
    temps.append(jax.jit(grad).lower(params, example).compile().memory_analysis().temp_size_in_bytes)
  activation = batch * seq_len * task.model_cfg.d_model * 4
  return [(t1 - t0) / (n1 - n0) / activation for t0, t1, n0, n1 in zip(temps, temps[1:], layers, layers[1:])]


@pytest.mark.slow
def test_value_residual_keeps_no_more_activations_per_layer_than_baseline():
  # Value residual carries V_1 through the layer scan; the stack's backward rebuilds it from the final one instead of
  # saving it at every layer (a scan's own backward: one more activation a layer, 9.0 against 8.0 at d335885).
  for base, value in zip(_activations_per_layer('baseline_24'), _activations_per_layer('value_residual')):
    assert base > 2  # the measure sees activations at all
    assert abs(value - base) < 0.1, (base, value)


SAMPLE = '''
import flax.linen as nn, jax, jax.numpy as jnp
from laurel import designs, lm, sharding
from laurel.serve import generate
from laurel.designs import StreamSpec
cfg = lm.LMConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_layers=3, stream=StreamSpec(design='mudd'))
rules = designs.logical_axis_rules(sharding.LOGICAL_AXIS_RULES)
mesh = jax.make_mesh((2, 2, 2), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
  init = lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((8, 8), jnp.int32))['params']
  shardings = sharding.logical_shardings(jax.eval_shape(init), mesh, rules)
  params = jax.jit(lambda: nn.unbox(init()), out_shardings=shardings)()
  print('sampled', generate.generate(cfg, params, [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], 3)[0].shape)
'''


@pytest.mark.slow
def test_sharded_mudd_sampling_has_no_involuntary_rematerialization():
  # On a (data 2, fsdp 2, tensor 2) mesh the embedding lookup gathered rows of an fsdp-sharded table, and SPMD
  # replicated them before sharding them by batch (the warning, on every compiled prefill and decode step).
  out = subprocess.run([sys.executable, '-c', SAMPLE], env=cli_env(8), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert 'sampled (4, 3)' in out.stdout, out.stderr[-2000:]
  assert 'Involuntary full rematerialization' not in out.stderr
