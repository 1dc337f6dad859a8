"""Which backend runs :func:`jaxact.moe_mlp`'s grouped products: the MoE op's rows of the one
decision point.

``implementation="pallas"`` takes the Triton grouped matmuls (:mod:`pallas_kernels.grouped_triton`)
for the forward's three products and the backward's six (the three weights' gradients, and three
products with a transposed expert weight); it raises ``NotImplementedError`` with the reason where
they cannot run the call (:func:`triton_unsupported`). ``None`` takes the first row of
:data:`MOE_AUTO_RULES` that holds: XLA's ``ragged_dot`` until a GPU has measured the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from jax import Array

from jaxact._src.core import dispatch

if TYPE_CHECKING:
  from jaxact._src.moe.plan import MoEPlan


def triton_unsupported(plan: MoEPlan, x: Array, w_gate: Array, w_down: Array) -> str | None:
  """Why the grouped Triton kernels cannot run this call, or None. Under expert parallelism they
  run per device in the experts' shard_map, on each device's rows (its experts' groups, then the
  padding of the rows it did not receive), as the XLA products do."""
  for name, dtype in (("x", x.dtype), ("output", plan.out_dtype)):
    if np.dtype(dtype).name not in ("float32", "bfloat16", "float16"):
      return f"{name} dtype {np.dtype(dtype).name} (supported: float32, bfloat16, float16)"
  if np.dtype(plan.acc_dtype) != np.float32:
    return f"accumulation in {np.dtype(plan.acc_dtype).name} (the kernels accumulate in float32)"
  if 0 in x.shape or 0 in w_gate.shape or 0 in w_down.shape:
    return "zero-size operands"
  from pallas_kernels import allow_tf32

  try:
    allow_tf32(plan.precision)
  except NotImplementedError as e:
    return str(e)
  return None


class _Call(NamedTuple):
  plan: MoEPlan
  x: Array
  w_gate: Array
  w_down: Array


@dataclasses.dataclass(frozen=True)
class _MoEFacts:
  """What the MoE rules ask of one call."""

  plan: MoEPlan
  target: dispatch.Target


# moe_mlp's rules for implementation=None, tried after triton_unsupported.
MOE_AUTO_RULES: tuple[dispatch.Rule, ...] = (
  dispatch.Rule(
    "`moe_mlp`: every target",
    lambda f: True,
    "xla",
    "xla",
    "unmeasured on a GPU (issue 43): the grouped Triton kernels compile for H100 and A100 "
    "without spills and do each group's rows alone, where XLA's ragged_dot multiplies every row "
    "by every expert; implementation='pallas' runs them",
  ),
)


def _triton(call: _Call, sharding) -> str | None:
  return triton_unsupported(call.plan, call.x, call.w_gate, call.w_down)


FAMILY = dispatch.Family(
  implementations={
    "xla": dispatch.Backends(),
    "pallas": dispatch.Backends("triton", "triton", _triton),
  },
  rules=MOE_AUTO_RULES,
  declined=_triton,
  facts=lambda c, s: _MoEFacts(c.plan, dispatch.target()),
)


def decide(
  fn_name: str, implementation: str | None, plan: MoEPlan, x: Array, w_gate, w_down
) -> dispatch.Decision:
  """The backends of one MoE call (:func:`jaxact._src.core.dispatch.decide` of :data:`FAMILY`)."""
  return dispatch.decide(FAMILY, fn_name, implementation, _Call(plan, x, w_gate, w_down))
