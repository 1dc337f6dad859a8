"""jaxact's side of the Pallas kernels (``pallas_kernels``): epilogues, support, platform switch.

The kernels know nothing of jaxact: they take the activation as an :class:`pallas_kernels.Epilogue`
(forward and derivative functions plus which residual is kept). This module builds one from a spec
row, says which fused calls the kernels support, and runs them behind
``jax.lax.platform_dependent`` so that the choice follows the platform a program is lowered for:

========================  ==========================  ==========================================
``implementation``        lowered for CUDA            lowered for any other platform (CPU, ...)
========================  ==========================  ==========================================
``"xla"``                 XLA                         XLA
``None``                  kernels if supported, XLA   XLA
``"pallas"``              kernels (else raises)       kernels in interpret mode (else raises)
========================  ==========================  ==========================================

``pallas_kernels`` is imported on first use, so ``import jaxact`` does not load Pallas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import Array, lax

from jaxact._src import pallas_sharding

_DTYPES = ("float32", "bfloat16", "float16")


def unsupported(plan: Any, dense: bool, x: Array, w: Array) -> str | None:
  """Why the kernels cannot run this fused call, or None when they can."""
  if not dense:
    return "only dense layers (and 1x1 convolutions) have kernels yet"
  rule = plan.act.rule
  if rule is None:
    return "the activation is a plain callable, not a jaxact spec activation"
  if rule.dynamic_names:
    return f"activation parameters given as arrays ({', '.join(rule.dynamic_names)})"
  for name, dtype in (("x", x.dtype), ("output", plan.out_dtype)):
    if np.dtype(dtype).name not in _DTYPES:
      return f"{name} dtype {np.dtype(dtype).name} (supported: {', '.join(_DTYPES)})"
  if np.dtype(plan.acc_dtype) != np.float32:
    return f"accumulation in {np.dtype(plan.acc_dtype).name} (the kernels accumulate in float32)"
  if 0 in x.shape or 0 in w.shape:
    return "zero-size operands"
  sharded = pallas_sharding.dense_reason(x, w)  # kernels under shard_map for the patterns it knows
  if sharded is not None:
    return f"inputs sharded over a mesh: {sharded}"
  from pallas_kernels import allow_tf32

  try:
    allow_tf32(plan.linear.precision)
  except NotImplementedError as e:
    return str(e)
  return None


def cuda_capable() -> bool:
  """False when this process sees a CUDA GPU older than compute capability 8.0 (Ampere).

  A program lowered for CUDA on a machine without one (abstract devices) is trusted to target
  Ampere or newer, the kernels' requirement.
  """
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return True
  return all(float(getattr(d, "compute_capability", "8.0")) >= 8.0 for d in devices)


def _epilogue(plan: Any):
  from pallas_kernels import Epilogue

  rule = plan.act.rule
  spec, params = rule.spec, dict(rule.static_params)

  def fn(z):
    return spec.fn(z, **params)

  derivative: Callable[[Array], Array] | None = None
  if rule.residual == "output":

    def derivative(y):
      return spec.d_output(y, **params)

  elif rule.residual == "input":

    def derivative(z):
      return spec.derivative_from_input(z, **params)

  return Epilogue(fn=fn, derivative=derivative, residual=rule.residual)


def _with_xla_derivatives(kernels: Callable[..., Any], xla: Callable[..., Any], interpret: bool):
  """`kernels`, differentiated as `xla` (the same function): Pallas calls have no JVP rule.

  Needed for forward-over-reverse (``jax.hessian``) of the fused ops, whose backward runs the
  kernels, and because ``platform_dependent`` differentiates every branch, the CUDA one included,
  whatever the platform.
  """

  @jax.custom_jvp
  def f(*args):
    return kernels(*args, interpret=interpret)

  @f.defjvp
  def f_jvp(primals, tangents):
    return f(*primals), jax.jvp(xla, primals, tangents)[1]

  return f


def _switch(args, kernels: Callable[..., Any], xla: Callable[..., Any], implementation: str):
  """`kernels` (with an `interpret` flag) or `xla`, by lowering platform."""
  gpu = _with_xla_derivatives(kernels, xla, interpret=False)
  if implementation == "pallas":
    cpu = _with_xla_derivatives(kernels, xla, interpret=True)
    return lax.platform_dependent(*args, cuda=gpu, default=cpu)
  return lax.platform_dependent(*args, cuda=gpu, default=xla)


def forward(plan: Any, implementation: str, x, w, b, xla: Callable[..., Any]):
  """``(y, z)`` as the XLA forward returns them (z only read for input residuals)."""
  from pallas_kernels import dense_bias_act_fwd

  def kernels(x, w, b, *, interpret):
    y, z = dense_bias_act_fwd(
      x,
      w,
      b,
      epilogue=_epilogue(plan),
      out_dtype=plan.out_dtype,
      precision=plan.linear.precision,
      interpret=interpret,
    )
    return y, z

  return _switch((x, w, b), pallas_sharding.dense_forward(kernels), xla, implementation)


def backward(plan: Any, implementation: str, x, w, kept, g, xla: Callable[..., Any]):
  """``(dx, dw, db)``; `kept` is the residual the forward kept (None for identity)."""
  from pallas_kernels import dense_bias_act_bwd

  def kernels(x, w, kept, g, *, interpret):
    return dense_bias_act_bwd(
      x,
      w,
      kept,
      g,
      epilogue=_epilogue(plan),
      has_bias=plan.has_bias,
      precision=plan.linear.precision,
      interpret=interpret,
    )

  return _switch((x, w, kept, g), pallas_sharding.dense_backward(kernels), xla, implementation)
