"""Array-valued parameters (leaky_relu's slope, elu/celu's alpha, squareplus's b, and any other
non-static spec parameter): Python numbers, NumPy and jax arrays broadcast per channel, traced
values under jit, and gradients with respect to the parameter itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
from cases import ELEMENTWISE, F64, assert_within, eps, jax_nn, public, reference

# Interesting values per parameter beyond the default: non-positive slopes and negative alphas
# make the output ambiguous, so the rule must fall back to keeping the input.
VALUES = {
  ("leaky_relu", "negative_slope"): (0.2, -0.1, 0.0),
  ("elu", "alpha"): (0.5, -0.5, 0.0),
  ("celu", "alpha"): (2.0, -0.7),
  ("squareplus", "b"): (1.0, 0.0),
}

PARAMS = [
  pytest.param(s, p, id=f"{s.name}-{p.name}") for s in ELEMENTWISE for p in s.params if not p.static
]

_X = np.linspace(-3.05, 2.95, 15).reshape(5, 3)  # three channels, no kinks (0 is not on it)
_DT = jnp.float32


def _values(spec, param):
  return (param.default, *VALUES.get((spec.name, param.name), ()))


def _per_channel(spec, param):
  """One value per channel: the nonzero interesting values, then the default scaled."""
  vals = [v for v in VALUES.get((spec.name, param.name), ()) if v != 0]
  vals += [param.default * f for f in (0.5, 1.0, 1.5)]
  return np.array(vals[:3], np.float64)


def _value_cases():
  """(spec, param, value) for every scalar value and a per-channel array."""
  out = []
  for p in PARAMS:
    spec, param = p.values
    for v in _values(spec, param):
      out.append(pytest.param(spec, param, v, id=f"{p.id}={v}"))
    out.append(pytest.param(spec, param, _per_channel(spec, param), id=f"{p.id}=per-channel"))
  return out


def _check(got, x, spec, name, pval, what, dtype=_DT):
  want = reference(spec)(jnp.asarray(x, F64), **{name: jnp.asarray(pval, F64)})
  want = np.asarray(want)
  bound = 4 * cases.VALUE_ULPS[_DT] * eps(_DT) * (1.0 + np.abs(want))
  assert got.dtype == dtype, what
  assert_within(got, want, bound, what)


@pytest.mark.sample(2)
@pytest.mark.parametrize("spec, param", PARAMS)
def test_numbers_numpy_and_jax_arrays_agree(spec, param):
  x = jnp.asarray(_X, _DT)
  f = public(spec)
  for v in _values(spec, param):
    _check(f(x, **{param.name: v}), _X, spec, param.name, v, f"{param.name}={v}")
    for arr in (np.float32(v), np.asarray(v, np.float64), jnp.asarray(v, _DT)):
      # An array parameter promotes x as in jax.nn (float64 here, where x64 is on).
      dtype = jnp.result_type(x, arr)
      _check(f(x, **{param.name: arr}), _X, spec, param.name, v, f"{param.name}={arr!r}", dtype)
  pc = _per_channel(spec, param)
  for arr in (pc, pc.astype(np.float32), jnp.asarray(pc, _DT), jnp.asarray(pc[None, :], F64)):
    dtype = jnp.result_type(x, arr)
    _check(f(x, **{param.name: arr}), _X, spec, param.name, pc, f"per-channel {arr!r}", dtype)
  if spec.jax_nn:
    got, want = f(x, **{param.name: pc}), jax_nn(spec)(x, **{param.name: jnp.asarray(pc, _DT)})
    np.testing.assert_allclose(got, want, rtol=16 * eps(_DT), atol=16 * eps(_DT))


@pytest.mark.parametrize("spec, param", PARAMS)
def test_traced_parameter_under_jit(spec, param):
  x = jnp.asarray(_X, _DT)
  f = public(spec)
  jitted = jax.jit(lambda x, v: f(x, **{param.name: v}))
  for v in (*_values(spec, param), _per_channel(spec, param)):
    v32 = jnp.asarray(v, _DT)
    np.testing.assert_array_equal(jitted(x, v32), f(x, **{param.name: v32}))
    _check(jitted(x, v32), _X, spec, param.name, v, f"traced {param.name}={v}")


def _x_and_param_grads(fn, x, v, w):
  return jax.grad(lambda x, v: jnp.sum(fn(x, v) * w), argnums=(0, 1))(x, v)


@pytest.mark.sample(2)
@pytest.mark.parametrize("spec, param, v", _value_cases())
def test_gradient_wrt_parameter_and_input(spec, param, v):
  """grad w.r.t. a scalar or per-channel parameter (and, at the same time, w.r.t. x) matches the
  float64 reference's autodiff and jax.nn's; non-positive slopes and negative alphas included."""
  w = (np.arange(15).reshape(5, 3) % 7 - 3) / 4.0
  call = lambda f: lambda x, v: f(x, **{param.name: v})
  x, v32 = jnp.asarray(_X, _DT), jnp.asarray(v, _DT)
  gx, gv = _x_and_param_grads(call(public(spec)), x, v32, jnp.asarray(w, _DT))
  assert gx.dtype == gv.dtype == _DT and gv.shape == v32.shape
  ref = call(reference(spec))
  x64, v64 = jnp.asarray(_X, F64), jnp.asarray(v, F64)
  wx, wv = _x_and_param_grads(ref, x64, v64, w)
  # The parameter's gradient is a sum over the batch: bound it by the sum of its terms' sizes.
  terms = jax.jacfwd(lambda v: ref(x64, v) * w)(v64)
  scale_v = np.abs(np.asarray(terms)).reshape(15, -1).sum(0).reshape(np.shape(v))
  assert_within(gx, wx, cases.GRAD_ULPS[_DT] * eps(_DT) * np.maximum(1, np.abs(wx)), "d/dx")
  assert_within(gv, wv, 8 * cases.GRAD_ULPS[_DT] * eps(_DT) * (1 + scale_v), f"d/d{param.name}")
  if spec.jax_nn:
    nx, nv = _x_and_param_grads(call(jax_nn(spec)), x, v32, jnp.asarray(w, _DT))
    assert_within(gx, nx, 2 * cases.GRAD_ULPS[_DT] * eps(_DT) * np.maximum(1, np.abs(wx)), "jax.nn")
    assert_within(gv, nv, 16 * cases.GRAD_ULPS[_DT] * eps(_DT) * (1 + scale_v), "jax.nn d/dparam")
