"""Argument handling of the fused ops: the activation argument and the operands, checked.

Every check raises at trace time with the argument named, the value received and what is accepted.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src import activations, codes, validation
from jaxact._src.fused_vjp import Act
from jaxact._src.spec import ALIASES, ActivationSpec

# ------------------------------------------------------------------------ activation resolution


@functools.cache
def _jaxact_functions() -> dict[Callable[..., Array], str]:
  """Every public jaxact activation function (aliases are the same object) to its spec name."""
  return {activations.get_activation(name): name for name in activations.ACTIVATIONS}


# The namespaces whose functions of a spec row's name (or alias) compute that row's activation with
# the same parameters: jax.nn, and Flax's re-exports of it.
# Checked by tests/test_activation_resolution.py against the functions' signatures and values.
FOREIGN_NAMESPACES = ("jax.nn", "flax.linen", "flax.nnx")


@functools.cache
def _foreign_functions(loaded: tuple[str, ...]) -> dict[Callable[..., Array], str]:
  """The functions of the `loaded` namespaces named as a spec row (or its alias), to its name."""
  names = [*activations.ACTIVATIONS, *ALIASES]
  found = {}
  for module in loaded:
    namespace = sys.modules[module]
    for name in names:
      f = getattr(namespace, name, None)
      if callable(f):
        with contextlib.suppress(TypeError):  # unhashable: not a function of the namespace's
          found.setdefault(f, activations.get_spec(name).name)
  return found


def _jaxact_name(f) -> str | None:
  """The spec name of `f` if it is a public jaxact activation function or one of jax.nn's (or
  Flax's re-export of it), else None."""
  try:
    name = _jaxact_functions().get(f)
    if name is None:
      loaded = tuple(m for m in FOREIGN_NAMESPACES if m in sys.modules)
      name = _foreign_functions(loaded).get(f)
    return name
  except TypeError:  # unhashable callable objects are not activation functions
    return None


def _describe(activation) -> str:
  if isinstance(activation, functools.partial):
    return f"functools.partial({getattr(activation.func, '__name__', activation.func)!r}, ...)"
  return getattr(activation, "__name__", type(activation).__name__)


def _spec_and_values(
  fn_name: str, activation
) -> tuple[ActivationSpec, dict[str, Any]] | Callable[..., Any]:
  """The spec row and parameter values `activation` stands for, or a callable to autodiff.

  Names, jaxact functions and jax.nn's (flax's re-exports included) give their spec row with
  default parameters; a ``functools.partial`` of one of these functions with keyword arguments only
  gives the row with those parameters. Anything
  else callable, and glu/softmax/log_softmax (not elementwise: their output shape or a whole-axis
  normalisation does not fit the one-``dz`` rule), is returned as a callable.
  """
  if isinstance(activation, str):
    try:
      func = activations.get_activation(activation)
    except ValueError as e:
      raise ValueError(f"jaxact.{fn_name}: {e}") from None
    keywords: dict[str, Any] = {}
  elif isinstance(activation, functools.partial) and _jaxact_name(activation.func) is not None:
    func, keywords = activation.func, dict(activation.keywords)
    if activation.args:  # partial(f, a)(z) is f(a, z): not a parametrised activation
      return activation
  elif callable(activation):
    if _jaxact_name(activation) is None:
      return activation
    func, keywords = activation, {}
  else:
    raise TypeError(
      f"jaxact.{fn_name}: `activation` must be an activation name (e.g. 'relu'), a jaxact "
      "activation function, a functools.partial of one with keyword parameters, or a callable; "
      f"got {type(activation).__name__} {activation!r}"
    )
  spec = activations.get_spec(_jaxact_name(func))
  if not spec.elementwise:
    return functools.partial(func, **keywords) if keywords else func
  known = {p.name: p.default for p in spec.params}
  if "residual_bits" in keywords:  # jaxact's own keyword: validated here, with the reason
    known["residual_bits"] = codes.check_bits(fn_name, spec.name, keywords["residual_bits"])
  unknown = sorted(set(keywords) - set(known))
  if unknown:
    accepted = ", ".join(known) or "none"
    raise TypeError(
      f"jaxact.{fn_name}: `activation` {_describe(activation)} sets {', '.join(unknown)}, which "
      f"jaxact.{spec.name} does not take; its parameters: {accepted}"
    )
  return spec, known | keywords


def resolve_activation(fn_name: str, activation, z: jax.ShapeDtypeStruct, arg_dtype):
  """`activation` as a static :class:`Act` and the arrays that go through the ``custom_vjp``.

  `z` is the pre-activation (shape, compute dtype); `arg_dtype` the dtype a plain callable is
  given. The residual decision is :func:`activations._split_params`'s: Python-number parameters
  are static, traced array parameters (whose gradient is then computed) and parameters for which
  the output does not determine the derivative make the pre-activation the residual.
  """
  resolved = _spec_and_values(fn_name, activation)
  if callable(resolved):
    try:
      fn, consts = jax.closure_convert(resolved, jax.ShapeDtypeStruct(z.shape, arg_dtype))
    except TypeError as e:
      raise TypeError(
        f"jaxact.{fn_name}: calling `activation` {_describe(resolved)} failed: {e}"
      ) from e
    return Act(fn=fn), list(consts)
  spec, values = resolved
  bits = values.pop("residual_bits", None)
  for p in spec.params:
    v = values[p.name]
    if not p.static and validation.is_arraylike(v) and not isinstance(v, (int, float)):
      shape = np.shape(v)
      try:
        ok = np.broadcast_shapes(shape, z.shape) == z.shape
      except ValueError:
        ok = False
      if not ok:
        raise ValueError(
          f"jaxact.{fn_name}: activation parameter `{p.name}` of jaxact.{spec.name} has shape "
          f"{shape}, which does not broadcast to the pre-activation shape {z.shape}"
        )
  rule, dynamic = activations._split_params(spec, z, values)
  return Act(rule=activations.with_code(rule, bits)), dynamic


# --------------------------------------------------------------------------- operand checks


def _as_float_array(fn_name: str, v, arg: str) -> Array:
  v = validation.as_real_array(fn_name, v, arg)
  if not validation.is_floating(v.dtype):
    raise TypeError(
      f"jaxact.{fn_name}: `{arg}` has dtype {v.dtype}; accepted: floating-point dtypes "
      "(float16, bfloat16, float32, float64)"
    )
  return v


def prepare(fn_name, x, w, b, preferred_element_type):
  """Arrays of one common float dtype (as ``x @ w + b`` promotes), accumulation and out dtypes."""
  arrays, acc_dtype, out_dtype = prepare_arrays(
    fn_name, {"x": x, "w": w, "b": b}, preferred_element_type
  )
  return arrays["x"], arrays["w"], arrays["b"], acc_dtype, out_dtype


def prepare_arrays(fn_name: str, arrays: dict[str, Any], preferred_element_type):
  """`arrays` (None entries stay None) as one common float dtype, as the op's arithmetic promotes
  them; the accumulation and output dtypes."""
  arrays = {k: None if v is None else _as_float_array(fn_name, v, k) for k, v in arrays.items()}
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
