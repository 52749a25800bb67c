"""Step time, throughput, MFU and peak memory of every row of a table, measured in one process.

  python scripts/benchmark.py [--out=results/benchmark_cpu.json] [--table=c4_ablation|residual_designs]
      [--rows=baseline_24,rw_lr] [--variants=model.loss_chunk=0,model.attention=xla] [--batch_size=N]
      [--seq_len=N] [--steps=N] [--steps_per_round=N] [--nofull_shape_memory] [--set=<field>=<value> ...]

The rows (Baseline-24 always) are compiled, warmed up and timed in rounds, the order rotating so that the machine's
load hits every row alike. Ratios to Baseline-24: of the median step, of the fastest (_min: the steadiest on a
shared machine), the median of in-round ratios (_paired) and, on CPU, of process CPU time (cpu_time_*). Default
shape on CPU: the paper preset's true model at 1 x 512 tokens, float32 (a shrunken model's r/D and vocabulary share
would distort the ratios: see the shape notes in the README); else 32 x 1024 tokens per device. mfu counts
the task's model_flops (6·N·tokens + attention), hfu XLA's FLOPs of the step (flops_per_step, remat included),
over the devices' peak (null where unknown). Full-shape memory: each row also compiled, not run, at Table 5's
32 x 1024 tokens per device (on CPU compare ratios, not bytes). Pods: run on every host with --distributed.
--variants adds Baseline-24 rows with one field changed, timed in the same rounds. --out may name the device:
results/benchmark_{device}.json. The JSON records jax's, CUDA's and cuDNN's versions where they apply.
"""

import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import time

import cli  # puts the repo root on sys.path
from laurel.cli import gpu_workarounds  # pylint: disable=g-bad-import-order

if __name__ == '__main__':  # before JAX starts a backend
  gpu_workarounds.apply()
import paper
import step_profile
import flax.linen as nn
import jax
from absl import app, flags
from etils import epath

from laurel import command_line, sharding, step, train_config
from laurel.cli import compile_cache
from laurel.plan import aot, cost, hardware
from laurel.config_lib import InputError

BASELINE = 'baseline_24'

_OUT = flags.DEFINE_string('out', '', 'Write the results as JSON here (besides the table on stdout).')
_TABLE = flags.DEFINE_enum('table', 'c4_ablation', cli.TABLES, 'configs/<table>.py: whose rows to measure.')
_ROWS = flags.DEFINE_list('rows', None, "Rows to measure (default: all of the table's); baseline_24 is always added.")
_PRESET = flags.DEFINE_enum('preset', 'paper', ['paper', 'tiny', 'gpu'], "Preset of the table's config.")
_BATCH = flags.DEFINE_integer('batch_size', None, 'Global batch (sequences). Default: 1 on CPU, else 32/device.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', None, 'Tokens per sequence. Default: 512 on CPU, else 1024.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps per row before the first round.', lower_bound=0)
_STEPS = flags.DEFINE_integer('steps', None, 'Timed steps per row. Default: 3 on CPU, else 30.', lower_bound=1)
_PER_ROUND = flags.DEFINE_integer('steps_per_round', None, 'Steps of a row per round. Default: 1 on CPU, else 5.',
                                  lower_bound=1)
_FULL = flags.DEFINE_bool('full_shape_memory', True, "Also compile each row at Table 5's per-device shape.")
_FULL_BATCH = flags.DEFINE_integer('full_shape_batch_per_device', 32, 'Full-shape sequences per device.')
_FULL_SEQ_LEN = flags.DEFINE_integer('full_shape_seq_len', 1024, 'Full-shape tokens per sequence.')
_VARIANTS = flags.DEFINE_list('variants', [], 'Baseline-24 once more per <field>=<value>, timed with the rows '
                               '(e.g. model.loss_chunk=0,model.attention=xla); named "baseline_24 <field>=<value>".')
_PEAK = flags.DEFINE_float('peak_flops', None, "Dense bf16 peak FLOP/s per device for MFU and HFU (default: "
                           "laurel.plan.hardware's figure for the device; none for CPUs).", lower_bound=1)
_PROFILE = flags.DEFINE_string('profile', '', 'Also trace a few steps of the --profile_rows into this folder and '
                               'print their ops by time, grouped: attention, loss, residual (LAuReL), optimizer (step_profile).')
_PROFILE_ROWS = flags.DEFINE_list('profile_rows', ['baseline_24', 'rw_lr'], 'The rows --profile traces.')
PROFILE_STEPS = 3
_SET = flags.DEFINE_multi_string('set', [], 'Config override <field>=<value> for all rows, e.g. model.remat=full.')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() first (TPU pods).')
_VARY = flags.DEFINE_string('vary', None, 'With --topology: <field>=<v1>,<v2>,...: compile Baseline-24 once per value '
                            '(e.g. model.remat=dots_no_batch,full) instead of the rows; ratios are to the first value.')
_COMPILER_FLOPS = flags.DEFINE_bool('compiler_flops', True, "With --topology: also the compiler's FLOPs and bytes "
                                    'per step (each row compiled again with two layers per loop iteration); '
                                    '--nocompiler_flops: peak memory and the estimated step only, one compile a row.')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'Compile every row for this TPU slice (v4, v5e, v5p, v6e; e.g. '
                                'v6e:4x4 or v6e-16) on this machine, run nothing: per-chip memory, the step time the '
                                "compiler's schedule estimates, its FLOPs and bytes, at the preset's batch and length. "
                                'Needs libtpu.')


def row_config(row, batch_size, seq_len, *extra, variant=()):
  """The row's config at the benchmark's shape (None: the preset's), on synthetic data (nothing is read); a
  variant's override comes after --set's."""
  shape = [f'{k}={v}' for k, v in (('batch_size', batch_size), ('data.seq_len', seq_len)) if v is not None]
  shape += ['data.name=synthetic', 'tensorboard=False']
  return command_line.load(f'configs/{_TABLE.value}.py:{row},preset={_PRESET.value}',
                         [*shape, *extra, *_SET.value, *variant])


def variant_rows(batch_size, seq_len, *extra) -> dict:
  """{'baseline_24 <field>=<value>': config} of each --variants override."""
  out = {}
  for override in _VARIANTS.value:
    field, sep, value = override.partition('=')
    if not sep or not field or not value:
      raise InputError(f'--variants: {override!r} is not <field>=<value>')
    out[f'{BASELINE} {field.removeprefix("model.")}={value}'] = row_config(BASELINE, batch_size, seq_len, *extra,
                                                                           variant=[override])
  return out


def shape_of(configs: dict) -> dict:
  c = next(iter(configs.values()))  # Baseline-24 comes first
  return {**{k: v for k, v in c.model.items() if not hasattr(v, 'to_dict')}, 'laurel': c.model.laurel.to_dict(),
          'num_layers': {row: configs[row].model.num_layers for row in configs}, 'batch_size': c.batch_size,
          'seq_len': c.data.seq_len, 'tokens_per_step': c.batch_size * c.data.seq_len, 'preset': c.preset,
          'mesh': c.mesh.to_dict(), 'set': list(_SET.value)}


def paper_figures(row: str, keys) -> dict:
  """Table 5's figures for a row of the c4_ablation table (the other tables have no published column)."""
  row = row.split()[0]  # 'baseline_24 remat=full' is Baseline-24
  return {f'paper_{k}': paper.TABLE5[row][k] for k in keys} if _TABLE.value == 'c4_ablation' else {}


def compile_row(config, mesh) -> tuple:
  """(compiled step, state initialiser, task, facts): parameters, compile time and memory, the peak as the train
  loop logs it beside XLA's own peak (which on CPU counts the arguments only)."""
  task, start = train_config.validate_config(config), time.perf_counter()
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    compiled, init_state, abstract, _ = step.compile_step(task, mesh)
  m = compiled.memory_analysis()
  return compiled, init_state, task, {
      'params': task.num_params(abstract.params), 'compile_s': time.perf_counter() - start,
      'peak_memory_bytes': hardware.peak_memory_bytes(compiled), 'argument_bytes': int(m.argument_size_in_bytes),
      'temp_bytes': int(m.temp_size_in_bytes), 'xla_peak_memory_bytes': int(m.peak_memory_in_bytes or 0)}


def time_rows(rows: dict, batch, steps: int, per_round: int):
  """Sets each row's 'wall' and 'cpu' (process) seconds per step: [[round 0's], [round 1's], ...]."""
  names, rounds = list(rows), math.ceil(steps / per_round)
  for i in range(-1, rounds):  # round -1: the warmup
    for name in names[i % len(names):] + names[:i % len(names)]:
      r, times = rows[name], []
      for _ in range(_WARMUP.value if i < 0 else min(per_round, steps - i * per_round)):
        start = time.perf_counter(), time.process_time()
        r['state'], r['metrics'] = jax.block_until_ready(r['step'](r['state'], batch))
        times.append((time.perf_counter() - start[0], time.process_time() - start[1]))
      if i >= 0:
        r.setdefault('wall', []).append([t[0] for t in times])
        r.setdefault('cpu', []).append([t[1] for t in times])
    if i >= 0:
      print(f'round {i + 1}/{rounds}: ' + ', '.join(f'{n} {statistics.median(rows[n]["wall"][-1]):.3f}s'
                                                    for n in names), flush=True)


def summarize(prefix: str, rounds, base_rounds) -> dict:
  """Median, fastest and slowest step; ratios to the baseline's, and the median over rounds of the in-round ratio."""
  steps, base = [t for rnd in rounds for t in rnd], [t for rnd in base_rounds for t in rnd]
  paired = statistics.median(statistics.fmean(a) / statistics.fmean(b) for a, b in zip(rounds, base_rounds))
  median = statistics.median(steps)
  return {f'{prefix}_s': median, f'{prefix}_ratio': ratio(median, statistics.median(base)),
          f'{prefix}_ratio_paired': round(paired, 4), f'{prefix}_min_s': min(steps),
          f'{prefix}_min_ratio': ratio(min(steps), min(base)), f'{prefix}_max_s': max(steps)}


def ratio(value, base):
  return round(value / base, 4) if value is not None and base else None


def measure(configs, mesh, cpu: bool, profiles: dict) -> list[dict]:
  """Compiles, initialises and times the rows: a result row each; with --profile, `profiles` gets the ops of the
  --profile_rows by time (step_profile)."""
  rows, batch, n = {}, None, jax.device_count()
  for name, c in configs.items():
    compiled, init_state, task, facts = compile_row(c, mesh)
    with jax.set_mesh(mesh):
      rows[name] = {'step': compiled, 'state': init_state(jax.random.key(c.seed)), **facts,
                    'flops_per_step': cost.step_flops(task), 'model_flops_per_step': task.model_flops(c.batch_size),
                    'xla_flops_compiled': hardware.xla_costs(compiled)[0] * n}
    batch = batch if batch is not None else step_profile.synthetic_batch(task, c, mesh)
    print(f"compiled {name}: {facts['compile_s']:.1f}s, {facts['params']:,} params, peak memory "
          f"{facts['peak_memory_bytes'] / 2**20:,.1f} MiB", flush=True)
  time_rows(rows, batch, _STEPS.value or (3 if cpu else 30), _PER_ROUND.value or (1 if cpu else 5))
  for name in [n for n in _PROFILE_ROWS.value if n in rows] if _PROFILE.value else []:
    r, logdir = rows[name], os.path.join(_PROFILE.value, name.replace(' ', '_').replace('=', '-'))
    r['state'], trace = step_profile.trace_steps(r['step'], r['state'], batch, logdir, PROFILE_STEPS)
    text = r['step'].as_text()
    profiles[name] = step_profile.op_times(trace, text, text.split()[1].rstrip(','), PROFILE_STEPS)
    step_profile.print_profile(name, profiles[name])
    profiles[name].update(trace=trace, ops=profiles[name]['ops'][:40])
  peak, base, c = (peak_flops_per_device() or 0) * n, rows[BASELINE], configs[BASELINE]
  out = []
  for name, r in rows.items():
    loss, timing = float(jax.device_get(r['metrics']['loss'])), summarize('step_time', r['wall'], base['wall'])
    if not math.isfinite(loss):
      raise RuntimeError(f'{name}: loss is {loss} after the timed steps')
    step_time = timing['step_time_s']
    out.append({'name': name, **{k: v for k, v in r.items() if k not in ('step', 'state', 'metrics', 'wall', 'cpu')},
                **timing, 'step_times_s': r['wall'], 'tokens_per_s': c.batch_size * c.data.seq_len / step_time,
                'mfu': hardware.utilisation(r['model_flops_per_step'], step_time, peak),
                'hfu': hardware.utilisation(r['flops_per_step'], step_time, peak),
                'final_loss': loss, **{f'{k}_ratio': ratio(r[key], base[key]) for k, key in (
                    ('params', 'params'), ('flops', 'flops_per_step'), ('peak_memory', 'peak_memory_bytes'))},
                **paper_figures(name, ('step_time_ratio', 'peak_memory_ratio')),
                **(dict(summarize('cpu_time', r['cpu'], base['cpu']), cpu_times_s=r['cpu']) if cpu else {})})
  return out  # cpu_time_*: process CPU seconds per step, meaningful where the host does the work


# The table on stdout, {key: header}, beside Table 5's ratios; full_*: the row's full-shape compile.
COLUMNS = {'name': 'row', 'params': 'params', 'step_time_s': 'step s', 'step_time_ratio': 'ratio',
           'step_time_ratio_paired': 'paired', 'step_time_min_ratio': 'min', 'cpu_time_s': 'cpu s',
           'cpu_time_ratio': 'ratio', 'cpu_time_min_ratio': 'min', 'flops_ratio': 'FLOPs',
           'paper_step_time_ratio': 'Table5', 'tokens_per_s': 'tokens/s', 'mfu': 'MFU', 'hfu': 'HFU',
           'mib': 'mem MiB', 'peak_memory_ratio': 'ratio', 'full_gib': 'full GiB', 'full_ratio': 'ratio',
           'paper_peak_memory_ratio': 'Table5'}


def print_table(result):
  full = {r['name']: {'full_gib': r['peak_memory_bytes'] / 2**30, 'full_ratio': r['peak_memory_ratio']}
          for r in result.get('full_shape_memory', [])}
  rows = [{**r, 'mib': r['peak_memory_bytes'] / 2**20, **full.get(r['name'], {})} for r in result['rows']]
  s, d = result['shape'], result['device']
  print(f"\n{d['device_kind']} x{d['device_count']} | batch {s['batch_size']} x {s['seq_len']} tokens | {s['dtype']} | "
        f"remat {s['remat']} | D={s['d_model']} F={s['d_ff']} V={s['vocab_size']} | ratios are to {BASELINE}")
  _print_columns(COLUMNS, rows)


# --topology's table: per-chip figures of the TPU compiler; ratios to baseline_24. The estimated step: the compiler's
# schedule (laurel.plan.schedule) at the chip's clock; `% rate`: model FLOPs per cycle over the compiler's own rate for a
# large matmul.
SLICE_COLUMNS = {'name': 'row', 'params': 'params', 'peak_gb': 'peak GB', 'peak_memory_ratio': 'ratio',
                 'paper_peak_memory_gb': 'Table5 GB', 'paper_peak_memory_ratio': 'ratio', 'cycles_m': 'Mcycles',
                 'est_ms': 'est. ms', 'estimated_step_ratio': 'ratio', 'paper_step_time_s': 'Table5 s',
                 'paper_step_time_ratio': 'ratio', 'rate_pct': '% rate', 'tflops': 'TFLOP', 'flops_ratio': 'ratio',
                 'bytes_gb': 'GB accessed', 'bytes_accessed_ratio': 'ratio'}


def measure_slice(names) -> dict:
  """Every row (or, with --vary, Baseline-24 at every value of one field) compiled by the TPU compiler for
  --topology on this machine (laurel.plan.aot); nothing runs."""
  accel = hardware.parse_accelerator(_TOPOLOGY.value, flag='--topology')
  topology = f'{accel["generation"]}:{accel["topology"]}'  # v6e-16 -> v6e:4x4
  if _VARY.value:
    field, _, values = _VARY.value.partition('=')
    if not values:
      raise InputError(f'--vary: {_VARY.value!r} is not <field>=<v1>,<v2>,...')
    configs = {f'{BASELINE} {field.removeprefix("model.")}={v}':
               row_config(BASELINE, _BATCH.value, _SEQ_LEN.value, f'{field}={v}') for v in values.split(',')}
  else:
    configs = {r: row_config(r, _BATCH.value, _SEQ_LEN.value) for r in names}
  for c in configs.values():  # every row is checked for the slice before anything compiles
    train_config.validate_config(c, accel['chips'], accel['hosts'])
  devices, chip = aot.slice_devices(topology), hardware.TPUS[accel['generation']]
  rows, kept = [], KeptRows(topology)
  for name, config in configs.items():
    start, row = time.perf_counter(), kept.get(name, config)
    note = ' (kept from an earlier run)' if row else ''
    if row is None:
      try:
        row = {'name': name, **aot.compile_for_slice(config, topology, costs=_COMPILER_FLOPS.value),
               'compile_s': time.perf_counter() - start}
      except aot.DoesNotFit as e:  # a row of the table, not the end of it: what it needs, where the compiler says
        row = {'name': name, 'fits': False, 'error': str(e), 'peak_memory_bytes': e.need_bytes,
               'compile_s': time.perf_counter() - start}
      kept.add(name, config, row)
    rows.append(row)
    peak = '?' if row['peak_memory_bytes'] is None else f"{row['peak_memory_bytes'] / 1e9:.2f} GB"
    print(f"compiled {name} for {topology}: {row['compile_s']:.0f}s, peak {peak} per chip{note}"
          + (' (does not fit)' if row.get('fits') is False else ''), flush=True)
  for r in rows:
    for key, value in (('peak_memory', 'peak_memory_bytes'), ('argument', 'argument_bytes'), ('temp', 'temp_bytes'),
                       ('flops', 'flops_per_step'), ('bytes_accessed', 'bytes_accessed_per_step'),
                       ('roofline', 'roofline_step_time_s'), ('estimated_step', 'estimated_step_s')):
      r[f'{key}_ratio'] = ratio(r.get(value), rows[0].get(value))
    r.update(paper_figures(r['name'], ('peak_memory_gb', 'peak_memory_ratio', 'step_time_s', 'step_time_ratio')))
  return {'device': {'topology': topology, 'device_kind': chip.device_kind, 'chips': len(devices),
                     'hosts': len({d.process_index for d in devices}), 'clock_hz': chip.clock_hz,
                     'peak_flops_per_chip': chip.peak_flops, 'hbm_bytes_per_chip': chip.hbm_bytes,
                     'hbm_bytes_per_s': chip.hbm_bytes_per_s, 'chip_figures': hardware.SOURCE,
                     'libtpu_version': importlib.metadata.version('libtpu'), 'jax_version': jax.__version__,
                     'note': 'compiled for the slice on a machine without one, not run; figures are per chip'},
          'shape': shape_of(configs), 'rows': rows}


def code_trees(root=cli.ROOT) -> str | None:
  """The committed git trees of laurel/ and configs/, what a compiled step depends on; None without git or while
  either has uncommitted changes. Commits elsewhere (results, scripts, docs) leave it as it is."""
  git = lambda *args: subprocess.run(['git', '-C', str(root), *args], capture_output=True, text=True, check=False)
  trees = git('rev-parse', 'HEAD:laurel', 'HEAD:configs')
  dirty = git('status', '--porcelain', '--untracked-files=no', '--', 'laurel', 'configs')
  return None if trees.returncode or dirty.returncode or dirty.stdout.strip() else ' '.join(trees.stdout.split())


class KeptRows:
  """Rows compiled for a slice take minutes each here, so with --out each is also written to <out>.partial.jsonl
  as it completes, and a rerun reuses a row compiled from the same config, libtpu, jax and committed laurel/ and
  configs/ (`code_trees`). The file is removed once the full JSON is written."""

  def __init__(self, topology: str):
    self.path = epath.Path(_OUT.value + '.partial.jsonl') if _OUT.value else None
    trees = code_trees()
    self.stamp = (None if trees is None else
                  f"{topology} {trees} libtpu {importlib.metadata.version('libtpu')} jax {jax.__version__}")
    self.rows = {}
    if self.path and self.stamp and self.path.exists():
      self.rows = {r['key']: r['row'] for r in map(json.loads, self.path.read_text().splitlines())}

  def key(self, name, config):
    return f'{name} {self.stamp} flops={_COMPILER_FLOPS.value} {config.to_json_best_effort(sort_keys=True)}'

  def get(self, name, config):
    return self.rows.get(self.key(name, config)) if self.stamp else None

  def add(self, name, config, row):
    if self.path and self.stamp:
      self.rows[self.key(name, config)] = row
      cli.write_json_lines(self.path, [{'key': k, 'row': r} for k, r in self.rows.items()])

  def discard(self):
    if self.path and self.path.exists():
      self.path.unlink()


def print_slice_table(result):
  scaled = lambda r, key, unit: None if r.get(key) is None else r[key] / unit
  rows = [{**r, 'peak_gb': scaled(r, 'peak_memory_bytes', 1e9), 'argument_gb': scaled(r, 'argument_bytes', 1e9),
           'temp_gb': scaled(r, 'temp_bytes', 1e9), 'tflops': scaled(r, 'flops_per_step', 1e12),
           'bytes_gb': scaled(r, 'bytes_accessed_per_step', 1e9), 'cycles_m': scaled(r, 'estimated_cycles', 1e6),
           'est_ms': scaled(r, 'estimated_step_s', 1e-3), 'rate_pct': scaled(r, 'matmul_rate_share', 0.01)}
          for r in result['rows']]
  s, d = result['shape'], result['device']
  print(f"\n{d['topology']} ({d['chips']} x {d['device_kind']}), compiled not run, per chip | batch "
        f"{s['batch_size']} x {s['seq_len']} tokens | {s['dtype']} | remat {s['remat']} | ratios are to {BASELINE}")
  _print_columns(SLICE_COLUMNS, rows)


def _print_columns(columns, rows):
  fmt = lambda v: '-' if v is None else f'{v:,}' if isinstance(v, int) else f'{v:,.{3 if v < 100 else 0}f}'
  cells = [[h for k, h in columns.items() if k in rows[0]]] + [
      [r[k] if k == 'name' else fmt(r.get(k)) for k in columns if k in rows[0]] for r in rows]
  widths = [max(len(line[i]) for line in cells) + 2 for i in range(len(cells[0]))]
  for line in cells:
    print(''.join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))


def main():
  compile_cache.setup()
  start, known = time.time(), command_line.table_rows(_TABLE.value)
  names = [BASELINE] + [r for r in dict.fromkeys(_ROWS.value or known) if r != BASELINE]
  if unknown := [r for r in names if r not in known]:
    raise InputError(f'--rows: unknown row {unknown[0]!r} (known: {", ".join(known)})')
  if _TOPOLOGY.value and _VARIANTS.value:
    raise InputError('--variants: not with --topology (--vary compiles Baseline-24 per value there)')
  if _TOPOLOGY.value:  # before anything starts a backend: the slice's compiler runs beside the CPU one
    aot.compile_only_process()
    write(measure_slice(names), start, print_slice_table)
    return KeptRows(_TOPOLOGY.value).discard()
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  cpu, n, kind = jax.default_backend() == 'cpu', jax.device_count(), jax.devices()[0].device_kind
  shape = (_BATCH.value or (1 if cpu else 32 * n), _SEQ_LEN.value or (512 if cpu else 1024),
           *(['model.dtype=float32'] if cpu else []))
  configs = {**{r: row_config(r, *shape) for r in names}, **variant_rows(*shape)}
  full = {r: row_config(r, _FULL_BATCH.value * n, _FULL_SEQ_LEN.value) for r in names} if _FULL.value else {}
  for c in [*configs.values(), *full.values()]:
    train_config.validate_config(c)
  result = {'device': {'platform': jax.default_backend(), 'device_kind': kind, 'device_count': n,
                       'process_count': jax.process_count(), 'peak_flops_per_device': peak_flops_per_device(),
                       'host_cpus': os.cpu_count(), 'hostname': platform.node(), **step_profile.runtime_versions()},
            'shape': shape_of(configs)}
  c, mesh = configs[BASELINE], sharding.make_mesh(configs[BASELINE].mesh)
  print(f'{kind} x{n}: {len(names)} rows, batch {c.batch_size} x {c.data.seq_len}, {c.model.dtype}', flush=True)
  profiles = result['profile'] = {}
  result['rows'] = measure(configs, mesh, cpu, profiles)  # their states are freed before the full-shape compiles
  if not profiles:
    del result['profile']
  stats = jax.local_devices()[0].memory_stats() or {}
  result['device']['device_peak_bytes'] = stats.get('peak_bytes_in_use')  # of every row together, this process
  if full:
    result['full_shape'] = {**shape_of(full), 'batch_per_device': _FULL_BATCH.value, 'note': 'compiled, not run'}
    result['full_shape_memory'] = rows = []
    for name, config in full.items():
      rows.append({'name': name, **compile_row(config, mesh)[3],
                   **paper_figures(name, ('peak_memory_gb', 'peak_memory_ratio'))})
      rows[-1]['peak_memory_ratio'] = ratio(rows[-1]['peak_memory_bytes'], rows[0]['peak_memory_bytes'])
      print(f"full shape {name}: peak memory {rows[-1]['peak_memory_bytes'] / 2**30:.2f} GiB "
            f"({rows[-1]['compile_s']:.1f}s)", flush=True)
  write(result, start, print_table)


def peak_flops_per_device() -> float | None:
  return _PEAK.value or hardware.PEAK_FLOPS.get(jax.devices()[0].device_kind)


def write(result, start, table):
  # compile_s of a program read back from the cache is the time to read it.
  result.update(command=cli.command(), wall_s=round(time.time() - start, 1),
                compilation_cache=compile_cache.directory() is not None)
  if jax.process_index() == 0:
    table(result)
    if _OUT.value:
      out = _OUT.value.replace('{device}', hardware.device_slug(result['device']['device_kind']))
      cli.write_json(out, result)
      print(f'wrote {out} ({result["wall_s"]:.0f}s)')


if __name__ == '__main__':
  app.run(cli.main(main))
