"""The dropout key of one call of an nnx layer, as ``nnx.Dropout`` decides it (the fused and gated
layers' ``dropout_rate``, ``deterministic``, ``rngs`` and ``rng_collection``)."""

from __future__ import annotations

import jax
from flax import nnx


def dropout_key(layer: str, module, deterministic, rngs) -> jax.Array | None:
  """The dropout's key for one call of `module` (``dropout_rate``, ``deterministic``, ``rngs``,
  ``rng_collection`` attributes), None when it does not drop, as ``nnx.Dropout`` decides."""
  if module.dropout_rate == 0:
    return None
  deterministic = deterministic if deterministic is not None else module.deterministic
  if deterministic is None:
    raise ValueError(
      f"{layer}: no `deterministic` given (to the constructor, the call, model.train()/eval() or "
      "nnx.view) while dropout_rate > 0"
    )
  if deterministic:
    return None
  rngs = rngs if rngs is not None else module.rngs
  if isinstance(rngs, nnx.Rngs):
    return rngs[module.rng_collection]()
  if isinstance(rngs, nnx.RngStream):
    return rngs()
  if isinstance(rngs, jax.Array):
    return rngs
  raise TypeError(
    f"{layer}: dropout needs `rngs` (an nnx.Rngs, RngStream or key, given to the constructor or "
    f"the call); got {type(rngs).__name__}"
  )
