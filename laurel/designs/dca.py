"""DCA, DeepCrossAttention (Heddes et al., arXiv 2502.06785): GRN-v3 §3.1, the DCA block §3.2, the read-out §4.1.

GRN(G_i) = Σ_{j ≤ i} ReLU(b_{i,j} + w_iᵀ y_j) ⊙ y_j (App. H's reading) over y_0, the embedding, and y_{j+1}, layer j's
block output without its skip; one GRN for each of the attention's Q, K, V. k-DCA (`dca_k`): the stack [y_0,
Σ_{1≤j≤i−k} y_j, y_{i−k+1}, …, y_i]. Pull form over laurel.designs.buffer, as MUDDFormer's.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laurel.config_lib import POSITIVE_INT, field
from laurel.designs.protocol import ACT, F32, STREAM_ACT, Chain, Design, Site, make_param, register
from laurel.designs.buffer import start_buffer, write_slot

STREAMS = 3  # Q, K, V


@dataclasses.dataclass(frozen=True)
class DCAKSpec:
  """`model.dca_k`: k-DCA's k (`dca` has no fields)."""
  dca_k: int = field(8, POSITIVE_INT)  # the last k layers their own columns, the intermediate ones summed


def grn_sum(b_CxKxD, w_CxD, g_KxBxLxD):
  """Σ_k ReLU(b_k + wᵀg_k) ⊙ g_k for each stream c: (C, B, L, D)."""
  gate_CxKxBxL = jnp.einsum('kbld,cd->ckbl', g_KxBxLxD.astype(F32), w_CxD)
  weight_CxKxBxLxD = jax.nn.relu(b_CxKxD[:, :, None, None, :] + gate_CxKxBxL[..., None]).astype(g_KxBxLxD.dtype)
  return jnp.einsum('ckbld,kbld->cbld', weight_CxKxBxLxD, g_KxBxLxD)


def last_k(spec, num_layers):
  """k: every earlier layer its own column for `dca`."""
  return num_layers if spec.design == 'dca' else spec.dca_k


def grn_columns(b_CxKxD, w_CxD, receiver, buffer_JxBxLxD):
  """GRN(G_i) of receiver i (traced) for each stream c over its k + 2 columns: y_0, a slice of the last k slots up
  to y_i (any other weighs nothing: the buffer may hold later ones) and the merged column."""
  k, slots = b_CxKxD.shape[1] - 2, buffer_JxBxLxD.shape[0]
  width = min(k, slots - 1)  # a k past N has columns that stay empty
  start = jnp.clip(receiver - width + 1, 0, slots - width)
  slot_K = start + jnp.arange(width)
  last_KxBxLxD = jax.lax.dynamic_slice_in_dim(buffer_JxBxLxD, start, width)
  last_KxBxLxD = jnp.where(((slot_K >= 1) & (slot_K <= receiver))[:, None, None, None], last_KxBxLxD, 0)
  column_K = jnp.clip(2 + receiver - slot_K, 2, k + 1)  # y_i is column 2, y_{i−1} column 3, ...
  out_CxBxLxD = (grn_sum(b_CxKxD[:, :1], w_CxD, buffer_JxBxLxD[:1])
                 + grn_sum(jnp.take(b_CxKxD, column_K, axis=1), w_CxD, last_KxBxLxD))
  if k < slots - 1:  # Σ_{1≤j≤i−k} y_j (DCA, k = N, never has one)
    merged_J = ((jnp.arange(slots) >= 1) & (jnp.arange(slots) <= receiver - k)).astype(buffer_JxBxLxD.dtype)
    merged_BxLxD = jnp.einsum('j,jbld->bld', merged_J, buffer_JxBxLxD, preferred_element_type=F32)
    out_CxBxLxD = out_CxBxLxD + grn_sum(b_CxKxD[:, 1:2], w_CxD, merged_BxLxD.astype(buffer_JxBxLxD.dtype)[None])
  return out_CxBxLxD


def _grn_weights(make, lead, lead_names, k, d, embed_axis):
  """(b, w) of GRNs over k + 2 columns, b = 1 and w = 0 (every GRN is then Σ_j y_j), leading axes `lead`."""
  bias = make('dca_bias', nn.initializers.ones, lead + (k + 2, d), lead_names + ('dca_sources', embed_axis))
  query = make('dca_query', nn.initializers.zeros, lead + (d,), lead_names + (embed_axis,))
  return bias.astype(F32), query.astype(F32)


class DCAChain(Chain):
  """(b_NxCxKxD, w_NxCxD, slot_NxJ): receiver i's GRN weights, and the slot its output takes (i + 1)."""

  @nn.compact
  def __call__(self):
    big_n, d = self.num_layers, self.features
    k = last_k(self.spec, big_n)
    bias, query = _grn_weights(self.make, (big_n, STREAMS), ('layers', 'dca_streams'), k, d, self.embed_axis)
    return bias, query, jnp.asarray(np.eye(big_n + 1)[1:], F32)


class DCASite(Site):
  """Site 0: the attention on the buffer's GRNs; site 1: the MLP around h, writing y_{i+1} = a + m to its slot."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    h_BxLxD, y_BxLxD, buffer_JxBxLxD = carry
    b_CxKxD, w_CxD, slot_J = chain_l
    if self.t == 0:  # the attention on the GRNs' q, k, v inputs; the FFN's skip is u^Q
      receiver = jnp.argmax(slot_J) - 1
      q_BxLxD, k_BxLxD, v_BxLxD = grn_columns(b_CxKxD, w_CxD, receiver, buffer_JxBxLxD)
      y_BxLxD = fn(q_BxLxD, self.attention_inputs(norm_in, q_BxLxD, k_BxLxD, v_BxLxD), None)
      h_BxLxD = q_BxLxD + y_BxLxD
    else:
      f_BxLxD = fn(h_BxLxD, norm_in(h_BxLxD), None)
      h_BxLxD, y_BxLxD = h_BxLxD + f_BxLxD, y_BxLxD + f_BxLxD
      buffer_JxBxLxD = write_slot(buffer_JxBxLxD, slot_J, y_BxLxD)
    return (nn.with_logical_constraint(h_BxLxD, ACT), nn.with_logical_constraint(y_BxLxD, ACT),
            nn.with_logical_constraint(buffer_JxBxLxD, STREAM_ACT))


class DCAReadout(nn.Module):
  """The read-out GRN over y_0, …, y_N."""
  features: int
  k: int
  param_dtype: Any = F32
  make = make_param

  @nn.compact
  def __call__(self, buffer_JxBxLxD):
    bias, query = _grn_weights(self.make, (1,), (None,), self.k, self.features, 'embed')
    return grn_columns(bias, query, buffer_JxBxLxD.shape[0] - 1, buffer_JxBxLxD)[0]


def _finish(spec, carry):
  buffer_JxBxLxD = carry[2]
  return DCAReadout(buffer_JxBxLxD.shape[-1], last_k(spec, buffer_JxBxLxD.shape[0] - 1),
                    name='dca_readout')(buffer_JxBxLxD)


def _start(spec, x_BxLxD, num_layers):
  """The buffer holds y_0; nothing between the sites yet."""
  return jnp.zeros_like(x_BxLxD), jnp.zeros_like(x_BxLxD), start_buffer(x_BxLxD, num_layers)


def padded_params(spec, num_layers, d_model):
  """Columns that stay empty at receiver i: the merged one while i ≤ k, and y_{i−r} of the last k for r ≥ i."""
  k = last_k(spec, num_layers)
  empty = lambda i: int(i <= k) + max(k - i, 0)
  return d_model * (STREAMS * sum(empty(i) for i in range(num_layers)) + empty(num_layers))


_DCA = dict(chain=DCAChain, start=_start, finish=_finish, buffer=2, no_decay=('dca_bias', 'dca_query'),
            padded_params=padded_params,
            logical_axes=(('dca_sources', None), ('dca_streams', None)))
register(Design('dca', DCASite, **_DCA), Design('dca_k', DCASite, config=DCAKSpec, **_DCA))
