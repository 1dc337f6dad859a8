"""jaxact.linen.LMHead / jaxact.nnx.LMHead against Flax's nn.Dense / nnx.Linear and optax's loss.

The heads must be the Flax layers (same parameters from the same key, the same logits without
labels, checkpoints loading both ways) and, with labels, the loss of those logits: values and the
gradients in every parameter, over a product of options.
"""

from __future__ import annotations

import functools

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


@pytest.mark.sample(1)
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


@pytest.mark.sample(2)
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
  with pytest.raises(ValueError, match=r"jaxact\.linen\.LMHead: `where` / `weights` given without"):
    jnn.LMHead(V).apply(params, x, where=where)
  custom = jnn.LMHead(V, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
  with pytest.raises(NotImplementedError, match=r"custom `dot_general`.*cannot be fused"):
    custom.apply(params, x, labels)
  np.testing.assert_array_equal(custom.apply(params, x), jnn.LMHead(V).apply(params, x))
  head = jnnx.LMHead(D, V, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"jaxact\.nnx\.LMHead: `where` / `weights` given without"):
    head(x, where=where)
  with pytest.raises(ValueError, match=r"jaxact\.linear_cross_entropy: `reduction` 'avg'"):
    jnnx.LMHead(D, V, reduction="avg", rngs=nnx.Rngs(0))(x, labels)
  with pytest.raises(TypeError, match=r"jaxact\.nnx\.attend_cross_entropy: `embed` must be"):
    jnnx.attend_cross_entropy(head, x, labels)
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"jaxact\.nnx\.attend_cross_entropy: `w_layout`"):
    jnnx.attend_cross_entropy(embed, x, labels, w_layout="dv")
  with pytest.raises(TypeError, match=r"jaxact\.linen\.attend_cross_entropy: `embed` must be"):
    jnn.attend_cross_entropy(embed, x, labels)


def _weights():
  return jnp.asarray(np.random.default_rng(2).uniform(0, 2, size=(B, S)), jnp.float32)


def _reference_options(logits, labels, where, weights):
  """flax examples/gemma's weighted loss with T5X's smoothing of 0.1 (its train.py), and the
  predictions its accuracy takes from the logits."""
  v = logits.shape[-1]
  confidence, low = 0.9, 0.1 / (v - 1)
  constant = -(confidence * jnp.log(confidence) + (v - 1) * low * jnp.log(low + 1e-20))
  targets = jnp.where(jax.nn.one_hot(labels, v) > 0, confidence, low)
  loss = -jnp.sum(targets * jax.nn.log_softmax(logits.astype(jnp.float32)), -1) - constant
  weights = jnp.where(where, weights, 0)
  return jnp.sum(loss * weights) / jnp.sum(weights), jnp.argmax(logits, -1)


T5X = dict(label_smoothing=0.1, label_smoothing_style="t5x", return_predictions=True)


def test_heads_take_weights_t5x_smoothing_and_return_predictions():
  x, labels, where = _data()
  weights = _weights()
  dense, head = nn.Dense(V), jnn.LMHead(V, **T5X)
  params = dense.init(jax.random.key(0), x)
  loss, predictions = head.apply(params, x, labels, where=where, weights=weights)
  want, want_pred = _reference_options(dense.apply(params, x), labels, where, weights)
  assert rel_err(loss, want) < 1e-5
  np.testing.assert_array_equal(predictions, want_pred)
  head = jnnx.LMHead(D, V, rngs=nnx.Rngs(0), **T5X)
  loss, predictions = head(x, labels, where=where, weights=weights)
  want, want_pred = _reference_options(
    nnx.Linear(D, V, rngs=nnx.Rngs(0))(x), labels, where, weights
  )
  assert rel_err(loss, want) < 1e-5
  np.testing.assert_array_equal(predictions, want_pred)


class _TiedLM(nn.Module):
  """Embeds the tokens and, tied, scores the next token with the same table."""

  fused: bool
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, tokens, labels, where, weights):
    embed = nn.Embed(V, D, dtype=self.dtype, name="embed")
    h = jnp.tanh(embed(tokens))
    if self.fused:
      return jnn.attend_cross_entropy(embed, h, labels, where=where, weights=weights, **T5X)
    return _reference_options(embed.attend(h), labels, where, weights)


@pytest.mark.sample(1)  # bfloat16 heads: test_nnx_head_is_nnx_linear_and_its_loss[bf16]
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["float32", "bf16"])
def test_linen_tied_head_is_embed_attend_and_its_loss(dtype):
  """attend_cross_entropy in a model whose table both embeds and scores: the loss and
  predictions of ``embed.attend``, and the table's gradient (both uses summed)."""
  _, labels, where = _data()
  tokens, weights = (labels * 7) % V, _weights()
  ours, theirs = _TiedLM(True, dtype), _TiedLM(False, dtype)
  params = theirs.init(jax.random.key(0), tokens, labels, where, weights)

  def run(model):
    def loss(p):
      value, pred = model.apply(p, tokens, labels, where, weights)
      return value, pred

    return jax.value_and_grad(loss, has_aux=True)(params)

  (v, pred), g = run(ours)
  (v_ref, pred_ref), g_ref = run(theirs)
  tol = 1e-5 if dtype is None else 2e-2
  assert rel_err(v, v_ref) < tol
  if dtype is None:  # bfloat16 logits may order two near-equal ones otherwise
    np.testing.assert_array_equal(pred, pred_ref)
  table, table_ref = g["params"]["embed"]["embedding"], g_ref["params"]["embed"]["embedding"]
  assert table.dtype == table_ref.dtype and rel_err(table, table_ref) < tol


def test_nnx_tied_head_is_embed_attend_and_its_loss():
  _, labels, where = _data()
  tokens, weights = (labels * 7) % V, _weights()
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))

  def ours(embed):
    h = jnp.tanh(embed(tokens))
    return jnnx.attend_cross_entropy(embed, h, labels, where=where, weights=weights, **T5X)

  def theirs(embed):
    return _reference_options(embed.attend(jnp.tanh(embed(tokens))), labels, where, weights)

  (v, pred), g = nnx.value_and_grad(ours, has_aux=True)(embed)
  (v_ref, pred_ref), g_ref = nnx.value_and_grad(theirs, has_aux=True)(embed)
  assert rel_err(v, v_ref) < 1e-5
  np.testing.assert_array_equal(pred, pred_ref)
  assert rel_err(g.embedding[...], g_ref.embedding[...]) < 1e-5


def test_tied_head_holds_no_copy_of_the_table_on_cpu():
  """Compiled for this CPU: the tied step's temp equals the untied head's (the loop reads the
  table by rows), where ``emb.T`` costs two table-sized copies (the check can fail)."""
  import jaxact

  t, d, v = 512, 128, 8192
  x = jax.ShapeDtypeStruct((t, d), jnp.float32)
  labels = jax.ShapeDtypeStruct((t,), jnp.int32)

  def temp(loss, w):
    step = jax.jit(jax.grad(loss, (0, 1)))
    return step.lower(x, w, labels).compile().memory_analysis().temp_size_in_bytes

  table_bytes = v * d * 4
  untied = temp(jaxact.linear_cross_entropy, jax.ShapeDtypeStruct((d, v), jnp.float32))
  table = jax.ShapeDtypeStruct((v, d), jnp.float32)
  by_rows = temp(functools.partial(jaxact.linear_cross_entropy, w_layout="vd"), table)
  transposed = temp(lambda x, e, y: jaxact.linear_cross_entropy(x, e.T, y), table)
  assert abs(by_rows - untied) < 0.01 * table_bytes, (by_rows, untied)
  assert transposed - untied > table_bytes, (transposed, untied)
