"""Arithmetic the families share where finite inputs must not overflow (debug_infs quiet)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def exp_diff(a: Array, b: Array) -> Array:
  """``exp(a - b)`` for finite ``a <= b`` whose difference may overflow (their halves' cannot): the
  rescaling factor of an online softmax whose running maximum starts at the float's lowest value."""
  return jnp.exp(2 * jnp.maximum(a / 2 - b / 2, -1e4))
