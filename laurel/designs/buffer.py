"""The write-once buffer of the designs that read every earlier layer's output (MUDDFormer, DCA)."""

import flax.linen as nn
import jax.numpy as jnp

from laurel.designs import STREAM_ACT


def start_buffer(x_BxLxD, num_layers):
  """A `Design.buffer` of N + 1 slots, x in slot 0: layer i reads slots 0..i and writes slot i + 1 once."""
  buffer_JxBxLxD = jnp.zeros((num_layers + 1,) + x_BxLxD.shape, x_BxLxD.dtype).at[0].set(x_BxLxD)
  return nn.with_logical_constraint(buffer_JxBxLxD, STREAM_ACT)


def write_slot(buffer_JxBxLxD, slot_J, y_BxLxD):
  """y written to the buffer's slot of the one-hot slot_J (a layer's row of `np.eye(N + 1)[1:]`, from its chain)."""
  return buffer_JxBxLxD + slot_J.astype(y_BxLxD.dtype)[:, None, None, None] * y_BxLxD
