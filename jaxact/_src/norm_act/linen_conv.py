"""``NormActConv``: a norm, its activation and then a convolution (the pre-activation order of
diffusion U-Nets, VAEs and ResNet v2), keeping one array for the backward pass: the normalized
input.

The convolution's weight gradient needs its input ``activation(scale * x_hat + bias)``, which is
elementwise in ``x_hat``: the layer keeps ``x_hat`` (the norm keeps it for its own backward pass
anyway) and makes the activation again in the backward pass, so neither the activation's output nor
the convolution's input is kept, and no convolution is made twice (``ConvNormAct`` makes its
convolution again; this layer does not).
"""

from __future__ import annotations

import jax
from flax import linen as nn
from flax.linen import dtypes

from jaxact._src.norm_act import api as norm_act
from jaxact._src.norm_act.linen import ConvNormAct


class NormActConv(ConvNormAct):
  """``nn.Conv(...)(activation(norm(x)))``, keeping only the norm's normalized input.

  The variables of a Flax module that writes ``nn.BatchNorm()`` (or ``nn.GroupNorm()``), the
  activation and ``nn.Conv(features, kernel_size)`` in its ``@nn.compact`` call (``BatchNorm_0``
  or ``GroupNorm_0``, ``Conv_0``), so such checkpoints load as they are; the batch statistics are
  updated as Flax updates them. The norm normalizes `x` (:func:`jaxact.batch_norm_act` with
  neither scale nor bias, keeping that normalized ``x_hat``); the scale, bias, activation and
  convolution run under ``jax.checkpoint`` from ``x_hat``: the backward pass makes the activation
  again from it (elementwise) for the convolution's weight gradient. One activation-sized array a
  layer, and every convolution made once.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import NormActConv
    >>> layer = NormActConv(8, (3, 3), norm="group", num_groups=2, activation="silu")
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 6, 6, 4)))
    >>> jax.tree_util.tree_map(jnp.shape, variables["params"])
    {'Conv_0': {'bias': (8,), 'kernel': (3, 3, 4, 8)}, 'GroupNorm_0': {'bias': (4,), 'scale': (4,)}}
    >>> layer.apply(variables, jnp.ones((2, 6, 6, 4))).shape
    (2, 6, 6, 8)

  Attributes: :class:`ConvNormAct`'s; ``conv_use_bias`` defaults to True here, as ``nn.Conv``'s
  ``use_bias`` (the convolution's output is not normalized by this layer).
  """

  conv_use_bias: bool = True

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    """The layer on `x` ``(batch, *spatial, channels)``; in training with ``norm="batch"`` the
    batch statistics update ``batch_stats``."""
    layer = "jaxact.linen.NormActConv"
    conv, norm, call, train = self._layers(layer, use_running_average)
    if self.is_initializing():
      return conv(norm(x, **call))
    # x_hat and the batch statistics: the norm without scale, bias or activation, in x's dtype
    plain = norm.clone(
      parent=None, use_scale=False, use_bias=False, activation="identity", dtype=None
    )
    stats = {k: v for k, v in norm.variables.items() if k == "batch_stats"}
    if train:
      x_hat, updates = plain.apply(stats, x, **call, mutable=["batch_stats"])
      for name, value in updates["batch_stats"].items():
        norm.put_variable("batch_stats", name, value)
    else:
      x_hat = plain.apply(stats, x, **call)
    params = norm.variables.get("params", {})
    scale, bias = params.get("scale"), params.get("bias")
    out = dtypes.canonicalize_dtype(
      *(a for a in (x, scale, bias) if a is not None), dtype=self.dtype
    )
    conv_fn = conv.clone(parent=None)

    def run(x_hat, scale, bias, conv_vars):
      y = norm_act.activate(
        layer,
        x_hat,
        scale,
        bias,
        activation=self.activation,
        feature_axes=(x_hat.ndim - 1,),
        out_dtype=out,
      )
      return conv_fn.apply(conv_vars, y)

    # Saved: the arguments alone. The activation is made again from x_hat in the backward pass;
    # the convolution's output is no residual, so it is not.
    return jax.checkpoint(run)(x_hat, scale, bias, conv.variables)
