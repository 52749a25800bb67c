"""The train step compiled for a TPU slice ('v6e:4x4' or 'v6e-16') on a machine without one: libtpu's compiler on
compile-only devices. compile_for_slice gives its figures, the step time among them as the compiler schedules it
(laurel.plan.schedule); preflight, the report before a launch."""

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from laurel import sharding, step, train_config
from laurel.cli import compile_cache, console, files
from laurel.plan import cost, schedule
from laurel.config_lib import InputError
from laurel.plan.hardware import TPUS, TPU, parse_accelerator, xla_costs

MEMORY = ('peak_memory_bytes', 'argument_bytes', 'output_bytes', 'alias_bytes', 'temp_bytes')


def slice_devices(topology: str) -> list:
  """The compile-only devices of a slice, one per chip, in processes as on the slice's hosts."""
  accel = parse_accelerator(topology, flag='topology')
  tpu = TPUS[accel['generation']]
  if importlib.util.find_spec('libtpu') is None:
    raise InputError(f"topology={topology!r}: compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
  # libtpu's lock file guards real chips: a compile-only client needs none, and another process may hold it. The
  # rest tells libtpu's start-up the slice, which it would otherwise ask a TPU VM's metadata server for (and log).
  for name, value in (('ALLOW_MULTIPLE_LIBTPU_LOAD', '1'), ('TPU_SKIP_MDS_QUERY', '1'),
                      ('TPU_WORKER_HOSTNAMES', 'localhost'), ('TPU_ACCELERATOR_TYPE', accel['name'])):
    os.environ.setdefault(name, value)
  # Chips per host along each axis: a one-host slice has them all, a larger slice's host 2x2x1.
  dims = [*map(int, accel['topology'].split('x')), 1][:3]
  bounds = dims if accel['hosts'] == 1 else [min(dims[0], 2), min(dims[1], 2), 1]
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return topologies.get_topology_desc(
        platform='tpu', topology_name=f'{accel["generation"]}:{accel["topology"]}', num_slices=1,
        chip_config_name='megacore' if tpu.cores_per_chip == 2 else 'default', chips_per_host_bounds=tuple(bounds)
    ).devices
  except jax.errors.JaxRuntimeError as e:
    raise InputError(f'topology={topology!r}: libtpu has no such slice ({str(e).splitlines()[0]})') from None


def compile_only_process() -> None:
  """The CPU as backend (a TPU VM's chips may be busy training), and JAX's persistent cache off: a compile-only
  client cannot load an executable back from it."""
  if not os.environ.get('JAX_PLATFORMS'):
    jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_enable_compilation_cache', False)


def _compiler_key(devices) -> list[str]:
  """What the compiler's figures depend on besides the program: the slice, jax, libtpu and their flags."""
  try:
    libtpu = importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    libtpu = 'none'
  slice_desc = f'{devices[0].device_kind} x{len(devices)} in {len({d.process_index for d in devices})} processes'
  return [slice_desc, jax.__version__, libtpu, os.environ.get('XLA_FLAGS', ''), os.environ.get('LIBTPU_INIT_ARGS', '')]


def _record(key_parts: list[str], figures) -> dict:
  """`figures()`, kept as JSON under the compilation cache keyed by `key_parts` and read back next time: a
  compile-only TPU client cannot load an executable back from the cache, so the compiler's figures are kept instead."""
  if compile_cache.directory() is None:
    return figures()
  path = pathlib.Path(compile_cache.directory(), 'preflight',
                      hashlib.sha256('\0'.join(key_parts).encode()).hexdigest() + '.json')
  with contextlib.suppress(OSError, ValueError):  # none yet, or unreadable: compile
    return json.loads(path.read_text())
  result = figures()
  with contextlib.suppress(OSError):  # a read-only cache costs the next run a compile, not this one its result
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(path, json.dumps(result) + '\n')
  return result


def matmul_rate(devices) -> float:
  """The TPU compiler's FLOPs per cycle for one bfloat16 8192³ product on one chip of `devices`: its own rate for a
  large matmul, at which laurel.plan.schedule counts the kernels it does not schedule."""
  n = 8192
  chip = jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:1], ('chip',)), jax.P())
  square = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=chip)
  lowered = jax.jit(jnp.matmul).lower(square, square)
  figures = lambda: {'cycles': schedule.estimate(lowered.compile().as_text(), 1.0, 1.0).compiler_cycles}
  return 2 * n ** 3 / _record([lowered.as_text(), *_compiler_key(devices[:1])], figures)['cycles']


def _kept(lowered, devices, topology: str, chip: TPU, rate: float, kernel_flops: float = 0.0) -> dict:
  """The TPU compiler's figures of a program (MEMORY, FLOPs and bytes accessed, its schedule's estimate at the matmul
  `rate`, kernels without a cost estimate counted as `kernel_flops`), kept by _record keyed by the
  program, the slice and the compiler; DoesNotFit where it ran out of HBM."""
  def figures():
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' in str(e):
        return {'resource_exhausted': str(e).splitlines()[0]}
      raise
    m = compiled.memory_analysis()
    sizes = (m.peak_memory_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
             m.temp_size_in_bytes)
    est = schedule.estimate(compiled.as_text(), rate, chip.hbm_bytes_per_s / chip.clock_hz, kernel_flops)
    return {**dict(zip(MEMORY, map(int, sizes))), **dict(zip(('flops', 'bytes_accessed'), xla_costs(compiled))),
            'schedule': schedule.as_dict(est)}

  key = [lowered.as_text(), *_compiler_key(devices), str(rate), str(kernel_flops)]
  kept = _record(key, figures)
  if 'resource_exhausted' in kept:
    raise _not_fitting(topology, chip, kept['resource_exhausted'])
  return kept


class DoesNotFit(InputError):
  """The step needs more HBM than a chip has; `need_bytes` what the compiler said it needs (None if it did not)."""
  def __init__(self, message: str, need_bytes: int | None = None):
    super().__init__(message)
    self.need_bytes = need_bytes


def _not_fitting(topology: str, chip: TPU, error: str) -> DoesNotFit:
  """The TPU compiler's out-of-memory error as one line: what the step needs per chip, what the chip has."""
  first = (error.splitlines() or [''])[0]
  need = re.search(r'required for [\w ]+\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)', first) or \
      re.search(r'Used ([\d.]+)([KMGT]?) of ([\d.]+[KMGT]?) hbm', first)
  if need:  # XLA writes binary units: 41.2G is 41.2 GiB
    need_bytes = int(float(need.group(1)) * 1024 ** ' KMGT'.index(need.group(2) or ' '))
    return DoesNotFit(f'topology={topology!r}: does not fit: the step needs {need.group(1)}{need.group(2)}B of HBM '
                      f'per chip, a {chip.device_kind} chip has {need.group(3)}B for it '
                      f'({chip.hbm_bytes / 1e9:.1f} GB in all)', need_bytes)
  return DoesNotFit(f'topology={topology!r}: does not fit a {chip.device_kind} chip '
                    f'({chip.hbm_bytes / 1e9:.1f} GB of HBM): {first}')


def compile_for_slice(config, topology: str, costs: bool = True) -> dict:
  """Per chip: parameters, MEMORY and the compiler's estimated step (SCHEDULE); with `costs`, FLOPs and bytes accessed
  per step (cost.step_costs) and the roofline step time max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)."""
  chip, devices = TPUS[parse_accelerator(topology, flag='topology')['generation']], slice_devices(topology)
  task = train_config.validate_config(config, len(devices), len({d.process_index for d in devices}))
  mesh = sharding.make_mesh(task.config.mesh, devices)
  rate = matmul_rate(devices)
  per_chip = task.config.batch_size // len(devices)

  def compiled(t):  # the figures of the step of task t, and its abstract state
    with jax.set_mesh(mesh), nn.logical_axis_rules(t.config.logical_axis_rules):
      lowered, _, abstract, _ = step.lower_step(t, mesh)
      return _kept(lowered, devices, topology, chip, rate, t.unestimated_kernel_flops(per_chip)), abstract

  figures, abstract = compiled(task)
  est = figures['schedule']
  facts = {'params': task.num_params(abstract.params), **{k: figures[k] for k in MEMORY}, 'hbm_bytes': chip.hbm_bytes,
           'clock_hz': chip.clock_hz, 'matmul_flops_per_cycle': rate, 'estimated_cycles': est['cycles'],
           'estimated_step_s': est['cycles'] / chip.clock_hz, 'schedule': est,
           'model_flops_per_chip': task.model_flops(task.config.batch_size) / len(devices)}
  facts['matmul_rate_share'] = facts['model_flops_per_chip'] / est['cycles'] / rate
  if not costs:
    return facts
  costs_of = lambda f: (f['flops'], f['bytes_accessed'])
  step_costs = lambda t: costs_of(figures if t.config == task.config else compiled(t)[0])  # the step: compiled once
  loss_costs = lambda lowered: costs_of(_kept(lowered, devices, topology, chip, rate))  # the loss's one-chunk program
  flops, bytes_accessed = cost.step_costs(task, step_costs, mesh, loss_costs)
  compute_s, memory_s = flops / chip.peak_flops, bytes_accessed / chip.hbm_bytes_per_s
  return {**facts, 'flops_per_step': flops, 'bytes_accessed_per_step': bytes_accessed, 'compute_s': compute_s,
          'memory_s': memory_s, 'roofline_step_time_s': max(compute_s, memory_s)}


def preflight(config, topology: str | None, mfu: float | None = None) -> str:
  """The report before every TPU launch (it fits each chip's HBM; the step time as the compiler schedules it, or at
  `mfu`, else --mfu; the step's largest groups), else a one-line InputError."""
  if not topology:
    raise InputError('topology=None: compiling for a slice needs one, e.g. --topology=v6e:4x4')
  accel = parse_accelerator(topology, flag='topology')
  chip, mfu = TPUS[accel['generation']], cost.mfu_flag() if mfu is None else mfu
  with console.phase(f'compiling the train step for {topology} with the TPU compiler', file=sys.stderr):
    facts = compile_for_slice(config, topology, costs=False)
  gb = lambda key: f'{facts[key] / 1e9:.3g} GB'
  need = f'the step needs {gb("peak_memory_bytes")} of HBM per chip'
  if facts['peak_memory_bytes'] > chip.hbm_bytes:
    raise InputError(f'topology={topology!r}: does not fit: {need}, a {chip.device_kind} chip has '
                     f'{chip.hbm_bytes / 1e9:.1f} GB')
  task = train_config.validate_config(config, accel['chips'], accel['hosts'])
  estimate = cost.estimate(model_flops=task.model_flops(task.config.batch_size), steps=task.config.steps,
                           units_per_step=task.config.batch_size * task.units_per_example(), chips=accel['chips'],
                           peak_flops=chip.peak_flops, mfu=mfu, cycles=facts['estimated_cycles'],
                           clock_hz=chip.clock_hz)
  est = facts['schedule']
  blind = f"{est['collective_bytes'] / 1e6:,.0f} MB of collectives per chip and step, host work"
  if est['uncounted_kernels']:
    blind += f", {est['uncounted_kernels']} kernel calls without a cost estimate"
  # The peak is the compiler's heap at its fullest: the state and batch, plus the temporaries alive at that point.
  return (f'preflight {topology}: fits: {need} of {chip.hbm_bytes / 1e9:.1f} GB (the compiler\'s peak heap: '
          f'{gb("argument_bytes")} of state and batch plus the temporaries alive at that point; '
          f'{gb("temp_bytes")} of temporaries in all, never alive at once)\n'
          f'preflight {topology}: {cost.line(estimate, task.unit)}\n'
          f"preflight {topology}: the step as the compiler schedules it: {schedule.group_shares(est['groups'])} "
          f'(not in the estimate: {blind})')
