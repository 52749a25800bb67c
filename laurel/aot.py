"""The train step compiled for a TPU slice on a machine without one: libtpu's compiler on abstract devices.

  topology 'v6e:4x4' (or the accelerator type 'v6e-16') -> the slice's compile-only devices (jax.experimental.topologies), a mesh over them
  compile_for_slice(config, topology) -> the TPU compiler's per-chip memory, FLOPs and bytes accessed; nothing is run
  preflight(config, topology) -> the same, or a one-line InputError when the step does not fit the chip's HBM

Needs libtpu (`pip install -e '.[tpu]'`). The state and batch are abstract (jax.ShapeDtypeStruct with shardings),
so nothing concrete ever lands on the abstract devices; the CPU stays the process's only backend.
"""

import dataclasses
import importlib.util
import math
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from laurel import console, cross_entropy, lm, sharding, tpu_slices, train
from laurel.config_lib import DTYPES, InputError


CHIP_SOURCE = ('per-chip HBM capacity and bandwidth, and the dense bf16 peak FLOP/s in laurel.train.PEAK_FLOPS: the '
               'Cloud TPU system-architecture pages, cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e')


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip of a TPU generation (figures: CHIP_SOURCE); its peak FLOP/s is train.PEAK_FLOPS[device_kind]."""
  device_kind: str  # as the compile-only devices name it
  hbm_bytes: float
  hbm_bytes_per_s: float
  dims: int  # of the slice's topology: 2-D torus (v5e, v6e) or 3-D (v4, v5p)
  chip_config: str  # 'megacore': one JAX device drives both TensorCores of a chip (v4, v5p)
  accelerator: str  # Cloud TPU's accelerator type, <this>-<TensorCores>


CHIPS = {'v4': Chip('TPU v4', 32 * 2**30, 1200e9, 3, 'megacore', 'v4'),
         'v5e': Chip('TPU v5 lite', 16e9, 819e9, 2, 'default', 'v5litepod'),
         'v5p': Chip('TPU v5', 95e9, 2765e9, 3, 'megacore', 'v5p'),
         'v6e': Chip('TPU v6 lite', 32e9, 1638e9, 2, 'default', 'v6e')}


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
  """'v6e:4x4' (or 'v6e-16') -> ('v6e', (4, 4)); a one-line InputError naming the field otherwise."""
  gen, _, shape = tpu_slices.as_topology(topology or '').partition(':')
  dims = shape.split('x')
  if gen not in CHIPS or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise InputError(f'topology={topology!r}: must be <generation>:<chips per axis>, e.g. v6e:4x4 or v5p:2x2x4, '
                     f'or an accelerator type, e.g. v6e-16 (generations: {", ".join(CHIPS)})')
  if len(dims) != CHIPS[gen].dims:
    raise InputError(f'topology={topology!r}: a {gen} slice is {CHIPS[gen].dims}-D, e.g. '
                     f'{gen}:{"x".join(["2"] * CHIPS[gen].dims)}')
  return gen, tuple(map(int, dims))


def _host_bounds(topology: str) -> tuple[int, int, int]:
  """Chips per host along each axis: a one-host v5e/v6e slice has up to 8 chips, every other host 2x2x1."""
  gen, dims = parse_topology(topology)
  chips = list(dims) + [1] * (3 - len(dims))
  return tuple(chips) if CHIPS[gen].dims == 2 and chips[0] * chips[1] <= 8 else (min(chips[0], 2), min(chips[1], 2), 1)


def slice_size(topology: str) -> tuple[int, int]:
  """(chips, hosts) of `topology`, for train.validate_config before anything compiles."""
  chips = math.prod(parse_topology(topology)[1])
  return chips, chips // math.prod(_host_bounds(topology))


def slice_devices(topology: str) -> list:
  """The compile-only devices of `topology`, one per chip, in processes as on the slice's hosts."""
  gen, _ = parse_topology(topology)
  topology = tpu_slices.as_topology(topology)  # libtpu's spelling
  if importlib.util.find_spec('libtpu') is None:
    raise InputError(f"topology={topology!r}: compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
  if not os.environ.get('JAX_PLATFORMS'):  # on a TPU VM too: the real chips may be busy training
    jax.config.update('jax_platforms', 'cpu')
  # libtpu's lock on /tmp/libtpu_lockfile guards real chips; a compile-only client needs none, and another
  # process of this venv that probed for a TPU may hold it. The rest describes the slice to libtpu's start-up,
  # which otherwise asks a TPU VM's metadata server and logs its failure to stderr (not read for the topology).
  chips, cores = math.prod(parse_topology(topology)[1]), 2 if CHIPS[gen].chip_config == 'megacore' else 1
  for name, value in (('ALLOW_MULTIPLE_LIBTPU_LOAD', '1'), ('TPU_SKIP_MDS_QUERY', '1'),
                      ('TPU_WORKER_HOSTNAMES', 'localhost'),
                      ('TPU_ACCELERATOR_TYPE', f'{CHIPS[gen].accelerator}-{chips * cores}')):
    os.environ.setdefault(name, value)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return topologies.get_topology_desc(
        platform='tpu', topology_name=topology, chip_config_name=CHIPS[gen].chip_config,
        chips_per_host_bounds=_host_bounds(topology), num_slices=1).devices
  except jax.errors.JaxRuntimeError as e:
    raise InputError(f'topology={topology!r}: libtpu has no such slice ({str(e).splitlines()[0]})') from None


def _compile(config, devices):
  task = train.validate_config(config, len(devices), len({d.process_index for d in devices}))
  mesh = sharding.make_mesh(config.mesh, devices)
  # A compile-only client cannot load an executable back from the persistent compilation cache (it warns on stderr
  # and compiles again), so none is written for it.
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
      compiled, _, abstract, _ = train.compile_step(task, config, mesh)
  finally:
    jax.config.update('jax_enable_compilation_cache', cache)
  return compiled, abstract


def _not_fitting(topology: str, chip: Chip, error: Exception) -> InputError:
  """The TPU compiler's out-of-memory error as one line: what the step needs per chip, and what the chip has."""
  first = str(error).splitlines()[0]
  need = re.search(r'required for [\w ]+\(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)', first) or \
      re.search(r'Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm', first)
  if need:
    return InputError(f'topology={topology!r}: does not fit: the step needs {need.group(1)}B of HBM per chip, '
                      f'a {chip.device_kind} chip has {need.group(2)}B for it ({chip.hbm_bytes / 1e9:.1f} GB in all)')
  return InputError(f'topology={topology!r}: does not fit a {chip.device_kind} chip '
                    f'({chip.hbm_bytes / 1e9:.1f} GB of HBM): {first}')


def compile_for_slice(config, topology: str, costs: bool = True) -> dict:
  """The step of `config` compiled by the TPU compiler for `topology`, per chip: parameters, peak HBM (the
  compiler's own figure), argument and temporary bytes; with `costs`, also FLOPs and bytes accessed per step and
  the roofline step time max(FLOPs / peak FLOP/s, bytes / HBM bandwidth).

  XLA counts a while loop's body once, so a scanned layer stack is compiled a second time with two layers per
  iteration (`model.scan_unroll=2`): the difference is one iteration's cost, added for every further iteration.
  The step must not accumulate gradients (its micro-batch loop would be counted once too)."""
  gen, _ = parse_topology(topology)
  chip, devices = CHIPS[gen], slice_devices(topology)
  try:
    compiled, abstract = _compile(config, devices)
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' in str(e):
      raise _not_fitting(topology, chip, e) from None
    raise
  m = compiled.memory_analysis()
  facts = {'params': int(sum(x.size for x in jax.tree.leaves(abstract.params))),
           'peak_memory_bytes': int(m.peak_memory_in_bytes), 'argument_bytes': int(m.argument_size_in_bytes),
           'output_bytes': int(m.output_size_in_bytes), 'alias_bytes': int(m.alias_size_in_bytes),
           'temp_bytes': int(m.temp_size_in_bytes), 'hbm_bytes': chip.hbm_bytes}
  if not costs:
    return facts
  if config.optimizer.grad_accum_steps > 1:
    raise InputError(f'optimizer.grad_accum_steps={config.optimizer.grad_accum_steps}: the compiler counts the '
                     'micro-batch loop once; measure costs with 1')
  totals = train.xla_costs(compiled)
  if config.model.get('scan_layers'):  # the LM: one scan iteration per layer
    layers = config.model.num_layers
    if layers % 2:
      raise InputError(f'model.num_layers={layers}: costs need an even number of scanned layers')
    unrolled = ml_collections.ConfigDict(config.to_dict())
    unrolled.model.scan_unroll = 2
    twice = train.xla_costs(_compile(unrolled, devices)[0])
    totals = [c + (layers - 1) * (c2 - c) for c, c2 in zip(totals, twice)]
    totals = [c + extra for c, extra in zip(totals, _uncounted_loss_chunks(config, devices))]
  flops, bytes_accessed = totals
  peak = train.PEAK_FLOPS[chip.device_kind]
  compute_s, memory_s = flops / peak, bytes_accessed / chip.hbm_bytes_per_s
  return {**facts, 'flops_per_step': flops, 'bytes_accessed_per_step': bytes_accessed, 'compute_s': compute_s,
          'memory_s': memory_s, 'roofline_step_time_s': max(compute_s, memory_s)}


def _uncounted_loss_chunks(config, devices) -> tuple[float, float]:
  """(FLOPs, bytes) of the loss's chunks after the first (laurel.cross_entropy): its scan body is counted once too.
  One chunk's loss and gradients are compiled alone, batch-sharded over the same mesh."""
  model = lm.LMConfig.from_config(config.model)
  chunk = min(model.loss_chunk or config.data.seq_len, config.data.seq_len)
  chunks = -(-config.data.seq_len // chunk)
  if chunks == 1:
    return 0.0, 0.0
  mesh = sharding.make_mesh(config.mesh, devices)
  dtype, batch = DTYPES[model.dtype], sharding.batch_sharding(mesh)
  kernel = jax.ShapeDtypeStruct((model.vocab_size, model.d_model), DTYPES[model.param_dtype],
                                sharding=jax.sharding.NamedSharding(mesh, jax.P()))
  shape = lambda *tail, dtype: jax.ShapeDtypeStruct((config.batch_size, chunk, *tail), dtype, sharding=batch)
  grads = jax.grad(lambda x, w, t, m: cross_entropy.chunked(x, w, 'vd', t, m, chunk, dtype)[0], (0, 1))
  one = train.xla_costs(jax.jit(grads).lower(shape(model.d_model, dtype=dtype), kernel, shape(dtype=jnp.int32),
                                             shape(dtype=jnp.float32)).compile())
  return tuple((chunks - 1) * c for c in one)


def preflight(config, topology: str | None) -> str:
  """Compiles the step for `topology` and checks that it fits each chip's HBM: a one-line report, or a one-line
  InputError giving the per-chip need and the chip's HBM. The check before every TPU launch."""
  if not topology:
    raise InputError('topology=None: compiling for a slice needs one, e.g. --topology=v6e:4x4')
  gen, _ = parse_topology(topology)
  with console.phase(f'compiling the train step for {topology} with the TPU compiler', file=sys.stderr):
    chip, facts = CHIPS[gen], compile_for_slice(config, topology, costs=False)
  gb = lambda key: f'{facts[key] / 1e9:.3g} GB'
  need = f'the step needs {gb("peak_memory_bytes")} of HBM per chip'
  if facts['peak_memory_bytes'] > chip.hbm_bytes:
    raise InputError(f'topology={topology!r}: does not fit: {need}, a {chip.device_kind} chip has '
                     f'{chip.hbm_bytes / 1e9:.1f} GB')
  # The peak is the compiler's heap at its fullest: the state and batch, plus the temporaries alive at that point.
  # All temporaries together come to more, since they are never alive at once.
  return (f'preflight {topology}: fits: {need} of {chip.hbm_bytes / 1e9:.1f} GB (the compiler\'s peak heap: '
          f'{gb("argument_bytes")} of state and batch plus the temporaries alive at that point; '
          f'{gb("temp_bytes")} of temporaries in all, never alive at once)')
