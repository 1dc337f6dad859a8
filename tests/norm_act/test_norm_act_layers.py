"""jaxact.linen / jaxact.nnx BatchNorm and GroupNorm against Flax's own followed by the
activation: attributes, parameters and batch statistics, outputs, gradients, updated running
averages; and with the default activation, Flax's layer itself."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact.linen as jnn
import jaxact.nnx as jnnx

from cases import representatives

ACTS = {"identity": lambda z: z, "relu": jax.nn.relu, "silu": jax.nn.silu}


def _x(dtype=jnp.float32, shape=(4, 3, 5, 8)):
  return (jax.random.normal(jax.random.key(0), shape, jnp.float32) * 2 + 0.5).astype(dtype)


def _close(a, b, dtype):
  tol = 3e-2 if jnp.dtype(dtype).itemsize == 2 else 2e-5
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert u.dtype == v.dtype and u.shape == v.shape
    v = np.asarray(v, np.float32)
    np.testing.assert_allclose(np.asarray(u, np.float32), v, rtol=tol, atol=tol * np.abs(v).max())


@pytest.mark.parametrize(
  ("ours", "theirs"), [(jnn.BatchNorm, nn.BatchNorm), (jnn.GroupNorm, nn.GroupNorm)]
)
def test_linen_attributes_are_flax_plus_activation(ours, theirs):
  assert issubclass(ours, theirs)
  fields = [f for f in dataclasses.fields(ours) if f.name not in ("parent", "name")]
  flax_fields = [f for f in dataclasses.fields(theirs) if f.name not in ("parent", "name")]
  assert [f.name for f in fields] == [f.name for f in flax_fields] + ["activation"]
  assert fields[-1].default == "identity"


@pytest.mark.parametrize(
  ("ours", "theirs"), [(jnnx.BatchNorm, nnx.BatchNorm), (jnnx.GroupNorm, nnx.GroupNorm)]
)
def test_nnx_arguments_are_flax_plus_activation(ours, theirs):
  assert issubclass(ours, theirs)
  mine = list(inspect.signature(ours.__init__).parameters.values())
  flax_params = list(inspect.signature(theirs.__init__).parameters.values())
  describe = lambda p: (p.name, p.kind, p.default)
  assert [describe(p) for p in mine[:-1]] == [describe(p) for p in flax_params]
  assert (mine[-1].name, mine[-1].default) == ("activation", "identity")


LINEN_CASES = {
  "bn-relu": (jnn.BatchNorm, nn.BatchNorm, dict(momentum=0.9), "relu", jnp.float32),
  "bn-bf16-silu": (jnn.BatchNorm, nn.BatchNorm, {}, "silu", jnp.bfloat16),
  "bn-two-pass-no-scale": (
    jnn.BatchNorm,
    nn.BatchNorm,
    dict(use_fast_variance=False, use_scale=False, epsilon=1e-3),
    "identity",
    jnp.float32,
  ),
  "bn-axis-1": (jnn.BatchNorm, nn.BatchNorm, dict(axis=1), "relu", jnp.float32),
  "gn-silu": (jnn.GroupNorm, nn.GroupNorm, dict(num_groups=4), "silu", jnp.float32),
  "gn-group-size-bf16": (
    jnn.GroupNorm,
    nn.GroupNorm,
    dict(num_groups=None, group_size=2, use_bias=False),
    "relu",
    jnp.bfloat16,
  ),
}


# bn-relu and gn-silu, the plain layers that bn-axis-1 and gn-group-size-bf16 run with an option
# more, under `pytest -m exhaustive`.
_LINEN_DEFAULT = {"bn-bf16-silu", "bn-two-pass-no-scale", "bn-axis-1", "gn-group-size-bf16"}


@pytest.mark.parametrize("case", representatives(list(LINEN_CASES), _LINEN_DEFAULT))
def test_linen_equals_flax_then_the_activation(case):
  ours_cls, flax_cls, kw, act, dtype = LINEN_CASES[case]
  x = _x(dtype)
  ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
  bn = ours_cls is jnn.BatchNorm
  call = dict(use_running_average=False) if bn else {}
  ours, theirs = ours_cls(activation=act, **kw), flax_cls(**kw)
  variables = theirs.init(jax.random.key(2), x, **call)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(2), x, **call)) == jax.tree.map(
    jnp.shape, variables
  )
  variables = jax.tree.map(lambda v: v + 0.1 * jnp.arange(v.size).reshape(v.shape), variables)

  def run(module, after):
    def loss(params, x):
      y, new = (
        module.apply(
          {**variables, "params": params}, x, **call, mutable=["batch_stats"] if bn else False
        )
        if bn
        else (module.apply({**variables, "params": params}, x), {})
      )
      y = after(y)
      return jnp.sum(y.astype(jnp.float32) * ct), (y, new)

    return jax.jit(jax.grad(loss, (0, 1), has_aux=True))(variables["params"], x)

  (g1, (y1, s1)) = run(ours, lambda y: y)
  (g2, (y2, s2)) = run(theirs, ACTS[act])
  _close((y1, s1, g1), (y2, s2, g2), dtype)
  if bn:  # inference: the running averages
    infer = lambda m, after: after(m.apply(variables, x, use_running_average=True))
    _close(infer(ours, lambda y: y), infer(theirs, ACTS[act]), dtype)


def test_linen_default_activation_is_flax_itself():
  x = _x()
  variables = nn.BatchNorm().init(jax.random.key(0), x, use_running_average=False)
  y1, s1 = jnn.BatchNorm().apply(variables, x, use_running_average=False, mutable=["batch_stats"])
  y2, s2 = nn.BatchNorm().apply(variables, x, use_running_average=False, mutable=["batch_stats"])
  _close((y1, s1), (y2, s2), jnp.float32)


NNX_CASES = {
  "bn-relu": (jnnx.BatchNorm, nnx.BatchNorm, dict(momentum=0.8), "relu", jnp.float32),
  "bn-bf16-identity": (jnnx.BatchNorm, nnx.BatchNorm, {}, "identity", jnp.bfloat16),
  "gn-silu": (jnnx.GroupNorm, nnx.GroupNorm, dict(num_groups=4), "silu", jnp.float32),
}


@pytest.mark.parametrize("case", NNX_CASES)
def test_nnx_equals_flax_then_the_activation(case):
  ours_cls, flax_cls, kw, act, dtype = NNX_CASES[case]
  x = _x(dtype)
  ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
  ours = ours_cls(8, activation=act, rngs=nnx.Rngs(0), **kw)
  theirs = flax_cls(8, rngs=nnx.Rngs(0), **kw)
  _close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), jnp.float32)

  def run(module, after):
    def loss(module, x):
      y = after(module(x))
      return jnp.sum(y.astype(jnp.float32) * ct), y

    grads, y = nnx.grad(loss, argnums=(0, 1), has_aux=True)(module, x)
    return grads, (y, nnx.state(module, nnx.BatchStat))  # the statistics updated in place

  (g1, (y1, s1)) = run(ours, lambda y: y)
  (g2, (y2, s2)) = run(theirs, ACTS[act])
  _close((y1, g1), (y2, g2), dtype)
  _close(jax.tree.leaves(s1), jax.tree.leaves(s2), jnp.float32)


def test_nnx_float64_input_keeps_float32_statistics_without_a_warning():
  # the suite runs under x64: Flax's own layer writes the float64 update into its float32
  # statistics through a casting scatter (a FutureWarning, an error in a later jax); ours casts
  x = _x(jnp.float64)
  ours = jnnx.BatchNorm(8, activation="relu", rngs=nnx.Rngs(0))
  theirs = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    y1 = ours(x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    y2 = jax.nn.relu(theirs(x))
  assert ours.mean[...].dtype == ours.var[...].dtype == jnp.float32
  _close((y1, ours.mean[...], ours.var[...]), (y2, theirs.mean[...], theirs.var[...]), jnp.float32)


def test_a_mask_and_bad_groups_name_the_layer():
  x = _x()
  with pytest.raises(ValueError, match=r"jaxact\.linen\.BatchNorm: `mask` is not supported"):
    jnn.BatchNorm(use_running_average=False).init(jax.random.key(0), x, mask=x > 0)
  with pytest.raises(ValueError, match=r"jaxact\.linen\.GroupNorm: `num_groups` 3 does not"):
    jnn.GroupNorm(num_groups=3).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"jaxact\.nnx\.BatchNorm: .*'relux' is not known"):
    jnnx.BatchNorm(8, activation="relux", rngs=nnx.Rngs(0))
