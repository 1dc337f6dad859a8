"""Under ``jax.checkpoint`` a layer's attention keeps nothing but what the checkpoint keeps (its
input), as jax.nn's does: the compiled step grows by one input a layer, causal or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxact

B, T, H, D = 2, 512, 2, 32  # blocks of 256 by default on CPU: a loop over query and key blocks


def _temp(attention, layers: int) -> int:
  def loss(x):
    for _ in range(layers):
      x = x + jax.checkpoint(lambda x: jnp.tanh(attention(x, 1.1 * x, 0.9 * x)))(x)
    return jnp.sum(x**2)

  x = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
  return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
  "causal", [False, pytest.param(True, marks=pytest.mark.exhaustive)], ids=["full", "causal"]
)
def test_a_checkpointed_layer_keeps_only_its_input(causal):
  def attention(q, k, v):
    blocks = dict(block_sizes=(128, 128))
    return jaxact.dot_product_attention(q, k, v, is_causal=causal, implementation="xla", **blocks)

  growth = (_temp(attention, 4) - _temp(attention, 2)) / 2
  one_input = B * T * H * D * 4
  assert growth <= 1.25 * one_input, growth / one_input  # was about 4 inputs without causal
