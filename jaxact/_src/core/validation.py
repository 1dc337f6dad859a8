"""Argument checks shared by every public op: clear TypeError/ValueError at trace time."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_SCALARS = (int, float, bool, np.generic)


def is_arraylike(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, *_SCALARS)) or hasattr(x, "__jax_array__")


def as_real_array(fn_name: str, x, arg: str = "x") -> jax.Array:
  """`x` as a jax array; TypeError for non-arrays (lists included, as jax.nn) and complex dtypes."""
  if not is_arraylike(x):
    raise TypeError(
      f"jaxact.{fn_name}: `{arg}` must be a JAX/NumPy array or a scalar, got "
      f"{type(x).__module__}.{type(x).__qualname__}"
      + (" (wrap it with jnp.asarray)" if isinstance(x, (list, tuple)) else "")
    )
  # jnp.asarray of a traced jax.Array is a new value (under eager jax.vjp, a copy the pullback would
  # keep next to the caller's array), so arrays pass through untouched.
  if not isinstance(x, jax.Array):
    x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    raise TypeError(
      f"jaxact.{fn_name}: `{arg}` has complex dtype {x.dtype}; accepted: real arrays "
      "(float16, bfloat16, float32, float64, or integers where the argument takes them)"
    )
  return x


def is_floating(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def as_float_array(fn_name: str, x, arg: str = "x") -> jax.Array:
  """:func:`as_real_array`, refused (``TypeError`` naming `arg`) unless of a floating dtype."""
  x = as_real_array(fn_name, x, arg)
  if not is_floating(x.dtype):
    raise TypeError(
      f"jaxact.{fn_name}: `{arg}` has dtype {x.dtype}; accepted: floating-point dtypes "
      "(float16, bfloat16, float32, float64)"
    )
  return x


def positive_epsilon(fn_name: str, epsilon) -> float:
  """A norm's `epsilon` as a float, refused (``ValueError``) unless a positive finite number."""
  if (
    isinstance(epsilon, bool)
    or not isinstance(epsilon, numbers.Real)
    or not np.isfinite(epsilon)
    or epsilon <= 0
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `epsilon` must be a positive finite float; got {epsilon!r}"
    )
  return float(epsilon)


def compute_dtype(dtype) -> np.dtype:
  """Half precision is computed in float32; float32 and float64 in themselves."""
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def unknown_name(kind: str, name, known: Sequence[str]) -> ValueError:
  return ValueError(f"{kind} {name!r} is not known; choose one of: {', '.join(sorted(known))}")


def normalize_axes(fn_name: str, axis, ndim: int) -> tuple[int, ...]:
  """`axis` (int, tuple of ints, or None for all) as sorted non-negative ints, validated."""
  if axis is None:
    return tuple(range(ndim))
  axes = (axis,) if isinstance(axis, (int, np.integer)) else axis
  try:
    axes = tuple(axes)
  except TypeError:
    raise TypeError(
      f"jaxact.{fn_name}: `axis` must be an int, a tuple of ints or None, got {axis!r}"
    ) from None
  out = []
  for a in axes:
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
      raise TypeError(
        f"jaxact.{fn_name}: `axis` must be an int, a tuple of ints or None, got {axis!r}"
      )
    if not -ndim <= a < ndim:
      raise ValueError(
        f"jaxact.{fn_name}: `axis` {a} is out of range for an input of rank {ndim} "
        f"(accepted: {-ndim} to {ndim - 1})"
      )
    out.append(int(a) % ndim)
  if len(set(out)) != len(out):
    raise ValueError(f"jaxact.{fn_name}: `axis` {axis!r} repeats an axis")
  return tuple(sorted(out))


def check_broadcasts_to(fn_name: str, arg: str, value_shape, x_shape) -> None:
  try:
    ok = np.broadcast_shapes(tuple(value_shape), tuple(x_shape)) == tuple(x_shape)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
      f"jaxact.{fn_name}: `{arg}` has shape {tuple(value_shape)}, which does not broadcast to "
      f"the shape of `x` {tuple(x_shape)}"
    )


def require_flax(module: str) -> None:
  """ImportError naming the extra to install, when Flax (needed by `module` only) is missing."""
  try:
    import flax  # noqa: F401
  except ImportError as e:
    raise ImportError(
      f"{module} needs Flax, which is not installed: pip install 'jaxact[flax]' (or flax); "
      "the rest of jaxact does not"
    ) from e
