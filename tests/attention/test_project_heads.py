"""jaxact.project_heads: the attention's output projection, equal to the reshape-and-matmul JAX
differentiates, keeping only its inputs: under lax.scan a stack keeps the attention's O once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

B, T, N, H, D = 2, 6, 3, 4, 5


def _plain(o, w):
  return o.reshape(*o.shape[:-2], -1) @ w.reshape(-1, w.shape[-1])


@pytest.mark.parametrize("layout", ["flat", "heads"])
def test_values_and_gradients_equal_autodiff_of_the_reshape_and_matmul(layout):
  ko, kw, kg = jax.random.split(jax.random.key(0), 3)
  o = jax.random.normal(ko, (B, T, N, H), jnp.float64)
  w = jax.random.normal(kw, (N * H, D) if layout == "flat" else (N, H, D), jnp.float64)
  g = jax.random.normal(kg, (B, T, D), jnp.float64)
  y, pull = jax.vjp(jaxact.project_heads, o, w)
  y_ref, pull_ref = jax.vjp(_plain, o, w)
  np.testing.assert_allclose(y, y_ref, rtol=1e-12)
  for got, want in zip(pull(g), pull_ref(g), strict=True):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_bfloat16_in_bfloat16_out():
  o = jnp.ones((B, T, N, H), jnp.bfloat16)
  w = jnp.ones((N * H, D), jnp.bfloat16)
  y, pull = jax.vjp(jaxact.project_heads, o, w)
  do, dw = pull(jnp.ones_like(y))
  assert (y.dtype, do.dtype, dw.dtype) == (jnp.bfloat16,) * 3
  np.testing.assert_allclose(np.asarray(y, np.float32), N * H)


def test_a_scanned_stack_keeps_the_attention_output_once():
  """The reshape form stacks O twice (the attention's and the matmul's reshaped copy); with
  project_heads the scan's stacked residuals hold one array of O's size."""
  layers, heads, dim = 3, 2, 8
  d = heads * dim
  x = jax.random.normal(jax.random.key(1), (B, 16, d))
  ws = jnp.stack([jnp.eye(d)] * layers)

  def stacked(project):
    def block(x, w):
      q = (x @ w).reshape(B, 16, heads, dim)
      o = jaxact.dot_product_attention(q, q, q, is_causal=True)
      return x + project(o, w), None

    loss = lambda ws, x: jnp.sum(jax.lax.scan(block, x, ws)[0] ** 2)
    scan = next(
      e for e in jax.make_jaxpr(jax.grad(loss))(ws, x).jaxpr.eqns if e.primitive.name == "scan"
    )
    return [v.aval.shape[1:] for v in scan.outvars if v.aval.shape[:1] == (layers,)]

  o_like = [(B, 16, heads, dim), (B, 16, d)]  # O, or O reshaped
  reshaped = stacked(lambda o, w: o.reshape(B, 16, d) @ w)
  projected = stacked(jaxact.project_heads)
  # each block's input x (for the q projection's dw), q, O, and in the reshape form O again
  assert sum(s in o_like for s in reshaped) == 4, reshaped
  assert sum(s in o_like for s in projected) == 3, projected


@pytest.mark.parametrize(
  "o_shape, w_shape, error, match",
  [
    ((B, T, N, H), (N * H + 1, D), ValueError, r"`w` has shape \(13, 5\); accepted: \(12, D\)"),
    ((B, T, N, H), (N, H + 1, D), ValueError, r"`w` has shape"),
    ((H,), (H, D), ValueError, r"`o` has shape \(4,\)"),
  ],
)
def test_bad_shapes_are_named(o_shape, w_shape, error, match):
  with pytest.raises(error, match=match):
    jaxact.project_heads(jnp.ones(o_shape), jnp.ones(w_shape))


def test_an_integer_o_is_refused():
  with pytest.raises(TypeError, match=r"`o` has dtype int32"):
    jaxact.project_heads(jnp.ones((B, T, N, H), jnp.int32), jnp.ones((N * H, D)))
