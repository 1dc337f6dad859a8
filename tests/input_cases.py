"""The inputs a program hands an op besides one batch of unit-sized rows, for the surveys of the
fused, gated and MoE families (``tests/<family>/test_<family>_inputs.py``): rows of huge and of
tiny values beside ordinary ones, empty arrays, and ``jax.vmap``.

Each op is compared with its formula, written in the survey in float64 and differentiated by JAX,
evaluated on the same (rounded) operands: no NaN where the formula's value is a number, no
infinity where it is within the dtype's range, and every entry within the dtype's tolerance of
its row's largest (the rows span 60 orders of magnitude, so each is held to its own scale), or
of 0 where it underflows the dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
DTYPE_IDS = ["float32", "bfloat16", "float16", "float64"]
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 4e-2, jnp.float16: 4e-3, jnp.float64: 1e-10}
# (huge, tiny) row scales of a dtype whose products with unit weights stay in its range, and the
# huge ones whose squares do too (a gated unit's act(a) * b).
SCALES = {
  jnp.float32: (1e30, 1e-30),
  jnp.bfloat16: (1e30, 1e-30),
  jnp.float16: (300.0, 1e-4),
  jnp.float64: (1e200, 1e-200),
}
SQUARED = {jnp.float32: 1e17, jnp.bfloat16: 1e17, jnp.float16: 20.0, jnp.float64: 1e140}


def rows(key, shape, dtype, squared=False) -> np.ndarray:
  """float64 normal values of `shape`; along the second-to-last axis the first row huge (as
  `dtype` represents it, and its square where `squared`), the second tiny and the third zero."""
  v = np.array(jax.random.normal(key, shape, jnp.float64))
  huge, tiny = SCALES[dtype]
  huge = SQUARED[dtype] if squared else huge
  v[..., 0, :] *= huge
  v[..., 1, :] *= tiny
  v[..., 2, :] = 0.0
  return v


def _or_skip(f, *args):
  """``f(*args)``; skips where the backend declines the call (``NotImplementedError``)."""
  try:
    return f(*args)
  except NotImplementedError as e:
    pytest.skip(f"the backend declines: {e}")


def assert_like_formula(f, formula, args, dtype, seed=1):
  """`f` (of arrays of `dtype`) against `formula` in float64 on the same operands: values and the
  pullback of a normal cotangent of each output."""
  args = [jnp.asarray(a, dtype) for a in args]
  shapes = _or_skip(jax.eval_shape, f, *args)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))
  ct = jax.tree.map(
    lambda s: jax.random.normal(next(keys), s.shape, jnp.float64).astype(s.dtype), shapes
  )
  y, pull = jax.jit(lambda *a: jax.vjp(f, *a))(*args)
  got = [*jax.tree.leaves(y), *jax.jit(pull)(ct)]
  y64, pull = jax.vjp(formula, *[jnp.asarray(a, jnp.float64) for a in args])
  want = [*jax.tree.leaves(y64), *pull(jax.tree.map(lambda c: jnp.asarray(c, jnp.float64), ct))]
  big = float(jnp.finfo(dtype).max) / 2
  for i, (g, w) in enumerate(zip(got, want, strict=True)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert g.shape == w.shape, (i, g.shape, w.shape)
    number = np.isfinite(w) & (np.abs(w) < big)
    assert not (np.isnan(g) & ~np.isnan(w)).any(), f"[{i}] NaN where the formula has a number"
    assert np.isfinite(g[number]).all(), f"[{i}] not finite where the formula is in range"
    if not w.size:
      continue
    scale = np.max(np.where(number, np.abs(w), 0), axis=-1, keepdims=True) if w.ndim else abs(w)
    err = np.where(number, np.abs(g - w), 0)
    # Below the dtype's smallest normal number a value may flush to 0 (XLA:CPU, the kernels).
    bound = TOL[dtype] * scale + float(jnp.finfo(dtype).smallest_normal)
    assert (err <= bound).all(), (i, np.max(err / bound))


def assert_vmap_is_a_loop(f, args, in_axes, atol):
  """``jax.vmap(f, in_axes)`` and the pullback of its sum equal a loop of `f` over the axis."""
  size = next(a.shape[0] for a, ax in zip(args, in_axes, strict=True) if ax == 0)

  def one(i, args):
    return [a[i] if ax == 0 else a for a, ax in zip(args, in_axes, strict=True)]

  def mapped(*args):
    y, pull = jax.vjp(jax.vmap(f, in_axes), *args)
    return y, pull(jnp.ones_like(y))

  def looped(*args):
    ys, grads = zip(*[jax.vjp(f, *one(i, args)) for i in range(size)], strict=True)
    grads = [p(jnp.ones_like(y)) for y, p in zip(ys, grads, strict=True)]
    summed = [
      jnp.stack(g) if ax == 0 else sum(g)
      for g, ax in zip(zip(*grads, strict=True), in_axes, strict=True)
    ]
    return jnp.stack(ys), summed

  got = _or_skip(jax.jit(mapped), *args)
  want = jax.jit(looped)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), atol=atol)
