"""The norms' statistics for any finite input: mean, variance and normalizer, every intermediate in
range.

Squaring float32 entries of about 1e19 or more overflows, centring entries near float32's largest
does too, and ``1 / sqrt(var + eps)`` of a row of 1e38 is below the smallest normal float, which
XLA flushes to 0. So a statistic's entries are scaled by a power of two ``inv`` that brings the
largest (or ``sqrt(eps)``, where that is larger) into ``[1, 2)``: the scaling is exact, every square
and sum of squares is in range, and an entry whose square flushes is below ``2^-63`` of the largest.
The entries are normalized as ``(x * inv - mean) * r``, ``mean`` and ``r`` of the scaled entries.

The centred variance is the corrected two-pass one, ``mean(c^2) - mean(c)^2`` with ``c = x - m``
(Chan, Golub and LeVeque), ``m`` a first mean taken beside the extremes in one pass over ``x`` (the
sum, or the midrange where the sum overflows; a constant statistic's own value, so that its
entries normalize to exactly 0): the two-pass statistics still read ``x`` twice. The number kept
for a backward pass is the standard deviation ``sigma = sqrt(var + eps)``, not its reciprocal
(below the smallest normal float for sigma above ``2^126``): :func:`reciprocal` splits ``1 /
sigma`` into two factors that are normal. ``eps`` enters as ``(sqrt(eps) * inv)^2``, so an epsilon
below float32's smallest normal (1e-40) is not flushed.

The compilers shape the arithmetic. XLA:CPU fuses a reduction's operand only through arithmetic
(a ``where`` or a comparison before a sum stores an array of x's size): hence the largest entry
first, not Blue's per-entry classes. XLA's GPU compiler fuses the plain norm's reduction and
normalization into one Triton kernel (a "normalization diamond"), which needs every number between
two passes to come from one reduction and constants; the per-row scale and the epsilon it scales
are two such numbers, so these statistics are passes of their own: the extremes and the sum, the
deviations' sums, the normalization.
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
  mean: Array | None  # the mean of x * inv (None for an RMS norm)
  var: Array  # the variance of x * inv (the mean square for an RMS norm)
  r: Array  # 1 / sqrt(var + eps inv^2): x_hat = (x * inv - mean) * r
  sigma: Array  # sqrt(var(x) + eps), within [sqrt_epsilon, the dtype's max]

  def normalized(self, x: Array) -> Array:
    """``x_hat = (x inv - mean) r`` of `x`."""
    xs = x * self.inv
    return (xs if self.mean is None else xs - self.mean) * self.r

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
  hi = jnp.max(x, axes, keepdims=True, initial=-fi.max)
  lo = jnp.min(x, axes, keepdims=True, initial=fi.max)
  if center:
    total = mean_of(x)
    hi, lo, total = pmax(hi), -pmax(-lo), pmean(total)
  else:
    hi, lo = pmax(hi), -pmax(-lo)
  inv = _power_of_two_inverse(jnp.maximum(jnp.maximum(hi, -lo), se))
  mean = None
  if not center:
    var = pmean(mean_of(jnp.square(x * inv)))
  else:
    # the first mean: a constant statistic's own value (its entries normalize to exactly 0); else
    # the mean, or where its sum overflowed (entries near the dtype's max) the midrange
    first = jnp.where(jnp.abs(total) <= fi.max, total, hi * 0.5 + lo * 0.5)
    mean = jnp.where(hi == lo, hi, first) * inv
    c = x * inv - mean
    m1, m2 = pmean((mean_of(c), mean_of(jnp.square(c))))
    mean, var = mean + m1, jnp.maximum(0, m2 - m1 * m1)
  # eps inv^2, which underflows only where negligible; behind a barrier, or XLA's simplifier may
  # form it as inv^2 * eps (jax 0.11's did): inf * 0 where eps is below the normals
  e = lax.optimization_barrier(se * inv)
  v = var + e * e
  # below the smallest normal only where x is constant (x_hat = 0 whatever r) and eps inv^2
  # underflowed: sigma is then sqrt(eps)
  r = lax.rsqrt(jnp.maximum(v, fi.tiny))
  sigma = jnp.clip(jnp.sqrt(v) * (1 / inv), se, fi.max)
  return Moments(inv, mean, var, r, sigma)


def _power_of_two_inverse(top: Array) -> Array:
  """``2^-floor(log2 top)`` for a positive normal `top`, at least the smallest normal (``2^-126``
  in float32; the largest tops then scale into ``[1, 4)``), from the bits of `top` (jnp.frexp
  would keep XLA's GPU compiler from fusing the statistics into one kernel)."""
  fi = jnp.finfo(top.dtype)
  ints = jnp.int32 if fi.bits == 32 else jnp.int64
  bias = fi.maxexp - 1
  exponent = lax.bitcast_convert_type(top, ints) & (
    ((1 << (fi.bits - 1 - fi.nmant)) - 1) << fi.nmant
  )
  exponent = jnp.minimum(exponent, (2 * bias - 1) << fi.nmant)
  return lax.bitcast_convert_type(jnp.asarray(2 * bias << fi.nmant, ints) - exponent, top.dtype)


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
