"""Which backend runs a gated call (``gated_dense``, ``gated_mlp``): the gated ops' rows of the one
decision point.

``implementation="pallas"`` takes the Triton kernels (:mod:`pallas_kernels.gated_triton`), forward
and backward pass; ``"mosaic"`` the Hopper forward (:mod:`pallas_kernels.gated_mosaic`) with the
Triton backward; either raises ``NotImplementedError`` with the reason when it cannot run the call
(:func:`triton_unsupported`, :func:`mosaic_unsupported`). ``None`` takes the first row of
:data:`GATED_AUTO_RULES` that holds, after the checks of the fused ops' common ground
(:func:`jaxact._src.core.dispatch.kernels_unsupported`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from jax import Array

from jaxact._src.activations import resolve
from jaxact._src.core import dispatch, pallas_sharding, shardings

if TYPE_CHECKING:
  from jaxact._src.gated.plan import GatedPlan


def triton_unsupported(plan: GatedPlan, x: Array, w_gate: Array, sharding) -> str | None:
  """Why the gated Triton kernels (:mod:`pallas_kernels.gated_triton`) cannot run this call in its
  `sharding` plan (:func:`~jaxact._src.core.pallas_sharding.gated_pattern`), or None."""
  why = dispatch.kernels_unsupported(plan, x, w_gate)
  if why is not None:
    return why
  hidden = plan.hidden_sharding
  hidden = None if hidden is None else shardings.spec_of_sharding(hidden, x.ndim)
  sharded = pallas_sharding.pattern_reason(sharding, x.ndim, hidden)
  if sharded is not None:
    return f"inputs sharded over a mesh: {sharded}"
  from pallas_kernels import allow_tf32

  try:
    allow_tf32(plan.precision)
  except NotImplementedError as e:
    return str(e)
  rule = plan.act.rule
  return dispatch.unlowered(rule.name, resolve.epilogue(rule))


def mosaic_unsupported(plan: GatedPlan, x: Array, w_gate: Array) -> str | None:
  """Why the gated Hopper forward (:mod:`pallas_kernels.gated_mosaic`) cannot run this call."""
  from pallas_kernels import gated_mosaic

  if np.dtype(plan.out_dtype) != np.dtype(x.dtype):
    return (
      f"output dtype {np.dtype(plan.out_dtype).name} differs from the operands' "
      f"{np.dtype(x.dtype).name} (the kernel writes a, b and h in the operands' dtype)"
    )
  if plan.precision is not None:
    return f"precision={plan.precision!r} (the kernel's wgmma takes the default precision only)"
  shape = (math.prod(x.shape[:-1]), *w_gate.shape)
  return gated_mosaic.gated_unsupported(shape, x.dtype, resolve.epilogue(plan.act.rule))


class _Call(NamedTuple):
  plan: GatedPlan
  x: Array
  w_gate: Array
  w_up: Array


@dataclasses.dataclass(frozen=True)
class _GatedFacts:
  """What the gated rules ask of one call."""

  plan: GatedPlan
  x: Array
  w_gate: Array
  target: dispatch.Target


# The gated ops' rules for implementation=None, tried after triton_unsupported.
GATED_AUTO_RULES: tuple[dispatch.Rule, ...] = (
  dispatch.Rule(
    "`gated_dense`, `gated_mlp`: every target",
    lambda f: True,
    "xla",
    "xla",
    "no GPU measurement supports the gated Triton kernels yet (they compile for H100 and A100 "
    "without spills; implementation='pallas' runs them)",
  ),
)


def _triton(call: _Call, sharding) -> str | None:
  return triton_unsupported(call.plan, call.x, call.w_gate, sharding)


FAMILY = dispatch.Family(
  implementations={
    "xla": dispatch.Backends(),
    "pallas": dispatch.Backends("triton", "triton", _triton),
    # The Mosaic GPU forward (both projections from one pass over x); the backward pass is the
    # Triton elementwise kernel, which Hopper runs.
    "mosaic": dispatch.Backends(
      "mosaic",
      "triton",
      lambda c, s: _triton(c, s) or mosaic_unsupported(c.plan, c.x, c.w_gate),
      instead=("pallas", "xla"),
    ),
  },
  rules=GATED_AUTO_RULES,
  declined=_triton,
  facts=lambda c, s: _GatedFacts(c.plan, c.x, c.w_gate, dispatch.target()),
  sharding=lambda c: pallas_sharding.gated_pattern(c.x, c.w_gate, c.w_up),
)


def decide(
  fn_name: str, implementation: str | None, plan: GatedPlan, x: Array, w_gate: Array, w_up: Array
) -> dispatch.Decision:
  """The backends for one gated call (:func:`jaxact._src.core.dispatch.decide` of
  :data:`FAMILY`): ``"pallas"`` takes the Triton kernels (:mod:`pallas_kernels.gated_triton`),
  forward and backward pass; ``"mosaic"`` the Hopper forward (:mod:`pallas_kernels.gated_mosaic`)
  with the Triton backward; either raises ``NotImplementedError`` with the reason when it cannot run
  the
  call. ``None`` takes the first row of :data:`GATED_AUTO_RULES` that holds."""
  return dispatch.decide(FAMILY, fn_name, implementation, _Call(plan, x, w_gate, w_up))


# Rows a block of the blocked XLA backward: the weight gradients' products then contract over 1024
# tokens a block (full-size matmuls on a GPU), and the (tokens, hidden) temporaries of a block are
# 1024 rows instead of every token's.
BACKWARD_ROWS = 1024


def backward_rows(plan: GatedPlan, tokens: int, weight_dtype) -> int | None:
  """The rows a block of the XLA backward, or None for one pass over every token: blocks where
  there are at least two of them, on one device's whole arrays (no mesh axes: the weight
  gradients' sums would cross devices), without dropout (its mask is drawn over the whole h), and
  where the weights are of the accumulation dtype (float32, float64): for 16-bit weights the
  blocks' float32 sums of the three weight gradients cost more than the blocks save (compiled for
  an H100, bf16, 8 scanned blocks of 8192 x 4096 x 11008: 5362 -> 5730 MiB, under block remat
  1478 -> 2017)."""
  split = lambda spec: spec is not None and any(spec)  # spec_of's: () where a dim is whole
  sharded = any(map(split, plan.shardings)) or plan.x_gather is not None
  if plan.decision.backward != "xla" or plan.dropout is not None or sharded:
    return None
  if np.dtype(weight_dtype) != np.dtype(plan.acc_dtype):
    return None
  return BACKWARD_ROWS if tokens >= 2 * BACKWARD_ROWS else None
