"""rms_norm / layer_norm that keep their output: values and gradients against JAX autodiff of the
plain formulas (float64), the kept residuals, zero scales, transformations and bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxact
from jaxact._src.norms.reference import EPS, gemma_rms, ref_ln, ref_ln_offset, ref_rms


def ours_rms(x, scale, bias=None, **kw):
  return jaxact.rms_norm(x, scale, **kw)


def ours_ln(x, scale, bias, **kw):
  return jaxact.layer_norm(x, scale, bias, **kw)


NORMS = {"rms": (ours_rms, ref_rms), "layer": (ours_ln, ref_ln)}


def _inputs(shape=(8, 64), dtype=jnp.float64, scale_kind="random"):
  k = jax.random.split(jax.random.key(0), 4)
  x = (jax.random.normal(k[0], shape, jnp.float64) * 2 + 0.5).astype(dtype)
  n = shape[-1]
  scale = {
    "random": jax.random.normal(k[1], (n,), jnp.float64),  # negative ones included
    "tiny": jax.random.normal(k[1], (n,), jnp.float64) * 1e-3,
    "zeros": jax.random.normal(k[1], (n,), jnp.float64).at[::5].set(0.0),
  }[scale_kind].astype(jnp.promote_types(dtype, jnp.float32))
  bias = jax.random.normal(k[2], (n,), jnp.float64).astype(scale.dtype)
  ct = jax.random.normal(k[3], shape, jnp.float64).astype(dtype)
  return x, scale, bias, ct


def _grads(f, x, scale, bias, ct):
  y, pull = jax.vjp(f, x, scale, bias)
  return y, pull(ct)


@pytest.mark.sample(2, "rms-tiny-output")
@pytest.mark.parametrize("residual", ["output", "input"])
@pytest.mark.parametrize("scale_kind", ["random", "tiny"])
@pytest.mark.parametrize("norm", NORMS)
def test_float64_matches_autodiff(norm, scale_kind, residual):
  ours, ref = NORMS[norm]
  x, scale, bias, ct = _inputs(scale_kind=scale_kind)
  y1, g1 = _grads(functools.partial(ours, residual=residual), x, scale, bias, ct)
  y2, g2 = _grads(ref, x, scale, bias, ct)
  np.testing.assert_allclose(y1, y2, rtol=1e-12, atol=1e-12)
  for a, b in zip(g1, g2, strict=True):
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("norm", NORMS)
def test_float32_gradients_within_1e_5_of_float64(norm):
  # The figure: relative 1e-5 wherever |gamma| >= 1e-3 max |gamma| (y / gamma loses the
  # rest).
  ours, ref = NORMS[norm]
  x, scale, bias, ct = _inputs()
  scale = jnp.where(jnp.abs(scale) < 1e-3 * jnp.abs(scale).max(), 1e-3, scale)
  f32 = [a.astype(jnp.float32) for a in (x, scale, bias, ct)]
  _, g32 = _grads(ours, *f32)
  _, g64 = _grads(ref, x, scale, bias, ct)
  for a, b in zip(g32, g64, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("norm", NORMS)
def test_half_precision_against_float32(norm, dtype):
  ours, ref = NORMS[norm]
  x, scale, bias, ct = _inputs(dtype=dtype)
  scale, bias = scale.astype(jnp.float32), bias.astype(jnp.float32)
  y, g = _grads(ours, x, scale, bias, ct)
  assert y.dtype == dtype and g[0].dtype == dtype and g[1].dtype == jnp.float32
  y32, g32 = _grads(ref, x.astype(jnp.float32), scale, bias, ct.astype(jnp.float32))
  np.testing.assert_allclose(y.astype(jnp.float32), y32, rtol=2e-2, atol=2e-2)
  for a, b in zip(g, g32, strict=True):
    np.testing.assert_allclose(
      a.astype(jnp.float32), b, rtol=3e-2, atol=3e-2 * float(jnp.abs(b).max())
    )


@pytest.mark.parametrize("norm", NORMS)
def test_check_grads(norm):
  ours, _ = NORMS[norm]
  x, scale, bias, _ = _inputs((3, 8))
  check_grads(ours, (x, scale, bias), order=2, modes=("rev",), eps=1e-4)


@pytest.mark.parametrize("norm", NORMS)
def test_zero_scales_are_nan_free_with_the_documented_gradient(norm):
  ours, ref = NORMS[norm]
  x, scale, bias, ct = _inputs(scale_kind="zeros")
  _, (dx, ds, db) = _grads(ours, x, scale, bias, ct)
  _, (rx, rs, rb) = _grads(ref, x, scale, bias, ct)
  zero = np.asarray(scale == 0)
  assert np.isfinite(dx).all() and np.isfinite(ds).all()
  # Channels with gamma = 0: dgamma = 0, and dx lacks its term -r x̂ mean(dx̂ x̂) (x̂ is lost there; for
  # RMS norm that is all of it); every other entry exact.
  c = x - jnp.mean(x, -1, keepdims=True) if norm == "layer" else x
  r = jax.lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + EPS)
  x_hat = c * r
  lost = -r * x_hat * jnp.mean(ct * scale * x_hat, -1, keepdims=True)
  np.testing.assert_array_equal(ds[zero], 0)
  np.testing.assert_allclose(dx[:, zero], (rx - lost)[:, zero], rtol=1e-10, atol=1e-12)
  if norm == "rms":
    np.testing.assert_allclose(dx[:, zero], 0, atol=1e-15)
  np.testing.assert_allclose(ds[~zero], rs[~zero], rtol=1e-10)
  np.testing.assert_allclose(dx[:, ~zero], rx[:, ~zero], rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(db, rb, rtol=1e-12)
  # residual="input" is exact there too.
  _, (ix, is_, _) = _grads(functools.partial(ours, residual="input"), x, scale, bias, ct)
  np.testing.assert_allclose(ix, rx, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(is_, rs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm", NORMS)
def test_keeps_the_output_and_one_number_a_row(norm):
  ours, _ = NORMS[norm]
  x, scale, bias, _ = _inputs((16, 64), jnp.bfloat16)
  y, pull = jax.vjp(lambda x: ours(x, scale, bias), x)
  big = [a for a in jax.tree.leaves(pull) if a.size >= x.size]
  assert len(big) == 1 and big[0].dtype == jnp.bfloat16
  np.testing.assert_array_equal(big[0], y)
  rows = [a for a in jax.tree.leaves(pull) if a.shape == (16, 1)]
  assert len(rows) == 1 and rows[0].dtype == jnp.float32
  _, pull = jax.vjp(lambda x: ours(x, scale, bias, residual="input"), x)
  (kept,) = [a for a in jax.tree.leaves(pull) if a.size >= x.size]
  np.testing.assert_array_equal(kept, x)


def test_no_scale_and_several_axes():
  x, _, _, ct = _inputs((4, 6, 8))
  for ours, ref in NORMS.values():
    y1, g1 = _grads(functools.partial(ours, axis=(1, 2)), x, None, None, ct)
    y2, g2 = _grads(functools.partial(ref, axis=(1, 2)), x, None, None, ct)
    np.testing.assert_allclose(y1, y2, rtol=1e-12)
    np.testing.assert_allclose(g1[0], g2[0], rtol=1e-10, atol=1e-12)


def test_jit_vmap_remat_scan():
  x, scale, bias, _ = _inputs((5, 4, 16))

  def loss(f):
    def body(c, xs):
      return c + jnp.sum(f(xs, scale, bias) ** 2), None

    return lambda x: jax.lax.scan(jax.checkpoint(body), 0.0, x)[0]

  g1 = jax.jit(jax.grad(loss(ours_ln)))(x)
  g2 = jax.grad(loss(ref_ln))(x)
  np.testing.assert_allclose(g1, g2, rtol=1e-10, atol=1e-12)
  v1 = jax.vmap(jax.grad(lambda x: jnp.sum(ours_rms(x, scale) ** 3)))(x)
  v2 = jax.vmap(jax.grad(lambda x: jnp.sum(ref_rms(x, scale) ** 3)))(x)
  np.testing.assert_allclose(v1, v2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
  ("call", "error", "match"),
  [
    (lambda x, s: jaxact.rms_norm(x, s[:3]), ValueError, r"`scale` has shape \(3,\)"),
    (lambda x, s: jaxact.layer_norm(x, s, s[:2]), ValueError, r"`bias` has shape \(2,\)"),
    (lambda x, s: jaxact.rms_norm(x, s, axis=2), ValueError, r"`axis` 2 is out of range"),
    (lambda x, s: jaxact.rms_norm(x, s, epsilon=0.0), ValueError, r"`epsilon` must be a positive"),
    (lambda x, s: jaxact.rms_norm(x, s, residual="x"), ValueError, r"`residual` must be"),
    (lambda x, s: jaxact.rms_norm(x.astype(jnp.int32), s), TypeError, r"`x` has dtype int32"),
    (lambda x, s: jaxact.layer_norm(x, s.astype(jnp.int32)), TypeError, r"`scale` has dtype"),
    (
      lambda x, s: jaxact.rms_norm(x, None, scale_offset=1.0),
      ValueError,
      r"jaxact\.rms_norm: `scale_offset` 1\.0 is added to `scale`.*but `scale` is None",
    ),
    (
      lambda x, s: jaxact.layer_norm(x, s, scale_offset=jnp.ones(())),
      TypeError,
      r"jaxact\.layer_norm: `scale_offset` must be a Python float",
    ),
    (
      lambda x, s: jaxact.rms_norm(x, s, scale_offset=float("nan")),
      ValueError,
      r"`scale_offset` must be finite",
    ),
  ],
  ids=[
    "scale-shape",
    "bias-shape",
    "axis",
    "epsilon",
    "residual",
    "int-x",
    "int-scale",
    "offset-no-scale",
    "offset-array",
    "offset-nan",
  ],
)
def test_bad_input(call, error, match):
  x, scale, _, _ = _inputs((2, 64))
  with pytest.raises(error, match=match):
    call(x, scale)


# ---------------------------------------------------------------------- scale_offset (Gemma's)


@pytest.mark.sample(2)
@pytest.mark.parametrize("residual", ["output", "input"])
@pytest.mark.parametrize("scale_kind", ["zeros", "random"], ids=["gemma-init", "trained"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_scale_offset_matches_autodiff_of_the_plain_formula(norm, scale_kind, residual):
  """``x_hat * (1 + scale)`` in float64: exact gradients with Gemma's initial scale of zeros (the
  effective gamma is 1, so the output residual recovers x_hat), where ``rms_norm(x, scale)``
  outputs zeros with a zero scale gradient."""
  x, scale, bias, ct = _inputs()
  if scale_kind == "zeros":
    scale = jnp.zeros_like(scale)
  if norm == "rms":
    ours = functools.partial(ours_rms, residual=residual, scale_offset=1.0)
    ref = gemma_rms
  else:
    ours = functools.partial(ours_ln, residual=residual, scale_offset=1.0)
    ref = ref_ln_offset
  y1, g1 = _grads(ours, x, scale, bias, ct)
  y2, g2 = _grads(ref, x, scale, bias, ct)
  np.testing.assert_allclose(y1, y2, rtol=1e-12, atol=1e-12)
  for a, b in zip(g1, g2, strict=True):
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * float(jnp.abs(b).max()))
  assert float(jnp.abs(g1[1]).min()) > 0  # every channel's scale trains
  if scale_kind == "zeros" and norm == "rms":  # without the offset: zeros, and no scale gradient
    y0, (_, d_scale, _) = _grads(ours_rms, x, scale, bias, ct)
    assert not y0.any() and not d_scale.any()
