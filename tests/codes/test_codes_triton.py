"""Derivative codes (``residual_bits``) in the Triton kernels, against the XLA path.

The dense forward kernel and the convolution epilogue kernel write the code of ``act'(z)`` from
registers beside ``y``, packed as :meth:`jaxact._src.codes.code.Code.pack` packs the last axis,
and the backward kernels decode it. On CPU the kernels run in interpret mode: the outputs, the
bytes kept for the backward pass (read from the pullback's residuals) and the gradients are
compared with ``implementation="xla"``. The inputs are small multiples of powers of two, so that the
pre-activation is exact in every dtype and both paths encode the same ``z``: the kept bytes must be
identical, not close. Features that do not fill whole bytes decline the kernels. Compiled for an
abstract H100 and A100 (XLA's GPU compiler, register-spill check): one representative by default,
the rest under ``pytest -m exhaustive``.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import support
from code_cases import coded, conv_args, dense_args, run
from jaxact._src.codes import code as codes
from kernel_cases import MOSAIC, TRITON, lowered_text
from pallas_kernels import DerivativeCode, Epilogue, bias_act_triton, dense_triton

from cases import representatives

# Same z, same codes: the outputs agree to the activation's evaluation, the gradients to the
# summation order of the backward products (and, in bfloat16, dz's rounding before them).
TOL = {
  jnp.float32: dict(atol=2e-5, rtol=2e-5),
  jnp.bfloat16: dict(atol=5e-2, rtol=3e-2),
}
Y_TOL = {jnp.float32: dict(atol=1e-6, rtol=1e-6), jnp.bfloat16: dict(atol=0, rtol=0)}


def assert_matches_xla(op, name, bits, dtype, x, w, b, **kw):
  y, kept, grads = run("pallas", op, coded(name, bits), x, w, b, **kw)
  y_xla, kept_xla, grads_xla = run("xla", op, coded(name, bits), x, w, b, **kw)
  code = codes.get_code(name, (("approximate", True),) if name == "gelu" else (), bits)
  assert [k.shape for k in kept] == [code.packed_shape(y.shape)], (kept, y.shape)
  np.testing.assert_array_equal(np.asarray(kept[0]), np.asarray(kept_xla[0]))
  chex.assert_trees_all_equal_shapes_and_dtypes((y, grads), (y_xla, grads_xla))
  chex.assert_tree_all_finite((y, grads))
  up = lambda t: jax.tree.map(lambda v: np.asarray(v.astype(jnp.float32)), t)
  chex.assert_trees_all_close(up(y), up(y_xla), **Y_TOL[dtype])
  chex.assert_trees_all_close(up(grads), up(grads_xla), **TOL[dtype])


_CASES = list(itertools.product((8, 4, 2), (jnp.float32, jnp.bfloat16)))
_IDS = [f"{bits}-{jnp.dtype(d).name}" for bits, d in _CASES]


# ------------------------------------------------------------------- interpret mode, values


@pytest.mark.parametrize("bits,dtype", representatives(_CASES, {"4-bfloat16"}, ids=_IDS))
def test_dense_keeps_the_xla_paths_bytes(bits, dtype):
  # 37 rows: a ragged row tile; 24 features: 12 bytes a row at 4 bits, 6 at 2, in one ragged
  # column tile of 64.
  x, w, b = dense_args((37, 16, 24), dtype)
  assert_matches_xla(jaxact.dense_bias_act, "gelu", bits, dtype, x, w, b)


@pytest.mark.parametrize(
  "name,bits", representatives([("silu", 2), ("mish", 8)], set(), ids=["silu-2", "mish-8"])
)
def test_dense_several_tiles_and_batch_dimensions(name, bits):
  # 2 x 65 rows, 136 features: two tiles each way, both ragged; a K of 32 in two steps.
  x, w, b = dense_args((2, 65, 32, 136), jnp.float32)
  assert_matches_xla(jaxact.dense_bias_act, name, bits, jnp.float32, x, w, b)


@pytest.mark.parametrize("bits,dtype", representatives(_CASES, {"2-float32"}, ids=_IDS))
def test_conv_keeps_the_xla_paths_bytes(bits, dtype):
  # 72 rows of 16 channels; fan-in 3 x 3 x 3.
  x, w, b = conv_args((2, 6, 6, 3), (3, 3, 3, 16), dtype)
  assert_matches_xla(jaxact.conv_bias_act, "gelu", bits, dtype, x, w, b, padding="SAME")


def test_features_that_do_not_fill_bytes_decline_the_kernels():
  """22 features: whole bytes of 4-bit codes (2 a byte), not of 2-bit ones (4 a byte). Asked for by
  name the kernels raise, saying why; chosen automatically (lowered for CUDA) the call is XLA's."""
  x, w, b = dense_args((8, 16, 22), jnp.float32)
  with pytest.raises(
    NotImplementedError,
    match=r"residual_bits=2: 2-bit codes are packed 4 to a byte along the features, and 22 "
    r"features are not a multiple of 4",
  ):
    jaxact.dense_bias_act(x, w, b, activation=coded("gelu", 2), implementation="pallas")
  gelu, code = support.epilogue("gelu"), codes.get_code("gelu", (("approximate", True),), 2)
  ep = Epilogue(gelu.fn, gelu.derivative, "code", DerivativeCode(2, code.boundaries, code.levels))
  with pytest.raises(ValueError, match=r"pallas_kernels.dense_triton: 2-bit codes .* 22 features"):
    dense_triton.dense_bias_act_fwd(x, w, b, epilogue=ep, interpret=True)
  with pytest.raises(
    ValueError, match=r"pallas_kernels.bias_act_triton: 2-bit codes .* 22 features"
  ):
    bias_act_triton.bias_act_fwd(x @ w, b, epilogue=ep, interpret=True)
  step = support.train_step(coded("gelu", 2), None)
  shapes = support.layer_shapes(64, 32, 22, jnp.bfloat16)
  assert TRITON not in lowered_text(step, shapes, "cuda", "A100")


# The Hopper (Mosaic GPU) kernels' codes: tests/codes/test_codes_mosaic.py.


# --------------------------------------------------------------------------- compiled for GPUs


def _compiler_or_skip():
  try:
    support.device(support.H100)
  except support.Unavailable as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"cannot compile for a GPU here: {e}")


@pytest.fixture
def float32_defaults():
  """Compile as a GPU user's program is compiled: without the suite's 64-bit mode."""
  with jax.enable_x64(False):
    yield


_COMPILED = [
  *itertools.product(("A100", "H100"), ("dense", "conv"), (8, 4, 2)),
  ("H100", "mosaic", 8),
]


# By default the case that spilled before the coded forward took 64-row tiles: 8-bit gelu, whose
# forward evaluates the activation and its derivative, at an A100's 128 x 128 tile.
@pytest.mark.parametrize(
  "gpu,op,bits",
  representatives(_COMPILED, {"A100-dense-8"}, ids=["-".join(map(str, c)) for c in _COMPILED]),
)
def test_coded_kernels_compile_without_spilling(gpu, op, bits, float32_defaults):
  """The training step of a bfloat16 layer with 8-, 4- or 2-bit gelu codes: the Triton kernels
  (dense: the widest tiles, Hopper's 128 x 256 included; conv: the epilogue's 256-channel tile)
  compile for the GPU with no register spilled; on an H100 ``None`` compiles the Mosaic GPU
  forward with an 8-bit code (and XLA's backward)."""
  _compiler_or_skip()
  if op == "conv":
    shapes = [
      jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4, 16, 16, 32), (3, 3, 32, 256), (256,))
    ]
  else:
    shapes = support.layer_shapes(512, 512, 512, jnp.bfloat16)
  impl = None if op == "mosaic" else "pallas"
  step = support.train_step(coded("gelu", bits), impl, conv=op == "conv")
  compiled = support.compile_for(step, shapes, support.GPUS[gpu], support.NO_SPILLS)
  text = compiled.as_text()
  want = {"dense": (3, 0), "conv": (2, 0), "mosaic": (0, 1)}[op]
  assert (text.count('"__gpu$xla.gpu.triton"'), text.count(f'"{MOSAIC}"')) == want
