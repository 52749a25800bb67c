"""DCA, DeepCrossAttention (Heddes et al., arXiv 2502.06785; its paper text was not read here: the equations follow
the unofficial reference code lucidrains/deep-cross-attention, `deep_cross_attention/dca_gpt.py`, `GRN` and
`DCABlock`).

  y_0 the embedding, y_{j+1} = layer j's output attn_j + mlp_j (its increment, so Σ_{j ≤ i} y_j = x_i, the stream)
  layer i, for c ∈ {Q, K, V} (a GRN per input, its weights per dimension and per token):
    u^c_i = Σ_{j ≤ i} (b^c_{i,j} + ReLU(w^c_iᵀ RMSNorm(y_j))) ⊙ y_j       b^c_{i,j}, w^c_i ∈ R^D
    h = x_i + Attn(norm(u^Q), norm_k(u^K), norm_v(u^V)),  x_{i+1} = h + MLP(norm(h))
The residual is the plain stream x_i (the reference code takes u^Q; the plain sum keeps the path that bypasses
attention the ordinary one) and the read-out is x_N (the code adds a final GRN). The GRN's RMSNorm scale is folded
into w (the same function). Every earlier layer is a source: the code's `past_layers_k` (the first and last k
layers only) is not here. Init b = 1, w = 0: u^c = x_i for every c, the plain model up to the rounding of the sum
(tested).

Push form: the weight of source j at receiver i depends on y_j and on i's parameters only, so layer l adds its
input increment y_l into running sums U^c of every receiver l, …, N − 1 (a queue, shifted after each read, as
DenseFormer's), the chain handing each layer b and w rotated to its offsets. The update is linear in U: a layer
scan's backward keeps y_l and the 3·N gates per token, never the history. The carry is (x, y pending, U_3xNxBxLxD).
`padded_params` counts the unused half of b (sources after the receiver).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from laurel.designs import ACT, F32, STREAM_ACT, Chain, Design, Site, register

EPS = 1e-6
SAVED = 'dca_inputs'  # the attention's q, k, v inputs, which every remat policy keeps (Design.saved_names)
STREAMS = 3  # Q, K, V
SUMS_ACT = (None,) + STREAM_ACT  # U: (stream, receiver offset, B, L, D)


class DCAChain(Chain):
  """(b_NxCxRxD, w_NxCxRxD): what layer l's input increment y_l gets at receiver l + r, b^c_{l+r,l} and w^c_{l+r},
  from `dca_bias` (receiver i, source j, c, D; used where j ≤ i) and `dca_query` (i, c,
  D)."""

  @nn.compact
  def __call__(self):
    big_n, d = self.num_layers, self.features
    make = lambda name, init, shape, names: self.param(name, nn.with_logical_partitioning(init, names), shape,
                                                       self.param_dtype).astype(F32)
    bias = make('dca_bias', nn.initializers.ones, (big_n, big_n, STREAMS, d),
                ('layers', 'dca_sources', 'dca_streams', self.embed_axis))
    query = make('dca_query', nn.initializers.zeros, (big_n, STREAMS, d), ('layers', 'dca_streams', self.embed_axis))
    # Offsets past the last layer (clamped to it) fill queue slots that are shifted out unread.
    receiver_NxR = np.minimum(np.arange(big_n)[:, None] + np.arange(big_n), big_n - 1)
    b_NxRxCxD = bias[receiver_NxR, np.arange(big_n)[:, None]]
    return b_NxRxCxD.swapaxes(1, 2), query[receiver_NxR].swapaxes(1, 2)


class DCASite(Site):
  """Site 0 (attention) pushes the pending increment y_l into the sums of receivers l, …, reads its own (U[:, 0]) as
  the attention's q, k, v inputs, and shifts the queue; site 1 (MLP) is a plain residual. The pending increment
  collects attn + mlp for the next layer."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    x_BxLxD, y_BxLxD, u_CxRxBxLxD = carry
    if self.t == 0:
      b_CxRxD, w_CxRxD = chain_l
      y = y_BxLxD.astype(F32)
      unit_BxLxD = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + EPS)
      gate_CxRxBxL = jax.nn.relu(jnp.einsum('bld,crd->crbl', unit_BxLxD, w_CxRxD)).astype(y_BxLxD.dtype)
      # Two products, not (b + gate)·y: their backward keeps y and the gates, not a (3, N)-stack of weights.
      u_CxRxBxLxD = (u_CxRxBxLxD + b_CxRxD[:, :, None, None, :].astype(y_BxLxD.dtype) * y_BxLxD
                     + gate_CxRxBxL[..., None] * y_BxLxD)
      inputs_CxBxLxD = checkpoint_name(u_CxRxBxLxD[:, 0], SAVED)
      f_BxLxD = fn(x_BxLxD, self.attention_inputs(norm_in, *inputs_CxBxLxD), None)
      y_BxLxD = f_BxLxD  # the next increment starts
      u_CxRxBxLxD = jnp.pad(u_CxRxBxLxD[:, 1:], ((0, 0), (0, 1)) + ((0, 0),) * 3)
    else:
      f_BxLxD = fn(x_BxLxD, norm_in(x_BxLxD), None)
      y_BxLxD = y_BxLxD + f_BxLxD
    x_BxLxD = x_BxLxD + f_BxLxD
    return (nn.with_logical_constraint(x_BxLxD, ACT), nn.with_logical_constraint(y_BxLxD, ACT),
            nn.with_logical_constraint(u_CxRxBxLxD, SUMS_ACT))


def _start(spec, x_BxLxD, num_layers):
  """x_0, pending as layer 0's input increment y_0 = x_0, empty sums."""
  return x_BxLxD, x_BxLxD, jnp.zeros((STREAMS, num_layers) + x_BxLxD.shape, x_BxLxD.dtype)


def padded_params(spec, num_layers, d_model):
  return STREAMS * d_model * num_layers * (num_layers - 1) // 2  # b^c_{i,j} for j > i


register(Design('dca', DCASite, chain=DCAChain, start=_start, finish=lambda spec, carry: carry[0],
                no_decay=('dca_bias', 'dca_query'), padded_params=padded_params, saved_names=(SAVED,),
                logical_axes=(('dca_sources', None), ('dca_streams', None))))
