"""``NormActConv`` for nnx: a norm, its activation and then a convolution, keeping one array for
the backward pass, the normalized input (why: :mod:`jaxact._src.norm_act.linen_conv`)."""

from __future__ import annotations

import jax
from flax import nnx

from jaxact._src.norm_act import api as norm_act
from jaxact._src.norm_act.nnx import ConvNormAct


class NormActConv(ConvNormAct):
  """``conv(activation(norm(x)))``, keeping only the norm's normalized input.

  Holds ``norm`` (:class:`jaxact.nnx.BatchNorm` or :class:`jaxact.nnx.GroupNorm` over the input's
  ``in_features`` channels, batch statistics updated as Flax updates them) and ``conv`` (Flax's
  ``nnx.Conv``), made by their own ``__init__`` from the same `rngs` in that order: a Flax module
  holding ``self.norm`` and ``self.conv`` made in that order has the same state. The norm keeps
  ``x_hat``; the scale, bias, activation and convolution run under ``jax.checkpoint`` from it, so
  the backward pass makes the activation again (elementwise) for the convolution's weight gradient
  and makes no convolution twice.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import NormActConv
    >>> layer = NormActConv(4, 8, (3, 3), norm="group", num_groups=2, activation="silu",
    ...                     rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 6, 6, 4))).shape, layer.norm.scale.shape
    ((2, 6, 6, 8), (4,))

  Args: :class:`ConvNormAct`'s; ``conv_use_bias`` defaults to True here, as ``nnx.Conv``'s
  ``use_bias`` (the convolution's output is not normalized by this layer).
  """

  _norm_first = True

  def __init__(self, *args, conv_use_bias: bool = True, **kwargs):
    super().__init__(*args, conv_use_bias=conv_use_bias, **kwargs)

  def __call__(self, x, use_running_average: bool | None = None):
    """The layer on `x` ``(batch, *spatial, channels)``; in training with a batch norm the batch
    statistics update ``norm.mean`` / ``norm.var``."""
    if isinstance(self.norm, nnx.BatchNorm):
      x_hat, scale, bias = self.norm._run(x, use_running_average, None, affine=False)
    else:
      x_hat, scale, bias = self.norm._run(x, None, affine=False)
    graph, state = nnx.split(self.conv)
    activation = self.norm.activation

    def run(x_hat, scale, bias, state):
      y = norm_act.activate(
        "jaxact.nnx.NormActConv",
        x_hat,
        scale,
        bias,
        activation=activation,
        feature_axes=(x_hat.ndim - 1,),
        out_dtype=x_hat.dtype,
      )
      return nnx.merge(graph, state)(y)

    # Saved: the arguments alone; the activation is made again from x_hat in the backward pass.
    return jax.checkpoint(run)(x_hat, scale, bias, state)
