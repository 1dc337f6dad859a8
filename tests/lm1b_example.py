"""Flax's ``examples/lm1b`` decoder-only Transformer LM as its ``models.py`` builds it and
``train.py`` trains it (github.com/google/flax, Apache-2.0, The Flax Authors), written after the
example for the one-line tests: the same modules (``nn.Embed``, fixed sinusoidal positions,
``nn.LayerNorm``, ``nn.SelfAttention`` on a padding-and-causal mask, ``nn.Dense`` -> ``nn.relu``
-> ``nn.Dropout`` MLPs, a ``logitdense`` head), the same parameter names, and the weighted
cross-entropy over non-padding tokens. Without decoding, packing and the input pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

XAVIER = nn.initializers.xavier_uniform()
TINY_NORMAL = nn.initializers.normal(stddev=1e-6)


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 64
  dtype: Any = jnp.float32
  emb_dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  qkv_dim: int = 32
  mlp_dim: int = 64
  max_len: int = 64
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False
  remat: bool = False  # each block under nn.remat (the user's own memory saving; not in lm1b)
  kernel_init: Callable = XAVIER
  bias_init: Callable = TINY_NORMAL


def _sinusoids(max_len: int, features: int) -> np.ndarray:
  half = features // 2
  rates = np.exp(np.arange(half) * (-np.log(10000.0) / (half - 1)))
  angles = np.arange(max_len)[:, None] * rates
  table = np.zeros((max_len, features), np.float32)
  table[:, :half], table[:, half : 2 * half] = np.sin(angles), np.cos(angles)
  return table[None]


class MlpBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, inputs):
    c = self.config
    dense = dict(dtype=c.dtype, kernel_init=c.kernel_init, bias_init=c.bias_init)
    x = nn.relu(nn.Dense(c.mlp_dim, **dense)(inputs))
    x = nn.Dropout(rate=c.dropout_rate)(x, deterministic=c.deterministic)
    out = nn.Dense(inputs.shape[-1], **dense)(x)
    return nn.Dropout(rate=c.dropout_rate)(out, deterministic=c.deterministic)


class DecoderBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, inputs, mask):
    c = self.config
    x = nn.LayerNorm(dtype=c.dtype)(inputs)
    x = nn.SelfAttention(
      num_heads=c.num_heads,
      dtype=c.dtype,
      qkv_features=c.qkv_dim,
      kernel_init=c.kernel_init,
      bias_init=c.bias_init,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=c.attention_dropout_rate,
      deterministic=c.deterministic,
    )(x, mask)
    x = nn.Dropout(rate=c.dropout_rate)(x, deterministic=c.deterministic) + inputs
    return x + MlpBlock(c)(nn.LayerNorm(dtype=c.dtype)(x))


def decoder(c: Config, inputs):
  """The model up to the head's input, its modules created in the calling module's compact call."""
  mask = nn.combine_masks(
    nn.make_attention_mask(inputs > 0, inputs > 0, dtype=c.dtype),
    nn.make_causal_mask(inputs, dtype=c.dtype),
  )
  y = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]  # shifted right
  y = nn.Embed(c.vocab_size, c.emb_dim, embedding_init=nn.initializers.normal(1.0))(y)
  y = y + _sinusoids(c.max_len, c.emb_dim)[:, : inputs.shape[1]]
  y = nn.Dropout(rate=c.dropout_rate)(y, deterministic=c.deterministic).astype(c.dtype)
  block = nn.remat(DecoderBlock) if c.remat else DecoderBlock
  for i in range(c.num_layers):
    y = block(c, name=f"encoderdecoderblock_{i}")(y, mask)
  return nn.LayerNorm(dtype=c.dtype, name="encoderdecoder_norm")(y)


class TransformerLM(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, inputs):
    c = self.config
    y = decoder(c, inputs)
    dense = dict(dtype=c.dtype, kernel_init=c.kernel_init, bias_init=c.bias_init)
    return nn.Dense(c.vocab_size, name="logitdense", **dense)(y).astype(c.dtype)


def weighted_cross_entropy(logits, targets):
  """train.py's loss: the cross-entropy of every non-padding token, summed, over their count."""
  weights = (targets > 0).astype(jnp.float32)
  one_hot = jax.nn.one_hot(targets, logits.shape[-1])
  loss = -jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1)
  return jnp.sum(loss * weights) / jnp.sum(weights)


def loss_fn(model: TransformerLM, params, inputs, rng=None):
  rngs = None if rng is None else {"dropout": rng}
  return weighted_cross_entropy(model.apply({"params": params}, inputs, rngs=rngs), inputs)
