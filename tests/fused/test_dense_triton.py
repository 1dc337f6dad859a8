"""Tests of the Pallas (Triton backend) kernels behind ``implementation="pallas"`` / ``None``.

On CPU the kernels run in Pallas interpret mode: values and the gradients of x, w and b are compared
with the XLA path for every residual family, the three dtypes, ragged and tiny shapes, batch
dimensions and no bias. Every tile configuration ``default_block_config`` can return is lowered for
CUDA (abstract H100 and A100 devices: no GPU needed), forward and backward, and the lowered module
must hold the Triton custom calls; ``implementation=None`` holds them when lowered for CUDA only.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import pallas_kernels
import support
from kernel_cases import TRITON, args, lowered_text
from pallas_kernels import dense_triton as kernels
from pallas_kernels import dense_triton_tiles
from support import GPUS, train_step
from support import layer_shapes as shapes

from cases import EXH, representatives

# The kernels and the XLA path differ by summation order (tiles of 16..128 against XLA:CPU's) and,
# in half precision, by dz being rounded to the operands' dtype before the backward dots.
TOL = {
  jnp.float32: dict(atol=2e-5, rtol=2e-5),
  jnp.bfloat16: dict(atol=5e-2, rtol=3e-2),
  jnp.float16: dict(atol=8e-3, rtol=4e-3),
}

ACTIVATIONS = {
  "relu": "relu",  # output residual, kinked
  "tanh": "tanh",  # output residual
  "elu": "elu",  # output residual with a (static) parameter
  "gelu": "gelu",  # input residual: the forward kernel stores z as well
  "silu": "silu",  # input residual
  "identity": "identity",  # no residual
  "leaky_relu_0.2": functools.partial(jaxact.leaky_relu, negative_slope=0.2),
}


def value_and_grads(impl, activation, x, w, b):
  """y and (dx, dw[, db]) for a fixed random cotangent, one jit per implementation."""

  @jax.jit
  def f(x, w, b):
    fn = lambda *a: jaxact.dense_bias_act(*a, activation=activation, implementation=impl)
    primals = (x, w) if b is None else (x, w, b)
    y, pull = jax.vjp(fn, *primals)
    g = jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(y.dtype)
    return y, pull(g)

  return f(x, w, b)


def assert_matches_xla(activation, x, w, b, dtype):
  got = value_and_grads("pallas", activation, x, w, b)
  want = value_and_grads("xla", activation, x, w, b)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_tree_all_finite(got)
  up = lambda t: jax.tree.map(lambda v: v.astype(jnp.float32), t)
  chex.assert_trees_all_close(up(got), up(want), **TOL[dtype])


# ------------------------------------------------------------------- interpret mode, values


@pytest.mark.sample(1, "leaky_relu_0.2")
@pytest.mark.parametrize(
  "name", representatives(list(ACTIVATIONS), {"relu", "gelu", "identity", "leaky_relu_0.2"})
)
def test_activations_float32_ragged(name):
  x, w, b = args((37, 19, 23), jnp.float32, seed=1)
  assert_matches_xla(ACTIVATIONS[name], x, w, b, jnp.float32)


_HALF = [(n, d) for n in ("tanh", "gelu", "identity") for d in (jnp.bfloat16, jnp.float16)]


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "name,dtype",
  representatives(
    _HALF,
    {"tanh-float16", "gelu-bfloat16", "identity-float16"},
    ids=[f"{n}-{jnp.dtype(d).name}" for n, d in _HALF],
  ),
)
def test_half_precision(name, dtype):
  x, w, b = args((37, 19, 23), dtype, seed=2)
  assert_matches_xla(ACTIVATIONS[name], x, w, b, dtype)


_SHAPES = {"1x1x1": (1, 1, 1), "batch-dims": (2, 5, 17, 23), "multi-tile": (130, 70, 140)}


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "shape,name",
  representatives(
    [(s, n) for s in _SHAPES.values() for n in ("relu", "silu")],
    {"1x1x1-relu", "batch-dims-silu", "multi-tile-relu", "multi-tile-silu"},
    ids=[f"{k}-{n}" for k in _SHAPES for n in ("relu", "silu")],
  ),
)
def test_shapes(shape, name):
  # 130 x 70 x 140 spans several tiles of each kernel, each ragged at the far edge.
  x, w, b = args(shape, jnp.float32, seed=3)
  assert_matches_xla(ACTIVATIONS[name], x, w, b, jnp.float32)


@pytest.mark.parametrize("name", representatives(["relu", "gelu", "identity"], {"gelu"}))
def test_no_bias(name):
  x, w, _ = args((37, 19, 23), jnp.float32, seed=4, bias=False)
  assert_matches_xla(ACTIVATIONS[name], x, w, None, jnp.float32)


def test_one_by_one_convolution_uses_the_dense_kernels():
  x, w, b = args((2, 3, 5, 7, 6), jnp.float32, seed=5)  # NHWC with C=7, reshaped kernel below
  w4 = w.reshape(1, 1, 7, 6)
  conv = lambda impl: jaxact.conv_bias_act(x, w4, b, activation="gelu", implementation=impl)
  chex.assert_trees_all_close(conv("pallas"), conv("xla"), **TOL[jnp.float32])


def test_standalone_kernels_against_reference():
  """pallas_kernels on its own: its custom_vjp against autodiff of its pure-jnp reference."""
  ep = kernels.Epilogue(fn=jnp.tanh, derivative=lambda y: 1.0 - y * y, residual="output")
  x, w, b = args((21, 33, 17), jnp.float32, seed=6)
  run = functools.partial(pallas_kernels.dense_bias_act, epilogue=ep, interpret=True)
  ref = functools.partial(pallas_kernels.dense_bias_act_reference, epilogue=ep)
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  chex.assert_trees_all_close(run(x, w, b), ref(x, w, b), atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(
    jax.grad(loss(run), (0, 1, 2))(x, w, b),
    jax.grad(loss(ref), (0, 1, 2))(x, w, b),
    atol=1e-5,
    rtol=1e-5,
  )


def test_unsupported_calls_fall_back_or_raise():
  x, w, b = args((4, 3, 2), jnp.float64, seed=7)
  with pytest.raises(NotImplementedError, match=r"x dtype float64"):
    jaxact.dense_bias_act(x, w, b, activation="relu", implementation="pallas")
  slopes = jnp.linspace(0.1, 0.2, 2, dtype=jnp.float32)
  x32, w32, b32 = (v.astype(jnp.float32) for v in (x, w, b))
  leaky = functools.partial(jaxact.leaky_relu, negative_slope=slopes)
  with pytest.raises(NotImplementedError, match=r"parameters given as arrays \(negative_slope\)"):
    jaxact.dense_bias_act(x32, w32, b32, activation=leaky, implementation="pallas")
  # None falls back to XLA silently for the same calls.
  jaxact.dense_bias_act(x, w, b, activation="relu")
  jaxact.dense_bias_act(x32, w32, b32, activation=leaky)


# ------------------------------------------------------------------------- CUDA lowering


def configs(hopper: bool):
  """One probe (shape, dtype) per configuration `default_block_config` can return for the target
  (support.triton_probes: every size class of every dimension, every dtype)."""
  return support.triton_probes(hopper)


# Shared memory per SM: A100 164 KiB, H100 228 KiB; Triton needs some for its epilogue.
SMEM = {False: 128 * 1024, True: 200 * 1024}


@pytest.mark.parametrize("hopper", [False, True], ids=["ampere", "hopper"])
def test_block_configs_are_powers_of_two_and_fit_shared_memory(hopper):
  found = configs(hopper)
  for cfg, (_, dt) in found.items():
    for name, t in (("fwd", cfg.fwd), ("dx", cfg.dx), ("dw", cfg.dw)):
      assert all(v >= 16 and v & (v - 1) == 0 for v in (t.rows, t.cols, t.step)), t
      # Operand tiles per pipeline stage: x and w forward; g, the residual and x or w backward.
      loads = {
        "fwd": t.rows + t.cols,  # x (rows x step), w (step x cols)
        "dx": 2 * t.rows + t.cols,  # g and residual (rows x step), w (cols x step)
        "dw": t.rows + 2 * t.cols,  # x (step x rows), g and residual (step x cols)
      }[name] * t.step
      assert loads * np.dtype(dt).itemsize * t.num_stages <= SMEM[hopper], (t, dt)
  # Hopper differs only for bfloat16 operands and layers its wide tiles divide.
  assert set(configs(True)) - set(configs(False)) == {
    dense_triton_tiles.default_block_config((512, 512, 512), jnp.bfloat16, hopper=True)
  }
  ragged = dense_triton_tiles.default_block_config((200, 200, 200), jnp.bfloat16, hopper=True)
  assert ragged in configs(False)


@pytest.mark.parametrize(
  "kind", [pytest.param(k, marks=[] if k == "H100" else EXH) for k in GPUS]
)  # A100 (every configuration, 10 s) under -m exhaustive; the H100 adds one configuration
def test_every_block_config_lowers_for_cuda(kind):
  """Forward and backward of every configuration, for every residual family, hold Triton calls."""
  found = configs(hopper=kind == "H100")
  assert len(found) >= 20
  if kind == "H100":  # lowering does not depend on the target: only the tiles Hopper adds
    found = {c: p for c, p in found.items() if c not in configs(hopper=False)}
    assert len(found) == 1
  families = ("tanh", "gelu", "identity")  # output, input and no residual, in turn
  for i, ((m, k, n), dt) in enumerate(found.values()):
    activation = families[i % 3]
    text = lowered_text(train_step(activation, "pallas"), shapes(m, k, n, dt), "cuda", kind)
    # forward, dx, dw(+db)
    assert text.count(f"custom_call @{TRITON}(") == 3, (m, k, n, dt, activation)


@pytest.mark.sample(2)
@pytest.mark.parametrize("name", [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise])
def test_every_spec_activation_lowers_for_cuda(name):
  """Every activation of the spec table works as an epilogue of the Triton kernels."""
  text = lowered_text(train_step(name, "pallas"), shapes(40, 40, 40, jnp.bfloat16), "cuda")
  assert text.count(f"custom_call @{TRITON}(") == 3


def test_auto_picks_kernels_only_when_lowered_for_cuda():
  step = train_step("gelu", None)
  args_ = shapes(64, 32, 48, jnp.bfloat16)
  assert text_has_triton(lowered_text(step, args_, "cuda", "A100"))
  assert not text_has_triton(lowered_text(step, args_, "cpu", "A100"))
  # "xla" never uses them.
  assert not text_has_triton(lowered_text(train_step("gelu", "xla"), args_, "cuda", "A100"))


def test_auto_keeps_xla_for_dense_layers_on_hopper():
  # Measured: XLA's matmuls beat the Triton kernels on an H100 (the fused ops' AUTO_RULES).
  args_ = shapes(64, 32, 48, jnp.bfloat16)
  assert not text_has_triton(lowered_text(train_step("gelu", None), args_, "cuda", "H100"))
  assert text_has_triton(lowered_text(train_step("gelu", "pallas"), args_, "cuda", "H100"))


def text_has_triton(text: str) -> bool:
  return TRITON in text


def test_f32_precision_reaches_the_kernels():
  """TF32 only where `precision` allows it: HIGHEST gives IEEE dots in the kernels' jaxprs."""
  assert pallas_kernels.allow_tf32(None) and pallas_kernels.allow_tf32("default")
  assert not pallas_kernels.allow_tf32("highest")
  assert not pallas_kernels.allow_tf32(jax.lax.Precision.HIGHEST)
  x, w, b = args((8, 8, 8), jnp.float32)
  for precision, want in ((None, "DEFAULT"), (jax.lax.Precision.HIGHEST, "HIGHEST")):
    jaxpr = str(
      jax.make_jaxpr(
        lambda x, w, b, p=precision: jaxact.dense_bias_act(
          x, w, b, activation="relu", precision=p, implementation="pallas"
        )
      )(x, w, b)
    )
    assert f"precision=(Precision.{want}, Precision.{want})" in jaxpr
