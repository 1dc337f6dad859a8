"""jaxact as a drop-in for jax.nn, corner by corner (issue 19): empty arrays, integer inputs with
jaxact installed into jax.nn, parameter types and dtype promotion, NaN propagation, -0.0."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.core.spec import SPECS

from cases import ELEMENTWISE, EXTRA_PARAMS, dtype_id, jax_nn, public, spec_params

JAX_NN_SPECS = tuple(s for s in SPECS if s.jax_nn)


@contextlib.contextmanager
def installed_into_jax_nn():
  """jaxact's functions as jax.nn's, as a program swapping third-party activations does."""
  saved = {s.name: getattr(jax.nn, s.name) for s in JAX_NN_SPECS}
  try:
    for s in JAX_NN_SPECS:
      setattr(jax.nn, s.name, public(s))
    yield
  finally:
    for name, fn in saved.items():
      setattr(jax.nn, name, fn)


# ------------------------------------------------------------------------------------ empty arrays


@pytest.mark.parametrize(
  "shape, axis", [((3, 0), -1), ((0, 3), -1), ((0,), -1), ((2, 0, 3), (1, 2))]
)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_of_empty_array_is_empty(name, shape, axis):
  x = jnp.zeros(shape, jnp.float32)
  y = getattr(jaxact, name)(x, axis=axis)
  want = getattr(jax.nn, name)(x, axis=axis)
  assert y.shape == want.shape == shape and y.dtype == want.dtype
  g = jax.grad(lambda x: getattr(jaxact, name)(x, axis=axis).sum())(x)
  assert g.shape == shape


# ------------------------------------------------------------- installed into jax.nn, integer input


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in JAX_NN_SPECS])
def test_integer_input_with_jaxact_installed_into_jax_nn(spec):
  """Integer inputs go to jax.nn's own function, bound at import: installed, they must not call
  jaxact again (which recursed forever)."""
  x = jnp.asarray([[-3, -1, 0, 1], [2, 3, 6, 7]], jnp.int32)
  with contextlib.suppress(Exception):  # some jax.nn functions refuse integers; so must we
    want = jax_nn(spec)(x)
  with installed_into_jax_nn():
    try:
      got = jax.nn.__dict__[spec.name](x)
    except RecursionError:
      pytest.fail(f"jax.nn.{spec.name} = jaxact.{spec.name} recurses on an integer input")
    except Exception:
      return  # jax.nn refuses this input too (test_errors checks that they agree)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)


def test_flax_model_calling_jax_nn_runs_with_jaxact_installed():
  """Third-party model code calling jax.nn.* (integer inputs included) gives jax.nn's outputs
  with jaxact's functions installed into jax.nn, and the same gradients."""
  nn = pytest.importorskip("flax.linen")

  class ThirdParty(nn.Module):
    @nn.compact
    def __call__(self, tokens, x):
      mask = jax.nn.relu(tokens - 2) + jax.nn.relu6(tokens)  # integer inputs
      h = jax.nn.gelu(nn.Dense(16)(x)) + jax.nn.sigmoid(mask[..., :1].astype(jnp.float32))
      h = jax.nn.silu(nn.Dense(16)(h)) * jax.nn.softplus(jnp.float32(1))
      h = jax.nn.glu(nn.Dense(16)(jax.nn.leaky_relu(h, 0.1)))
      return jax.nn.log_softmax(nn.Dense(4)(jax.nn.elu(h)), where=mask[..., :4] >= 0)

  model = ThirdParty()
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(6, 4) % 5
  x = jax.random.normal(jax.random.key(0), (6, 8), jnp.float32)
  params = model.init(jax.random.key(1), tokens, x)
  loss = lambda p: jnp.sum(jnp.where(jnp.isfinite(out := model.apply(p, tokens, x)), out, 0) ** 2)
  want, want_g = model.apply(params, tokens, x), jax.grad(loss)(params)
  with installed_into_jax_nn():
    assert jax.nn.gelu is jaxact.gelu
    got, got_g = model.apply(params, tokens, x), jax.jit(jax.grad(loss))(params)
  assert jax.nn.gelu is not jaxact.gelu  # restored
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got_g, want_g)


# ----------------------------------------------------------------------------- parameter types


@pytest.mark.parametrize(
  "approximate", [np.bool_(False), np.bool_(True), 0, 1, np.int32(0), jnp.asarray(True)], ids=repr
)
def test_gelu_approximate_accepts_what_jax_nn_accepts(approximate):
  x = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.float32)
  want = jax.nn.gelu(x, approximate=approximate)
  np.testing.assert_allclose(jaxact.gelu(x, approximate=approximate), want, rtol=1e-6, atol=1e-7)


def test_traced_gelu_approximate_names_the_argument():
  with pytest.raises(TypeError, match=r"jaxact\.gelu: `approximate`.*concrete") as e:
    jax.jit(lambda x, a: jaxact.gelu(x, approximate=a))(jnp.ones(3, jnp.float32), True)
  assert "_Rule" not in str(e.value) and "hash" not in str(e.value)
  assert isinstance(e.value, jax.errors.ConcretizationTypeError)  # what jax.nn raises derives it


_PROMOTING = [
  ("elu", "alpha", jnp.float32),
  ("elu", "alpha", jnp.float64),
  ("elu", "alpha", jnp.int32),
  ("leaky_relu", "negative_slope", jnp.float32),
  ("celu", "alpha", jnp.float32),
  ("squareplus", "b", jnp.float32),
]


@pytest.mark.sample(2)
@pytest.mark.parametrize("name, param, pdtype", _PROMOTING, ids=str)
def test_array_parameter_promotes_as_in_jax_nn(name, param, pdtype):
  """bfloat16 x with a float32 array parameter gives float32, as jax.nn's formulas do."""
  x = jnp.linspace(-2.0, 2.0, 8, dtype=jnp.bfloat16)
  for v in (jnp.full((8,), 2, pdtype), np.asarray(2, pdtype)):
    got = getattr(jaxact, name)(x, **{param: v})
    want = getattr(jax.nn, name)(x, **{param: v})
    assert got.dtype == want.dtype, (type(v), got.dtype, want.dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), 2e-2)
    g = jax.grad(lambda x, v=v: getattr(jaxact, name)(x, **{param: v}).sum())(x)
    assert g.dtype == x.dtype


# ----------------------------------------------------------------------------- NaN and -0.0


@pytest.mark.sample(3)
@pytest.mark.parametrize("spec, params", spec_params(ELEMENTWISE))
def test_nan_gradient_wherever_jax_nn_gives_nan(spec, params):
  """A NaN input gives a NaN value, and a NaN gradient wherever jax.nn's is NaN (the activations
  whose gradient at NaN is finite in both are listed in docs/numerics.md)."""
  x = jnp.asarray([math.nan, -math.nan, 1.0], jnp.float32)
  f = lambda v: public(spec)(v, **params)
  y, g = f(x), jax.vmap(jax.grad(f))(x)
  assert np.isnan(np.asarray(y[:2], np.float32)).all()
  if not spec.jax_nn:
    assert np.isnan(np.asarray(g[:2], np.float32)).all()
    return
  ref = lambda v: jax_nn(spec)(v, **params)
  g_ref = np.asarray(jax.vmap(jax.grad(ref))(x), np.float32)
  g = np.asarray(g, np.float32)
  assert (np.isnan(g) >= np.isnan(g_ref)).all(), f"grad at NaN: jaxact {g}, jax.nn {g_ref}"
  finite_in_both = ~np.isnan(g[0]) and ~np.isnan(g_ref[0])
  assert finite_in_both == (spec.name in NAN_FINITE_GRADIENT), spec.name


# The activations whose gradient at NaN is a number in jaxact and in jax.nn (docs/numerics.md).
NAN_FINITE_GRADIENT = (
  "identity",
  "relu",
  "relu6",
  "leaky_relu",
  "sparse_sigmoid",
  "hard_tanh",
  "hard_sigmoid",
)


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64], ids=dtype_id
)
@pytest.mark.parametrize("params", [{}, *EXTRA_PARAMS["leaky_relu"][:1]], ids=str)
def test_leaky_relu_gradient_at_minus_zero_is_one(params, dtype):
  """jax.nn (and the docs' kink table): f'(0) = 1, for -0.0 too; a tiny negative x whose output
  underflows to -0.0 still gets the slope."""
  slope = params.get("negative_slope", 0.01)
  tiny = float(jnp.finfo(dtype).tiny)
  x = jnp.asarray([-0.0, 0.0, -tiny, -4 * tiny], dtype)
  g = jax.vmap(jax.grad(lambda v: jaxact.leaky_relu(v, **params)))(x)
  want = jax.vmap(jax.grad(lambda v: jax.nn.leaky_relu(v, **params)))(x)
  np.testing.assert_array_equal(np.asarray(g, np.float64)[:2], 1.0)
  np.testing.assert_allclose(np.asarray(g, np.float64)[2:], slope, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(want, np.float64), rtol=1e-2)
