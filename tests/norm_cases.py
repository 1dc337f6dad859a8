"""What the norm families' tests at the edges of the float range share: rows of every magnitude,
the plain norm in float64 (each statistic first scaled by a power of two, exact, so that its
squares stay finite in float64 too) with its gradients by ``jax.vjp``, and closeness a statistic at
a time."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

TOL = {jnp.float32: 1e-5, jnp.float64: 1e-10, jnp.bfloat16: 3e-2, jnp.float16: 3e-3}


def rows(dtype, n=16):
  """One row of each kind: ordinary, the issue's ``[3e30, -4e30, 1e30, 2e30]``, 1e-30, 1e30 mixed
  with ordinary entries, entries near the dtype's max of both signs, a constant 1e30 row and zeros
  (1e30 and 1e-30 scaled to float16's range)."""
  rng = np.random.default_rng(0)
  z = lambda: rng.standard_normal(n)
  fi = jnp.finfo(dtype)
  big, small = (3e4, 1e-4) if fi.maxexp == 16 else (1e30, 1e-30)
  x = [
    z() * 2 + 0.5,
    np.array([3e30, -4e30, 1e30, 2e30] * (n // 4)) * min(1.0, big / 4e30),
    z() * small,
    np.where(rng.random(n) < 0.3, z() * big, z()),
    np.sign(z()) * float(fi.max) * rng.uniform(0.5, 1.0, n),
    np.full(n, 1.1 * big),
    np.zeros(n),
  ]
  return jnp.asarray(np.stack(x), dtype)


def plain(v, eps, axes, center):
  """The normalized `v` (float64) as the formula writes it, statistics over `axes`."""
  c = v - jnp.mean(v, axes, keepdims=True) if center else v
  return c / jnp.sqrt(jnp.mean(c * c, axes, keepdims=True) + eps)


def reference(x, scale, bias, ct, *, center=True, eps=1e-6, axes=(-1,), groups=0):
  """``(y, (dx, d scale, d bias))`` of ``plain(x) * scale + bias`` in float64 (statistics over
  `axes`; with `groups`, of x ``(batch, ..., C)`` seen as ``(batch, ..., groups, C / groups)``
  over all but the first axis), each statistic scaled by a power of two k first: ``norm(x k, eps
  k^2)`` is ``norm(x, eps)``, and its squares are finite."""
  x64 = np.asarray(x, np.float64)
  view = (*x.shape[:-1], groups, x.shape[-1] // groups) if groups else x.shape
  axes = (*range(1, len(view) - 2), len(view) - 1) if groups else axes
  top = np.maximum(np.abs(x64.reshape(view)).max(axes, keepdims=True), np.sqrt(eps))
  k = 2.0 ** -np.minimum(np.floor(np.log2(top)), 1000)  # a normal float64
  f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
  args = (f64(x), f64(scale), f64(bias), f64(ct), f64(k), eps)
  return _reference(*args, center=center, axes=axes, view=view)


@functools.partial(jax.jit, static_argnames=("center", "axes", "view"))
def _reference(x, scale, bias, ct, k, eps, *, center, axes, view):
  def f(x, scale, bias):
    y = plain(x.reshape(view) * k, eps * k * k, axes, center).reshape(x.shape)
    y = y if scale is None else y * scale
    return y if bias is None else y + bias

  y, pull = jax.vjp(f, x, scale, bias)
  return y, pull(ct)


def assert_close(a, b, tol, floor=0.0, axes=(-1,)):
  """`a` within `tol` of `b`'s largest magnitude over `axes` (a statistic's entries: a row, or a
  batch norm's channel), plus `floor` (float32 flushes results below its smallest normal); both
  finite."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.isfinite(a).all() and np.isfinite(b).all()
  atol = tol * np.abs(b).max(axes, keepdims=True) + floor
  bad = np.abs(a - b) > atol
  assert not bad.any(), (np.argwhere(bad)[:5], a[bad][:5], b[bad][:5])


def floor(dtype) -> float:
  """The absolute slack beside the relative tolerance: 16 of the dtype's smallest normal."""
  return 16 * float(jnp.finfo(dtype).tiny)
