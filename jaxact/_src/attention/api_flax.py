"""What Flax's two ``attention_fn`` signatures (:mod:`jaxact._src.attention.linen`,
:mod:`jaxact._src.attention.nnx`) share: Flax's arguments turned into one
:func:`jaxact.dot_product_attention` call (any number of batch axes merged into one, masks of any
dtype read as Flax reads them, Flax's dropout arguments, ``module`` refused by name).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxact._src.attention.api import dot_product_attention as _attention


def refusal(which: str, msg: str) -> NotImplementedError:
  return NotImplementedError(f"jaxact.{which}.dot_product_attention: {msg}")


def _flat_batch(a, batch: tuple[int, ...], tail: int):
  """`a` with its leading axes before the last `tail` ones (Flax's ``batch...``) merged into one,
  broadcast first where they are partly broadcast."""
  if a is None or len(batch) <= 1:
    return a
  lead = a.shape[: a.ndim - tail] if a.ndim > tail else ()
  if all(d == 1 for d in lead):
    return a.reshape((1, *a.shape[a.ndim - tail :])) if lead else a
  a = jnp.broadcast_to(a, (*batch, *a.shape[a.ndim - tail :]))
  return a.reshape((math.prod(batch), *a.shape[len(batch) :]))


def flax_call(
  which,
  query,
  key,
  value,
  bias,
  mask,
  broadcast_dropout,
  dropout_rng,
  dropout_rate,
  deterministic,
  precision,
  module,
  is_causal,
):
  if module is not None:
    raise refusal(
      which,
      "`module` was given (sow_weights=True): jaxact's attention never builds the attention "
      "weights, so there are none to sow; call the attention layer with sow_weights=False",
    )
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      mask = mask != 0
  rate = 0.0 if deterministic else dropout_rate
  batch = query.shape[:-3]
  shape = query.shape
  if len(batch) > 1:  # one batch axis for jaxact (a free reshape of contiguous axes)
    query, key, value = (a.reshape((math.prod(batch), *a.shape[-3:])) for a in (query, key, value))
    bias, mask = _flat_batch(bias, batch, 3), _flat_batch(mask, batch, 3)
  out = _attention(
    query,
    key,
    value,
    bias,
    mask,
    is_causal=is_causal,
    dropout_rate=rate,
    dropout_rng=dropout_rng if rate > 0 else None,
    broadcast_dropout=broadcast_dropout,
    precision=precision,
  )
  return out.reshape((*shape[:-1], out.shape[-1]))
