"""The plain formulas of :func:`jaxact.dense_bias_act` and :func:`jaxact.conv_bias_act`, for the
tests: ``act(x @ w + b)`` and ``act(conv(x, w) + b)`` written with jax.nn and lax, which JAX
differentiates; nothing here is fused or custom.

Each takes the activation as a function (e.g. :func:`jaxact._src.activations.reference.jax_nn`) and
returns ``f(x, w, b=None)``.
"""

from __future__ import annotations

from jax import lax

from jaxact._src.activations.reference import jax_nn as reference_activation

__all__ = ["conv_reference", "dense_reference", "reference_activation"]


def dense_reference(act):
  def f(x, w, b=None):
    z = x @ w
    return act(z if b is None else z + b)

  return f


def conv_reference(act, **conv):
  n = conv.pop("n")
  dn = (
    conv.pop("dimension_numbers", None)
    or {
      1: ("NWC", "WIO", "NWC"),
      2: ("NHWC", "HWIO", "NHWC"),
      3: ("NDHWC", "DHWIO", "NDHWC"),
    }[n]
  )
  strides = conv.pop("window_strides", 1)
  padding = conv.pop("padding", "SAME")
  if isinstance(padding, int):
    padding = ((padding, padding),) * n
  if padding == "VALID":  # lax takes no string padding with lhs_dilation
    padding = ((0, 0),) * n
  kw = {
    k: (v,) * n if isinstance(v, int) and k != "feature_group_count" else v for k, v in conv.items()
  }

  def f(x, w, b=None):
    s = (strides,) * n if isinstance(strides, int) else strides
    z = lax.conv_general_dilated(x, w, s, padding, dimension_numbers=dn, **kw)
    if b is not None:
      out_dn = lax.conv_dimension_numbers(x.shape, w.shape, dn).out_spec
      shape = [1] * z.ndim
      shape[out_dn[1]] = b.shape[0]
      z = z + b.reshape(shape)
    return act(z)

  return f
