"""jaxact.linen / jaxact.nnx RMSNorm and LayerNorm against Flax's own modules: attributes,
parameters, outputs and gradients; what they refuse; and a pre-norm gated block that keeps
nothing of its input."""

from __future__ import annotations

import dataclasses
import inspect

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import jaxact.linen as jnn
import jaxact.nnx as jnnx

PAIRS = [(jnn.RMSNorm, nn.RMSNorm), (jnn.LayerNorm, nn.LayerNorm)]
NNX_PAIRS = [(jnnx.RMSNorm, nnx.RMSNorm), (jnnx.LayerNorm, nnx.LayerNorm)]


def _x(shape=(4, 6, 16), dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(0), shape, jnp.float32) * 2 + 0.5).astype(dtype)


def _close(a, b, dtype):
  tol = 2e-2 if jnp.dtype(dtype).itemsize == 2 else 2e-5
  np.testing.assert_allclose(
    np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
  )


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=["rms", "layer"])
def test_linen_attributes_are_flax_plus_residual(ours, theirs):
  assert issubclass(ours, theirs)
  fields = [f for f in dataclasses.fields(ours) if f.name not in ("parent", "name")]
  flax_fields = [f for f in dataclasses.fields(theirs) if f.name not in ("parent", "name")]
  assert [f.name for f in fields] == [f.name for f in flax_fields] + ["residual", "scale_offset"]
  for f, g in zip(fields, flax_fields, strict=False):
    assert f.default is g.default or f.default == g.default, f.name
  assert (fields[-2].default, fields[-1].default) == ("output", 0.0)


@pytest.mark.parametrize(("ours", "theirs"), NNX_PAIRS, ids=["rms", "layer"])
def test_nnx_arguments_are_flax_plus_residual(ours, theirs):
  assert issubclass(ours, theirs)
  mine = list(inspect.signature(ours.__init__).parameters.values())
  flax_params = list(inspect.signature(theirs.__init__).parameters.values())
  describe = lambda p: (p.name, p.kind, p.default)
  assert [describe(p) for p in mine[:-2]] == [describe(p) for p in flax_params]
  assert [(p.name, p.default) for p in mine[-2:]] == [("residual", "output"), ("scale_offset", 0.0)]
  flax_vars = vars(theirs(8, rngs=nnx.Rngs(0)))
  assert list(vars(ours(8, rngs=nnx.Rngs(0)))) == [*flax_vars, "residual", "scale_offset"]


CASES = [
  dict(x_dtype=jnp.float32, kw={}),
  dict(x_dtype=jnp.bfloat16, kw={}),  # Flax promotes to the float32 params: a float32 output
  dict(x_dtype=jnp.bfloat16, kw={"dtype": jnp.bfloat16}),
  dict(x_dtype=jnp.float32, kw={"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}),
  dict(x_dtype=jnp.float32, kw={"use_scale": False}),
  dict(x_dtype=jnp.float32, kw={"reduction_axes": (1, 2), "feature_axes": (1, 2)}),
  dict(x_dtype=jnp.float32, kw={"epsilon": 1e-2, "scale_init": nn.initializers.normal(1.0)}),
]


CASE_IDS = ["f32", "bf16-x", "bf16-dtype", "bf16-params", "no-scale", "two-axes", "eps-init"]


@pytest.mark.sample(2)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=["rms", "layer"])
def test_linen_equals_flax(ours, theirs, case):
  x, kw = _x(dtype=case["x_dtype"]), case["kw"]
  if theirs is nn.LayerNorm and "use_scale" in kw:
    kw = {**kw, "use_bias": False}
  params = theirs(**kw).init(jax.random.key(1), x)
  assert jax.tree.map(jnp.shape, ours(**kw).init(jax.random.key(1), x)) == jax.tree.map(
    jnp.shape, params
  )
  y, y_want = ours(**kw).apply(params, x), theirs(**kw).apply(params, x)
  assert y.dtype == y_want.dtype
  _close(y, y_want, y.dtype)

  def grads(m):
    return jax.grad(lambda p, x: jnp.sum(m.apply(p, x).astype(jnp.float32) ** 3), (0, 1))(params, x)

  got, want = jax.tree.leaves(grads(ours(**kw))), jax.tree.leaves(grads(theirs(**kw)))
  for a, b in zip(got, want, strict=True):
    assert a.dtype == b.dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    half = y.dtype if jnp.dtype(y.dtype).itemsize == 2 else x.dtype
    _close(np.asarray(a, np.float32) / scale, np.asarray(b, np.float32) / scale, half)


@pytest.mark.parametrize(("ours", "theirs"), NNX_PAIRS, ids=["rms", "layer"])
def test_nnx_equals_flax(ours, theirs):
  x = _x()
  mine, flax_layer = ours(16, rngs=nnx.Rngs(0)), theirs(16, rngs=nnx.Rngs(0))
  assert jax.tree.map(jnp.shape, nnx.state(mine, nnx.Param)) == jax.tree.map(
    jnp.shape, nnx.state(flax_layer, nnx.Param)
  )
  _close(mine(x), flax_layer(x), jnp.float32)
  g1 = jax.grad(lambda x: jnp.sum(mine(x) ** 3))(x)
  g2 = jax.grad(lambda x: jnp.sum(flax_layer(x) ** 3))(x)
  _close(g1 / jnp.abs(g2).max(), g2 / jnp.abs(g2).max(), jnp.float32)
  x16 = x.astype(jnp.bfloat16)
  mine16 = ours(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  theirs16 = theirs(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert mine16(x16).dtype == theirs16(x16).dtype == jnp.bfloat16
  _close(mine16(x16), theirs16(x16), jnp.bfloat16)


def _gemma_rms(x, scale):
  """Gemma's RMSNorm (flax examples/gemma, layers.py): ``x_hat * (1 + scale)``."""
  var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


def test_gemma_norm_by_scale_offset_in_linen_and_nnx():
  """``scale_offset=1.0`` with a zero-initialised scale is Gemma's norm: the output, and the
  gradients in x and in the scale (which a plain RMSNorm of a zero scale would give as 0)."""
  x = _x()
  scale = jax.random.normal(jax.random.key(3), (16,), jnp.float32) * 0.1
  linen = jnn.RMSNorm(scale_offset=1.0, scale_init=nn.initializers.zeros)
  params = linen.init(jax.random.key(0), x)
  assert not params["params"]["scale"].any()
  params = {"params": {"scale": scale}}  # a Gemma checkpoint's scale

  def loss(f):
    return lambda x, s: jnp.sum(f(x, s) ** 3)

  got = jax.grad(loss(lambda x, s: linen.apply({"params": {"scale": s}}, x)), (0, 1))(x, scale)
  want = jax.grad(loss(_gemma_rms), (0, 1))(x, scale)
  _close(linen.apply(params, x), _gemma_rms(x, scale), jnp.float32)
  for a, b in zip(got, want, strict=True):
    _close(a / jnp.abs(b).max(), b / jnp.abs(b).max(), jnp.float32)
  layer = jnnx.RMSNorm(16, scale_offset=1.0, scale_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
  _close(layer(x), x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), jnp.float32)
  layer.scale[...] = scale
  _close(layer(x), _gemma_rms(x, scale), jnp.float32)
  d_scale = nnx.grad(lambda m: jnp.sum(m(x) ** 3))(layer).scale[...]
  _close(d_scale / jnp.abs(want[1]).max(), want[1] / jnp.abs(want[1]).max(), jnp.float32)
  ln = jnnx.LayerNorm(16, scale_offset=1.0, scale_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
  _close(ln(x), nnx.LayerNorm(16, rngs=nnx.Rngs(0))(x), jnp.float32)  # 1 + 0 is Flax's 1


@pytest.mark.parametrize(
  ("module", "call", "match"),
  [
    (jnn.RMSNorm(), {"mask": jnp.ones((2, 8), bool)}, r"RMSNorm: `mask` is not supported"),
    (jnn.LayerNorm(axis_name="batch"), {}, r"LayerNorm: `axis_name`"),
    (jnn.RMSNorm(reduction_axes=(0, 1)), {}, r"`feature_axes` -1 must be the `reduction_axes`"),
    (jnn.LayerNorm(epsilon=0.0), {}, r"jaxact.linen.LayerNorm: `epsilon` must be a positive"),
  ],
  ids=["mask", "axis_name", "feature_axes", "epsilon"],
)
def test_refusals_name_the_attribute(module, call, match):
  with pytest.raises(ValueError, match=match):
    module.init(jax.random.key(0), jnp.ones((2, 8)), **call)


def test_nnx_promote_dtype_takes_flax_arguments():
  """A custom ``promote_dtype`` gets what Flax's layer gives it: ``(x, scale)`` in RMSNorm."""

  def to_bf16(arrays, dtype=None):
    x, scale = arrays  # RMSNorm's pair
    return x.astype(jnp.bfloat16), scale.astype(jnp.bfloat16)

  x = _x()
  mine = jnnx.RMSNorm(16, promote_dtype=to_bf16, rngs=nnx.Rngs(0))
  flax_layer = nnx.RMSNorm(16, promote_dtype=to_bf16, rngs=nnx.Rngs(0))
  assert mine(x).dtype == flax_layer(x).dtype == jnp.bfloat16
  _close(mine(x), flax_layer(x), jnp.bfloat16)


def test_nnx_refuses_a_wrong_feature_count():
  with pytest.raises(ValueError, match=r"num_features=8"):
    jnnx.RMSNorm(8, rngs=nnx.Rngs(0))(jnp.ones((2, 6)))


def test_a_pre_norm_gated_block_keeps_nothing_of_its_input():
  # x + gated_mlp(rms_norm(x)): the pullback holds y (gated_mlp's x), the rms, a and b; not x.
  t, d, f = 64, 32, 96
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (t, d), jnp.float32)
  scale = jax.random.normal(k[1], (d,), jnp.float32)
  wg, wu = (jax.random.normal(kk, (d, f), jnp.float32) / d**0.5 for kk in k[2:4])
  wd = jax.random.normal(k[4], (f, d), jnp.float32) / f**0.5

  def block(x):
    return x + jaxact.gated_mlp(jaxact.rms_norm(x, scale), wg, wu, wd, activation="silu")

  _, pull = jax.vjp(block, x)
  leaves = jax.tree.leaves(pull)
  big = sorted((a.shape for a in leaves if a.shape[:1] == (t,) and a.size >= t * d), key=str)
  assert big == sorted([(t, d), (t, f), (t, f)], key=str)  # y, a, b
  assert not any(a.shape == x.shape and np.array_equal(a, x) for a in leaves)
  assert sum(a.shape == (t, 1) for a in leaves) == 1  # the rms
