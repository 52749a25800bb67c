"""The train step compiled for a TPU slice on a machine without one: libtpu's compiler on abstract devices.

  topology 'v6e:4x4' (or the accelerator type 'v6e-16') -> the slice's compile-only devices (jax.experimental.topologies), a mesh over them
  compile_for_slice(config, topology) -> the TPU compiler's per-chip memory, FLOPs and bytes accessed; nothing is run
  preflight(config, topology) -> the same, or a one-line InputError when the step does not fit the chip's HBM

Needs libtpu (`pip install -e '.[tpu]'`). The state and batch are abstract (jax.ShapeDtypeStruct with shardings),
so nothing concrete ever lands on the abstract devices. A command line that compiles for a slice calls
`compile_only_process()` first: the CPU as the process's only backend. A compile-only client cannot load an
executable back from JAX's persistent cache, so the compiler's figures of each program are kept instead
(laurel.compile_cache.record): a second pre-flight of the same step lowers its programs and compiles none.
"""

import importlib.metadata
import importlib.util
import math
import os
import re
import sys

import flax.linen as nn
import jax

from laurel import compile_cache, console, cost, sharding, step, tpu_slices
from laurel.config_lib import InputError
from laurel.hardware import TPUS, TPU, xla_costs


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
  """'v6e:4x4' (or 'v6e-16') -> ('v6e', (4, 4)); a one-line InputError naming the field otherwise."""
  gen, _, shape = tpu_slices.as_topology(topology or '').partition(':')
  dims = shape.split('x')
  if gen not in TPUS or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise InputError(f'topology={topology!r}: must be <generation>:<chips per axis>, e.g. v6e:4x4 or v5p:2x2x4, '
                     f'or an accelerator type, e.g. v6e-16 (generations: {", ".join(TPUS)})')
  if len(dims) != TPUS[gen].dims:
    raise InputError(f'topology={topology!r}: a {gen} slice is {TPUS[gen].dims}-D, e.g. '
                     f'{gen}:{"x".join(["2"] * TPUS[gen].dims)}')
  return gen, tuple(map(int, dims))


def slice_size(topology: str) -> tuple[int, int]:
  """(chips, hosts) of `topology` (laurel.tpu_slices), for step.validate_config before anything compiles."""
  parse_topology(topology)
  accel = tpu_slices.parse_accelerator(tpu_slices.as_topology(topology), flag='topology')
  return accel['chips'], accel['hosts']


def _host_bounds(topology: str) -> tuple[int, int, int]:
  """Chips per host along each axis: a one-host slice's chips are all on its host, a larger slice's host has 2x2x1."""
  chips = list(parse_topology(topology)[1])
  chips += [1] * (3 - len(chips))
  return tuple(chips) if slice_size(topology)[1] == 1 else (min(chips[0], 2), min(chips[1], 2), 1)


def slice_devices(topology: str) -> list:
  """The compile-only devices of `topology`, one per chip, in processes as on the slice's hosts."""
  gen, _ = parse_topology(topology)
  topology = tpu_slices.as_topology(topology)  # libtpu's spelling
  if importlib.util.find_spec('libtpu') is None:
    raise InputError(f"topology={topology!r}: compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
  # libtpu's lock on /tmp/libtpu_lockfile guards real chips; a compile-only client needs none, and another
  # process of this venv that probed for a TPU may hold it. The rest describes the slice to libtpu's start-up,
  # which otherwise asks a TPU VM's metadata server and logs its failure to stderr (not read for the topology).
  chips, tpu = math.prod(parse_topology(topology)[1]), TPUS[gen]
  for name, value in (('ALLOW_MULTIPLE_LIBTPU_LOAD', '1'), ('TPU_SKIP_MDS_QUERY', '1'),
                      ('TPU_WORKER_HOSTNAMES', 'localhost'),
                      ('TPU_ACCELERATOR_TYPE', f'{tpu.accelerator}-{chips * tpu.cores_per_chip}')):
    os.environ.setdefault(name, value)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return topologies.get_topology_desc(
        platform='tpu', topology_name=topology,
        chip_config_name='megacore' if tpu.cores_per_chip == 2 else 'default',
        chips_per_host_bounds=_host_bounds(topology), num_slices=1).devices
  except jax.errors.JaxRuntimeError as e:
    raise InputError(f'topology={topology!r}: libtpu has no such slice ({str(e).splitlines()[0]})') from None


def compile_only_process() -> None:
  """For a command line's start: the CPU as the backend (on a TPU VM too: its chips may be busy training), and
  JAX's persistent cache off, from which a compile-only client cannot load an executable back (it warns on stderr
  and compiles again); laurel.compile_cache.record keeps what the pre-flight needs instead."""
  if not os.environ.get('JAX_PLATFORMS'):
    jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_enable_compilation_cache', False)


def _compile(task, devices) -> tuple[dict, object]:
  """The TPU compiler's figures of the step of `task` on `devices` (memory, XLA's costs; or, where it runs out of
  HBM, its error's first line as `resource_exhausted`) and the abstract state. Compiled once: the figures are kept
  under the compilation cache, keyed by the lowered program, the slice and the compiler's version."""
  mesh = sharding.make_mesh(task.config.mesh, devices)
  with jax.set_mesh(mesh), nn.logical_axis_rules(task.config.logical_axis_rules):
    lowered, _, abstract, _ = step.lower_step(task, mesh)
    return _kept(lowered, devices, _figures), abstract


def _kept(lowered, devices, figures) -> dict:
  """figures(lowered), or what it returned for the same program, slice and compiler in an earlier process."""
  slice_desc = f'{devices[0].device_kind} x{len(devices)} in {len({d.process_index for d in devices})} processes'
  key = [lowered.as_text(), slice_desc, jax.__version__, _libtpu_version(),
         os.environ.get('XLA_FLAGS', ''), os.environ.get('LIBTPU_INIT_ARGS', '')]
  return compile_cache.record(key, lambda: figures(lowered))


def _libtpu_version() -> str:
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return 'none'


def _figures(lowered) -> dict:
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' in str(e):
      return {'resource_exhausted': str(e).splitlines()[0]}
    raise
  m = compiled.memory_analysis()
  flops, bytes_accessed = xla_costs(compiled)
  return {'peak_memory_bytes': int(m.peak_memory_in_bytes), 'argument_bytes': int(m.argument_size_in_bytes),
          'output_bytes': int(m.output_size_in_bytes), 'alias_bytes': int(m.alias_size_in_bytes),
          'temp_bytes': int(m.temp_size_in_bytes), 'flops': flops, 'bytes_accessed': bytes_accessed}


class DoesNotFit(InputError):
  """The step needs more HBM than a chip has; `need_bytes` what the compiler said it needs (None if it did not)."""

  def __init__(self, message: str, need_bytes: int | None = None):
    super().__init__(message)
    self.need_bytes = need_bytes


def _not_fitting(topology: str, chip: TPU, error: Exception | str) -> DoesNotFit:
  """The TPU compiler's out-of-memory error as one line: what the step needs per chip, and what the chip has."""
  first = (str(error).splitlines() or [''])[0]
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
  """The step of `config` compiled by the TPU compiler for `topology`, per chip: parameters, peak HBM (the
  compiler's own figure), argument and temporary bytes; with `costs`, also FLOPs and bytes accessed per step and
  the roofline step time max(FLOPs / peak FLOP/s, bytes / HBM bandwidth).

  The costs are step.step_costs': XLA counts a loop's body once, so what its loops leave out is compiled too."""
  gen, _ = parse_topology(topology)
  chip, devices = TPUS[gen], slice_devices(topology)
  task = step.validate_config(config, len(devices), len({d.process_index for d in devices}))
  figures, abstract = _compile(task, devices)

  def fitting(figures):
    if 'resource_exhausted' in figures:
      raise _not_fitting(topology, chip, figures['resource_exhausted'])
    return figures

  fitting(figures)
  facts = {'params': task.num_params(abstract.params),
           **{k: figures[k] for k in ('peak_memory_bytes', 'argument_bytes', 'output_bytes', 'alias_bytes',
                                      'temp_bytes')}, 'hbm_bytes': chip.hbm_bytes}
  if not costs:
    return facts
  # The step above is not compiled again.
  def costs_of(t):
    f = fitting(figures if t.config == task.config else _compile(t, devices)[0])
    return f['flops'], f['bytes_accessed']

  def lowered_costs(lowered):  # the loss's one-chunk program, kept as the step is
    f = _kept(lowered, devices, lambda l: dict(zip(('flops', 'bytes_accessed'), xla_costs(l.compile()))))
    return f['flops'], f['bytes_accessed']

  flops, bytes_accessed = step.step_costs(task, costs_of, sharding.make_mesh(task.config.mesh, devices),
                                          lowered_costs)
  compute_s, memory_s = flops / chip.peak_flops, bytes_accessed / chip.hbm_bytes_per_s
  return {**facts, 'flops_per_step': flops, 'bytes_accessed_per_step': bytes_accessed, 'compute_s': compute_s,
          'memory_s': memory_s, 'roofline_step_time_s': max(compute_s, memory_s)}


def preflight(config, topology: str | None) -> str:
  """Compiles the step for `topology` and checks that it fits each chip's HBM: a report (whether it fits, then what
  the run will cost, laurel.cost), or a one-line InputError giving the per-chip need and the chip's HBM. The check
  before every TPU launch. Without --mfu the estimate needs the compiler's roofline, which compiles more
  (step.step_costs); every compile is kept (laurel.compile_cache), so a second pre-flight only lowers them."""
  if not topology:
    raise InputError('topology=None: compiling for a slice needs one, e.g. --topology=v6e:4x4')
  gen, _ = parse_topology(topology)
  mfu = cost.mfu_flag()
  with console.phase(f'compiling the train step for {topology} with the TPU compiler', file=sys.stderr):
    chip, facts = TPUS[gen], compile_for_slice(config, topology, costs=mfu is None)
  gb = lambda key: f'{facts[key] / 1e9:.3g} GB'
  need = f'the step needs {gb("peak_memory_bytes")} of HBM per chip'
  if facts['peak_memory_bytes'] > chip.hbm_bytes:
    raise InputError(f'topology={topology!r}: does not fit: {need}, a {chip.device_kind} chip has '
                     f'{chip.hbm_bytes / 1e9:.1f} GB')
  # The peak is the compiler's heap at its fullest: the state and batch, plus the temporaries alive at that point.
  # All temporaries together come to more, since they are never alive at once.
  task = step.validate_config(config, *slice_size(topology))
  estimate = cost.estimate(model_flops=task.model_flops(task.config.batch_size), steps=task.config.steps,
                           units_per_step=task.config.batch_size * task.units_per_example(),
                           chips=slice_size(topology)[0], peak_flops=chip.peak_flops, mfu=mfu,
                           roofline_s=facts.get('roofline_step_time_s'))
  return (f'preflight {topology}: fits: {need} of {chip.hbm_bytes / 1e9:.1f} GB (the compiler\'s peak heap: '
          f'{gb("argument_bytes")} of state and batch plus the temporaries alive at that point; '
          f'{gb("temp_bytes")} of temporaries in all, never alive at once)\n'
          f'preflight {topology}: {cost.line(estimate, task.unit)}')
