"""Sampling from a trained LM, with a KV cache (docs/evaluation.md).

  python -m laurel.serve.generate --workdir=DIR --prompt=TEXT [--prompt=TEXT ...] [--max_new_tokens=N]
      [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S] [--nocache] [--trust_design_file]
"""

import dataclasses
import functools
import sys
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from laurel import data, lm
from laurel.cli import console
from laurel.config_lib import InputError
from laurel.plan import hardware
from laurel.serve import evaluate, loader


def sample(logits_BxV, rng, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """Next tokens: argmax at temperature 0, else drawn from softmax(logits / T) within the top k and top p."""
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature
  if top_k:
    kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  if top_p < 1.0:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    before_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1) - jax.nn.softmax(sorted_BxV, axis=-1)
    cutoff_Bx1 = jnp.min(jnp.where(before_BxV < top_p, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
  return jax.random.categorical(rng, logits_BxV).astype(jnp.int32)


def decode_step_costs(model_cfg: lm.LMConfig, batch: int, length: int) -> tuple[float, float]:
  """XLA's (FLOPs, bytes accessed) of one decode step against a cache of `length`; layers unrolled, as XLA counts a
  scanned body once."""
  step, variable_shapes = _decoder(dataclasses.replace(model_cfg, scan_layers=False))
  variables, token = variable_shapes(batch, length), jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  return hardware.xla_costs(step.lower(variables['params'], variables['cache'], token, token).compile())


@functools.lru_cache(maxsize=4)
def _decoder(model_cfg: lm.LMConfig):
  """(jitted apply with the cache, variable_shapes(batch, length)), cached so that a seen shape is not recompiled."""
  model = lm.LM(model_cfg, decode=True)

  @jax.jit  # params are arguments: closed over, they would be constants of the compiled program
  def step(params, cache, tokens_BxL, positions_BxL):
    logits, updated = model.apply({'params': params, 'cache': cache}, tokens_BxL, positions_BxL, mutable=['cache'])
    return logits, updated['cache']

  @functools.lru_cache(maxsize=16)
  def variable_shapes(batch: int, length: int):
    return jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((batch, length), jnp.int32))))

  return step, variable_shapes


def generate(model_cfg: lm.LMConfig, params, prompts: list[list[int]], max_new_tokens: int, *, temperature=0.0,
             top_k=0, top_p=1.0, seed=0, use_cache=True, pad_id=0, prefill_len=0) -> tuple[np.ndarray, np.ndarray]:
  """(new tokens (B, N), the logits that chose them (B, N, V)); prompts are right-padded, each row decoding at its
  own position. `prefill_len` (0: the longest prompt) fixes the prefill's shape, to compile once per bucket."""
  lengths_B = np.array([len(p) for p in prompts], np.int32)
  if lengths_B.min() < 1:
    raise InputError('prompt: empty after tokenisation')
  prompt_len = max(int(lengths_B.max()), prefill_len)
  total = prompt_len + max_new_tokens
  if model_cfg.positional == 'learned' and total > model_cfg.max_len:
    raise InputError(f'max_new_tokens={max_new_tokens}: prompt + new tokens ({total}) exceed model.max_len='
                     f'{model_cfg.max_len}')
  tokens_BxT = np.full((len(prompts), total), pad_id, np.int32)
  for b, p in enumerate(prompts):
    tokens_BxT[b, :len(p)] = p
  rows_B, rng, new, new_logits = jnp.arange(len(prompts)), jax.random.key(seed), [], []
  if use_cache:
    step, variable_shapes = _decoder(model_cfg)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variable_shapes(len(prompts), total)['cache'])
    # Prefill: every prompt at once, right-padded (padding is never attended; each row decodes from its length).
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (len(prompts), prompt_len))
    logits_BxLxV, cache = step(params, cache, jnp.asarray(tokens_BxT[:, :prompt_len]), positions)
    logits_BxV = logits_BxLxV[rows_B, lengths_B - 1]
  else:
    forward = jax.jit(lambda params, tokens: lm.LM(model_cfg).apply({'params': params}, tokens))
    tokens = jnp.asarray(tokens_BxT)
  for t in range(max_new_tokens):
    if not use_cache:
      logits_BxV = forward(params, tokens)[rows_B, lengths_B - 1 + t]  # causal: what lies beyond is never read
    rng, key = jax.random.split(rng)
    token_B = sample(logits_BxV, key, temperature, top_k, top_p)
    new.append(token_B)
    new_logits.append(logits_BxV)
    if not use_cache:
      tokens = tokens.at[rows_B, lengths_B + t].set(token_B)
    elif t + 1 < max_new_tokens:
      logits_Bx1xV, cache = step(params, cache, token_B[:, None], jnp.asarray(lengths_B + t)[:, None])
      logits_BxV = logits_Bx1xV[:, 0]
  return np.stack(new, axis=1), np.stack(new_logits, axis=1)


def until_eos(ids, eos_id: int) -> tuple[list[int], bool]:
  """(the tokens before the first end of document, whether there was one)."""
  ids = [int(i) for i in ids]
  return (ids[:ids.index(eos_id)], True) if eos_id in ids else (ids, False)


def _generate(fv: flags.FlagValues) -> None:
  for name, ok, why in (('max_new_tokens', fv.max_new_tokens >= 1, 'must be >= 1'),
                        ('temperature', fv.temperature >= 0, 'must be >= 0'),
                        ('top_k', fv.top_k >= 0, 'must be >= 0'),
                        ('top_p', 0 < fv.top_p <= 1, 'must be in (0, 1]')):
    if not ok:
      raise InputError(f'--{name}={fv[name].value!r}: {why}')
  with loader.lm_run_on_mesh(fv.workdir, fv.trust_design_file) as (task, params, step, _):
    tokenizer = data.make_tokenizer(task.config.data)
    longest = max(len(tokenizer.encode(p)) for p in fv.prompt) + fv.max_new_tokens
    if longest > task.config.data.seq_len:  # positions it never trained on: seconds a token, text of no use
      raise InputError(f'--max_new_tokens={fv.max_new_tokens}: the longest prompt and the new tokens make '
                       f'{longest}, past the context the model trained on (data.seq_len={task.config.data.seq_len})')
    new_BxN, _ = generate(task.model_cfg, params, [tokenizer.encode(p) for p in fv.prompt], fv.max_new_tokens,
                          temperature=fv.temperature, top_k=fv.top_k, top_p=fv.top_p, seed=fv.seed,
                          use_cache=fv.cache, pad_id=tokenizer.pad_id)
  print(f'checkpoint {step} of {fv.workdir}', file=sys.stderr)
  for i, (prompt, row) in enumerate(zip(fv.prompt, new_BxN)):
    ids, ended = until_eos(row, tokenizer.eos_id)
    # A header per sample, as its text may span several lines
    print(f'=== {i + 1}/{len(fv.prompt)} | prompt {prompt!r} | {len(ids)} new tokens'
          + (' (then the end of the document)' if ended else ''))
    print(prompt + tokenizer.decode(ids))


def define_flags() -> flags.FlagValues:
  """laurel-generate's flags, afresh for one command line."""
  fv = evaluate.serving_flags('The LM run to sample from.')
  define = lambda kind, name, default, text: getattr(flags, f'DEFINE_{kind}')(name, default, text, flag_values=fv)
  define('multi_string', 'prompt', [], 'A prompt (repeat for a batch).')
  define('integer', 'max_new_tokens', 64, 'Tokens to generate per prompt.')
  define('float', 'temperature', 0.0, 'Softmax temperature; 0 = greedy.')
  define('integer', 'top_k', 0, 'Sample from the k most likely tokens; 0 = all.')
  define('float', 'top_p', 1.0, 'Sample from the smallest set of tokens with this much probability.')
  define('integer', 'seed', 0, 'Sampling seed.')
  define('bool', 'cache', True, 'Decode with a KV cache (--nocache recomputes every step).')
  return fv


def main(argv: Sequence[str]) -> int:
  """laurel-generate's command line `argv` (the program first) in this process: its exit status."""
  return evaluate.command_main(define_flags(), argv, _generate, ['workdir', 'prompt'], __doc__)


def run():  # laurel-generate, python -m laurel.serve.generate
  console.run_command(main, 'interrupted')


if __name__ == '__main__':
  run()
