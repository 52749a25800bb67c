"""The chunked cross-entropy's cost by the TPU compiler's own schedule estimate, on one v6e chip, compile-only.

  .venv/bin/python scripts/loss_cycles.py                        # the working tree's cross_entropy.py
  .venv/bin/python scripts/loss_cycles.py --rev=0c92939 --rev=   # the form before it, then the tree's
  .venv/bin/python scripts/loss_cycles.py --chunk=128 --chunk=512

Compiles jax.value_and_grad of cross_entropy.chunked (x and the kernel; the accuracy count as an aux output) for one
v6e chip, compile-only, at the paper preset's per-chip shape: 32 sequences of 1024 tokens, D=768, the tied
32768×768 float32 table used in bfloat16, x in bfloat16. Prints the estimated cycles (laurel.plan.schedule) in all and
of one trip of the chunk loop, the peak memory and the most expensive instructions.
"""

import importlib.util
import subprocess
import sys
import tempfile

from absl import app, flags

from laurel.plan import aot

_REV = flags.DEFINE_multi_string('rev', [''], "Git revisions whose laurel/cross_entropy.py to compile ('': the "
                                 'working tree).')
_CHUNK = flags.DEFINE_multi_integer('chunk', [256], 'Positions per chunk (model.loss_chunk).')
_TOP = flags.DEFINE_integer('top', 12, 'Instructions to list.')
BATCH, LENGTH, D, VOCAB = 32, 1024, 768, 32768
FLOPS_PER_CYCLE, BYTES_PER_CYCLE = 369_231, 936  # v6e: the compiler's rate for a large bf16 matmul; HBM


def cross_entropy_at(rev: str):
  """laurel.cross_entropy as of `rev` ('': the working tree)."""
  if not rev:
    from laurel import cross_entropy  # pylint: disable=import-outside-toplevel
    return cross_entropy
  with tempfile.NamedTemporaryFile('w', suffix='.py', delete=False) as f:
    f.write(subprocess.run(['git', 'show', f'{rev}:laurel/cross_entropy.py'], check=True, capture_output=True,
                           text=True).stdout)
  spec = importlib.util.spec_from_file_location(f'cross_entropy_{rev}', f.name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def compiled_loss(cross_entropy, chunk: int, device):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from laurel import train_config  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1, 1), ('data', 'fsdp', 'tensor'))
  batch, whole = (jax.sharding.NamedSharding(mesh, jax.P(*spec)) for spec in ((('data', 'fsdp'),), ()))
  x = jax.ShapeDtypeStruct((BATCH, LENGTH, D), jnp.bfloat16, sharding=batch)
  kernel = jax.ShapeDtypeStruct((VOCAB, D), jnp.float32, sharding=whole)
  targets = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32, sharding=batch)
  weights = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.float32, sharding=batch)
  # The accuracy count as an aux output, as the train step's metrics use it (else it is dead code).
  loss = lambda x, w, t, m: cross_entropy.chunked(x, w, 'vd', t, m, chunk, jnp.bfloat16)
  with jax.set_mesh(mesh), nn.logical_axis_rules(train_config.LOGICAL_AXIS_RULES):
    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)).lower(x, kernel, targets, weights).compile()


def main(_):
  aot.compile_only_process()
  from laurel.plan import schedule  # pylint: disable=import-outside-toplevel
  device = aot.slice_devices('v6e:1x1')[0]
  for rev in _REV.value:
    cross_entropy = cross_entropy_at(rev)
    for chunk in _CHUNK.value:
      compiled = compiled_loss(cross_entropy, chunk, device)
      text = compiled.as_text()
      est = schedule.estimate(text, FLOPS_PER_CYCLE, BYTES_PER_CYCLE)
      chunks = -(-LENGTH // chunk)
      peak = compiled.memory_analysis().peak_memory_in_bytes
      ops, _ = schedule.executed_ops(text)
      per_chunk = sum(o.cycles for o in ops if o.cycles and o.trips == chunks)
      print(f'{rev or "working tree"} chunk={chunk}: {est.cycles / 1e6:.2f} M cycles, {per_chunk / 1e6:.2f} M a '
            f'chunk ({chunks} chunks), peak memory {peak / 2**20:.0f} MiB, groups '
            + ', '.join(f'{g} {c / 1e6:.2f} M' for g, c in est.groups.items() if c >= 5e3))
      for op in sorted((o for o in ops if o.cycles), key=lambda o: -o.cycles * o.trips)[:_TOP.value]:
        print(f'  {op.cycles * op.trips / 1e6:6.2f} M  {op.trips}× {op.opcode:12s} {op.name:28s} {op.op_name[-90:]}')
      sys.stdout.flush()


if __name__ == '__main__':
  app.run(main)
