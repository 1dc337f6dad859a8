"""Batch and group norms fused with their activation, keeping one array: the normalized input.

``y = act(scale * x_hat + bias)`` with ``x_hat = (x - mean) r``, ``r = 1 / sigma`` and ``sigma =
sqrt(var + eps)``. Autodiff of that composition keeps ``x`` (or ``x - mean``) for the norm, and
``z`` or ``y`` for the activation: two or three activation-sized arrays. The backward pass needs
only ``x_hat`` (and ``sigma``, one float32 number a statistic): from it it recomputes ``z = scale *
x_hat + bias`` and the activation's derivative at ``z``, then

.. math::
  \\bar x = r \\left(\\bar{\\hat x} - \\overline{\\bar{\\hat x}} - \\hat x \\,
  \\overline{\\bar{\\hat x} \\hat x}\\right), \\quad \\bar{\\hat x} = \\bar z \\, \\gamma

(overlines are means over the statistic's elements, averaged over ``axis_name`` as the statistics
are). So each op is one ``custom_vjp`` keeping ``x_hat`` in ``x``'s dtype, ``sigma`` and the
parameters. The statistics are from :mod:`jaxact._src.core.moments`: no intermediate out of range
for any finite input (``x_hat = (x * inv - mean) * r`` with a power of two ``inv``), and
``sigma`` kept rather than ``r``, which is not a normal float32 above ``sigma = 2^126``.

Why ``x_hat`` and not ``y`` (In-Place ABN's choice): ``y`` determines ``x_hat`` only through
``(act^-1(y) - bias) / scale``, which is lost where ``scale`` is 0 (and the derivative at
``scale = 0`` is not: ``d scale = sum(dz x_hat)``), and only for invertible activations. ``x_hat``
gives the exact gradient for every scale, zero included, and every activation, from one array.
For half precision inputs ``x_hat`` is rounded to ``x``'s dtype before the scale and bias, in the
forward as in the backward, so both see the same pre-activation (at a kink, the same side of it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxact._src.activations import api as activations
from jaxact._src.core import barriers, moments
from jaxact._src.core.spec import JAX_NN
from jaxact._src.norm_act import kernels
from jaxact._src.norm_act.plan import NormActPlan


def _pmean(plan: NormActPlan, v):
  if plan.axis_name is None:
    return v
  return lax.pmean(v, plan.axis_name, axis_index_groups=plan.axis_index_groups)


def _varying(a) -> frozenset:
  """The named axes `a` varies over under ``shard_map``'s typing (empty outside it, or untyped)."""
  t = getattr(jax.typeof(a), "manual_axis_type", None)
  return frozenset(t.varying) if t is not None else frozenset()


def _like(ct, primal, g):
  """A parameter's cotangent in its shape and dtype; summed over the named axes that `g` varies
  over and the parameter does not (autodiff's transpose of the implicit broadcast)."""
  if primal is None:
    return None
  ct = ct.reshape(primal.shape).astype(primal.dtype)
  axes = tuple(sorted(_varying(g) - _varying(primal)))
  return lax.psum(ct, axes) if axes else ct


def _param(plan: NormActPlan, p, ndim: int, shape):
  if p is None:
    return None
  return p.astype(plan.acc).reshape(plan.feature_shape(ndim, shape))


def _pmax(plan: NormActPlan, v):
  if plan.axis_name is None:
    return v
  return lax.pmax(v, plan.axis_name, axis_index_groups=plan.axis_index_groups)


def statistics(plan: NormActPlan, xv) -> moments.Moments:
  """The statistics of the view `xv` (in the accumulation dtype) over the plan's axes, kept as
  size-1 axes: the two-pass mean and variance of entries scaled into range
  (:mod:`jaxact._src.core.moments`), for Flax's ``use_fast_variance`` too (its ``E[x^2] - E[x]^2``
  would save no pass here, and is rounding noise for a channel whose spread is below ``1e-4`` of
  its mean)."""
  return moments.moments(
    xv,
    plan.axes,
    plan.epsilon,
    pmean=lambda v: _pmean(plan, v),
    pmax=lambda v: _pmax(plan, v),
  )


def _activate(plan: NormActPlan, z, dynamic):
  act = plan.act
  if act.fn is not None:  # a plain callable sees what `act(norm(x))` would give it
    return act.fn(z.astype(plan.out_dtype), *dynamic)
  return act.rule.spec.fn(z, **act.rule.params(dynamic)).astype(plan.out_dtype)


def _preactivation(plan: NormActPlan, x_hat, scale, bias):
  z = x_hat.astype(plan.acc)
  if scale is not None:
    z = z * _param(plan, scale, z.ndim, z.shape)
  if bias is not None:
    z = z + _param(plan, bias, z.ndim, z.shape)
  return z


def _dz(plan: NormActPlan, xh, scale, bias, g, dynamic):
  """``(g act'(z), the activation's array parameters' cotangents)`` with z recomputed from x_hat."""
  z = _preactivation(plan, xh, scale, bias)
  act = plan.act
  if act.fn is not None:
    _, pull = jax.vjp(act.fn, z.astype(plan.out_dtype), *dynamic)
    dz, *d_dynamic = pull(g)
    return _rounded(plan, dz.astype(plan.acc)), d_dynamic
  rule = act.rule
  if rule.residual == "output":  # the derivative from z, which is at hand (y is not)
    rule = dataclasses.replace(rule, residual="input")
  dz, d_dynamic = activations.rule_cotangents(rule, z, g, dynamic, plan.acc, tied=True)
  return _rounded(plan, dz), d_dynamic


def _rounded(plan: NormActPlan, dz):
  """dz rounded to x's dtype, the cotangent of the 16-bit pre-activation as autodiff of the 16-bit
  composition has it (float32 and wider: dz itself).

  XLA stores dz once for the reductions and dx that read it (it does not recompute the
  activation's derivative for each); in float32 that array is twice the 16-bit one Flax's
  backward stores (a U-Net step compiled for an H100: 1218 against Flax's 1090 MiB). The barrier
  keeps XLA from folding the two conversions away, so the stored array is the 16-bit one."""
  if plan.dz_dtype is None:
    return dz
  return lax.optimization_barrier(dz.astype(plan.dz_dtype)).astype(plan.acc)


def _param_grads(plan: NormActPlan, dz, xh, scale, bias, g):
  others = plan.others(dz.ndim)
  d_scale = None if scale is None else _like(jnp.sum(dz * xh, others), scale, g)
  d_bias = None if bias is None else _like(jnp.sum(dz, others), bias, g)
  dxh = dz if scale is None else dz * _param(plan, scale, dz.ndim, dz.shape)
  return d_scale, d_bias, dxh


# ------------------------------------------------------------------ training: batch statistics


def _normalize_only(plan: NormActPlan, scale, bias) -> bool:
  """No scale, bias or activation and y in x's dtype: y is x_hat itself, one array for the
  output and the residual (a caller keeping x_hat as its next op's input keeps nothing more)."""
  act = plan.act
  return (
    scale is None
    and bias is None
    and act.fn is None
    and act.rule.name == "identity"
    and plan.out_dtype == plan.x_dtype
  )


def _output(plan: NormActPlan, x_hat, scale, bias, dynamic):
  if _normalize_only(plan, scale, bias):
    return x_hat
  return _activate(plan, _preactivation(plan, x_hat, scale, bias), dynamic)


def _normalized(plan: NormActPlan, x, inv, mean, r, scale, bias, dynamic=()):
  """``(y, x_hat)`` of x normalized as ``(x * inv - mean) * r`` by the view's statistics."""
  xv = x.reshape(plan.view_shape(x.shape)).astype(plan.acc)
  x_hat = ((xv * inv - mean) * r).reshape(x.shape).astype(plan.x_dtype)
  return _output(plan, x_hat, scale, bias, dynamic), x_hat


def _normalize(plan: NormActPlan, x, inv, mean, r, scale, bias, dynamic, keep: bool = True):
  """:func:`_normalized` by the plan's backend (x_hat None from the kernels without `keep`)."""
  if plan.decision.forward == "xla":
    return _normalized(plan, x, inv, mean, r, scale, bias, dynamic)
  xla = functools.partial(_normalized, plan)
  return kernels.forward(plan, x, inv, mean, r, scale, bias, xla, keep=keep)


def _train_forward(plan: NormActPlan, x, scale, bias, dynamic, keep: bool = True):
  xv = x.reshape(plan.view_shape(x.shape)).astype(plan.acc)
  m = statistics(plan, xv)
  y, x_hat = _normalize(plan, x, m.inv, m.mean, m.r, scale, bias, dynamic, keep)
  mean, var = m.unscaled()
  return y, x_hat, mean, var, m.sigma


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _train(plan: NormActPlan, x, scale, bias, *dynamic):
  y, _, mean, var, _ = _train_forward(plan, x, scale, bias, dynamic, keep=False)
  return y, mean, var


def _train_fwd(plan: NormActPlan, x, scale, bias, *dynamic):
  y, x_hat, mean, var, sigma = _train_forward(plan, x, scale, bias, dynamic)
  y, x_hat, sigma = _barrier(y, x_hat, sigma)
  return (y, mean, var), (x_hat, sigma, scale, bias, dynamic)


def _barrier(y, x_hat, sigma):
  """`y`, `x_hat` and `sigma` past one barrier, which keeps XLA from recomputing x_hat from x in
  the backward pass (which would keep x alive as well) and from fusing the forward's activation
  into the backward's; a `y` that is `x_hat` stays its one buffer."""
  if y is x_hat:
    x_hat, sigma = lax.optimization_barrier((x_hat, sigma))
    return x_hat, x_hat, sigma
  return lax.optimization_barrier((y, x_hat, sigma))


def _train_bwd(plan: NormActPlan, res, cts):
  g, g_mean, g_var = cts
  x_hat, sigma, scale, bias, dynamic = res
  (x_hat, sigma), g = barriers.after_cotangent((x_hat, sigma), g)
  if plan.decision.backward == "xla":
    return _train_grads(plan, x_hat, sigma, scale, bias, g, g_mean, g_var, dynamic)
  xla = lambda *a: _train_grads(plan, *a, ())
  return kernels.train_backward(plan, x_hat, sigma, scale, bias, g, g_mean, g_var, xla)


def _train_grads(plan: NormActPlan, x_hat, sigma, scale, bias, g, g_mean, g_var, dynamic):
  xh = x_hat.astype(plan.acc)
  dz, d_dynamic = _dz(plan, xh, scale, bias, g, dynamic)
  d_scale, d_bias, dxh = _param_grads(plan, dz, xh, scale, bias, g)
  view = plan.view_shape(xh.shape)
  dxh, xh = dxh.reshape(view), xh.reshape(view)
  m1, m2 = _pmean(
    plan,
    (jnp.mean(dxh, plan.axes, keepdims=True), jnp.mean(dxh * xh, plan.axes, keepdims=True)),
  )
  r, q = moments.reciprocal(sigma)
  dx = (dxh - m1 - xh * m2) * r * q
  # The statistics' own cotangents (zero unless the caller differentiates through them):
  # d mean / dx = 1 / n and d var / dx = 2 (x - mean) / n, with x - mean = x_hat sigma.
  n = max(math.prod(view[a] for a in plan.axes), 1)
  if plan.axis_name is None:
    dx = dx + _stat_cotangents(g_mean, g_var, xh, sigma, n)
  elif set(_names(plan.axis_name)) <= _varying(g):
    # typed shard_map: the statistics are invariant over the axis, their cotangents too, and the
    # transpose of the mean over it spreads them without a sum
    size = lax.psum(1, plan.axis_name, axis_index_groups=plan.axis_index_groups)
    dx = dx + _stat_cotangents(g_mean, g_var, xh, sigma, n * size)
  else:  # pmap, or shard_map untyped: each device's own copy, summed as psum's transpose sums
    g_mean, g_var = _pmean(plan, (g_mean, g_var))
    dx = dx + _stat_cotangents(g_mean, g_var, xh, sigma, n)
  dx = dx.reshape(x_hat.shape).astype(plan.x_dtype)
  return (dx, d_scale, d_bias, *d_dynamic)


def _stat_cotangents(g_mean, g_var, xh, sigma, n):
  """``(g_mean + 2 g_var (x - mean)) / n``, each product in range (``sigma 2 / n`` is finite)."""
  return g_mean / n + g_var * (xh * (sigma * (2 / n)))


def _names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


_train.defvjp(_train_fwd, _train_bwd)
_train_jit = jax.jit(_train, static_argnums=0)


def train(plan: NormActPlan, x, scale, bias, *dynamic):
  """``(y, mean, var)``: the statistics of the view (size-1 axes kept), accumulation dtype."""
  # A closure-converted callable is a new object on every call; jit would retrace each time.
  run = _train_jit if plan.act.fn is None else _train
  return run(plan, x, scale, bias, *dynamic)


# ------------------------------------------------------------ inference: given mean and variance


def _infer_forward(plan: NormActPlan, x, scale, bias, mean, var, dynamic, keep: bool = True):
  sigma = moments.sigma_of(var, plan.epsilon)
  # (x / 2 - mean / 2) (2 / sigma): the halves' difference is finite for any finite x and mean,
  # and 2 / sigma is (sigma_of holds sigma between the smallest normal and 2^63)
  half = jnp.full_like(mean, 0.5)
  y, x_hat = _normalize(plan, x, half, mean * 0.5, 2 / sigma, scale, bias, dynamic, keep)
  return y, x_hat, sigma


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _infer(plan: NormActPlan, x, scale, bias, mean, var, *dynamic):
  return _infer_forward(plan, x, scale, bias, mean, var, dynamic, keep=False)[0]


def _infer_fwd(plan: NormActPlan, x, scale, bias, mean, var, *dynamic):
  y, x_hat, sigma = _barrier(*_infer_forward(plan, x, scale, bias, mean, var, dynamic))
  return y, (x_hat, sigma, scale, bias, mean, var, dynamic)


def _infer_bwd(plan: NormActPlan, res, g):
  x_hat, sigma, scale, bias, mean, var, dynamic = res
  (x_hat, sigma), g = barriers.after_cotangent((x_hat, sigma), g)
  if plan.decision.backward == "xla":
    return _infer_grads(plan, x_hat, sigma, scale, bias, mean, var, g, dynamic)
  xla = lambda *a: _infer_grads(plan, *a, ())
  return kernels.infer_backward(plan, x_hat, sigma, scale, bias, mean, var, g, xla)


def _infer_grads(plan: NormActPlan, x_hat, sigma, scale, bias, mean, var, g, dynamic):
  r = 1 / sigma  # normal: sigma_of holds sigma below 2^63
  xh = x_hat.astype(plan.acc)
  dz, d_dynamic = _dz(plan, xh, scale, bias, g, dynamic)
  d_scale, d_bias, dxh = _param_grads(plan, dz, xh, scale, bias, g)
  others = plan.others(xh.ndim)
  # x_hat = (x - mean) r with r = (var + eps)^-1/2: d x_hat / d mean = -r and
  # d x_hat / d var = -x_hat r^2 / 2
  d_mean = _like(-jnp.sum(dxh, others, keepdims=True) * r, mean, g)
  d_var = _like(-0.5 * r * jnp.sum(dxh * xh, others, keepdims=True) * r, var, g)
  dx = (dxh * r).astype(plan.x_dtype)
  return (dx, d_scale, d_bias, d_mean, d_var, *d_dynamic)


_infer.defvjp(_infer_fwd, _infer_bwd)
_infer_jit = jax.jit(_infer, static_argnums=0)


def infer(plan: NormActPlan, x, scale, bias, mean, var, *dynamic):
  """``y`` normalized with the given `mean` and `var` (broadcastable to x, accumulation dtype)."""
  run = _infer_jit if plan.act.fn is None else _infer
  return run(plan, x, scale, bias, mean, var, *dynamic)


# --------------------------------------------------------- the affine and activation on x_hat


def activate(plan: NormActPlan, x_hat, scale, bias, *dynamic):
  """``act(scale * x_hat + bias)`` as the ops' forward makes it from the normalized input, with
  the activation's derivative from the spec table under JAX's autodiff: for a caller that keeps
  `x_hat` and makes this again in its backward pass (a norm, activation and convolution keeping
  one array)."""
  z = _preactivation(plan, x_hat, scale, bias)
  act = plan.act
  if act.fn is not None:
    return act.fn(z.astype(plan.out_dtype), *dynamic)
  spec = act.rule.spec
  if spec.jax_nn and not spec.jax_nn_kinks:
    # jax.nn's autodiff is the table's derivative here, and XLA fuses it into the backward's
    # sums where it stores the table's derivative (a U-Net step for an H100: one float32 array)
    return JAX_NN[spec.name](z, **act.rule.params(dynamic)).astype(plan.out_dtype)
  return activations.apply_rule(act.rule, z, *dynamic).astype(plan.out_dtype)
