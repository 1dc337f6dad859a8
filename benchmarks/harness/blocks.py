"""A stack of blocks over stacked parameters, unrolled under ``jit`` or as ``jax.lax.scan``, and
its loss: the model the gated, fused, norms and H100 jobs measure their blocks in."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def stack(block, scan: bool):
  """``(forward, loss)`` of the blocks: ``params`` is a tuple of arrays each stacked ``(L, ...)``,
  ``block(x, p)`` takes one block's slice of them; the loss is the output's mean square."""

  def forward(params, x):
    if scan:
      x, _ = lax.scan(lambda x, p: (block(x, p), None), x, params)
    else:
      for i in range(params[0].shape[0]):
        x = block(x, tuple(w[i] for w in params))
    return x

  def loss(params, x):
    return jnp.mean(jnp.square(forward(params, x).astype(jnp.float32)))

  return forward, loss
