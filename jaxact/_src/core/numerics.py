"""Arithmetic the families share where finite inputs must not overflow (debug_infs quiet)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def exp_diff(a: Array, b: Array) -> Array:
  """``exp(a - b)`` for finite ``a <= b`` whose difference may overflow (their halves' cannot): the
  rescaling factor of an online softmax whose running maximum starts at the float's lowest value."""
  return jnp.exp(2 * jnp.maximum(a / 2 - b / 2, -1e4))


def safe_mul(p: Array, q: Array) -> Array:
  """``p * q``, but 0 where one factor is 0 and the other infinite (an intermediate overflow).

  NaN factors still give NaN, so a diverging run shows itself.
  """
  prod = p * q
  zero_inf = ((p == 0) & jnp.isinf(q)) | (jnp.isinf(p) & (q == 0))
  # The zero is min(|p|, |q|), read from the factors: an array of zeros (jnp.zeros_like, or a
  # scalar broadcast by jnp.where) depends on nothing in a scanned block, so the scan hoists it
  # out of the loop as one whole (tokens, hidden) buffer.
  return jnp.where(zero_inf, jnp.minimum(jnp.abs(p), jnp.abs(q)), prod)


def mul3(p: Array, q: Array, r: Array) -> Array:
  """``p * q * r``, overflowing to infinity only where the product itself does.

  Formed as ``(p * q) * r``, or as ``(p * r) * q`` where ``p * q`` overflowed from finite factors
  (then either ``|r| <= 1`` and ``p * r`` is finite, or the product overflows anyway); each
  product as :func:`safe_mul` forms it, so 0 times an infinite factor is 0.
  """
  pq = safe_mul(p, q)
  over = jnp.isinf(pq) & jnp.isfinite(p) & jnp.isfinite(q)
  return safe_mul(jnp.where(over, safe_mul(p, r), pq), jnp.where(over, q, r))
