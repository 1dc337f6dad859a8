"""softmax / log_softmax: stability, empty rows, `where` masks, axes."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.activations import reference as references

import cases
from cases import DTYPES, F64, as_dtype, assert_within, dtype_id, eps, loss_grad

SOFTMAXES = [pytest.param(name, id=name) for name in ("softmax", "log_softmax")]
_INF = np.inf
_W = np.array([1.0, -2.0, 0.5, 3.0])  # a cotangent: sum(softmax) has gradient 0 and tests nothing


def _fns(name):
  return getattr(jaxact, name), getattr(jax.nn, name), getattr(references, name)


def _stable_rows(dtype):
  big = 0.88 * float(jnp.finfo(dtype).max)  # 3e38 in float32 and bfloat16, 5.8e4 in float16
  return np.array([[1e4, 1e4 + 1, 1e4 + 2, 1e4 + 3], [-big, big, 0.0, 1.0], [-big, -big, 0.0, 1.0]])


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", SOFTMAXES)
def test_stable_for_huge_and_spread_rows(name, dtype):
  f, _, ref = _fns(name)
  x = as_dtype(_stable_rows(dtype), dtype)
  y = f(x)
  assert y.dtype == dtype
  got = np.asarray(y, np.float64)
  assert not np.isnan(got).any()
  want = np.asarray(as_dtype(ref(x.astype(F64)), dtype), np.float64)  # -6e38 rounds to -inf
  inf = np.isinf(want)
  np.testing.assert_array_equal(got[inf], want[inf])
  # Absolute: log-probabilities carry an ulp of log(sum) (see cases.VALUE_ABS_SCALE).
  bound = cases.VALUE_ULPS[dtype] * eps(dtype) * (1.0 + np.abs(want)) + cases.VALUE_ATOL[dtype]
  assert_within(got[~inf], want[~inf], bound[~inf], name)
  chex.assert_tree_all_finite(loss_grad(f, x, np.broadcast_to(_W, x.shape)))


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", SOFTMAXES)
def test_all_minus_inf_row_is_empty_with_zero_gradient(name, dtype):
  f = getattr(jaxact, name)
  x = jnp.asarray([[-_INF] * 4, [0.5, -1.0, 2.0, 0.0]], dtype)
  y = np.asarray(f(x), np.float64)
  empty = 0.0 if name == "softmax" else -_INF
  np.testing.assert_array_equal(y[0], empty)
  assert np.isfinite(y[1]).all()
  g = np.asarray(loss_grad(lambda v: jnp.where(jnp.isinf(f(v)), 0, f(v)), x, np.stack([_W, _W])))
  np.testing.assert_array_equal(g[0], 0.0)
  # The same with a cotangent on the -inf outputs themselves (what a loss reading them would send).
  g = np.asarray(jax.vjp(f, x)[1](jnp.asarray(np.stack([_W, _W]), dtype))[0])
  np.testing.assert_array_equal(g[0], 0.0)
  assert np.isfinite(g).all()


@pytest.mark.parametrize("name", SOFTMAXES)
def test_plus_inf_entries_share_the_mass(name):
  """Documented: +inf entries split the row evenly (jax.nn gives NaN)."""
  f = getattr(jaxact, name)
  y = np.asarray(f(jnp.asarray([_INF, 1.0, _INF, -_INF], jnp.float32)), np.float64)
  want = np.array([0.5, 0.0, 0.5, 0.0])
  with np.errstate(divide="ignore"):
    want = want if name == "softmax" else np.log(want)
  np.testing.assert_allclose(y, want, rtol=1e-7)


# ------------------------------------------------------------------------------------- where

_X = np.array([[0.3, -1.2, 2.0, 0.7], [1.5, 0.1, -0.4, -2.2], [0.0, 1.0, 2.0, 3.0]])
_MASK = np.array([[True, False, True, True], [False, True, False, True], [False] * 4])


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("name", SOFTMAXES)
def test_where_matches_jax_nn_and_masks_the_gradient(name, dtype):
  f, f_nn, ref = _fns(name)
  x, m = jnp.asarray(_X, dtype), jnp.asarray(_MASK)
  y = np.asarray(f(x, where=m), np.float64)
  empty = 0.0 if name == "softmax" else -_INF
  np.testing.assert_array_equal(y[~_MASK], empty)  # masked entries, and the all-masked row
  partial = _MASK.any(-1)
  want = np.asarray(f_nn(x, where=m), np.float64)
  bound = 4 * cases.JAX_NN_ULPS * eps(dtype) * (1 + np.abs(np.where(_MASK, want, 0)))
  assert_within(np.where(_MASK, y, 0)[partial], np.where(_MASK, want, 0)[partial], bound[partial])
  want64 = np.asarray(ref(x.astype(F64), where=m))
  bound = cases.VALUE_ULPS[dtype] * eps(dtype) * (1 + np.abs(np.where(_MASK, want64, 0)))
  assert_within(y[_MASK], want64[_MASK], bound[_MASK], name)

  w = np.broadcast_to(_W, _X.shape)
  # Gradient reaching masked entries is zero, even from a cotangent sent to them.
  g = np.asarray(jax.vjp(lambda v: f(v, where=m), x)[1](jnp.asarray(w, dtype))[0], np.float64)
  np.testing.assert_array_equal(g[~_MASK], 0.0)
  # Through the unmasked outputs: the same gradient as jax.nn's and the float64 reference's.
  masked_loss = lambda fn: lambda v: jnp.where(m, fn(v, where=m), 0)
  g = np.asarray(loss_grad(masked_loss(f), x, w), np.float64)
  g_nn = np.asarray(loss_grad(masked_loss(f_nn), x, w), np.float64)
  g64 = np.asarray(loss_grad(masked_loss(ref), x.astype(F64), w))
  np.testing.assert_array_equal(g[~_MASK], 0.0)
  bound = cases.GRAD_ULPS[dtype] * eps(dtype) * np.maximum(1, np.abs(g64))
  assert_within(g, g64, bound, f"{name} where-gradient vs reference")
  assert_within(g, g_nn, 4 * bound, f"{name} where-gradient vs jax.nn")


@pytest.mark.parametrize("name", SOFTMAXES)
def test_where_broadcasts(name):
  f, f_nn, _ = _fns(name)
  x = jnp.asarray(_X, jnp.float32)
  m = jnp.asarray([True, False, True, True])
  np.testing.assert_allclose(f(x, where=m), f_nn(x, where=m), rtol=1e-6)


# -------------------------------------------------------------------------------------- axes

_X3 = np.linspace(-3.0, 3.0, 24).reshape(2, 3, 4) ** 2 / 3 - 1  # not monotone along any axis


@pytest.mark.sample(2)
@pytest.mark.parametrize("axis", [0, 1, -1, 2, (0, 2), (1, 0), None], ids=str)
@pytest.mark.parametrize("name", SOFTMAXES)
def test_axes_match_jax_nn_and_reference(name, axis):
  f, f_nn, ref = _fns(name)
  x = jnp.asarray(_X3, jnp.float32)
  y = f(x, axis=axis)
  assert y.shape == x.shape and y.dtype == jnp.float32
  bound = 8 * eps(jnp.float32)
  np.testing.assert_allclose(y, ref(x.astype(F64), axis=axis), rtol=bound, atol=bound)
  np.testing.assert_allclose(y, f_nn(x, axis=axis), rtol=bound, atol=bound)
  w = np.arange(24).reshape(2, 3, 4) % 5 - 2.0
  g = loss_grad(lambda v: f(v, axis=axis), x, w)
  g_nn = loss_grad(lambda v: f_nn(v, axis=axis), x, w)
  np.testing.assert_allclose(g, g_nn, rtol=4 * bound, atol=4 * bound)


@pytest.mark.parametrize("name", SOFTMAXES)
def test_layer_activation_keeps_no_buffer_beyond_its_output(name):
  """An L-layer MLP h = softmax(h @ w) under jit(grad) with a loss whose cotangent is computed from
  the output (sum h^2): L + 1 activation buffers of temp, as for every output-residual activation
  (softmax's backward read the cotangent twice in one fusion and kept one more buffer)."""
  layers, batch, width = 3, 2048, 256
  keys = jax.random.split(jax.random.key(0), layers + 1)
  ws = [jax.random.normal(k, (width, width), jnp.float32) / 16 for k in keys[:-1]]
  x = jax.random.normal(keys[-1], (batch, width), jnp.float32)
  act = getattr(jaxact, name)

  def loss(ws, x):
    for w in ws:
      x = act(x @ w)
    return jnp.sum(x**2)

  compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
  buffers = compiled.memory_analysis().temp_size_in_bytes / (batch * width * 4)
  assert buffers <= layers + 1 + 0.05, buffers
