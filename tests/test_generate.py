"""laurel.serve.generate: KV-cache decoding equals recomputing the whole forward pass, for every residual design."""

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import call_main
from laurel import designs, lm
from laurel.serve import generate
from laurel.designs import StreamSpec
from laurel.designs.laurel import LaurelSpec

BASE = lm.LMConfig(vocab_size=32, d_model=16, num_heads=2, d_ff=32, num_layers=4, max_len=32)
DESIGNS = {
    'baseline': BASE,
    'rw_lr_pa_block_post_norm': dataclasses.replace(
        BASE, norm_position='post', stream=LaurelSpec(variant='rw+lr+pa', rank=4, k=3)),
    'rw_lr_pa_sublayer_learned': dataclasses.replace(
        BASE, positional='learned', stream=LaurelSpec(variant='rw+lr+pa', rank=4, k=3, site='sublayer')),
    'rw_per_dim_pa_low_rank_h': dataclasses.replace(
        BASE, stream=LaurelSpec(variant='rw+pa', rank=4, k=3, pa_h='low_rank', rw_per_dim=True)),
    'rw_per_dim_lr_pa': dataclasses.replace(
        BASE, stream=LaurelSpec(variant='rw+lr+pa', rank=4, k=2, rw_per_dim=True)),
    'gemma3n_attention': dataclasses.replace(
        BASE, stream=LaurelSpec(variant='rw+lr', rank=4, form='gemma3n', site='attention')),
    'value_residual': dataclasses.replace(BASE, value_residual=True, scan_layers=False),
    'residual_transformer': dataclasses.replace(BASE, share=lm.ShareSpec(group_size=2, rank=3)),
    # mHC at 4 Sinkhorn iterations, not 20: the same unrolled loop, a fifth of its compile time
    **{d: dataclasses.replace(BASE, stream=StreamSpec(d, **{'hc': {'hc_dynamic': True}, 'frac': {'hc_dynamic': True},
                                                           'mhc': {'sinkhorn_iters': 4}}.get(d, {})))
       for d in ('rezero', 'layerscale', 'hc', 'mhc', 'mhc_lite', 'frac', 'denseformer', 'attnres')},
    'mhc_v4_readout': dataclasses.replace(BASE, stream=StreamSpec(design='mhc', mhc_readout='v4', sinkhorn_iters=4)),
    'frac_m4_static': dataclasses.replace(BASE, stream=StreamSpec(design='frac', fractions=4)),
    'attnres_block': dataclasses.replace(BASE, stream=StreamSpec(design='attnres_block', attnres_block=4)),
    'attnres_block_heads_delta': dataclasses.replace(BASE, stream=StreamSpec(
        design='attnres_block', attnres_block=4, attnres_heads=2, attnres_delta=True)),
    'mudd': dataclasses.replace(BASE, stream=StreamSpec(design='mudd')),
    'mudd_r_value_residual': dataclasses.replace(BASE, value_residual=True, stream=StreamSpec(
        design='mudd', mudd_streams='r')),
    'dca_value_residual': dataclasses.replace(BASE, value_residual=True, stream=StreamSpec(design='dca')),
    'dca_k': dataclasses.replace(BASE, stream=StreamSpec(design='dca_k', dca_k=1)),
}
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13]]
NEW_TOKENS = 5


@functools.lru_cache(maxsize=None)
def _params(name, seed=1):
  """Random values around the init, so no design sits at its (often plain-residual) initial point. The init is one
  compiled program and the noise NumPy's: run op by op, they cost a compile per operation and shape."""
  cfg = DESIGNS[name]
  init = jax.jit(lambda: nn.unbox(lm.LM(cfg).init(jax.random.key(seed), jnp.ones((1, 4), jnp.int32))['params']))
  rng = np.random.default_rng(seed + 1)
  return jax.tree.map(lambda p: np.asarray(p) + 0.3 * rng.standard_normal(p.shape).astype(p.dtype), init())


@functools.lru_cache(maxsize=None)
def _decoded(name):
  """(tokens, logits) of PROMPTS decoded with the cache: what each test below compares another way of decoding with,
  computed once per design."""
  return generate.generate(DESIGNS[name], _params(name), PROMPTS, NEW_TOKENS)


def test_every_registered_design_is_decoded_with_the_cache():
  covered = {cfg.stream.design for cfg in DESIGNS.values()}
  assert set(designs.REGISTRY) <= covered, f'add a case to DESIGNS for {sorted(set(designs.REGISTRY) - covered)}'


@pytest.mark.parametrize('name', list(DESIGNS))
@pytest.mark.slow
def test_cache_and_recompute_give_the_same_tokens_and_logits(name):
  cached, cached_logits = _decoded(name)
  recomputed, recomputed_logits = generate.generate(DESIGNS[name], _params(name), PROMPTS, NEW_TOKENS,
                                                    use_cache=False)
  np.testing.assert_array_equal(cached, recomputed)
  np.testing.assert_allclose(cached_logits, recomputed_logits, rtol=1e-4, atol=1e-4)
  assert cached.shape == (len(PROMPTS), NEW_TOKENS) and np.std(cached_logits) > 0.1


@pytest.mark.slow
def test_batched_prompts_of_different_lengths_decode_as_alone():
  name = 'rw_lr_pa_sublayer_learned'
  batch, batch_logits = _decoded(name)
  longest = max(map(len, PROMPTS))
  for b, prompt in enumerate(PROMPTS):
    # Each alone, right-padded to the batch's prefill as in it (one compile for the three): no row changes another.
    # That padding changes no row: test_a_longer_prefill_and_padding_rows_change_no_row_and_reuse_the_compiled_step.
    alone, alone_logits = generate.generate(DESIGNS[name], _params(name), [prompt], NEW_TOKENS, prefill_len=longest)
    np.testing.assert_array_equal(alone[0], batch[b])
    np.testing.assert_allclose(alone_logits[0], batch_logits[b], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('name', ['baseline', 'rw_lr_pa_sublayer_learned', 'hc', 'denseformer',
                                  'attnres_block_heads_delta', 'mudd', 'dca_value_residual'])
@pytest.mark.slow
def test_a_longer_prefill_and_padding_rows_change_no_row_and_reuse_the_compiled_step(name):
  """What laurel.serve.harness does to keep one compile per shape: prompts padded to a bucket (prefill_len), the batch
  padded with one-token rows."""
  cfg, params = DESIGNS[name], _params(name)
  plain, plain_logits = _decoded(name)
  padded, padded_logits = generate.generate(cfg, params, PROMPTS + [[1]], NEW_TOKENS, prefill_len=12)
  np.testing.assert_array_equal(padded[:len(PROMPTS)], plain)
  np.testing.assert_allclose(padded_logits[:len(PROMPTS)], plain_logits, rtol=1e-4, atol=1e-4)
  step, _ = generate._decoder(cfg)  # pylint: disable=protected-access
  compiled = step._cache_size()  # pylint: disable=protected-access
  generate.generate(cfg, params, [[2, 3]] * 4, NEW_TOKENS, prefill_len=12)  # other prompts, the same shapes
  assert step._cache_size() == compiled  # pylint: disable=protected-access


def test_sampling_options():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
  greedy = np.asarray(jnp.argmax(logits, -1))
  key = jax.random.key(3)
  np.testing.assert_array_equal(generate.sample(logits, key, 0.0), greedy)
  np.testing.assert_array_equal(generate.sample(logits, key, 1.0, top_k=1), greedy)
  np.testing.assert_array_equal(generate.sample(logits, key, 1.0, top_p=1e-6), greedy)
  draws = np.stack([generate.sample(logits, jax.random.key(s), 1.0, top_k=3) for s in range(200)])
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  assert all(set(draws[:, b]) <= set(top3[b]) and len(set(draws[:, b])) > 1 for b in range(4))
  np.testing.assert_array_equal(generate.sample(logits, key, 0.7), generate.sample(logits, key, 0.7))


@pytest.mark.slow
def test_generate_cli_samples_a_trained_run(trained_run, tmp_path):
  workdir = trained_run  # conftest's: generating reads it only
  command = [f'--workdir={workdir}', '--prompt=def ', '--prompt=import', '--max_new_tokens=6']
  outs = [call_main(generate.main, *command, *extra) for extra in ([], ['--nocache'])]
  for status, out, err in outs:
    assert status == 0, err[-2000:]
    # Each sample below a line naming its prompt: continuations may span lines (and print blank ones).
    samples = re.split(r'^(=== \d/2 \| prompt .* \| \d new tokens.*)$', out, flags=re.M)
    assert samples[0] == '' and len(samples) == 5, out
    assert samples[1].startswith("=== 1/2 | prompt 'def ' | ") and samples[3].startswith("=== 2/2 | prompt 'import' | ")
    assert samples[2].startswith('\ndef ') and samples[4].startswith('\nimport')
  assert outs[0][1] == outs[1][1]  # greedy: the cache changes nothing
  status, _, err = call_main(generate.main, *command[:1], '--prompt=x', '--top_p=0')
  assert status == 2 and err.strip() == 'error: --top_p=0.0: must be in (0, 1]'
  status, _, err = call_main(generate.main, f'--workdir={tmp_path}', '--prompt=x')
  assert status == 2 and 'no config.json' in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize('design', [dict(stream=LaurelSpec(variant='rw')),
                                    dict(stream=StreamSpec(design='layerscale'))])
def test_decode_scales_outputs_not_kernels(design):
  """RW's α (LayerScale's λ) folded into a kernel costs a multiply per kernel entry, half the matmul's FLOPs for
  one token: the decode step scales the token's outputs instead, costing the baseline's FLOPs (XLA's count)."""
  decode_flops = lambda cfg: generate.decode_step_costs(cfg, 1, 8)[0]
  base = dataclasses.replace(BASE, d_model=64, num_heads=4, d_ff=256)
  assert 1.0 < decode_flops(dataclasses.replace(base, **design)) / decode_flops(base) < 1.01
