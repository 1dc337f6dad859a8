"""Tests of the convolution epilogue kernels (``pallas_kernels.bias_act_triton``) behind
conv_bias_act.

With ``implementation="pallas"`` the convolution and its transposes stay with XLA and the bias +
activation epilogue (forward, in place) and the one-pass ``dz``/``db`` backward are Pallas kernels.
On CPU they run in interpret mode and are compared with the XLA path (values and the gradients of
x, w and b) across residual families, dtypes, layouts, strides, groups and ragged tile edges; the
standalone kernels are compared with autodiff of their jnp reference; and lowering for CUDA on
abstract H100/A100 devices must hold the two Triton calls (in place) for every tile configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import pallas_kernels
from kernel_cases import TRITON, lowered_text
from pallas_kernels import bias_act_triton
from support import GPUS

from cases import representatives

# Both paths run the same convolution; the kernels add the bias in float32 to the convolution's
# output where XLA may fuse it, so half precision differs by a rounding of z.
TOL = {
  jnp.float32: dict(atol=2e-5, rtol=2e-5),
  jnp.bfloat16: dict(atol=6e-2, rtol=3e-2),
  jnp.float16: dict(atol=8e-3, rtol=4e-3),
}

ACTIVATIONS = {
  "relu": "relu",
  "tanh": "tanh",
  "elu": "elu",
  "gelu": "gelu",
  "silu": "silu",
  "identity": "identity",
  "leaky_relu_0.2": functools.partial(jaxact.leaky_relu, negative_slope=0.2),
}


def conv_args(x_shape, w_shape, dtype, seed=0, bias=True):
  kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, x_shape, jnp.float32)
  fan_in = int(np.prod(w_shape[:-1]))
  w = jax.random.normal(kw, w_shape, jnp.float32) / np.sqrt(fan_in)
  b = jax.random.normal(kb, (w_shape[-1],), jnp.float32) if bias else None
  return tuple(None if v is None else v.astype(dtype) for v in (x, w, b))


def value_and_grads(impl, activation, x, w, b, **conv_kw):
  @jax.jit
  def f(x, w, b):
    fn = lambda *a: jaxact.conv_bias_act(*a, activation=activation, implementation=impl, **conv_kw)
    primals = (x, w) if b is None else (x, w, b)
    y, pull = jax.vjp(fn, *primals)
    g = jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(y.dtype)
    return y, pull(g)

  return f(x, w, b)


def assert_matches_xla(activation, x, w, b, dtype, **conv_kw):
  got = value_and_grads("pallas", activation, x, w, b, **conv_kw)
  want = value_and_grads("xla", activation, x, w, b, **conv_kw)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_tree_all_finite(got)
  up = lambda t: jax.tree.map(lambda v: v.astype(jnp.float32), t)
  chex.assert_trees_all_close(up(got), up(want), **TOL[dtype])


# ------------------------------------------------------------------- interpret mode, values


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "name", representatives(list(ACTIVATIONS), {"relu", "gelu", "elu", "identity"})
)
def test_activations_float32(name):
  # 23 output channels: a ragged column tile; stride 2 with SAME padding.
  x, w, b = conv_args((2, 9, 9, 5), (3, 3, 5, 23), jnp.float32, seed=1)
  assert_matches_xla(ACTIVATIONS[name], x, w, b, jnp.float32, window_strides=2, padding="SAME")


_HALF = [(n, d) for n in ("tanh", "gelu", "identity") for d in (jnp.bfloat16, jnp.float16)]


@pytest.mark.parametrize(
  "name,dtype",
  representatives(
    _HALF,
    {"gelu-bfloat16"},
    ids=[f"{n}-{jnp.dtype(d).name}" for n, d in _HALF],
  ),
)
def test_half_precision(name, dtype):
  x, w, b = conv_args((2, 8, 8, 6), (3, 3, 6, 16), dtype, seed=2)
  assert_matches_xla(ACTIVATIONS[name], x, w, b, dtype, padding="SAME")


_LAYOUTS = {
  "1d": ((3, 17, 4), (5, 4, 9), dict(padding="VALID")),
  "3d": ((1, 4, 5, 6, 3), (2, 2, 2, 3, 8), dict(padding="SAME")),
  "groups": ((2, 7, 7, 8), (3, 3, 4, 6), dict(padding="SAME", feature_group_count=2)),
  "dilations": (
    (2, 6, 6, 3),
    (3, 3, 3, 5),
    dict(padding=((1, 2), (2, 1)), lhs_dilation=2, rhs_dilation=2),
  ),
  "row-tiles": ((4, 20, 20, 3), (3, 3, 3, 70), dict(padding="SAME")),  # 1600 rows: several tiles
  "column-tiles": ((2, 5, 5, 3), (1, 1, 3, 300), dict(padding=1)),  # 300 channels: two tiles
}


# By default: 3-D, feature groups and two column tiles (what differs most from the dense kernels'
# 2-D layout), with an output-residual (relu) or an input-residual (gelu) epilogue; every layout
# with both under `pytest -m exhaustive`.
@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "x_shape, w_shape, conv_kw, name",
  representatives(
    [(*v, n) for v in _LAYOUTS.values() for n in ("relu", "gelu")],
    {"groups-gelu", "column-tiles-relu"},
    ids=[f"{k}-{n}" for k in _LAYOUTS for n in ("relu", "gelu")],
  ),
)
def test_layouts_and_shapes(x_shape, w_shape, conv_kw, name):
  x, w, b = conv_args(x_shape, w_shape, jnp.float32, seed=3)
  assert_matches_xla(ACTIVATIONS[name], x, w, b, jnp.float32, **conv_kw)


# the kernels' no-bias path: tests/fused/test_dense_triton.py's test_no_bias (dense)
@pytest.mark.exhaustive
@pytest.mark.parametrize("name", ["relu", "gelu", "identity"])
def test_no_bias(name):
  x, w, _ = conv_args((2, 8, 8, 4), (3, 3, 4, 12), jnp.float32, seed=4, bias=False)
  assert_matches_xla(ACTIVATIONS[name], x, w, None, jnp.float32, padding="SAME")


def test_channels_first_output_falls_back_or_raises():
  x, w, _ = conv_args((2, 4, 6, 6), (5, 4, 3, 3), jnp.float32, seed=5)
  b = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
  dn = ("NCHW", "OIHW", "NCHW")
  with pytest.raises(NotImplementedError, match=r"not channels-last \(out_spec=\(0, 1, 2, 3\)\)"):
    jaxact.conv_bias_act(x, w, b, activation="relu", dimension_numbers=dn, implementation="pallas")
  y = jaxact.conv_bias_act(x, w, b, activation="relu", dimension_numbers=dn)  # None: XLA
  want = jaxact.conv_bias_act(
    x, w, b, activation="relu", dimension_numbers=dn, implementation="xla"
  )
  chex.assert_trees_all_equal(y, want)


def test_standalone_kernels_against_reference():
  """pallas_kernels.bias_act_triton on its own, every residual family, small tiles (many
  programs)."""
  z = jax.random.normal(jax.random.key(6), (3, 7, 37), jnp.float32) * 3
  b = jax.random.normal(jax.random.key(7), (37,), jnp.float32)
  g = jax.random.normal(jax.random.key(8), z.shape, jnp.float32)
  tiles = bias_act_triton.EltwiseTiles(rows=16, cols=16, num_warps=4)
  epilogues = {
    "output": pallas_kernels.Epilogue(jnp.tanh, lambda y: 1.0 - y * y, "output"),
    "input": pallas_kernels.Epilogue(jax.nn.softplus, jax.nn.sigmoid, "input"),
    "none": pallas_kernels.Epilogue(lambda v: v, None, "none"),
  }
  for residual, ep in epilogues.items():
    run = functools.partial(
      bias_act_triton.bias_act_fwd, epilogue=ep, block_config=tiles, interpret=True
    )
    y, zb = jax.jit(run)(z, b)
    ref, pull = jax.vjp(
      lambda z, b, ep=ep: bias_act_triton.bias_act_reference(z, b, epilogue=ep), z, b
    )
    chex.assert_trees_all_close(y, ref, atol=1e-6, rtol=1e-6)
    if residual == "input":
      chex.assert_trees_all_close(zb, z + b, atol=1e-6, rtol=1e-6)
    else:
      assert zb is None
    kept = {"output": y, "input": zb, "none": None}[residual]
    want_dz, want_db = pull(g)
    # One row tile a program, and three (db summed across them; the last ones past the rows).
    for t in (tiles, dataclasses.replace(tiles, steps=3)):
      dz, db = jax.jit(
        functools.partial(
          bias_act_triton.bias_act_bwd, epilogue=ep, has_bias=True, block_config=t, interpret=True
        )
      )(g, kept)
      chex.assert_trees_all_close(dz, want_dz, atol=1e-5, rtol=1e-5)
      chex.assert_trees_all_close(db, want_db, atol=1e-4, rtol=1e-5)
      assert db.dtype == jnp.float32


@pytest.mark.sample(2)
@pytest.mark.parametrize("residual", ["output", "input", "none"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bias_grad_sums_dz_over_every_axis_but_the_last(residual, dtype):
  """bias_grad (db of the Hopper backward, which forms dz on the fly): the float32 sum of
  ``g * act'(r)`` over 300 rows in programs of DB_STEPS ragged row tiles, ragged columns, against
  float64 numpy; dz is summed before any rounding to g's dtype."""
  epilogue = {
    "output": pallas_kernels.Epilogue(jnp.tanh, lambda y: 1.0 - y * y, "output"),
    "input": pallas_kernels.Epilogue(jax.nn.softplus, jax.nn.sigmoid, "input"),
    "none": pallas_kernels.Epilogue(lambda v: v, None, "none"),
  }[residual]
  g = (jax.random.normal(jax.random.key(1), (2, 150, 37), jnp.float32) * 3).astype(dtype)
  r = (jax.random.normal(jax.random.key(2), g.shape, jnp.float32) * 2).astype(dtype)
  tiles = bias_act_triton.EltwiseTiles(
    rows=16, cols=16, num_warps=4, steps=bias_act_triton.DB_STEPS
  )
  assert 2 * tiles.steps * tiles.rows < 300  # three programs down the rows
  run = functools.partial(
    bias_act_triton.bias_grad, epilogue=epilogue, block_config=tiles, interpret=True
  )
  db = jax.jit(run)(g, None if residual == "none" else r)
  g64, r64 = (np.asarray(v, np.float64) for v in (g, r))
  d = {"output": 1.0 - r64 * r64, "input": 1.0 / (1.0 + np.exp(-r64)), "none": 1.0}[residual]
  assert db.dtype == jnp.float32 and db.shape == (37,)
  np.testing.assert_allclose(np.asarray(db), (g64 * d).sum((0, 1)), rtol=1e-5, atol=1e-4)
  if residual != "none":
    with pytest.raises(ValueError, match=r"needs the residual of shape \(2, 150, 37\); got None"):
      bias_act_triton.bias_grad(g, None, epilogue=epilogue, interpret=True)


def test_standalone_kernels_check_their_arguments():
  ep = pallas_kernels.Epilogue(jnp.tanh, lambda y: 1.0 - y * y, "output")
  z = jnp.zeros((4, 3), jnp.float32)
  with pytest.raises(ValueError, match=r"`b` must have shape \(3,\); got b.shape=\(4,\)"):
    bias_act_triton.bias_act_fwd(z, jnp.zeros(4, jnp.float32), epilogue=ep, interpret=True)
  with pytest.raises(TypeError, match=r"`z` has dtype int32"):
    bias_act_triton.bias_act_fwd(z.astype(jnp.int32), None, epilogue=ep, interpret=True)
  with pytest.raises(ValueError, match=r"needs the residual of shape \(4, 3\); got None"):
    bias_act_triton.bias_act_bwd(z, None, epilogue=ep, has_bias=False, interpret=True)


# ------------------------------------------------------------------------- CUDA lowering


def conv_step(activation, implementation, bias=True):
  def loss(x, w, b):
    y = jaxact.conv_bias_act(
      x, w, b, activation=activation, padding="SAME", implementation=implementation
    )
    return jnp.sum(y.astype(jnp.float32))

  return jax.value_and_grad(loss, (0, 1, 2) if bias else (0, 1))


def conv_shapes(n, hw, c_in, c_out, dtype):
  shapes = ((n, hw, hw, c_in), (3, 3, c_in, c_out), (c_out,))
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


# (rows, channels) probes covering _block_config's classes: tiny, one tile, many tiles; channel
# counts below, at and above the 256-column cap; every dtype.
_PROBES = [
  ((n, hw, c_out), dt)
  for (n, hw), c_out in itertools.product(((1, 2), (2, 8), (8, 32)), (3, 64, 300))
  for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
]
CONFIGS = {
  bias_act_triton.default_tiles((n * hw * hw, c), dt): ((n, hw, c), dt)
  for (n, hw, c), dt in _PROBES
}


def test_block_configs_are_powers_of_two():
  assert len(CONFIGS) >= 5
  for t in CONFIGS:
    assert all(v >= 1 and v & (v - 1) == 0 for v in (t.rows, t.cols)), t
    assert t.rows >= 16 and t.rows * t.cols <= 4096 and t.cols <= 256, t


@pytest.mark.sample(1)
@pytest.mark.parametrize("kind", list(GPUS))
def test_every_block_config_lowers_for_cuda(kind):
  families = ("tanh", "gelu", "identity")
  for i, ((n, hw, c), dt) in enumerate(CONFIGS.values()):
    activation = families[i % 3]
    text = lowered_text(conv_step(activation, "pallas"), conv_shapes(n, hw, 4, c, dt), "cuda", kind)
    assert text.count(f"custom_call @{TRITON}(") == 2, (n, hw, c, dt, activation)  # fwd, bwd
    # In place: dz over the cotangent; the epilogue over the convolution's output, except in
    # float16, whose convolution result is float32 (see fused._forward_matmul_dtype).
    assert text.count("output_operand_aliases") == (1 if dt == jnp.float16 else 2)


@pytest.mark.sample(2)
@pytest.mark.parametrize("name", [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise])
def test_every_spec_activation_lowers_for_cuda(name):
  text = lowered_text(conv_step(name, "pallas"), conv_shapes(2, 8, 4, 24, jnp.bfloat16))
  assert text.count(f"custom_call @{TRITON}(") == 2


def test_auto_follows_the_lowering_platform():
  args_ = conv_shapes(2, 8, 4, 24, jnp.bfloat16)
  assert TRITON in lowered_text(conv_step("gelu", None), args_, platform="cuda")
  assert TRITON not in lowered_text(conv_step("gelu", None), args_, platform="cpu")
  assert TRITON not in lowered_text(conv_step("gelu", "xla"), args_, platform="cuda")
