"""Attention's kernel calls: :mod:`pallas_kernels.attention_triton` (Pallas Triton, CUDA),
:mod:`pallas_kernels.attention_splash` (splash attention, TPU) or the XLA path, by the decision and
the lowering platform.

Both passes exchange O ``(B, T, N, H)`` and the row statistics ``(B, N, 2, T)`` float32 in the
kernels' layout (the XLA path's (B, K, G, 2, T) is the same array reshaped); each backend reads only
the statistics its own forward wrote (the Triton kernels' row max is in their units, not the
logits'; splash writes each row's log-sum-exp and 0, which the XLA path would read alike), and
``lax.platform_dependent`` picks the same backend for both passes. Kernels asked for by name run on
every platform, in interpret mode off theirs; kernels that ``implementation=None`` chose run only
where the program is lowered for their platform, XLA elsewhere
(:func:`jaxact._src.core.platform.by_platform`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from jaxact._src.core import dispatch
from jaxact._src.core.platform import by_platform

_F32 = np.finfo(np.float32)
# Where ``q.k scale / c`` falls below float32's least normal number it is flushed to 0: the logit
# then errs by at most c times that number, 2**-40 for a cap of 2**86.
_CAP_MAX = 2.0**86


def _static(plan) -> dict[str, Any]:
  return dict(
    scale=plan.scale,
    causal=plan.causal,
    window=plan.window,
    soft_cap=plan.soft_cap,
    precision=plan.precision,
  )


def forward(plan, q, k, v, q_len, kv_len, xla: Callable[..., Any]):
  """``(o, stats)`` of the Triton forward kernel, or of `xla` (same arguments, same layouts)."""
  from pallas_kernels import attention_forward

  def kernel(q, k, v, q_len, kv_len, *, interpret):
    return attention_forward(q, k, v, q_len, kv_len, interpret=interpret, **_static(plan))

  return by_platform((q, k, v, q_len, kv_len), kernel, xla, plan.decision, "triton")


def backward(plan, q, k, v, o, stats, do, q_len, kv_len, xla: Callable[..., Any]):
  """``(dq, dk, dv)`` of the Triton backward kernels, or of `xla` (same arguments)."""
  from pallas_kernels import attention_backward

  def kernel(q, k, v, o, stats, do, q_len, kv_len, *, interpret):
    return attention_backward(
      q, k, v, o, stats, do, q_len, kv_len, interpret=interpret, **_static(plan)
    )

  args = (q, k, v, o, stats, do, q_len, kv_len)
  return by_platform(args, kernel, xla, plan.decision, "triton")


def triton_unsupported(plan, q, k, v, bias, aux) -> str | None:
  """Why the Triton attention kernels cannot run this call (`aux`: :class:`.plan.Aux`), or
  None."""
  if bias is not None:
    return "an additive `bias` (the kernels take causal, window and length masks)"
  if aux.mask is not None:
    return "a boolean `mask` array (the kernels take causal, window and length masks)"
  if aux.q_segments is not None:
    return "segment ids (the kernels take causal, window and length masks)"
  if plan.dropout is not None:
    return "dropout (the kernels draw no masks)"
  if plan.scale <= 0:
    return f"scale={plan.scale} (the kernels take a positive scale)"
  if plan.soft_cap is not None and not (
    _F32.tiny <= plan.scale / plan.soft_cap <= _F32.max and plan.soft_cap <= _CAP_MAX
  ):
    return (
      f"logits_soft_cap={plan.soft_cap} with scale={plan.scale} (the kernels' logits are "
      "c tanh(q.k scale / c): scale / c must be a normal float32 and c at most 2**86)"
    )
  from pallas_kernels import attention_unsupported

  return attention_unsupported(q.shape, k.shape, q.dtype, v_shape=v.shape, precision=plan.precision)


# ------------------------------------------------------------------------- splash (TPU)


def _splash_static(plan) -> dict[str, Any]:
  return dict(scale=plan.scale, causal=plan.causal, soft_cap=plan.soft_cap)


def splash_forward(plan, q, k, v, xla: Callable[..., Any]):
  """``(o, stats)`` of splash attention's forward (stats: each row's log-sum-exp, then 0), or of
  `xla` (same arguments, same layouts)."""
  from pallas_kernels.attention_splash import splash_forward as forward_

  def kernel(q, k, v, *, interpret):
    o, lse = forward_(q, k, v, interpret=interpret, **_splash_static(plan))
    return o, jnp.stack([lse, jnp.zeros_like(lse)], axis=2)

  return by_platform((q, k, v), kernel, xla, plan.decision, "splash")


def splash_backward(plan, q, k, v, o, stats, do, xla: Callable[..., Any]):
  """``(dq, dk, dv)`` of splash attention's backward kernels, or of `xla` (same arguments)."""
  from pallas_kernels.attention_splash import splash_backward as backward_

  def kernel(q, k, v, o, stats, do, *, interpret):
    lse = stats[:, :, 0] + stats[:, :, 1]  # m + log sum: the log-sum-exp either forward wrote
    return backward_(q, k, v, o, lse, do, interpret=interpret, **_splash_static(plan))

  return by_platform((q, k, v, o, stats, do), kernel, xla, plan.decision, "splash")


def splash_unsupported(plan, q, k, v, bias, aux) -> str | None:
  """Why splash attention cannot run this call (`aux`: :class:`.plan.Aux`), or None."""
  if bias is not None or aux.mask is not None:
    return "a `bias` or `mask` array (splash attention is run with a causal mask or none)"
  if aux.q_lengths is not None or aux.kv_lengths is not None or aux.q_segments is not None:
    return "lengths or segment ids (splash attention is run with a causal mask or none)"
  if plan.window is not None:
    return "`local_window_size` (splash attention is run with a causal mask or none)"
  if plan.dropout is not None:
    return "dropout (splash attention draws no masks)"
  if plan.precision is not None:
    return f"precision={plan.precision!r} (splash attention's products take none)"
  mesh = dispatch.context_mesh()
  auto = [a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Auto]
  if not mesh.empty and any(mesh.shape[a] > 1 for a in auto):
    return (
      f"Auto mesh axes {auto} (XLA would gather a kernel's operands whole onto every device): "
      "use Explicit axes, or call it inside shard_map"
    )
  from pallas_kernels.attention_splash import splash_unsupported as unsupported

  return unsupported(q.shape, k.shape, v.shape, q.dtype)
