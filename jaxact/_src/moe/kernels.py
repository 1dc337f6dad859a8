"""The MoE op's kernel calls: the grouped products of :mod:`pallas_kernels.grouped_triton` behind
the platform switch, each beside the XLA product it replaces (``jax.lax.ragged_dot`` and its
transposes).

Three products cover the forward and the backward pass: :func:`gmm` (each group's rows times its
expert's weight), :func:`gmm_t` (times the weight's transpose: the gradient of a product's input)
and :func:`tgmm` (each group's rows transposed times its cotangent rows: the gradient of a
product's weight). ``pallas_kernels`` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from jax import Array, lax

from jaxact._src.core import platform

if TYPE_CHECKING:
  from jaxact._src.moe.plan import MoEPlan


def ragged(plan: MoEPlan, lhs: Array, w: Array, sizes: Array, dtype) -> Array:
  """XLA's grouped product ``lhs[rows of e] @ w[e]`` in `dtype`."""
  return lax.ragged_dot(lhs, w, sizes, plan.precision, preferred_element_type=dtype)


def _switch(plan: MoEPlan, args, triton, xla):
  return platform.switch(args, triton, xla, plan.decision, False)


def gmm(plan: MoEPlan, lhs: Array, w: Array, sizes: Array, dtype) -> Array:
  """``lhs[rows of e] @ w[e]`` (rows past the groups zero), by the Triton kernel."""
  from pallas_kernels import grouped_triton

  def triton(lhs, w, sizes, *, interpret):
    return grouped_triton.gmm(
      lhs, w, sizes, preferred_element_type=dtype, precision=plan.precision, interpret=interpret
    )

  return _switch(plan, (lhs, w, sizes), triton, lambda *a: ragged(plan, *a, dtype))


def gmm_t(plan: MoEPlan, ct: Array, w: Array, sizes: Array, dtype) -> Array:
  """``ct[rows of e] @ w[e].T``: the transpose of ``ragged(., w)`` applied to `ct`."""
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

  def xla(ct, w, sizes):
    like = jax.ShapeDtypeStruct((ct.shape[0], w.shape[1]), ct.dtype)
    return jax.linear_transpose(lambda v: ragged(plan, v, w, sizes, ct.dtype), like)(ct)[0].astype(
      dtype
    )

  return _switch(plan, (ct, w, sizes), triton, xla)


def tgmm(plan: MoEPlan, lhs: Array, ct: Array, sizes: Array, experts: int, dtype) -> Array:
  """``lhs[rows of e].T @ ct[rows of e]`` for each of the `experts`: the transpose of
  ``ragged(lhs, .)`` applied to `ct`."""
  from pallas_kernels import grouped_triton

  def triton(lhs, ct, sizes, *, interpret):
    return grouped_triton.tgmm(
      lhs, ct, sizes, preferred_element_type=dtype, precision=plan.precision, interpret=interpret
    )

  def xla(lhs, ct, sizes):
    like = jax.ShapeDtypeStruct((experts, lhs.shape[1], ct.shape[1]), lhs.dtype)
    grad = jax.linear_transpose(lambda w: ragged(plan, lhs, w, sizes, ct.dtype), like)(ct)[0]
    return grad.astype(dtype)

  return _switch(plan, (lhs, ct, sizes), triton, xla)
