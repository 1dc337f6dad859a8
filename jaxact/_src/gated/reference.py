"""The plain formulas of :func:`jaxact.gated_dense` and :func:`jaxact.gated_mlp`, for the tests:
``act(x @ w_gate + b_gate) * (x @ w_up + b_up)`` (and its down projection) as JAX differentiates it;
nothing here is fused or custom.
"""

from __future__ import annotations

from jaxact._src.activations.reference import jax_nn as reference_activation

__all__ = ["composition", "reference_activation"]


def composition(act, mlp: bool):
  """The plain composition JAX differentiates, computed in float32 or wider."""

  def f(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    h = act(x @ w_gate + b_gate) * (x @ w_up + b_up)
    return h @ w_down + b_down if mlp else h

  return f
