"""The models and tasks ``python -m benchmarks fewbit`` trains with few-bit codes
(:mod:`benchmarks.codes_training`): an MLP and a CNN on scikit-learn's digits, a byte-level
transformer language model on the English texts of Python's ``pydoc_data.topics``; gelu with its
derivative kept exactly or in 8, 4 or 2 bits."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pydoc_data.topics import topics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxact
import jaxact.linen


def gelu(bits: int | None) -> Callable:
  return functools.partial(jaxact.gelu, residual_bits=bits)


# ----------------------------------------------------------------------------------------- models


class MLP(nn.Module):
  bits: int | None

  @nn.compact
  def __call__(self, x):
    for features in (256, 256):
      x = jaxact.linen.DenseAct(features, activation=gelu(self.bits))(x)
    return nn.Dense(10)(x)


class CNN(nn.Module):
  bits: int | None

  @nn.compact
  def __call__(self, x):
    x = jaxact.linen.ConvAct(16, (3, 3), activation=gelu(self.bits))(x)
    x = jaxact.linen.ConvAct(32, (3, 3), strides=2, activation=gelu(self.bits))(x)
    x = x.reshape(x.shape[0], -1)
    x = jaxact.linen.DenseAct(64, activation=gelu(self.bits))(x)
    return nn.Dense(10)(x)


LM_LAYERS, LM_WIDTH, LM_HEADS, LM_CONTEXT, LM_VOCAB = 2, 64, 4, 64, 256


def _layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def lm_init(key) -> dict:
  d = LM_WIDTH
  keys = iter(jax.random.split(key, 3 + 4 * LM_LAYERS))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

  def ln():
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

  blocks = [
    {
      "ln1": ln(),
      "qkv": normal((d, 3 * d), d),
      "proj": normal((d, d), d) / math.sqrt(2 * LM_LAYERS),
      "ln2": ln(),
      "w1": normal((d, 4 * d), d),
      "b1": jnp.zeros(4 * d),
      "w2": normal((4 * d, d), 4 * d) / math.sqrt(2 * LM_LAYERS),
      "b2": jnp.zeros(d),
    }
    for _ in range(LM_LAYERS)
  ]
  return {
    "embed": normal((LM_VOCAB, d), 1) * 0.1,
    "pos": normal((LM_CONTEXT, d), 1) * 0.1,
    "blocks": blocks,
    "ln_f": ln(),
    "head": normal((d, LM_VOCAB), d),
  }


def lm_apply(p: dict, tokens, bits: int | None):
  """Logits (B, T, vocab) of a pre-norm causal transformer over byte tokens (B, T)."""
  b, t = tokens.shape
  d, heads = LM_WIDTH, LM_HEADS
  h = p["embed"][tokens] + p["pos"][:t]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for blk in p["blocks"]:
    q, k, v = jnp.split(_layer_norm(h, blk["ln1"]) @ blk["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads)
    s = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    h = h + jnp.einsum("bhts,bshd->bthd", s, v).reshape(b, t, d) @ blk["proj"]
    m = _layer_norm(h, blk["ln2"]).reshape(b * t, d)
    u = jaxact.dense_bias_act(m, blk["w1"], blk["b1"], activation=gelu(bits))
    h = h + (u @ blk["w2"] + blk["b2"]).reshape(b, t, d)
  return _layer_norm(h, p["ln_f"]) @ p["head"]


# ------------------------------------------------------------------------------------------ tasks


@dataclasses.dataclass(frozen=True)
class Task:
  """One model and its data. Batches are drawn as indices into `choices` (rows or text offsets)."""

  name: str
  init: Callable  # key -> params
  apply: Callable  # (params, inputs, bits) -> logits (..., classes)
  batch: Callable  # int indices (B,) -> (inputs, integer targets)
  choices: int
  train_eval: tuple  # fixed (inputs, targets): the logged loss and the final train loss
  test: tuple
  batch_size: int
  steps: int
  learning_rate: float
  log_every: int


def _digits():
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return train_test_split(x, y.astype(np.int32), test_size=0.25, random_state=0, stratify=y)


def digits_task(name: str, steps: int) -> Task:
  x_tr, x_te, y_tr, y_te = _digits()
  if name == "MLP":
    module, shape = MLP, (-1, 64)
  else:
    module, shape = CNN, (-1, 8, 8, 1)
  x_tr, x_te = jnp.asarray(x_tr.reshape(shape)), jnp.asarray(x_te.reshape(shape))
  y_tr, y_te = jnp.asarray(y_tr), jnp.asarray(y_te)
  return Task(
    name=f"{name} (digits)",
    init=lambda key: module(None).init(key, x_tr[:1]),
    apply=lambda params, x, bits: module(bits).apply(params, x),
    batch=lambda idx: (x_tr[idx], y_tr[idx]),
    choices=len(y_tr),
    train_eval=(x_tr, y_tr),
    test=(x_te, y_te),
    batch_size=64,
    steps=steps,
    learning_rate=1e-3,
    log_every=10,
  )


def _windows(tokens: np.ndarray, starts: np.ndarray) -> tuple:
  idx = starts[:, None] + np.arange(LM_CONTEXT)
  return jnp.asarray(tokens[idx]), jnp.asarray(tokens[idx + 1])


def lm_task(steps: int, test_windows: int) -> Task:
  # The standard library's documentation topics, in a fixed order; the last tenth is the test text.
  text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
  tokens = np.frombuffer(text, np.uint8).astype(np.int32)
  split = int(0.9 * len(tokens))
  train, test = tokens[:split], tokens[split:]
  choices = len(train) - LM_CONTEXT - 1
  rng = np.random.default_rng(0)
  train_tokens = jnp.asarray(train)

  def batch(starts):
    idx = starts[:, None] + jnp.arange(LM_CONTEXT)
    return train_tokens[idx], train_tokens[idx + 1]

  test_starts = np.arange(test_windows) * ((len(test) - LM_CONTEXT - 1) // test_windows)
  return Task(
    name="transformer LM (pydoc text)",
    init=lm_init,
    apply=lm_apply,
    batch=batch,
    choices=choices,
    train_eval=_windows(train, np.sort(rng.integers(0, choices, 64))),
    test=_windows(test, test_starts),
    batch_size=32,
    steps=steps,
    learning_rate=3e-3,
    log_every=10,
  )


def make_tasks(quick: bool) -> list[Task]:
  if quick:
    return [digits_task("MLP", 100), digits_task("CNN", 60), lm_task(60, 64)]
  return [digits_task("MLP", 400), digits_task("CNN", 300), lm_task(300, 256)]
