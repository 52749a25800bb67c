"""LAuReL: Learned Augmented Residual Layer (arXiv 2411.07501) in JAX/Flax."""

from laurel import console

console.quiet_start()  # before any module of the package starts a JAX backend
