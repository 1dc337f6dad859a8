"""Extreme inputs: no NaN from non-NaN input, finite gradients for finite input, limits at ±inf.

The grid, for every activation and dtype: ±1e30 (±inf after the cast in float16), ±finfo.max,
±88.8 (exp overflows float32 past 88.7), ±548, ±smallest subnormal, ±finfo.tiny, 0, ±inf; NaN has
a test of its own.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.activations import reference as references
from jaxact._src.core.spec import SPECS

import cases
from cases import (
  DTYPES,
  ELEMENTWISE,
  F64,
  NON_ELEMENTWISE,
  OUTPUT_RESIDUAL,
  as_dtype,
  assert_within,
  cotangent,
  dtype_id,
  eps,
  loss_grad,
  public,
  reference,
  spec_param,
)

_NAN = math.nan
_INF = math.inf


def extremes(dtype) -> jax.Array:
  fi = jnp.finfo(dtype)
  mags = [1e30, float(fi.max), 88.8, 548.0, float(fi.smallest_subnormal), float(fi.tiny)]
  return as_dtype([s * m for m in mags for s in (1.0, -1.0)] + [0.0, _INF, -_INF], dtype)


def _grad_at(fn, x):
  """f'(x) elementwise, each entry on its own (a NaN entry cannot touch the others)."""
  return jax.vmap(jax.grad(fn))(x)


def _nan_cases():
  return [
    pytest.param(
      s,
      dtype,
      id=f"{s.name}-{dtype_id(dtype)}",
    )
    for s in SPECS
    for dtype in DTYPES
  ]


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec, dtype", _nan_cases())
def test_nan_propagates(spec, dtype):
  x = jnp.asarray([[_NAN, 1.0, -2.0, 0.5], [0.25, -1.0, 3.0, -0.5]], dtype)
  y = np.asarray(public(spec)(x), np.float64)
  if spec.elementwise:
    assert np.isnan(y[0, 0]), f"{spec.name}(NaN) = {y[0, 0]}"
    assert not np.isnan(y[0, 1:]).any() and not np.isnan(y[1]).any()
  elif spec.name == "glu":  # a NaN in either half makes that output NaN
    assert np.isnan(y[0, 0]) and not np.isnan(y[0, 1]) and not np.isnan(y[1]).any()
  else:  # softmaxes: the NaN's row is NaN, as in jax.nn
    assert np.isnan(y[0]).all() and not np.isnan(y[1]).any()


@pytest.mark.sample(3)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", spec_param(ELEMENTWISE))
def test_extreme_inputs(spec, dtype):
  x = extremes(dtype)
  fn = public(spec)
  y, g = fn(x), _grad_at(fn, x)
  assert y.dtype == g.dtype == dtype
  x64, y64, g64 = (np.asarray(a, np.float64) for a in (x, y, g))
  assert not np.isnan(y64).any(), f"NaN from non-NaN input: {dict(zip(x64, y64, strict=True))}"
  finite = np.isfinite(x64)
  chex.assert_tree_all_finite(g[jnp.asarray(finite)])

  lo, dlo, hi, dhi = references.LIMITS[spec.name]
  for at, value, slope in ((-_INF, lo, dlo), (_INF, hi, dhi)):
    i = x64 == at  # float16 has more than one: ±1e30 cast to ±inf
    want = float(jnp.asarray(value, dtype))  # the limit rounded to the dtype
    assert (y64[i] == want).all(), f"{spec.name}({at}) = {y64[i]}, not {want}"
    # The gradient from a rounded output may miss the limit by a fraction of an ulp of 1
    # (selu'(-inf) in bfloat16 is y + 1.7581 with y = -1.7578).
    grad_bound = cases.GRAD_ULPS[dtype] * eps(dtype) * max(1.0, abs(slope))
    assert_within(g64[i], np.full(i.sum(), slope), grad_bound, f"{spec.name}'({at})")

  # Large finite inputs where the float64 reference itself is finite: the right numbers, not
  # merely finite ones (subnormals are excluded: XLA flushes them to zero, onto a kink).
  ok = finite & (np.abs(x64) >= 88.0) & (np.abs(x64) <= 548.0)
  want_y = np.asarray(reference(spec)(jnp.asarray(x64[ok], F64)))
  want_g = np.asarray(jax.vmap(jax.grad(reference(spec)))(jnp.asarray(x64[ok], F64)))
  good = np.isfinite(want_y) & np.isfinite(want_g) & (np.abs(want_y) <= float(jnp.finfo(dtype).max))
  scale = np.abs(want_y) + np.abs(x64[ok] * want_g)  # as in test_activations: |f| + |x f'|
  value_bound = cases.VALUE_ULPS[dtype] * eps(dtype) * scale + cases.VALUE_ATOL[dtype]
  assert_within(y64[ok][good], want_y[good], value_bound[good], f"{spec.name} at ±88.8, ±548")
  grad_bound = cases.GRAD_ULPS[dtype] * eps(dtype) * np.maximum(1.0, np.abs(want_g))
  assert_within(g64[ok][good], want_g[good], grad_bound[good], f"{spec.name}' at ±88.8, ±548")

  # Beyond every saturation (|x| >= 1e30, finfo.max) the gradient is the limit's.
  for sign, slope in ((-1.0, dlo), (1.0, dhi)):
    far = finite & (sign * x64 >= 1e30)
    bound = cases.GRAD_ULPS[dtype] * eps(dtype) * max(1.0, abs(slope))
    assert_within(g64[far], np.full(far.sum(), slope), bound, f"{spec.name}' far out")


def _far_cases():
  return [
    pytest.param(
      s,
      dtype,
      id=f"{s.name}-{dtype_id(dtype)}",
    )
    for s in ELEMENTWISE
    for dtype in DTYPES
  ]


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec, dtype", _far_cases())
def test_far_inputs_follow_the_asymptote(spec, dtype):
  """At ±1e30 and ±finfo.max the value is the float64 reference's where that is finite, else the
  asymptote: the limit, or slope * x where the limit is infinite (so finite unless slope * x
  itself is out of range, as selu(finfo.max) is)."""
  fi = jnp.finfo(dtype)
  x = as_dtype([1e30, float(fi.max), -1e30, -float(fi.max)], dtype)
  x64 = np.asarray(x, np.float64)
  keep = np.isfinite(x64)  # float16: 1e30 is inf
  x, x64 = x[jnp.asarray(keep)], x64[keep]
  y = np.asarray(public(spec)(x), np.float64)
  lo, dlo, hi, dhi = references.LIMITS[spec.name]
  limit = np.where(x64 > 0, hi, lo)
  slope = np.where(x64 > 0, dhi, dlo)
  ref = np.asarray(reference(spec)(jnp.asarray(x64, F64)))
  with np.errstate(over="ignore", invalid="ignore"):
    want = np.where(np.isfinite(ref), ref, np.where(np.isinf(limit), slope * x64, limit))
  want = np.asarray(as_dtype(want, dtype), np.float64)  # rounded (or overflowed) to the dtype
  big = np.isinf(want)
  np.testing.assert_array_equal(y[big], want[big], f"{spec.name} at {x64[big]}")
  bound = cases.VALUE_ULPS[dtype] * eps(dtype) * np.abs(want) + cases.VALUE_ATOL[dtype]
  assert_within(y[~big], want[~big], bound[~big], f"{spec.name} at {x64[~big]}")


def _rows(v: jax.Array, width: int = 4) -> jax.Array:
  return jnp.stack([jnp.roll(v, k) for k in range(width)], axis=-1)


@pytest.mark.sample(3)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", spec_param(NON_ELEMENTWISE))
def test_extreme_inputs_rowwise(spec, dtype):
  """glu / softmax / log_softmax on rows that mix the extreme values (NaN: test_nan_propagates)."""
  x = _rows(extremes(dtype))
  fn = public(spec)
  y = fn(x)
  assert y.dtype == dtype
  x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if spec.name == "glu":
    a, b = np.split(x64, 2, axis=-1)
    # ±inf * sigmoid(-inf) has no limit; everything else must be a number.
    assert not np.isnan(y64[~np.isinf(a) & ~np.isinf(b)]).any()
  else:
    assert not np.isnan(y64).any(), f"NaN from rows without NaN: {x64[np.isnan(y64).any(-1)]}"
  finite_rows = np.isfinite(x64).all(-1)
  xf = x[jnp.asarray(finite_rows)]
  w = cotangent(spec, jax.eval_shape(fn, xf).shape)
  chex.assert_tree_all_finite(loss_grad(fn, xf, w))


# ------------------------------------------------------------------------ regressions (issue 2)


def _value_and_grad(fn, x):
  return fn(x), _grad_at(fn, x)


@pytest.mark.sample(2)
@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize(
  "dtype, points",
  [
    pytest.param(jnp.float32, [1e30, -1e30, 3.4e38, -3.4e38, 1e20, -1e20], id="float32"),
    pytest.param(jnp.float16, [300.0, -300.0, 65504.0, -65504.0, 1000.0, -1000.0], id="float16"),
    pytest.param(jnp.bfloat16, [1e30, -1e30, 3.38e38, -3.38e38], id="bfloat16"),
  ],
)
def test_gelu_gradient_finite_where_jax_nn_is_nan(dtype, points, approximate):
  """jax.nn.gelu's gradient is NaN at |x| >= 1e30 (float32) and |x| >= 300 (float16)."""
  x = jnp.asarray(points, dtype)
  y, g = _value_and_grad(lambda v: jaxact.gelu(v, approximate=approximate), x)
  chex.assert_tree_all_finite((y, g))
  pos = np.asarray(x) > 0
  np.testing.assert_array_equal(np.asarray(y)[pos], np.asarray(x)[pos])  # gelu(x) = x, far right
  np.testing.assert_array_equal(np.asarray(y)[~pos], 0)  # and 0 far left
  np.testing.assert_array_equal(np.asarray(g, np.float64), np.where(pos, 1.0, 0.0))


def test_squareplus_finite_at_float32_max():
  """jax.nn.squareplus overflows x^2 and is inf/NaN at ±3.4e38."""
  x = jnp.asarray([3.4e38, -3.4e38, 1e20, -1e20, 1e19, -1e19], jnp.float32)
  y, g = _value_and_grad(jaxact.squareplus, x)
  chex.assert_tree_all_finite((y, g))
  x64 = np.asarray(x, np.float64)
  pos = x64 > 0
  np.testing.assert_array_equal(np.asarray(y)[pos], np.asarray(x)[pos])
  # x < 0: b / (4 |x|) = 1 / |x|, below float32's range for |x| >= 1e38.
  assert_within(
    np.asarray(y)[~pos],
    1.0 / np.abs(x64[~pos]),
    4 * eps(jnp.float32) / np.abs(x64[~pos]) + cases.VALUE_ATOL[jnp.float32],
  )
  np.testing.assert_array_equal(np.asarray(g)[pos], 1.0)
  assert (np.asarray(g)[~pos] >= 0).all() and (np.asarray(g)[~pos] <= 4 * eps(jnp.float32)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sigmoid_gradient_finite_at_minus_548(dtype):
  """candle's sigmoid gradient was NaN at x = -548 (exp(548) overflows float32)."""
  x = jnp.asarray([-548.0, -88.8, -88.0, -104.0], dtype)
  y, g = _value_and_grad(jaxact.sigmoid, x)
  chex.assert_tree_all_finite((y, g))
  want = np.asarray(jax.vmap(jax.grad(references.sigmoid))(x.astype(F64)))
  assert_within(g, want, cases.GRAD_ULPS[dtype] * eps(dtype) * np.maximum(1.0, want))


def test_sigmoid_gradient_saturates_where_documented():
  """Documented limit: from the output alone sigmoid' is exactly 0 once y rounds to 1 (x >= 17 in
  float32), which is within an ulp of 1 of the true value."""
  x = jnp.asarray([17.0, 20.0, 30.0], jnp.float32)
  g = np.asarray(_grad_at(jaxact.sigmoid, x), np.float64)
  np.testing.assert_array_equal(g, 0.0)
  assert (
    np.asarray(jax.vmap(jax.grad(references.sigmoid))(x.astype(F64))) < eps(jnp.float32)
  ).all()


# --------------------------------------------------------- tiny inputs on either side of a kink


def _tiny_cases():
  out = []
  for s in OUTPUT_RESIDUAL:
    if not s.elementwise:
      continue
    for dtype in DTYPES:
      out.append(pytest.param(s, dtype, id=f"{s.name}-{dtype_id(dtype)}"))
  return out


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec, dtype", _tiny_cases())
def test_gradient_at_tiny_inputs_is_that_sides_derivative(spec, dtype):
  """x = ±finfo.tiny (the smallest normal number) is not a kink: the derivative there is the one
  of its side, even though the output saved for the backward pass may underflow."""
  tiny = float(jnp.finfo(dtype).tiny)
  x = jnp.asarray([-tiny, tiny, -4 * tiny, 4 * tiny], dtype)
  g = np.asarray(_grad_at(public(spec), x), np.float64)
  want = np.asarray(jax.vmap(jax.grad(reference(spec)))(x.astype(F64)))
  assert_within(
    g, want, cases.GRAD_ULPS[dtype] * eps(dtype) * np.maximum(1.0, np.abs(want)), spec.name
  )


# ------------------------------------------------------------------------ regressions (issue 19)


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_squareplus_b0_gradient_is_one_for_tiny_positive_x(dtype):
  """With b = 0 squareplus is relu; its output-residual derivative was 0/0 once y*y underflowed
  (positive x below ~1e-19 in float32), in the activation and in the fused layers."""
  fi = jnp.finfo(dtype)
  pts = [float(fi.tiny), 1e-30, 1e-20, 1e-19, float(fi.eps), 1.0, 1e30, -1e-20, -1.0]
  x = as_dtype(pts, dtype)
  keep = np.isfinite(np.asarray(x, np.float64))
  x = x[jnp.asarray(keep)]
  x64 = np.asarray(x, np.float64)
  want = np.where(x64 > 0, 1.0, 0.0)
  g = _grad_at(lambda v: jaxact.squareplus(v, b=0), x)
  np.testing.assert_array_equal(np.asarray(g, np.float64), want)
  # The fused layer uses the same derivative: z = x (identity weight), activation squareplus(b=0).
  act = functools.partial(jaxact.squareplus, b=0)
  w = jnp.eye(x.shape[0], dtype=dtype)
  dense = lambda v: jaxact.dense_bias_act(v[None], w, activation=act)[0].sum()
  g_fused = np.asarray(jax.grad(dense)(x), np.float64)
  chex.assert_tree_all_finite(g_fused)
  np.testing.assert_array_equal(g_fused, want)


def test_celu_with_negative_alpha_stays_finite_up_to_float32s_largest_value():
  """celu(x, alpha < 0) grows like alpha e^(x / alpha); XLA's float32 exp overflows a little before
  float32's largest number, and celu must not: at x = -62.105984, alpha = -0.7 the value is
  -2.38e38 (float64: -2.3819642e38)."""
  x = jnp.asarray([-62.105984, -61.0, -70.0], jnp.float32)
  got = np.asarray(jaxact.celu(x, alpha=-0.7), np.float64)
  want = -0.7 * np.expm1(np.asarray(x, np.float64) / -0.7)
  np.testing.assert_allclose(got[:2], want[:2], rtol=2e-5)
  assert got[2] == -np.inf  # the true value, -0.7 e^100, is beyond float32's range
  # The derivative e^(x / alpha) = 3.4028060e38 at the first point, just below the largest
  # float32: finite, though x / alpha rounded to float32 alone would put it above.
  g = np.asarray(jax.vmap(jax.grad(lambda v: jaxact.celu(v, alpha=-0.7)))(x), np.float64)
  np.testing.assert_allclose(g[:2], np.exp(np.asarray(x[:2], np.float64) / -0.7), rtol=2e-5)
  assert g[2] == np.inf


# ------------------------------------------------------------------------ regressions (issue 54)


def _glu_f64(a, b, w):
  """glu(a, b) = a sigmoid(b) and its gradients for the cotangent w, in long double where the
  platform has one (float64's range ends before a sigmoid(b) of the float64 cases does)."""
  a, b, w = (np.asarray(v, np.longdouble) for v in (a, b, w))
  s, s_neg = 1 / (1 + np.exp(-b)), 1 / (1 + np.exp(b))
  return [np.asarray(v, np.float64) for v in (a * s, w * s, w * a * s * s_neg)]


@pytest.mark.parametrize(
  "dtype, rows",
  [
    pytest.param(
      jnp.float32,
      [[3e38, -87.0], [3e38, -88.8], [-3.4e38, 88.8], [3e38, -100.0], [1e30, -70.0],
       [3.4e38, -1e30], [-3.4e38, 3.4e38], [2.0, -3.0]],
      id="float32",
    ),
    pytest.param(jnp.bfloat16, [[3.3e38, -87.0], [-3.3e38, 90.0], [3.3e38, -3.3e38]],
                 id="bfloat16"),
    pytest.param(jnp.float64, [[1.7e308, -708.0], [-1.7e308, 715.0], [1e300, -1e30]], id="float64"),
  ],
)  # fmt: skip
def test_glu_with_a_near_the_largest_float(dtype, rows):
  """glu(a, b) with |a| near the float's largest and sigmoid(b) near its smallest normal: the
  product is a number (a = 3e38, b = -87: about 5), but XLA:CPU flushed sigmoid(b) to zero (value
  0), and g * a overflowed before it met sigmoid(b) sigmoid(-b) (gradient NaN or inf)."""
  if dtype == jnp.float64 and np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps:
    pytest.skip("no long double on this platform for the float64 reference")
  x = as_dtype(rows, dtype)
  w = as_dtype(np.full((len(rows), 1), 1.5), dtype)
  y, g = jaxact.glu(x), loss_grad(jaxact.glu, x, w)
  chex.assert_tree_all_finite((y, g))
  x64 = np.asarray(x, np.float64)
  want_y, want_da, want_db = _glu_f64(x64[:, :1], x64[:, 1:], np.asarray(w, np.float64))
  bound = lambda want, ulps: ulps * eps(dtype) * np.maximum(1.0, np.abs(want)) + 1e-30
  assert_within(y, want_y, bound(want_y, cases.VALUE_ULPS[dtype]), "glu")
  assert_within(g[:, :1], want_da, bound(want_da, cases.GRAD_ULPS[dtype]), "d glu / d a")
  assert_within(g[:, 1:], want_db, bound(want_db, cases.GRAD_ULPS[dtype]), "d glu / d b")


# Parameters spanning each `unbounded` rule's two sides (defaults for the rest).
_UNBOUNDED_PARAMS = {
  "leaky_relu": [{"negative_slope": s} for s in (0.01, -0.5, 1.0, 1.5, -2.0)],
  "celu": [{"alpha": a} for a in (1.0, 0.5, -1.0, -3.0)],
  "elu": [{"alpha": a} for a in (1.0, 3.0, -2.0)],
  "squareplus": [{"b": b} for b in (4.0, 1e30)],
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_unbounded_is_what_the_formula_does_at_the_extremes(dtype):
  # The gated units and their kernels form act(a) * b from the derivative exactly where the table
  # says act can overflow: a wrong False returns inf or NaN for a finite product, so every spec is
  # checked against its own formula at the dtype's largest values.
  big = np.finfo(dtype).max
  for spec in ELEMENTWISE:
    defaults = {p.name: p.default for p in spec.params}
    for params in _UNBOUNDED_PARAMS.get(spec.name, [{}]):
      params = {**defaults, **params}
      y = np.asarray(spec.fn(jnp.array([-big, -1e3, 1e3, big], dtype), **params))
      declared = spec.unbounded is not None and spec.unbounded(**params)
      assert declared == bool(np.isinf(y).any()), (spec.name, params)
