"""RMS and layer norms that keep their output: the backward reads ``y`` and one number a row.

In a pre-norm block ``y = norm(x)`` feeds a matmul, which keeps ``y`` for its weight gradient.
Autodiff of the norm keeps ``x`` as well (and, for half precision, a float32 copy of it), though
the backward can be written from ``y``: the normalized input is ``x̂ = y / gamma`` (RMS norm) or
``(y - beta) / gamma`` (layer norm), where ``gamma = scale_offset + scale`` (``scale_offset`` is 0,
or 1 for Gemma's ``x̂ (1 + scale)``), and with the per-row ``r = 1 / sigma``,
``sigma = sqrt(var + ε)``

.. math::
  \\bar x = r \\left(\\bar{\\hat x} - \\overline{\\bar{\\hat x}} - \\hat x \\,
  \\overline{\\bar{\\hat x} \\hat x}\\right), \\quad \\bar{\\hat x} = \\bar y \\gamma

(the mean of :math:`\\bar{\\hat x}` is absent for RMS norm; overlines are means over the normalized
axes). So each op is one ``custom_vjp`` keeping ``y`` (the array the next matmul keeps anyway),
``sigma`` in float32 and the parameters; the block input ``x`` need not be kept at all. The
statistics are from :mod:`jaxact._src.core.moments`: every intermediate in range for any finite
input, and ``sigma`` kept rather than ``r`` (a row of 1e38's ``r`` is not a normal float32).

Where ``gamma`` is exactly 0 the input cannot be recovered from ``y``: there ``x̂`` is taken as 0, so
that channel's ``dgamma`` and (RMS norm, layer norm) its own ``dx`` term ``-r x̂ mean(dx̂ x̂)`` are 0;
every other channel's gradient is exact. Layer norm's ``x̂ = (y - beta) / gamma`` carries ``y``'s
rounding, ``u |y|``: an error of ``u (|x̂| + |beta / gamma|)``, large where ``|beta|`` dwarfs
``|gamma|``.
``residual="input"`` keeps ``x`` instead and is exact everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.core import barriers, moments, shardings
from jaxact._src.norms.plan import NormPlan

# The names of the kept output and per-row standard deviation (jax.ad_checkpoint.checkpoint_name):
# under jax.checkpoint(policy=save_only_these_names(*CHECKPOINT_NAMES)) a block keeps them and does
# not recompute the norm in its backward. The input-residual plan keeps x, the caller's array.
CHECKPOINT_NAMES = ("jaxact.norms.y", "jaxact.norms.sigma")


def _param(plan: NormPlan, p: Array | None, like: Array) -> Array | None:
  """`p` in the accumulation dtype, broadcastable to `like` and split as its features are."""
  if p is None:
    return None
  return shardings.align(p.astype(plan.acc).reshape(plan.feature_shape(like.shape)), like)


def _gamma(plan: NormPlan, scale: Array | None, like: Array) -> Array | None:
  """``scale_offset + scale`` in the accumulation dtype, broadcastable to `like`."""
  gamma = _param(plan, scale, like)
  return gamma if gamma is None or not plan.scale_offset else gamma + plan.scale_offset


def _normalized(plan: NormPlan, x: Array) -> tuple[Array, Array]:
  """``(x̂, sigma)`` in the accumulation dtype, sigma with the normalized axes kept (size 1)."""
  xf = x.astype(plan.acc)
  m = moments.moments(xf, plan.axes, plan.epsilon, center=plan.center)
  return m.normalized(xf), m.sigma


def _forward(plan: NormPlan, x, scale, bias):
  x_hat, sigma = _normalized(plan, x)
  y = x_hat
  if scale is not None:
    y = y * _gamma(plan, scale, x)
  if bias is not None:
    y = y + _param(plan, bias, x)
  y = y.astype(plan.out_dtype)
  if plan.out_sharding is not None:  # y as asked, and sigma split as y's rows
    y = shardings.reshard(y, plan.out_sharding)
    rows = shardings.spec_of_sharding(plan.out_sharding, y.ndim)
    sigma = shardings.to_spec(sigma, tuple(() if d in plan.axes else a for d, a in enumerate(rows)))
  return y, sigma


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(plan: NormPlan, x, scale, bias):
  return _forward(plan, x, scale, bias)[0]


def _norm_fwd(plan: NormPlan, x, scale, bias):
  y, sigma = _forward(plan, x, scale, bias)
  if plan.residual == "input":
    return y, (x, None, scale, bias)
  # The barrier makes the kept y the returned array (one buffer) and keeps XLA from recomputing it
  # from x in the backward pass, which would keep x alive as well.
  y, sigma = lax.optimization_barrier((y, sigma))
  y, sigma = (checkpoint_name(a, n) for a, n in zip((y, sigma), CHECKPOINT_NAMES, strict=True))
  return y, (y, sigma, scale, bias)


def _norm_bwd(plan: NormPlan, res, g):
  kept, sigma, scale, bias = res
  x_spec = plan.shardings[0]
  if plan.residual == "input" and x_spec is not None:
    g = shardings.to_spec(g, x_spec)  # the arithmetic below pairs g with x
  (kept, sigma), g = barriers.after_cotangent((kept, sigma), g)
  acc = plan.acc
  gamma, beta = _gamma(plan, scale, g), _param(plan, bias, g)
  if plan.residual == "input":
    x_hat, sigma = _normalized(plan, kept)
  else:
    x_hat = kept.astype(acc)
    if beta is not None:
      x_hat = x_hat - beta
    if (
      gamma is not None
    ):  # exact zeros of gamma: x̂ is lost there, and taken as 0 (module docstring)
      zero = gamma == 0
      x_hat = jnp.where(zero, 0, x_hat / jnp.where(zero, 1, gamma))
  g32 = g.astype(acc)
  others = tuple(d for d in range(g.ndim) if d not in plan.axes)

  def param_grad(p, v):
    return None if p is None else jnp.sum(v, others).reshape(p.shape).astype(p.dtype)

  d_scale = param_grad(scale, g32 * x_hat)
  d_bias = param_grad(bias, g32)
  dx_hat = g32 if gamma is None else g32 * gamma
  inner = dx_hat - x_hat * jnp.mean(dx_hat * x_hat, plan.axes, keepdims=True)
  if plan.center:
    inner = inner - jnp.mean(dx_hat, plan.axes, keepdims=True)
  r, q = moments.reciprocal(sigma)
  dx = (inner * r * q).astype(plan.x_dtype)
  return shardings.retype((dx, d_scale, d_bias), plan.shardings)


_norm.defvjp(_norm_fwd, _norm_bwd)
run = jax.jit(_norm, static_argnums=0)
