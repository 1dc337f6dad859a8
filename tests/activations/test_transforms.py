"""jit, vmap, grad, grad-of-grad, jax.checkpoint, lax.scan and jax.hessian on every activation.

``jax.jvp`` of a ``custom_vjp`` function is impossible in JAX; that it raises is tested (and
documented in the README).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxact._src.core.spec import SPECS

from cases import ELEMENTWISE, F64, assert_within, eps, public, reference, representatives

ALL = [pytest.param(s, id=s.name) for s in SPECS]
# One activation of each residual family, and the non-elementwise ones: the default run of the
# slower transformations (scan, hessian); every activation under -m exhaustive.
FAMILIES = representatives(
  list(SPECS),
  {"relu", "tanh", "leaky_relu", "gelu", "mish", "identity", "glu", "softmax", "log_softmax"},
  [s.name for s in SPECS],
)

# Away from every kink (0, ±1, ±3, 6) by more than check_grads' finite-difference step.
_POINTS = np.array([[-2.3, -0.7, 0.4, 1.3], [2.6, 7.2, -4.1, 0.55]])
_W = np.array([[0.5, -1.0, 0.25, 2.0], [-0.75, 1.5, 1.0, -0.5]])


def _x(dtype=jnp.float32) -> jax.Array:
  return jnp.asarray(_POINTS, dtype)


def _loss(f, w=_W):
  def loss(x):
    y = f(x)
    return jnp.sum(y * jnp.asarray(w[..., : y.shape[-1]], y.dtype))

  return loss


@pytest.mark.sample(1)
@pytest.mark.parametrize("spec", ALL)
def test_jit_and_vmap(spec):
  f, x = public(spec), _x()
  y = f(x)
  np.testing.assert_array_equal(jax.jit(f)(x), y)
  np.testing.assert_allclose(jax.vmap(f)(x), y, rtol=1e-6, atol=1e-7)  # rows are independent
  batch = jnp.stack([x, 2 * x, -x])
  np.testing.assert_allclose(
    jax.vmap(f)(batch), jnp.stack([y, f(2 * x), f(-x)]), rtol=1e-6, atol=1e-7
  )
  g = jax.grad(_loss(f))(x)
  np.testing.assert_allclose(jax.jit(jax.grad(_loss(f)))(x), g, rtol=1e-6, atol=1e-7)
  per_row = jax.vmap(jax.grad(lambda r: _loss(f, _W[0])(r[None])))(x)
  np.testing.assert_allclose(per_row[0], g[0], rtol=1e-6, atol=1e-7)


@pytest.mark.sample(2)
@pytest.mark.parametrize("spec", ALL)
def test_check_grads_second_order(spec):
  """Reverse mode, to second order, against finite differences (float64)."""
  check_grads(public(spec), (_x(F64),), order=2, modes=["rev"])


@pytest.mark.sample(2)
@pytest.mark.parametrize("spec", FAMILIES)
def test_hessian_matches_reference(spec):
  x = _x(F64)
  h = jax.hessian(_loss(public(spec)))(x)
  want = jax.hessian(_loss(reference(spec)))(x)
  assert h.shape == want.shape == x.shape * 2
  assert_within(h, want, 64 * eps(F64) * np.maximum(1.0, np.abs(want)), spec.name)


@pytest.mark.sample(2)
@pytest.mark.parametrize("spec", ALL)
def test_checkpoint(spec):
  f, x = public(spec), _x()
  g = jax.grad(_loss(f))(x)
  got = jax.grad(jax.checkpoint(_loss(f)))(x)
  np.testing.assert_allclose(got, g, rtol=1e-6, atol=1e-7)
  policy = jax.checkpoint_policies.nothing_saveable
  got = jax.jit(jax.grad(jax.checkpoint(_loss(f), policy=policy)))(x)
  np.testing.assert_allclose(got, g, rtol=1e-6, atol=1e-7)


@pytest.mark.sample(1)
@pytest.mark.parametrize("spec", FAMILIES)
def test_scan_over_layers(spec):
  """An MLP's layers under lax.scan (optionally rematerialized) equal the unrolled loop."""
  f = public(spec)
  n, layers = 4, 3
  m = 2 * n if f(jnp.zeros((1, 2 * n), jnp.float32)).shape[-1] == n else n  # glu halves its input
  ws = jax.random.normal(jax.random.key(1), (layers, n, m), jnp.float32) / 2
  x = _x()

  def unrolled(ws):
    h = x
    for i in range(layers):
      h = f(h @ ws[i])
    return jnp.sum(h**2)

  def scanned(ws, remat=False):
    body = lambda h, w: (f(h @ w), None)
    h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, x, ws)
    return jnp.sum(h**2)

  want, g_want = jax.value_and_grad(unrolled)(ws)
  for remat in (False, True):
    got, g = jax.jit(jax.value_and_grad(functools.partial(scanned, remat=remat)))(ws)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "spec", [pytest.param(s, id=s.name) for s in ELEMENTWISE if any(not p.static for p in s.params)]
)
def test_vmap_over_a_parameter(spec):
  (p,) = [p for p in spec.params if not p.static][:1]
  f, x = public(spec), _x()
  vals = jnp.asarray([p.default, 0.5 * p.default, 2.0 * p.default], jnp.float32)
  got = jax.vmap(lambda v: f(x, **{p.name: v}))(vals)
  for i, v in enumerate(vals):
    np.testing.assert_allclose(got[i], f(x, **{p.name: v}), rtol=1e-6)


@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in SPECS])
def test_jvp_raises(spec):
  """Forward mode on a custom_vjp is not possible in JAX (documented); it fails loudly."""
  x = _x()
  with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
    jax.jvp(public(spec), (x,), (jnp.ones_like(x),))
