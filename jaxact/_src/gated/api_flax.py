"""What the gated family's two Flax layers (:mod:`jaxact._src.gated.linen`,
:mod:`jaxact._src.gated.nnx`) share: their call on promoted arrays, one :func:`jaxact.gated_mlp`
or, for dtypes it does not take, Flax's own computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxact._src.gated import api as gated
from jaxact._src.layers import common as layers


def layer_gated_mlp(
  activation,
  precision,
  x,
  w_gate,
  w_up,
  w_down,
  b_gate,
  b_up,
  b_down,
  dropped=None,
  layer="",
  out_sharding=None,
  residuals="projections",
) -> jax.Array:
  """``down(dropout(act(gate(x)) * up(x)))`` on promoted arrays, `dropped` the dropout's
  :func:`~jaxact._src.layers.common.dropout_kwargs` (None or {}: none): one
  :func:`jaxact.gated_mlp`, or, for dtypes it does not take (complex), Flax's three ``Dense``
  computations, the activation and Flax's dropout."""
  arrays = (x, w_gate, w_up, w_down, b_gate, b_up, b_down)
  dropped = dropped or {}
  if layers.fusable(*arrays):
    return gated.gated_mlp(
      *arrays,
      activation=activation,
      precision=precision,
      out_sharding=out_sharding,
      residuals=residuals,
      **dropped,
    )
  h = layers.activate(activation, _dense(x, w_gate, b_gate, precision))
  h = h * _dense(x, w_up, b_up, precision)
  return _dense(layers.drop(layer, h, dropped), w_down, b_down, precision, out_sharding)


def _dense(
  x: jax.Array, kernel: jax.Array, bias: jax.Array | None, precision, out_sharding=None
) -> jax.Array:
  """Flax ``Dense``'s computation on promoted arrays."""
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  y = jax.lax.dot_general(x, kernel, dims, precision=precision, out_sharding=out_sharding)
  if bias is not None:
    y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y
