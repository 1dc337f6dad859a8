"""The optimization barriers that keep what a custom_vjp keeps, and nothing more.

Shared by every op with a saved residual: the elementwise activations, glu and the softmaxes, and
the fused layers. XLA is free to move, fuse and share work across the forward and backward passes;
these barriers stop exactly the moves that would keep more arrays alive between them.
"""

from __future__ import annotations

import jax
from jax import Array

from jaxact._src.core.spec import Residual


def barrier_residual(residual: Residual, y: Array, x: Array) -> tuple[Array, Array | None]:
  """``(y, kept)``: the output and the residual the backward reads, behind one barrier.

  Shared by every op built on a rule (the elementwise op here and the fused layers).
  """
  if residual == "none":
    return y, None
  # The barrier hides the residual's origin from XLA. Without it XLA (a) fuses a cheap forward
  # formula into the backward's consumers, recomputing y from x and so keeping x alive too, and
  # (b) CSEs the backward's intermediates (exp, sigmoid of x) with the forward's, keeping those
  # alive as extra activation-sized buffers. Either way the saving this rule exists for is lost.
  # y goes through the barrier with the residual: the residual must be the very array returned
  # (a second buffer would double what the pullback holds), and an unbarriered forward lets XLA's
  # CPU reduction fusions pull the formula in and materialise its broadcast constants.
  if residual == "output":
    y = jax.lax.optimization_barrier(y)
    return y, y
  return jax.lax.optimization_barrier((y, x))  # x: the input, or its derivative code


def after_cotangent(kept, g):
  """Tie the residual to the incoming cotangent, so no part of the derivative runs before it.

  Otherwise XLA's scheduler may compute the g-independent part of the derivative (say exp(x) in
  mish') as soon as the residual exists, in the forward pass, and keep it alive until the backward
  pass: extra activation-sized buffers per layer.
  """
  return jax.lax.optimization_barrier((kept, g))[0], g


def zeros_from(like: Array, dtype=None) -> Array:
  """Zeros of `like`'s shape (and sharding), computed from it elementwise: 0 for every element,
  NaN or not.

  A buffer an op starts from zeros (an accumulator, an output written block by block) made with
  ``jnp.zeros`` depends on nothing of the step: in a model scanned over its layers JAX hoists it
  out of the scan as one whole buffer, which the loop then copies for every layer. Made from an
  array of the step it is made where it is used, on each device from its own elements.
  """
  return (like != like).astype(dtype or like.dtype) * 0
