"""The ``codes`` section of ``python -m benchmarks gpu`` runs here before it runs on a GPU.

What the section checks and times is built in ``support.gpu_codes``. On CPU its
correctness check runs the kernels in interpret mode at small shapes (a kernel keeping other codes
than XLA's fails it), the epilogue kernels it times run against XLA's fusions of the same passes
with the bytes each is credited with counted by hand, and every function it times lowers for an
abstract H100 at the section's shapes with the kernels its row names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import MOSAIC, TRITON, lowered_text
from support import gpu_codes as gc
from support import layer_step

from cases import representatives

_IDS = [gc.label(b) for b in gc.BITS]

# ------------------------------------------------------------------------ the correctness check


_CHECKS = [
  ("dense", "pallas", "gelu", 4),
  ("conv", "pallas", "silu", 2),
  ("dense", "mosaic", "gelu", 8),
]


# The kernels' own tests compare them with XLA (tests/codes/test_codes_triton.py,
# tests/codes/test_codes_mosaic.py); these run the section's check on both layers' inputs.
@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "op,impl,name,bits",
  representatives(_CHECKS, {"dense-mosaic-gelu-8"}),
)
def test_the_check_passes_for_the_kernels(op, impl, name, bits):
  # The Hopper kernels' least tile: 128 rows, 256 features, 64 deep.
  if op == "dense":
    args = gc.exact_dense((128, 64, 256), jnp.bfloat16, 0)
  else:
    args = gc.exact_conv((2, 6, 6, 3), (3, 3, 3, 16), jnp.bfloat16, 0)
  c = gc.check(op, impl, name, bits, args)
  assert c.error is None and c.ok, c
  assert (c.y_diff, c.code_diff) == (0, 0)
  assert c.code_count == 128 * 256 if op == "dense" else 2 * 6 * 6 * 16


def test_the_check_fails_what_it_should():
  """A 4- or 2-bit code one step off fails (the same exact z crosses the same boundaries), an 8-bit
  one passes (act' through a GPU's exp may round across a step), two steps fail; y two epsilons
  off and a gradient 5% off fail; and inputs whose pre-activation is not exact are refused."""
  base = dict(op="dense", impl="pallas", name="gelu", shape=(), dtype="bfloat16", errs=(0.0,) * 3)
  assert gc.Check(bits=8, code_step=1, **base).ok
  assert not gc.Check(bits=8, code_step=2, **base).ok
  assert not gc.Check(bits=4, code_step=1, **base).ok
  assert not gc.Check(bits=2, y_ulps=2.0, **base).ok
  assert not gc.Check(bits=2, **base | {"errs": (0.0, 0.05, 0.0)}).ok
  assert not gc.Check(bits=2, error="ValueError: no", **base).ok
  x, w, b, g = gc.exact_dense((4, 16, 8), jnp.bfloat16, 0)
  with pytest.raises(ValueError, match="not exact in bfloat16"):
    gc.check("dense", "pallas", "gelu", 4, (x, w, b + 2**-9, g))


# ------------------------------------------------------------------ the epilogue kernels alone


@pytest.mark.exhaustive
@pytest.mark.parametrize("bits", representatives(gc.BITS, {"exact (z)", "4-bit"}, _IDS))
def test_epilogue_passes_match_xla_and_count_their_bytes(bits):
  """200 rows of 32 channels (default tiles of 128 x 32: two programs, one ragged)."""
  rows, c = 200, 32
  fwd, bwd = gc.epilogue_passes("gelu", bits, rows, c, interpret=True)
  args = gc.random_args(fwd.args, 0)
  (y, kept), (y_x, kept_x) = fwd.kernel(*args), fwd.xla(*args)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_x, np.float32))
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(kept_x))
  g = gc.random_args(bwd.args[:1], 1)[0]
  got, want = bwd.kernel(g, kept), bwd.xla(g, kept)
  for a, r in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(r, np.float32), rtol=1e-2)

  per_element = 2 if bits is None else bits / 8  # z in bfloat16, or the packed code
  arrays = 2 * rows * c * 2 + rows * c * per_element  # z (g) read, y (dz) written; the residual
  assert fwd.bytes == fwd.xla_bytes == arrays + c * 2  # b read
  partials = 2 * c * 4  # a row of float32 sums a program, written and read back
  assert bwd.xla_bytes == arrays + c * 4  # db written
  assert bwd.bytes == arrays + c * 4 + 2 * partials


# ------------------------------------------------------------------ an H100, at the section's shape


@pytest.fixture
def _float32_defaults():
  with jax.enable_x64(False):
    yield


def _kernels(text: str) -> tuple[int, int]:
  return text.count(f"custom_call @{TRITON}("), text.count(f"custom_call @{MOSAIC}(")


@pytest.mark.exhaustive
@pytest.mark.usefixtures("_float32_defaults")
@pytest.mark.parametrize("bits", representatives(gc.BITS, {"2-bit"}, _IDS))
def test_every_timed_function_lowers_for_an_h100(bits):
  """benchmarks.gpu_conv's conv layer (its epilogue: 128 x 56 x 56 rows of 256 channels) and
  the (8192, 4096, 4096) dense layer, as benchmarks.gpu_codes times them."""
  rows, c = 128 * 56 * 56, 256
  for p in gc.epilogue_passes("gelu", bits, rows, c):
    assert _kernels(lowered_text(p.kernel, p.args)) == (1, 0), p.name
    assert _kernels(lowered_text(p.xla, p.args)) == (0, 0), p.name
  dense = (8192, 4096, 4096)
  xwb = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((8192, 4096), (4096, 4096), (4096,))]
  assert gc.hopper_unsupported("gelu", bits, dense) is None
  assert _kernels(lowered_text(gc.hopper_forward("gelu", bits, num_sms=132), xwb)) == (0, 1)
  conv = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16)
    for s in ((128, 56, 56, 256), (3, 3, 256, 256), (256,), (128, 56, 56, 256))
  ]
  g = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
  # Kernels in the step (forward, backward): Triton dense: forward, dx, dw + db; conv: the
  # epilogue's forward and backward; "mosaic": forward, dx, dw and db's Triton pass. None on an
  # H100: dense layers keeping z or an 8-bit code take the Mosaic GPU forward, others XLA.
  want = {
    ("dense", "xla"): lambda b: (0, 0),
    ("dense", None): lambda b: (0, 1 if b in (None, 8) else 0),
    ("dense", "pallas"): lambda b: (3, 0),
    ("dense", "mosaic"): lambda b: (1, 3),
    ("conv", "xla"): lambda b: (0, 0),
    ("conv", None): lambda b: (2, 0),
    ("conv", "pallas"): lambda b: (2, 0),
  }
  for (op, impl), kernels in want.items():
    step = layer_step(gc.layer_fn(op, "gelu", bits, impl))
    text = lowered_text(step, [*xwb, g] if op == "dense" else conv)
    assert _kernels(text) == kernels(bits), (op, impl)
