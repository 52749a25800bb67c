"""LAuReL: Learned Augmented Residual Layer (arXiv 2411.07501) in JAX/Flax."""
