"""Shared by the linear cross-entropy tests: the plain composition they are checked against
(:func:`jaxact._src.lce.reference.cross_entropy_reference`, as ``reference``) and small inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxact._src.lce.reference import cross_entropy_reference as reference  # noqa: F401

# 67 columns in blocks of 16: four whole blocks and one overlapping its predecessor.
T, D, V, BLOCK = 13, 8, 67, 16


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
