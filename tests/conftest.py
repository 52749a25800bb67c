"""Test-wide JAX settings, set before jax initialises (subprocesses inherit them through tests/helpers.py).

8 host CPU devices so mesh tests run in-process; low XLA optimisation and a persistent compilation cache,
because compiling dominates these tests' time on a 2-core machine (results are compared within one setting);
long collective timeouts, because 8 simulated devices on 2 shared cores can be slow to meet.
"""
import os
import tempfile

# XLA aborts the process when one simulated device reaches a collective 40 s after the others; 8 devices
# sharing 2 busy cores (the other pytest worker compiling) can take that long, so allow 10 minutes.
TEST_XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_collective_call_terminate_timeout_seconds=600 '
                  '--xla_cpu_collective_call_warn_stuck_timeout_seconds=300')
os.environ.setdefault('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), 'laurel_test_jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
