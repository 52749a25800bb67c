"""Every test sees 8 host CPU devices, so mesh tests run in-process; set before jax initialises."""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
