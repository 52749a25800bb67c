"""The one table of accelerator facts, and what XLA's compiler says a program costs on one.

  TPUS[generation]       a Cloud TPU generation's chip (peak FLOP/s, HBM, bandwidth) and slices (cores, runtime)
  PEAK_FLOPS[kind]       dense bf16 peak FLOP/s per device of a jax device kind, for MFU (absent: e.g. CPU)
  utilisation(...)       MFU or HFU: FLOPs per step over the step time and the devices' summed peak
  xla_costs(compiled)    XLA's (FLOPs, bytes accessed) of a lowered or compiled computation
  peak_memory_bytes(c)   peak bytes of a compiled computation
  available_host_bytes() the memory this host can still give

Standard library only: the launcher (scripts/launch_tpu.py, laurel.tpu_slices) reads it without loading jax.
"""

import dataclasses
import re

SOURCE = ('per-chip dense bf16 peak FLOP/s, HBM capacity and bandwidth: the Cloud TPU system-architecture pages, '
          'cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e')


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

  @property
  def device_kind(self) -> str:
    return self.device_kinds[0]


TPUS = {'v4': TPU(('TPU v4',), 275e12, 32 * 2**30, 1200e9, 3, 2, 'v4', 'tpu-ubuntu2204-base', 4096),
        'v5e': TPU(('TPU v5 lite', 'TPU v5e'), 197e12, 16e9, 819e9, 2, 1, 'v5litepod', 'v2-alpha-tpuv5-lite', 256),
        'v5p': TPU(('TPU v5', 'TPU v5p'), 459e12, 95e9, 2765e9, 3, 2, 'v5p', 'v2-alpha-tpuv5', 4096),
        'v6e': TPU(('TPU v6 lite', 'TPU v6e'), 918e12, 32e9, 1638e9, 2, 1, 'v6e', 'v2-alpha-tpuv6e', 256)}
# Dense bf16 peak FLOP/s per device of the other accelerators this code reports MFU on (NVIDIA's datasheets; the H100
# SXM and the H200 share one, 1,979 being the figure with 2:4 sparsity; the A100's is 312).
_OTHER_PEAK_FLOPS = {'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H200': 989e12, 'NVIDIA A100-SXM4-80GB': 312e12,
                     'NVIDIA A100-SXM4-40GB': 312e12}
PEAK_FLOPS = {**{kind: tpu.peak_flops for tpu in TPUS.values() for kind in tpu.device_kinds}, **_OTHER_PEAK_FLOPS}


def utilisation(flops_per_step: float | None, step_time_s: float, peak_flops: float | None) -> float | None:
  """FLOPs per step over the step time and the devices' summed peak FLOP/s (None where either is unknown)."""
  return flops_per_step / step_time_s / peak_flops if peak_flops and flops_per_step else None


def device_slug(kind: str) -> str:
  """A device kind as part of a file name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
  return re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_')


def xla_costs(lowered_or_compiled) -> tuple[float, float]:
  """XLA's (FLOPs, bytes accessed) of a lowered or compiled computation (per device; a loop's body counted once)."""
  cost = lowered_or_compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))


def xla_flops(lowered_or_compiled) -> float:
  return xla_costs(lowered_or_compiled)[0]


def available_host_bytes() -> int | None:
  """The memory this host can still give a process (Linux's MemAvailable), or None where it does not say."""
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
  except (OSError, StopIteration, ValueError):
    return None


def peak_memory_bytes(compiled) -> int:
  """Peak bytes of a compiled computation. XLA's CPU backend reports only the arguments as its peak, so take
  the larger of that and arguments + outputs + temporaries - aliased (donated) buffers."""
  m = compiled.memory_analysis()
  buffers = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return int(max(getattr(m, 'peak_memory_in_bytes', 0) or 0, buffers))
