"""Flax nnx's ``attention_fn`` signature over :func:`jaxact.dot_product_attention`.

``nnx.MultiHeadAttention(..., attention_fn=jaxact.nnx.dot_product_attention)`` keeps its parameters
and calls this with nnx's arguments (:mod:`jaxact._src.attention.api_flax`). Shapes that do not fit
together raise nnx's ValueErrors, in its order and words.
"""

from __future__ import annotations

from jaxact._src.attention.api_flax import flax_call


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
  return flax_call(
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
