"""jaxact.nnx.swap: a model written with Flax's own nnx layers, swapped in place, trains as the
original does (the original Flax model is the reference), and says what it took and left."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxact.nnx as jnnx
from jaxact._src.swap import nnx as swap_nnx


class Block(nnx.Module):
  def __init__(self, d: int, act: str, *, rngs: nnx.Rngs):
    self.act = act
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln(x), is_causal=True)
    return x + self.down(getattr(nnx, self.act)(self.up(self.norm(x))))


class LM(nnx.Module):
  def __init__(self, vocab: int = 11, d: int = 8, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, "gelu", rngs=rngs), Block(d, "relu", rngs=rngs)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


class CNN(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.conv2 = nnx.Conv(4, 8, (3, 3), strides=2, rngs=rngs)
    self.gn = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
    self.head = nnx.Linear(8, 5, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv1(x)))
    x = nnx.relu(self.gn(self.conv2(x)))
    return self.head(x.mean(axis=(1, 2)))


def _lm_batch(dtype=jnp.float32):
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 11)
  return tokens, jnp.roll(tokens, -1, axis=1)


def _cnn_batch(dtype=jnp.float32):
  x = jax.random.normal(jax.random.key(2), (4, 6, 6, 3), dtype)
  return x, jax.random.randint(jax.random.key(3), (4,), 0, 5)


def _loss(model, x, labels):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _flat(state):
  return {tuple(map(str, p)): v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _assert_close(got, want, tol):
  got, want = _flat(got), _flat(want)
  assert got.keys() == want.keys()
  for path in want:
    assert got[path].shape == want[path].shape and got[path].dtype == want[path].dtype, path
    np.testing.assert_allclose(got[path], want[path], rtol=tol, atol=tol, err_msg=str(path))


def _train(model, batch, routed: bool, steps: int = 3):
  """(loss, grads) of the first step, the routing's report, and the state after `steps` steps of
  adam, each step under nnx.jit (the routing active while it is traced)."""
  optimizer = nnx.Optimizer(model, optax.adam(1e-2, eps=1e-3), wrt=nnx.Param)
  route = jnnx.route_activations()

  def step(model, optimizer, x, labels):
    loss, grads = nnx.value_and_grad(_loss)(model, x, labels)
    optimizer.update(model, grads)
    return loss, grads

  step = nnx.jit(route(step) if routed else step)
  first = step(model, optimizer, *batch)
  for _ in range(steps - 1):
    step(model, optimizer, *batch)
  return first, route.report, nnx.state(model)


def _parity(make, batch, routed: bool, tol: float):
  original = make()
  swapped = copy.deepcopy(original)
  report = jnnx.swap(swapped)
  assert report.taken and all(isinstance(c.ran, str) for c in report.taken)
  _assert_close(nnx.state(swapped), nnx.state(original), 0)  # the same tree and values
  (loss, grads), routing, state = _train(swapped, batch, routed)
  (want_loss, want_grads), _, want_state = _train(original, batch, False)
  np.testing.assert_allclose(loss, want_loss, rtol=tol)
  _assert_close(grads, want_grads, tol)
  _assert_close(state, want_state, tol)
  return report, routing


@pytest.mark.parametrize("routed", [False, True], ids=["swap", "swap+route"])
def test_transformer_trains_as_the_flax_original(routed):
  report, routing = _parity(lambda: LM(rngs=nnx.Rngs(0)), _lm_batch(), routed, 2e-5)
  ran = {c.ran for c in report.taken}
  assert ran == {
    "jaxact.nnx.LinearAct",
    "jaxact.nnx.LayerNorm",
    "jaxact.nnx.RMSNorm",
    "jaxact.nnx.dot_product_attention",
  }
  fused = {c.ran for c in routing.taken if c.what.startswith("flax.nnx.Linear + ")}
  # the MLPs' up-projections fuse with the activation after them: one op each
  assert fused == ({"jaxact.dense_bias_act(gelu)", "jaxact.dense_bias_act(relu)"} if routed else set())


@pytest.mark.parametrize("routed", [False, True], ids=["swap", "swap+route"])
def test_cnn_trains_as_the_flax_original_batch_stats_included(routed):
  report, routing = _parity(lambda: CNN(rngs=nnx.Rngs(0)), _cnn_batch(), routed, 2e-5)
  assert {c.ran for c in report.taken} == {
    "jaxact.nnx.ConvAct",
    "jaxact.nnx.BatchNorm",
    "jaxact.nnx.GroupNorm",
    "jaxact.nnx.LinearAct",
  }
  fused = {c.ran for c in routing.taken if " + " in c.what}
  assert fused == (
    {"jaxact.batch_norm_act(relu)", "jaxact.group_norm_act(relu)"} if routed else set()
  )
