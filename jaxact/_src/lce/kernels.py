"""The LM head's kernel calls: the Hopper forward (:mod:`pallas_kernels.lce_mosaic`) and the
backward kernel forming ``G`` a block of vocabulary columns at a time
(:mod:`pallas_kernels.lce_mosaic_bwd`), behind the platform switch. ``pallas_kernels`` is imported
on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxact._src.core import platform


def forward(plan, x, w, b, labels, xla: Callable[..., Any]):
  """``(max, sum exp(s - max), label logit, max - mean logit or None)`` of one device's tokens
  (all the vocabulary) by the Hopper forward kernel (:mod:`pallas_kernels.lce_mosaic`); `xla`
  computes the same."""
  from pallas_kernels.lce_mosaic import lce_fwd

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


def backward(plan, x, w, b, labels, rows, xla: Callable[..., Any]):
  """``(G, db or None)`` of one block of vocabulary columns by the Hopper backward kernel
  (:mod:`pallas_kernels.lce_mosaic_bwd`): G in x's dtype, db float32 ``(Vb,)``; `xla` computes
  the same from ``(x, w, b, labels, rows)``."""
  from pallas_kernels.lce_mosaic_bwd import lce_bwd

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
