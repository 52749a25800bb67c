"""The layer scan's backward of the designs that widen the stream (`Design.replay`: HC's and mHC's n streams). A
scan's own backward keeps every layer's carry, n D-wide; this one keeps what each layer adds to it instead (its sites'
f outputs and per-token mixing weights, about one D-wide tensor a site, which the sites sow into `RECORD`) and the
carry every `segment` layers, and rebuilds a layer's carry by replaying only the cheap stream mixing from there.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

RECORD = 'stream_replay'  # the collection a site sows its replay record into (only when it is mutable)


def segment_length(num_layers: int) -> int:
  """Layers between kept carries: the largest divisor of N up to N/2 (two segments: one carry kept besides the
  input's, and at most N/2 − 1 layers replayed to rebuild one)."""
  return max(k for k in range(1, max(1, num_layers // 2) + 1) if num_layers % k == 0)


class ResidualsBesideInputs:
  """A layer's vjp kept without the residuals that are its own inputs (the stream, the parameters: the backward has
  them); its tree, and which leaves are inputs, are the same at every layer of a scan."""

  def keep(self, vjp, inputs) -> list:
    leaves, self.tree = jax.tree.flatten(vjp)
    input_leaves = jax.tree.leaves(inputs)
    self.input = [next((k for k, a in enumerate(input_leaves) if a is leaf), None) for leaf in leaves]
    return [leaf for leaf, k in zip(leaves, self.input) if k is None]

  def vjp(self, kept, inputs):
    kept, input_leaves = iter(kept), jax.tree.leaves(inputs)
    return jax.tree.unflatten(self.tree, [next(kept) if k is None else input_leaves[k] for k in self.input])


def layer_backward(vjp, grads):
  """((the carry's cotangent, the shared kernels' summed), (the layer's parameters', its chain's)) after a layer."""
  g_carry, g_shared = grads
  g_params, g_carry, g_chain, g_shared_l = vjp(g_carry)
  return (g_carry, jax.tree.map(jnp.add, g_shared, g_shared_l)), (g_params, g_chain)


def reverse_layers(one, g_out, shared_G, xs, unroll):
  """The layers' backward, a reverse scan of `one` (`layer_backward` of a layer) over `xs` -> the cotangents of a
  scanned stack's custom VJP: (its parameters', the carry's, the layer inputs', the shared kernels')."""
  (g_carry, g_shared), (g_params, g_chain) = jax.lax.scan(
      one, (g_out, jax.tree.map(jnp.zeros_like, shared_G)), xs, reverse=True, unroll=unroll)
  return {'params': g_params}, g_carry, (None, g_chain), g_shared


def stack_replaying_streams(stack, block, cfg, replay, policy, carry, positions_BxL, segment_ids_BxL, layer_xs,
                            shared_G):
  """`stack(carry, ...)`, the scanned layers (each the unbound module `block`), with a backward that keeps no
  stream per layer: layer l's is rebuilt by `replay(stream, record)` from the segment's first, through the records
  of the layers before l. A layer's forward keeps what its vjp under the remat `policy` keeps, less its own inputs
  (the backward has them), so it recomputes only what the policy does not save. Value residual's V_1 (written by
  layer 0) is rebuilt from the final one."""
  num_layers = cfg.num_layers
  every = segment_length(num_layers)

  def layer(params_l, carry, chain_l, shared, layer_index):
    (out, _), mutated = block.apply({'params': params_l}, carry, positions_BxL, segment_ids_BxL,
                                    (layer_index, chain_l), shared, mutable=[RECORD])
    return out, mutated[RECORD]

  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
  residuals = ResidualsBesideInputs()

  def forward(mdl, carry, layer_xs, shared_G):
    params = mdl.variables['params']

    def one(state, xs):
      carry, starts = state
      params_l, (layer_index, chain_l) = xs
      # A segment's first layer keeps its stream (in place: one slot per segment, not a copy per layer).
      slot = layer_index // every
      starts = starts.at[slot].set(jnp.where(layer_index % every == 0, carry[0], starts[slot]))
      inputs = (params_l, carry, chain_l, shared_G)
      out, vjp, record = jax.vjp(lambda p, c, w, s: layer(p, c, w, s, layer_index), *inputs, has_aux=True)
      return (out, starts), (residuals.keep(vjp, inputs), record)
    starts = jnp.zeros((num_layers // every,) + carry[0].shape, carry[0].dtype)
    (out, starts), (saved, records) = jax.lax.scan(one, (carry, starts), (params, layer_xs), unroll=cfg.scan_unroll)
    return out, (params, starts, saved, records, carry[1], out[1], layer_xs, shared_G)

  def backward(kept, g_out):
    params, starts, saved, records, first_values, final_values, layer_xs, shared_G = kept
    at = lambda j: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), records)

    def one(grads, xs):
      params_l, saved, (layer_index, chain_l) = xs
      first = layer_index - layer_index % every
      stream = jax.lax.fori_loop(first, layer_index, lambda j, h: replay(h, at(j)), starts[layer_index // every])
      values = None if final_values is None else jnp.where(layer_index > 0, final_values, first_values)
      return layer_backward(residuals.vjp(saved, (params_l, (stream, values), chain_l, shared_G)), grads)
    return reverse_layers(one, g_out, shared_G, (params, saved, layer_xs), cfg.scan_unroll)

  run = lambda mdl, carry, layer_xs, shared_G: mdl(carry, positions_BxL, segment_ids_BxL, layer_xs, shared_G)[0]
  return nn.custom_vjp(run, forward, backward)(stack, carry, layer_xs, shared_G)
