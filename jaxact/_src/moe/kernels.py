"""The MoE op's kernel calls: the grouped products of :mod:`pallas_kernels.grouped_triton` behind
the platform switch, each given the XLA product it replaces (``jax.lax.ragged_dot`` and its
transposes, as :mod:`jaxact._src.moe.vjp` makes them).

Three products cover the forward and the backward pass: :func:`gmm` (each group's rows times its
expert's weight), :func:`gmm_t` (times the weight's transpose: the gradient of a product's input)
and :func:`tgmm` (each group's rows transposed times its cotangent rows: the gradient of a
product's weight). ``pallas_kernels`` is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jax import Array

from jaxact._src.core import platform

if TYPE_CHECKING:
  from jaxact._src.moe.plan import MoEPlan


def _switch(plan: MoEPlan, args, triton, xla):
  return platform.switch(args, triton, xla, plan.decision, False)


def gmm(plan: MoEPlan, lhs: Array, w: Array, sizes: Array, dtype, xla: Callable[..., Any]) -> Array:
  """``lhs[rows of e] @ w[e]`` (rows past the groups zero), by the Triton kernel; `xla` (of
  ``(lhs, w, sizes)``) where the program is not lowered for CUDA."""
  from pallas_kernels import grouped_triton

  def triton(lhs, w, sizes, *, interpret):
    return grouped_triton.gmm(
      lhs, w, sizes, preferred_element_type=dtype, precision=plan.precision, interpret=interpret
    )

  return _switch(plan, (lhs, w, sizes), triton, xla)


def gmm_t(
  plan: MoEPlan, ct: Array, w: Array, sizes: Array, dtype, xla: Callable[..., Any]
) -> Array:
  """``ct[rows of e] @ w[e].T``: the transpose of a grouped product in its input applied to `ct`;
  `xla` of ``(ct, w, sizes)`` off CUDA."""
  from pallas_kernels import grouped_triton

  def triton(ct, w, sizes, *, interpret):
    return grouped_triton.gmm(
      ct,
      w,
      sizes,
      transpose_rhs=True,
      preferred_element_type=dtype,
      precision=plan.precision,
      interpret=interpret,
    )

  return _switch(plan, (ct, w, sizes), triton, xla)


def tgmm(
  plan: MoEPlan, lhs: Array, ct: Array, sizes: Array, dtype, xla: Callable[..., Any]
) -> Array:
  """``lhs[rows of e].T @ ct[rows of e]`` for each expert: the transpose of a grouped product in
  its weight applied to `ct`; `xla` of ``(lhs, ct, sizes)`` off CUDA."""
  from pallas_kernels import grouped_triton

  def triton(lhs, ct, sizes, *, interpret):
    return grouped_triton.tgmm(
      lhs, ct, sizes, preferred_element_type=dtype, precision=plan.precision, interpret=interpret
    )

  return _switch(plan, (lhs, ct, sizes), triton, xla)
