"""The gated residual of tests/gated_design.py, a design from outside the package: its equation against NumPy, its
config section, and a run through laurel.main that resumes from its workdir."""

import json
import math
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from design_chain import D, LAYERS, T, init, inputs, randomize, run
from helpers import TINY_LM, call_main, losses, train_cli
from laurel import command_line, config_lib, designs, lm, main, step, train_config
from reference import np_rms

DESIGN = 'tests.gated_design:gated'


@pytest.fixture
def gated():
  """The design registered for one test, then gone from the registry (other tests enumerate every design)."""
  yield designs.lookup(DESIGN)
  designs.REGISTRY.pop('gated')
  sys.modules.pop('tests.gated_design')


@pytest.mark.parametrize('gate', ['per_feature', 'scalar'])
def test_gated_chain_is_x_plus_sigmoid_gate_times_f(gated, gate):
  spec = gated.config(gate=gate)
  params = randomize(init('gated', spec), seed=3)
  x, ws = (np.asarray(a, np.float64) for a in inputs())
  for l in range(LAYERS):
    for t in range(T):
      g = np.asarray(params[f'layers_{l}'][f'site{t}']['gate'], np.float64)
      assert g.shape == ((D,) if gate == 'per_feature' else ())
      x = x + np.tanh(np_rms(x) @ ws[l, t]) / (1 + np.exp(-g))
  np.testing.assert_allclose(run('gated', spec, params), x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(run('gated', spec, params, scan=True), x, rtol=1e-5, atol=1e-5)


def test_gated_section_is_read_checked_and_named_in_errors(gated):
  spec = 'c4_ablation:baseline_24,preset=tiny'
  config = command_line.load(spec, [f'model.stream.design={DESIGN}', 'model.gated.gate=scalar', 'model.gated.init=1.5'])
  model = lm.LMConfig.from_config(config.model)
  assert model.stream == gated.config(gate='scalar', init=1.5) and model.stream.design == 'gated'
  assert 'model.laurel.variant' in model.unused_fields('model')
  with pytest.raises(config_lib.InputError, match=r"^model\.gated\.gate='vector': must be one of per_feature, scalar"):
    lm.LMConfig.from_config(command_line.load(spec, [f'model.stream.design={DESIGN}', 'model.gated.gate=vector']).model)
  with pytest.raises(config_lib.InputError, match=r"^model\.stream\.design='tests\.no_such:gated': cannot import"):
    command_line.load(spec, ['model.stream.design=tests.no_such:gated'])


def test_the_step_built_after_the_import_keeps_its_gate_out_of_weight_decay(gated):
  """The optimizer reads the registry's no-decay names when it is built: a design imported late counts."""
  params = {'site': {'gate': jnp.ones((4, 4)), 'kernel': jnp.ones((4, 4))}}
  tx, _ = step.make_optimizer(train_config.OptimizerConfig(warmup_steps=1, weight_decay=0.5), steps=10)
  state, zero = tx.init(params), {'site': {'gate': jnp.zeros((4, 4)), 'kernel': jnp.zeros((4, 4))}}
  for _ in range(2):  # the first step's learning rate is the warmup's 0
    updates, state = tx.update(zero, state, params)
    params = optax.apply_updates(params, updates)
  assert np.all(np.asarray(params['site']['gate']) == 1) and np.all(np.asarray(params['site']['kernel']) < 1)


@pytest.fixture
def unregistered():
  """For a command line that imports the design itself: gone from the registry after (other tests enumerate every
  design)."""
  yield
  designs.REGISTRY.pop('gated', None)
  sys.modules.pop('tests.gated_design', None)


@pytest.mark.slow
def test_gated_design_trains_through_laurel_main_and_resumes_from_its_workdir(unregistered, tmp_path, capsys,
                                                                               monkeypatch):
  overrides = {**{k: v for k, v in TINY_LM.items() if not k.startswith('model.laurel')}, 'steps': 3,
               'checkpoint_every': 3, 'model.stream.design': DESIGN, 'model.gated.gate': 'scalar'}
  status, _, err = train_cli(capsys, 'configs/c4_ablation.py:baseline_24,preset=tiny', tmp_path, overrides)
  assert status == 0, err[-2000:]
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert saved['model']['stream'] == {'design': DESIGN} and saved['model']['gated'] == {'gate': 'scalar', 'init': 0.0}
  designs.REGISTRY.pop('gated')  # as a later command: the resume imports the design its config.json names
  sys.modules.pop('tests.gated_design')
  monkeypatch.chdir(tmp_path)
  status, out, err = call_main(main.main, f'--config={tmp_path}', f'--workdir={tmp_path}', '--config.steps=5')
  assert status == 0, err[-2000:]
  assert 'resumed from checkpoint 3' in out and sorted(losses(tmp_path)) == [1, 2, 3, 4, 5]
  assert math.isfinite(json.loads((tmp_path / 'final.json').read_text())['eval_loss'])
