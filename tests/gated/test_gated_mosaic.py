"""Tests of the gated units' Hopper forward kernel (``pallas_kernels.gated_mosaic``).

On CPU the kernel runs in Mosaic GPU's interpreter (warpgroups, shared memory, TMA and barriers
simulated; one CTA walking every tile): a, b and h against :func:`gated_forward_reference` (the
same roundings: one ulp apart where the float32 sums differ in order) and against the ``jax.nn``
composition, for silu and gelu as jaxact's spec table gives them to the kernels, over several
tiles in M and N and more K steps than pipeline stages (the ring wraps). Lowering for an abstract
H100 runs Mosaic GPU's compiler up to the point that checks the shared-memory budget; compiling
through jax's CUDA plugin (``tests/install_gpu_compiler.py``) goes on to ptxas.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from kernel_cases import MOSAIC, lowered_text
from pallas_kernels import Epilogue, _mosaic, gated_mosaic

from cases import representatives

JAX_NN = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu, "identity": None}


def operands(shape, dtype=jnp.bfloat16, seed=0, biases=(True, True)):
  """x (batch..., K), w_gate and w_up (K, N), b_gate and b_up (N,): a and b of unit size."""
  *batch, k, n = shape
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (*batch, k), jnp.float32)
  w_gate, w_up = (jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k) for key in keys[1:3])
  b_gate, b_up = (
    jax.random.normal(key, (n,), jnp.float32) if present else None
    for key, present in zip(keys[3:], biases, strict=True)
  )
  return tuple(None if v is None else v.astype(dtype) for v in (x, w_gate, w_up, b_gate, b_up))


def f32(v):
  return np.asarray(v, np.float32)


def ulps(dtype) -> float:
  """Relative spacing of `dtype` at most (2^-7 for bfloat16: one rounding either way)."""
  return float(jnp.finfo(dtype).eps)


def jax_nn_composition(name, x, w_gate, w_up, b_gate, b_up):
  """``act(x @ w_gate + b_gate) * (x @ w_up + b_up)`` as a jax user writes it."""
  act = JAX_NN[name] or (lambda v: v)
  a = x @ w_gate + (0 if b_gate is None else b_gate)
  b = x @ w_up + (0 if b_up is None else b_up)
  return a, b, act(a) * b


def check(name, ops, keep_ab, tiles=None):
  """Run the kernel in interpret mode and compare with the reference and with jax.nn."""
  x, *_ = ops
  dtype = x.dtype
  ep = Epilogue(None, None, "none") if name == "identity" else support.epilogue(name)
  got = gated_mosaic.gated_forward(
    *ops, epilogue=ep, num_sms=1, keep_ab=keep_ab, tiles=tiles, interpret=True
  )
  want = gated_mosaic.gated_forward_reference(*ops, fn=ep.fn, keep_ab=keep_ab)
  composed = jax_nn_composition(name, *ops)
  if not keep_ab:
    assert got[0] is None and got[1] is None
  for v_got, v_want, v_nn, label in zip(got, want, composed, "abh", strict=True):
    if v_got is None:
      continue
    assert v_got.dtype == dtype and v_got.shape == v_nn.shape, label
    # The reference rounds the same float32 values once: apart by a rounding where the kernel's
    # sums (in another order) land on the other side of a rounding boundary. h moves with a's
    # rounding by act'(a) * b: about two of its own.
    scale = {"a": 1, "b": 1, "h": 3}[label]
    np.testing.assert_allclose(
      f32(v_got), f32(v_want), rtol=scale * ulps(dtype), atol=scale * ulps(dtype), err_msg=label
    )
    # jax.nn rounds x @ w, the sum with the bias, act(a) and the product each to the dtype.
    np.testing.assert_allclose(
      f32(v_got), f32(v_nn), rtol=4 * ulps(dtype), atol=6e-2, err_msg=label
    )
  if keep_ab:  # h is the function of the a and b written that a backward pass recomputes it as
    a, b, h = (jnp.asarray(v, jnp.float32) for v in got)
    h_of_ab = ((a if ep.fn is None else ep.fn(a)) * b).astype(dtype)
    np.testing.assert_allclose(f32(h), f32(h_of_ab), rtol=ulps(dtype), atol=0)
  return got


# ---------------------------------------------------------------------- interpret: the kernel


def test_silu_a_b_and_h_over_several_tiles():
  """Two CTA tiles along N, four K steps through the three-stage ring of the a, b and h
  configuration (64 x 32 epilogue sub-tiles)."""
  t = gated_mosaic.gated_block_config((128, 256, 256), jnp.bfloat16, keep_ab=True)
  assert (t.stages, t.epi_m, t.epi_n) == (3, 64, 32)
  check("silu", operands((128, 256, 256), seed=1), keep_ab=True)


def test_gelu_h_alone():
  """h alone (the 64 x 64-epilogue configuration), two tiles along N."""
  check("gelu", operands((128, 128, 256), seed=2), keep_ab=False)


_EXHAUSTIVE = {
  # name: (activation, shape, dtype, biases, keep_ab, tiles)
  "f16-silu-abh": ("silu", (256, 256, 256), jnp.float16, (True, True), True, None),
  "bf16-gelu-abh-batch": ("gelu", (2, 64, 128, 256), jnp.bfloat16, (True, True), True, None),
  "bf16-relu-no-biases": ("relu", (128, 128, 384), jnp.bfloat16, (False, False), True, None),
  "bf16-silu-up-bias-only": ("silu", (128, 128, 128), jnp.bfloat16, (False, True), False, None),
  "f16-identity-h": ("identity", (256, 192, 128), jnp.float16, (True, True), False, None),
  "bf16-silu-2x2-tiles": ("silu", (256, 256, 256), jnp.bfloat16, (True, True), True, None),
  "bf16-silu-two-stages-snake": (
    "silu",
    (384, 320, 384),
    jnp.bfloat16,
    (True, True),
    True,
    gated_mosaic.GatedTiles(stages=2, epi_n=32, snake_width=2),
  ),
}


@pytest.mark.parametrize("case", representatives(list(_EXHAUSTIVE), set()))
def test_kernel_variants_match_reference(case):
  name, shape, dtype, biases, keep_ab, tiles = _EXHAUSTIVE[case]
  check(name, operands(shape, dtype, seed=3, biases=biases), keep_ab, tiles)


@pytest.mark.exhaustive
def test_a_zero_gate_times_an_infinite_up_projection_is_zero():
  """h = 0 where act(a) = 0 and b overflowed (as jaxact's gated path), not NaN."""
  x, w_gate, w_up, _, _ = operands((128, 64, 128), seed=4)
  b_gate = jnp.full((128,), -1e4, jnp.bfloat16)  # relu(a) = 0 everywhere
  b_up = jnp.full((128,), jnp.inf, jnp.bfloat16)
  relu = Epilogue(fn=lambda z: jnp.maximum(z, 0.0), derivative=None, residual="output")
  _, b, h = gated_mosaic.gated_forward(
    x, w_gate, w_up, b_gate, b_up, epilogue=relu, num_sms=1, interpret=True
  )
  assert np.all(np.isinf(f32(b))) and np.all(f32(h) == 0)


# ---------------------------------------------------------------------- contract and validation


def test_block_config_fits_the_shared_memory():
  """h alone: four stages and 64 x 64 sub-tiles; a, b and h: three stages and 64 x 32 (at 64 x 64
  neither four nor three stages fit beside the three outputs' slots); no more stages than K
  steps. Every choice within Hopper's 227 KiB."""
  for keep_ab, (stages, epi_n) in ((False, (4, 64)), (True, (3, 32))):
    t = gated_mosaic.gated_block_config((8192, 4096, 14336), jnp.bfloat16, keep_ab=keep_ab)
    assert (t.stages, t.epi_n) == (stages, epi_n)
    assert t.smem_bytes(2, 3 if keep_ab else 1) <= _mosaic.HOPPER_SMEM
    wider = gated_mosaic.GatedTiles(stages=3, epi_n=64)
    assert not keep_ab or wider.smem_bytes(2, 3) > _mosaic.HOPPER_SMEM
  assert gated_mosaic.gated_block_config((128, 128, 128), jnp.float16).stages == 2


def test_bad_operands_are_refused_with_reasons():
  x, w_gate, w_up, b_gate, b_up = operands((128, 64, 128))
  silu = support.epilogue("silu")
  run = lambda *ops, **kw: gated_mosaic.gated_forward(*ops, epilogue=silu, num_sms=1, **kw)
  with pytest.raises(ValueError, match=r"w_up.shape=\(64, 256\)"):
    run(x, w_gate, jnp.zeros((64, 256), x.dtype), b_gate, b_up)
  with pytest.raises(ValueError, match=r"`b_up` must have shape \(128,\); got \(64,\)"):
    run(x, w_gate, w_up, b_gate, b_up[:64])
  with pytest.raises(TypeError, match="must share one dtype"):
    run(x, w_gate.astype(jnp.float16), w_up, b_gate, b_up)
  with pytest.raises(TypeError, match="accepted: bfloat16, float16"):
    run(*(v.astype(jnp.float32) for v in (x, w_gate, w_up, b_gate, b_up)))
  with pytest.raises(ValueError, match="M=64 is not a multiple of 128"):
    run(x[:64], w_gate, w_up, b_gate, b_up)
  with pytest.raises(ValueError, match="N=64 is not a multiple of 128"):
    run(x, w_gate[:, :64], w_up[:, :64], None, None)
  with pytest.raises(ValueError, match="K=32 is not a multiple of 64"):
    run(x[:, :32], w_gate[:32], w_up[:32], b_gate, b_up)
  erf_inv = Epilogue(fn=jax.lax.erf_inv, derivative=None, residual="input")
  t = gated_mosaic.GatedTiles()
  assert "erf_inv" in gated_mosaic.gated_unsupported((128, 64, 128), jnp.bfloat16, erf_inv, t)
  assert gated_mosaic.gated_unsupported((128, 64, 128), jnp.bfloat16, silu) is None
  assert "N=200" in gated_mosaic.gated_unsupported((128, 64, 200), jnp.float16, silu)


# ---------------------------------------------------------------------- an H100, no GPU


@pytest.fixture
def _float32_defaults():
  """Lower and compile as a GPU user's program is (64-bit index arithmetic changes registers)."""
  with jax.enable_x64(False):
    yield


def kernel_shapes(m, k, n, dtype=jnp.bfloat16):
  return [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (k, n), (n,), (n,))]


def forward(name, keep_ab, tiles=None):
  ep = support.epilogue(name)

  def fwd(*ops):
    return gated_mosaic.gated_forward(*ops, epilogue=ep, num_sms=132, keep_ab=keep_ab, tiles=tiles)

  return fwd


@pytest.mark.usefixtures("_float32_defaults")
@pytest.mark.parametrize(
  "name,keep_ab",
  representatives(
    [("silu", True), ("gelu", False), ("gelu", True), ("silu", False)],
    {"gelu-h"},  # test_compiles_for_h100 lowers silu-abh
    ids=["silu-abh", "gelu-h", "gelu-abh", "silu-h"],
  ),
)
def test_lowers_for_h100(name, keep_ab):
  """Both configurations of gated_block_config, at a layer's shape: one Mosaic GPU kernel."""
  text = lowered_text(forward(name, keep_ab), kernel_shapes(4096, 4096, 14336))
  assert len(re.findall(rf"custom_call @{MOSAIC}\(", text)) == 1


@pytest.mark.usefixtures("_float32_defaults")
def test_a_configuration_over_the_shared_memory_budget_fails_to_lower():
  """The budget is checked: four stages with 64 x 64 slots for a, b and h want 264 KiB."""
  t = gated_mosaic.GatedTiles(stages=4, epi_n=64)
  assert t.smem_bytes(2, 3) > _mosaic.HOPPER_SMEM
  with pytest.raises(ValueError, match="shared memory"):
    lowered_text(forward("silu", True, t), kernel_shapes(512, 512, 512))


@pytest.mark.usefixtures("_float32_defaults")
@pytest.mark.parametrize(
  "name,keep_ab",
  representatives([("silu", True), ("gelu", False)], {"silu-abh"}, ids=["silu-abh", "gelu-h"]),
)
def test_compiles_for_h100(name, keep_ab):
  """Through XLA's GPU compiler and ptxas (jax's CUDA plugin, no GPU)."""
  try:
    support.device(support.H100)
  except support.Unavailable as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI"):
      raise RuntimeError(f"CI installs jax's CUDA compiler, yet: {e}") from e
    pytest.skip(f"cannot compile for a GPU here: {e}")
  compiled = support.compile_for(forward(name, keep_ab), kernel_shapes(512, 512, 512))
  assert support.custom_calls(compiled) == {MOSAIC}
