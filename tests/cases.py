"""Test parametrization derived from the spec table, and the dtype tolerance tables.

Everything here is read from ``jaxact._src.core.spec.SPECS``: a new spec row is picked up by every
test that iterates over ``SPECS`` / ``ELEMENTWISE`` (and the coverage test in
tests/activations/test_activations.py fails until jaxact/_src/activations/reference.py has a
reference and limits for it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.activations import reference as references
from jaxact._src.core.spec import SPECS, ActivationSpec

F64 = jnp.float64
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def dtype_id(dtype) -> str:
  return np.dtype(dtype).name


def eps(dtype) -> float:
  """Spacing of the dtype at 1 (bf16 2^-7, f16 2^-10, f32 2^-23, f64 2^-52)."""
  return float(jnp.finfo(dtype).eps)


# ----------------------------------------------------------------------------------- tolerances
#
# Values: |y - ref| <= VALUE_ULPS * eps * (|ref| + |J| |x|) + VALUE_ATOL. The |J| |x| term is how
# much the exact result moves when every input moves by one relative unit: rounding anywhere in an
# evaluation costs about that much, so the bound is a few ulps of the problem's own conditioning.
# Half precision is computed in float32 and rounded once, so half an ulp (plus float32's
# error, far below it) is all it may lose; VALUE_ULPS = 1 leaves a factor of two.
# VALUE_ATOL is the underflow floor. XLA on CPU flushes float32/float64 subnormals to zero, and a
# factor such as exp(-87) or erfc(9) underflows while x times it is still a normal number, so
# results below 2^10 finfo.tiny (1.2e-35 in float32; bfloat16 is computed in float32) may lose
# their digits. float16, computed in float32, keeps its subnormals (spacing 2^-24).
VALUE_ULPS = {jnp.bfloat16: 1.0, jnp.float16: 1.0, jnp.float32: 4.0, jnp.float64: 8.0}
_F32_FLOOR = 2.0**10 * float(jnp.finfo(jnp.float32).tiny)
VALUE_ATOL = {
  jnp.bfloat16: _F32_FLOOR,
  jnp.float16: 2.0**-24,
  jnp.float32: _F32_FLOOR,
  jnp.float64: 2.0**10 * float(jnp.finfo(jnp.float64).tiny),
}
# log_softmax subtracts log(sum(exp(x - max))), a number in [0, log n] whose rounding is an absolute
# error of about one ulp of 1 however small the result (a dominant entry's log-probability is
# -log(1 + tiny)); jax.nn computes it the same way. Other specs have no such term.
VALUE_ABS_SCALE = {"log_softmax": 1.0}

# jaxact vs jax.nn: jax.nn computes half precision in half precision and has its own cancellations
# (squareplus for x < 0, the tanh form of gelu for x << 0), so this is a looser, absolute-floored
# bound: JAX_NN_ULPS * eps * (1 + |ref| + |J| |x|).
JAX_NN_ULPS = 16.0

# Gradients: |g - g_ref| <= GRAD_ULPS * eps * max(1, |g_ref|) (issue 2: "within a few ulps of
# max(1, |f'(x)|) in the input dtype"). Output-residual gradients in half precision start from y
# rounded to the input dtype (half an ulp), which d_output can amplify by its slope (at most 2, for
# tanh and soft_sign), and the result is rounded once more.
# float32/float64 get a few more: XLA's tanh is itself off by up to 2 eps near saturation (2.4e-7
# at |x| = 8 in float32, 7.8e-16 at |x| = 19 in float64), and tanh' = 1 - y^2 doubles that.
GRAD_ULPS = {jnp.bfloat16: 4.0, jnp.float16: 4.0, jnp.float32: 8.0, jnp.float64: 16.0}


def assert_trees_close(got, want, tol: float) -> None:
  """Leaf by leaf: `got` finite and within `tol` of `want`, relative and absolute (the absolute
  part scaled by ``max(1, max |want|)``), in float64."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max())))


def assert_within(got, want, bound, what=""):
  """Elementwise |got - want| <= bound (NaN anywhere fails), with the worst offender reported."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  bound = np.broadcast_to(np.asarray(bound, np.float64), want.shape)
  err = np.abs(got - want)
  bad = ~(err <= bound)
  if bad.any():
    i = np.unravel_index(
      np.argmax(np.where(bad, np.nan_to_num(err / bound, nan=np.inf), -1)), bad.shape
    )
    raise AssertionError(
      f"{what}: {bad.sum()} of {bad.size} entries out of tolerance; worst at index {i}: "
      f"got {got[i]!r}, want {want[i]!r}, |err| {err[i]:.3g} > bound {bound[i]:.3g}"
    )


# ------------------------------------------------------------------------------- the spec table

ELEMENTWISE = tuple(s for s in SPECS if s.elementwise)
NON_ELEMENTWISE = tuple(s for s in SPECS if not s.elementwise)
OUTPUT_RESIDUAL = tuple(s for s in SPECS if s.residual == "output")

# Non-default parameter settings, exercised next to the defaults by the value and gradient tests.
# (A new spec runs with its defaults; add settings here to cover more.)
EXTRA_PARAMS: dict[str, tuple[dict, ...]] = {
  "leaky_relu": ({"negative_slope": 0.2}, {"negative_slope": -0.1}, {"negative_slope": 0.0}),
  "elu": ({"alpha": 0.5}, {"alpha": -0.5}),
  "celu": ({"alpha": 2.0}, {"alpha": -0.7}),
  "squareplus": ({"b": 1.0}, {"b": 0}),
  "gelu": ({"approximate": False},),
  "glu": ({"axis": 0},),
  "softmax": ({"axis": 0},),
  "log_softmax": ({"axis": (0, 1)},),
}


def _case_id(spec: ActivationSpec, params: dict) -> str:
  return spec.name + "".join(f"-{k}={v}" for k, v in params.items())


def spec_params(specs=SPECS):
  """pytest params (spec, params) for each spec with defaults and with EXTRA_PARAMS."""
  return [
    pytest.param(s, p, id=_case_id(s, p))
    for s in specs
    for p in ({}, *EXTRA_PARAMS.get(s.name, ()))
  ]


def spec_param(specs=SPECS):
  return [pytest.param(s, id=s.name) for s in specs]


def public(spec: ActivationSpec):
  return getattr(jaxact, spec.name)


def reference(spec: ActivationSpec):
  return references.REFERENCES[spec.name]


def jax_nn(spec: ActivationSpec):
  return getattr(jax.nn, spec.name)


def kink_points(spec: ActivationSpec) -> tuple[float, ...]:
  return tuple(spec.kinks) + tuple(spec.jax_nn_kinks)


# ------------------------------------------------------------------------------------ inputs

# Moderate inputs: a 0.25-spaced sweep offset by 0.1 (so no point sits on or next to a kink at an
# integer), a point near 0, and a few larger magnitudes where sigmoid-like factors saturate.
_SWEEP = np.linspace(-6.0, 6.25, 50) + 0.1
_EXTRA = np.array([1e-3, 7.9, 9.7, 17.3])
MODERATE = np.concatenate([_SWEEP, _EXTRA, -_EXTRA])


def _rows(v: np.ndarray, width: int = 4) -> np.ndarray:
  """(n, width) array whose columns are rotations of v, so rows mix small and large entries."""
  return np.stack([np.roll(v, 7 * k) for k in range(width)], axis=-1)


def shaped(spec: ActivationSpec, v: np.ndarray) -> np.ndarray:
  """A 1-D float64 grid in the shape the activation needs (rows of 4 for glu and softmaxes)."""
  return v if spec.elementwise else _rows(v)


def as_dtype(v, dtype) -> jax.Array:
  """The float64 values `v` cast to `dtype` (overflow goes to ±inf, as a cast does)."""
  with np.errstate(over="ignore"):
    return jnp.asarray(np.asarray(v, np.float64).astype(dtype))


def moderate(spec: ActivationSpec, dtype) -> jax.Array:
  return as_dtype(shaped(spec, MODERATE), dtype)


def away_from_kinks(spec: ActivationSpec, x: jax.Array, dist: float = 0.05) -> jax.Array:
  """Boolean mask of the entries of x farther than `dist` from every kink of the spec."""
  x64 = np.asarray(x, np.float64)
  ok = np.ones(x64.shape, bool)
  for k in kink_points(spec):
    ok &= np.abs(x64 - k) > dist
  return jnp.asarray(ok)


def cotangent(spec: ActivationSpec, shape) -> np.ndarray:
  """Cotangent (in the output's `shape`) for gradient tests: all ones for elementwise activations
  (grad of sum is f'(x)); for the others a fixed pattern of bf16-exact weights in [-1, 1] (the
  gradient of sum(softmax) is identically 0 and would test nothing)."""
  n = math.prod(shape)
  if spec.elementwise:
    return np.ones(shape)
  return ((np.arange(n) * 5 % 17 - 8) / 8.0).reshape(shape)


# ---------------------------------------------------------------------------- reference helpers


@functools.cache
def _jitted_reference(name: str, params: tuple) -> tuple:
  """Jitted reference value/sensitivity and gradient for one (spec, params): compiled once and
  reused by every dtype (the inputs are always float64 of one shape)."""
  fn = lambda v: references.REFERENCES[name](v, **dict(params))

  @jax.jit
  def value_and_sensitivity(x64):
    y = fn(x64)
    jac = jax.jacfwd(fn)(x64).reshape(y.size, x64.size)
    return y, (jnp.abs(jac) @ jnp.abs(x64.reshape(-1))).reshape(y.shape)

  @jax.jit
  def grad(x64, w):
    return jax.grad(lambda v: jnp.sum(fn(v) * w))(x64)

  return value_and_sensitivity, grad


def _key(params: dict) -> tuple:
  return tuple(sorted(params.items()))


def ref_value_and_sensitivity(spec: ActivationSpec, x64: jax.Array, params: dict):
  """Reference value and |J| |x| (the change of each output for a relative change of each input)."""
  return _jitted_reference(spec.name, _key(params))[0](x64)


def ref_grad(spec: ActivationSpec, x64: jax.Array, w, params: dict) -> jax.Array:
  return _jitted_reference(spec.name, _key(params))[1](x64, jnp.asarray(w, F64))


def loss_grad(fn, x: jax.Array, w) -> jax.Array:
  """grad of sum(fn(x) * w), with w in x's dtype (jitted: one compile instead of many eager ops)."""
  return jax.jit(jax.grad(lambda v, w: jnp.sum(fn(v) * w)))(x, jnp.asarray(w, x.dtype))


def representatives(cases, default, ids=None):
  """``pytest.param`` for each of `cases` (argument tuples or single values): those whose id is in
  `default` run in the default suite, the others only under ``pytest -m exhaustive``.

  Interpret-mode kernel tests cost seconds each: the default suite keeps one representative of each
  family (residual, dtype, layout), the exhaustive run every combination.
  """
  ids = ids or [c if isinstance(c, str) else "-".join(map(str, c)) for c in cases]
  missing = set(default) - set(ids)
  assert not missing, f"no such case: {missing}"
  return [
    pytest.param(*(c if isinstance(c, tuple) else (c,)), id=i, marks=[] if i in default else EXH)
    for c, i in zip(cases, ids, strict=True)
  ]


EXH = [pytest.mark.exhaustive]


# ------------------------------------------------------------------------------- every backend


def backends(family) -> list:
  """One ``pytest.param`` per implementation a family declares (its ``rules.FAMILY``, a
  :class:`jaxact._src.core.dispatch.Family`), None (the automatic choice) first: a backend added
  to the family joins its behaviour suite without a line here."""
  return [pytest.param(None, id="none")] + [pytest.param(i, id=i) for i in family.implementations]


def value_and_grads_or_skip(f, *args, cotangent_seed: int = 1):
  """``f(*args)`` and the gradients of ``sum(f * c)`` for every argument (c drawn from a fixed
  seed), float64 copies; skips with the backend's own reason where it cannot run the call
  (``NotImplementedError``: no kernel of that name, or one that declines these shapes or this
  machine)."""
  try:
    y = f(*args)
  except NotImplementedError as e:
    pytest.skip(f"the backend declines: {e}")
  c = jax.random.normal(jax.random.key(cotangent_seed), y.shape, jnp.float32).astype(y.dtype)
  grads = jax.grad(lambda *a: jnp.sum((f(*a) * c).astype(jnp.float32)), range(len(args)))(*args)
  as64 = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float64), t)
  return as64(y), as64(grads)
