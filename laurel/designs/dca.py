"""DCA, DeepCrossAttention (Heddes et al., arXiv 2502.06785, ICML 2025): GRN-v3 (§3.1), the DCA block (§3.2,
Fig. 4) and the read-out y = GRN(G_{N+1}) (§4.1; the "Outputs" GRN of App. H, Fig. 10).

  y_0 the embedding, y_{i+1} = layer i's block output a_i + m_i (its skip is not added, §3.2)
  GRN-v3 of receiver i over the stack G_i = [y_0, …, y_i], per token and per dimension:
    GRN(G_i) = Σ_{j ≤ i} ReLU(b_{i,j} + w_iᵀ y_j) ⊙ y_j                     b_{i,j}, w_i ∈ R^D
  layer i, a GRN for each of Q, K, V:
    a_i = Attn(norm(u^Q), norm_k(u^K), norm_v(u^V)),  h = u^Q + a_i,  m_i = MLP(norm(h))
  read-out (before the final norm): a GRN of receiver N over y_0, …, y_N
Init b = 1, w = 0 (the retrofitting paragraph: "identical to a standard residual network at initialization"): every
GRN is Σ y_j = x_i, the plain model up to the rounding of that sum (tested).

Two readings are taken where the text is loose. The ReLU: App. A writes the weight as b + ReLU(wᵀy), but with w = 0
at init ReLU'(0) = 0 gives w no gradient, ever; App. H's biases "filtered out as a result of the ReLU" are
ReLU(b + wᵀy), the form here, in which w trains. No norm before wᵀ (the text has none; lucidrains'
deep-cross-attention normalises).

`dca`: every earlier layer its own column, the paper's "DCA" (Tables 1, 5, 7). `dca_k`: its k-DCA (§3.1, §5;
Tables 3 and 6 use 8-DCA): the stack is [y_0, Σ_{1 ≤ j ≤ i−k} y_j, y_{i−k+1}, …, y_i], the intermediate layers
summed into one column (its own b and gate), at most k + 2 columns.

Push form: the weight of source j at receiver i depends on y_j and on i's parameters only, so layer l adds its
input y_l into running sums U^c of every receiver l, …, N (the read-out N in stream Q's slot), a queue shifted after
each read, the chain handing each layer b and w rotated to its offsets; the last layer's MLP site adds y_N, which
only the read-out reads. U enters linearly: a layer's backward keeps y_l, the read sums and the 3·(N + 1) gates a
token (`gated`), never the history. The carry is (h, y pending, U_(N+1)x3xBxLxD).
`padded_params` counts the stored weights no receiver reads (sources after the receiver; the read-out's K and V).

k-DCA in pull form over a buffer of every block output, as MUDDFormer's: slot i + 1 is written once, by layer i
(`Design.buffer`), so the scanned stack's backward rebuilds each layer's buffer from the final one instead of
keeping a window of k outputs per layer (laurel.lm; it recomputes each layer, as remat 'full'). Each layer reads its
k + 2 columns as fixed sums of slots. The read-out's GRN is a module of its own, called after the last layer.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from laurel.designs import ACT, F32, STREAM_ACT, Chain, Design, Site, register

SAVED = 'dca_inputs'  # the attention's q, k, v inputs, which every remat policy keeps (Design.saved_names)
STREAMS = 3  # Q, K, V
SUMS_ACT = (None,) + STREAM_ACT  # U: (receiver offset, stream, B, L, D)


@jax.custom_vjp
def gated(b_RxCxD, gate_RxCxBxL, y_BxLxD):
  """ReLU(b + gate) ⊙ y, (R, C, B, L, D). Its backward keeps b, the gates and y and rebuilds the ReLU's mask from
  them (autodiff would keep the mask where remat does not recompute the layer, R·C D-wide a token), one receiver at
  a time: whole, the mask and the weights are (R, C)-stacks the compiler materialises beside U."""
  return jax.nn.relu(b_RxCxD[:, :, None, None, :] + gate_RxCxBxL[..., None]).astype(y_BxLxD.dtype) * y_BxLxD


def _gated_fwd(b_RxCxD, gate_RxCxBxL, y_BxLxD):
  return gated(b_RxCxD, gate_RxCxBxL, y_BxLxD), (b_RxCxD, gate_RxCxBxL, y_BxLxD)


def _gated_bwd(saved, g_RxCxBxLxD):
  b_RxCxD, gate_RxCxBxL, y_BxLxD = saved

  def receiver(g_y, xs):
    b_CxD, gate_CxBxL, g_CxBxLxD = xs
    z = b_CxD[:, None, None, :] + gate_CxBxL[..., None]
    g_y = g_y + jnp.sum(g_CxBxLxD * jax.nn.relu(z).astype(g_CxBxLxD.dtype), axis=0, dtype=F32)
    g_z = jnp.where(z > 0, g_CxBxLxD * y_BxLxD, 0).astype(F32)
    return g_y, (g_z.sum((1, 2)), g_z.sum(-1))
  g_y, (g_b, g_gate) = jax.lax.scan(receiver, jnp.zeros(y_BxLxD.shape, F32), (b_RxCxD, gate_RxCxBxL, g_RxCxBxLxD))
  return g_b.astype(b_RxCxD.dtype), g_gate.astype(gate_RxCxBxL.dtype), g_y.astype(y_BxLxD.dtype)


gated.defvjp(_gated_fwd, _gated_bwd)


def grn_term(b, w, y):
  """ReLU(b + wᵀy) ⊙ y for each (receiver, stream) of b, w (R, C, D) and y (B, L, D)."""
  return gated(b, jnp.einsum('bld,rcd->rcbl', y.astype(F32), w), y)


def grn_sum(b_CxKxD, w_CxD, g_KxBxLxD):
  """Σ_k ReLU(b_k + wᵀg_k) ⊙ g_k for each stream c: (C, B, L, D)."""
  gate_CxKxBxL = jnp.einsum('kbld,cd->ckbl', g_KxBxLxD.astype(F32), w_CxD)
  weight_CxKxBxLxD = jax.nn.relu(b_CxKxD[:, :, None, None, :] + gate_CxKxBxL[..., None]).astype(g_KxBxLxD.dtype)
  return jnp.einsum('ckbld,kbld->cbld', weight_CxKxBxLxD, g_KxBxLxD)


class DCAChain(Chain):
  """(b_NxRxCxD, w_NxRxCxD, b_last_NxD, w_last_NxD): what layer l's input y_l gets at receiver l + r (receivers past
  N clamped to it, in queue slots shifted out unread), b^c_{l+r,l} and w^c_{l+r}, and the read-out's weights of y_N,
  zero except at the last layer; from `dca_bias` (receiver i, source j, c, D; used where j ≤ i) and `dca_query`
  (i, c, D), receiver N the read-out."""

  @nn.compact
  def __call__(self):
    big_n, d = self.num_layers, self.features
    make = lambda name, init, shape, names: self.param(name, nn.with_logical_partitioning(init, names), shape,
                                                       self.param_dtype).astype(F32)
    bias = make('dca_bias', nn.initializers.ones, (big_n + 1, big_n + 1, STREAMS, d),
                ('layers_dca', 'dca_sources', 'dca_streams', self.embed_axis))
    query = make('dca_query', nn.initializers.zeros, (big_n + 1, STREAMS, d),
                 ('layers_dca', 'dca_streams', self.embed_axis))
    receiver_NxR = np.minimum(np.arange(big_n)[:, None] + np.arange(big_n + 1), big_n)
    b_NxRxCxD = bias[receiver_NxR, np.arange(big_n)[:, None]]
    last_N1 = jnp.asarray(np.arange(big_n) == big_n - 1, F32)[:, None]
    return b_NxRxCxD, query[receiver_NxR], last_N1 * bias[big_n, big_n, 0], last_N1 * query[big_n, 0]


class DCASite(Site):
  """Site 0 (attention) pushes the pending y_l into the sums of receivers l, …, reads its own (U[0]) as the
  attention's q, k, v inputs, and shifts the queue; site 1 (MLP) is a residual around h. The pending y collects
  a + m for the next layer; the last layer's goes to the read-out here."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    h_BxLxD, y_BxLxD, u_RxCxBxLxD = carry
    b_RxCxD, w_RxCxD, b_last_D, w_last_D = chain_l
    if self.t == 0:
      u_RxCxBxLxD = u_RxCxBxLxD + grn_term(b_RxCxD, w_RxCxD, y_BxLxD)
      h_BxLxD, y_BxLxD = _attention_site(self, u_RxCxBxLxD[0], fn, norm_in)
      u_RxCxBxLxD = jnp.pad(u_RxCxBxLxD[1:], ((0, 1),) + ((0, 0),) * 4)
    else:
      f_BxLxD = fn(h_BxLxD, norm_in(h_BxLxD), None)
      h_BxLxD, y_BxLxD = h_BxLxD + f_BxLxD, y_BxLxD + f_BxLxD
      u_RxCxBxLxD = u_RxCxBxLxD.at[0, 0].add(grn_term(b_last_D[None, None], w_last_D[None, None], y_BxLxD)[0, 0])
    return (nn.with_logical_constraint(h_BxLxD, ACT), nn.with_logical_constraint(y_BxLxD, ACT),
            nn.with_logical_constraint(u_RxCxBxLxD, SUMS_ACT))


def _attention_site(site, u_CxBxLxD, fn, norm_in):
  """(h, a): the attention on the GRNs' inputs and the FFN's skip h = u^Q + a."""
  q_BxLxD, k_BxLxD, v_BxLxD = checkpoint_name(u_CxBxLxD, SAVED)
  a_BxLxD = fn(q_BxLxD, site.attention_inputs(norm_in, q_BxLxD, k_BxLxD, v_BxLxD), None)
  return q_BxLxD + a_BxLxD, a_BxLxD


def stack_selection(k, receiver, slots):
  """(k + 2, slots): receiver i's columns as sums of buffer slots, y_0, Σ_{1≤j≤i−k} y_j, y_i, …, y_{i−k+1} (a y_j
  with j < 1 an empty column)."""
  select = np.zeros((k + 2, slots), np.float32)
  select[0, 0] = 1.0
  select[1, 1:max(receiver - k + 1, 1)] = 1.0
  for r in range(min(k, receiver)):
    select[2 + r, receiver - r] = 1.0
  return select


def _columns(select_KxJ, buffer_JxBxLxD):
  out = jnp.einsum('kj,jbld->kbld', select_KxJ.astype(buffer_JxBxLxD.dtype), buffer_JxBxLxD,
                   preferred_element_type=F32)
  return out.astype(buffer_JxBxLxD.dtype)


class LastKChain(Chain):
  """(b_NxCxKxD, w_NxCxD, select_NxKxJ, slot_NxJ): receiver i's weights of its k + 2 columns, `dca_bias` and
  `dca_query`; which buffer slots make each column (`stack_selection`); the slot its output takes (i + 1)."""

  @nn.compact
  def __call__(self):
    big_n, d, k = self.num_layers, self.features, self.spec.dca_k
    bias = self.param('dca_bias', nn.with_logical_partitioning(nn.initializers.ones,
                                                               ('layers', 'dca_streams', 'dca_sources', self.embed_axis)),
                      (big_n, STREAMS, k + 2, d), self.param_dtype)
    query = self.param('dca_query', nn.with_logical_partitioning(nn.initializers.zeros,
                                                                 ('layers', 'dca_streams', self.embed_axis)),
                       (big_n, STREAMS, d), self.param_dtype)
    select = np.stack([stack_selection(k, i, big_n + 1) for i in range(big_n)])
    return bias.astype(F32), query.astype(F32), jnp.asarray(select), jnp.asarray(np.eye(big_n + 1)[1:], F32)


class LastKSite(Site):
  """k-DCA, pull form over a buffer of every block output. Site 0 reads its k + 2 columns from the buffer, its GRNs
  over them, and runs the attention; site 1 (MLP) is a residual around h, and writes y_{i+1} = a + m to its slot."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    h_BxLxD, y_BxLxD, buffer_JxBxLxD = carry
    b_CxKxD, w_CxD, select_KxJ, slot_J = chain_l
    if self.t == 0:
      u_CxBxLxD = grn_sum(b_CxKxD, w_CxD, _columns(select_KxJ, buffer_JxBxLxD))
      h_BxLxD, y_BxLxD = _attention_site(self, u_CxBxLxD, fn, norm_in)
    else:
      f_BxLxD = fn(h_BxLxD, norm_in(h_BxLxD), None)
      h_BxLxD, y_BxLxD = h_BxLxD + f_BxLxD, y_BxLxD + f_BxLxD
      buffer_JxBxLxD = buffer_JxBxLxD + slot_J.astype(y_BxLxD.dtype)[:, None, None, None] * y_BxLxD
    return (nn.with_logical_constraint(h_BxLxD, ACT), nn.with_logical_constraint(y_BxLxD, ACT),
            nn.with_logical_constraint(buffer_JxBxLxD, STREAM_ACT))


class LastKReadout(nn.Module):
  """The read-out GRN of k-DCA over y_0, the merged column and the last k of y_1, …, y_N."""
  features: int
  columns: int
  param_dtype: Any = F32

  @nn.compact
  def __call__(self, g_KxBxLxD):
    make = lambda name, init, shape, names: self.param(name, nn.with_logical_partitioning(init, names), shape,
                                                       self.param_dtype).astype(F32)
    bias = make('dca_bias', nn.initializers.ones, (1, self.columns, self.features), (None, 'dca_sources', 'embed'))
    query = make('dca_query', nn.initializers.zeros, (1, self.features), (None, 'embed'))
    return grn_sum(bias, query, g_KxBxLxD)[0]


def _finish_last_k(spec, carry):
  buffer_JxBxLxD = carry[2]
  slots = buffer_JxBxLxD.shape[0]
  g_KxBxLxD = _columns(jnp.asarray(stack_selection(spec.dca_k, slots - 1, slots)), buffer_JxBxLxD)
  return LastKReadout(buffer_JxBxLxD.shape[-1], spec.dca_k + 2, name='dca_readout')(g_KxBxLxD)


def _start_last_k(spec, x_BxLxD, num_layers):
  """The buffer holds y_0; nothing between the sites yet."""
  buffer_JxBxLxD = jnp.zeros((num_layers + 1,) + x_BxLxD.shape, x_BxLxD.dtype).at[0].set(x_BxLxD)
  return jnp.zeros_like(x_BxLxD), jnp.zeros_like(x_BxLxD), nn.with_logical_constraint(buffer_JxBxLxD, STREAM_ACT)


def padded_params_last_k(spec, num_layers, d_model):
  """Columns that stay empty at a receiver: the merged one while i ≤ k, the last k's past y_1."""
  k = spec.dca_k
  unused = lambda i: (k + 1) - min(i, k) - (i > k)
  return d_model * (STREAMS * sum(unused(i) for i in range(num_layers)) + unused(num_layers))


def _start(spec, x_BxLxD, num_layers):
  """Pending: layer 0's input y_0 = x_0; empty sums of receivers 0, …, N."""
  return x_BxLxD, x_BxLxD, jnp.zeros((num_layers + 1, STREAMS) + x_BxLxD.shape, x_BxLxD.dtype)


def padded_params(spec, num_layers, d_model):
  """b^c_{i,j} for j > i, and the read-out's (receiver N's) K and V weights."""
  n = num_layers + 1
  return STREAMS * d_model * n * (n - 1) // 2 + (STREAMS - 1) * d_model * (n + 1)


register(Design('dca', DCASite, chain=DCAChain, start=_start, finish=lambda spec, carry: carry[2][0, 0],
                no_decay=('dca_bias', 'dca_query'), padded_params=padded_params, saved_names=(SAVED,),
                logical_axes=(('layers_dca', None), ('dca_sources', None), ('dca_streams', None))),
         Design('dca_k', LastKSite, fields=('dca_k',), chain=LastKChain, start=_start_last_k, finish=_finish_last_k,
                buffer=2, no_decay=('dca_bias', 'dca_query'), padded_params=padded_params_last_k, saved_names=(SAVED,),
                logical_axes=(('dca_sources', None), ('dca_streams', None))))
