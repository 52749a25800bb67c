"""Next-token cross-entropy without the full logits: one chunk of positions at a time.

The (batch, length, vocabulary) float32 logits of a step at Table 5's shape are 4 GiB per chip, plus their bf16
copy and gradient. Here a scan over chunks of `chunk` positions computes each chunk's logits, its log-sum-exp and
its label logit, and keeps nothing of them: the chunk body is rematerialised, so the backward pass recomputes one
chunk's logits at a time and only the hidden states (B, L, D) are saved. The label logit is a masked sum over the
vocabulary (a one-hot contraction) rather than a gather, which the TPU compiler lays out better.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn


def shifted_targets(tokens_BxL, segment_ids_BxL):
  """(targets, weights): position t predicts token t+1 of its own document, never padding (segment 0); the last
  position has weight 0. Keeping length L (not L−1) lets the logits stay unsliced."""
  targets_BxL = jnp.pad(tokens_BxL[:, 1:], ((0, 0), (0, 1)))
  next_segment_BxL = jnp.pad(segment_ids_BxL[:, 1:], ((0, 0), (0, 1)))
  weights_BxL = ((next_segment_BxL == segment_ids_BxL) & (next_segment_BxL > 0)).astype(jnp.float32)
  return targets_BxL, weights_BxL


def chunked(x_BxLxD, kernel, kernel_axes: str, targets_BxL, weights_BxL, chunk: int, dtype=None):
  """(Σ weight·nll, Σ weight·[argmax = target]) over every position, with logits x·W computed `chunk` positions at
  a time (0: all at once). `kernel` is the output projection, laid out as `kernel_axes` ('dv', or 'vd' for a tied
  embedding); it is cast to `dtype` inside each chunk, so its gradient accumulates over chunks in its own dtype."""
  b, length, _ = x_BxLxD.shape
  chunk = chunk or length
  pad = -length % chunk
  if pad:  # padded positions weigh nothing
    x_BxLxD, targets_BxL, weights_BxL = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
                                         for a in (x_BxLxD, targets_BxL, weights_BxL))
  n = (length + pad) // chunk
  chunks = lambda a: a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)  # batch stays the sharded axis

  @jax.checkpoint
  def chunk_sums(x_BxCxD, targets_BxC, weights_BxC):
    w = kernel.astype(dtype or x_BxCxD.dtype)
    logits_BxCxV = jnp.einsum(f'bcd,{kernel_axes}->bcv', x_BxCxD.astype(w.dtype), w,
                              preferred_element_type=jnp.float32)
    logits_BxCxV = nn.with_logical_constraint(logits_BxCxV, ('act_batch', 'act_len', 'act_vocab'))
    vocab_V = jnp.arange(logits_BxCxV.shape[-1])
    label_BxC = jnp.sum(jnp.where(vocab_V == targets_BxC[..., None], logits_BxCxV, 0.0), axis=-1)
    nll_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1) - label_BxC
    correct_BxC = (jnp.argmax(logits_BxCxV, axis=-1) == targets_BxC).astype(jnp.float32)
    return jnp.sum(nll_BxC * weights_BxC), jnp.sum(correct_BxC * weights_BxC)

  def body(sums, xs):
    nll, correct = chunk_sums(*xs)
    return (sums[0] + nll, sums[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  (nll, correct), _ = jax.lax.scan(body, (zero, zero), (chunks(x_BxLxD), chunks(targets_BxL), chunks(weights_BxL)))
  return nll, correct
