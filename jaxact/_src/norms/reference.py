"""The plain formulas of :func:`jaxact.rms_norm` and :func:`jaxact.layer_norm`, for the tests: the
statistics in float32 (or wider), as Flax's ``RMSNorm`` / ``LayerNorm`` compute them, and Gemma's
RMSNorm as its code writes it; JAX differentiates them, nothing here is custom.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-6  # the tests' epsilon (Flax's default)


def ref_rms(x, scale, bias=None, axis=-1):
  x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis, keepdims=True) + EPS)
  return (y if scale is None else y * scale).astype(x.dtype)


def ref_ln(x, scale, bias, axis=-1):
  x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  c = x32 - jnp.mean(x32, axis, keepdims=True)
  y = c * jax.lax.rsqrt(jnp.mean(c * c, axis, keepdims=True) + EPS)
  y = y if scale is None else y * scale
  return (y if bias is None else y + bias).astype(x.dtype)


def gemma_rms(x, scale, bias=None, axis=-1, offset=1.0):
  """Gemma's RMSNorm as its code writes it (``x * rsqrt(mean(x^2) + eps) * (1 + scale)``)."""
  var = jnp.mean(jnp.square(x), axis=axis, keepdims=True)
  return x * jax.lax.rsqrt(var + EPS) * (offset + scale)


def ref_ln_offset(x, scale, bias, axis=-1, offset=1.0):
  return ref_ln(x, offset + scale, bias, axis)
