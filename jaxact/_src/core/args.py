"""Operand checks shared by the ops: arrays of one float dtype, the accumulation dtype, the
precision as the static plan holds it, and the convolution arguments (strides, padding, layouts).

Every check raises at trace time with the argument named, the value received and what is accepted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src.core import validation


def prepare(fn_name, x, w, b, preferred_element_type):
  """Arrays of one common float dtype (as ``x @ w + b`` promotes), accumulation and out dtypes."""
  arrays, acc_dtype, out_dtype = prepare_arrays(
    fn_name, {"x": x, "w": w, "b": b}, preferred_element_type
  )
  return arrays["x"], arrays["w"], arrays["b"], acc_dtype, out_dtype


def prepare_arrays(fn_name: str, arrays: dict[str, Any], preferred_element_type):
  """`arrays` (None entries stay None) as one common float dtype, as the op's arithmetic promotes
  them; the accumulation and output dtypes."""
  arrays = {
    k: None if v is None else validation.as_float_array(fn_name, v, k) for k, v in arrays.items()
  }
  dtype = jnp.result_type(*(v for v in arrays.values() if v is not None))
  # Convert only what differs: outside jit, astype to the same dtype still makes a new array, and
  # jax.vjp's pullback would then hold that copy of x next to the caller's x.
  arrays = {k: v if v is None or v.dtype == dtype else v.astype(dtype) for k, v in arrays.items()}
  out_dtype = dtype
  if preferred_element_type is not None:
    try:
      out_dtype = jax.dtypes.canonicalize_dtype(np.dtype(preferred_element_type))
    except TypeError:
      out_dtype = None
    if out_dtype is None or not validation.is_floating(out_dtype):
      raise TypeError(
        f"jaxact.{fn_name}: `preferred_element_type` {preferred_element_type!r} is not a "
        "floating-point dtype; accepted: None (the inputs' dtype), float16, bfloat16, float32, "
        "float64"
      )
  acc_dtype = jnp.promote_types(
    validation.compute_dtype(dtype), validation.compute_dtype(out_dtype)
  )
  return arrays, np.dtype(acc_dtype), np.dtype(out_dtype)


def check_bias(fn_name: str, b: Array | None, features: int, w: Array) -> None:
  if b is not None and b.shape != (features,):
    raise ValueError(
      f"jaxact.{fn_name}: `b` has shape {b.shape} but the output has {features} features "
      f"(w.shape={w.shape}); accepted: shape ({features},) or None"
    )


def hashable_precision(precision):
  # The precision is part of the jit-static plan; lax accepts a list of two as well as a tuple.
  return tuple(precision) if isinstance(precision, list) else precision


def channels_last(ndim: int) -> lax.ConvDimensionNumbers:
  """Flax's layout for any number of spatial dims: NWC/WIO, NHWC/HWIO, NDHWC/DHWIO, ..."""
  spatial = tuple(range(1, ndim - 1))
  return lax.ConvDimensionNumbers(
    lhs_spec=(0, ndim - 1, *spatial),
    rhs_spec=(ndim - 1, ndim - 2, *range(ndim - 2)),
    out_spec=(0, ndim - 1, *spatial),
  )


def int_tuple(fn_name: str, arg: str, value, n: int) -> tuple[int, ...]:
  values = (value,) * n if isinstance(value, (int, np.integer)) else value
  try:
    values = tuple(values)
  except TypeError:
    values = None
  if (
    values is None
    or len(values) != n
    or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in values)
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `{arg}` must be a positive int or a sequence of {n} positive ints (one "
      f"per spatial dimension); got {value!r}"
    )
  return tuple(int(v) for v in values)


def conv_padding(fn_name: str, padding, spatial, kernel, strides, lhs_dil, rhs_dil):
  """`padding` as one (low, high) pair per spatial dimension, strings resolved as lax does."""
  n = len(spatial)
  accepted = (
    f'"SAME", "SAME_LOWER", "VALID", an int, a sequence of {n} ints or of {n} (low, high) pairs'
  )
  if isinstance(padding, str):
    kind = padding.upper()
    if kind not in ("SAME", "SAME_LOWER", "VALID"):
      raise ValueError(
        f"jaxact.{fn_name}: `padding` {padding!r} is not known; accepted: {accepted}"
      )
    if kind == "VALID":
      return ((0, 0),) * n
    if lhs_dil != (1,) * n:
      # lax.conv_general_dilated refuses this too: which size should SAME preserve?
      raise ValueError(
        f"jaxact.{fn_name}: `padding` {padding!r} with lhs_dilation={lhs_dil} is ambiguous; give "
        "explicit (low, high) pairs"
      )
    dilated = [(k - 1) * r + 1 for k, r in zip(kernel, rhs_dil, strict=True)]
    return tuple(tuple(map(int, p)) for p in lax.padtype_to_pads(spatial, dilated, strides, kind))

  def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

  if is_int(padding):
    return ((int(padding), int(padding)),) * n
  try:
    pads = tuple(padding)
    if len(pads) == n and all(is_int(p) for p in pads):
      return tuple((int(p), int(p)) for p in pads)
    pairs = tuple(tuple(p) for p in pads)
    if len(pairs) == n and all(len(p) == 2 and all(map(is_int, p)) for p in pairs):
      return tuple((int(lo), int(hi)) for lo, hi in pairs)
  except TypeError:
    pass
  raise ValueError(f"jaxact.{fn_name}: `padding` must be {accepted}; got {padding!r}")


def dim_min(a, b):
  """The smaller of two sizes, either of which may be a symbolic dimension (``jax.export``'s
  shape polymorphism: ``min(t, 512)`` is then a dimension expression, not a Python bool)."""
  if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
    return min(int(a), int(b))
  from jax._src import core  # the one private import: jax has no public min of dimensions

  return core.min_dim(a, b)


def static_size(d) -> int:
  """`d` if it is a known size; 1 for a symbolic dimension (its least value)."""
  return 1 if jax.export.is_symbolic_dim(d) else int(d)
