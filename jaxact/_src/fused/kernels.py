"""The fused ops' kernel calls: the dense layer's matmul kernels (Triton or Mosaic GPU) and the
convolution's epilogue kernels, per shard, behind the platform switch.

The kernels (``pallas_kernels``) know nothing of jaxact: they take the activation as a
:class:`pallas_kernels.Epilogue` (:func:`jaxact._src.activations.resolve.epilogue`) and their tiles
as arguments. This module picks the tiles for the target that the decision carries, wraps the
kernels to run per shard (:mod:`jaxact._src.core.pallas_sharding`) and hands them, with the XLA
path, to :func:`jaxact._src.core.platform.switch`. ``pallas_kernels`` is imported on first use, so
``import jaxact`` does not load Pallas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jax import Array

from jaxact._src.activations.resolve import epilogue
from jaxact._src.core import pallas_sharding, platform

if TYPE_CHECKING:
  from jaxact._src.fused.plan import Plan


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
    from pallas_kernels.dense_mosaic import hopper_dense_bias_act_fwd

    return hopper_dense_bias_act_fwd(
      x, w, b, epilogue=ep, num_sms=d.target.sms, interpret=interpret
    )

  def triton_conv(x, w, b, *, interpret):
    z = linear(x, w)
    kernel = pallas_sharding.elementwise_forward(bias_act_fwd)
    return kernel(z, b, epilogue=ep, out_dtype=plan.out_dtype, interpret=interpret)

  mosaic = d.forward == "mosaic"
  if plan.linear.kind == "dense":
    kernels = pallas_sharding.dense_forward(mosaic_dense if mosaic else triton_dense, d.sharding)
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
    from pallas_kernels.dense_mosaic_bwd import hopper_dense_bias_act_bwd

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
    kernels = pallas_sharding.dense_backward(mosaic_dense if mosaic else triton_dense, d.sharding)
    return platform.switch((x, w, kept, g), kernels, xla, d, mosaic)
  return platform.switch((x, w, kept, g), triton_conv, xla, d, mosaic)
