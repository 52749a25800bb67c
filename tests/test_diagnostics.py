"""A design reports its own diagnostics (issue 60, Design.diagnostics): LAuReL's α, β and γ per site, the scale
family's scales, the hyper-connection family's mixing norms, DenseFormer's and AttnRes's depth weights, read from the
parameters alone and logged as training metrics (tests/test_metric_writers.py: in TensorBoard, never evaluated)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from design_chain import LAYERS, T, init
import reference
from helpers import TINY_LM, load_config
from laurel import designs, train_config
from laurel.designs import hyper
from laurel.cli import console


def report_of(name, spec, params) -> dict:
  """The design's report on a design_chain network's parameters (LAYERS layers of T sites), as the loop fetches it."""
  design = designs.REGISTRY[name]
  chain = design.chain(spec, LAYERS, T, 8).apply({'params': params.get('chain', {})})
  stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
  sites = stack([stack([params.get(f'layers_{l}', {}).get(f'site{t}', {}) for t in range(T)])
                 for l in range(LAYERS)])
  return jax.device_get(design.diagnostics(spec, chain, sites))


def random_params(task, seed=0) -> dict:
  """A task's parameters at random values (N(0, 1)), without initialising the model."""
  shapes = nn.unbox(jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params'])
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


def rw_weights(w_Sx2):
  """RW's (α, β) = rw_scale·softmax(w) per site (§2.1; 1 and 1 at init)."""
  return 2 * np.exp(w_Sx2) / np.exp(w_Sx2).sum(-1, keepdims=True)


@pytest.mark.parametrize('scan', [True, False])
def test_laurel_reports_rw_alpha_and_beta_and_pa_gamma_of_every_site_of_the_lm(scan):
  """At random parameters, against RW's normalisation and PA's γ read straight from each site (push form: site i's
  γ_j is what it sends to site i + j), for the LM's two sites per layer, its layers scanned or not."""
  config = load_config('configs/c4_ablation.py:rw_lr_pa,preset=tiny', {
      **TINY_LM, 'model.laurel.site': 'sublayer', 'model.scan_layers': scan})
  task = train_config.validate_config(config, num_devices=1, process_count=1)
  params = random_params(task)
  metrics = task.design_metrics(jax.device_get(jax.jit(task.design_report)(params)))
  weights, num_sites, k = rw_weights(params['laurel_rw']['rw_w']), 2 * TINY_LM['model.num_layers'], 3
  layer = lambda l: params['layers'] if scan else params[f'layers_{l}']
  gamma = lambda s: layer(s // 2)[f'laurel_{("attn", "mlp")[s % 2]}']['pa_gamma'][(s // 2,) if scan else ()]
  expected = {}
  for s in range(num_sites):
    expected.update({f'laurel/alpha_{s:02d}': weights[s, 0], f'laurel/beta_{s:02d}': weights[s, 1]})
    expected.update({f'laurel/gamma_{s:02d}_{j}': gamma(s)[j] for j in range(k)})
  assert metrics.keys() == expected.keys()
  np.testing.assert_allclose([metrics[key] for key in expected], list(expected.values()), rtol=1e-6)


def test_a_resnet_reports_each_stage_s_chain():
  config = load_config('configs/imagenet_resnet50.py:rw,preset=tiny')
  task = train_config.validate_config(config, num_devices=1, process_count=1)
  params = random_params(task)
  metrics = task.design_metrics(jax.device_get(jax.jit(task.design_report)(params)))
  expected = {}
  for stage, blocks in enumerate(task.model_cfg.stage_sizes, 1):
    weights = rw_weights(params[f'stage{stage}_laurel_rw']['rw_w'])
    for name, column in (('alpha', 0), ('beta', 1)):
      expected.update({f'laurel/stage{stage}_{name}_{j:02d}': weights[j, column] for j in range(blocks)})
  assert metrics.keys() == expected.keys()
  np.testing.assert_allclose([metrics[key] for key in expected], list(expected.values()), rtol=1e-6)


def _mhc_start(n):
  """‖(I + 11ᵀ/n)/2 − I‖_F: mHC's (and mHC-lite's) H_res at init."""
  return float(np.linalg.norm((np.eye(n) + 1 / n) / 2 - np.eye(n)))


# design -> (spec, {name: its value at every site or layer at init}) over design_chain's LAYERS layers of T = 2 sites;
# the specs are tests/reference.py's cases, whose init design_chain keeps for tests/test_designs.py too.
STARTS = {
    'laurel': (reference.LAUREL_RW_PA, {'alpha': 1.0, 'beta': 1.0, 'gamma': 0.0}),
    'rezero': (reference.STREAM_CASES['rezero'], {'alpha': 0.0}),
    'layerscale': (reference.STREAM_CASES['layerscale'], {'mean_abs_lambda': 0.1}),
    'hc': (reference.STREAM_CASES['hc'], {'mixing': 0.0}),
    'mhc': (reference.STREAM_CASES['mhc'], {'mixing': _mhc_start(3)}),
    'mhc_lite': (reference.STREAM_CASES['mhc_lite'], {'mixing': _mhc_start(3)}),
    'frac': (reference.STREAM_CASES['frac'], {'mixing': 0.0, 'input_mixing': 0.0}),
    'denseformer': (reference.STREAM_CASES['denseformer'], {'own': 1.0, 'others': 0.0}),
    'attnres': (reference.STREAM_CASES['attnres'], {'query_norm': 0.0}),
}


@pytest.mark.parametrize('name', STARTS)
def test_each_family_reports_where_its_design_starts(name):
  spec, starts = STARTS[name]
  report = report_of(name, spec, init(name, spec))
  assert report.keys() == starts.keys()
  for key, value in starts.items():
    np.testing.assert_allclose(report[key], value, atol=1e-5, err_msg=key)


def test_the_hyper_mixing_norm_reads_the_learned_mixing():
  spec = designs.REGISTRY['hc'].config(expansion=2)
  params = init('hc', spec)
  params['layers_1']['site0']['a_r'] = jnp.asarray([[1.0, 0.5], [0.0, 1.0]])  # stream 0 feeds stream 1 too
  report = report_of('hc', spec, params)['mixing']
  assert report.shape == (LAYERS * T,) and report[2 * 1 + 0] == pytest.approx(0.5) and np.count_nonzero(report) == 1
  assert hyper.lite_h_res(jnp.zeros(2), 2) == pytest.approx(jnp.full((2, 2), 0.5))


def test_diagnostics_are_logged_not_printed_on_the_console_line():
  row = {'loss': 2.5, 'laurel/alpha_00': 1.25, 'step_time_s': 0.5, 'tokens_per_s': 100.0, 'mean_of_steps': 2}
  assert console.step_line(4, 8, row, 'tokens') == ('step 4/8 (50%) | mean of 2 steps: loss 2.5000 | 0.5 s/step, 100 '
                                                    'tokens/s | ETA 2.0 s')
  assert designs.scalars('laurel', {'gamma': np.ones((2, 3)), 'alpha': np.zeros(2)}) == {
      **{f'laurel/gamma_{s:02d}_{j}': 1.0 for s in range(2) for j in range(3)}, 'laurel/alpha_00': 0.0,
      'laurel/alpha_01': 0.0}
