"""Next-token cross-entropy without the full logits: a scan over chunks of positions computes each chunk's logits
(on a TPU twice, see _scan_chunks), and from them the loss and its gradients (a custom VJP), so the backward pass only
scales saved gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn


def shifted_targets(tokens_BxL, segment_ids_BxL):
  """(targets, weights) of length L, so the logits stay unsliced: t predicts token t+1 of its document, not padding."""
  targets_BxL = jnp.pad(tokens_BxL[:, 1:], ((0, 0), (0, 1)))
  next_segment_BxL = jnp.pad(segment_ids_BxL[:, 1:], ((0, 0), (0, 1)))
  weights_BxL = ((next_segment_BxL == segment_ids_BxL) & (next_segment_BxL > 0)).astype(jnp.float32)
  return targets_BxL, weights_BxL


@jax.named_scope('loss')  # where laurel.plan.schedule counts its time
def _scan_chunks(x_BxLxD, kernel, kernel_axes, targets_BxL, weights_BxL, chunk, dtype, grads: bool):
  """The sums, and with `grads` the gradients of Σ weight·nll with respect to x and the kernel."""
  b, length, d = x_BxLxD.shape
  chunk, dtype = min(chunk or length, length), jnp.dtype(dtype or x_BxLxD.dtype)  # no chunk longer than the rows
  pad = -length % chunk
  if pad:  # padded positions weigh nothing
    x_BxLxD, targets_BxL, weights_BxL = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
                                         for a in (x_BxLxD, targets_BxL, weights_BxL))
  n = (length + pad) // chunk
  chunks = lambda a: a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)  # batch stays the sharded axis
  w = kernel.astype(dtype)
  product = lambda spec, a, c: jnp.einsum(spec, a, c, preferred_element_type=jnp.float32)
  logits = lambda x_BxCxD, w: nn.with_logical_constraint(product(f'bcd,{kernel_axes}->bcv', x_BxCxD, w),
                                                         ('act_batch', 'act_len', 'act_vocab'))

  def body(carry, xs):
    nll, correct, grad_kernel = carry
    x_BxCxD, targets_BxC, weights_BxC = xs
    logits_BxCxV = logits(x_BxCxD, w)
    is_label_BxCxV = jnp.arange(logits_BxCxV.shape[-1]) == targets_BxC[..., None]
    label_BxC = jnp.sum(jnp.where(is_label_BxCxV, logits_BxCxV, 0.0), axis=-1)
    max_BxC = jnp.max(logits_BxCxV, axis=-1)
    sum_exp = lambda logits_BxCxV: jnp.sum(jnp.exp(logits_BxCxV - max_BxC[..., None]), axis=-1)
    # The TPU compiler puts the sum in the epilogue of the product computed again, which by its estimate costs less
    # than another pass over the float32 logits; the barrier keeps it from merging the two products. Other compilers
    # were not measured: they sum the stored logits.
    again = lambda: sum_exp(logits(*jax.lax.optimization_barrier((x_BxCxD, w))))
    lse_BxC = max_BxC + jnp.log(jax.lax.platform_dependent(tpu=again, default=lambda: sum_exp(logits_BxCxV)))
    nll = nll + jnp.sum((lse_BxC - label_BxC) * weights_BxC)
    # Correct where the label's logit is the largest, ties included: no pass over the logits for an argmax.
    correct = correct + jnp.sum((label_BxC >= max_BxC) * weights_BxC)
    if not grads:
      return (nll, correct, grad_kernel), None
    # d(Σ w·nll)/d logits = w·(softmax − one-hot)
    grad_BxCxV = (jnp.exp(logits_BxCxV - lse_BxC[..., None]) - is_label_BxCxV) * weights_BxC[..., None]
    grad_BxCxV = grad_BxCxV.astype(dtype)
    grad_x_BxCxD = product(f'bcv,{kernel_axes}->bcd', grad_BxCxV, w).astype(x_BxLxD.dtype)
    grad_kernel = grad_kernel + product(f'bcv,bcd->{kernel_axes}', grad_BxCxV, x_BxCxD)
    return (nll, correct, grad_kernel), grad_x_BxCxD

  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros(kernel.shape, jnp.float32) if grads else None)
  xs = (chunks(x_BxLxD.astype(dtype)), chunks(targets_BxL), chunks(weights_BxL))
  (nll, correct, grad_kernel), grad_x = jax.lax.scan(body, init, xs)
  if not grads:
    return nll, correct
  grad_x_BxLxD = grad_x.swapaxes(0, 1).reshape(b, length + pad, d)[:, :length]
  return (nll, correct), (grad_x_BxLxD, grad_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 5, 6))
def chunked(x_BxLxD, kernel, kernel_axes: str, targets_BxL, weights_BxL, chunk: int, dtype=None):
  """(Σ weight·nll, Σ weight·[the target's logit is the largest, a tie too]), logits x·W `chunk` positions at a time
  (0: all). `kernel` is laid out as `kernel_axes` ('dv' or 'vd'), used in `dtype` (default: x's); matmuls accumulate
  in float32."""
  return _scan_chunks(x_BxLxD, kernel, kernel_axes, targets_BxL, weights_BxL, chunk, dtype, grads=False)


def _chunked_fwd(x_BxLxD, kernel, kernel_axes, targets_BxL, weights_BxL, chunk, dtype=None):
  sums, grads = _scan_chunks(x_BxLxD, kernel, kernel_axes, targets_BxL, weights_BxL, chunk, dtype, grads=True)
  return sums, (grads, targets_BxL, weights_BxL, jnp.zeros((), kernel.dtype))  # the last: the kernel's dtype


@jax.named_scope('loss')
def _chunked_bwd(kernel_axes, chunk, dtype, saved, cotangents):
  del kernel_axes, chunk, dtype
  (grad_x_BxLxD, grad_kernel), targets_BxL, weights_BxL, kernel_like = saved
  g = cotangents[0]  # the accuracy count has no gradient
  return ((g * grad_x_BxLxD).astype(grad_x_BxLxD.dtype), (g * grad_kernel).astype(kernel_like.dtype),
          np.zeros(targets_BxL.shape, jax.dtypes.float0), jnp.zeros_like(weights_BxL))


chunked.defvjp(_chunked_fwd, _chunked_bwd)
