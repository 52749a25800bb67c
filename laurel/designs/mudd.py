"""MUDDFormer, multiway dynamic dense connections (Xiao et al., arXiv 2502.12170; code `modeling_muddformer.py`).

A_i = GELU(RMSNorm(X_{i+1}) W1_i) W2_i + a_i, X^c = Σ_{j ≤ i+1} A_i[c, j]·X_j per token for c ∈ {Q, K, V, R}; layer i+1:
h = X^R + Attn(X^Q, X^K, X^V), out = h + MLP(norm(h)). Pull form over laurel.designs.buffer, per-layer shapes padded
to N + 1 sources and K_max hidden units (`padded_params` counts them).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from laurel.config_lib import field, one_of
from laurel.designs.protocol import ACT, F32, STREAM_ACT, Chain, Design, Site, const, register, unit_rms
from laurel.designs.buffer import filled_slots, start_buffer, write_slot
from laurel.designs.mixing import mix

WEIGHTS_ACT = (None, None, 'act_batch', 'act_len')  # A: (N + 1 sources, C streams, B, L), the tokens minor
# A layer's output, from which its weights A are computed: every remat policy keeps it (Design.saved_names), so the
# backward does not recompute the MLP for it.
SAVED = 'mudd_out'


@dataclasses.dataclass(frozen=True)
class MUDDSpec:
  """`model.mudd`."""
  mudd_streams: str = field('qkvr', one_of('qkvr', 'r'))  # the dense streams: Q, K, V, R, or R alone


def layer_shapes(spec, num_layers: int) -> list[tuple[int, int, int]]:
  """(streams C_i, sources i + 2, hidden K_i) of each layer i; the last mixes R only. K_i as the code's: C_i·(i+2),
  ×4 at the last layer, rounded as (n // 64 + 1)·64."""
  shapes = []
  for i in range(num_layers):
    last = i == num_layers - 1
    c = 1 if last else len(spec.mudd_streams)
    shapes.append((c, i + 2, (c * (i + 2) * (4 if last else 1) // 64 + 1) * 64))
  return shapes


def padded_params(spec, num_layers: int, d_model: int) -> int:
  """Stored minus used parameters: W1's columns past K_i, W2's and the bias's entries past C_i × (i+2) or K_i."""
  shapes = layer_shapes(spec, num_layers)
  c, j, k_max = len(spec.mudd_streams), num_layers + 1, max(k for *_, k in shapes)
  used = sum(d_model * k + k * ci * si + ci * si for ci, si, k in shapes)
  return num_layers * (d_model * k_max + k_max * c * j + c * j) - used


class MUDDChain(Chain):
  """(a_NxCxJ, hidden_NxK, slot_NxJ): layer i's bias a_i (one-hot on j = i + 1), hidden-unit mask and slot. Sources
  j > i + 1 need no mask (`filled_slots` weighs them 0), nor the last layer's Q, K, V weights (never read)."""

  @nn.compact
  def __call__(self):
    big_n, c = self.num_layers, len(self.spec.mudd_streams)
    hidden_N = np.array([k for *_, k in layer_shapes(self.spec, big_n)])
    hidden = np.arange(hidden_N.max()) < hidden_N[:, None]
    slot = np.eye(big_n + 1)[1:]
    bias = self.make('mudd_bias', const(slot[:, None, :]), (big_n, c, big_n + 1),
                     ('layers', 'mudd_streams', 'mudd_sources')).astype(F32)
    return bias, jnp.asarray(hidden, F32), jnp.asarray(slot, F32)


class MUDDSite(Site):
  """Site 0: h = X^R + Attn(X^Q, X^K, X^V) by the last layer's A; site 1: h + MLP(norm(h)) to its slot, and its A."""

  @nn.compact
  def __call__(self, carry, fn, norm_in, norm_out, chain_l):
    x_BxLxD, buffer_JxBxLxD, a_JxCxBxL = carry
    bias_CxJ, hidden_K, slot_J = chain_l
    if self.t == 0:  # the weights on slots not yet written are 0 (the buffer's backward reads the final buffer)
      # X^c = Σ_j A[c, j]·X_j, one pass over the buffer (laurel.designs.mixing), whose gradient the kernel adds in place
      streams_CxBxLxD, buffer_JxBxLxD = mix(a_JxCxBxL * filled_slots(slot_J)[:, None, None, None], buffer_JxBxLxD,
                                            through=True)
      x_BxLxD = streams_CxBxLxD[-1]
      xn = norm_in(x_BxLxD) if len(streams_CxBxLxD) == 1 else self.attention_inputs(norm_in, *streams_CxBxLxD[:3])
      return nn.with_logical_constraint(x_BxLxD + fn(x_BxLxD, xn, None), ACT), buffer_JxBxLxD, a_JxCxBxL
    out_BxLxD = nn.with_logical_constraint(x_BxLxD + fn(x_BxLxD, norm_in(x_BxLxD), None), ACT)
    out_BxLxD = checkpoint_name(out_BxLxD, SAVED)
    buffer_JxBxLxD = write_slot(buffer_JxBxLxD, slot_J, out_BxLxD)
    c, j = bias_CxJ.shape
    k_max = hidden_K.shape[0]
    w1 = self.make('mudd_w1', nn.initializers.variance_scaling(1.0, 'fan_in', 'normal'), (self.features, k_max),
                   (self.embed_axis, 'mudd_hidden')).astype(F32)
    w2 = self.make('mudd_w2', nn.initializers.zeros, (k_max, c, j),
                   ('mudd_hidden', 'mudd_streams', 'mudd_sources')).astype(F32)
    hidden_BxLxK = jax.nn.gelu(unit_rms(out_BxLxD) @ w1, approximate=False)
    a_JxCxBxL = jnp.einsum('blk,kcj->jcbl', hidden_BxLxK, w2 * hidden_K[:, None, None]) + bias_CxJ.T[..., None, None]
    return out_BxLxD, nn.with_logical_constraint(buffer_JxBxLxD, STREAM_ACT), nn.with_logical_constraint(
        a_JxCxBxL, WEIGHTS_ACT)


def _start(spec, x_BxLxD, num_layers):
  """The buffer holds X_0; every stream of layer 0 is X_0 (weights one-hot on source 0)."""
  a_JxCxBxL = jnp.zeros((num_layers + 1, len(spec.mudd_streams)) + x_BxLxD.shape[:2], F32).at[0].set(1.0)
  return x_BxLxD, start_buffer(x_BxLxD, num_layers), a_JxCxBxL


def _finish(spec, carry):
  """The last layer's X^R."""
  _, buffer_JxBxLxD, a_JxCxBxL = carry
  return mix(a_JxCxBxL[:, -1], buffer_JxBxLxD)


register(Design('mudd', MUDDSite, config=MUDDSpec, chain=MUDDChain, start=_start, finish=_finish, buffer=1, mirror=0,
                saved_names=(SAVED,),
                no_decay=('mudd_bias',), padded_params=padded_params,
                logical_axes=(('mudd_hidden', None), ('mudd_streams', None), ('mudd_sources', None))))
