"""Helpers shared by the tests of the convolutional layers (ConvNormAct, NormActConv): inputs,
closeness by dtype, variables moved off their initial values, and stacks of a layer unrolled and
under ``nn.scan``."""

from __future__ import annotations

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = {jnp.float32: 2e-5, jnp.float64: 1e-11, jnp.bfloat16: 2e-2}


def inputs(dtype, shape=(4, 6, 6, 3)):
  return (jax.random.normal(jax.random.key(0), shape, jnp.float32) * 2 + 0.5).astype(dtype)


def close(a, b, dtype):
  """Every leaf of `a` as `b`'s dtype and shape, and within `dtype`'s tolerance of it (relative,
  and absolute against the leaf's largest magnitude)."""
  tol = TOLERANCE[dtype]
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert u.dtype == v.dtype and u.shape == v.shape
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    np.testing.assert_allclose(u, v, rtol=tol, atol=tol * float(np.abs(v).max()))


def perturbed(variables):
  """Parameters and running averages away from their initial values (a zero scale kept)."""

  def move(path, v):
    if path[-1].key == "scale":
      return v.at[0].set(0.0) * 1.5
    return v + 0.1 * jnp.arange(v.size, dtype=v.dtype).reshape(v.shape) / v.size

  return jax.tree_util.tree_map_with_path(move, variables)


def stack(layer, n=3):
  """`n` layers made by ``layer(name=...)``, unrolled."""

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(n):
        x = layer(name=f"layers_{i}")(x)
      return x

  return Stack()


def scanned(layer, n=3):
  """`n` layers made by ``layer(name=...)`` under ``nn.scan`` (parameters and batch statistics
  stacked)."""

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      body = nn.scan(
        lambda module, carry, _: (module(carry), None),
        variable_axes={"params": 0, "batch_stats": 0},
        split_rngs={"params": True},
        length=n,
      )
      return body(layer(name="layers"), x, None)[0]

  return Scanned()


def grads(module, variables, x, call, mutable):
  """``(d params, d x), (y, updated collections)`` of a weighted sum of `module`'s output, jitted:
  what the layer tests compare between jaxact's layer and Flax's composition."""

  def loss(params, x):
    out = module.apply({**variables, "params": params}, x, **call, mutable=mutable)
    y, new = out if mutable else (out, {})
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))), (y, new)

  return jax.jit(jax.grad(loss, (0, 1), has_aux=True))(variables["params"], x)


def nnx_grads(module, x, ct):
  """``(d module, d x), (y, batch statistics)`` of ``sum(module(x) * ct)``: what the nnx layer
  tests compare between jaxact's layer and Flax's composition."""

  def loss(module, x):
    y = module(x)
    return jnp.sum(y * ct), y

  grads, y = nnx.grad(loss, argnums=(0, 1), has_aux=True)(module, x)
  return grads, (y, nnx.state(module, nnx.BatchStat))
