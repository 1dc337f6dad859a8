"""What the GPU truth run checks of the gated MLP, built where tests reach it.

``jaxact.gated_mlp`` through its kernels (``"pallas"``: the Triton forward and one-pass
backward; ``"mosaic"``: the Hopper forward with the Triton backward) against the XLA path, with
every bias, for the gated activations: y and the gradients of x, the three kernels and the three
biases (:func:`support.gpu_compare.compare_to_xla`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from support.gpu_compare import Comparison, compare_to_xla

ACTIVATIONS = ("silu", "gelu", "relu", "sigmoid")  # SwiGLU, GeGLU, ReGLU, GLU
NAMES = ("y", "dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down")


def operands(shape: tuple[int, ...], dtype, seed: int = 0) -> tuple[jax.Array, ...]:
  """x ``(..., D)``, w_gate and w_up ``(D, F)``, w_down ``(F, O)`` and the three biases for
  ``shape = (..., D, F, O)``: the projections and y of unit size."""
  *batch, d, f, o = shape
  k = jax.random.split(jax.random.key(seed), 7)
  normal = jax.random.normal
  arrays = (
    normal(k[0], (*batch, d), jnp.float32),
    normal(k[1], (d, f), jnp.float32) / np.sqrt(d),
    normal(k[2], (d, f), jnp.float32) / np.sqrt(d),
    normal(k[3], (f, o), jnp.float32) / np.sqrt(f),
    normal(k[4], (f,), jnp.float32),
    normal(k[5], (f,), jnp.float32),
    normal(k[6], (o,), jnp.float32),
  )
  return tuple(a.astype(dtype) for a in arrays)


def build(activation: str):
  """``build(implementation, precision) -> f(x, w_gate, w_up, w_down, b_gate, b_up, b_down)``."""

  def with_impl(implementation, precision):
    def f(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
      return jaxact.gated_mlp(
        x,
        w_gate,
        w_up,
        w_down,
        b_gate,
        b_up,
        b_down,
        activation=activation,
        precision=precision,
        implementation=implementation,
      )

    return f

  return with_impl


def check(activation: str, implementation: str, shape, dtype, seed: int = 0) -> Comparison:
  """The gated MLP of ``shape = (..., D, F, O)`` through `implementation` against XLA's."""
  args = operands(shape, dtype, seed)
  return compare_to_xla(build(activation), args, implementation, names=NAMES, seed=seed + 1)
