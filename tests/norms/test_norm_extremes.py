"""rms_norm / layer_norm at the edges of the float range: rows of 1e30, 1e-30 and near the dtype's
max, mixed magnitudes, constant rows, an epsilon below float32's smallest normal, the output
residual under a dominant bias, empty and vmapped batches; values and gradients against
``jax.vjp`` of the plain formula in float64 (``norm_cases``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from norm_cases import TOL, assert_close, floor, reference, rows


def _ours(center, **kw):
  if center:
    return lambda x, s, b: jaxact.layer_norm(x, s, b, **kw)
  return lambda x, s, b: jaxact.rms_norm(x, s, **kw)


def _check(center, x, scale, bias, ct, tol, slack, **kw):
  y, pull = jax.vjp(_ours(center, **kw), x, scale, bias)
  grads = pull(ct)
  y64, grads64 = reference(x, scale, bias, ct, center=center, eps=kw.get("epsilon", 1e-6))
  assert_close(y, y64, tol, slack)
  assert_close(grads[0], grads64[0], tol, slack)
  for a, b in zip(grads[1:], grads64[1:], strict=True):
    if b is not None:
      assert_close(a, b, tol, slack)


def _params(n, dtype, bias=True):
  k = jax.random.split(jax.random.key(1), 2)
  p = jnp.promote_types(dtype, jnp.float32)
  scale = (jax.random.normal(k[0], (n,), jnp.float64) + 2).astype(p)
  return scale, (jax.random.normal(k[1], (n,), jnp.float64).astype(p) if bias else None)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_rows_of_any_magnitude_match_float64(norm):
  """The issue's row ``[3e30, -4e30, 1e30, 2e30]`` gave 0 (its mean square overflowed); rows near
  float32's max, whose centring overflows, and of 1e-30 beside it, in one call."""
  x = rows(jnp.float32)
  scale, _ = _params(x.shape[-1], jnp.float32)
  ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  _check(norm == "layer", x, scale, None, ct, 1e-5, floor(jnp.float32))
  if norm == "rms":  # the figures: float64 gives [1.095, -1.461, 0.365, 0.730]
    y = jaxact.rms_norm(x[1:2, :4], None)[0]
    np.testing.assert_allclose(y, [1.0954451, -1.4605935, 0.3651484, 0.7302967], rtol=1e-6)


@pytest.mark.sample(3)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
@pytest.mark.parametrize("residual", ["output", "input"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_every_row_kind_in_every_dtype(norm, residual, dtype):
  """Values and gradients of every kind of row (:func:`rows`) within the dtype's tolerance; a
  bias with the input residual (the output residual's bound under a bias: the test below)."""
  x = rows(dtype)
  scale, bias = _params(x.shape[-1], dtype, bias=norm == "layer" and residual == "input")
  ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(dtype)
  _check(norm == "layer", x, scale, bias, ct, TOL[dtype], floor(dtype), residual=residual)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_an_epsilon_below_the_smallest_normal(norm):
  """epsilon=1e-40 (a float32 subnormal, which XLA flushes to 0) on a zero row gave NaN (0 / 0);
  exact: y = 0 and dx = scale ct / sqrt(eps) (1e20 times), finite."""
  x = jnp.zeros((2, 8), jnp.float32).at[1].set(jnp.arange(8, dtype=jnp.float32) * 1e-30)
  scale, _ = _params(8, jnp.float32)
  ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  _check(norm == "layer", x, scale, None, ct, 1e-5, 0.0, epsilon=1e-40)


def _x_hat_bound(x, scale, bias, ct, u):
  """The documented bound on the output residual's gradients, per element: the gradients of an x̂
  off by ``delta <= 4 u (|x̂| + |beta / gamma|)`` (float64)."""
  x, scale, bias, ct = (np.asarray(a, np.float64) for a in (x, scale, bias, ct))
  c = x - x.mean(-1, keepdims=True)
  sigma = np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6)
  x_hat = c / sigma
  delta = 4 * u * (np.abs(x_hat) + np.abs(bias / scale))
  dx_hat = ct * scale
  d_scale = np.sum(np.abs(ct) * delta, 0)
  m = np.abs((dx_hat * x_hat).mean(-1, keepdims=True))
  dx = (delta * m + np.abs(x_hat) * (np.abs(dx_hat) * delta).mean(-1, keepdims=True)) / sigma
  return dx, d_scale


def test_layer_norm_output_residual_within_its_bound_for_any_bias():
  """``x_hat = (y - beta) / gamma`` carries y's rounding, ``u |y|``: with ``beta = 1e4`` and
  ``gamma = 1`` the scale gradient was 1.7e-4 (relative to its largest) from float64, past the
  docs' 1e-5, which named only gamma. The stated bound, ``u (|x_hat| + |beta / gamma|)`` a entry
  (four times that, tested), holds for every bias; ``residual="input"`` is within 1e-5."""
  for beta in (1e2, 1e4, 1e7):
    _check_bias(beta)


def _check_bias(beta):
  k = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k[0], (8, 64), jnp.float32) * 2 + 0.5
  scale = jnp.ones(64, jnp.float32).at[::4].set(0.5)
  bias = jnp.full(64, beta, jnp.float32).at[::3].set(-beta / 10)
  ct = jax.random.normal(k[1], x.shape, jnp.float32)
  _, (rx, rs, _) = reference(x, scale, bias, ct, center=True)
  grads = {}
  for residual in ("output", "input"):
    _, pull = jax.vjp(_ours(True, residual=residual), x, scale, bias)
    grads[residual] = pull(ct)
  bx, bs = _x_hat_bound(x, scale, bias, ct, 2.0**-24)
  dx, ds, _ = grads["output"]
  tol = lambda ref: 1e-6 * np.abs(np.asarray(ref)).max()  # the arithmetic besides x_hat's
  assert (np.abs(np.asarray(dx, np.float64) - rx) <= bx + tol(rx)).all()
  assert (np.abs(np.asarray(ds, np.float64) - rs) <= bs + tol(rs)).all()
  if beta >= 1e4:  # the bias's share is what makes the output residual's error past 1e-5
    assert np.abs(np.asarray(ds, np.float64) - rs).max() > 2e-5 * np.abs(rs).max()
  ix, is_, _ = grads["input"]
  for a, b in ((ix, rx), (is_, rs)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_empty_and_vmapped_batches():
  """No rows, rows of no entries, and a vmapped batch of extreme rows (as the unbatched call)."""
  for shape, f in (((0, 8), _ours(True)), ((3, 0), _ours(False))):
    x = jnp.zeros(shape, jnp.float32)
    scale = jnp.ones(shape[-1], jnp.float32)
    y, pull = jax.vjp(f, x, scale, scale)
    dx, ds, _ = pull(y)
    assert y.shape == dx.shape == shape and ds.shape == scale.shape
    assert np.isfinite(np.asarray(ds)).all()
  x = rows(jnp.float32)[1:5].reshape(4, 2, 8)  # 1e30, 1e-30, mixed, near the max
  scale, bias = _params(8, jnp.float32)
  f = functools.partial(_ours(True), s=scale, b=bias)
  g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))
  np.testing.assert_array_equal(jax.vmap(g)(x), jnp.stack([g(a) for a in x]))
