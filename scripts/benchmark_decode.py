"""Inference cost of every row of a table beside Baseline-24: prefill, per-token decode, KV cache.

  python scripts/benchmark_decode.py [--table=c4_ablation] [--preset=paper] [--rows=...] [--prompt_len=128]
      [--batch=8] [--new_tokens=16] [--rounds=3] [--out=results/decode_cpu.json]

Per row, with random weights at the row's true shape (float32 on CPU): the prefill of `batch` prompts of
`prompt_len` tokens, and the time per generated token at batch 1 and at `batch` (median over `rounds` rounds whose
row order rotates, so the machine's load hits every row alike); the KV-cache bytes; and the compiled decode step's
FLOPs and bytes accessed, as XLA counts them with the layers unrolled (figures noise cannot move). Each as a ratio
to Baseline-24. The paper reports LAuReL's prefill and generation latency within 1-2% at 4B.
"""

import statistics
import time

import cli  # puts the repo root on sys.path
import jax
import jax.numpy as jnp
from absl import app, flags

from laurel import command_line, lm, sharding
from laurel.serve import generate
from laurel.config_lib import InputError

BASELINE = 'baseline_24'
_TABLE = flags.DEFINE_enum('table', 'c4_ablation', cli.TABLES, 'configs/<table>.py: whose rows to measure.')
_PRESET = flags.DEFINE_enum('preset', 'paper', ['paper', 'tiny'], "Preset of the table's config.")
_ROWS = flags.DEFINE_list('rows', None, "Rows (default: all of the table's); baseline_24 is always added.")
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 128, 'Tokens per prompt.', lower_bound=1)
_BATCH = flags.DEFINE_integer('batch', 8, 'Prompts in the prefill and the larger decode batch.', lower_bound=1)
_NEW = flags.DEFINE_integer('new_tokens', 16, 'Decode steps timed per batch size and round.', lower_bound=1)
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Timing rounds.', lower_bound=1)
_OUT = flags.DEFINE_string('out', '', 'Write the results as JSON here.')


class Row:
  """One row's model with random weights, its jitted prefill/decode step and fresh caches."""

  def __init__(self, name: str):
    overrides = ['model.dtype=float32'] if jax.default_backend() == 'cpu' else []
    config = command_line.load(f'configs/{_TABLE.value}.py:{name},preset={_PRESET.value}', overrides)
    self.name, self.cfg = name, lm.LMConfig.from_config(config.model)
    self.total = _PROMPT_LEN.value + _NEW.value + 1
    model = lm.LM(self.cfg, decode=True)
    tokens = jnp.ones((1, 4), jnp.int32)
    self.params = jax.jit(lambda: jax.tree.map(lambda p: p.unbox() if hasattr(p, 'unbox') else p,
                                               lm.LM(self.cfg).init(jax.random.key(0), tokens)['params']))()
    self.step = jax.jit(lambda p, c, t, pos: model.apply({'params': p, 'cache': c}, t, pos, mutable=['cache']))
    self.cache_shapes = {b: jax.eval_shape(lambda b=b: model.init(jax.random.key(0), jnp.zeros(
        (b, self.total), jnp.int32)))['cache'] for b in (1, _BATCH.value)}

  def cache(self, batch: int):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.cache_shapes[batch])

  def facts(self) -> dict:
    """Parameters, KV-cache bytes, and XLA's FLOPs and bytes of one decode step at batch 1 and `batch`, compiled
    with the layers unrolled (XLA counts a scanned body once)."""
    out = {'params': sharding.num_params(self.params)}
    for b in (1, _BATCH.value):
      out[f'kv_cache_bytes_b{b}'] = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.cache_shapes[b])))
      out[f'decode_flops_b{b}'], out[f'decode_bytes_accessed_b{b}'] = generate.decode_step_costs(self.cfg, b,
                                                                                                 self.total)
    return out

  def time_prefill(self) -> float:
    tokens = jnp.ones((_BATCH.value, _PROMPT_LEN.value), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(_PROMPT_LEN.value), tokens.shape)
    cache = self.cache(_BATCH.value)
    start = time.perf_counter()
    jax.block_until_ready(self.step(self.params, cache, tokens, positions))
    return time.perf_counter() - start

  def time_decode(self, batch: int) -> float:
    """Seconds per generated token, the cache filled past the prompt."""
    cache, token = self.cache(batch), jnp.ones((batch, 1), jnp.int32)
    start = None
    for t in range(_NEW.value + 1):  # step 0 warms the loop up
      logits, cache = self.step(self.params, cache, token, jnp.full((batch, 1), _PROMPT_LEN.value + t))
      token = jnp.argmax(logits, -1).astype(jnp.int32)
      if t == 0:
        jax.block_until_ready(token)
        start = time.perf_counter()
    jax.block_until_ready(token)
    return (time.perf_counter() - start) / _NEW.value


def main():
  known = command_line.table_rows(_TABLE.value)
  names = [BASELINE] + [r for r in dict.fromkeys(_ROWS.value or known) if r != BASELINE]
  if unknown := [r for r in names if r not in known]:
    raise InputError(f'--rows: unknown row {unknown[0]!r} (known: {", ".join(known)})')
  rows = {n: Row(n) for n in names}
  facts = {n: r.facts() for n, r in rows.items()}
  keys = ('prefill_s', 'decode_b1_s', f'decode_b{_BATCH.value}_s')
  times = {n: {k: [] for k in keys} for n in names}
  for i in range(_ROUNDS.value + 1):  # round 0 compiles and warms up, untimed
    for n in names[i % len(names):] + names[:i % len(names)]:
      measured = (rows[n].time_prefill(), rows[n].time_decode(1), rows[n].time_decode(_BATCH.value))
      if i:
        for k, v in zip(keys, measured):
          times[n][k].append(v)
    print(f'round {i}/{_ROUNDS.value} done', flush=True)
  out = []
  for n in names:
    row = {'name': n, **facts[n], **{k: statistics.median(v) for k, v in times[n].items()}}
    out.append(row)
  base = out[0]
  for row in out:
    for k in [k for k in row if k != 'name']:
      row[f'{k}_ratio'] = round(row[k] / base[k], 4) if base[k] else None
  result = {'command': cli.command(), 'device': jax.devices()[0].device_kind, 'table': _TABLE.value,
            'preset': _PRESET.value, 'prompt_len': _PROMPT_LEN.value, 'batch': _BATCH.value,
            'new_tokens': _NEW.value, 'rounds': _ROUNDS.value, 'rows': out}
  cols = ('params', 'prefill_s', 'decode_b1_s', f'decode_b{_BATCH.value}_s', 'kv_cache_bytes_b1',
          'decode_flops_b1', 'decode_bytes_accessed_b1')
  print('row'.ljust(30) + ''.join(f'{c} ×'.rjust(26) for c in cols))
  for row in out:
    print(row['name'].ljust(30) + ''.join(f"{row[c]:.4g} ({row[f'{c}_ratio']:.4f})".rjust(26) for c in cols))
  if _OUT.value:
    cli.write_json(_OUT.value, result)
    print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  app.run(cli.main(main))
