"""The widened-stream designs' layer backward (laurel/designs/recompute.py): it keeps each layer's sites' records
instead of its n-stream carry, and gives the gradients of the scan's own backward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laurel import lm
from laurel.designs import StreamSpec, recompute

VOCAB, D, HEADS, FF, LEN, BATCH = 32, 16, 2, 32, 8, 2
PLAIN_SCAN = lambda stack, block, cfg, replay, policy, *args: stack(*args)[0]  # the scan's own backward


def _cfg(**model):
  fields = dict(vocab_size=VOCAB, d_model=D, num_heads=HEADS, d_ff=FF, num_layers=4, max_len=16, scan_layers=True)
  cfg = lm.LMConfig(**{**fields, **model})
  cfg.check('model')
  return cfg


def _random_params(cfg, tokens, seed):
  rng = np.random.default_rng(seed)
  shapes = nn.unbox(jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), tokens))['params'])
  draw = lambda path, s: jnp.asarray(
      (1.0 if 'scale' in jax.tree_util.keystr(path) else 0.0) + 0.3 * rng.normal(size=s.shape), s.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.mark.parametrize('stream,model', [
    (StreamSpec(design='hc'), {'remat': 'save_qkv'}),
    (StreamSpec(design='hc', hc_dynamic=True), {'num_layers': 6}),
    (StreamSpec(design='mhc'), {'remat': 'full', 'value_residual': True}),
    (StreamSpec(design='mhc', mhc_readout='v4', expansion=3), {'remat': 'dots_no_batch'}),
    (StreamSpec(design='mhc_lite'), {'remat': 'save_qkv', 'num_layers': 8})],
    ids=['hc_save_qkv', 'hc_dynamic_6', 'mhc_full_value_residual', 'mhc_v4_dots', 'mhc_lite_8'])
@pytest.mark.slow
def test_replaying_backward_is_the_scans_own(stream, model, monkeypatch):
  # At random weights: the backward rebuilding each layer's streams from its segment's first against a scan's
  # autodiff, in float32.
  cfg = _cfg(stream=stream, **model)
  tokens = jnp.asarray(np.random.default_rng(18).integers(1, VOCAB, size=(BATCH, LEN)), jnp.int32)
  params = _random_params(cfg, tokens, 17)
  grad = lambda: jax.grad(lambda p: jnp.mean(lm.LM(cfg).apply({'params': p}, tokens) ** 2))(params)
  got = grad()
  monkeypatch.setattr(lm, 'stack_replaying_streams', PLAIN_SCAN)
  want = grad()
  close = lambda path, g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(),
                                                        err_msg=jax.tree_util.keystr(path))
  jax.tree_util.tree_map_with_path(close, got, want)  # the same tree, or it raises


@pytest.mark.parametrize('layers,segment', [(24, 12), (4, 2), (6, 3), (7, 1), (1, 1)])
def test_segment_length(layers, segment):
  assert recompute.segment_length(layers) == segment


@pytest.mark.slow
def test_replaying_backward_keeps_less_per_layer_than_the_scans_own():
  # A scan's own backward keeps the n = 4 streams a layer (3 D-wide more than the baseline's one); this one keeps
  # the two sites' f outputs and mixing weights (~1 more). Per layer from 4 to 8 layers (two segments at both, so
  # the kept streams cancel), on the CPU compiler, in bfloat16: baseline 8.0, the scan's 14.0, this 10.3 D-wide.
  def temp_bytes(layers, stream, plain=False):
    cfg = lm.LMConfig(vocab_size=64, d_model=256, num_heads=2, d_ff=512, num_layers=layers, scan_layers=True,
                      remat='save_qkv', dtype='bfloat16', stream=stream)
    params = jax.eval_shape(lambda: lm.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
    loss = lambda p, t: lm.LM(cfg).apply({'params': p}, t).mean()
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    with pytest.MonkeyPatch.context() as patch:
      if plain:
        patch.setattr(lm, 'stack_replaying_streams', PLAIN_SCAN)
      return jax.jit(jax.grad(loss)).lower(nn.unbox(params), tokens).compile().memory_analysis().temp_size_in_bytes
  per_layer = lambda *args: (temp_bytes(8, *args) - temp_bytes(4, *args)) / 4
  baseline, plain, replay = per_layer(StreamSpec()), per_layer(StreamSpec('hc'), True), per_layer(StreamSpec('hc'))
  assert replay - baseline < 0.5 * (plain - baseline), (baseline, plain, replay)
