"""Which backend runs a fused call (``dense_bias_act``, ``conv_bias_act``): the fused ops' rows of
the one decision point.

:func:`decide` takes a fused call's static plan, its operands and the lowering target and returns a
:class:`~jaxact._src.core.dispatch.Decision`: the backend of the forward and of the backward
(``"xla"``, ``"triton"``, ``"mosaic"``), whether the kernels were asked for by name, and, when
``implementation=None`` declined a kernel, why. The rules, in the order they are tried:

1. ``implementation="xla"``: XLA.
2. ``implementation="pallas"`` / ``"mosaic"``: the Triton / Mosaic GPU kernels, forward and
   backward, on every platform (interpret mode off CUDA); a call they cannot run raises
   ``NotImplementedError`` with the reason (:func:`triton_unsupported`, :func:`mosaic_unsupported`).
3. ``implementation=None``: the first row of :data:`AUTO_RULES` that holds. Kernels chosen there
   run only where the program is lowered for CUDA; lowered for anything else the call is XLA's.
   A call the kernels cannot run is XLA's, silently.

This module declares that as data (:data:`FAMILY`); the procedure is
:func:`jaxact._src.core.dispatch.decide`, the same for every family.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

from jax import Array

from jaxact._src.activations import resolve
from jaxact._src.core import dispatch, pallas_sharding, shardings

if TYPE_CHECKING:
  from jaxact._src.fused.plan import Plan


def sharding_of(plan: Plan, x: Array, w: Array):
  """The call's sharding plan: the dense pattern of ``x @ w`` (or why none covers the operands)
  for a dense layer, None for a convolution (XLA partitions it; its epilogue kernels run on the
  pre-activation as that array is split)."""
  if plan.linear.kind != "dense":
    return None
  return pallas_sharding.dense_pattern(x, w)


def triton_unsupported(plan: Plan, x: Array, w: Array, sharding) -> str | None:
  """Why the Triton kernels (and the kernels' common ground) cannot run this call in its
  `sharding` plan (:func:`sharding_of`), or None."""
  dense = plan.linear.kind == "dense"
  if not dense:
    out_spec = plan.linear.dimension_numbers.out_spec
    if out_spec[1] != len(out_spec) - 1:
      return f"the convolution's output is not channels-last (out_spec={tuple(out_spec)})"
  why = dispatch.kernels_unsupported(plan, x, w)
  if why is not None:
    return why
  out = plan.linear.out_sharding  # the caller's out_sharding (Explicit axes), or None
  out = None if out is None else shardings.spec_of_sharding(out, x.ndim)
  if dense:
    # kernels under shard_map for known patterns
    sharded = pallas_sharding.pattern_reason(sharding, x.ndim, out)
  else:
    # The convolution stays XLA's (partitioned as usual); its epilogue kernels run per shard.
    sharded = pallas_sharding.elementwise_reason(x, plan.linear.dimension_numbers.lhs_spec[1])
    if sharded is None and any(shardings.split_spec(w)):
      sharded = "the convolution kernel `w` is sharded (only data-parallel convolutions are)"
    if sharded is None and out is not None and out[plan.linear.dimension_numbers.out_spec[1]]:
      sharded = (
        f"out_sharding={shardings.pspec(out)} splits the output's features (the "
        "epilogue kernels split the batch only)"
      )
  if sharded is not None:
    return f"inputs sharded over a mesh: {sharded}"
  rule = plan.act.rule
  if rule.code is not None:  # packed along the features, which each device must fill bytes of
    if dense:
      features = pallas_sharding.dense_shard_shape(sharding, x, w)[2]
    else:
      features = w.shape[plan.linear.dimension_numbers.rhs_spec[0]]
    why = resolve.epilogue(rule).code.unsupported(features)
    if why is not None:
      return f"residual_bits={rule.code.bits}: {why}"
  if dense:
    from pallas_kernels import allow_tf32

    try:
      allow_tf32(plan.linear.precision)
    except NotImplementedError as e:
      return str(e)
  return None


def mosaic_unsupported(
  plan: Plan, x: Array, w: Array, sharding, backward: bool = False
) -> str | None:
  """Why the Mosaic GPU forward kernel (with `backward`, the backward kernels too) cannot run this
  call in its `sharding` plan, or None."""
  if plan.linear.kind != "dense":
    return "the Hopper kernel is a dense layer (convolutions other than 1x1 are not)"
  why = triton_unsupported(plan, x, w, sharding)
  if why is not None:
    return why
  from pallas_kernels import dense_mosaic, dense_mosaic_bwd

  shape = pallas_sharding.dense_shard_shape(sharding, x, w)  # each device's block when sharded
  epilogue = resolve.epilogue(plan.act.rule)
  why = dense_mosaic.hopper_unsupported(shape, x.dtype, plan.out_dtype, epilogue)
  if why is None and backward:
    why = dense_mosaic_bwd.hopper_bwd_unsupported(shape, x.dtype, epilogue)
  whole = (math.prod(x.shape[:-1]), *w.shape)
  if why is not None and shape != whole:
    why = f"{why}, in each device's block of the sharded layer ((M, K, N) = {shape})"
  return why


class _Call(NamedTuple):
  plan: Plan
  x: Array
  w: Array


class _Facts:
  """What the rules ask of one call, each fact computed on first use."""

  def __init__(self, call: _Call, sharding):
    self.plan, self.x, self.w, self.sharding = call.plan, call.x, call.w, sharding
    self.target = dispatch.target()
    self.dense = call.plan.linear.kind == "dense"

  @functools.cached_property
  def mosaic_forward(self) -> bool:
    why = mosaic_unsupported(self.plan, self.x, self.w, self.sharding)
    return self.target.hopper and why is None


AUTO_RULES: tuple[dispatch.Rule, ...] = (
  dispatch.Rule(
    "Hopper target, a dense layer keeping a 4- or 2-bit derivative code",
    lambda f: (
      f.target.hopper
      and f.dense
      and f.plan.act.rule.code is not None
      and f.plan.act.rule.code.bits < 8
    ),
    "xla",
    "xla",
    "the Mosaic GPU forward packs 4- and 2-bit codes with a second wgmma in its epilogue, which "
    "spills 132-212 bytes a thread compiled for the H100 (the z-writing forward: 44-56) and has "
    "not been timed on a GPU",
  ),
  dispatch.Rule(
    "Hopper target, a dense layer the Mosaic GPU forward kernel takes",
    lambda f: f.mosaic_forward,
    "mosaic",
    "xla",
    "the Mosaic GPU forward runs at or above jnp.dot's rate and writes z beside y in its epilogue; "
    "XLA's backward (one dz fusion, cuBLAS dx and dw) ran 1.8x (relu) to 4.7x (gelu) faster than "
    "the Mosaic GPU backward kernels, which also keep one activation more in a deep network",
    "results/gpu.md: The backward alone: Mosaic GPU kernels against XLA's, bf16",
  ),
  dispatch.Rule(
    "Hopper target, other dense layers",
    lambda f: f.target.hopper and f.dense,
    "xla",
    "xla",
    "the Triton matmul kernels are 1.7-3.4x slower than XLA's cuBLAS matmuls on Hopper",
    "results/gpu.md: One dense layer, bf16",
  ),
  dispatch.Rule(
    "CUDA GPU older than Ampere (compute capability < 8.0)",
    lambda f: not f.target.ampere_or_newer,
    "xla",
    "xla",
    "the Triton kernels need compute capability 8.0 or newer",
  ),
  dispatch.Rule(
    "CUDA (Ampere or newer; convolution epilogues on Hopper too)",
    lambda f: True,
    "triton",
    "triton",
    "the Triton kernels keep only what the backward needs (no dz array between the passes); "
    "convolution epilogues measured at 86-91% (forward) and 72-86% (backward) of the H100's copy "
    "bandwidth; dense layers on Ampere/Ada are unmeasured",
    "results/gpu.md: Conv layer and its epilogue kernels, bf16",
  ),
)


def _triton(call: _Call, sharding) -> str | None:
  return triton_unsupported(call.plan, call.x, call.w, sharding)


FAMILY = dispatch.Family(
  implementations={
    "xla": dispatch.Backends(),
    "pallas": dispatch.Backends("triton", "triton", _triton),
    "mosaic": dispatch.Backends(
      "mosaic", "mosaic", lambda c, s: mosaic_unsupported(c.plan, c.x, c.w, s, backward=True)
    ),
  },
  rules=AUTO_RULES,
  declined=_triton,
  facts=_Facts,
  sharding=lambda c: sharding_of(c.plan, c.x, c.w),
)


def decide(
  fn_name: str, implementation: str | None, plan: Plan, x: Array, w: Array
) -> dispatch.Decision:
  """The backends for one fused call (:func:`jaxact._src.core.dispatch.decide` of :data:`FAMILY`).
  Raises ``NotImplementedError`` when kernels asked for by name cannot run the call."""
  return dispatch.decide(FAMILY, fn_name, implementation, _Call(plan, x, w))
