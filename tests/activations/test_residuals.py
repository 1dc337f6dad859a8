"""What jax.vjp's pullback keeps: one activation-sized array, the output or the input per the spec.

``jax.tree.leaves(pull)`` are the residuals the backward pass holds on to. jax.nn keeps two to six
activation-sized arrays for most of these; jaxact keeps one (identity: none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxact._src.core.spec import SPECS

from cases import ELEMENTWISE, dtype_id, public

_SHAPE = (64, 128)
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _x(dtype) -> jax.Array:
  return jax.random.normal(jax.random.key(0), _SHAPE, jnp.float32).astype(dtype)


def _kept(y: jax.Array, pull) -> list[jax.Array]:
  """The pullback's activation-sized leaves (glu's output is half its input; both count)."""
  return [leaf for leaf in jax.tree.leaves(pull) if leaf.size >= y.size]


def _assert_keeps(kept, residual, x, y, what):
  if residual == "none":
    assert kept == [], f"{what}: keeps {[k.shape for k in kept]}, expected nothing"
    return
  assert len(kept) == 1, f"{what}: keeps {len(kept)} activation-sized arrays, expected 1"
  (k,) = kept
  assert k.dtype == x.dtype, f"{what}: keeps {k.dtype}, input is {x.dtype}"
  if residual == "output":
    np.testing.assert_array_equal(k, y, f"{what}: the kept array is not the output")
    assert not np.array_equal(k, x), f"{what}: the kept array is the input"
  else:
    np.testing.assert_array_equal(k, x, f"{what}: the kept array is not the input")


@pytest.mark.sample(3)
@pytest.mark.parametrize("dtype", _DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in SPECS])
def test_pullback_keeps_what_the_spec_says(spec, dtype):
  x = _x(dtype)
  y, pull = jax.vjp(public(spec), x)
  assert y.dtype == dtype
  _assert_keeps(_kept(y, pull), spec.residual, x, y, spec.name)
  # The pullback still works from what it kept.
  (dx,) = pull(jnp.ones_like(y))
  assert dx.dtype == dtype and dx.shape == x.shape


_DYNAMIC = [
  pytest.param(s, p, id=f"{s.name}-{p.name}")
  for s in ELEMENTWISE
  if s.residual == "output"
  for p in s.params
  if not p.static
]


@pytest.mark.parametrize("spec, param", _DYNAMIC)
def test_traced_parameter_keeps_the_input(spec, param):
  """A traced parameter (under jit, or differentiated) leaves d_output unusable: x is kept."""
  x = _x(jnp.float32)
  f = public(spec)
  v = jnp.asarray(param.default, jnp.float32)

  y, pull = jax.jit(lambda x, v: jax.vjp(lambda x: f(x, **{param.name: v}), x))(x, v)
  _assert_keeps(_kept(y, pull), "input", x, y, f"{spec.name} under jit")

  y, pull = jax.vjp(lambda x, v: f(x, **{param.name: v}), x, v)
  _assert_keeps(_kept(y, pull), "input", x, y, f"{spec.name} w.r.t. {param.name}")

  # A concrete array parameter is not traced: the output is enough again.
  y, pull = jax.vjp(lambda x: f(x, **{param.name: np.full((128,), param.default, np.float32)}), x)
  _assert_keeps(_kept(y, pull), "output", x, y, f"{spec.name} with a NumPy {param.name}")


_CANDIDATES = (-0.1, -0.5, 0.0)


@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in ELEMENTWISE if s.output_ok])
def test_parameters_that_make_the_output_ambiguous_keep_the_input(spec):
  """e.g. leaky_relu(negative_slope=-0.1): y no longer tells the side of 0, so x is kept."""
  x = _x(jnp.float32)
  defaults = {p.name: p.default for p in spec.params}
  dynamic = [p.name for p in spec.params if not p.static]
  bad = [(n, v) for n in dynamic for v in _CANDIDATES if not spec.output_ok(**defaults | {n: v})]
  assert bad, f"none of {_CANDIDATES} is rejected by {spec.name}'s output_ok"
  for name, v in bad:
    for value in (
      v,
      np.array([v, 0.5] * 64, np.float32),
    ):  # scalar, and one bad channel among good ones
      y, pull = jax.vjp(lambda x, name=name, value=value: public(spec)(x, **{name: value}), x)
      _assert_keeps(_kept(y, pull), "input", x, y, f"{spec.name}({name}={v})")
