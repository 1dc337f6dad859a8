"""Flax's ``attention_fn`` signatures over :func:`jaxact.dot_product_attention`.

``nn.MultiHeadDotProductAttention(attention_fn=jaxact.linen.dot_product_attention)`` and
``nnx.MultiHeadAttention(..., attention_fn=jaxact.nnx.dot_product_attention)`` keep their
parameters and call these with Flax's arguments: any number of batch axes, masks of any dtype
(nonzero attends, as Flax's ``jnp.where`` reads them), Flax's dropout (the same key gives the same
mask), ``dtype`` promotion. Shapes that do not fit together raise what Flax raises, in Flax's words
(linen's ``'q, k, v batch dims must match.'`` as an error that is both a ValueError and the
AssertionError linen's asserts raise; nnx's ValueErrors). What Flax's own function does and these
cannot, they refuse by name: sowing the attention weights (``sow_weights=True`` passes ``module``:
there are no weights to sow) and custom einsums.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxact._src.attention.api import dot_product_attention as _attention


def _err(which: str, msg: str) -> NotImplementedError:
  return NotImplementedError(f"jaxact.{which}.dot_product_attention: {msg}")


class FlaxShapeError(ValueError, AssertionError):
  """Shapes ``flax.linen.dot_product_attention`` refuses: a ValueError (what jaxact raises for bad
  input) that is also the AssertionError linen's own asserts raise, with linen's message."""


def _linen_shapes(query, key, value) -> None:
  """linen's asserts, in its order and words (``dot_product_attention``, then the weights')."""
  q, k, v = query.shape, key.shape, value.shape
  got = f" (jaxact.linen.dot_product_attention: query {q}, key {k}, value {v})"
  if not query.ndim == key.ndim == value.ndim:
    raise FlaxShapeError("q, k, v must have same rank." + got)
  if not q[:-3] == k[:-3] == v[:-3]:
    raise FlaxShapeError("q, k, v batch dims must match." + got)
  if not q[-2] == k[-2] == v[-2]:
    raise FlaxShapeError("q, k, v num_heads must match." + got)
  if k[-3] != v[-3]:
    raise FlaxShapeError("k, v lengths must match." + got)
  if q[-1] != k[-1]:
    raise FlaxShapeError("q, k depths must match." + got)


def _nnx_shapes(query, key, value) -> None:
  """nnx's ValueErrors, in its order and words (``_validate_qkv_shapes``, the lengths, then the
  weights' depths and grouped heads)."""
  arrays = (query, key, value)
  got = " (jaxact.nnx.dot_product_attention)"
  if not query.ndim == key.ndim == value.ndim:
    ndims = ", ".join(str(a.ndim) for a in arrays)
    raise ValueError(f"q, k, v must have same rank, but got {ndims}." + got)
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    shapes = ", ".join(str(a.shape) for a in arrays)
    raise ValueError(f"q, k, v batch dims must match, but got shapes {shapes}." + got)
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(
      f"k, v lengths must match, but got {key.shape[-3]} and {value.shape[-3]}." + got
    )
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
      f"q, k depths must match, but got {query.shape[-1]} and {key.shape[-1]}." + got
    )
  q_heads, k_heads = query.shape[-2], key.shape[-2]
  if q_heads != k_heads and (k_heads == 0 or q_heads % k_heads):
    raise ValueError(
      f"Query heads ({q_heads}) must be multiple of Key heads ({k_heads}) for Grouped Query "
      "Attention." + got
    )


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


def _call(
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
    raise _err(
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


def linen_dot_product_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  broadcast_dropout: bool = True,
  dropout_rng=None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype=None,
  precision=None,
  module=None,
  force_fp32_for_softmax: bool = False,
  einsum_dot_general=None,
  qk_attn_weights_einsum=None,
  attn_weights_value_einsum=None,
):
  """``flax.linen.dot_product_attention``'s signature and meaning, computed by
  :func:`jaxact.dot_product_attention` (keeping q, k, v, O and two numbers a row).

  Pass it as ``nn.MultiHeadDotProductAttention(..., attention_fn=...)``: the parameters do not
  change. The softmax always runs in float32 (``force_fp32_for_softmax`` is accepted and has
  nothing to change); a row whose every key is masked gives 0 (Flax: the mean of the values);
  ``module`` (``sow_weights=True``) and custom einsums raise ``NotImplementedError``.

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxact.linen as jnn
    >>> layer = nn.MultiHeadDotProductAttention(
    ...   num_heads=2, qkv_features=8, attention_fn=jnn.dot_product_attention)
    >>> x = jnp.ones((1, 5, 8))
    >>> params = layer.init(jax.random.key(0), x)
    >>> layer.apply(params, x, mask=nn.make_causal_mask(jnp.ones((1, 5)))).shape
    (1, 5, 8)
  """
  from flax.linen import dtypes

  del force_fp32_for_softmax  # the softmax runs in float32 always
  if any(
    f is not None for f in (einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)
  ):
    raise _err("linen", "custom einsums (einsum_dot_general, qk/attn einsums) are not supported")
  query, key, value = dtypes.promote_dtype(query, key, value, dtype=dtype)
  _linen_shapes(query, key, value)
  return _call(
    "linen",
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
    False,
  )


def nnx_dot_product_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  broadcast_dropout: bool = True,
  dropout_rng=None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype=None,
  precision=None,
  module=None,
  promote_dtype=None,
  is_causal: bool = False,
):
  """``flax.nnx.dot_product_attention``'s signature and meaning (grouped-query attention and
  ``is_causal`` included), computed by :func:`jaxact.dot_product_attention`.

  Pass it as ``nnx.MultiHeadAttention(..., attention_fn=...)``: the parameters do not change. A
  row whose every key is masked gives 0 (Flax: the mean of the values); ``module``
  (``sow_weights=True``) raises ``NotImplementedError``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxact import nnx as jnnx
    >>> layer = nnx.MultiHeadAttention(
    ...   num_heads=2, in_features=8, qkv_features=8, decode=False,
    ...   attention_fn=jnnx.dot_product_attention, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 5, 8)), is_causal=True).shape
    (1, 5, 8)
  """
  if promote_dtype is None:
    from flax.nnx.nn import dtypes

    promote_dtype = dtypes.promote_dtype
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  _nnx_shapes(query, key, value)
  return _call(
    "nnx",
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
  )
