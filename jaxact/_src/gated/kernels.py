"""The gated ops' kernel calls: the gated projection (Triton, or the Hopper forward) and the
one-pass elementwise backward, per shard, behind the platform switch.

The kernels (:mod:`pallas_kernels.gated_triton`, :mod:`pallas_kernels.gated_mosaic`) take the
activation as a :class:`pallas_kernels.Epilogue` (:func:`jaxact._src.activations.resolve.epilogue`);
the matmuls of the backward pass and the down projection are XLA's either way. ``pallas_kernels`` is
imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxact._src.activations.resolve import epilogue
from jaxact._src.core import pallas_sharding, platform

if TYPE_CHECKING:
  from jaxact._src.gated.plan import GatedPlan


def forward(
  plan: GatedPlan, x, w_gate, w_up, b_gate, b_up, xla: Callable[..., Any], *, keep: bool = True
):
  """``(h, a, b)`` of a gated projection, as `xla` returns them, by the Triton forward kernel;
  without `keep` (no gradient to come) a and b are None and only h is written."""
  from pallas_kernels import gated_triton

  d, ep = plan.decision, epilogue(plan.act.rule)

  def triton(x, w_gate, w_up, b_gate, b_up, *, interpret):
    return gated_triton.gated_fwd(
      x,
      w_gate,
      w_up,
      b_gate,
      b_up,
      epilogue=ep,
      out_dtype=plan.out_dtype,
      keep=keep,
      precision=plan.precision,
      block_config=gated_triton.default_block_config(
        (math.prod(x.shape[:-1]), *w_gate.shape), x.dtype
      ),
      interpret=interpret,
    )

  def mosaic(x, w_gate, w_up, b_gate, b_up, *, interpret):
    from pallas_kernels import gated_mosaic

    a, b, h = gated_mosaic.gated_forward(
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
    args, pallas_sharding.gated_forward(kernels, d.sharding), xla, d, d.forward == "mosaic"
  )


def backward(plan: GatedPlan, gh, a, b, xla: Callable[..., Any], *, with_h: bool, grad_dtype):
  """``(da, db, h)`` from the cotangent `gh` of ``h = act(a) * b`` by the one-pass Triton kernel
  (h None unless `with_h`), as `xla` returns them: da and db in `grad_dtype`, h in a's dtype."""
  from pallas_kernels import gated_triton

  ep = epilogue(plan.act.rule)

  def triton(gh, a, b, *, interpret):
    return gated_triton.gated_bwd(
      gh, a, b, epilogue=ep, with_h=with_h, grad_dtype=grad_dtype, interpret=interpret
    )

  return platform.switch((gh, a, b), pallas_sharding.pointwise(triton), xla, plan.decision, False)
