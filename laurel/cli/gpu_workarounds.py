"""XLA:GPU flags that a known-slow jaxlib needs, set before JAX starts a backend (laurel.cli.console.quiet_start).
Standard library only: it runs before JAX loads.

jaxlib 0.10.2 to 0.11.0 add float32 scatters on NVIDIA GPUs hundreds of times slower than before (openxla/xla#46225,
jax-ml/jax#38806; fixed in 0.11.1): the token lookup's gradient is one. LLVM's NVPTX option that allows
flush-to-zero atomics gives the fast atomic add back; the `cuda` extra asks for jax 0.11.1 or newer, and this covers
the images and clusters that bring their own jaxlib.
"""

import glob
import importlib.metadata
import importlib.util
import os
import re
import sys

SLOW_SCATTER = ((0, 10, 2), (0, 11, 0))  # the first and the last affected jaxlib
FTZ_ATOMICS = '--xla_backend_extra_options=-nvptx-allow-ftz-atomics'
CUDA_PLUGINS = ('jax_cuda13_plugin', 'jax_cuda12_plugin')


def slow_gpu_scatter(jaxlib_version: str) -> bool:
  """Whether XLA:GPU of this jaxlib (e.g. '0.10.2', '0.11.0.dev20260101') adds float32 scatters slowly."""
  release = re.match(r'(\d+)\.(\d+)\.(\d+)', jaxlib_version)
  return bool(release) and SLOW_SCATTER[0] <= tuple(map(int, release.groups())) <= SLOW_SCATTER[1]


def on_nvidia_gpu() -> bool:
  """Whether JAX will start its CUDA backend: an NVIDIA device file, a CUDA plug-in, JAX_PLATFORMS allowing it."""
  platforms = {p.strip() for p in os.environ.get('JAX_PLATFORMS', '').split(',') if p.strip()}
  if platforms and not platforms & {'cuda', 'gpu'}:
    return False
  return bool(glob.glob('/dev/nvidia[0-9]*')) and any(importlib.util.find_spec(p) for p in CUDA_PLUGINS)


def apply() -> None:
  """Adds FTZ_ATOMICS to XLA_FLAGS on an NVIDIA GPU with an affected jaxlib (unless XLA_FLAGS sets LLVM's options
  already) and says so in one line on stderr. LLVM without NVPTX (the CPU's) would refuse the option."""
  try:
    version = importlib.metadata.version('jaxlib')
  except importlib.metadata.PackageNotFoundError:
    return
  xla_flags = os.environ.get('XLA_FLAGS', '')
  if not slow_gpu_scatter(version) or 'xla_backend_extra_options' in xla_flags or not on_nvidia_gpu():
    return
  os.environ['XLA_FLAGS'] = f'{xla_flags} {FTZ_ATOMICS}'.strip()
  print(f'note: jaxlib {version} adds float32 scatters slowly on GPUs (openxla/xla#46225, fixed in 0.11.1): '
        f'XLA_FLAGS gets {FTZ_ATOMICS}', file=sys.stderr, flush=True)
