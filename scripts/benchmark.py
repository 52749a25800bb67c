"""Step time, throughput, MFU and peak memory of every Table 5 row, measured in one process.

  python scripts/benchmark.py [--out=results/benchmark_cpu.json] [--rows=baseline_24,rw_lr] [--batch_size=N]
      [--seq_len=N] [--steps=N] [--steps_per_round=N] [--nofull_shape_memory] [--set=<field>=<value> ...]

Every row is compiled (laurel.train.compile_step) and initialised first; then the rows are timed in rounds, each
round running --steps_per_round steps of every row in turn, the order rotating from round to round, so that a
change in the machine's load hits every row alike. Each row first runs --warmup untimed steps; every timed step
ends in jax.block_until_ready. Baseline-24 is always measured, whatever --rows says. Per row, as ratios to it:
  step_time_ratio         median step time / Baseline-24's
  step_time_ratio_paired  median over rounds of the ratio within a round
  step_time_min_ratio     fastest step / Baseline-24's fastest: other processes can only add time, so on a
                          shared machine this is the steadiest of the three
  cpu_time_*              (CPU only) the same for the process's CPU seconds per step, which waiting for a
                          core does not inflate
Measured on the 2-core development machine while other jobs ran, single steps varied by 2x from round to round:
read the CPU ratios as rough, and quote accelerator runs.

Shape. Defaults depend on the platform. On CPU: the true Table 5 model (24 layers, D=768, F=2048, 12 heads,
vocabulary 32,768: the paper preset of configs/c4_ablation.py) at batch 1 x 512 tokens, float32, the preset's remat:
a small batch rather than a shrunken model, whose r/D and vocabulary share would distort the ratios
(/work/shared/NOTES.md). On GPU/TPU: 32 sequences x 1024 tokens per device (Table 5's 512 x 1024 on 16 chips),
with the preset's bfloat16 and remat. Each flag below overrides its default; --set overrides any config field.

MFU = FLOPs per step / step time / (peak FLOP/s per device x devices), peak from laurel.train.PEAK_FLOPS (null
where unknown, e.g. CPU). XLA's cost analysis counts a scanned layer stack's body once, so the FLOPs are those
of the same train step lowered (not compiled) with the layers unrolled; `xla_flops_compiled` is the raw figure
of the scanned step, for reference. With remat the FLOPs include the recomputation (hardware FLOPs).

Full-shape memory (--full_shape_memory, on by default): each row's step compiled, not run, at Table 5's
per-device shape (32 x 1024 tokens per device, the preset's bfloat16 and remat), with XLA's peak memory for it.
On CPU this is the CPU compiler's buffer assignment: compare the ratios with Table 5's, not the bytes.

Multi-host (TPU pods): run on every host with --distributed; process 0 writes --out.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

import common  # puts the repo root on sys.path
from absl import app, flags, logging

C4_ABLATION = 'configs/c4_ablation.py'
ROWS = ('baseline_24', 'baseline_28', 'rw', 'lr', 'pa', 'rw_lr', 'rw_lr_pa')
BASELINE = 'baseline_24'
# Table 5 (TPU v6e 4x4): step-time ratio, peak-memory ratio, peak memory (GB).
PAPER = {'baseline_24': (1.000, 1.000, 11.65), 'baseline_28': (1.105, 1.136, 13.23), 'rw': (1.000, 1.024, 11.93),
         'lr': (1.032, 1.055, 12.29), 'pa': (1.053, 1.077, 12.55), 'rw_lr': (1.042, 1.079, 12.57),
         'rw_lr_pa': (1.095, 1.107, 12.90)}

_OUT = flags.DEFINE_string('out', '', 'Write the results as JSON here (besides the table on stdout).')
_ROWS = flags.DEFINE_list('rows', list(ROWS), 'Table 5 rows to measure; baseline_24 is always added.')
_PRESET = flags.DEFINE_enum('preset', 'paper', ['paper', 'tiny'], 'Preset of configs/c4_ablation.py.')
_BATCH = flags.DEFINE_integer('batch_size', None, 'Global batch (sequences). Default: 1 on CPU, else 32/device.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', None, 'Tokens per sequence. Default: 512 on CPU, else 1024.')
_DTYPE = flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'],
                           "Compute dtype. Default: float32 on CPU, else the preset's.")
_REMAT = flags.DEFINE_enum('remat', None, ['none', 'full', 'dots', 'dots_no_batch'],
                           "Remat policy. Default: none on CPU, else the preset's.")
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps per row before the first round.')
_STEPS = flags.DEFINE_integer('steps', None, 'Timed steps per row. Default: 3 on CPU, else 30.')
_STEPS_PER_ROUND = flags.DEFINE_integer('steps_per_round', None,
                                        'Steps of a row per round. Default: 1 on CPU, else 5.')
_FULL = flags.DEFINE_bool('full_shape_memory', True, "Also compile each row at Table 5's per-device shape.")
_FULL_BATCH = flags.DEFINE_integer('full_shape_batch_per_device', 32, 'Full-shape sequences per device.')
_FULL_SEQ_LEN = flags.DEFINE_integer('full_shape_seq_len', 1024, 'Full-shape tokens per sequence.')
_SET = flags.DEFINE_multi_string('set', [], '<field>=<value> config override for every row, e.g. '
                                 'model.laurel.rank=16 (applied last, to both shapes).')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() first (TPU pods).')


def row_config(row, *, batch_size, seq_len, dtype=None, remat=None):
  """The row's config at the benchmark's shape; synthetic data, so nothing is read or downloaded."""
  c = common.load_config(C4_ABLATION, f'{row},preset={_PRESET.value}')
  c.batch_size = batch_size
  c.data.seq_len = seq_len
  c.data.name = 'synthetic'
  c.data.vocab_path = ''
  c.tensorboard = False
  if dtype:
    c.model.dtype = dtype
  if remat:
    c.model.remat = remat
  for assignment in _SET.value:
    common.set_field(c, *common.parse_assignment(assignment))
  return c


def shape_of(configs: dict) -> dict:
  c = configs[BASELINE]
  m = c.model
  return {'num_layers': {row: configs[row].model.num_layers for row in configs}, 'd_model': m.d_model,
          'd_ff': m.d_ff, 'num_heads': m.num_heads, 'vocab_size': m.vocab_size, 'mlp': m.mlp,
          'laurel_rank': m.laurel.rank, 'laurel_k': m.laurel.k, 'batch_size': c.batch_size,
          'seq_len': c.data.seq_len, 'tokens_per_step': c.batch_size * c.data.seq_len, 'dtype': m.dtype,
          'param_dtype': m.param_dtype, 'remat': m.remat, 'scan_layers': m.scan_layers, 'preset': c.preset,
          'mesh': {k: c.mesh[k] for k in ('data', 'fsdp', 'tensor')}, 'set': list(_SET.value)}


def compile_row(config, mesh):
  import flax.linen as nn
  import jax
  from laurel import train
  task = train.validate_config(config)
  start = time.perf_counter()
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    compiled, init_state, abstract, _ = train.compile_step(task, config, mesh)
  return task, compiled, init_state, abstract, time.perf_counter() - start


def synthetic_batch(task, config, mesh):
  """One fixed batch of random tokens, one document per row, placed like the train loop places its batches."""
  import jax
  import numpy as np
  from laurel import sharding
  local = config.batch_size // jax.process_count()
  rng = np.random.default_rng(jax.process_index())
  batch = task.example_batch(local)
  batch['tokens'] = rng.integers(1, config.model.vocab_size, batch['tokens'].shape, dtype=np.int32)
  batch['positions'] = np.broadcast_to(np.arange(config.data.seq_len, dtype=np.int32), batch['tokens'].shape).copy()
  return sharding.global_batch(batch, mesh)


def memory_breakdown(compiled) -> dict:
  """The step's peak (laurel.train.peak_memory_bytes, as the train loop logs it), its arguments and temporaries,
  and XLA's own `peak_memory_in_bytes`, which on CPU leaves the temporaries out."""
  from laurel import train
  m = compiled.memory_analysis()
  return {'peak_memory_bytes': train.peak_memory_bytes(compiled), 'argument_bytes': int(m.argument_size_in_bytes),
          'temp_bytes': int(m.temp_size_in_bytes),
          'xla_peak_memory_bytes': int(getattr(m, 'peak_memory_in_bytes', 0) or 0)}


def time_rows(rows: dict, batch, warmup: int, steps: int, steps_per_round: int) -> tuple[dict, dict]:
  """Interleaved timing: wall and process CPU seconds, each {row: [[steps of round 0], [round 1], ...]}.
  On CPU the process time (all of XLA's threads) is less sensitive than the wall time to other processes."""
  import jax

  def run(r, n):
    wall, cpu = [], []
    for _ in range(n):
      start, start_cpu = time.perf_counter(), time.process_time()
      r['state'], r['metrics'] = r['compiled'](r['state'], batch)
      jax.block_until_ready((r['state'], r['metrics']))
      wall.append(time.perf_counter() - start)
      cpu.append(time.process_time() - start_cpu)
    return wall, cpu

  names = list(rows)
  for name in names:
    run(rows[name], warmup)
  rounds = math.ceil(steps / steps_per_round)
  wall, cpu = {name: [] for name in names}, {name: [] for name in names}
  for i in range(rounds):
    n = min(steps_per_round, steps - i * steps_per_round)
    order = names[i % len(names):] + names[:i % len(names)]
    for name in order:
      w, c = run(rows[name], n)
      wall[name].append(w)
      cpu[name].append(c)
    print(f'round {i + 1}/{rounds}: ' + ', '.join(f'{name} {statistics.median(wall[name][-1]):.3f}s'
                                                  for name in names), flush=True)
  return wall, cpu


def summarize(prefix: str, rounds, base_rounds) -> dict:
  """The median over all steps and its ratio to the baseline's; the median over rounds of the ratio within a
  round (paired); and the ratio of the fastest steps (min: other processes can only add time)."""
  steps, base = [t for rnd in rounds for t in rnd], [t for rnd in base_rounds for t in rnd]
  paired = statistics.median(statistics.fmean(a) / statistics.fmean(b) for a, b in zip(rounds, base_rounds))
  return {f'{prefix}_s': statistics.median(steps),
          f'{prefix}_ratio': ratio(statistics.median(steps), statistics.median(base)),
          f'{prefix}_ratio_paired': round(paired, 4), f'{prefix}_min_s': min(steps),
          f'{prefix}_min_ratio': ratio(min(steps), min(base)), f'{prefix}_max_s': max(steps)}


def device_info() -> dict:
  import jax
  from laurel import train
  kind = jax.devices()[0].device_kind
  return {'platform': jax.default_backend(), 'device_kind': kind, 'device_count': jax.device_count(),
          'process_count': jax.process_count(), 'peak_flops_per_device': train.PEAK_FLOPS.get(kind),
          'host_cpus': os.cpu_count(), 'hostname': platform.node(), 'jax_version': jax.__version__}


def ratio(value, base):
  return round(value / base, 4) if value is not None and base else None


def print_table(result):
  full = {r['name']: r for r in result.get('full_shape_memory', [])}
  s, d = result['shape'], result['device']
  print(f"\n{d['device_kind']} x{d['device_count']} | batch {s['batch_size']} x {s['seq_len']} tokens | {s['dtype']} | "
        f"remat {s['remat']} | D={s['d_model']} F={s['d_ff']} V={s['vocab_size']} | ratios are to {BASELINE}")
  # (header, width, value of a row): ratios to the baseline beside Table 5's.
  columns = [('row', 12, lambda r, f: r['name']), ('params', 12, lambda r, f: f"{r['params']:,}"),
             ('step s', 9, lambda r, f: f"{r['step_time_s']:.3f}"),
             ('ratio', 7, lambda r, f: f"{r['step_time_ratio']:.3f}"),
             ('paired', 7, lambda r, f: f"{r['step_time_ratio_paired']:.3f}"),
             ('min', 7, lambda r, f: f"{r['step_time_min_ratio']:.3f}")]
  if 'cpu_time_s' in result['rows'][0]:
    columns += [('cpu s', 9, lambda r, f: f"{r['cpu_time_s']:.3f}"),
                ('ratio', 7, lambda r, f: f"{r['cpu_time_ratio']:.3f}"),
                ('min', 7, lambda r, f: f"{r['cpu_time_min_ratio']:.3f}")]
  columns += [('FLOPs', 7, lambda r, f: f"{r['flops_ratio']:.3f}" if r['flops_ratio'] else '-'),
              ('Table5', 7, lambda r, f: f"{r['paper_step_time_ratio']:.3f}"),
              ('tokens/s', 10, lambda r, f: f"{r['tokens_per_s']:,.0f}"),
              ('MFU', 7, lambda r, f: f"{100 * r['mfu']:.1f}%" if r['mfu'] is not None else '-'),
              ('mem MiB', 10, lambda r, f: f"{r['peak_memory_bytes'] / 2**20:,.1f}"),
              ('ratio', 7, lambda r, f: f"{r['peak_memory_ratio']:.3f}")]
  if full:
    columns += [('full GiB', 9, lambda r, f: f"{f['peak_memory_bytes'] / 2**30:.2f}"),
                ('ratio', 7, lambda r, f: f"{f['peak_memory_ratio']:.3f}")]
  columns += [('Table5', 7, lambda r, f: f"{r['paper_peak_memory_ratio']:.3f}")]
  print(''.join(f'{h:<{w}}' if i == 0 else f'{h:>{w}}' for i, (h, w, _) in enumerate(columns)))
  for r in result['rows']:
    f = full.get(r['name'])
    print(''.join(f'{v(r, f):<{w}}' if i == 0 else f'{v(r, f):>{w}}' for i, (_, w, v) in enumerate(columns)))


def benchmark() -> dict:
  import jax
  from laurel import sharding, train
  cpu = jax.default_backend() == 'cpu'
  n = jax.device_count()
  batch_size = _BATCH.value or (1 if cpu else 32 * n)
  seq_len = _SEQ_LEN.value or (512 if cpu else 1024)
  dtype = _DTYPE.value or ('float32' if cpu else None)
  remat = _REMAT.value  # default: the preset's own (dots_no_batch for the paper preset)
  steps = _STEPS.value or (3 if cpu else 30)
  steps_per_round = _STEPS_PER_ROUND.value or (1 if cpu else 5)
  names = [BASELINE] + [r for r in dict.fromkeys(_ROWS.value) if r != BASELINE]
  unknown = [r for r in names if r not in ROWS]
  if unknown:
    raise ValueError(f'--rows: unknown row {unknown[0]!r} (known: {", ".join(ROWS)})')
  if steps < 1 or steps_per_round < 1 or _WARMUP.value < 0:
    raise ValueError('--steps and --steps_per_round must be >= 1, --warmup >= 0')

  configs = {r: row_config(r, batch_size=batch_size, seq_len=seq_len, dtype=dtype, remat=remat) for r in names}
  for c in configs.values():
    train.validate_config(c)
  mesh = sharding.make_mesh(configs[BASELINE].mesh)
  result = {'device': device_info(), 'shape': shape_of(configs)}
  print(f"{result['device']['device_kind']} x{n}: {len(names)} rows at batch {batch_size} x {seq_len}, "
        f"{configs[BASELINE].model.dtype}, remat {configs[BASELINE].model.remat}", flush=True)

  rows, batch = {}, None
  for name in names:
    task, compiled, init_state, abstract, compile_s = compile_row(configs[name], mesh)
    with jax.set_mesh(mesh):
      state = init_state(jax.random.key(configs[name].seed))
    batch = batch if batch is not None else synthetic_batch(task, configs[name], mesh)
    rows[name] = {'compiled': compiled, 'state': state, 'metrics': None, 'compile_s': compile_s,
                  'params': int(sum(x.size for x in jax.tree.leaves(abstract.params))),
                  'flops': train.step_flops(configs[name]),
                  'xla_flops_compiled': train.xla_flops(compiled) * n,
                  **memory_breakdown(compiled)}
    print(f"compiled {name}: {compile_s:.1f}s, {rows[name]['params']:,} params, peak memory "
          f"{rows[name]['peak_memory_bytes'] / 2**20:,.1f} MiB", flush=True)

  wall, cpu_times = time_rows(rows, batch, _WARMUP.value, steps, steps_per_round)
  peak_flops = result['device']['peak_flops_per_device']
  tokens = batch_size * seq_len
  base = rows[BASELINE]
  result['rows'] = []
  for name in names:
    r = rows[name]
    loss = float(jax.device_get(r['metrics']['loss']))
    timing = summarize('step_time', wall[name], wall[BASELINE])
    step_time = timing['step_time_s']
    row = {
        'name': name, 'params': r['params'], 'params_ratio': ratio(r['params'], base['params']), **timing,
        'step_times_s': wall[name], 'tokens_per_s': tokens / step_time,
        'mfu': r['flops'] / step_time / (peak_flops * n) if peak_flops and r['flops'] else None,
        'flops_per_step': r['flops'], 'flops_ratio': ratio(r['flops'], base['flops']),
        'xla_flops_compiled': r['xla_flops_compiled'],
        'peak_memory_bytes': r['peak_memory_bytes'],
        'peak_memory_ratio': ratio(r['peak_memory_bytes'], base['peak_memory_bytes']),
        'argument_bytes': r['argument_bytes'], 'temp_bytes': r['temp_bytes'], 'compile_s': r['compile_s'],
        'final_loss': loss, 'paper_step_time_ratio': PAPER[name][0], 'paper_peak_memory_ratio': PAPER[name][1]}
    if cpu:  # process CPU seconds per step: meaningful where the host does the work
      row.update(summarize('cpu_time', cpu_times[name], cpu_times[BASELINE]), cpu_times_s=cpu_times[name])
    result['rows'].append(row)
    if not math.isfinite(loss):
      raise RuntimeError(f'{name}: loss is {loss} after the timed steps')
  rows.clear()  # frees the train states before the full-shape compiles

  if _FULL.value:
    full = {r: row_config(r, batch_size=_FULL_BATCH.value * n, seq_len=_FULL_SEQ_LEN.value) for r in names}
    result['full_shape'] = {k: v for k, v in shape_of(full).items()}
    result['full_shape']['batch_per_device'] = _FULL_BATCH.value
    result['full_shape']['note'] = ('compiled, not run; XLA buffer assignment for ' + jax.default_backend()
                                    + ('; compare ratios with Table 5, not bytes' if cpu else ''))
    result['full_shape_memory'] = []
    for name in names:
      _, compiled, _, _, compile_s = compile_row(full[name], mesh)
      result['full_shape_memory'].append({'name': name, **memory_breakdown(compiled), 'compile_s': compile_s,
                                          'paper_peak_memory_gb': PAPER[name][2],
                                          'paper_peak_memory_ratio': PAPER[name][1]})
      print(f"full shape {name}: peak memory {result['full_shape_memory'][-1]['peak_memory_bytes'] / 2**30:.2f} "
            f"GiB ({compile_s:.1f}s to compile)", flush=True)
      del compiled
    base_bytes = result['full_shape_memory'][0]['peak_memory_bytes']
    for r in result['full_shape_memory']:
      r['peak_memory_ratio'] = ratio(r['peak_memory_bytes'], base_bytes)
  return result


def main(argv):
  if len(argv) > 1:
    common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  logging.set_verbosity(logging.WARNING)
  import jax
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  command = shlex.join(getattr(sys, 'orig_argv', [sys.executable, *sys.argv]))
  start = time.time()
  try:
    result = benchmark()
  except ValueError as e:
    common.fail(str(e))
  result['command'] = command
  result['wall_s'] = round(time.time() - start, 1)
  if jax.process_index() != 0:
    return
  print_table(result)
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, 'w') as f:
      f.write(json.dumps(result, indent=2) + '\n')
    print(f'wrote {_OUT.value} ({result["wall_s"]:.0f}s)')


if __name__ == '__main__':
  app.run(main)
