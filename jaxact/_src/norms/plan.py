"""The static plan of one :func:`jaxact.rms_norm` / :func:`jaxact.layer_norm` call."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

Residual = Literal["output", "input"]


@dataclasses.dataclass(frozen=True)
class NormPlan:
  """Everything static about one norm call."""

  center: bool  # layer norm subtracts the mean; RMS norm does not
  axes: tuple[int, ...]
  epsilon: float
  residual: Residual
  acc: np.dtype  # statistics and arithmetic: float32, or float64 for float64 inputs
  x_dtype: np.dtype
  out_dtype: np.dtype  # x's, or a Flax layer's promoted dtype
  scale_offset: float = 0.0  # gamma = scale_offset + scale (Gemma: 1)
  # Explicit mesh axes: the specs of x, scale, bias (their cotangents' types) and y's sharding
  # when the caller asked for one (y is resharded to it, and kept so).
  shardings: tuple = (None, None, None)
  out_sharding: Any = None

  def feature_shape(self, x_shape) -> tuple[int, ...]:
    """The broadcast shape of a parameter: x's sizes on the normalized axes, 1 elsewhere."""
    return tuple(n if d in self.axes else 1 for d, n in enumerate(x_shape))
