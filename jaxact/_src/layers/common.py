"""What jaxact's Flax layers (``jaxact.linen``, ``jaxact.nnx``) share.

The layers subclass Flax's ``Dense``/``Linear`` and ``Conv`` (its attributes; in nnx, its
``__init__`` makes the parameters), compute what Flax's call computes, step for step (parameter
creation in linen, dtype promotion, batch flattening, ``CIRCULAR``/``REFLECT``/``CAUSAL`` padding,
the kernel mask), and hand the matmul or convolution, the bias and the activation to
:func:`jaxact.dense_bias_act` / :func:`jaxact.conv_bias_act` as one op. What the fused op cannot
express (a custom ``dot_general`` / ``conv_general_dilated``, dtypes other than
real floating point) takes Flax's own computation followed by the activation.

Flax's two padding and batch-flattening steps are written once here (:class:`ConvInputs`); they
are plain array code that the fused op then receives, not fallbacks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from jaxact._src.activations import api as activations
from jaxact._src.codes import code as codes
from jaxact._src.core import dropout

Activation = str | Callable[..., jax.Array]


def check_activation(layer: str, activation) -> None:
  """TypeError/ValueError, naming the layer, for an `activation` no path could apply."""
  if isinstance(activation, str):
    try:
      activations.get_activation(activation)
    except ValueError as e:  # "activation 'relux' is not known; choose one of: ..."
      raise ValueError(f"{layer}: {e}") from None
  elif not callable(activation):
    raise TypeError(
      f"{layer}: `activation` must be an activation name (e.g. 'relu'), a jaxact activation "
      "function, a functools.partial of one with keyword parameters, or a callable; got "
      f"{type(activation).__name__} {activation!r}"
    )


def check_features(layer: str, name: str, value, *, optional: bool = False) -> None:
  """TypeError/ValueError, naming the layer and the attribute, unless `value` is a positive int
  (or None where `optional`)."""
  if value is None and optional:
    return
  accepted = "a positive int" + (" or None" if optional else "")
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{layer}: `{name}` must be {accepted}; got {type(value).__name__} {value!r}")
  if value <= 0:
    raise ValueError(f"{layer}: `{name}` must be {accepted}; got {value!r}")


def with_bits(layer: str, activation, residual_bits) -> Activation:
  """`activation` carrying ``residual_bits`` (the layers' attribute of that name), checked."""
  if residual_bits is None:
    return activation
  func = activation.func if isinstance(activation, functools.partial) else activation
  if isinstance(activation, str):
    func = activation = activations.get_activation(activation)
  name = getattr(func, "__name__", None)
  if (
    not callable(func)
    or name not in activations.ACTIVATIONS
    or (activations.get_activation(name) is not func)
  ):
    raise TypeError(
      f"{layer}: `residual_bits` applies to jaxact's own activations (a name, a jaxact function "
      f"or a functools.partial of one); got activation {activation!r}"
    )
  codes.check_bits(layer.removeprefix("jaxact."), name, residual_bits)
  return functools.partial(activation, residual_bits=residual_bits)


def activate(activation, y: jax.Array) -> jax.Array:
  """`activation` applied after Flax's own computation (the fallback path).

  A name stands for the jaxact function of that name, so its residual rule applies here too;
  ``"identity"`` returns `y` itself, whatever its dtype (complex included), as Flax's layer does.
  """
  if isinstance(activation, str):
    activation = activations.get_activation(activation)
  if activation is activations.identity:
    return y
  return activation(y)


def dropout_kwargs(rate: float, broadcast_dims, key) -> dict[str, Any]:
  """The dropout arguments of :func:`jaxact.dense_bias_act` for a layer that drops (else {})."""
  if key is None:
    return {}
  return {"dropout_rate": rate, "dropout_rng": key, "dropout_broadcast_dims": tuple(broadcast_dims)}


def drop(layer: str, y: jax.Array, kwargs: dict[str, Any]) -> jax.Array:
  """Flax's dropout of `y` by :func:`dropout_kwargs` (the paths that run Flax's computation)."""
  if not kwargs:
    return y
  d, data = dropout.check(
    layer, kwargs["dropout_rate"], kwargs["dropout_rng"], kwargs["dropout_broadcast_dims"], y.ndim
  )
  return y if d is None else d.apply(d.mask(data, y.shape), y)


def fusable(*arrays: jax.Array | None) -> bool:
  """Whether the fused op takes these (promoted) arrays: real floating point only."""
  return all(a is None or jnp.issubdtype(a.dtype, jnp.floating) for a in arrays)


def fused_out_dtype(preferred_element_type, bias: jax.Array | None):
  """The dtype Flax's ``dot_general(..., preferred_element_type=t) + bias`` ends in, or None.

  Flax adds the bias after the dot, in the promoted dtype, so the result is the promotion of the
  two; the fused op returns that dtype directly.
  """
  if preferred_element_type is None:
    return None
  if bias is None:
    return preferred_element_type
  return jnp.promote_types(preferred_element_type, bias.dtype)


def _broadcast(x: int | Sequence[int] | None, n: int) -> tuple[int, ...]:
  if x is None:  # Flax's backward-compatible sentinel for 1
    x = 1
  if isinstance(x, int):
    return (x,) * n
  return tuple(x)


@dataclasses.dataclass(frozen=True)
class ConvInputs:
  """Flax ``Conv``'s preparation of its input, and the inverse reshape of its output.

  Flax folds every batch dimension into one (adding one for unbatched input), pads explicitly for
  ``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'`` and then convolves with ``'VALID'``; the result
  gets the original batch dimensions back.
  """

  inputs: jax.Array
  strides: tuple[int, ...]
  padding: Any  # a lax padding: "SAME", "VALID", ... or (low, high) pairs
  input_dilation: tuple[int, ...]
  kernel_dilation: tuple[int, ...]
  batch_shape: tuple[int, ...] | None  # the batch dims to restore, None if there was one

  @classmethod
  def prepare(
    cls, inputs, kernel_size: tuple[int, ...], strides, padding, input_dilation, kernel_dilation
  ) -> ConvInputs:
    n = len(kernel_size)
    num_batch_dimensions = inputs.ndim - (n + 1)
    batch_shape = None
    if num_batch_dimensions != 1:
      batch_shape = inputs.shape[:num_batch_dimensions]
      inputs = jnp.reshape(inputs, (-1, *inputs.shape[num_batch_dimensions:]))
    strides = _broadcast(strides, n)
    input_dilation = _broadcast(input_dilation, n)
    kernel_dilation = _broadcast(kernel_dilation, n)
    padding_lax = canonicalize_padding(padding, n)
    if padding_lax in ("CIRCULAR", "REFLECT"):
      dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation, strict=True)]
      pads = [(0, 0), *[((k - 1) // 2, k // 2) for k in dilated], (0, 0)]
      mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding_lax]
      inputs = jnp.pad(inputs, pads, mode=mode)
      padding_lax = "VALID"
    elif padding_lax == "CAUSAL":
      if n != 1:
        raise ValueError("Causal padding is only implemented for 1D convolutions.")
      left_pad = kernel_dilation[0] * (kernel_size[0] - 1)
      inputs = jnp.pad(inputs, [(0, 0), (left_pad, 0), (0, 0)])
      padding_lax = "VALID"
    return cls(inputs, strides, padding_lax, input_dilation, kernel_dilation, batch_shape)

  def restore(self, y: jax.Array) -> jax.Array:
    if self.batch_shape is None:
      return y
    return jnp.reshape(y, self.batch_shape + y.shape[1:])


def conv_dimension_numbers(ndim: int):
  """Flax's channels-last dimension numbers (NWC/WIO, NHWC/HWIO, ...) for the fallback path."""
  lhs_spec = (0, ndim - 1, *range(1, ndim - 1))
  rhs_spec = (ndim - 1, ndim - 2, *range(ndim - 2))
  return jax.lax.ConvDimensionNumbers(lhs_spec, rhs_spec, lhs_spec)


def check_groups(layer: str, in_features: int, feature_group_count: int) -> None:
  if in_features % feature_group_count:
    raise ValueError(
      f"{layer}: the input has {in_features} features, which feature_group_count="
      f"{feature_group_count} does not divide"
    )


def check_mask(mask, kernel_shape: tuple[int, ...]) -> None:
  if mask is not None and mask.shape != kernel_shape:
    raise ValueError(
      f"Mask needs to have the same shape as weights. Shapes are: {mask.shape}, {kernel_shape}"
    )
