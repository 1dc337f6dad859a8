"""Which backend runs a norm + activation call (``batch_norm_act``, ``group_norm_act``): the norm
ops' rows of the one decision point.

``implementation="pallas"`` takes the Triton kernels of the normalize-and-activate epilogue
(:mod:`pallas_kernels.norm_act_triton`), forward and backward (the statistics stay XLA's), or
raises ``NotImplementedError`` with the reason when they cannot run the call
(:func:`triton_unsupported`). ``None`` is XLA: no GPU has timed the kernels yet
(:data:`NORM_ACT_AUTO_RULES`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
from jax import Array

from jaxact._src.activations import resolve
from jaxact._src.core import dispatch, shardings

if TYPE_CHECKING:
  from jaxact._src.norm_act.plan import NormActPlan


def epilogue(plan: NormActPlan):
  """The kernels' activation: its derivative taken from the pre-activation, which the backward
  recomputes from x_hat (as the XLA path's ``_dz`` takes it)."""
  rule = plan.act.rule
  if rule.residual == "output":
    rule = dataclasses.replace(rule, residual="input")
  return resolve.epilogue(rule)


def _layout(plan: NormActPlan, x: Array) -> str | None:
  last = x.ndim - 1
  if plan.feature_axes != (last,):
    return (
      f"the features are axes {plan.feature_axes} of a rank-{x.ndim} x; the kernels take "
      "channels-last inputs (one feature axis, the last)"
    )
  if plan.groups and plan.axes != (*range(1, last), x.ndim):
    return (
      "the statistics reduce other axes than every axis but the first (`reduction_axes`); the "
      "kernels take a statistic per example and group"
    )
  return None


def _sharding(plan: NormActPlan, arrays) -> str | None:
  if plan.axis_name is not None:
    return (
      f"axis_name={plan.axis_name!r}: statistics averaged across devices (the kernels run on "
      "one device's whole arrays)"
    )
  mesh = shardings.explicit_mesh(*arrays)
  if isinstance(mesh, str):
    return mesh
  for a in arrays:
    if a is not None and any(shardings.split_spec(a)):
      return f"inputs sharded over a mesh (spec {shardings.pspec(shardings.spec_of(a))})"
  t = getattr(jax.typeof(arrays[0]), "manual_axis_type", None)
  if t is not None and t.varying:
    return "inside a shard_map that types the values' variation (check_vma=True)"
  return None


def triton_unsupported(plan: NormActPlan, x: Array, scale, bias) -> str | None:
  """Why the Triton kernels (:mod:`pallas_kernels.norm_act_triton`) cannot run this call, or
  None."""
  why = (
    dispatch.kernels_unsupported(plan, x, acc=plan.acc)
    or _layout(plan, x)
    or _sharding(plan, (x, scale, bias))
  )
  if why is not None:
    return why
  return dispatch.unlowered(plan.act.rule.name, epilogue(plan))


class _Call(NamedTuple):
  plan: NormActPlan
  x: Array
  scale: Array | None
  bias: Array | None


NORM_ACT_AUTO_RULES: tuple[dispatch.Rule, ...] = (
  dispatch.Rule(
    "`batch_norm_act`, `group_norm_act`: every target",
    lambda f: True,
    "xla",
    "xla",
    "unmeasured on a GPU (issue 43): the normalize-and-activate Triton kernels compile for H100 "
    "and A100 without spills; implementation='pallas' runs them",
  ),
)


def _triton(call: _Call, sharding) -> str | None:
  return triton_unsupported(call.plan, call.x, call.scale, call.bias)


FAMILY = dispatch.Family(
  implementations={
    "xla": dispatch.Backends(),
    "pallas": dispatch.Backends("triton", "triton", _triton),
    "mosaic": dispatch.Backends(
      missing="has no kernel: jaxact has no Mosaic GPU norm + activation kernel; use "
      "implementation='pallas' (Triton, which Hopper runs), 'xla' or None"
    ),
  },
  rules=NORM_ACT_AUTO_RULES,
  declined=_triton,
  facts=lambda c, s: dispatch.target(),
)


def decide(
  fn_name: str, implementation: str | None, plan: NormActPlan, x: Array, scale, bias
) -> dispatch.Decision:
  """The backends for one norm + activation call (:func:`jaxact._src.core.dispatch.decide` of
  :data:`FAMILY`): ``"pallas"`` takes the Triton kernels, ``None`` the first row of
  :data:`NORM_ACT_AUTO_RULES` (XLA)."""
  return dispatch.decide(FAMILY, fn_name, implementation, _Call(plan, x, scale, bias))
