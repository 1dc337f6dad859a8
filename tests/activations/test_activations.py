"""Values and first derivatives of every activation against float64 references and jax.nn.

Parametrized from the spec table: every spec, with its default parameters and the settings in
``cases.EXTRA_PARAMS``, in bfloat16, float16, float32 and float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import jaxact
from jaxact._src.activations import reference as references
from jaxact._src.core.spec import SPECS

import cases
from cases import (
  DTYPES,
  ELEMENTWISE,
  F64,
  assert_within,
  away_from_kinks,
  cotangent,
  dtype_id,
  eps,
  jax_nn,
  loss_grad,
  moderate,
  public,
  ref_grad,
  ref_value_and_sensitivity,
  reference,
  spec_param,
  spec_params,
)


def _params_by_dtype(specs):
  return [
    pytest.param(*p.values, dtype, id=f"{p.id}-{dtype_id(dtype)}")
    for p in spec_params(specs)
    for dtype in DTYPES
  ]


def test_tables_cover_every_spec():
  names = [s.name for s in SPECS]
  assert tuple(names) == jaxact.ACTIVATIONS
  assert set(references.REFERENCES) >= set(names), "add a float64 reference to tests/references.py"
  elementwise = {s.name for s in ELEMENTWISE}
  assert set(references.LIMITS) >= elementwise, "add the ±inf limits to tests/references.py"
  for s in SPECS:
    assert hasattr(jaxact, s.name)
    assert hasattr(jax.nn, s.name) == s.jax_nn, s.name


# ---------------------------------------------------------------------------------------- values


def _in_range(want: np.ndarray, dtype) -> np.ndarray:
  return np.abs(want) <= float(jnp.finfo(dtype).max)


def _assert_overflows_to_inf(got, want, dtype, what):
  """Exact results beyond the dtype's range must round to ±inf (celu with alpha < 0 grows like
  e^{-x/alpha}: finite inputs, results no float16 can hold)."""
  big = ~_in_range(want, dtype)
  np.testing.assert_array_equal(np.asarray(got, np.float64)[big], np.sign(want[big]) * np.inf, what)


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec, params, dtype", _params_by_dtype(SPECS))
def test_values_match_float64_reference_and_jax_nn(spec, params, dtype):
  x = moderate(spec, dtype)
  y = public(spec)(x, **params)
  assert y.dtype == dtype
  ref, sens = ref_value_and_sensitivity(spec, x.astype(F64), params)
  ref, sens = np.asarray(ref), np.asarray(sens)
  assert y.shape == ref.shape
  _assert_overflows_to_inf(y, ref, dtype, spec.name)
  ok = _in_range(ref, dtype)
  scale = np.abs(ref) + sens + cases.VALUE_ABS_SCALE.get(spec.name, 0.0)
  bound = cases.VALUE_ULPS[dtype] * eps(dtype) * scale + cases.VALUE_ATOL[dtype]
  assert_within(np.asarray(y)[ok], ref[ok], bound[ok], f"{spec.name}{params} vs reference")
  if not spec.jax_nn:
    return
  want = jax_nn(spec)(x, **params)
  assert want.dtype == dtype and want.shape == y.shape
  want = np.asarray(want, np.float64)
  # Compare where jax.nn did not overflow on the way (it computes celu(alpha < 0) in float16
  # itself, so its e^{x/alpha} overflows before alpha scales it back into range).
  ok &= np.isfinite(want)
  bound = cases.JAX_NN_ULPS * eps(dtype) * (1.0 + np.abs(ref) + sens)
  assert_within(np.asarray(y)[ok], want[ok], bound[ok], f"{spec.name}{params} vs jax.nn")


# ----------------------------------------------------------------------- the spec's derivatives


def _full_params(spec, params):
  return {p.name: p.default for p in spec.params} | params


@pytest.mark.sample(2)
@pytest.mark.parametrize("spec, params", spec_params(ELEMENTWISE))
def test_spec_derivatives_match_autodiff_of_reference(spec, params):
  """d_output(fn(x)) and derivative_from_input(x) equal jax.grad of the float64 reference."""
  x = moderate(spec, F64)
  keep = np.asarray(away_from_kinks(spec, x))
  x = x[keep]
  full = _full_params(spec, params)
  want = jax.vmap(jax.grad(lambda v: reference(spec)(v, **params)))(x)
  bound = cases.GRAD_ULPS[F64] * eps(F64) * np.maximum(1.0, np.abs(want))

  y = spec.fn(x, **full)
  assert_within(spec.derivative_from_input(x, **full), want, bound, f"{spec.name}.d_input")
  if spec.d_output is not None and (
    spec.output_ok is None or spec.output_ok(**{p.name: full[p.name] for p in spec.params})
  ):
    assert_within(spec.d_output(y, **full), want, bound, f"{spec.name}.d_output")


# ---------------------------------------------------------------------------- public gradients


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec, params, dtype", _params_by_dtype(SPECS))
def test_gradient_matches_float64_reference(spec, params, dtype):
  """jax.grad of the public function is within a few ulps of max(1, |f'(x)|) of the truth."""
  x = moderate(spec, dtype)
  fn = lambda v: public(spec)(v, **params)
  w = cotangent(spec, jax.eval_shape(fn, x).shape)
  g = loss_grad(fn, x, w)
  assert g.dtype == dtype
  want = np.asarray(ref_grad(spec, x.astype(F64), w, params))
  _assert_overflows_to_inf(g, want, dtype, spec.name)
  keep = np.asarray(away_from_kinks(spec, x)) & _in_range(want, dtype)
  bound = cases.GRAD_ULPS[dtype] * eps(dtype) * np.maximum(1.0, np.abs(want))
  assert_within(np.asarray(g)[keep], want[keep], bound[keep], f"{spec.name}{params}")


@pytest.mark.sample(4)
@pytest.mark.parametrize("spec", spec_param([s for s in SPECS if s.jax_nn]))
def test_gradient_matches_jax_nn(spec):
  """Ordinary inputs (no kinks, no saturation): the same gradient as jax.nn's autodiff."""
  dtype = jnp.float32  # the other dtypes are covered against the float64 reference above
  x = jnp.asarray(np.linspace(-2.9, 2.9, 24).reshape(6, 4) + 0.05, dtype)
  if spec.elementwise:
    x = x[away_from_kinks(spec, x)]
  fn = public(spec)
  w = cotangent(spec, jax.eval_shape(fn, x).shape)
  got = np.asarray(loss_grad(fn, x, w), np.float64)
  want = np.asarray(loss_grad(jax_nn(spec), x, w), np.float64)
  # jax.nn differentiates in the input dtype itself; allow both sides their gradient error.
  bound = 2 * cases.GRAD_ULPS[dtype] * eps(dtype) * np.maximum(1.0, np.abs(want))
  assert_within(got, want, bound, spec.name)


# ----------------------------------------------------------------------------------------- kinks


@pytest.mark.sample(4)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", spec_param([s for s in ELEMENTWISE if s.kinks or s.jax_nn_kinks]))
def test_kinks_follow_the_documented_convention(spec, dtype):
  points = sorted(set(spec.kinks) | set(spec.jax_nn_kinks))
  x = jnp.asarray(points, dtype)
  got = np.asarray(jax.vmap(jax.grad(public(spec)))(x), np.float64)
  for p, g in zip(points, got, strict=True):
    if p in spec.kinks:
      want = float(jnp.asarray(spec.kinks[p], dtype))
      assert g == want, f"jaxact.{spec.name}'({p}) = {g}, spec.kinks says {want}"
  if not spec.jax_nn:
    return
  nn = np.asarray(jax.vmap(jax.grad(jax_nn(spec)))(x), np.float64)
  for p, g, n in zip(points, got, nn, strict=True):
    if p in spec.jax_nn_kinks:
      # The documented difference: jax.nn's autodiff gives another value there.
      want = float(jnp.asarray(spec.jax_nn_kinks[p], dtype))
      assert n == want, f"jax.nn.{spec.name}'({p}) = {n}, spec.jax_nn_kinks says {want}"
    else:
      # Same side of the kink; jax.nn computes in the input dtype, so allow its rounding (selu's
      # scale * alpha is 1.7578 in bfloat16 rounded once, 1.75 computed in bfloat16).
      assert abs(g - n) <= 2 * eps(dtype) * max(1.0, abs(n)), (
        f"at {p}: jaxact gives {g}, jax.nn {n}, and jax_nn_kinks lists no difference"
      )


_TRANSCENDENTAL = {"exp", "exp2", "expm1", "logistic", "log", "log1p", "tanh", "erf", "erfc"}


def _transcendentals(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name in _TRANSCENDENTAL
    n += sum(_transcendentals(sub) for sub in jaxprs_in_params(eqn.params))
  return n


@pytest.mark.parametrize("name", ["silu", "gelu_quick", "gelu", "mish"])
def test_backward_takes_one_transcendental(name):
  """The activations LLMs use most: the backward pass recomputes f' from x with one exp (issue 54:
  silu's and gelu's took two, mish's five and a log1p), so that a training step costs two
  transcendentals an element where autodiff of jax.nn's formula shares one."""
  f = getattr(jaxact, name)
  x = jnp.ones((8,), jnp.float32)
  step = jax.make_jaxpr(jax.value_and_grad(lambda v: jnp.sum(f(v))))(x)
  assert _transcendentals(jax.make_jaxpr(f)(x).jaxpr) == 1
  assert _transcendentals(step.jaxpr) == 2, step
