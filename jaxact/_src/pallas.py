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

On a Hopper target (the abstract mesh's device, else the CUDA devices this process sees: H100,
H200, ...), ``None`` runs dense layers with the Mosaic GPU forward kernel
(``pallas_kernels.hopper``) and XLA's backward, for the calls that kernel supports
(:func:`hopper_unsupported`), and XLA for the rest; ``"mosaic"`` forces the Hopper kernels, the
Mosaic GPU backward kernels too (interpret mode off CUDA). Why: :data:`HOPPER_BACKWARD` and
:data:`XLA_FASTER`.

``pallas_kernels`` is imported on first use, so ``import jaxact`` does not load Pallas.
"""

from __future__ import annotations

import math
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
    out_spec = plan.linear.dimension_numbers.out_spec
    if out_spec[1] != len(out_spec) - 1:
      return f"the convolution's output is not channels-last (out_spec={tuple(out_spec)})"
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
  if dense:
    sharded = pallas_sharding.dense_reason(x, w)  # kernels under shard_map for known patterns
  else:
    # The convolution stays XLA's (partitioned as usual); its epilogue kernels run per shard.
    sharded = pallas_sharding.elementwise_reason(x, plan.linear.dimension_numbers.lhs_spec[1])
    if sharded is None and any(pallas_sharding.spec_of(w)):
      sharded = "the convolution kernel `w` is sharded (only data-parallel convolutions are)"
  if sharded is not None:
    return f"inputs sharded over a mesh: {sharded}"
  if dense:
    from pallas_kernels import allow_tf32

    try:
      allow_tf32(plan.linear.precision)
    except NotImplementedError as e:
      return str(e)
  return None


# Where `implementation=None` keeps XLA although the kernels support the call, because XLA measured
# faster there (benchmarks/RESULTS.md, run 4: H100 80GB HBM3, jax 0.11.2, 2026-11-22). On Hopper,
# XLA's cuBLAS matmuls (wgmma) run at ~625-700 TFLOP/s in bf16 where the Triton dense kernels reach
# ~540-645 forward and 190-370 forward+backward: (8192, 4096, 4096) fwd+bwd 2.23 ms (relu) /
# 4.42 ms (gelu) against jaxact XLA's 1.25 / 1.40 and jax.nn's 1.24 / 1.32. (Their training-step
# temp is lower: 0 / 64 MiB against XLA's 96 / 192; `implementation="pallas"` still gives that.)
# The conv epilogue kernels are not affected: 0.99x jax.nn's step time for a 3x3 conv layer.
# Hopper dense layers the Mosaic GPU kernel takes run it instead (see HOPPER_BACKWARD); this entry
# covers the others.
XLA_FASTER = (("dense", "Hopper (H100/H200): the Triton matmul kernels are 1.5-3.4x slower"),)


# The Hopper path's backward, chosen by measurement (benchmarks/RESULTS.md, H100 80GB HBM3,
# jax 0.11.2, 2026-11-22, one bf16 layer's jit(vjp) step, ms): with the Mosaic GPU forward, XLA's
# backward (one fusion forming dz, and a bf16 dz fed to cuBLAS's dx and dw) beat the one-pass
# dz + db Pallas kernel before cuBLAS and the fused Triton backward kernels: (8192, 4096, 4096)
# relu 1.19 against 1.29 and 2.21, gelu 1.34 against 1.40 and 4.44; (16384, 1024, 4096) relu 0.76
# against 0.87 and 1.20. cuBLAS runs both backward products at ~700 TFLOP/s; the dz pass they read
# is ~6% of the step. The Mosaic GPU backward kernels (pallas_kernels.hopper, dz formed in shared
# memory inside both matmuls, run under "mosaic") were timed in runs 8-9 (same machine and jax):
# the backward alone, XLA's against theirs, (8192, 4096, 4096) relu 0.79 against 1.42 ms, gelu
# 0.90 against 4.18; (16384, 1024, 4096) relu 0.53 against 0.82, gelu 0.61 against 2.34 (their
# fastest tiling, hopper_bwd_tiles' default, of the five hopper_bwd_variants). Not fusing dz means
# forming it once per output tile: K / 256 times in dx and K / 128 in dw, which gelu's derivative
# cannot afford. Their memory does not argue for them in deep networks either: an 8-layer MLP step
# (8192 x 4096 layers) keeps 640 MiB with them against 576 with XLA's backward (relu), 1088 against
# 1024 (gelu), measured on the H100 (run 10) as benchmarks.aot compiles it: their dx is a new buffer
# beside g and the residual, which the kernels read to their end, where XLA's dz overwrites g in
# place and its dx reuses the residual's buffer (one layer's step alone: 0 MiB against 64).
HOPPER_BACKWARD = "xla"


def targets_hopper() -> bool:
  """Whether the program is being built for a Hopper GPU (see pallas_kernels.dense.is_hopper)."""
  from pallas_kernels.dense import is_hopper, target_device_kind

  return is_hopper(target_device_kind())


def hopper_unsupported(
  plan: Any, dense: bool, x: Array, w: Array, backward: bool = False
) -> str | None:
  """Why the Hopper (Mosaic GPU) forward kernel (and with `backward` the backward kernels too)
  cannot run this fused call, or None."""
  if not dense:
    return "the Hopper kernel is a dense layer (convolutions other than 1x1 are not)"
  why = unsupported(plan, dense, x, w)
  if why is not None:
    return why
  from pallas_kernels import hopper

  shape = pallas_sharding.dense_shard_shape(x, w)  # each device's block when sharded
  why = hopper.hopper_unsupported(shape, x.dtype, plan.out_dtype, _epilogue(plan))
  if why is None and backward:
    why = hopper.hopper_bwd_unsupported(shape, x.dtype, _epilogue(plan))
  whole = (math.prod(x.shape[:-1]), *w.shape)
  if why is not None and shape != whole:
    why = f"{why}, in each device's block of the sharded layer ((M, K, N) = {shape})"
  return why


def auto_prefers_xla(dense: bool) -> str | None:
  """Why ``implementation=None`` keeps XLA for a supported call on the target GPU, or None."""
  from pallas_kernels.dense import is_hopper, target_device_kind

  if dense and is_hopper(target_device_kind()):
    return XLA_FASTER[0][1]
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


def _targets_cuda() -> bool:
  """Whether this trace is for a CUDA GPU: an abstract mesh of CUDA devices, or a CUDA default
  backend."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None:
    return device.platform in ("cuda", "gpu")
  return jax.default_backend() == "gpu"


def _switch(
  args,
  kernels: Callable[..., Any],
  xla: Callable[..., Any],
  implementation: str,
  mosaic: bool = False,
):
  """`kernels` (with an `interpret` flag) or `xla`, by lowering platform.

  Forced kernels (``"pallas"``, ``"mosaic"``) run in interpret mode off CUDA. Mosaic GPU's
  interpreter is effectful (ordered host callbacks), and a ``platform_dependent`` whose other
  branch has effects does not lower for CUDA: when the trace is known to be for a CUDA GPU
  (:func:`_targets_cuda`), forced Mosaic kernels are staged alone.
  """
  gpu = _with_xla_derivatives(kernels, xla, interpret=False)
  if implementation == "pallas" and mosaic and _targets_cuda():
    return gpu(*args)
  if implementation == "pallas":
    cpu = _with_xla_derivatives(kernels, xla, interpret=True)
    return lax.platform_dependent(*args, cuda=gpu, default=cpu)
  return lax.platform_dependent(*args, cuda=gpu, default=xla)


def forward(plan: Any, implementation: str, x, w, b, xla: Callable[..., Any], linear):
  """``(y, z)`` as the XLA forward returns them (z only read for input residuals).

  Dense layers run the fused matmul kernel; convolutions run ``linear(x, w)`` (XLA's convolution)
  followed by the one-pass bias + activation kernel, in place.
  """
  from pallas_kernels import bias_act_fwd, dense_bias_act_fwd

  def dense_kernels(x, w, b, *, interpret):
    return dense_bias_act_fwd(
      x,
      w,
      b,
      epilogue=_epilogue(plan),
      out_dtype=plan.out_dtype,
      precision=plan.linear.precision,
      interpret=interpret,
    )

  def conv_kernels(x, w, b, *, interpret):
    z = linear(x, w)
    epilogue = pallas_sharding.elementwise_forward(bias_act_fwd)
    return epilogue(z, b, epilogue=_epilogue(plan), out_dtype=plan.out_dtype, interpret=interpret)

  def hopper_kernels(x, w, b, *, interpret):
    from pallas_kernels.hopper import hopper_dense_bias_act_fwd

    return hopper_dense_bias_act_fwd(x, w, b, epilogue=_epilogue(plan), interpret=interpret)

  if _is_dense(plan):
    mosaic = plan.kernels == "mosaic"
    kernels = hopper_kernels if mosaic else dense_kernels
    return _switch((x, w, b), pallas_sharding.dense_forward(kernels), xla, implementation, mosaic)
  return _switch((x, w, b), conv_kernels, xla, implementation)


def backward(
  plan: Any, implementation: str, x, w, kept, g, xla: Callable[..., Any], transposes, dz_dtype
):
  """``(dx, dw, db)``; `kept` is the residual the forward kept (None for identity).

  Dense layers run the two fused backward matmul kernels; convolutions run the one-pass dz + db
  kernel, then ``transposes(x, w, dz)`` (XLA's transposed convolutions) for ``(dx, dw)``.
  """
  from pallas_kernels import bias_act_bwd, dense_bias_act_bwd

  def dense_kernels(x, w, kept, g, *, interpret):
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

  def conv_kernels(x, w, kept, g, *, interpret):
    dz, db = pallas_sharding.elementwise_backward(bias_act_bwd)(
      g,
      kept,
      epilogue=_epilogue(plan),
      has_bias=plan.has_bias,
      dz_dtype=dz_dtype,
      interpret=interpret,
    )
    dx, dw = transposes(x, w, dz)
    return dx, dw, None if db is None else db.astype(x.dtype)

  def hopper_kernels(x, w, kept, g, *, interpret):
    from pallas_kernels.hopper import hopper_dense_bias_act_bwd

    return hopper_dense_bias_act_bwd(
      x, w, kept, g, epilogue=_epilogue(plan), has_bias=plan.has_bias, interpret=interpret
    )

  if _is_dense(plan):
    mosaic = plan.kernels == "mosaic"
    kernels = pallas_sharding.dense_backward(hopper_kernels if mosaic else dense_kernels)
    return _switch((x, w, kept, g), kernels, xla, implementation, mosaic)
  return _switch((x, w, kept, g), conv_kernels, xla, implementation)


def _is_dense(plan: Any) -> bool:
  return not hasattr(plan.linear, "dimension_numbers")
