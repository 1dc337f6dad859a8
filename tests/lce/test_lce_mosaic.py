"""The Hopper (Mosaic GPU) forward kernel of the linear cross-entropy (``lce_hopper``): in Mosaic
GPU's interpreter against its jnp reference and a float64 one, through
``jaxact.linear_cross_entropy(implementation="mosaic")`` against the XLA path, its refusals, and
compiled for an H100 at the issue's size without a (tokens x vocabulary) buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import support
from jaxact._src.lce import plan as lce_plan
from kernel_cases import lowered_text
from pallas_kernels import lce_mosaic, lce_mosaic_bwd


def _inputs(t, d, v, dtype=jnp.bfloat16, *, masked=True, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (t, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (d, v), jnp.float32) * 3 / d**0.5).astype(dtype)
  b = jax.random.normal(k[2], (v,), jnp.float32)
  if masked:
    b = b.at[::7].set(-jnp.inf)  # a masked vocabulary
  labels = jax.random.randint(k[3], (t,), -3, v + 3, jnp.int32)  # some outside [0, V)
  return x, w, b, labels


def _float64(x, w, b, labels, soft_cap):
  """The statistics by float64 numpy from the same 16-bit operands."""
  z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  if b is not None:
    z = z + np.asarray(b, np.float64)
  with np.errstate(invalid="ignore"):
    s = z if soft_cap is None else np.where(z == -np.inf, -np.inf, soft_cap * np.tanh(z / soft_cap))
  top = np.maximum(s.max(1, keepdims=True), np.finfo(np.float32).min)
  se = np.exp(s - top).sum(1)
  v = w.shape[1]
  labels = np.asarray(labels)
  inside = (labels >= 0) & (labels < v)
  sy = np.where(inside, s[np.arange(len(labels)), np.clip(labels, 0, v - 1)], 0.0)
  gap = top[:, 0] - np.where(np.isfinite(s), s, 0.0).sum(1) / v  # max - mean (masked count 0)
  return top[:, 0], se, sy, gap


def _close(got, want, tol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  same_inf = np.isinf(want) & (got == want)
  np.testing.assert_allclose(np.where(same_inf, 0, got), np.where(same_inf, 0, want), **tol)


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  ("shape", "dtype", "soft_cap", "bias"),
  [
    ((128, 128, 512), jnp.bfloat16, None, True),
    ((256, 64, 1024), jnp.float16, 5.0, False),  # two token tiles, four vocabulary steps
    pytest.param((128, 256, 256), jnp.bfloat16, 30.0, True, marks=pytest.mark.exhaustive),
  ],
  ids=["bf16-bias", "f16-cap-tiles", "bf16-cap-bias"],
)
def test_forward_kernel_matches_its_reference_and_float64(shape, dtype, soft_cap, bias):
  x, w, b, labels = _inputs(*shape, dtype, masked=bias)
  b = b if bias else None
  got = lce_mosaic.lce_fwd(x, w, b, labels, soft_cap=soft_cap, want_mean=True, interpret=True)
  ref = lce_mosaic.lce_reference(x, w, b, labels, soft_cap=soft_cap, want_mean=True)
  for g, r in zip(got, ref, strict=True):
    assert g.dtype == jnp.float32 and g.shape == (shape[0],)
    _close(g, r, dict(rtol=1e-5, atol=1e-5))
  for g, r in zip(got, _float64(x, w, b, labels, soft_cap), strict=True):
    _close(g, r, dict(rtol=2e-5, atol=2e-5))
  assert not np.isnan(np.asarray(got)).any()


def test_rows_without_a_finite_logit_and_no_mean():
  x, w, b, labels = _inputs(128, 64, 256)
  b = b.at[:].set(-jnp.inf)  # every entry masked: a finite max and a sum of 0, never NaN
  m, se, sy, gap = lce_mosaic.lce_fwd(
    x, w, b, labels, soft_cap=None, want_mean=False, interpret=True
  )
  assert gap is None
  assert np.all(np.asarray(m) == np.finfo(np.float32).min) and np.all(np.asarray(se) == 0)
  inside = (labels >= 0) & (labels < 256)
  np.testing.assert_array_equal(np.asarray(sy)[np.asarray(inside)], -np.inf)
  np.testing.assert_array_equal(np.asarray(sy)[~np.asarray(inside)], 0.0)


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "options",
  [
    {},
    {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_soft_cap": 10.0},
    # T5X's full smoothing is optax's at V / (V - 1) > 1: a negative label term in the kernel
    {"label_smoothing": 1.0, "label_smoothing_style": "t5x", "weights": True},
  ],
  ids=["plain", "all-options", "t5x-weights"],
)
def test_jaxact_mosaic_equals_the_xla_path(options, monkeypatch):
  x, w, b, labels = _inputs(128, 128, 512)
  if options.get("weights"):
    options = {**options, "weights": jnp.linspace(0.0, 2.0, 128, dtype=jnp.float32)}
  b = b.astype(jnp.bfloat16)
  impossible = (labels < 0) | (labels >= 512) | (b[jnp.clip(labels, 0, 511)] == -jnp.inf)
  labels = jnp.where(impossible, 1, labels)
  calls = []
  kernel = lce_mosaic.lce_fwd
  monkeypatch.setattr(lce_mosaic, "lce_fwd", lambda *a, **k: calls.append(k) or kernel(*a, **k))
  bwd_calls, bwd = [], lce_mosaic_bwd.lce_bwd

  def spy(x, w, *a, **k):
    bwd_calls.append(dict(k, w=w))
    return bwd(x, w, *a, **k)

  monkeypatch.setattr(lce_mosaic_bwd, "lce_bwd", spy)

  def step(impl):
    def loss(x, w, b):
      return jaxact.linear_cross_entropy(x, w, labels, bias=b, implementation=impl, **options)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b)

  (l1, g1) = step("mosaic")
  assert calls and calls[0]["want_mean"] == ("label_smoothing" in options)  # the kernel ran
  assert bwd_calls  # the backward kernel formed G ...
  assert {c["w"].shape for c in bwd_calls} == {(128, 256)}  # ... a whole block of 256 columns
  (l2, g2) = step("xla")
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  # G is rounded to bfloat16 for the products on both paths; the kernel's float32 G may round to
  # the neighbouring bfloat16 (1 ulp, 2^-8 relative) where the XLA path's differs in its last bits.
  for a, c in zip(g1, g2, strict=True):
    a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
    assert np.linalg.norm(a - c) <= 2**-9 * np.linalg.norm(c)
    np.testing.assert_allclose(a, c, rtol=2**-7, atol=2**-8 * np.abs(c).max())


def _float64_dlogits(x, w, b, labels, g, *, smoothing, z_loss, soft_cap):
  """``d(sum_t g_t loss_t)/dz`` by float64 autodiff of the plain per-token loss (the caller's
  formula, independent of the kernels'), and its column sums."""
  v = w.shape[1]
  z = jnp.asarray(x, jnp.float64) @ jnp.asarray(w, jnp.float64)
  if b is not None:
    z = z + jnp.asarray(b, jnp.float64)
  valid = (labels >= 0) & (labels < v)

  def total(z):
    s = z
    if soft_cap is not None:
      s = jnp.where(z == -jnp.inf, -jnp.inf, soft_cap * jnp.tanh(z / soft_cap))
    lse = jax.nn.logsumexp(s, axis=1)
    sy = jnp.where(valid, jnp.take_along_axis(s, jnp.clip(labels, 0, v - 1)[:, None], 1)[:, 0], 0)
    mean = jnp.sum(jnp.where(jnp.isfinite(s), s, 0), 1) / v
    loss = lse - (1 - smoothing) * sy - smoothing * mean + z_loss * lse**2
    return jnp.sum(g * loss)

  grad = jax.grad(total)(z)
  return np.asarray(grad), np.asarray(grad).sum(0)


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  ("shape", "dtype", "options", "bias"),
  [
    ((128, 128, 512), jnp.bfloat16, dict(smoothing=0.1, z_loss=1e-3, soft_cap=None), True),
    ((256, 64, 512), jnp.float16, dict(smoothing=0.0, z_loss=0.0, soft_cap=5.0), False),
    pytest.param(
      (128, 64, 256),
      jnp.bfloat16,
      dict(smoothing=1.0, z_loss=0.0, soft_cap=30.0),
      True,
      marks=pytest.mark.exhaustive,
    ),
  ],
  ids=["bf16-smoothing-zloss-bias", "f16-cap-tiles", "bf16-uniform-only"],
)
def test_backward_kernel_matches_float64_autodiff(shape, dtype, options, bias):
  x, w, b, labels = _inputs(*shape, dtype, masked=bias)
  b = b if bias else None
  labels = jnp.where(labels % 5 == 0, labels, jnp.clip(labels, 0, shape[2] - 1))  # some invalid
  a, k, cap = options["smoothing"], options["z_loss"], options["soft_cap"]
  g = jax.random.normal(jax.random.key(9), (shape[0],), jnp.float32)  # any cotangent a token
  m, se = lce_mosaic.lce_reference(x, w, b, labels, soft_cap=cap, want_mean=False)[:2]
  lse = m + jnp.log(se)
  valid = (labels >= 0) & (labels < shape[2])
  rows = jnp.stack(
    [
      m,
      g * (1 + 2 * k * lse) / se,
      jnp.where(valid, g * (1 - a), 0.0),
      g * a / shape[2],
    ]
  )
  got, db = lce_mosaic_bwd.lce_bwd(
    x, w, b, labels, rows, soft_cap=cap, label_term=a < 1, uniform_term=a > 0, interpret=True
  )
  want, want_db = _float64_dlogits(x, w, b, labels, g.astype(jnp.float64), **options)
  assert got.dtype == dtype and got.shape == shape[::2]
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all()
  # G is rounded to the operands' dtype: half an ulp (2^-9 relative in bfloat16) beside float32's.
  ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
  np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp * 1e-2 * np.abs(want).max())
  if bias:
    assert db.shape == (shape[0] // 128, shape[2]) and db.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(db).sum(0), want_db, rtol=1e-4, atol=1e-5)
  else:
    assert db is None


def test_backward_kernel_refusals_and_blocks():
  assert lce_mosaic_bwd.lce_bwd_unsupported((16384, 4096, 4096), jnp.bfloat16) is None
  assert "V=384" in lce_mosaic_bwd.lce_bwd_unsupported((128, 64, 384), jnp.bfloat16)
  assert "float32" in lce_mosaic_bwd.lce_bwd_unsupported((128, 64, 256), jnp.float32)
  big = lce_mosaic_bwd.HopperTiles(stages=4)  # G's buffers leave room for three stages only
  assert "shared memory" in lce_mosaic_bwd.lce_bwd_unsupported((128, 64, 256), jnp.bfloat16, big)
  assert lce_plan.kernel_block(4096, 131072) == 4096
  assert lce_plan.kernel_block(5000, 3 * 1024) == 3 * 1024
  assert lce_plan.kernel_block(4096, 256 * 7 * 3) == 256 * 7
  assert lce_plan.kernel_block(100, 1024) == 256
  x, w, _, labels = _inputs(128, 64, 512)
  with pytest.raises(NotImplementedError, match=r"vocab_block_size=384 does not divide V=512"):
    jaxact.linear_cross_entropy(x, w, labels % 512, implementation="mosaic", vocab_block_size=384)
  with pytest.raises(ValueError, match=r"rows \(3, 128\)"):
    lce_mosaic_bwd.lce_bwd(
      x, w, None, labels, jnp.zeros((3, 128)), soft_cap=None, label_term=True, uniform_term=False
    )


@pytest.mark.parametrize(
  ("call", "match"),
  [
    (
      lambda x, w, y: jaxact.linear_cross_entropy(x[:100], w, y[:100], implementation="mosaic"),
      r"tokens=100 is not a multiple of 128",
    ),
    (
      lambda x, w, y: jaxact.linear_cross_entropy(x, w[:, :384], y % 384, implementation="mosaic"),
      r"V=384 is not a multiple of 256",
    ),
    (
      lambda x, w, y: jaxact.linear_cross_entropy(
        x.astype(jnp.float32), w.astype(jnp.float32), y, implementation="mosaic"
      ),
      r"operand dtype float32",
    ),
    (
      lambda x, w, y: jaxact.linear_cross_entropy(
        x, w, y, implementation="mosaic", precision=jax.lax.Precision.HIGHEST
      ),
      r"precision=",
    ),
    (
      lambda x, w, y: jaxact.linear_cross_entropy(
        x, w, y, implementation="mosaic", return_predictions=True
      ),
      r"return_predictions=True",
    ),
    (
      lambda x, w, y: jaxact.linear_cross_entropy(
        x, w.T, y, implementation="mosaic", w_layout="vd"
      ),
      r"w_layout='vd'",
    ),
  ],
  ids=["tokens", "vocab", "float32", "precision", "predictions", "table"],
)
def test_mosaic_refusals_say_why(call, match):
  x, w, _, labels = _inputs(128, 64, 512)
  with pytest.raises(NotImplementedError, match=match):
    call(x, w, labels % 512)


def test_lce_unsupported():
  assert lce_mosaic.lce_unsupported((16384, 4096, 131072), jnp.bfloat16) is None
  assert "D=100" in lce_mosaic.lce_unsupported((128, 100, 256), jnp.bfloat16)
  big = lce_mosaic.LceTiles(stages=8)
  assert "shared memory" in lce_mosaic.lce_unsupported((128, 64, 256), jnp.float16, big)


def _shapes(t, d, v):
  return [
    jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
    jax.ShapeDtypeStruct((v,), jnp.float32),
    jax.ShapeDtypeStruct((t,), jnp.int32),
  ]


def test_forward_kernel_lowers_for_an_h100_at_the_issue_size():
  def fwd(x, w, b, labels):
    return lce_mosaic.lce_fwd(x, w, b, labels, soft_cap=30.0, want_mean=True, num_sms=132)

  text = lowered_text(fwd, _shapes(16384, 4096, 131072))
  assert "mosaic_gpu" in text


def test_forward_kernel_compiles_for_an_h100_without_a_logits_buffer():
  try:
    device = support.device(support.H100)
  except support.Unavailable as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"cannot compile for a GPU here: {e}")
  del device

  def fwd(x, w, b, labels):
    return lce_mosaic.lce_fwd(x, w, b, labels, soft_cap=None, want_mean=True, num_sms=132)

  compiled = support.compile_for(fwd, _shapes(16384, 4096, 131072))
  # Five float32 statistics a token for each of two warpgroups: 0.6 MiB; the logits would be 4 GiB.
  assert compiled.memory_analysis().temp_size_in_bytes <= 1 << 20


def test_backward_kernel_compiles_for_an_h100_without_a_logits_buffer():
  try:
    support.device(support.H100)
  except support.Unavailable as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"cannot compile for a GPU here: {e}")
  t, d, v = 16384, 4096, 4096  # the issue's tokens and D, one GPU-sized block of columns
  shapes = [*_shapes(t, d, v), jax.ShapeDtypeStruct((4, t), jnp.float32)]

  def bwd(x, w, b, labels, rows):
    return lce_mosaic_bwd.lce_bwd(
      x, w, b, labels, rows, soft_cap=30.0, label_term=True, uniform_term=True, num_sms=132
    )

  compiled = support.compile_for(bwd, shapes)
  # G (128 MiB) and db's partial sums are outputs; the logits block never exists.
  assert compiled.memory_analysis().temp_size_in_bytes <= 1 << 20


def test_the_gpu_section_lowers_for_an_h100():
  # benchmarks.gpu_lce times these on a GPU: each path's fwd+bwd lowers here, the kernels too.
  from support import gpu_lce

  shapes = _shapes(1024, 256, 2048)
  args = [shapes[0], shapes[1], shapes[3]]
  kernels = {}
  for label, loss in gpu_lce.paths(hopper=True).items():
    text = lowered_text(jax.value_and_grad(loss, argnums=(0, 1)), args)
    kernels[label] = text.count("mosaic_gpu")
  assert {k for k, n in kernels.items() if n} == {"jaxact mosaic", "jaxact mosaic fwd"}
  # "mosaic" runs the backward kernel too; "mosaic fwd" the forward kernel with XLA's backward.
  assert kernels["jaxact mosaic"] > kernels["jaxact mosaic fwd"]
