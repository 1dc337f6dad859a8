"""Three optax adamw steps of a tiny byte LM: jaxact.gated_mlp and jaxact.linear_cross_entropy
train like their compositions.

The model (embedding, a pre-RMSNorm residual gated-MLP block, head) is trained on the Python
documentation's text from one initialisation on the same batches, once with the MLP written as
``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` and once as :func:`jaxact.gated_mlp`; then with the
head and loss as optax's composition and as :func:`jaxact.linear_cross_entropy`. The first
step's gradients are compared directly (Adam's update hardly changes when a gradient is scaled),
then the losses of every step. ``python -m benchmarks lm`` is the full-size run.
"""

from __future__ import annotations

from pydoc_data.topics import topics

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxact

DIM, HIDDEN, BLOCKS, CONTEXT, BATCH, STEPS = 32, 64, 1, 32, 4, 3


def composition_mlp(x, p):
  gate = x @ p["gate_proj"]["kernel"]
  up = x @ p["up_proj"]["kernel"]
  return (jax.nn.silu(gate) * up) @ p["down_proj"]["kernel"]


def jaxact_mlp(x, p):
  return jaxact.gated_mlp(
    x, p["gate_proj"]["kernel"], p["up_proj"]["kernel"], p["down_proj"]["kernel"]
  )


def rms_norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def init(key):
  keys = iter(jax.random.split(key, 2 + 3 * BLOCKS))

  def kernel(n_in, n_out):
    return jax.random.normal(next(keys), (n_in, n_out)) / np.sqrt(n_in)

  blocks = [
    {
      "gate_proj": {"kernel": kernel(DIM, HIDDEN)},
      "up_proj": {"kernel": kernel(DIM, HIDDEN)},
      "down_proj": {"kernel": kernel(HIDDEN, DIM)},
    }
    for _ in range(BLOCKS)
  ]
  return {"embed": kernel(256, DIM) * 0.1, "blocks": blocks, "head": kernel(DIM, 256)}


def composition_head(x, w, labels):
  return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()


def jaxact_head(x, w, labels):
  return jaxact.linear_cross_entropy(x, w, labels, vocab_block_size=96)  # 3 blocks, overlapping


def loss_fn(mlp, head, params, batch):
  x = params["embed"][batch[:, :-1]]
  for block in params["blocks"]:
    x = x + mlp(rms_norm(x), block)
  return head(rms_norm(x), params["head"], batch[:, 1:])


def train(mlp, params, batches, head=composition_head):
  opt = optax.adamw(3e-3)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn, argnums=2)(mlp, head, params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  opt_state = opt.init(params)
  losses = []
  for i, batch in enumerate(batches):
    params, opt_state, loss, grads = step(params, opt_state, batch)
    losses.append(float(loss))
    if i == 0:
      first_grads = grads
  return np.array(losses), first_grads


def _batches():
  text = np.frombuffer(topics["assert"].encode() + topics["for"].encode(), dtype=np.uint8)
  starts = np.random.default_rng(0).integers(0, len(text) - CONTEXT - 1, (STEPS, BATCH))
  return text.astype(np.int32)[starts[..., None] + np.arange(CONTEXT + 1)]


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "mlp, head", [(jaxact_mlp, composition_head), (composition_mlp, jaxact_head)], ids=["mlp", "head"]
)
def test_jaxact_trains_a_byte_lm_like_the_composition(mlp, head):
  batches = _batches()
  params = init(jax.random.key(0))

  losses, grads = train(composition_mlp, params, batches)
  jaxact_losses, jaxact_grads = train(mlp, params, batches, head)

  for (path, g), ref in zip(
    jax.tree_util.tree_leaves_with_path(jaxact_grads), jax.tree.leaves(grads), strict=True
  ):
    scale = np.max(np.abs(ref))
    assert scale > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(
      g, ref, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
    )
  np.testing.assert_allclose(jaxact_losses, losses, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.1  # the steps train: the comparison is not of a flat loss
