"""The write-once buffer of the designs that keep every layer's output (`Design.buffer`: MUDDFormer's, DCA's), and
the layer stack's backward that keeps no copy of it. J = N + 1 slots; B batch, L length, D width.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

BUFFER_AXES = (None, 'act_batch', 'act_len', 'act_embed')


def start_buffer(x_BxLxD, num_layers):
  """A `Design.buffer` of N + 1 slots, x in slot 0: layer i reads slots 0..i and writes slot i + 1 once."""
  buffer_JxBxLxD = jnp.zeros((num_layers + 1,) + x_BxLxD.shape, x_BxLxD.dtype).at[0].set(x_BxLxD)
  return nn.with_logical_constraint(buffer_JxBxLxD, BUFFER_AXES)


def write_slot(buffer_JxBxLxD, slot_J, y_BxLxD):
  """y written over the slot of the one-hot slot_J (a layer's row of `np.eye(N + 1)[1:]`), in place."""
  return jax.lax.dynamic_update_index_in_dim(buffer_JxBxLxD, y_BxLxD.astype(buffer_JxBxLxD.dtype),
                                             jnp.argmax(slot_J), 0)


def filled_slots(slot_J):
  """1 on the slots written before the layer whose slot is slot_J's, else 0: the backward gives every layer the
  final buffer, so a layer's reads must weigh the slots it has not yet seen 0."""
  return 1 - jnp.cumsum(slot_J)


def stack_rebuilding_buffer(stack, block, cfg, index, mirror, policy, carry, positions_BxL, segment_ids_BxL,
                            layer_xs, shared_G):
  """`stack(carry, ...)`, the scanned layers (each the unbound module `block`), with a backward that keeps the final
  write-once buffer (carry entry `index`; None: none) in place of a scan's N copies, and rebuilds value residual's
  V_1 (written by layer 0) and the entry `mirror` (the buffer's slot i at layer i's input) from it. A layer keeps
  what its vjp under the remat `policy` keeps, less its inputs and outputs (a layer's output is the next's input)."""
  def layer(params_l, carry, chain_l, shared, layer_index):
    return block.apply({'params': params_l}, carry, positions_BxL, segment_ids_BxL, (layer_index, chain_l), shared)[0]

  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
  # the vjp's tree, and where each of its leaves comes from (an index into the layer's input and output leaves,
  # None where kept): the same at every layer
  structure = {}

  def replaced(stream, i, value):
    return stream if i is None else stream[:i] + (value,) + stream[i + 1:]

  def put(carry, buffer, first_values):
    """The carry with the buffer and (with value residual) V_1 in place; None: left out."""
    stream, values = carry
    return replaced(stream, index, buffer), first_values if cfg.value_residual else values

  def put_mirror(carry, value):
    """The carry with `value` as its mirror entry (None: left out)."""
    stream, values = carry
    return replaced(stream, mirror, value), values

  def slot(buffer_JxBxLxD, j):
    """The buffer's slot j, where there is a mirror to restore from it."""
    return None if mirror is None else jax.lax.dynamic_index_in_dim(buffer_JxBxLxD, j, 0, keepdims=False)

  def forward(mdl, carry, layer_xs, shared_G):
    params = mdl.variables['params']

    def one(carry, xs):
      params_l, (layer_index, chain_l) = xs
      inputs = (params_l, carry, chain_l, shared_G)
      out, vjp = jax.vjp(lambda p, c, w, s: layer(p, c, w, s, layer_index), *inputs)
      leaves, structure['tree'] = jax.tree.flatten(vjp)
      found = jax.tree.leaves(inputs) + jax.tree.leaves(put(out, None, None))
      structure['source'] = [next((k for k, a in enumerate(found) if a is leaf), None) for leaf in leaves]
      kept = [leaf for leaf, k in zip(leaves, structure['source']) if k is None]
      return out, (put_mirror(put(carry, None, None), None), kept)
    out, saved = jax.lax.scan(one, carry, (params, layer_xs), unroll=cfg.scan_unroll)
    return out, (params, saved, out, layer_xs, shared_G)

  def backward(residuals, g_out):
    params, saved, final, layer_xs, shared_G = residuals
    final_JxBxLxD = None if index is None else final[0][index]

    def one(grads, xs):
      g_carry, g_shared, next_carry = grads  # next_carry: the layer's output, the next layer's saved input
      params_l, (carry, kept), (layer_index, chain_l) = xs
      first_values = None if final[1] is None else jnp.where(layer_index > 0, final[1], 0)
      carry_in = put_mirror(put(carry, final_JxBxLxD, first_values), slot(final_JxBxLxD, layer_index))
      found = (jax.tree.leaves((params_l, carry_in, chain_l, shared_G))
               + jax.tree.leaves(put_mirror(next_carry, slot(final_JxBxLxD, layer_index + 1))))
      kept = iter(kept)
      vjp = jax.tree.unflatten(structure['tree'], [next(kept) if k is None else found[k] for k in structure['source']])
      g_params, g_carry, g_chain, g_shared_l = vjp(g_carry)
      return (g_carry, jax.tree.map(jnp.add, g_shared, g_shared_l), carry), (g_params, g_chain)
    (g_carry, g_shared, _), (g_params, g_chain) = jax.lax.scan(
        one, (g_out, jax.tree.map(jnp.zeros_like, shared_G), put_mirror(put(final, None, None), None)),
        (params, saved, layer_xs), reverse=True, unroll=cfg.scan_unroll)
    return {'params': g_params}, g_carry, (None, g_chain), g_shared

  run = lambda mdl, carry, layer_xs, shared_G: mdl(carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G)[0]
  return nn.custom_vjp(run, forward, backward)(stack, carry, layer_xs, shared_G)
