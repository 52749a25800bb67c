"""Accelerator facts (TPUS, PEAK_FLOPS), Cloud TPU slices in either spelling (parse_accelerator), and what XLA's
compiler says a program costs."""

import dataclasses
import math
import re

from laurel.config_lib import InputError

SOURCE = ('per-chip dense bf16 peak FLOP/s, HBM capacity and bandwidth, MXUs per TensorCore and their size: the Cloud '
          'TPU system-architecture pages, cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e; the clock is the peak over '
          'the MXUs\' multiply-adds per cycle (v4: 1.05 GHz, as the TPU v4 paper, Jouppi et al. 2023, states)')


@dataclasses.dataclass(frozen=True)
class TPU:
  """One Cloud TPU generation (figures: SOURCE)."""
  device_kinds: tuple[str, ...]  # as jax names its devices; the first as the compile-only devices name them
  peak_flops: float  # dense bf16, per chip
  hbm_bytes: float
  hbm_bytes_per_s: float
  dims: int  # of a slice's topology: 2-D torus (v5e, v6e) or 3-D (v4, v5p)
  cores_per_chip: int  # TensorCores; 2: one JAX device drives both (megacore), and accelerator types count cores
  accelerator: str  # Cloud TPU's accelerator type is <this>-<TensorCores>
  runtime_version: str  # the TPU VM software version gcloud creates it with
  largest: int  # TensorCores of the largest slice
  mxus: int  # matrix units per chip, all TensorCores
  mxu_size: int  # an MXU multiplies mxu_size × mxu_size

  @property
  def device_kind(self) -> str:
    return self.device_kinds[0]

  @property
  def clock_hz(self) -> float:
    """The peak FLOP/s over 2 FLOPs per multiply-add of every MXU cell each cycle."""
    return self.peak_flops / (2 * self.mxus * self.mxu_size ** 2)


TPUS = {'v4': TPU(('TPU v4',), 275e12, 32 * 2**30, 1200e9, 3, 2, 'v4', 'tpu-ubuntu2204-base', 4096, 8, 128),
        'v5e': TPU(('TPU v5 lite', 'TPU v5e'), 197e12, 16e9, 819e9, 2, 1, 'v5litepod', 'v2-alpha-tpuv5-lite', 256, 4,
                   128),
        'v5p': TPU(('TPU v5', 'TPU v5p'), 459e12, 95e9, 2765e9, 3, 2, 'v5p', 'v2-alpha-tpuv5', 4096, 8, 128),
        'v6e': TPU(('TPU v6 lite', 'TPU v6e'), 918e12, 32e9, 1638e9, 2, 1, 'v6e', 'v2-alpha-tpuv6e', 256, 4, 256)}
# Dense bf16 peak FLOP/s per jax device kind, for MFU (absent: e.g. CPU); NVIDIA's from its datasheets, whose 1,979
# for the H100 SXM and the H200 is with 2:4 sparsity.
PEAK_FLOPS = {**{kind: tpu.peak_flops for tpu in TPUS.values() for kind in tpu.device_kinds},
              'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H200': 989e12, 'NVIDIA A100-SXM4-80GB': 312e12,
              'NVIDIA A100-SXM4-40GB': 312e12}
# Chips -> a Cloud TPU slice's topology: 2-D for v5e/v6e, 3-D for v4/v5p.
TOPOLOGY_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16', 256: '16x16'}
TOPOLOGY_3D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8', 256: '4x8x8',
               512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16'}
ACCELERATOR_TYPE = re.compile(r'(v4|v5p|v5litepod|v5e|v6e)-(\d+)')


def _dims(shape: str) -> list[int] | None:
  dims = shape.split('x')
  return [int(d) for d in dims] if all(d.isdigit() and int(d) > 0 for d in dims) else None


def parse_accelerator(name: str, topology: str | None = None, flag: str = '--accelerator') -> dict:
  """A slice as gcloud's accelerator type ('v6e-16') or the TPU compiler's topology ('v6e:4x4') -> its name,
  generation, chips, hosts, topology, runtime version and gcloud's create flags. `topology`: a custom v4 one (AxBxC)."""
  name = name or ''
  unknown = InputError(f'{flag}={name!r}: unknown TPU accelerator type or topology: must be an accelerator type '
                       f'(e.g. v6e-16) or a topology (e.g. v6e:4x4; generations: {", ".join(TPUS)})')
  if ':' in name:  # the TPU compiler's spelling
    gen, _, shape = name.partition(':')
    if gen not in TPUS or (dims := _dims(shape)) is None:
      raise unknown
    if len(dims) != TPUS[gen].dims:
      raise InputError(f'{flag}={name!r}: a {gen} slice is {TPUS[gen].dims}-D, e.g. '
                       f'{gen}:{"x".join(["2"] * TPUS[gen].dims)}')
    chips = math.prod(dims)
    default = (TOPOLOGY_3D if TPUS[gen].dims == 3 else TOPOLOGY_2D).get(chips)
    if shape != default and gen != 'v4':  # only v4 takes a custom topology
      raise InputError(f'{flag}={name!r}: Cloud TPU has no such {gen} slice' +
                       (f'; {chips} chips are {gen}:{default}' if default else ''))
    name, topology = f'{TPUS[gen].accelerator}-{chips * TPUS[gen].cores_per_chip}', topology or shape
  if not (match := ACCELERATOR_TYPE.fullmatch(name)):
    raise unknown
  prefix, size = match.group(1).replace('v5e', 'v5litepod'), int(match.group(2))
  gen, tpu = next((g, tpu) for g, tpu in TPUS.items() if tpu.accelerator == prefix)
  chips, table = size // tpu.cores_per_chip, (TOPOLOGY_3D if tpu.dims == 3 else TOPOLOGY_2D)
  if size % tpu.cores_per_chip or chips not in table or size > tpu.largest:
    sizes = ', '.join(str(c * tpu.cores_per_chip) for c in table if c * tpu.cores_per_chip <= tpu.largest)
    raise InputError(f'{flag}={name!r}: no such {gen} slice (sizes: {sizes})')
  # 4 chips per host, except the single-host v5e/v6e slices of up to 8 chips.
  hosts = 1 if tpu.dims == 2 and chips <= 8 else max(1, chips // 4)
  accel = {'name': f'{prefix}-{size}', 'generation': gen, 'chips': chips, 'hosts': hosts, 'topology': table[chips],
           'version': tpu.runtime_version, 'create_flags': [f'--accelerator-type={prefix}-{size}']}
  if topology and topology != accel['topology']:
    if gen != 'v4':
      raise InputError(f'--topology={topology!r}: only v4 takes a custom topology; {accel["name"]} is '
                       f'{accel["topology"]}')
    if len(dims := _dims(topology) or []) != 3 or math.prod(dims) != chips:
      raise InputError(f'--topology={topology!r}: must be AxBxC with A*B*C = {chips} chips ({accel["name"]})')
    accel.update(topology=topology, create_flags=['--type=v4', f'--topology={topology}'])
  return accel


def utilisation(flops_per_step: float | None, step_time_s: float, peak_flops: float | None) -> float | None:
  """FLOPs per step / step time / the devices' summed peak FLOP/s; None where either is unknown."""
  return flops_per_step / step_time_s / peak_flops if peak_flops and flops_per_step else None


def device_slug(kind: str) -> str:
  """A device kind as part of a file name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
  return re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_')


def xla_costs(lowered_or_compiled) -> tuple[float, float]:
  """XLA's (FLOPs, bytes accessed), per device; a loop's body counted once; 0 where the backend gives none (a
  lowered program under the CUDA and TPU plug-ins)."""
  cost = lowered_or_compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))


def available_host_bytes() -> int | None:
  """Linux's MemAvailable, or None where it does not say."""
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
  except (OSError, StopIteration, ValueError):
    return None


def peak_memory_bytes(compiled) -> int:
  """XLA's peak, or arguments + outputs + temporaries - donated if larger (the CPU's peak is the arguments only)."""
  m = compiled.memory_analysis()
  buffers = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return int(max(m.peak_memory_in_bytes or 0, buffers))
