"""Test-wide JAX settings, set before jax initialises (subprocesses inherit them through tests/helpers.py).

8 host CPU devices so mesh tests run in-process; low XLA optimisation and a persistent compilation cache,
because compiling dominates these tests' time on a 2-core machine (results are compared within one setting).
"""
import os
import tempfile

# XLA:CPU runs each ready collective on a thread of a pool sized max(NPROC or cores, devices), and blocks
# that thread until every participant arrives. A step with several independent all-reduces per device can
# fill an 8-thread pool with half-met rendezvous and deadlock: mesh (2, 1, 4) hung within two runs, 3 times
# out of 3. A larger pool leaves every participant a thread; a real hang then fails in 3 minutes.
os.environ['NPROC'] = str(max(64, int(os.environ.get('NPROC') or 0)))
TEST_XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_collective_call_terminate_timeout_seconds=180 '
                  '--xla_cpu_collective_call_warn_stuck_timeout_seconds=60')
os.environ.setdefault('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), 'laurel_test_jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
