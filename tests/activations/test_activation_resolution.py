"""jax.nn's activation functions (and Flax's re-exports of them) given to the fused ops resolve to
the jaxact spec of the same name: same values, gradients, kept residuals and compiled temp as the
name. A callable jaxact does not know still goes through autodiff.
"""

from __future__ import annotations

import functools
import inspect

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import jaxact.linen
from jaxact._src.activations import api as activations
from jaxact._src.core.spec import SPECS

# Every (namespace name, spec row) for which jax.nn has a function of the row's name or alias.
_JAX_NN = [
  pytest.param(name, spec, id=name)
  for spec in SPECS
  for name in (spec.name, *spec.aliases)
  if callable(getattr(jax.nn, name, None))
]
_ELEMENTWISE = [p for p in _JAX_NN if p.values[1].elementwise]


def _operands(dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(ks[0], (64, 24), dtype)
  w = (jax.random.normal(ks[1], (24, 32)) / 5).astype(dtype)
  b = jax.random.normal(ks[2], (32,), dtype)
  return x, w, b


def _kept(y, pull):
  """The pullback's leaves of the output's size or more (x (64, 24) and w (24, 32) are smaller)."""
  return [leaf for leaf in jax.tree.leaves(pull) if leaf.size >= y.size]


def _same_as_name(activation, name, **params):
  x, w, b = _operands()
  by_fn = functools.partial(jaxact.dense_bias_act, activation=activation)
  named = activations.get_activation(name)
  by_name = functools.partial(
    jaxact.dense_bias_act, activation=functools.partial(named, **params) if params else name
  )
  y1, pull1 = jax.vjp(by_fn, x, w, b)
  y2, pull2 = jax.vjp(by_name, x, w, b)
  np.testing.assert_array_equal(y1, y2)
  ct = jax.random.normal(jax.random.key(9), y1.shape, y1.dtype)
  for g1, g2 in zip(pull1(ct), pull2(ct), strict=True):
    np.testing.assert_array_equal(g1, g2)
  kept1, kept2 = _kept(y1, pull1), _kept(y2, pull2)
  assert len(kept1) == len(kept2)
  for k1, k2 in zip(kept1, kept2, strict=True):
    np.testing.assert_array_equal(k1, k2)
  return kept1, y1


@pytest.mark.parametrize(("name", "spec"), _JAX_NN)
def test_jax_nn_signature_matches_the_spec_row(name, spec):
  # The resolution maps jax.nn.<name> to the row with the same parameters: names and defaults.
  params = list(inspect.signature(getattr(jax.nn, name)).parameters.values())[1:]
  assert [p.name for p in params] == [p.name for p in spec.params]
  for theirs, ours in zip(params, spec.params, strict=True):
    assert theirs.default == ours.default, (name, theirs.name)


@pytest.mark.sample(2)
@pytest.mark.parametrize(("name", "spec"), _ELEMENTWISE)
def test_jax_nn_function_keeps_what_its_name_keeps(name, spec):
  kept, y = _same_as_name(getattr(jax.nn, name), spec.name)
  if spec.residual == "output":
    assert len(kept) == 1
    np.testing.assert_array_equal(kept[0], y)


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  ("activation", "name", "params"),
  [
    (
      functools.partial(jax.nn.leaky_relu, negative_slope=0.2),
      "leaky_relu",
      {"negative_slope": 0.2},
    ),
    (functools.partial(jax.nn.gelu, approximate=False), "gelu", {"approximate": False}),
    (functools.partial(jax.nn.elu, alpha=0.5), "elu", {"alpha": 0.5}),
    (nn.relu, "relu", {}),
    (nnx.gelu, "gelu", {}),
    (nn.swish, "silu", {}),
    (jnp.tanh, "tanh", {}),  # jax.nn.tanh is jax.numpy's
  ],
  ids=["leaky_relu-0.2", "gelu-exact", "elu-0.5", "linen-relu", "nnx-gelu", "swish", "jnp-tanh"],
)
def test_partials_and_flax_reexports_resolve(activation, name, params):
  _same_as_name(activation, name, **params)


def test_unknown_callable_still_goes_through_autodiff():
  # A lambda computing relu keeps the pre-activation (not y) and still differentiates correctly.
  x, w, b = _operands()
  relu = lambda z: z * (z > 0)
  y, pull = jax.vjp(lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=relu), x, w, b)
  (kept,) = _kept(y, pull)
  np.testing.assert_allclose(kept, x @ w + b, rtol=1e-6, atol=1e-6)
  assert not np.array_equal(kept, y)


def test_non_elementwise_jax_nn_functions_stay_callables():
  x, w, b = _operands()
  y = jaxact.dense_bias_act(x, w, b, activation=jax.nn.softmax)
  np.testing.assert_allclose(y, jax.nn.softmax(x @ w + b), rtol=1e-6, atol=1e-7)


def test_gated_dense_and_flax_layers_resolve_jax_nn():
  x, w, _ = _operands()
  wg, wu = w, w[::-1]
  a, b = jax.vjp(lambda x: jaxact.gated_dense(x, wg, wu, activation=jax.nn.silu), x)
  c, d = jax.vjp(lambda x: jaxact.gated_dense(x, wg, wu, activation="silu"), x)
  np.testing.assert_array_equal(a, c)
  assert [k.shape for k in _kept(a, b)] == [k.shape for k in _kept(c, d)]
  layer = jaxact.linen.DenseAct(8, activation=nn.gelu)
  params = layer.init(jax.random.key(0), x)
  named = jaxact.linen.DenseAct(8, activation="gelu")
  np.testing.assert_array_equal(layer.apply(params, x), named.apply(params, x))


@pytest.mark.parametrize(
  ("activation", "name"),
  [
    (jax.nn.relu, "relu"),
    (jax.nn.gelu, "gelu"),
    (functools.partial(jax.nn.leaky_relu, negative_slope=0.2), "leaky_relu"),
  ],
  ids=["relu", "gelu", "leaky_relu"],
)
def test_compiled_temp_equals_the_names(activation, name):
  # The figure: the function objects compile to the same memory as the names.
  x, w, b = (jnp.ones((256, 128)), jnp.ones((128, 256)), jnp.ones((256,)))

  def temp(act):
    loss = lambda x, w, b: jnp.sum(jaxact.dense_bias_act(x, w, b, activation=act) ** 2)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return step.lower(x, w, b).compile().memory_analysis().temp_size_in_bytes

  named = functools.partial(activations.get_activation(name), negative_slope=0.2)
  plain = temp(lambda z: jnp.where(z > 0, z, 0.2 * z) if name == "leaky_relu" else activation(z))
  ours = temp(named if name == "leaky_relu" else name)
  assert temp(activation) == ours
  assert ours <= plain  # and the autodiff path, for contrast, is no smaller
