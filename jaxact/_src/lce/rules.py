"""Which backend runs :func:`jaxact.linear_cross_entropy` and :func:`jaxact.linear_log_probs`: the
LM head's rows of the one decision point.

``"mosaic"`` takes the Hopper kernels (the forward's statistics, and the backward's blocks of
``G`` for XLA's products), raising ``NotImplementedError`` with the reason where they cannot run
(:func:`mosaic_unsupported`); ``"pallas"`` has no Triton kernel to take; ``None`` takes the first
row of :data:`LCE_AUTO_RULES` that holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from jax import Array, lax

from jaxact._src.core import dispatch, pallas_sharding, shardings

if TYPE_CHECKING:
  from jaxact._src.lce.plan import LcePlan


# linear_cross_entropy's and linear_log_probs' rules for implementation=None.
LCE_AUTO_RULES: tuple[dispatch.Rule, ...] = (
  dispatch.Rule(
    "`linear_cross_entropy`, `linear_log_probs`: every target",
    lambda f: True,
    "xla",
    "xla",
    "the vocabulary-blocked XLA path keeps no (tokens x vocabulary) array and matches the plain "
    "composition's CPU time; no GPU measurement supports the Hopper kernels yet",
  ),
)


def sharding_of(plan: LcePlan, x: Array, w: Array):
  """The dense pattern of ``x @ w`` (``x @ w.T`` for ``"vd"``), the contraction dimension whole on
  each device (gathered where it is split), or why no pattern covers the operands."""
  return pallas_sharding.dense_pattern(x, w, w_transposed=plan.w_layout == "vd", gather=True)


def per_device(pattern):
  """The call's sharding plan: `pattern` (:func:`sharding_of`'s) where the operands are split over
  devices, None where the loop runs as one program; raises for the patterns it cannot run per
  device."""
  if isinstance(pattern, str):
    raise NotImplementedError(
      f"jaxact.linear_cross_entropy: {pattern}; shard the tokens of `x` and the vocabulary of `w` "
      "over different mesh axes"
    )
  if pattern is None or not (pattern.data or pattern.model):
    return None
  return pattern


def mosaic_unsupported(plan: LcePlan, x: Array, w: Array, sharding) -> str | None:
  """Why the Hopper kernels of :func:`jaxact.linear_cross_entropy` (the forward, and the backward
  on blocks of ``plan.block`` columns) cannot run this call in its `sharding` pattern
  (:func:`sharding_of`'s), or None."""
  if np.dtype(plan.acc_dtype) != np.float32:
    return "float64 inputs (the kernel accumulates in float32)"
  if plan.predictions:
    return "return_predictions=True (the forward kernel does not track each token's argmax)"
  if plan.entropy:
    return "return_entropy=True (the kernels do not accumulate the entropy's moment)"
  if plan.temperature != 1:
    return f"temperature={plan.temperature} (the kernels do not divide the logits)"
  if plan.w_layout != "dv":
    return f"w_layout={plan.w_layout!r} (the kernels read w as (D, V))"
  if 0 in x.shape or 0 in w.shape:
    return f"zero-size operands (x.shape={x.shape}, w.shape={w.shape})"
  if np.dtype(x.dtype) != np.dtype(w.dtype):
    return f"x ({np.dtype(x.dtype).name}) and w ({np.dtype(w.dtype).name}) of different dtypes"
  if plan.precision not in (None, lax.Precision.DEFAULT, (None, None)):
    return f"precision={plan.precision!r} (the kernel multiplies at the operands' own precision)"
  if isinstance(sharding, str):
    return f"inputs sharded over a mesh: {sharding}"
  if sharding is not None and sharding.gathers:  # the kernels gather nothing
    return f"inputs sharded over a mesh: {sharding.gathers}"
  if sharding is not None and shardings.splits(sharding.mesh, sharding.model):
    return "the vocabulary split over devices (the kernel path runs data parallel only)"
  from pallas_kernels import lce_mosaic, lce_mosaic_bwd

  shape = pallas_sharding.dense_shard_shape(sharding, x, w)  # each device's block when sharded
  why = lce_mosaic.lce_unsupported(shape, x.dtype)
  whole = (math.prod(x.shape[:-1]), *w.shape)
  if why is not None and shape != whole:
    why = f"{why}, in each device's block ((tokens, D, V) = {shape})"
  if why is None and plan.by != "vocab":
    why = f"by={plan.by!r} (the backward kernel forms G a block of vocabulary columns at a time)"
  if why is None and w.shape[1] % plan.block:
    why = f"vocab_block_size={plan.block} does not divide V={w.shape[1]}"
  if why is None:
    why = lce_mosaic_bwd.lce_bwd_unsupported((shape[0], shape[1], plan.block), x.dtype)
    why = None if why is None else f"{why}, in a block of vocab_block_size={plan.block} columns"
  return why


class _Call(NamedTuple):
  plan: LcePlan
  x: Array
  w: Array


FAMILY = dispatch.Family(
  implementations={
    "xla": dispatch.Backends(),
    "pallas": dispatch.Backends(
      missing="has no Triton kernel for this op; use 'mosaic' (Hopper), 'xla' or None"
    ),
    # The forward kernel, and the backward kernel forming G for XLA's products.
    "mosaic": dispatch.Backends(
      "mosaic", "mosaic", lambda c, s: mosaic_unsupported(c.plan, c.x, c.w, s)
    ),
  },
  rules=LCE_AUTO_RULES,
  sharding=lambda c: sharding_of(c.plan, c.x, c.w),
  xla_sharded=True,  # the vocabulary loop runs per device too
  place=per_device,
)


def decide(fn_name: str, implementation: str | None, plan: LcePlan, x: Array, w: Array):
  """The backends for one :func:`jaxact.linear_cross_entropy` call
  (:func:`jaxact._src.core.dispatch.decide` of :data:`FAMILY`): ``"mosaic"`` takes the Hopper
  kernels (``NotImplementedError`` with the reason where they cannot run), ``"pallas"`` has no
  Triton kernel to take, ``None`` the first row of :data:`LCE_AUTO_RULES` that holds. Every backend
  runs in the call's sharding plan (:func:`per_device`), derived once."""
  return dispatch.decide(FAMILY, fn_name, implementation, _Call(plan, x, w))
