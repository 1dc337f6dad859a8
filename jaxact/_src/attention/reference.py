"""The plain formula of :func:`jaxact.dot_product_attention`, whole (T, S) maps, for the tests.

It builds every logit, combines the masks as ``jax.nn.dot_product_attention`` does, and takes the
softmax of the unmasked logits, with jaxact's one difference: a row that sees no key gives 0 (jax.nn
gives the mean of the values there). JAX differentiates it; nothing here is blocked or custom.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def attention_reference(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  scale=None,
  is_causal=False,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  logits_soft_cap=None,
  query_segment_ids=None,
  key_value_segment_ids=None,
  dropout_multiplier=None,
):
  """``O`` for 4-d jax.nn layouts (B, T, N, H), (B, S, K, H); `dropout_multiplier` (broadcastable
  to (B, N, T, S)) multiplies the probabilities, as Flax's attention dropout does."""
  b, t, n, h = query.shape
  s_len, kv_heads = key.shape[1], key.shape[2]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  k = jnp.repeat(key, n // kv_heads, axis=2)
  v = jnp.repeat(value, n // kv_heads, axis=2)
  scale = 1 / np.sqrt(h) if scale is None else scale
  z = jnp.einsum("btnh,bsnh->bnts", query, k, preferred_element_type=acc) * scale
  if logits_soft_cap is not None:
    z = logits_soft_cap * jnp.tanh(z / logits_soft_cap)
  if bias is not None:
    z = z + bias.astype(acc)
  rows = jnp.arange(t)[:, None]
  cols = jnp.arange(s_len)[None, :]
  valid = jnp.ones((b, n, t, s_len), bool)
  if mask is not None:
    valid &= mask
  if is_causal:
    valid &= cols <= rows
  if local_window_size is not None:
    left, right = (
      (local_window_size, local_window_size)
      if isinstance(local_window_size, int)
      else local_window_size
    )
    valid &= (cols >= rows - left) & (cols <= rows + right)
  if query_seq_lengths is not None:
    valid &= (rows < query_seq_lengths[:, None, None, None]) & jnp.ones_like(cols, bool)
  if key_value_seq_lengths is not None:
    valid &= (cols < key_value_seq_lengths[:, None, None, None]) & jnp.ones_like(rows, bool)
  if query_segment_ids is not None or key_value_segment_ids is not None:
    seg_q = key_value_segment_ids if query_segment_ids is None else query_segment_ids
    seg_k = query_segment_ids if key_value_segment_ids is None else key_value_segment_ids
    valid &= (seg_q[:, :, None] == seg_k[:, None, :])[:, None]
  valid &= z > -jnp.inf  # a bias of -inf masks
  m = jnp.max(jnp.where(valid, z, -jnp.inf), -1, keepdims=True)
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
  e = jnp.exp(jnp.where(valid, z - m, -jnp.inf))
  total = jnp.sum(e, -1, keepdims=True)
  p = e / jnp.where(total == 0, 1, total)
  if dropout_multiplier is not None:
    p = p * dropout_multiplier
  o = jnp.einsum("bnts,bsnh->btnh", p.astype(value.dtype), v, preferred_element_type=acc)
  return o.astype(query.dtype)


def flax_dropout_multiplier(rng, rate: float, shape, broadcast: bool, dtype=jnp.float32):
  """Flax's attention dropout multiplier (``keep / keep_prob``) for attention maps of `shape`
  (B, N, T, S), drawn as ``flax.linen.dot_product_attention_weights`` draws it."""
  keep_prob = 1.0 - rate
  drawn = (1, 1, *shape[-2:]) if broadcast else shape
  keep = jax.random.bernoulli(rng, keep_prob, drawn)
  return keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
