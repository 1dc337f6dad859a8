"""Shared by the linear cross-entropy tests: the plain composition they are checked against and
small inputs.

The reference is what a JAX user writes without jaxact: ``x @ w + b``, Gemma 2's cap, optax's
``softmax_cross_entropy`` against ``optax.smooth_labels`` of the one-hot labels, PaLM's z-loss on
``jax.nn.logsumexp``, and numpy's ``where`` / mean, all differentiated by JAX's autodiff. Masked
vocabulary entries (logits of -inf) would make optax's smoothed loss infinite; there the reference
takes the smoothing mean over finite logits only, as jaxact documents (``masked=True``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

# 67 columns in blocks of 16: four whole blocks and one overlapping its predecessor.
T, D, V, BLOCK = 13, 8, 67, 16


def reference(
  x,
  w,
  labels,
  *,
  bias=None,
  where=None,
  reduction="mean",
  label_smoothing=0.0,
  z_loss=0.0,
  logit_soft_cap=None,
  precision=None,
  masked=False,
):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  z = jnp.matmul(x, w, precision=precision, preferred_element_type=acc)
  if bias is not None:
    z = z + bias.astype(acc)
  if logit_soft_cap is not None:
    z = jnp.where(z == -jnp.inf, z, logit_soft_cap * jnp.tanh(z / logit_soft_cap))
  vocab = w.shape[-1]
  onehot = jax.nn.one_hot(labels, vocab, dtype=acc)
  if not masked:
    loss = optax.softmax_cross_entropy(z, optax.smooth_labels(onehot, label_smoothing))
  else:
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.sum(jnp.where(onehot > 0, z, 0), axis=-1)
    mean = jnp.sum(jnp.where(jnp.isfinite(z), z, 0), axis=-1) / vocab
    loss = lse - label_smoothing * mean
    if label_smoothing < 1:  # full smoothing does not look at the label (0 * -inf would be NaN)
      loss = loss - (1 - label_smoothing) * picked
  if z_loss:
    loss = loss + z_loss * jax.nn.logsumexp(z, axis=-1) ** 2
  if where is not None:
    loss = jnp.where(where, loss, 0)
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  count = loss.size if where is None else jnp.sum(where)
  return jnp.sum(loss) / jnp.maximum(count, 1)


def inputs(dtype=jnp.float64, t=T, d=D, v=V, seed=0, scale=1.0):
  """``x, w, b, labels, where`` drawn from a fixed seed; logits of order `scale`."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(t, d)), dtype)
  w = jnp.asarray(rng.normal(size=(d, v)) * scale / np.sqrt(d), dtype)
  b = jnp.asarray(rng.normal(size=(v,)), dtype)
  labels = jnp.asarray(rng.integers(0, v, size=(t,)), jnp.int32)
  where = jnp.asarray(rng.random(t) > 0.3)
  return x, w, b, labels, where


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))
