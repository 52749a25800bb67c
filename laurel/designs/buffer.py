"""The write-once buffer of the designs that keep every layer's output (`Design.buffer`: MUDDFormer's, DCA's), and
the layer scan's backward that keeps no copy of it. J = N + 1 slots; B batch, L length, D width.
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
  """y written to the buffer's slot of the one-hot slot_J (a layer's row of `np.eye(N + 1)[1:]`, from its chain)."""
  return buffer_JxBxLxD + slot_J.astype(y_BxLxD.dtype)[:, None, None, None] * y_BxLxD


def stack_rebuilding_buffer(stack, block, cfg, index, policy, carry, positions_BxL, segment_ids_BxL, layer_xs,
                            shared_G):
  """`stack(carry, ...)`, the scanned layers (each the unbound module `block`), with a backward that keeps no copy of
  the carry's write-once buffer (entry `index`; None: none): layer i's is the final one with slots > i zeroed. A
  scan's own backward saves N copies of N + 1 slots; this one the final buffer and each layer's carry without it, and
  rebuilds value residual's V_1 (written by layer 0) too. A layer's forward keeps what its vjp under the remat
  `policy` keeps, less its own inputs (the backward has them), so it recomputes only what the policy does not save."""
  def layer(params_l, carry, chain_l, shared, layer_index):
    return block.apply({'params': params_l}, carry, positions_BxL, segment_ids_BxL, (layer_index, chain_l), shared)[0]

  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
  structure = {}  # the vjp's tree and which of its leaves are the layer's inputs: the same at every layer

  def put(carry, buffer, first_values):
    """The carry with the buffer and (with value residual) V_1 in place; None: left out."""
    stream, values = carry
    if index is not None:
      stream = stream[:index] + (buffer,) + stream[index + 1:]
    return stream, first_values if cfg.value_residual else values

  def forward(mdl, carry, layer_xs, shared_G):
    params = mdl.variables['params']

    def one(carry, xs):
      params_l, (layer_index, chain_l) = xs
      inputs = (params_l, carry, chain_l, shared_G)
      out, vjp = jax.vjp(lambda p, c, w, s: layer(p, c, w, s, layer_index), *inputs)
      leaves, structure['tree'] = jax.tree.flatten(vjp)
      input_leaves = jax.tree.leaves(inputs)
      # A residual that is one of the layer's inputs (the buffer, the parameters) is not kept: the backward has it.
      structure['input'] = [next((k for k, a in enumerate(input_leaves) if a is leaf), None) for leaf in leaves]
      return out, (put(carry, None, None), [leaf for leaf, k in zip(leaves, structure['input']) if k is None])
    out, saved = jax.lax.scan(one, carry, (params, layer_xs), unroll=cfg.scan_unroll)
    return out, (params, saved, None if index is None else out[0][index], out[1], layer_xs, shared_G)

  def backward(residuals, g_out):
    params, saved, final_JxBxLxD, final_values, layer_xs, shared_G = residuals

    def one(grads, xs):
      g_carry, g_shared = grads
      params_l, (carry, kept), (layer_index, chain_l) = xs
      buffer = None if index is None else jnp.where(
          (jnp.arange(final_JxBxLxD.shape[0]) <= layer_index)[:, None, None, None], final_JxBxLxD, 0)
      first_values = None if final_values is None else jnp.where(layer_index > 0, final_values, 0)
      input_leaves = jax.tree.leaves((params_l, put(carry, buffer, first_values), chain_l, shared_G))
      kept = iter(kept)
      vjp = jax.tree.unflatten(structure['tree'], [next(kept) if k is None else input_leaves[k]
                                                   for k in structure['input']])
      g_params, g_carry, g_chain, g_shared_l = vjp(g_carry)
      return (g_carry, jax.tree.map(jnp.add, g_shared, g_shared_l)), (g_params, g_chain)
    (g_carry, g_shared), (g_params, g_chain) = jax.lax.scan(
        one, (g_out, jax.tree.map(jnp.zeros_like, shared_G)), (params, saved, layer_xs), reverse=True,
        unroll=cfg.scan_unroll)
    return {'params': g_params}, g_carry, (None, g_chain), g_shared

  run = lambda mdl, carry, layer_xs, shared_G: mdl(carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G)[0]
  return nn.custom_vjp(run, forward, backward)(stack, carry, layer_xs, shared_G)
