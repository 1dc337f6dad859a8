"""Tests of the Hopper path: the Mosaic GPU forward kernel (``pallas_kernels.dense_mosaic``) behind
``implementation="mosaic"`` and, on Hopper targets, ``None``.

On CPU the kernel runs in Mosaic GPU's interpreter (``plgpu.InterpretGPUParams``, which simulates
the warpgroups, shared memory, TMA and barriers): values and the gradients of x, w and b through
jaxact are compared with the XLA path for every residual family, bfloat16 and float16, batch
dimensions and no bias; the kernel alone against a float32 reference over several tiles in every
dimension. Lowering for an abstract H100 (no GPU needed) runs Mosaic GPU's compiler up to the
PTX-independent module, which checks the shared-memory budget and the layouts: every tile
configuration ``hopper_tiles`` returns and every activation the kernel accepts must lower, and
``None`` must pick the kernel on an H100 only, for the shapes it supports.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

import jaxact
import support
from kernel_cases import MOSAIC, TRITON, args, backward_reference, lowered_text
from pallas_kernels import Epilogue, _mosaic, dense_mosaic, dense_mosaic_bwd
from support import layer_shapes as shapes
from support import train_step

from cases import representatives

# The XLA path rounds the bf16 matmul result before adding the bias (cuBLAS's bf16 output); the
# kernel adds it to the float32 accumulator: values agree to a rounding or two of the output.
TOL = {jnp.bfloat16: dict(atol=6e-2, rtol=3e-2), jnp.float16: dict(atol=8e-3, rtol=4e-3)}
# Gradients: both paths run XLA's backward from their own y (or z). Where that rounding moves a
# value across a kink (relu's 0), dz flips, so gradients are compared as XLA's own are checked:
# relative Frobenius error against float32 autodiff of the plain formula, at most twice XLA's
# (plus a floor of one rounding of the dtype).
FLOOR = {jnp.bfloat16: 8e-3, jnp.float16: 1e-3}

ACTIVATIONS = {
  "relu": "relu",  # output residual, kinked
  "tanh": "tanh",  # output residual
  "gelu": "gelu",  # input residual: the kernel writes z as well
  "silu": "silu",  # input residual
  "identity": "identity",  # no residual
  "leaky_relu_0.2": functools.partial(jaxact.leaky_relu, negative_slope=0.2),
  "elu": "elu",  # expm1 in the forward (rewritten from exp and log in the kernel)
  "softplus": "softplus",  # log1p in the forward, expm1 in the derivative from y
}


def value_and_grads(impl, activation, x, w, b):
  """y and (dx, dw[, db]) for a fixed random cotangent; impl "f32" is the float32 reference:
  autodiff of ``spec.fn(x @ w + b)`` on upcast inputs at HIGHEST precision."""

  @jax.jit
  def run(x, w, b):
    def f(x, w, *b):
      if impl == "f32":
        spec = jaxact.get_spec(
          activation if isinstance(activation, str) else activation.func.__name__
        )
        params = {p.name: p.default for p in spec.params}
        params |= getattr(activation, "keywords", {})
        z = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST) + (b[0] if b else 0.0)
        return spec.fn(z, **params)
      return jaxact.dense_bias_act(
        x, w, b[0] if b else None, activation=activation, implementation=impl
      )

    y, pull = jax.vjp(f, x, w, *(() if b is None else (b,)))
    g = jax.random.normal(jax.random.key(9), y.shape, jnp.float32).astype(y.dtype)
    return y, pull(g)

  if impl == "f32":
    return run(*(None if v is None else v.astype(jnp.float32) for v in (x, w, b)))
  return run(x, w, b)


def rel(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(a - ref) / np.linalg.norm(ref)


def assert_matches_xla(activation, x, w, b):
  """Values close to the XLA path's; gradients as accurate as its (against float32)."""
  dtype = x.dtype.type
  (y, grads), (y_xla, grads_xla) = (
    value_and_grads(i, activation, x, w, b) for i in ("mosaic", "xla")
  )
  _, grads_ref = value_and_grads("f32", activation, x, w, b)
  assert y.dtype == y_xla.dtype and y.shape == y_xla.shape
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_xla, np.float32), **TOL[dtype])
  for got, xla, ref in zip(grads, grads_xla, grads_ref, strict=True):
    assert got.dtype == xla.dtype and got.shape == xla.shape
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert rel(got, ref) <= max(2 * rel(xla, ref), FLOOR[dtype]), (rel(got, ref), rel(xla, ref))


# ---------------------------------------------------------------------- interpret: through jaxact


# Every activation once; each dtype meets an output-, an input- and (f16) a no-residual epilogue.
_DTYPE_OF = {
  "relu": jnp.bfloat16,
  "gelu": jnp.bfloat16,
  "leaky_relu_0.2": jnp.bfloat16,
  "elu": jnp.bfloat16,
  "tanh": jnp.float16,
  "silu": jnp.float16,
  "identity": jnp.float16,
  "softplus": jnp.float16,
}


_IDS = [f"{'bf16' if _DTYPE_OF[n] == jnp.bfloat16 else 'f16'}-{n}" for n in ACTIVATIONS]


# By default test_fused_backends.py::test_dense_bias_act_equals_autodiff_of_the_formula
# [mosaic-bfloat16] runs this path (gelu, bfloat16, forward and backward kernels through jaxact).
@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "name,dtype",
  representatives(
    [(n, _DTYPE_OF[n]) for n in ACTIVATIONS],
    {"bf16-gelu", "f16-softplus"},
    ids=_IDS,
  ),
)
def test_values_and_grads_match_xla(name, dtype):
  assert_matches_xla(ACTIVATIONS[name], *args((256, 128, 512), dtype))


@pytest.mark.exhaustive
@pytest.mark.parametrize("bias", representatives([True, False], {"no_bias"}, ["bias", "no_bias"]))
def test_batch_dims_and_no_bias(bias):
  x, w, b = args((2, 64, 128, 256), jnp.bfloat16, seed=3, bias=bias)  # M = 128 over two axes
  assert_matches_xla("gelu", x, w, b)


def test_residual_is_the_output_or_the_preactivation():
  """The Hopper path keeps what the XLA path keeps: y for relu, z for gelu (plus x and w)."""
  x, w, b = args((128, 64, 256), jnp.bfloat16)
  for name, kept in (("relu", "y"), ("gelu", "z")):
    y, pull = jax.vjp(
      lambda x, w, b, n=name: jaxact.dense_bias_act(x, w, b, activation=n, implementation="mosaic"),
      x,
      w,
      b,
    )
    leaves = [v for v in jax.tree.leaves(pull) if getattr(v, "shape", None) == y.shape]
    assert len(leaves) == 1, name
    if kept == "y":
      np.testing.assert_array_equal(np.asarray(leaves[0], np.float32), np.asarray(y, np.float32))
    else:
      z = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
      np.testing.assert_allclose(np.asarray(leaves[0], np.float32), z, atol=3e-2, rtol=1e-2)


# ---------------------------------------------------------------------- interpret: the kernel


def reference(x, w, b, fn):
  z = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) + (
    0.0 if b is None else b.astype(jnp.float32)
  )
  return fn(z), z


@pytest.mark.parametrize(
  "tiles",
  [
    None,  # hopper_tiles' choice
    pytest.param(
      dense_mosaic.HopperTiles(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32),
      marks=pytest.mark.exhaustive,
    ),
    pytest.param(
      dense_mosaic.HopperTiles(tile_m=64, tile_n=64, tile_k=32, stages=3, snake_width=2),
      marks=pytest.mark.exhaustive,
    ),
  ],
  ids=["default", "small_epilogue", "k32_snake2"],
)
def test_kernel_over_many_tiles_matches_float32_reference(tiles):
  """Several tiles along M, N and K (so the pipeline ring wraps and the snake walk turns): 2 x 4
  output tiles of 128 x 128, 5 steps of 64 along K through a ring of 3 stages."""
  x, w, b = args((256, 320, 512), jnp.bfloat16, seed=5)
  epilogue = Epilogue(fn=jnp.tanh, derivative=None, residual="input")
  y, z = dense_mosaic.hopper_dense_bias_act_fwd(
    x, w, b, epilogue=epilogue, num_sms=1, tiles=tiles, interpret=True
  )
  want_y, want_z = reference(x, w, b, jnp.tanh)
  assert y.dtype == z.dtype == jnp.bfloat16
  # One bf16 rounding of each output (values of order 1-4).
  np.testing.assert_allclose(np.asarray(y, np.float32), want_y, atol=8e-3, rtol=8e-3)
  np.testing.assert_allclose(np.asarray(z, np.float32), want_z, atol=3e-2, rtol=8e-3)


def test_kernel_without_bias_and_output_residual():
  x, w, _ = args((128, 64, 256), jnp.float16, seed=6)
  relu = functools.partial(jnp.maximum, 0.0)  # jax.nn.relu is a custom_jvp: not lowered in 0.11
  epilogue = Epilogue(fn=relu, derivative=None, residual="output")
  y, z = dense_mosaic.hopper_dense_bias_act_fwd(
    x, w, None, epilogue=epilogue, num_sms=1, interpret=True
  )
  assert z is None
  np.testing.assert_allclose(
    np.asarray(y, np.float32), reference(x, w, None, relu)[0], atol=4e-3, rtol=2e-3
  )


_TILINGS = {
  "default": None,  # hopper_bwd_tiles' choice: two compute warpgroups, dx_k 256, dw_k 128
  "narrow_k": dense_mosaic_bwd.HopperBwdTiles(dx_k=64, dw_k=64, dx_stages=2, dw_stages=2),
  "other_steps": dense_mosaic_bwd.HopperBwdTiles(
    dx_k=128, dx_n=32, dw_k=64, dw_n=64, dw_m=128, dx_stages=3
  ),
  "one_warpgroup": dense_mosaic_bwd.HopperBwdTiles(
    wgs=1, dx_m=128, dx_k=128, dx_stages=3, dw_stages=3
  ),
  "delayed": dense_mosaic_bwd.HopperBwdTiles(delay=1),
  "one_delayed": dense_mosaic_bwd.HopperBwdTiles(
    wgs=1, dx_k=128, dx_stages=3, dw_stages=3, delay=1
  ),
}
# Each tiling once, and the default with and without a residual operand; the pipelines with a
# residual ("output" and "input": one more tile stream, dz formed from it) and without ("none")
# each meet both warpgroup layouts and the delayed release. Every case costs ~5-15 s in Mosaic
# GPU's interpreter: the default suite runs the two-warpgroup default with a residual and the
# one-warpgroup delayed tiling without one, `pytest -m exhaustive` the rest.
_BACKWARD_CASES = [
  ("default", "output"),
  ("one_delayed", "none"),
  ("narrow_k", "input"),
  ("default", "none"),
  ("other_steps", "none"),
  ("one_warpgroup", "input"),
  ("delayed", "output"),
]


@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "tiles,residual",
  [
    pytest.param(_TILINGS[t], r, id=f"{t}-{r}", marks=[pytest.mark.exhaustive] if i >= 2 else [])
    for i, (t, r) in enumerate(_BACKWARD_CASES)
  ],
)
def test_backward_kernels_over_many_tiles_match_float32_reference(tiles, residual):
  """dx, dw and db of the Hopper backward over several tiles in every dimension (the pipelines
  wrap), from y (tanh' = 1 - y^2), from z (tanh' = 1 - tanh(z)^2), and for identity."""
  x, w, _ = args((384, 512, 1024), jnp.bfloat16, seed=7)
  g = jax.random.normal(jax.random.key(8), (384, 1024), jnp.float32).astype(jnp.bfloat16)
  z = jnp.dot(x, w, preferred_element_type=jnp.float32)
  derivative = {
    "output": lambda y: 1 - y * y,
    "input": lambda z: 1 - jnp.tanh(z) ** 2,
    "none": None,
  }[residual]
  r = {"output": jnp.tanh(z), "input": z, "none": None}[residual]
  r = None if r is None else r.astype(jnp.bfloat16)
  epilogue = Epilogue(fn=jnp.tanh, derivative=derivative, residual=residual)
  dx, dw, db = dense_mosaic_bwd.hopper_dense_bias_act_bwd(
    x, w, r, g, epilogue=epilogue, has_bias=True, tiles=tiles, interpret=True
  )
  assert dx.dtype == dw.dtype == db.dtype == jnp.bfloat16
  assert (dx.shape, dw.shape, db.shape) == (x.shape, w.shape, (1024,))
  want_grads = backward_reference(x, w, r, g, derivative)
  for got, want in zip((dx, dw, db), want_grads, strict=True):
    # One bf16 rounding of the result (float32 accumulation of the same bf16 dz).
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=8e-3 * scale, rtol=8e-3)
  # db (bias_grad) is the float32 column sum of dz, rounded once: 2^-8 apart.
  np.testing.assert_allclose(np.asarray(db, np.float32), want_grads[2], atol=1e-5, rtol=2**-8)


@pytest.mark.exhaustive
def test_backward_kernels_batch_dims_and_no_bias():
  x, w, _ = args((2, 64, 128, 256), jnp.float16, seed=4)
  g = jax.random.normal(jax.random.key(5), (2, 64, 256), jnp.float32).astype(jnp.float16)
  y = jax.nn.relu(jnp.dot(x, w)).astype(jnp.float16)
  relu = Epilogue(fn=None, derivative=lambda y: jnp.where(y > 0, 1.0, 0.0), residual="output")
  dx, dw, db = dense_mosaic_bwd.hopper_dense_bias_act_bwd(
    x, w, y, g, epilogue=relu, has_bias=False, interpret=True
  )
  assert db is None and dx.shape == x.shape and dx.dtype == jnp.float16
  rows = (x.reshape(-1, 128), w, y.reshape(-1, 256), g.reshape(-1, 256))
  want_dx, want_dw, _ = backward_reference(*rows, relu.derivative)
  got_dx = np.asarray(dx, np.float32).reshape(-1, 128)
  np.testing.assert_allclose(got_dx, want_dx, atol=2e-3, rtol=2e-3)
  np.testing.assert_allclose(np.asarray(dw, np.float32), want_dw, atol=1e-2, rtol=2e-3)


def _kernels(jaxpr) -> list[set[str]]:
  """The primitives of each Pallas kernel `jaxpr` calls (the sub-jaxprs of the calls that carry
  ``compiler_params``: ``pallas_call``, or ``mpmd_map`` for Mosaic GPU in newer jax)."""
  found = []
  for eqn in jaxpr.eqns:
    subs = jax_core.jaxprs_in_params(eqn.params)
    if "compiler_params" in eqn.params:
      found.append(set().union(*map(_mosaic.primitives, subs)))
    else:
      for sub in subs:
        found += _kernels(sub)
  return found


@pytest.mark.parametrize("residual", ["output", "input", "none"])
def test_db_is_not_summed_by_the_kernels_of_two_warpgroups(residual):
  """A Mosaic GPU reduction across warps (``jnp.sum`` over rows of a WGMMA-layout tile) goes
  through a scratch buffer at one shared-memory offset for every warpgroup, so two compute
  warpgroups reducing at once race: the dw kernel's db was 33-92% off on an H100 (run 8;
  benchmarks/results/gpu.md, Correctness) while Mosaic GPU's interpreter got it right. The wgmma
  kernels must hold no reduction; db is a third (Triton) kernel's, the only one that reduces."""
  derivative = {"output": lambda y: 1 - y * y, "input": lambda z: 1 - jnp.tanh(z) ** 2}
  epilogue = Epilogue(fn=jnp.tanh, derivative=derivative.get(residual), residual=residual)
  x, w, _ = shapes(512, 512, 1024, jnp.bfloat16)
  rg = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
  for tiles in support.hopper_bwd_variants((512, 512, 1024), residual != "none").values():

    def bwd(x, w, r, g, tiles=tiles):
      r = None if residual == "none" else r
      return dense_mosaic_bwd.hopper_dense_bias_act_bwd(
        x, w, r, g, epilogue=epilogue, has_bias=True, tiles=tiles
      )

    kernels = _kernels(jax.make_jaxpr(bwd)(x, w, rg, rg).jaxpr)
    wgmma = [k for k in kernels if "wgmma_wait" in k]
    others = [k for k in kernels if "wgmma_wait" not in k]
    assert len(wgmma) == 2 and len(others) == 1, (tiles, kernels)
    for k in wgmma:
      assert not {p for p in k if p.startswith("reduce_")}, (tiles, sorted(k))
    assert "reduce_sum" in others[0]


def lower_backward(shape, residual: bool, tiles=None) -> str:
  """The Hopper backward kernels (tanh from y, or identity) with a bias, lowered for an H100."""
  tanh = Epilogue(fn=jnp.tanh, derivative=lambda y: 1 - y * y, residual="output")
  ident = Epilogue(fn=None, derivative=None, residual="none")

  def bwd(x, w, r, g):
    ep = tanh if residual else ident
    return dense_mosaic_bwd.hopper_dense_bias_act_bwd(
      x, w, r if residual else None, g, epilogue=ep, has_bias=True, tiles=tiles
    )

  x, w, _ = shapes(*shape, jnp.bfloat16)
  rg = jax.ShapeDtypeStruct((shape[0], shape[2]), jnp.bfloat16)
  return lowered_text(bwd, [x, w, rg, rg], "cuda")


# By default test_every_tile_configuration_lowers_for_h100 lowers the backward kernels at K = 4096
# with a residual (and checks their shared memory).
@pytest.mark.exhaustive
@pytest.mark.parametrize("k", [4096, 384, 192])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "identity"])
def test_every_backward_tile_configuration_lowers_for_h100(k, residual):
  """hopper_bwd_tiles narrows along K (256, 128, 64) for the K it is given, and picks the deepest
  pipeline that fits: each configuration lowers (Mosaic GPU checks the shared-memory budget)."""
  t = dense_mosaic_bwd.hopper_bwd_tiles((256, k, 256), residual)
  assert k % t.dx_k == 0 and k % t.dw_k == 0
  assert max(t.smem_bytes(2, residual)) <= _mosaic.HOPPER_SMEM
  text = lower_backward((256, k, 256), residual)
  assert mosaic_calls(text) == 2 and text.count(f"custom_call @{TRITON}(") == 1  # db: bias_grad


@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "residual", representatives([True, False], {"residual"}, ["residual", "identity"])
)
def test_every_backward_tiling_the_benchmark_times_lowers_for_h100(residual):
  """benchmarks gpu times support.hopper_bwd_variants against each other on a GPU: each
  must fit the shared memory and lower, or the GPU run would learn nothing about it."""
  shape = (8192, 4096, 4096)
  variants = support.hopper_bwd_variants(shape, residual)
  assert len(variants) == 5 and variants["default"] == dense_mosaic_bwd.hopper_bwd_tiles(
    shape, residual
  )
  for t in variants.values():
    assert max(t.smem_bytes(2, residual)) <= _mosaic.HOPPER_SMEM
    assert mosaic_calls(lower_backward(shape, residual, t)) == 2


def test_a_backward_configuration_over_the_shared_memory_budget_fails_to_lower():
  t = dense_mosaic_bwd.HopperBwdTiles(dx_stages=5, dw_stages=5)
  assert max(t.smem_bytes(2, True)) > _mosaic.HOPPER_SMEM
  with pytest.raises(ValueError, match="shared memory"):
    lower_backward((1024, 1024, 1024), True, t)


# ---------------------------------------------------------------------- what it supports


def test_unsupported_calls_give_reasons():
  relu = Epilogue(fn=functools.partial(jnp.maximum, 0.0), derivative=None, residual="output")
  bf16 = jnp.bfloat16
  assert dense_mosaic.hopper_unsupported((128, 64, 256), bf16, bf16, relu) is None
  cases = {
    ((128, 64, 256), jnp.float32, jnp.float32): "float32",
    ((128, 64, 256), bf16, jnp.float32): "output dtype float32",
    ((100, 64, 256), bf16, bf16): "M=100 is not a multiple of 128",
    ((128, 64, 200), bf16, bf16): "N=200 is not a multiple of 256",
    ((128, 40, 256), bf16, bf16): "K=40 is not a multiple of 64",
  }
  for (shape, dt, out), want in cases.items():
    assert want in dense_mosaic.hopper_unsupported(shape, dt, out, relu)
  erf_inv = Epilogue(fn=jax.lax.erf_inv, derivative=None, residual="input")
  assert "erf_inv" in dense_mosaic.hopper_unsupported((128, 64, 256), bf16, bf16, erf_inv)
  # Operations inside a cond's branches are found too.
  branchy = Epilogue(
    fn=lambda z: jax.lax.cond(True, jax.lax.lgamma, jnp.tanh, z), derivative=None, residual="input"
  )
  assert "lgamma" in dense_mosaic.hopper_unsupported((128, 64, 256), bf16, bf16, branchy)
  # expm1 and log1p, which Mosaic GPU does not lower either, are computed from exp and log; not
  # inside a cond's branches, where they are refused as before.
  for fn in (jnp.expm1, jnp.log1p):
    assert (
      dense_mosaic.hopper_unsupported((128, 64, 256), bf16, bf16, Epilogue(fn, None, "input"))
      is None
    )
  branchy = Epilogue(lambda z: jax.lax.cond(True, jnp.log1p, jnp.tanh, z), None, "input")
  assert "log1p" in dense_mosaic.hopper_unsupported((128, 64, 256), bf16, bf16, branchy)
  with pytest.raises(ValueError, match="M=100 is not a multiple of 128"):
    dense_mosaic.hopper_dense_bias_act_fwd(
      *args((100, 64, 256), bf16), epilogue=relu, num_sms=1, interpret=True
    )


def test_mosaic_raises_for_unsupported_calls_and_none_falls_back():
  x, w, b = args((100, 64, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=r"implementation='mosaic'.*M=100"):
    jaxact.dense_bias_act(x, w, b, activation="relu", implementation="mosaic")
  x, w, b = args((128, 64, 256), jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    jaxact.dense_bias_act(x, w, b, activation="relu", implementation="mosaic")
  x, w, b = args((128, 64, 256), jnp.bfloat16)
  xc = x.reshape(1, 8, 16, 64)
  w3 = jnp.full((3, 3, 64, 256), 0.01, jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="dense layer"):
    jaxact.conv_bias_act(xc, w3, b, activation="relu", padding="SAME", implementation="mosaic")
  # A 1x1 unit-stride convolution is a dense layer: it takes the kernel.
  w1 = w.reshape(1, 1, 64, 256)
  got = jaxact.conv_bias_act(xc, w1, b, activation="relu", implementation="mosaic")
  want = jaxact.conv_bias_act(xc, w1, b, activation="relu", implementation="xla")
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[jnp.bfloat16]
  )
  with pytest.raises(ValueError, match="'mosaic'"):
    jaxact.dense_bias_act(x, w, b, activation="relu", implementation="hopper")


def test_every_lowerable_spec_activation_is_accepted():
  """The kernel accepts each spec activation whose operations Mosaic GPU lowers; the others (and
  only they) are refused with the operation named."""
  refused = {}
  for name in jaxact.ACTIVATIONS:
    spec = jaxact.get_spec(name)
    if not spec.elementwise:
      continue
    params = {p.name: p.default for p in spec.params}
    fn = functools.partial(spec.fn, **params)
    why = _mosaic.epilogue_unsupported(Epilogue(fn, None, "input"))
    if why is not None:
      refused[name] = why
  # expm1 and log1p have no Mosaic GPU lowering in jax 0.11-0.12; the kernels rewrite them.
  assert not refused


# ---------------------------------------------------------------------- lowering for an H100


def mosaic_calls(text: str) -> int:
  return len(re.findall(rf"custom_call @{MOSAIC}\(", text))


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "name,dtype",
  list(itertools.product(["relu", "gelu", "identity"], [jnp.bfloat16, jnp.float16])),
)
def test_every_tile_configuration_lowers_for_h100(name, dtype):
  """hopper_tiles gives four stages with y alone and three with z too: both lower (the shared
  memory budget and layouts are checked by Mosaic GPU's compiler), with the backward kernels'
  four-stage tiles."""
  m, k, n = 8192, 4096, 4096
  outputs = 2 if jaxact.get_spec(name).residual == "input" else 1
  t = dense_mosaic.hopper_tiles((m, k, n), outputs)
  assert t.smem_bytes(2, outputs) <= _mosaic.HOPPER_SMEM
  assert t.stages == (3 if outputs == 2 else 4)
  bwd = dense_mosaic_bwd.hopper_bwd_tiles((m, k, n), residual=name != "identity")
  assert max(bwd.smem_bytes(2, name != "identity")) <= _mosaic.HOPPER_SMEM
  # With a residual tile beside g's, dx's ring stage is 64 KiB and dw's 80 KiB; without, 48 each
  # (four of them and the output sub-tiles fill the 227 KiB exactly).
  assert (bwd.dx_stages, bwd.dw_stages) == ((4, 4) if name == "identity" else (3, 2))
  text = lowered_text(train_step(name, "mosaic"), shapes(m, k, n, dtype), "cuda")
  assert mosaic_calls(text) == 3  # the forward, dx and dw kernels
  assert text.count(f"custom_call @{TRITON}(") == 1  # db's pass


def test_a_configuration_over_the_shared_memory_budget_fails_to_lower():
  """The budget check is real: four stages with z as well do not fit (263 KiB > 227)."""
  t = dense_mosaic.HopperTiles(stages=4)
  assert t.smem_bytes(2, 2) > _mosaic.HOPPER_SMEM
  epilogue = Epilogue(fn=jax.nn.gelu, derivative=None, residual="input")

  def fwd(x, w, b):
    return dense_mosaic.hopper_dense_bias_act_fwd(x, w, b, epilogue=epilogue, num_sms=132, tiles=t)

  with pytest.raises(ValueError, match="shared memory"):
    lowered_text(fwd, shapes(1024, 1024, 1024, jnp.bfloat16), "cuda")


# One activation of each kind (residual family; expm1 and log1p, which the kernel rewrites; the
# longest derivative), every one under `pytest -m exhaustive`. By default the same lowerings run in
# test_every_tile_configuration_lowers_for_h100 ("mosaic") and test_none_picks_the_hopper_kernel_on_
# h100_only (None, elu's expm1 included).
@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "name",
  representatives(
    [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise],
    {"identity", "relu", "gelu", "elu", "softplus", "mish"},
  ),
)
def test_every_accepted_activation_lowers_for_h100(name):
  """None: the forward kernel (XLA's backward); "mosaic": the forward and both backward kernels,
  for every elementwise activation of the spec table (expm1 and log1p rewritten)."""
  fits = shapes(256, 128, 512, jnp.bfloat16)
  assert mosaic_calls(lowered_text(train_step(name, None), fits, "cuda")) == 1
  assert mosaic_calls(lowered_text(train_step(name, "mosaic"), fits, "cuda")) == 3


def test_none_picks_the_hopper_kernel_on_h100_only():
  step = train_step("gelu", None)
  fits = shapes(256, 128, 512, jnp.bfloat16)
  assert mosaic_calls(lowered_text(step, fits, "cuda", "H100")) == 1
  # Lowered for the CPU: XLA; for an A100: the Triton kernels (3 calls, no Mosaic GPU).
  assert mosaic_calls(lowered_text(step, fits, "cpu", "H100")) == 0
  a100 = lowered_text(step, fits, "cuda", "A100")
  assert mosaic_calls(a100) == 0 and TRITON in a100
  # elu's expm1 is computed from exp in the kernel: it takes the kernel too.
  assert mosaic_calls(lowered_text(train_step("elu", None), fits, "cuda", "H100")) == 1
  # Shapes, dtypes and activations the kernel does not take (a plain callable): XLA on an H100
  # (the Triton dense kernels measured slower there), silently.
  for step_, shape in (
    (step, shapes(200, 128, 512, jnp.bfloat16)),
    (step, shapes(256, 128, 512, jnp.float32)),
    (train_step(jnp.sin, None), fits),
  ):
    text = lowered_text(step_, shape, "cuda", "H100")
    assert mosaic_calls(text) == 0 and TRITON not in text
  # "xla" never uses it.
  assert mosaic_calls(lowered_text(train_step("gelu", "xla"), fits, "cuda", "H100")) == 0


def test_backward_kernels_reject_bad_operands():
  x, w, _ = args((128, 64, 256), jnp.bfloat16)
  g = jnp.ones((128, 256), jnp.bfloat16)
  tanh = Epilogue(fn=jnp.tanh, derivative=lambda y: 1 - y * y, residual="output")
  bwd = functools.partial(dense_mosaic_bwd.hopper_dense_bias_act_bwd, epilogue=tanh, has_bias=True)
  with pytest.raises(ValueError, match=r"`g` must have shape \(128, 256\); got \(128, 128\)"):
    bwd(x, w, g, g[:, :128])
  with pytest.raises(ValueError, match="'output' epilogue needs the residual"):
    bwd(x, w, None, g)
  with pytest.raises(TypeError, match="must share one dtype"):
    bwd(x, w, g.astype(jnp.float16), g)
  with pytest.raises(ValueError, match="float32"):
    bwd(*(a.astype(jnp.float32) for a in (x, w, g, g)))
  assert "(in the derivative)" in dense_mosaic_bwd.hopper_bwd_unsupported(
    (128, 64, 256), jnp.bfloat16, Epilogue(jnp.tanh, jax.lax.erf_inv, "input")
  )


@pytest.mark.parametrize("name", ["expm1", "log1p"])
def test_kernel_expm1_and_log1p_match_within_a_few_ulps(name):
  """The kernels' expm1 and log1p (from exp and log, which Mosaic GPU lowers) against float64,
  over float32's range: tiny arguments (where exp(x) - 1 alone loses every digit), the overflow
  edge, infinities, -1 for log1p and NaN."""
  mags = np.logspace(-38, np.log10(88.7), 4000)
  x = np.concatenate([-mags, [0.0], mags, -np.logspace(1, 38, 200)]).astype(np.float32)
  if name == "log1p":
    x = np.concatenate([x[x > -1], [-1.0], np.logspace(1, 38, 200), [np.inf]]).astype(np.float32)
  else:
    x = np.concatenate([x, [89.0, np.inf, -np.inf]]).astype(np.float32)
  fn = {"expm1": _mosaic.expm1, "log1p": _mosaic.log1p}[name]
  got = np.asarray(jax.jit(fn)(x), np.float64)
  with np.errstate(divide="ignore", over="ignore"):  # log1p(-1) = -inf; float32 overflows
    want = getattr(np, name)(x.astype(np.float64))
    want32 = want.astype(np.float32).astype(np.float64)  # inf where float32 overflows
  finite = np.isfinite(want32)
  np.testing.assert_array_equal(got[~finite], want32[~finite])
  np.testing.assert_allclose(got[finite], want[finite], rtol=4 * 2.0**-24, atol=0)
  assert np.isnan(fn(jnp.float32(np.nan)))


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "name",
  representatives(["elu", "selu", "softplus", "log_sigmoid", "mish"], {"elu", "softplus"}),
)
def test_expm1_log1p_activations_stay_finite_at_extreme_inputs(name):
  """Pre-activations from +-1e-30 to +-3e4 (bf16) through the Mosaic kernels (their expm1/log1p
  from exp/log, in the forward and the derivative): y and every gradient finite, y as the XLA
  path's, and db (the sum of dz) as XLA's."""
  k, n = 64, 256
  mags = np.logspace(-30, np.log10(3e4), 64)
  rows = np.stack([np.roll(np.concatenate([-mags, mags])[:k], r) for r in range(128)])
  x = jnp.asarray(rows, jnp.bfloat16)  # (128, 64): every row a spread of magnitudes and signs
  w = jnp.asarray(np.eye(k, n) + np.eye(k, n, k) + np.eye(k, n, 2 * k) + np.eye(k, n, 3 * k))
  w, b = w.astype(jnp.bfloat16), jnp.zeros((n,), jnp.bfloat16)  # z = x, four times over
  (y, grads), (y_xla, _) = (value_and_grads(i, name, x, w, b) for i in ("mosaic", "xla"))
  for v in (y, *grads):
    assert np.all(np.isfinite(np.asarray(v, np.float32)))
  np.testing.assert_allclose(
    np.asarray(y, np.float32), np.asarray(y_xla, np.float32), **TOL[jnp.bfloat16]
  )
  # db against the float64 sum of dz = g * act'(residual), from the residual the kernels keep (y,
  # or z = x four times over, exactly): one rounding of db apart. (XLA's db sums the bf16-rounded
  # dz: near y = -1.758 selu's y + 1.758 keeps few bits, and the two differ by 8 roundings there.)
  spec = jaxact.get_spec(name)
  params = {p.name: p.default for p in spec.params}
  g = jax.random.normal(jax.random.key(9), y.shape, jnp.float32).astype(y.dtype)  # as used
  if spec.residual == "output":
    d = spec.d_output(jnp.asarray(y, jnp.float32), **params)
  else:
    d = spec.derivative_from_input(jnp.tile(jnp.asarray(x, jnp.float32), (1, 4)), **params)
  want = np.sum(np.asarray(g, np.float64) * np.asarray(d, np.float64), axis=0)
  np.testing.assert_allclose(np.asarray(grads[2], np.float32), want, rtol=2**-7, atol=1e-3)
