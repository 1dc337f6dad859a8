"""What Flax's ``examples/gemma`` computes where the porting guide (docs/porting-flax.md) swaps in
jaxact, written after the example (``modules.py``'s ``Attention.__call__``, ``transformer.py``'s
``make_causal_attn_mask``) for the tests and ``benchmarks/gemma.py`` to compare against.

The whole example (its modules and ``train.py``'s step, which need Flax: this package imports
jax, numpy and the library alone) is ``tests/gemma_example.py``, which the guide's blocks are
pasted into by tests/repo/test_porting_guide.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

K_MASK = -2.3819763e38  # the example's logit for a masked key


def make_causal_attn_mask(input_mask: jax.Array) -> jax.Array:
  """``(B, T)`` -> ``(B, T, T)``: query ``t`` sees key ``s`` where ``s <= t`` and ``s`` is not
  padding (the mask ``train.py`` and ``eval_step`` hand the model)."""
  positions = jnp.arange(input_mask.shape[-1])
  return input_mask[:, None, :] & (positions[None, :] <= positions[:, None])[None]


def example_attention(
  query_proj: jax.Array,
  key_proj: jax.Array,
  value_proj: jax.Array,
  attn_mask: jax.Array,
  *,
  query_pre_attn_scalar: float,
  attn_logits_soft_cap: float | None = None,
  sliding_window_size: int | None = None,
  dropout: Callable[..., jax.Array] | None = None,
  rngs: Any = None,
) -> jax.Array:
  """The example's attention core without a cache: from the query and key after RoPE to the
  ``(B, T, N, H)`` output before ``attn_vec_einsum``.

  The query is multiplied by `query_pre_attn_scalar` (the number
  ``TransformerConfig.query_pre_attn_scalar()`` returns), each query head reads key/value head
  ``n // (N // K)``, the logits are capped by `attn_logits_soft_cap`, and a key counts where
  `attn_mask` (``(B, T, S)`` or ``(B, 1, S)``, any pattern) says so and, on a local layer
  (`sliding_window_size` set), within the symmetric band ``|s - t| < sliding_window_size`` built
  on `attn_mask`'s own last two axes (for a one-row mask: row 0's band, for every query); a
  masked key gets the logit ``K_MASK``. The softmax is rounded to the keys' dtype, then
  `dropout` (the module's ``nnx.Dropout``, called with `rngs`) applies to the ``(B, T, N, S)``
  probabilities."""
  b, t, n, h = query_proj.shape
  kv_heads = key_proj.shape[2]
  groups = n // kv_heads
  query = (query_proj * query_pre_attn_scalar).reshape(b, t, kv_heads, groups, h)
  logits = jnp.einsum("btkgh,bskh->btkgs", query, key_proj).reshape(b, t, n, -1)
  if attn_logits_soft_cap is not None:
    logits = attn_logits_soft_cap * jnp.tanh(logits / attn_logits_soft_cap)
  if sliding_window_size is not None:
    rows = jnp.arange(attn_mask.shape[-2])[:, None]
    cols = jnp.arange(attn_mask.shape[-1])[None, :]
    attn_mask = attn_mask & (jnp.abs(cols - rows) < sliding_window_size)
  logits = jnp.where(attn_mask[:, :, None, :], logits, K_MASK)
  probs = jax.nn.softmax(logits, axis=-1).astype(key_proj.dtype)
  if dropout is not None:
    probs = dropout(probs, rngs=rngs)
  probs = probs.reshape(b, t, kv_heads, groups, -1)
  return jnp.einsum("btkgs,bskh->btkgh", probs, value_proj).reshape(b, t, n, h)
