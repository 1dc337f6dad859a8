"""A dense or conv layer on a norm's output, or on its fused activation's (ResNet's BatchNorm ->
relu -> Conv, a diffusion U-Net's GroupNorm -> silu -> Conv): the layer keeps the norm's
normalized input ``x_hat``, which the norm keeps anyway, instead of its own input, and makes the
norm's scale, bias and activation again from it under ``jax.checkpoint`` in the backward pass
(``NormActConv``'s way: elementwise work made twice, no convolution). One array a norm where
there were two.

A swapped norm offers ``split`` (:func:`activations.offer`), a layer called on exactly its
output finds it (:func:`activations.normalized`) and runs its call through :func:`nnx_call` (nnx)
or ``linen._from_normalized`` (linen's view of the module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx

from jaxact._src.norm_act import api as norm_act_api
from jaxact._src.swap import activations

NOTE = ", its input made again from the norm's x_hat"  # after the layer's op in the report


def split(name: str, axes, run: Callable[[], tuple], out_dtype=None):
  """A norm's ``split``: ``() -> (x_hat, scale, bias, tail)``, computed once; `run()` gives
  ``(x_hat, scale, bias)`` (the norm without its scale, bias or activation, an op that keeps just
  x_hat), and ``tail(x_hat, scale, bias, activation)`` is the rest of the norm (its output in
  `out_dtype`, x_hat's where None), for the layer `name`."""

  @functools.cache
  def once():
    x_hat, scale, bias = run()
    out = x_hat.dtype if out_dtype is None else out_dtype

    def tail(x_hat, scale, bias, activation):
      activation = "identity" if activation is None else activation
      return norm_act_api.activate(
        name, x_hat, scale, bias, activation=activation, feature_axes=axes, out_dtype=out
      )

    return x_hat, scale, bias, tail

  return once


def nnx_source(layer, inputs, kwargs):
  """The offer of the norm whose output `inputs` is, where the swapped nnx `layer` (no activation
  of its own, no extra call arguments) may take it from the norm's x_hat; else None."""
  if layer.activation != "identity" or kwargs or activations.current() is None:
    return None
  return activations.normalized(inputs)


def nnx_call(layer, source, call_layer):
  """``call(**kwargs)``: ``call_layer(layer, z, **kwargs)`` on `z`, the norm's output made again
  from its x_hat under ``jax.checkpoint`` (the layer's attributes as they are when it is called,
  which the fusion sets); a ``rngs`` key travels as an argument."""

  def call(rngs=None, **kwargs):
    x_hat, scale, bias, tail = source.split()
    graph, state = nnx.split(layer)
    activation = source.activation

    def run(x_hat, scale, bias, state, rngs):
      z = tail(x_hat, scale, bias, activation)
      key = {} if rngs is None else {"rngs": rngs}
      with activations.inside():
        return call_layer(nnx.merge(graph, state), z, **kwargs, **key)

    return jax.checkpoint(run)(x_hat, scale, bias, state, rngs)

  return call
