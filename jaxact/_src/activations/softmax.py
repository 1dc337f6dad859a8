"""glu, softmax and log_softmax as ``jax.custom_vjp`` functions keeping their output (glu: input).

softmax keeps ``y`` (``x_bar = y * (y_bar - <y_bar, y>)``), log_softmax keeps ``y`` too
(``x_bar = y_bar - exp(y) * sum(y_bar)``), glu its input. An all ``-inf`` or all-masked row gives
0 (log_softmax: -inf) with zero gradient; entries equal to +inf share the row's mass.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jaxact._src.core import validation
from jaxact._src.core.barriers import after_cotangent
from jaxact._src.core.spec import JAX_NN, _sigmoid

# The custom_vjp functions below call plain `_impl` functions from their fwd rules, never
# themselves: under forward-over-reverse (jax.hessian) the fwd rule is differentiated by jvp,
# which a nested custom_vjp call would refuse.


# Past |b| = 80 (float64: 700) the smaller of sigmoid(±b), about e^-|b|, nears the float's smallest
# normal number (e^-87, e^-708), which XLA:CPU flushes to zero, while a times it is still large for
# a large a (float32: a = 3e38, b = -87 gives about 5). There it is formed as e^(k - |b|), scaled up
# by e^k (k - |b| is exact up to |b| = 2k, Sterbenz), and a scaled down by e^-k first. Per itemsize
# of the compute dtype: (threshold, k, e^-k), k = 64 ln 2 (float32) or 512 ln 2.
_K32 = float(np.float32(64 * math.log(2.0)))
_GLU_SPLIT = {
  4: (80.0, _K32, math.exp(-_K32)),
  8: (700.0, 512 * math.log(2.0), math.exp(-512 * math.log(2.0))),
}


def _glu_sigmoids(b: Array) -> tuple[Array, Array, Array, Array]:
  """``(rb, sb, r, cl)``: sigmoid(b) = rb * sb and sigmoid(b) sigmoid(-b) = r * cl, from one exp;
  short of the split r = rb = 1 and sb is ``_sigmoid_pair``'s."""
  threshold, k, inv_scale = _GLU_SPLIT[b.dtype.itemsize]
  # Weights of 0 and 1 in exact arithmetic, not jnp.where on the exp (see _sigmoid_pair).
  split = jnp.where(jnp.abs(b) > threshold, 1.0, 0.0)
  e = jnp.exp(split * k - jnp.abs(b))  # e^-|b|, times e^k where split
  r = split * inv_scale + (1.0 - split)
  er = e * r  # e^-|b| (underflowing where split)
  d = 1.0 + er
  c = e / d  # the smaller sigmoid is r * c
  p = jnp.where(b >= 0, 1.0, 0.0)
  # sigmoid(b) sigmoid(-b) = r e / d^2, d's rounding taken out (exact: er <= 1, Fast2Sum) so that
  # it does not count twice. Each expression reads c once: XLA:CPU would write it to memory and
  # read it back for two.
  cl = (e / (d * d)) * (1.0 - 2.0 * (((1.0 - d) + er) / d))
  return p + (1.0 - p) * r, p + c * ((1.0 - p) - p * r), r, cl


def _glu_impl(axis: int, x: Array) -> Array:
  cdt = validation.compute_dtype(x.dtype)
  a, b = jnp.split(x.astype(cdt), 2, axis)
  rb, sb, _, _ = _glu_sigmoids(b)
  return ((a * rb) * sb).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _glu(axis: int, x: Array) -> Array:
  return _glu_impl(axis, x)


def _glu_fwd(axis, x):
  y, x = jax.lax.optimization_barrier((_glu_impl(axis, x), x))  # see _elementwise_fwd
  return y, x


def _glu_bwd(axis, x, g):
  x, g = after_cotangent(x, g)
  cdt = validation.compute_dtype(x.dtype)
  a, b = jnp.split(x.astype(cdt), 2, axis)
  g32 = g.astype(cdt)
  # Each half from its own exp: one shared by the two would be written to memory and read twice.
  # da's sigmoid may underflow where db's must not (a large a).
  da = g32 * _sigmoid(b)
  _, _, r, cl = _glu_sigmoids(b)
  # a times sigmoid(b) sigmoid(-b) <= 1/4 first: g a alone overflows for |a| near the float's
  # largest (then inf * 0 = NaN where a sigmoid is 0), though the product is finite.
  db = g32 * ((a * r) * cl)
  return (jnp.concatenate([da, db], axis).astype(x.dtype),)


_glu.defvjp(_glu_fwd, _glu_bwd)
_glu_jit = jax.jit(_glu, static_argnums=0)


def _shifted(x: Array, axes: tuple[int, ...], where: Array | None) -> Array:
  """x minus its max over `axes`, with rows that have no finite max handled without NaN.

  All -inf (or all masked) rows stay -inf everywhere, so they sum to 0. Rows containing +inf put 0
  at the +inf entries and -inf elsewhere: the +inf entries share the mass (the limit as they grow
  together). NaN anywhere in a row propagates.
  """
  if where is not None:
    x = jnp.where(where, x, -jnp.inf)
  x_max = jnp.max(x, axes, keepdims=True)
  finite_shift = x - jnp.where(x_max == -jnp.inf, 0.0, x_max)
  return jnp.where(x_max == jnp.inf, jnp.where(x == jnp.inf, 0.0, -jnp.inf), finite_shift)


def _softmax_impl(log: bool, axes: tuple[int, ...], x: Array, where: Array | None) -> Array:
  cdt = validation.compute_dtype(x.dtype)
  shifted = _shifted(x.astype(cdt), axes, where)
  e = jnp.exp(shifted)
  total = jnp.sum(e, axes, keepdims=True)
  total = jnp.where(total == 0, 1.0, total)  # empty rows: 0 / 1 (softmax), -inf - 0 (log_softmax)
  y = shifted - jnp.log(total) if log else e / total
  return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _softmax(log: bool, axes: tuple[int, ...], x: Array, where: Array | None) -> Array:
  return _softmax_impl(log, axes, x, where)


def _softmax_fwd(log, axes, x, where):
  y = jax.lax.optimization_barrier(_softmax_impl(log, axes, x, where))  # see _elementwise_fwd
  return y, (y, where)


def _softmax_bwd(log, axes, res, g):
  y, where = res
  y, g = after_cotangent(y, g)
  cdt = validation.compute_dtype(y.dtype)
  y32, g32 = y.astype(cdt), g.astype(cdt)
  if not log:
    # Masked entries and empty rows have y == 0, so they get 0 without a mask. The barrier keeps
    # the row sum a fusion of its own: fused with the product that reads g again, it made XLA
    # materialize a cotangent computed elementwise from the output (a loss's, say 2y or -t/y) as
    # one more activation-sized buffer, where two fusions each recompute it.
    dot = jax.lax.optimization_barrier(jnp.sum(g32 * y32, axes, keepdims=True))
    dx = y32 * (g32 - dot)
  else:
    mask = jnp.ones(y.shape, bool) if where is None else jnp.broadcast_to(where, y.shape)
    g_sum = jnp.sum(jnp.where(mask, g32, 0.0), axes, keepdims=True)
    dx = g32 - jnp.exp(y32) * g_sum
    empty = jnp.max(y32, axes, keepdims=True) == -jnp.inf
    dx = jnp.where(mask & ~empty, dx, 0.0)
  return dx.astype(y.dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)
_softmax_jit = jax.jit(_softmax, static_argnums=(0, 1))


def apply_glu(x: ArrayLike, axis: int) -> Array:
  x = validation.as_real_array("glu", x)
  if not validation.is_floating(x.dtype):
    return JAX_NN["glu"](x, axis=axis)
  (ax,) = validation.normalize_axes("glu", axis, x.ndim)
  if x.shape[ax] % 2:
    raise ValueError(
      f"jaxact.glu: `x` has size {x.shape[ax]} along axis {axis} (shape {x.shape}); glu splits "
      "that axis in two halves, so its size must be even"
    )
  with jax.named_scope("jaxact.glu"):
    return _glu_jit(ax, x)


def apply_softmax(name: str, x: ArrayLike, axis, where) -> Array:
  x = validation.as_real_array(name, x)
  if not validation.is_floating(x.dtype):
    return JAX_NN[name](x, axis=axis, where=where)
  axes = validation.normalize_axes(name, axis, x.ndim)
  if where is not None:
    where = validation.as_real_array(name, where, arg="where")
    if where.dtype != jnp.bool_:
      raise TypeError(f"jaxact.{name}: `where` must be a boolean array, got dtype {where.dtype}")
    validation.check_broadcasts_to(name, "where", where.shape, x.shape)
  if x.size == 0:  # nothing to normalize (a zero-length axis has no max): empty, as in jax.nn
    return jnp.zeros_like(x)
  with jax.named_scope(f"jaxact.{name}"):
    return _softmax_jit(name == "log_softmax", axes, x, where)
