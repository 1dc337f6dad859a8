"""``residuals="input"``: the gated ops keeping their input alone, the projections recomputed.

The gradients are those of the default (which keep a and b) and of autodiff of the composition;
the pullback holds x and the weights only; a stack of blocks, unrolled under jit or scanned,
compiles to at least its blocks' a and b less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import jaxact.linen
import jaxact.nnx
from jaxact._src.gated.reference import composition, reference_activation

D, F, O = 8, 12, 6  # noqa: E741 (in, hidden, out)
BATCH = (3, 5)
TOL = {
  jnp.float64: dict(atol=1e-12, rtol=1e-12),
  jnp.bfloat16: dict(atol=8e-2, rtol=4e-2),
}


def operands(dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 7)
  shapes = [(*BATCH, D), (D, F), (D, F), (F, O), (F,), (F,), (O,)]
  scales = [1.0, D**-0.5 * 2, D**-0.5, F**-0.5, 0.5, 0.5, 0.5]
  return tuple(
    (s * jax.random.normal(k, shape, jnp.float64)).astype(dtype)
    for k, shape, s in zip(ks, shapes, scales, strict=True)
  )


def call(mlp, **kw):
  def f(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    if mlp:
      return jaxact.gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, **kw)
    return jaxact.gated_dense(x, w_gate, w_up, b_gate, b_up, **kw)

  return f


def value_and_grads(f, args, ct):
  y, pull = jax.vjp(f, *args)
  return y, pull(ct.astype(y.dtype))


def assert_close(got, want, dtype, what):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    np.testing.assert_allclose(
      np.asarray(g, np.float64), np.asarray(w, np.float64), err_msg=f"{what} [{i}]", **TOL[dtype]
    )


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("mlp", [True, False], ids=["mlp", "dense"])
def test_keeping_the_input_gives_the_gradients_of_the_composition(monkeypatch, mlp, dtype, blocks):
  """Values and every gradient as autodiff of the composition (float64), and equal to the default's
  to rounding; `blocks`: the backward in blocks of 4 rows (the 15 tokens make four, the last
  moved back), each block's a and b recomputed from its rows of x."""
  from jaxact._src.gated import rules

  if blocks:
    monkeypatch.setattr(rules, "BACKWARD_ROWS", 4)
  args = operands(dtype)
  ct = jnp.cos(jnp.arange(np.prod(BATCH) * (O if mlp else F))).reshape(*BATCH, -1)
  got = value_and_grads(call(mlp, activation="gelu", residuals="input"), args, ct)
  wide = [a.astype(jnp.float64) for a in args]
  want = value_and_grads(composition(reference_activation("gelu"), mlp), wide, ct)
  assert_close(got, want, dtype, "against autodiff")
  kept = value_and_grads(call(mlp, activation="gelu"), args, ct)
  for g, k in zip(jax.tree.leaves(got), jax.tree.leaves(kept), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(k, np.float64), rtol=1e-2)


def test_keeping_the_input_with_dropout_and_a_traced_parameter():
  """The dropout's mask drawn again from the key and a traced activation parameter's gradient:
  equal to the default, which keeps a and b."""
  args = operands(jnp.float64)
  key = jax.random.key(3)

  def f(residuals):
    def loss(slope, *a):
      act = lambda z: jax.nn.leaky_relu(z, slope)
      y = jaxact.gated_mlp(
        *a, activation=act, dropout_rate=0.3, dropout_rng=key, residuals=residuals
      )
      return jnp.sum(jnp.sin(y))

    return jax.grad(loss, argnums=tuple(range(8)))(jnp.float64(0.2), *args)

  assert_close(f("input"), f("projections"), jnp.float64, "dropout")


def test_the_pullback_keeps_the_input_and_the_weights_only():
  x, w_gate, w_up, w_down, b_gate, b_up, b_down = operands(jnp.float32)
  _, pull = jax.vjp(call(True, residuals="input"), x, w_gate, w_up, w_down, b_gate, b_up, b_down)
  big = [leaf for leaf in jax.tree.leaves(pull) if leaf.size >= x.size]
  assert len(big) == 1 and np.array_equal(big[0], x), [leaf.shape for leaf in big]
  assert not [leaf for leaf in jax.tree.leaves(pull) if leaf.shape == (*BATCH, F)]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_a_stack_compiles_to_its_blocks_projections_less(scan):
  """A 4-block residual stack ``x + gated_mlp(norm(x))`` under jit(grad): keeping the input
  compiles to at least two and a half blocks' a and b less temp than keeping them (the last
  block's are read at once either way; the backward's recomputed projections are not merged with
  the forward's, which would keep them alive)."""
  tokens, d, f, n = 256, 32, 96, 4

  def temp(residuals):
    def block(x, w):
      h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
      return x + jaxact.gated_mlp(h, *w, residuals=residuals)

    def loss(ws, x):
      if scan:
        x = jax.lax.scan(lambda c, w: (block(c, w), None), x, ws)[0]
      else:
        for i in range(n):
          x = block(x, [w[i] for w in ws])
      return jnp.sum(x**2)

    shape = jax.ShapeDtypeStruct
    ws = [shape((n, d, f), jnp.float32)] * 2 + [shape((n, f, d), jnp.float32)]
    compiled = jax.jit(jax.grad(loss)).lower(ws, shape((tokens, d), jnp.float32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  a_and_b = 2 * tokens * f * 4
  kept, recomputed = temp("projections"), temp("input")
  assert recomputed <= kept - 2.5 * a_and_b, (kept, recomputed)


def test_an_unknown_residuals_value_is_refused():
  args = operands(jnp.float32)
  with pytest.raises(ValueError, match=r"jaxact.gated_mlp: `residuals` 'x' is not known; choose"):
    call(True, residuals="x")(*args)
  with pytest.raises(ValueError, match=r"jaxact.gated_dense: `residuals` 'a' is not known"):
    call(False, residuals="a")(*args)


def test_the_flax_layers_take_the_option():
  """linen and nnx GatedMLP(residuals="input"): the default layers' gradients."""
  from flax import nnx

  x = operands(jnp.float32)[0]
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  mine, plain = (jaxact.linen.GatedMLP(F, residuals=r) for r in ("input", "projections"))
  params = plain.init(jax.random.key(0), x)
  grads = [jax.grad(lambda p, m=m: jnp.sum(jnp.sin(m.apply(p, x))))(params) for m in (mine, plain)]
  jax.tree.map(close, *grads)

  def nnx_grads(residuals):
    layer = jaxact.nnx.GatedMLP(D, F, rngs=nnx.Rngs(0), residuals=residuals)
    return nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)

  jax.tree.map(close, nnx_grads("input"), nnx_grads("projections"))
