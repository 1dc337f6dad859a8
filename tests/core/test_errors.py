"""Bad input: TypeError / ValueError at trace time, naming the function, argument and value."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.core.spec import SPECS

from cases import ELEMENTWISE, dtype_id, jax_nn, public

ALL = [pytest.param(s, id=s.name) for s in SPECS]


@pytest.mark.parametrize(
  "bad, type_name",
  [
    ([1.0, 2.0], "list"),
    ((1.0, 2.0), "tuple"),
    ("abc", "str"),
    ({"a": 1.0}, "dict"),
    (None, "NoneType"),
  ],
  ids=["list", "tuple", "str", "dict", "None"],
)
@pytest.mark.parametrize("spec", ALL)
def test_non_array_input_is_a_type_error_naming_function_and_type(spec, bad, type_name):
  with pytest.raises(TypeError, match=rf"jaxact\.{spec.name}\b.*\b{type_name}\b"):
    public(spec)(bad)


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.complex128], ids=dtype_id)
@pytest.mark.parametrize("spec", ALL)
def test_complex_input_is_a_type_error(spec, dtype):
  with pytest.raises(TypeError, match=rf"jaxact\.{spec.name}\b.*complex"):
    public(spec)(jnp.asarray([[1.0 + 2.0j, -0.5j]], dtype))


_INT_INPUTS = {
  "int32": np.array([[-3, -1, 0, 1], [2, 3, 6, 7]], np.int32),
  "int8": np.array([[-3, -1, 0, 1], [2, 3, 6, 7]], np.int8),
  "uint8": np.array([[0, 1, 2, 3], [5, 6, 7, 200]], np.uint8),
  "bool": np.array([[True, False, True, False], [False, False, True, True]]),
}


def _outcome(f, x):
  try:
    y = f(x)
  except Exception as e:
    return type(e)
  return y


# jax.nn.log_softmax casts its -inf shift to the integer dtype, with NumPy's warning.
@pytest.mark.sample(30)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("name", list(_INT_INPUTS))
@pytest.mark.parametrize("spec", ALL)
def test_integer_input_behaves_as_jax_nn(spec, name):
  x = jnp.asarray(_INT_INPUTS[name])
  got = _outcome(public(spec), x)
  if not spec.jax_nn:  # gelu_quick: integers are promoted to the default float, as jax.nn would
    want = public(spec)(x.astype(jnp.result_type(float)))
  else:
    want = _outcome(jax_nn(spec), x)
  if isinstance(want, type):
    assert got is want, f"jax.nn.{spec.name} raises {want.__name__}; jaxact gives {got!r}"
    return
  assert not isinstance(got, type), f"jaxact.{spec.name} raised {got.__name__}; jax.nn did not"
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------- names


def test_unknown_name_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"'relux'.*\brelu\b.*") as info:
    jaxact.get_activation("relux")
  for name in jaxact.ACTIVATIONS:
    assert re.search(rf"\b{name}\b", str(info.value)), f"{name} is not listed"
  with pytest.raises(ValueError, match=r"'relux'.*\bsoftmax\b"):
    jaxact.get_spec("relux")
  with pytest.raises(TypeError, match="str"):
    jaxact.get_activation(3)


# ------------------------------------------------------------------------------ glu, axes


def test_glu_with_an_odd_axis_is_a_value_error():
  x = jnp.ones((2, 5), jnp.float32)
  with pytest.raises(ValueError, match=r"jaxact\.glu.*\b5\b.*even"):
    jaxact.glu(x)
  with pytest.raises(ValueError, match=r"jaxact\.glu.*\b(3|axis)\b"):
    jaxact.glu(jnp.ones((3, 4), jnp.float32), axis=0)
  assert jaxact.glu(x, axis=0).shape == (1, 5)  # axis 0 has size 2: fine


@pytest.mark.parametrize(
  "name, axis",
  [
    pytest.param(name, axis, id=f"{name}-{axis}")
    for name in ("softmax", "log_softmax", "glu")
    for axis in (2, -3, (0, 2), (0, 0), (1, -1))
    if name != "glu" or isinstance(axis, int)  # glu takes a single int axis
  ],
)
def test_bad_axis_is_a_value_error(name, axis):
  with pytest.raises(ValueError, match=rf"jaxact\.{name}.*axis"):
    getattr(jaxact, name)(jnp.ones((2, 4), jnp.float32), axis=axis)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "glu"])
@pytest.mark.parametrize("axis", ["0", 1.0, [0, "a"]], ids=str)
def test_non_integer_axis_is_a_type_error(name, axis):
  with pytest.raises(TypeError, match=rf"jaxact\.{name}.*axis"):
    getattr(jaxact, name)(jnp.ones((2, 4), jnp.float32), axis=axis)


# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
  "name, kwargs, param",
  [
    ("celu", {"alpha": 0}, "alpha"),
    ("celu", {"alpha": 0.0}, "alpha"),
    ("celu", {"alpha": np.array([1.0, 0.0, 2.0, 1.0])}, "alpha"),
    ("squareplus", {"b": -1}, "b"),
    ("squareplus", {"b": -1e-3}, "b"),
    ("squareplus", {"b": jnp.asarray([4.0, -1.0, 4.0, 4.0], jnp.float32)}, "b"),
  ],
  ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]!r}" for k in v),
)
def test_bad_parameter_value_is_a_value_error_naming_it(name, kwargs, param):
  with pytest.raises(ValueError, match=rf"jaxact\.{name}.*`{param}`"):
    getattr(jaxact, name)(jnp.ones((2, 4), jnp.float32), **kwargs)


def test_gelu_approximate_must_be_a_bool():
  with pytest.raises((TypeError, ValueError), match=r"jaxact\.gelu.*approximate"):
    jaxact.gelu(jnp.ones(3, jnp.float32), approximate="yes")


_ARRAY_PARAMS = [
  pytest.param(s, p.name, id=f"{s.name}-{p.name}")
  for s in ELEMENTWISE
  for p in s.params
  if not p.static
]


@pytest.mark.parametrize("spec, name", _ARRAY_PARAMS)
def test_parameter_that_does_not_broadcast_is_a_value_error(spec, name):
  with pytest.raises(ValueError, match=rf"jaxact\.{spec.name}.*`{name}`.*\(3,\)"):
    public(spec)(jnp.ones((2, 4), jnp.float32), **{name: np.ones(3)})


@pytest.mark.parametrize(
  "spec, name",
  [pytest.param(*p.values, id=p.id) for p in _ARRAY_PARAMS],
)
def test_string_parameter_is_a_type_error(spec, name):
  with pytest.raises(TypeError, match=rf"jaxact\.{spec.name}.*`{name}`.*str"):
    public(spec)(jnp.ones((2, 4), jnp.float32), **{name: "0.5"})


@pytest.mark.parametrize("spec, name", _ARRAY_PARAMS)
def test_complex_parameter_is_a_type_error(spec, name):
  with pytest.raises(TypeError, match=rf"jaxact\.{spec.name}.*`{name}`.*complex"):
    public(spec)(jnp.ones((2, 4), jnp.float32), **{name: np.asarray(0.5 + 1j)})


@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in ELEMENTWISE])
def test_wrong_arguments_name_the_function(spec):
  x = jnp.ones(3, jnp.float32)
  extra = (0.5,) * (len(spec.params) + 1)
  with pytest.raises(TypeError, match=rf"jaxact\.{spec.name}"):
    public(spec)(x, *extra)
  with pytest.raises(TypeError, match=rf"jaxact\.{spec.name}"):
    public(spec)(x, not_a_parameter=1.0)


# ---------------------------------------------------------------------------------- where


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize(
  "where",
  [np.array([1, 0, 1, 1]), np.array([1.0, 0.0, 1.0, 1.0]), jnp.asarray([1, 0, 1, 1], jnp.int32)],
  ids=["numpy-int", "numpy-float", "jax-int"],
)
def test_non_bool_where_is_a_type_error(name, where):
  with pytest.raises(TypeError, match=rf"jaxact\.{name}.*`where`.*bool"):
    getattr(jaxact, name)(jnp.ones((2, 4), jnp.float32), where=where)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_where_that_does_not_broadcast_is_a_value_error(name):
  with pytest.raises(ValueError, match=rf"jaxact\.{name}.*`where`"):
    getattr(jaxact, name)(jnp.ones((2, 4), jnp.float32), where=np.ones(3, bool))


def test_errors_are_raised_at_trace_time():
  """Under jit the same errors come out of tracing, not out of the compiled program."""
  with pytest.raises(TypeError, match=r"jaxact\.softmax.*`where`"):
    jax.jit(lambda x: jaxact.softmax(x, where=jnp.ones(4, jnp.int32)))(jnp.ones(4, jnp.float32))
  with pytest.raises(ValueError, match=r"jaxact\.glu"):
    jax.jit(jaxact.glu)(jnp.ones(5, jnp.float32))
