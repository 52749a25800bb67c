"""CPU seconds XLA:CPU takes to compile the tests' tiny LM's loss gradient, under the XLA_FLAGS given.

  XLA_FLAGS='--xla_backend_optimization_level=0' python scripts/experiments/compile_time.py
  XLA_FLAGS='--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false' \\
      python scripts/experiments/compile_time.py

Why tests/conftest.py turns the fusion emitters off. CPU time of the process (every compiler thread), one compile.
"""
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / 'tests'))
from helpers import SPEC, TINY_LM, load_config  # pylint: disable=wrong-import-position
from laurel import step  # pylint: disable=wrong-import-position


def main():
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_enable_compilation_cache', False)  # tests/conftest.py turns it on
  model = step.validate_config(load_config(SPEC, TINY_LM), num_devices=1).model
  tokens_BxL = jnp.ones((8, 32), jnp.int32)
  params = jax.jit(lambda: model.init(jax.random.key(0), tokens_BxL))()
  loss = lambda p: model.apply(p, tokens_BxL).astype(jnp.float32).mean()
  lowered = jax.jit(jax.grad(loss)).lower(params)
  start = time.process_time()
  lowered.compile()
  print(f'{time.process_time() - start:.2f} CPU-s to compile the gradient')


if __name__ == '__main__':
  main()
