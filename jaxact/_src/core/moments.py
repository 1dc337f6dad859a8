"""The norms' statistics for any finite input: mean, variance and normalizer, every intermediate in
range.

Squaring float32 entries of about 1e19 or more overflows, centring entries near float32's largest
does too, and ``1 / sqrt(var + eps)`` of a row of 1e38 is below the smallest normal float, which
XLA flushes to 0. So a statistic's entries are scaled by a power of two ``inv`` that brings the
largest (or ``sqrt(eps)``, where that is larger) into ``[1, 2)``: the scaling is exact, every square
and sum of squares is in range, and an entry whose square flushes is below ``2^-63`` of the largest.
The entries are normalized as ``(x * inv - mean) * r``, ``mean`` and ``r`` of the scaled entries.

The centred variance is the corrected two-pass one, ``mean(c^2) - mean(c)^2`` with ``c = x - m``
(Chan, Golub and LeVeque), whose mean ``m + mean(c)`` makes a constant row's entries exactly 0;
``m`` is a first estimate taken beside the largest entry, in the same pass over ``x`` (the mean,
or the midrange where the sum overflows), so the two-pass statistics still read ``x`` twice. The
number kept for a backward pass is the standard deviation ``sigma = sqrt(var + eps)``, not its
reciprocal (below the smallest normal float for sigma above ``2^126``): :func:`reciprocal` splits
``1 / sigma`` into two factors that are normal. ``eps`` enters as ``(sqrt(eps) * inv)^2``, so an
epsilon below float32's smallest normal (1e-40) is not flushed.

(XLA:CPU fuses a reduction's operand only through simple arithmetic, and a value two sums read
only into one variadic reduce: a ``where`` or a comparison before a sum, or ``c`` read by two
sums, stores an array of x's size. Hence a largest entry first, not Blue's per-entry classes, and
``mean(c)`` and ``mean(c^2)`` as one ``lax.reduce``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import Array, lax


def sqrt_epsilon(epsilon: float, dtype) -> float:
  """``sqrt(epsilon)`` held within ``[smallest normal, 2^(maxexp / 2 - 1)]`` of `dtype` (float32:
  an epsilon below 1.4e-76 counts as 1.4e-76, above 8.5e37 as 8.5e37), so that ``sigma`` and
  ``2 / sigma`` are normal numbers."""
  fi = np.finfo(dtype)
  return float(min(max(math.sqrt(epsilon), float(fi.tiny)), 2.0 ** (fi.maxexp // 2 - 1)))


class Moments(NamedTuple):
  """A statistic's numbers, with its reduced axes kept (size 1)."""

  inv: Array  # the scale of x, a power of two
  mean: Array  # the mean of x * inv (None for an RMS norm)
  var: Array  # the variance of x * inv (the mean square for an RMS norm)
  r: Array  # 1 / sqrt(var + eps inv^2): x_hat = (x * inv - mean) * r
  sigma: Array  # sqrt(var(x) + eps), within [sqrt_epsilon, the dtype's max]

  def unscaled(self) -> tuple[Array, Array]:
    """``(mean(x), var(x))``; the variance saturates at the dtype's max (float32: a standard
    deviation above 1.8e19), the mean is held within it (its rounding could pass it)."""
    big = jnp.finfo(self.var.dtype).max
    scale = 1 / self.inv  # a power of two: exact
    return jnp.clip(self.mean * scale, -big, big), jnp.minimum(self.var * scale * scale, big)


def _same(v):
  return v


def moments(
  x: Array,
  axes: tuple[int, ...],
  epsilon: float,
  *,
  center: bool = True,
  pmean: Callable = _same,
  pmax: Callable = _same,
) -> Moments:
  """The statistics of `x` (an accumulation dtype) over `axes`: centred with the two-pass variance,
  else (``center`` False) the mean square. `pmean` and `pmax` average and take the maximum over
  devices (a tuple of arrays at once), as the statistics are shared."""
  dt = x.dtype
  fi = jnp.finfo(dt)
  n = max(math.prod(x.shape[a] for a in axes), 1)  # empty: sums of 0, not 0 / 0
  se = sqrt_epsilon(epsilon, dt)
  mean_of = lambda v: jnp.sum(v, axes, keepdims=True) / n
  hi = pmax(jnp.max(x, axes, keepdims=True, initial=-fi.max))
  lo = -pmax(-jnp.min(x, axes, keepdims=True, initial=fi.max))
  top = jnp.maximum(jnp.maximum(hi, -lo), se)
  _, e = jnp.frexp(top)  # top = f 2^e with f in [0.5, 1)
  inv = jnp.ldexp(jnp.ones_like(top), jnp.clip(1 - e, 2 - fi.maxexp, fi.maxexp - 2))
  mean = None
  if not center:
    var = pmean(mean_of(jnp.square(x * inv)))
  else:
    # the first estimate, in x * inv's scale: the mean, or where its sum overflowed (entries near
    # the dtype's max) the midrange
    total = pmean(mean_of(x))
    mean = jnp.where(jnp.isfinite(total), total, hi * 0.5 + lo * 0.5) * inv
    c = x * inv - mean
    m1, m2 = pmean(_sums((c, c * c), axes, n))
    mean, var = mean + m1, jnp.maximum(0, m2 - m1 * m1)
  e = se * inv
  v = var + e * e
  # v is below the smallest normal only where var is 0 and e^2 underflowed: r is then 1 / e
  ok = v >= fi.tiny
  r = jnp.where(ok, lax.rsqrt(jnp.where(ok, v, 1)), 1 / jnp.maximum(e, fi.tiny))
  sigma = jnp.clip(jnp.sqrt(v) * (1 / inv), se, fi.max)
  return Moments(inv, mean, var, r, sigma)


def _sums(operands: tuple[Array, ...], axes: tuple[int, ...], n: int) -> tuple[Array, ...]:
  """The means of `operands` over `axes` (kept, size 1) as one variadic reduce."""
  zero = jnp.zeros((), operands[0].dtype)
  add = lambda a, b: tuple(p + q for p, q in zip(a, b, strict=True))
  sums = lax.reduce(operands, (zero,) * len(operands), add, axes)
  return tuple(jnp.expand_dims(v, axes) / n for v in sums)


def sigma_of(var: Array, epsilon: float) -> Array:
  """``sqrt(var + eps)`` of a given variance (a running average), with no intermediate out of
  range: at least ``sqrt_epsilon``; a negative variance counts as 0."""
  return jnp.hypot(jnp.sqrt(jnp.maximum(var, 0)), sqrt_epsilon(epsilon, var.dtype))


def reciprocal(sigma: Array) -> tuple[Array, Array]:
  """``(r, q)`` with ``r * q = 1 / sigma``, both normal numbers for every normal `sigma` (``q`` a
  power of two, 1 unless sigma is within ``2^8`` of the dtype's max): ``(v * r) * q`` is ``v /
  sigma`` (XLA computes a division by a broadcast statistic as a product with its reciprocal,
  which would flush)."""
  fi = jnp.finfo(sigma.dtype)
  q = jnp.where(sigma > 2.0 ** (fi.maxexp - 8), 2.0**-8, 1.0).astype(sigma.dtype)
  return 1 / (sigma * q), q
