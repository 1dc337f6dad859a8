"""What Flax's attention gives where jaxact's differs by design, put back for a routed call."""

from __future__ import annotations

import jax.numpy as jnp


def keyless_rows_as_flax(out, value, mask):
  """Flax's value for a query row whose every key is masked: the mean of the values (its masked
  logits are all one large negative number); jaxact's attention gives 0 there. `out` and `value`
  are ``(..., length, heads, head_dim)``, `mask` ``(..., heads or 1, q, k)`` or None."""
  if mask is None:
    return out
  keyless = ~jnp.any(jnp.asarray(mask, bool), axis=-1)  # (..., heads or 1, q)
  keyless = jnp.swapaxes(keyless, -1, -2)[..., None]  # (..., q, heads or 1, 1)
  mean = jnp.mean(value, axis=-3, keepdims=True).astype(out.dtype)  # (..., 1, heads, d)
  return jnp.where(keyless, mean, out)
