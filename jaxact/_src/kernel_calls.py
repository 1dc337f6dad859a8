"""The gated ops' and the LM head's kernel calls: per-shard runs behind the platform switch.

The kernels (``pallas_kernels``) know nothing of jaxact: they take the activation as a
:class:`pallas_kernels.Epilogue` and their tiles as arguments. This module picks the tiles for
the target that :mod:`jaxact._src.core.dispatch` looked up, wraps the kernels to run per shard
(:mod:`jaxact._src.core.pallas_sharding`) and runs them behind the platform switch
(:func:`jaxact._src.core.platform.switch`).

``pallas_kernels`` is imported on first use, so ``import jaxact`` does not load Pallas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jax import Array

from jaxact._src.activations.resolve import epilogue
from jaxact._src.core import pallas_sharding, platform

if TYPE_CHECKING:
  from jaxact._src.gated_vjp import GatedPlan


def _dense_shape(x: Array, w: Array) -> tuple[int, int, int]:
  return math.prod(x.shape[:-1]), *w.shape


def gated_forward(
  plan: GatedPlan, x, w_gate, w_up, b_gate, b_up, xla: Callable[..., Any], *, keep: bool = True
):
  """``(h, a, b)`` of a gated projection, as `xla` returns them, by the Triton forward kernel;
  without `keep` (no gradient to come) a and b are None and only h is written."""
  from pallas_kernels import gated

  d, ep = plan.decision, epilogue(plan.act.rule)

  def triton(x, w_gate, w_up, b_gate, b_up, *, interpret):
    return gated.gated_fwd(
      x,
      w_gate,
      w_up,
      b_gate,
      b_up,
      epilogue=ep,
      out_dtype=plan.out_dtype,
      keep=keep,
      precision=plan.precision,
      block_config=gated.default_block_config(_dense_shape(x, w_gate), x.dtype),
      interpret=interpret,
    )

  def mosaic(x, w_gate, w_up, b_gate, b_up, *, interpret):
    from pallas_kernels import gated_hopper

    a, b, h = gated_hopper.gated_forward(
      x,
      w_gate,
      w_up,
      b_gate,
      b_up,
      epilogue=ep,
      num_sms=d.target.sms,
      keep_ab=keep,
      interpret=interpret,
    )
    return h, a, b

  # switch stages forced Mosaic kernels alone when the trace is for CUDA.
  kernels = {"triton": triton, "mosaic": mosaic}[d.forward]
  args = (x, w_gate, w_up, b_gate, b_up)
  return platform.switch(
    args, pallas_sharding.gated_forward(kernels), xla, d, d.forward == "mosaic"
  )


def gated_backward(plan: GatedPlan, gh, a, b, xla: Callable[..., Any], *, with_h: bool, grad_dtype):
  """``(da, db, h)`` from the cotangent `gh` of ``h = act(a) * b`` by the one-pass Triton kernel
  (h None unless `with_h`), as `xla` returns them: da and db in `grad_dtype`, h in a's dtype."""
  from pallas_kernels import gated

  ep = epilogue(plan.act.rule)

  def triton(gh, a, b, *, interpret):
    return gated.gated_bwd(
      gh, a, b, epilogue=ep, with_h=with_h, grad_dtype=grad_dtype, interpret=interpret
    )

  return platform.switch((gh, a, b), pallas_sharding.pointwise(triton), xla, plan.decision, False)


def lce_forward(plan, x, w, b, labels, xla: Callable[..., Any]):
  """``(lse, label logit, mean logit or None)`` of one device's tokens (all the vocabulary) by
  the Hopper forward kernel (:mod:`pallas_kernels.lce_hopper`); `xla` computes the same."""
  from pallas_kernels.lce_hopper import lce_fwd

  d, want_mean = plan.decision, plan.label_smoothing > 0

  def kernels(x, w, b, labels, *, interpret):
    return lce_fwd(
      x,
      w,
      b,
      labels,
      soft_cap=plan.soft_cap,
      want_mean=want_mean,
      num_sms=d.target.sms,
      interpret=interpret,
    )

  return platform.switch((x, w, b, labels), kernels, xla, d, mosaic=True)


def lce_backward(plan, x, w, b, labels, rows, xla: Callable[..., Any]):
  """``(G, db or None)`` of one block of vocabulary columns by the Hopper backward kernel
  (:mod:`pallas_kernels.lce_hopper_bwd`): G in x's dtype, db float32 ``(Vb,)``; `xla` computes
  the same from ``(x, w, b, labels, rows)``."""
  from pallas_kernels.lce_hopper_bwd import lce_bwd

  d = plan.decision

  def kernels(x, w, b, labels, rows, *, interpret):
    g, db = lce_bwd(
      x,
      w,
      b,
      labels,
      rows,
      soft_cap=plan.soft_cap,
      label_term=plan.label_smoothing != 1,
      uniform_term=plan.label_smoothing > 0,
      num_sms=d.target.sms,
      interpret=interpret,
    )
    return g, None if db is None else db.sum(0)

  return platform.switch((x, w, b, labels, rows), kernels, xla, d, mosaic=True)
