"""Helpers shared by the derivative-code kernel tests (tests/codes/test_codes_triton.py, the Triton
kernels; tests/codes/test_codes_mosaic.py, the Mosaic GPU ones): exact inputs, coded activations,
one run of
a fused op with what its pullback keeps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxact
import support
from jaxact._src.activations import api as activations

ACTIVATION = {"gelu": jaxact.gelu, "silu": jaxact.silu, "mish": jaxact.mish}


def exact(shape, scale: float, seed: int) -> jax.Array:
  """Integers in [-2, 2] times `scale`, float32."""
  v = jax.random.randint(jax.random.key(seed), shape, -2, 3)
  return v.astype(jnp.float32) * scale


def dense_args(shape, dtype):
  """x (rows, K) in halves, w in quarters, b in halves: z = x @ w + b is a multiple of 1/8 of at
  most K / 2 + 1 in size, exact in bfloat16 for K <= 32 (and in any summation order)."""
  *batch, k, n = shape
  x, w, b = exact((*batch, k), 0.5, 1), exact((k, n), 0.25, 2), exact((n,), 0.5, 3)
  return tuple(v.astype(dtype) for v in (x, w, b))


def conv_args(x_shape, w_shape, dtype):
  """As :func:`dense_args`, for a convolution of fan-in ``prod(w_shape[:-1]) <= 32``."""
  x, w, b = exact(x_shape, 0.5, 4), exact(w_shape, 0.25, 5), exact(w_shape[-1:], 0.5, 6)
  return tuple(v.astype(dtype) for v in (x, w, b))


def coded(name: str, bits: int):
  return functools.partial(ACTIVATION[name], residual_bits=bits)


def run(impl, op, activation, x, w, b, **kw):
  """y, the uint8 arrays the pullback keeps, and (dx, dw, db) for a fixed random cotangent."""

  @jax.jit
  def f(x, w, b):
    fn = lambda *a: op(*a, activation=activation, implementation=impl, **kw)
    y, pull = jax.vjp(fn, x, w, b)
    g = jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(y.dtype)
    kept = [v for v in jax.tree.leaves(pull) if v.dtype == jnp.uint8]
    return y, kept, pull(g)

  return f(x, w, b)


def coded_rule(name: str, bits: int):
  """The rule jaxact builds for `name` (default parameters) with a `bits`-bit code."""
  spec = jaxact.get_spec(name)
  z = jax.ShapeDtypeStruct((), jnp.float32)
  rule, _ = activations._split_params(spec, z, support.param_defaults(spec))
  return activations.with_code(rule, bits)
