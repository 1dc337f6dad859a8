"""The static plan of one :func:`jaxact.batch_norm_act` / :func:`jaxact.group_norm_act` call."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxact._src.activations.resolve import Act
from jaxact._src.core.dispatch import Decision


@dataclasses.dataclass(frozen=True)
class NormActPlan:
  """Everything static about one call.

  The statistics are taken over `axes` of x's *view*: x itself for batch norm, x with its last
  (channel) axis split into ``(groups, channels // groups)`` for group norm (``groups`` > 0).
  """

  act: Act
  groups: int  # 0: batch norm (a statistic per feature); else group norm's number of groups
  axes: tuple[int, ...]  # the reduced axes of the view
  feature_axes: tuple[int, ...]  # x's axes that scale and bias run along
  epsilon: float
  acc: np.dtype  # statistics and arithmetic: float32, or float64 for float64 inputs
  x_dtype: np.dtype  # also the kept x_hat's dtype
  out_dtype: np.dtype
  axis_name: Any = None  # statistics averaged over this named axis (lax.pmean), as Flax's
  axis_index_groups: Any = None  # tuple of tuples, hashable
  # Under shard_map with typed (varying/invariant) values: the parameters are invariant over
  # axis_name while x varies, so their cotangents are summed over it (as autodiff's transpose of
  # the implicit broadcast does).
  psum_params: bool = False
  # the backends (rules.decide): XLA unless the kernels were chosen
  decision: Decision = dataclasses.field(default_factory=Decision)

  @property
  def dz_dtype(self) -> np.dtype | None:
    """The dtype the pre-activation's cotangent ``dz`` is rounded to, as autodiff of the 16-bit
    composition stores it: x's where it is narrower than the arithmetic, else None (no rounding)."""
    return self.x_dtype if np.dtype(self.x_dtype).itemsize < np.dtype(self.acc).itemsize else None

  def view_shape(self, shape) -> tuple[int, ...]:
    shape = tuple(shape)
    if not self.groups:
      return shape
    return (*shape[:-1], self.groups, shape[-1] // self.groups)

  def feature_shape(self, ndim: int, shape) -> tuple[int, ...]:
    """The broadcast shape of a parameter: x's sizes on the feature axes, 1 elsewhere."""
    return tuple(n if d in self.feature_axes else 1 for d, n in enumerate(shape[:ndim]))

  def others(self, ndim: int) -> tuple[int, ...]:
    """x's axes a parameter gradient sums over."""
    return tuple(d for d in range(ndim) if d not in self.feature_axes)
