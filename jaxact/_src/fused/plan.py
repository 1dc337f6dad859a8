"""The static plan of one fused call: the linear op (a matmul or a convolution), the activation,
the dtypes, the shardings and the backends; what every module of the family reads."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
from jax import Array, lax

from jaxact._src.activations.resolve import Act
from jaxact._src.core.dispatch import Decision
from jaxact._src.core.dropout import Dropout

# ---------------------------------------------------------------------------- the linear ops


@dataclasses.dataclass(frozen=True)
class Dense:
  kind: ClassVar[str] = "dense"
  precision: Any
  # Under Explicit mesh axes, the product's output sharding (jnp.dot's `out_sharding`); its
  # transposes, the backward's products, give x's and w's.
  out_sharding: Any = None

  def __call__(self, x: Array, w: Array, acc_dtype) -> Array:
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(
      x,
      w,
      dims,
      self.precision,
      preferred_element_type=acc_dtype,
      out_sharding=self.out_sharding,
    )

  def feature_axis(self, ndim: int) -> int:
    return ndim - 1

  def contraction_dims(self, ndim: int) -> tuple[int, int]:
    """The dimensions of x and w the product contracts."""
    return ndim - 1, 0


@dataclasses.dataclass(frozen=True)
class Conv:
  kind: ClassVar[str] = "conv"
  window_strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  dimension_numbers: lax.ConvDimensionNumbers
  feature_group_count: int
  precision: Any
  out_sharding: Any = None  # as Dense's

  def __call__(self, x: Array, w: Array, acc_dtype) -> Array:
    return lax.conv_general_dilated(
      x,
      w,
      self.window_strides,
      self.padding,
      self.lhs_dilation,
      self.rhs_dilation,
      self.dimension_numbers,
      self.feature_group_count,
      precision=self.precision,
      preferred_element_type=acc_dtype,
      out_sharding=self.out_sharding,
    )

  def feature_axis(self, ndim: int) -> int:
    return self.dimension_numbers.out_spec[1]

  def contraction_dims(self, ndim: int) -> tuple[int, int]:
    return self.dimension_numbers.lhs_spec[1], self.dimension_numbers.rhs_spec[1]


# ---------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one fused call."""

  linear: Dense | Conv
  act: Act
  acc_dtype: np.dtype  # accumulation and activation dtype
  out_dtype: np.dtype
  has_bias: bool
  decision: Decision = dataclasses.field(default_factory=Decision)  # fused/rules.py decides
  # The specs of x, w and b when their types carry Explicit-axes shardings: each cotangent is
  # resharded to its primal's (db, summed from dz, is split like the output's features, where b
  # may be replicated).
  shardings: tuple = (None, None, None)
  # The spec x is resharded to before the products (shardings.product_input), and kept in: its
  # contraction dimension split as w's is, gathered over the other axes (None: x as it is).
  x_gather: Any = None
  sharded: bool = False  # operands are or may be split over devices (shardings.spread)
  dropout: Dropout | None = None  # applied to the activation's output, inside the op

  def bias_shape(self, ndim: int, features: int) -> tuple[int, ...]:
    shape = [1] * ndim
    shape[self.linear.feature_axis(ndim)] = features
    return tuple(shape)
