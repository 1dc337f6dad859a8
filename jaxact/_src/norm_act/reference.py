"""The plain formulas of :func:`jaxact.batch_norm_act` and :func:`jaxact.group_norm_act`, for the
tests: Flax's ``_compute_stats`` and ``_normalize`` written out in ``jnp`` (statistics in float32
or wider), then the activation; JAX differentiates them, nothing here is custom.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _stats(x, axes, fast, axis_name=None):
  def pmean(v):
    return v if axis_name is None else lax.pmean(v, axis_name)

  mean = pmean(jnp.mean(x, axes, keepdims=True))
  if fast:
    var = jnp.maximum(0.0, pmean(jnp.mean(x * x, axes, keepdims=True)) - mean * mean)
  else:
    var = pmean(jnp.mean(jnp.square(x - mean), axes, keepdims=True))
  return mean, var


def _affine(x, mean, var, scale, bias, epsilon, feature_shape):
  y = (x - mean) * lax.rsqrt(var + epsilon)
  if scale is not None:
    y = y * scale.reshape(feature_shape)
  if bias is not None:
    y = y + bias.reshape(feature_shape)
  return y


def batch_norm_act(
  x, scale, bias, act, *, axis=-1, epsilon=1e-5, mean=None, var=None, fast=True, axis_name=None
):
  """``(act(batch_norm(x)), mean, var)``; with `mean` and `var` given, normalized by those."""
  axis = axis % x.ndim
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  feature_shape = tuple(n if d == axis else 1 for d, n in enumerate(x.shape))
  if mean is None:
    mean, var = _stats(xf, tuple(d for d in range(x.ndim) if d != axis), fast, axis_name)
  else:
    mean, var = mean.reshape(feature_shape), var.reshape(feature_shape)
  y = act(_affine(xf, mean, var, scale, bias, epsilon, feature_shape)).astype(x.dtype)
  return y, mean.reshape(-1), var.reshape(-1)


def group_norm_act(x, scale, bias, act, *, num_groups, epsilon=1e-6, fast=True, axis_name=None):
  """``act(group_norm(x))`` over every axis but the first, as Flax's ``GroupNorm``."""
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  c = x.shape[-1]
  xg = xf.reshape((*x.shape[:-1], num_groups, c // num_groups))
  mean, var = _stats(xg, (*range(1, x.ndim - 1), x.ndim), fast, axis_name)
  mean = jnp.repeat(mean, c // num_groups, -1).reshape(x.shape[:1] + (1,) * (x.ndim - 2) + (c,))
  var = jnp.repeat(var, c // num_groups, -1).reshape(mean.shape)
  feature_shape = (1,) * (x.ndim - 1) + (c,)
  return act(_affine(xf, mean, var, scale, bias, epsilon, feature_shape)).astype(x.dtype)
