"""Derivative codes (``residual_bits``) in the Hopper kernels (``pallas_kernels.dense_mosaic``,
``hopper_bwd``), against the XLA path.

The forward writes 8-bit codes as they are and packs 4- and 2-bit ones with a small wgmma (codes
times a constant packing matrix); the backward kernels read the bytes and spread them over their
columns the same way before decoding ``act'``. On CPU the kernels run in Mosaic GPU's interpreter:
the kept bytes must be identical to XLA's (the inputs are small multiples of powers of two, so both
paths encode the same pre-activation), the backward's dx, dw and db within one rounding of a
float32 reference from the same decoded ``act'``. Lowered for an abstract H100, every code width
takes the Mosaic GPU forward and both backward kernels; compiled through ptxas (jax's CUDA plugin)
by default for one width, every width under ``pytest -m exhaustive``.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import support
from code_cases import coded, coded_rule, dense_args, run
from jaxact._src.activations import api as activations
from jaxact._src.activations import resolve
from kernel_cases import MOSAIC, TRITON, args, backward_reference, lowered_text
from pallas_kernels import Epilogue, _mosaic, dense_mosaic, dense_mosaic_bwd

from cases import representatives

BITS = [8, 4, 2]
_IDS = [f"{b}-bit" for b in BITS]


def epilogue(bits: int, name: str = "gelu") -> Epilogue:
  return resolve.epilogue(coded_rule(name, bits))


def decoded(bits: int, kept, shape, name: str = "gelu"):
  """``act'`` as the kept bytes give it, float32 (XLA's unpack and decode)."""
  code = coded_rule(name, bits).code
  return code.decode(code.unpack(kept, shape), jnp.float32)


# ---------------------------------------------------------------------- interpret: the kernels


@pytest.mark.parametrize("bits", representatives(BITS, {"4-bit"}, _IDS))
def test_forward_writes_the_xla_paths_bytes(bits):
  """A CTA tile of 128 x 256 (two warpgroups, each packing its 64 x 64 sub-tiles): the kept bytes
  are XLA's encode + pack of the same float32 z, byte for byte; y is gelu(z) rounded once."""
  rule = coded_rule("gelu", bits)
  x, w, b = dense_args((128, 64, 256), jnp.bfloat16)
  y, kept = dense_mosaic.hopper_dense_bias_act_fwd(
    x, w, b, epilogue=epilogue(bits), num_sms=1, interpret=True
  )
  z = x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32)  # exact
  want = activations.encode(rule, z)
  assert kept.dtype == jnp.uint8 and kept.shape == want.shape == (128, 256 * bits // 8)
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(want))
  want_y = jax.nn.gelu(z).astype(jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32), atol=1e-2)


_BWD_CASES = [(2, "default"), (4, "default"), (8, "default"), (4, "one_warpgroup")]
_TILINGS = {
  "default": None,
  "one_warpgroup": dense_mosaic_bwd.HopperBwdTiles(
    wgs=1, dx_m=128, dx_k=128, dx_stages=3, dw_stages=3
  ),
}


@pytest.mark.parametrize(
  "bits,tiling",
  representatives(_BWD_CASES, {"2-default"}, ids=[f"{b}-{t}" for b, t in _BWD_CASES]),
)
def test_backward_kernels_decode_the_bytes(bits, tiling):
  """dx, dw and db from g and the packed code (two CTAs along M, two steps along N): one bf16
  rounding from float32 products of the same bf16 dz = g * act'(decoded)."""
  m, k, n = 256, 128, 512
  x, w, _ = args((m, k, n), jnp.bfloat16, seed=7)
  g = jax.random.normal(jax.random.key(8), (m, n), jnp.float32).astype(jnp.bfloat16)
  z = jnp.dot(x, w, preferred_element_type=jnp.float32)
  kept = activations.encode(coded_rule("gelu", bits), z)
  dx, dw, db = dense_mosaic_bwd.hopper_dense_bias_act_bwd(
    x, w, kept, g, epilogue=epilogue(bits), has_bias=True, tiles=_TILINGS[tiling], interpret=True
  )
  want = backward_reference(x, w, decoded(bits, kept, (m, n)), g, lambda d: d)
  for got, ref in zip((dx, dw, db), want, strict=True):
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=8e-3 * scale, rtol=8e-3)


# ---------------------------------------------------------------------- interpret: through jaxact


# By default the kernels' own tests above run the same forward (4-bit bytes against XLA's, byte
# for byte) and backward (decoding 2-bit bytes over two CTAs) in the interpreter.
@pytest.mark.exhaustive
@pytest.mark.parametrize("bits", representatives(BITS, {"4-bit"}, _IDS))
def test_mosaic_matches_xla(bits):
  """``implementation="mosaic"`` (Hopper forward and backward kernels, interpreted) against
  ``"xla"`` with the same code: the kept bytes are identical, y too (the same z); the gradients
  within one bfloat16 rounding of float32 products of the same dz (XLA's own dw, a dot over two
  batch axes on the CPU, rounds more: 0.5 against the kernels' 0.06 at |dw| = 24 here)."""
  x, w, b = dense_args((2, 64, 64, 256), jnp.bfloat16)  # M = 128 over two batch axes
  y, kept, grads = run("mosaic", jaxact.dense_bias_act, coded("gelu", bits), x, w, b)
  y_xla, kept_xla, grads_xla = run("xla", jaxact.dense_bias_act, coded("gelu", bits), x, w, b)
  assert [k.shape for k in kept] == [(2, 64, 256 * bits // 8)] == [k.shape for k in kept_xla]
  np.testing.assert_array_equal(np.asarray(kept[0]), np.asarray(kept_xla[0]))
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_xla, np.float32))
  g = jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(y.dtype)  # run()'s
  rows = (x.reshape(128, 64), w, decoded(bits, kept[0], y.shape).reshape(128, 256))
  want = backward_reference(*rows, g.reshape(128, 256), lambda d: d)
  for got, xla, ref in zip(grads, grads_xla, want, strict=True):
    assert got.dtype == xla.dtype and got.shape == xla.shape
    scale = float(jnp.max(jnp.abs(ref)))
    got = np.asarray(got, np.float32).reshape(ref.shape)
    np.testing.assert_allclose(got, ref, atol=2**-8 * scale, rtol=2**-8)


# ---------------------------------------------------------------------- what they take


def test_codes_that_do_not_fill_bytes_are_refused_with_the_reason():
  """Features that are not a multiple of the code's per-byte count are refused by name before any
  tile check; sub-tiles narrower than 16 bytes of packed codes (TMA's and wgmma's least) too."""
  x, w, b = dense_args((128, 64, 258), jnp.bfloat16)
  with pytest.raises(
    NotImplementedError,
    match=r"implementation='mosaic'.*residual_bits=2: 2-bit codes are packed 4 to a byte along the "
    r"features, and 258 features are not a multiple of 4",
  ):
    jaxact.dense_bias_act(x, w, b, activation=coded("gelu", 2), implementation="mosaic")
  narrow = dense_mosaic.HopperTiles(epi_n=32)
  why = dense_mosaic.hopper_unsupported(
    (128, 64, 256), jnp.bfloat16, jnp.bfloat16, epilogue(2), narrow
  )
  assert (
    why == "2-bit codes in sub-tiles of 32 columns (8 bytes: TMA and the packing wgmma need 16)"
  )
  narrow = dense_mosaic_bwd.HopperBwdTiles(dx_n=32)
  why = dense_mosaic_bwd.hopper_bwd_unsupported((256, 256, 256), jnp.bfloat16, epilogue(2), narrow)
  assert "2-bit codes in blocks of 32 columns (8 bytes" in why
  assert (
    dense_mosaic_bwd.hopper_bwd_unsupported((256, 256, 256), jnp.bfloat16, epilogue(4), narrow)
    is None
  )
  x, w, _ = args((128, 64, 256), jnp.bfloat16)
  g = jnp.ones((128, 256), jnp.bfloat16)
  bwd = functools.partial(
    dense_mosaic_bwd.hopper_dense_bias_act_bwd, epilogue=epilogue(2), has_bias=True
  )
  with pytest.raises(
    ValueError, match=r"needs the residual of shape \(128, 64\); got \(128, 256\)"
  ):
    bwd(x, w, g.astype(jnp.uint8), g)
  with pytest.raises(TypeError, match="uint8 for a code"):
    bwd(x, w, g[:, :64], g)


@pytest.mark.parametrize("bits", BITS, ids=_IDS)
def test_a_smaller_residual_deepens_the_backward_pipelines(bits):
  """The code's tile is 1 / per_byte bytes an element instead of the residual's 2: dw's pipeline
  goes from 2 stages to 3 (dx stays at 3), within Hopper's shared memory."""
  shape = (8192, 4096, 4096)
  code = epilogue(bits).code
  t = dense_mosaic_bwd.hopper_bwd_tiles(shape, True, code)
  assert (t.dx_stages, t.dw_stages) == (3, 3)
  assert dense_mosaic_bwd.hopper_bwd_tiles(shape, True) == dense_mosaic_bwd.HopperBwdTiles(
    dx_stages=3
  )
  assert max(t.smem_bytes(2, True, code)) <= _mosaic.HOPPER_SMEM
  deeper = dense_mosaic_bwd.HopperBwdTiles(dx_stages=4, dw_stages=4)
  assert min(deeper.smem_bytes(2, True, code)) > _mosaic.HOPPER_SMEM


# ---------------------------------------------------------------------- an H100, no GPU


def mosaic_calls(text: str) -> int:
  return len(re.findall(rf"custom_call @{MOSAIC}\(", text))


@pytest.fixture
def _float32_defaults():
  """Lower and compile as a GPU user's program is (64-bit index arithmetic changes registers)."""
  with jax.enable_x64(False):
    yield


@pytest.mark.exhaustive
@pytest.mark.usefixtures("_float32_defaults")
@pytest.mark.parametrize("bits", representatives(BITS, {"4-bit"}, _IDS))
def test_every_code_lowers_for_h100(bits):
  """A training step at a layer's shape: "mosaic" runs the forward and both backward kernels
  (and db's Triton pass)."""
  shapes = support.layer_shapes(8192, 4096, 4096, jnp.bfloat16)
  text = lowered_text(support.train_step(coded("gelu", bits), "mosaic"), shapes)
  assert mosaic_calls(text) == 3 and text.count(f"custom_call @{TRITON}(") == 1


@pytest.mark.usefixtures("_float32_defaults")
@pytest.mark.parametrize("bits", representatives(BITS, {"8-bit", "4-bit"}, _IDS))
def test_none_on_hopper_runs_only_the_timed_coded_forward(bits):
  """None on an H100: an 8-bit code's layer takes the Mosaic GPU forward (writing the code) and
  XLA's backward; 4- and 2-bit codes, whose packing forward is untimed, stay on XLA."""
  shapes = support.layer_shapes(256, 128, 256, jnp.bfloat16)
  text = lowered_text(support.train_step(coded("gelu", bits), None), shapes, "cuda", "H100")
  assert mosaic_calls(text) == (1 if bits == 8 else 0) and TRITON not in text


@pytest.mark.exhaustive
@pytest.mark.usefixtures("_float32_defaults")
@pytest.mark.parametrize("bits", representatives(BITS, {"2-bit"}, _IDS))
def test_the_coded_kernels_compile_for_h100(bits):
  """Through XLA's GPU compiler and ptxas (jax's CUDA plugin, no GPU): the forward and both
  backward kernels."""
  try:
    support.device(support.H100)
  except support.Unavailable as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI"):
      raise RuntimeError(f"CI installs jax's CUDA compiler, yet: {e}") from e
    pytest.skip(f"cannot compile for a GPU here: {e}")
  step = support.train_step(coded("gelu", bits), "mosaic")
  compiled = support.compile_for(step, support.layer_shapes(512, 512, 512))
  assert compiled.as_text().count(f'custom_call_target="{MOSAIC}"') == 3
