"""jaxact.linen.LMHead / jaxact.nnx.LMHead against Flax's nn.Dense / nnx.Linear and optax's loss.

The heads must be the Flax layers (same parameters from the same key, the same logits without
labels, checkpoints loading both ways) and, with labels, the loss of those logits: values and the
gradients in every parameter, over a product of options.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxact.linen as jnn
import jaxact.nnx as jnnx

from lce_cases import rel_err

B, S, D, V = 2, 5, 8, 37


def _data(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(B, S, D)), dtype)
  labels = jnp.asarray(rng.integers(0, V, size=(B, S)), jnp.int32)
  where = jnp.asarray(rng.random((B, S)) > 0.3)
  return x, labels, where


def _optax_loss(logits, labels, where, z_loss=0.0):
  logits = logits.astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  loss = loss + z_loss * jax.nn.logsumexp(logits, -1) ** 2
  return jnp.sum(jnp.where(where, loss, 0)) / jnp.sum(where)


OPTIONS = [
  dict(),
  dict(use_bias=False),
  dict(dtype=jnp.bfloat16),
  dict(param_dtype=jnp.float64, precision="highest"),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=["default", "no_bias", "bf16", "f64_params"])
def test_linen_head_is_nn_dense_and_its_loss(opts):
  x, labels, where = _data()
  dense, head = nn.Dense(V, **opts), jnn.LMHead(V, z_loss=1e-3, **opts)
  params = dense.init(jax.random.key(0), x)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, params, head.init(jax.random.key(0), x)))
  np.testing.assert_array_equal(head.apply(params, x), dense.apply(params, x))

  def ours(p):
    return head.apply(p, x, labels, where=where)

  def theirs(p):
    return _optax_loss(dense.apply(p, x), labels, where, z_loss=1e-3)

  tol = 2e-2 if opts.get("dtype") == jnp.bfloat16 else 1e-5
  assert rel_err(ours(params), theirs(params)) < tol
  grads, grads_ref = jax.grad(ours)(params), jax.grad(theirs)(params)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
    assert g.dtype == r.dtype and rel_err(g, r) < tol


@pytest.mark.parametrize("opts", OPTIONS, ids=["default", "no_bias", "bf16", "f64_params"])
def test_nnx_head_is_nnx_linear_and_its_loss(opts):
  x, labels, where = _data()
  linear = nnx.Linear(D, V, rngs=nnx.Rngs(0), **opts)
  head = jnnx.LMHead(D, V, z_loss=1e-3, rngs=nnx.Rngs(0), **opts)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, nnx.state(linear), nnx.state(head)))
  np.testing.assert_array_equal(head(x), linear(x))

  def ours(m):
    return m(x, labels, where=where)

  def theirs(m):
    return _optax_loss(m(x), labels, where, z_loss=1e-3)

  tol = 2e-2 if opts.get("dtype") == jnp.bfloat16 else 1e-5
  assert rel_err(ours(head), theirs(linear)) < tol
  grads, grads_ref = nnx.grad(ours)(head), nnx.grad(theirs)(linear)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
    assert rel_err(g, r) < tol


def test_a_flax_checkpoint_loads_into_a_model_with_the_head():
  """An LM whose head was ``nn.Dense(V, name="head")``: the same tree with ``LMHead``."""

  class LM(nn.Module):
    head: type[nn.Module]

    @nn.compact
    def __call__(self, tokens, labels=None):
      h = nn.Embed(V, D, name="embed")(tokens)
      h = nn.Dense(D, name="block")(h)
      if labels is None:
        return self.head(V, name="head")(h)
      return self.head(V, name="head")(h, labels)

  tokens = jnp.arange(B * S).reshape(B, S) % V
  params = LM(nn.Dense).init(jax.random.key(0), tokens)
  loss = LM(jnn.LMHead).apply(params, tokens, (tokens + 1) % V)
  logits = LM(nn.Dense).apply(params, tokens)
  want = optax.softmax_cross_entropy_with_integer_labels(logits, (tokens + 1) % V).mean()
  assert rel_err(loss, want) < 1e-5


def test_tied_embedding_with_the_function():
  """The docs' tied head: ``linear_cross_entropy(h, embed.embedding.T, labels)`` is
  ``nn.Embed.attend`` followed by the loss."""
  import jaxact

  x, labels, _ = _data()
  embed = nn.Embed(V, D)
  params = embed.init(jax.random.key(0), labels)

  def ours(p):
    return jaxact.linear_cross_entropy(x, p["params"]["embedding"].T, labels)

  def theirs(p):
    logits = embed.apply(p, x, method=nn.Embed.attend)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  assert rel_err(ours(params), theirs(params)) < 1e-5
  assert (
    rel_err(
      jax.grad(ours)(params)["params"]["embedding"], jax.grad(theirs)(params)["params"]["embedding"]
    )
    < 1e-5
  )


def test_refusals_name_the_reason():
  x, labels, where = _data()
  params = jnn.LMHead(V).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"jaxact\.linen\.LMHead: `where` is given without"):
    jnn.LMHead(V).apply(params, x, where=where)
  custom = jnn.LMHead(V, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
  with pytest.raises(NotImplementedError, match=r"custom `dot_general`.*cannot be fused"):
    custom.apply(params, x, labels)
  np.testing.assert_array_equal(custom.apply(params, x), jnn.LMHead(V).apply(params, x))
  head = jnnx.LMHead(D, V, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"jaxact\.nnx\.LMHead: `where` is given without"):
    head(x, where=where)
  with pytest.raises(ValueError, match=r"jaxact\.linear_cross_entropy: `reduction` 'avg'"):
    jnnx.LMHead(D, V, reduction="avg", rngs=nnx.Rngs(0))(x, labels)
