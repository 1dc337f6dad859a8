"""Flax linen's ``attention_fn`` signature over :func:`jaxact.dot_product_attention`.

``nn.MultiHeadDotProductAttention(attention_fn=jaxact.linen.dot_product_attention)`` keeps its
parameters and calls this with linen's arguments (:mod:`jaxact._src.attention.api_flax`). Shapes
that do not fit together raise what linen raises, in its words (``'q, k, v batch dims must
match.'``), as an error that is both a ValueError and the AssertionError linen's asserts raise.
"""

from __future__ import annotations

from jaxact._src.attention.api_flax import flax_call, refusal


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
    raise refusal("linen", "custom einsums (einsum_dot_general, qk/attn einsums) are not supported")
  query, key, value = dtypes.promote_dtype(query, key, value, dtype=dtype)
  _linen_shapes(query, key, value)
  return flax_call(
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
