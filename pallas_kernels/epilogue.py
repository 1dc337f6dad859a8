"""The activation as every kernel takes it: forward and derivative functions, and the residual."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from jax import Array

Residual = Literal["output", "input", "none"]


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """The activation, as the kernels apply it (always to float32 values).

  Attributes:
    fn: ``y = fn(z)``, elementwise.
    derivative: ``act'`` from the residual: ``derivative(y)`` for ``residual="output"``,
      ``derivative(z)`` for ``"input"``; ignored (may be None) for ``"none"`` (identity).
    residual: what the forward keeps for the backward pass: ``"output"`` (``y``), ``"input"``
      (``z``, stored by the forward kernel as a second output) or ``"none"``.
  """

  fn: Callable[[Array], Array]
  derivative: Callable[[Array], Array] | None
  residual: Residual
