"""Flax's ``examples/lm1b_nnx`` decoder-only Transformer LM as its ``models.py`` builds it and
``train.py`` trains it (github.com/google/flax, Apache-2.0, The Flax Authors), written after the
example for the one-line tests: the same modules (``nnx.Embed``, fixed sinusoidal positions,
``nnx.LayerNorm``, ``nnx.MultiHeadAttention`` on a padding-and-causal mask, ``nnx.Linear`` ->
``nnx.relu`` -> ``nnx.Dropout`` -> ``nnx.Linear`` -> ``nnx.Dropout`` MLPs, a ``logitdense``
head), the same attribute names and parameter paths, dropout's keys passed to the call as
``train.py`` does, and its weighted cross-entropy over non-padding tokens. Without decoding
caches, packing, sharding annotations and the input pipeline; ``remat`` (each block under
``nnx.remat``) is the user's own memory saving, not in the example.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

XAVIER = nnx.initializers.xavier_uniform()
TINY_NORMAL = nnx.initializers.normal(stddev=1e-6)


@dataclasses.dataclass(unsafe_hash=True)
class TransformerConfig:
  """The example's hyperparameters; small by default (for tests)."""

  vocab_size: int = 64
  output_vocab_size: int = 64
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  emb_dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  qkv_dim: int = 32
  mlp_dim: int = 64
  max_len: int = 64
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  kernel_init: nnx.Initializer = XAVIER
  bias_init: nnx.Initializer = TINY_NORMAL
  remat: bool = False  # each block under nnx.remat (not in the example)


def shift_right(x: jax.Array) -> jax.Array:
  """The tokens one place later along the sequence, a 0 first: each position predicts itself."""
  return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


def sinusoids(max_len: int, features: int) -> np.ndarray:
  """The fixed position table, ``(1, max_len, features)``: sines then cosines of geometrically
  spaced frequencies from 1 to 1/10000."""
  half = features // 2
  rates = np.exp(np.arange(half) * (-np.log(10000.0) / (half - 1)))
  angles = np.arange(max_len)[:, None] * rates
  table = np.zeros((max_len, features), np.float32)
  table[:, :half], table[:, half : 2 * half] = np.sin(angles), np.cos(angles)
  return table[None]


class AddPositionEmbs(nnx.Module):
  """Adds the fixed sinusoidal positions (the example's default: no learned table)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config

  def __call__(self, inputs: jax.Array) -> jax.Array:
    table = sinusoids(self.config.max_len, self.config.emb_dim)
    return inputs + table[:, : inputs.shape[1]]


class MlpBlock(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    dense = dict(dtype=c.dtype, kernel_init=c.kernel_init, bias_init=c.bias_init, rngs=rngs)
    self.linear1 = nnx.Linear(c.emb_dim, c.mlp_dim, **dense)
    self.linear2 = nnx.Linear(c.mlp_dim, c.emb_dim, **dense)
    self.dropout = nnx.Dropout(rate=c.dropout_rate)

  def __call__(self, inputs: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
    x = self.dropout(nnx.relu(self.linear1(inputs)), rngs=rngs)
    return self.dropout(self.linear2(x), rngs=rngs)


class EncoderDecoder1DBlock(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    self.ln1 = nnx.LayerNorm(num_features=c.emb_dim, dtype=c.dtype, rngs=rngs)
    self.ln2 = nnx.LayerNorm(num_features=c.emb_dim, dtype=c.dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=c.num_heads,
      in_features=c.emb_dim,
      qkv_features=c.qkv_dim,
      dtype=c.dtype,
      kernel_init=c.kernel_init,
      bias_init=c.bias_init,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=c.attention_dropout_rate,
      rngs=rngs,
      keep_rngs=False,
    )
    self.mlp = MlpBlock(c, rngs=rngs)
    self.dropout = nnx.Dropout(rate=c.dropout_rate)

  def __call__(self, inputs, *, decoder_mask=None, rngs: nnx.Rngs | None = None):
    x = self.attention(self.ln1(inputs), mask=decoder_mask, rngs=rngs)
    x = self.dropout(x, rngs=rngs) + inputs
    return x + self.mlp(self.ln2(x), rngs=rngs)


def _block(layer: EncoderDecoder1DBlock, y, decoder_mask, rngs):
  return layer(y, decoder_mask=decoder_mask, rngs=rngs)


class Decoder(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    self.output_embed = nnx.Embed(
      num_embeddings=c.output_vocab_size,
      features=c.emb_dim,
      embedding_init=nnx.initializers.normal(stddev=1.0),
      rngs=rngs,
    )
    self.posembed_output = AddPositionEmbs(c, rngs=rngs)
    self.dropout = nnx.Dropout(rate=c.dropout_rate)
    for i in range(c.num_layers):
      setattr(self, f"encoderdecoderblock_{i}", EncoderDecoder1DBlock(c, rngs=rngs))
    self.encoderdecoder_norm = nnx.LayerNorm(num_features=c.emb_dim, dtype=c.dtype, rngs=rngs)
    if c.logits_via_embedding:
      self.logitdense = None
    else:
      self.logitdense = nnx.Linear(
        c.emb_dim,
        c.output_vocab_size,
        dtype=c.dtype,
        kernel_init=c.kernel_init,
        bias_init=c.bias_init,
        rngs=rngs,
      )

  def __call__(self, inputs, *, decoder_mask=None, rngs: nnx.Rngs | None = None):
    c = self.config
    y = self.output_embed(shift_right(inputs.astype(jnp.int32)))
    y = self.dropout(self.posembed_output(y), rngs=rngs).astype(c.dtype)
    block = nnx.remat(_block) if c.remat else _block
    for i in range(c.num_layers):
      y = block(getattr(self, f"encoderdecoderblock_{i}"), y, decoder_mask, rngs)
    y = self.encoderdecoder_norm(y)
    if self.logitdense is not None:
      return self.logitdense(y)
    # the embedding's transpose as the head, its logits scaled as the example does
    return self.output_embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])


class TransformerLM(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.decoder = Decoder(config, rngs=rngs)

  def __call__(self, inputs, *, rngs: nnx.Rngs | None = None):
    dtype = self.config.dtype
    decoder_mask = nnx.combine_masks(
      nnx.make_attention_mask(inputs > 0, inputs > 0, dtype=dtype),
      nnx.make_causal_mask(inputs, dtype=dtype),
    )
    return self.decoder(inputs, decoder_mask=decoder_mask, rngs=rngs).astype(dtype)


def weighted_cross_entropy(logits, targets):
  """train.py's loss (no label smoothing): the cross-entropy of every non-padding token, summed,
  over their count."""
  weights = (targets > 0).astype(jnp.float32)
  one_hot = jax.nn.one_hot(targets, logits.shape[-1])
  loss = -jnp.sum(one_hot * nnx.log_softmax(logits), axis=-1)
  return jnp.sum(loss * weights) / jnp.sum(weights)


def loss_fn(model: TransformerLM, inputs, rngs: nnx.Rngs | None = None):
  """train.py's training loss of `model` on `inputs` (the targets are the inputs themselves)."""
  return weighted_cross_entropy(model(inputs, rngs=rngs), inputs)
