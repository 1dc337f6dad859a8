"""Attention's kernel calls: :mod:`pallas_kernels.attention_triton` (Pallas Triton) or the XLA
path, by the decision and the lowering platform.

Both passes exchange O ``(B, T, N, H)`` and the row statistics ``(B, N, 2, T)`` float32 in the
kernels' layout (the XLA path's (B, K, G, 2, T) is the same array reshaped); each backend reads only
the statistics its own forward wrote (the kernels' row max is in their units, not the logits'), and
``lax.platform_dependent`` picks the same backend for both passes. Kernels asked for by name run on
every platform, in interpret mode off CUDA; kernels that ``implementation=None`` chose run only
where the program is lowered for CUDA, XLA elsewhere (as :func:`jaxact._src.core.platform.switch`
does for the fused ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from jax import lax

from jaxact._src.core.dispatch import Decision

_F32 = np.finfo(np.float32)
# Where ``q.k scale / c`` falls below float32's least normal number it is flushed to 0: the logit
# then errs by at most c times that number, 2**-40 for a cap of 2**86.
_CAP_MAX = 2.0**86


def _switch(args, kernel: Callable[..., Any], xla: Callable[..., Any], d: Decision):
  gpu = functools.partial(kernel, interpret=False)
  if d.forced:
    return lax.platform_dependent(
      *args, cuda=gpu, default=functools.partial(kernel, interpret=True)
    )
  return lax.platform_dependent(*args, cuda=gpu, default=xla)


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

  return _switch((q, k, v, q_len, kv_len), kernel, xla, plan.decision)


def backward(plan, q, k, v, o, stats, do, q_len, kv_len, xla: Callable[..., Any]):
  """``(dq, dk, dv)`` of the Triton backward kernels, or of `xla` (same arguments)."""
  from pallas_kernels import attention_backward

  def kernel(q, k, v, o, stats, do, q_len, kv_len, *, interpret):
    return attention_backward(
      q, k, v, o, stats, do, q_len, kv_len, interpret=interpret, **_static(plan)
    )

  return _switch((q, k, v, o, stats, do, q_len, kv_len), kernel, xla, plan.decision)


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
