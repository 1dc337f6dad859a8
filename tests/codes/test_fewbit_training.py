"""Training with a few-bit derivative code tracks the exact residual (issue 18; the full comparison,
MLP, CNN and a transformer over hundreds of steps, is ``python -m benchmarks fewbit``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxact
from layer_cases import digits

STEPS = 20


def _losses(bits, x, y, params, batches):
  """The minibatch loss of each step of adam on a 64-128-10 gelu MLP, from `params`."""
  act = functools.partial(jaxact.gelu, residual_bits=bits)
  opt = optax.adam(1e-2)

  def loss_fn(p, idx):
    h = jaxact.dense_bias_act(x[idx], p["w1"], p["b1"], activation=act)
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y[idx]).mean()

  def step(state, idx):
    p, o = state
    loss, g = jax.value_and_grad(loss_fn)(p, idx)
    updates, o = opt.update(g, o, p)
    return (optax.apply_updates(p, updates), o), loss

  run = jax.jit(lambda p: jax.lax.scan(step, (p, opt.init(p)), batches)[1])
  return np.asarray(run(params), np.float64)


@pytest.mark.exhaustive
def test_eight_bit_code_tracks_the_exact_residual_on_digits():
  x_tr, y_tr, _, _ = digits()
  x = x_tr.reshape(len(y_tr), 64)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(k1, (64, 128), jnp.float32) / 8,
    "b1": jnp.zeros(128, jnp.float32),
    "w2": jax.random.normal(k2, (128, 10), jnp.float32) / np.sqrt(128),
    "b2": jnp.zeros(10, jnp.float32),
  }
  batches = jax.random.randint(k3, (STEPS, 64), 0, len(y_tr))
  exact = _losses(None, x, y_tr, params, batches)
  assert exact[-5:].mean() < 0.5 * exact[0], exact  # it trains
  rel = np.abs(_losses(8, x, y_tr, params, batches) / exact - 1)
  # Issue 18's target: within 0.5% of exact at every step (measured: at most 0.07%; 2 bits: 3%).
  # Not bit-identical: the code, not x, is in effect.
  assert 0 < rel.max() < 0.005, rel
