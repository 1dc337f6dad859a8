"""The fused and gated ops' kernel calls: epilogues from the spec table, per-shard runs.

The kernels (``pallas_kernels``) know nothing of jaxact: they take the activation as a
:class:`pallas_kernels.Epilogue` and their tiles as arguments. This module builds the epilogue from
a spec row, picks the tiles for the target that :mod:`jaxact._src.core.dispatch` looked up, wraps
the kernels to run per shard (:mod:`jaxact._src.core.pallas_sharding`) and runs them behind the
platform switch (:func:`jaxact._src.core.platform.switch`).

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
  from jaxact._src.fused_vjp import Plan
  from jaxact._src.gated_vjp import GatedPlan


def _dense_shape(x: Array, w: Array) -> tuple[int, int, int]:
  return math.prod(x.shape[:-1]), *w.shape


def forward(plan: Plan, x, w, b, xla: Callable[..., Any], linear: Callable[..., Array]):
  """``(y, z)`` as the XLA forward returns them (z only read for input residuals).

  Dense layers run the fused matmul kernel; convolutions run ``linear(x, w)`` (XLA's convolution)
  followed by the one-pass bias + activation kernel.
  """
  from pallas_kernels import bias_act_fwd, default_block_config, dense_bias_act_fwd

  d, ep = plan.decision, epilogue(plan.act.rule)

  def triton_dense(x, w, b, *, interpret):
    return dense_bias_act_fwd(
      x,
      w,
      b,
      epilogue=ep,
      out_dtype=plan.out_dtype,
      precision=plan.linear.precision,
      block_config=default_block_config(
        _dense_shape(x, w), x.dtype, hopper=d.target.hopper, coded=ep.code is not None
      ),
      interpret=interpret,
    )

  def mosaic_dense(x, w, b, *, interpret):
    from pallas_kernels.hopper import hopper_dense_bias_act_fwd

    return hopper_dense_bias_act_fwd(
      x, w, b, epilogue=ep, num_sms=d.target.sms, interpret=interpret
    )

  def triton_conv(x, w, b, *, interpret):
    z = linear(x, w)
    kernel = pallas_sharding.elementwise_forward(bias_act_fwd)
    return kernel(z, b, epilogue=ep, out_dtype=plan.out_dtype, interpret=interpret)

  mosaic = d.forward == "mosaic"
  if plan.linear.kind == "dense":
    kernels = pallas_sharding.dense_forward(mosaic_dense if mosaic else triton_dense)
    return platform.switch((x, w, b), kernels, xla, d, mosaic)
  return platform.switch((x, w, b), triton_conv, xla, d, mosaic)


def backward(plan: Plan, x, w, kept, g, xla: Callable[..., Any], transposes, dz_dtype):
  """``(dx, dw, db)``; `kept` is the residual the forward kept (None for identity).

  Dense layers run the two fused backward matmul kernels; convolutions run the one-pass dz + db
  kernel, then ``transposes(x, w, dz)`` (XLA's transposed convolutions) for ``(dx, dw)``.
  """
  from pallas_kernels import bias_act_bwd, default_block_config, dense_bias_act_bwd

  d, ep = plan.decision, epilogue(plan.act.rule)

  def triton_dense(x, w, kept, g, *, interpret):
    return dense_bias_act_bwd(
      x,
      w,
      kept,
      g,
      epilogue=ep,
      has_bias=plan.has_bias,
      precision=plan.linear.precision,
      block_config=default_block_config(_dense_shape(x, w), x.dtype, hopper=d.target.hopper),
      interpret=interpret,
    )

  def mosaic_dense(x, w, kept, g, *, interpret):
    from pallas_kernels.hopper_bwd import hopper_dense_bias_act_bwd

    return hopper_dense_bias_act_bwd(
      x, w, kept, g, epilogue=ep, has_bias=plan.has_bias, interpret=interpret
    )

  def triton_conv(x, w, kept, g, *, interpret):
    dz, db = pallas_sharding.elementwise_backward(bias_act_bwd)(
      g, kept, epilogue=ep, has_bias=plan.has_bias, dz_dtype=dz_dtype, interpret=interpret
    )
    dx, dw = transposes(x, w, dz)
    return dx, dw, None if db is None else db.astype(x.dtype)

  mosaic = d.backward == "mosaic"
  if plan.linear.kind == "dense":
    kernels = pallas_sharding.dense_backward(mosaic_dense if mosaic else triton_dense)
    return platform.switch((x, w, kept, g), kernels, xla, d, mosaic)
  return platform.switch((x, w, kept, g), triton_conv, xla, d, mosaic)


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
