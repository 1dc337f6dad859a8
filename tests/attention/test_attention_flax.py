"""jaxact.linen / jaxact.nnx dot_product_attention as Flax's attention_fn: the attention layers keep
their parameters, and give Flax's outputs and gradients (masks, dropout with the same key, several
batch axes); what they cannot do is refused by name."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxact.linen as jnn
from jaxact import nnx as jnnx

D, HEADS = 16, 4


def _x(shape=(2, 12, D), seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _close(a, b, tol=2e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


# By default: several batch axes under a causal mask (the mask alone, dropout: -m exhaustive;
# dropout with the same key is test_nnx_attention_fn_equals_flax's default case).
@pytest.mark.parametrize(
  "case",
  ["batch_axes"]
  + [pytest.param(c, marks=pytest.mark.exhaustive) for c in ("causal_mask", "dropout", "plain")],
)
def test_linen_attention_fn_equals_flax(case):
  x = _x((2, 3, 12, D) if case == "batch_axes" else (2, 12, D))
  kw = dict(num_heads=HEADS, qkv_features=D)
  if case == "dropout":
    kw["dropout_rate"] = 0.25
  ours = nn.MultiHeadDotProductAttention(**kw, attention_fn=jnn.dot_product_attention)
  theirs = nn.MultiHeadDotProductAttention(**kw)
  params = theirs.init(jax.random.key(1), x, deterministic=True)
  mine = ours.init(jax.random.key(1), x, deterministic=True)
  assert jax.tree.structure(mine) == jax.tree.structure(params)
  causal = case in ("causal_mask", "batch_axes")
  mask = nn.make_causal_mask(jnp.ones(x.shape[:-1])) if causal else None
  rngs = {"dropout": jax.random.key(2)}

  def loss(layer, p, x):
    y = layer.apply(p, x, mask=mask, deterministic=case != "dropout", rngs=rngs)
    return jnp.sum(y * jnp.cos(y))

  got = jax.value_and_grad(loss, argnums=(1, 2))(ours, params, x)
  want = jax.value_and_grad(loss, argnums=(1, 2))(theirs, params, x)
  _close(got, want)


@pytest.mark.sample(1, "dropout")
@pytest.mark.parametrize(
  "case",
  ["is_causal", "dropout"]
  + [pytest.param(c, marks=pytest.mark.exhaustive) for c in ("plain", "mask")],
)
def test_nnx_attention_fn_equals_flax(case):
  x = _x()
  kw = dict(num_heads=HEADS, in_features=D, qkv_features=D, decode=False)
  if case == "dropout":
    kw["dropout_rate"] = 0.25
  theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, attention_fn=jnnx.dot_product_attention, rngs=nnx.Rngs(0))
  _close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), 0)
  call = {}
  if case == "is_causal":
    call["is_causal"] = True
  if case == "mask":
    call["mask"] = nnx.make_causal_mask(jnp.ones(x.shape[:-1]))
  if case == "dropout":
    call["deterministic"] = False
    call["is_causal"] = True

  def loss(model, x, seed):
    extra = {"rngs": nnx.Rngs(dropout=seed)} if case == "dropout" else {}
    y = model(x, **call, **extra)
    return jnp.sum(y * jnp.cos(y))

  got = nnx.value_and_grad(loss, argnums=(0, 1))(ours, x, 5)
  want = nnx.value_and_grad(loss, argnums=(0, 1))(theirs, x, 5)
  _close(got[0], want[0])
  _close(nnx.state(got[1][0], nnx.Param), nnx.state(want[1][0], nnx.Param))
  _close(got[1][1], want[1][1])


def test_what_flax_attention_does_and_jaxact_cannot_is_refused_by_name():
  x = _x()
  layer = nn.MultiHeadDotProductAttention(
    num_heads=HEADS, qkv_features=D, attention_fn=jnn.dot_product_attention
  )
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="sow_weights=False"):
    layer.apply(params, x, sow_weights=True, mutable=["intermediates"])
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(NotImplementedError, match="custom einsums"):
    jnn.dot_product_attention(q, q, q, einsum_dot_general=jax.lax.dot_general)
