"""RMS and layer norms that keep their output: the backward reads ``y`` and one number a row.

In a pre-norm block ``y = norm(x)`` feeds a matmul, which keeps ``y`` for its weight gradient.
Autodiff of the norm keeps ``x`` as well (and, for half precision, a float32 copy of it), though
the backward can be written from ``y``: the normalized input is ``x̂ = y / gamma`` (RMS norm) or
``(y - beta) / gamma`` (layer norm), where ``gamma = scale_offset + scale`` (``scale_offset`` is 0,
or 1 for Gemma's ``x̂ (1 + scale)``), and with the per-row ``r = 1 / sqrt(var + ε)``

.. math::
  \\bar x = r \\left(\\bar{\\hat x} - \\overline{\\bar{\\hat x}} - \\hat x \\,
  \\overline{\\bar{\\hat x} \\hat x}\\right), \\quad \\bar{\\hat x} = \\bar y \\gamma

(the mean of :math:`\\bar{\\hat x}` is absent for RMS norm; overlines are means over the normalized
axes). So each op is one ``custom_vjp`` keeping ``y`` (the array the next matmul keeps anyway),
``r`` in float32 and the parameters; the block input ``x`` need not be kept at all.

Where ``gamma`` is exactly 0 the input cannot be recovered from ``y``: there ``x̂`` is taken as 0, so
that channel's ``dgamma`` and (RMS norm, layer norm) its own ``dx`` term ``-r x̂ mean(dx̂ x̂)`` are 0;
every other channel's gradient is exact. ``residual="input"`` keeps ``x`` instead and is exact
everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import barriers, shardings, validation

Residual = Literal["output", "input"]


@dataclasses.dataclass(frozen=True)
class _Plan:
  center: bool  # layer norm subtracts the mean; RMS norm does not
  axes: tuple[int, ...]
  epsilon: float
  residual: Residual
  acc: np.dtype  # statistics and arithmetic: float32, or float64 for float64 inputs
  x_dtype: np.dtype
  out_dtype: np.dtype  # x's, or a Flax layer's promoted dtype
  scale_offset: float = 0.0  # gamma = scale_offset + scale (Gemma: 1)
  # Explicit mesh axes: the specs of x, scale, bias (their cotangents' types) and y's sharding
  # when the caller asked for one (y is resharded to it, and kept so).
  shardings: tuple = (None, None, None)
  out_sharding: Any = None

  def feature_shape(self, x_shape) -> tuple[int, ...]:
    """The broadcast shape of a parameter: x's sizes on the normalized axes, 1 elsewhere."""
    return tuple(n if d in self.axes else 1 for d, n in enumerate(x_shape))


def _param(plan: _Plan, p: Array | None, like: Array) -> Array | None:
  """`p` in the accumulation dtype, broadcastable to `like` and split as its features are."""
  if p is None:
    return None
  return shardings.align(p.astype(plan.acc).reshape(plan.feature_shape(like.shape)), like)


def _gamma(plan: _Plan, scale: Array | None, like: Array) -> Array | None:
  """``scale_offset + scale`` in the accumulation dtype, broadcastable to `like`."""
  gamma = _param(plan, scale, like)
  return gamma if gamma is None or not plan.scale_offset else gamma + plan.scale_offset


def _normalized(plan: _Plan, x: Array) -> tuple[Array, Array]:
  """``(x̂, r)`` in the accumulation dtype, r with the normalized axes kept (size 1)."""
  xf = x.astype(plan.acc)
  if plan.center:
    xf = xf - jnp.mean(xf, plan.axes, keepdims=True)
  r = lax.rsqrt(jnp.mean(xf * xf, plan.axes, keepdims=True) + jnp.asarray(plan.epsilon, plan.acc))
  return xf * r, r


def _forward(plan: _Plan, x, scale, bias):
  x_hat, r = _normalized(plan, x)
  y = x_hat
  if scale is not None:
    y = y * _gamma(plan, scale, x)
  if bias is not None:
    y = y + _param(plan, bias, x)
  y = y.astype(plan.out_dtype)
  if plan.out_sharding is not None:  # y as asked, and r split as y's rows
    y = shardings.reshard(y, plan.out_sharding)
    rows = shardings.spec_of_sharding(plan.out_sharding, y.ndim)
    r = shardings.to_spec(r, tuple(() if d in plan.axes else a for d, a in enumerate(rows)))
  return y, r


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(plan: _Plan, x, scale, bias):
  return _forward(plan, x, scale, bias)[0]


def _norm_fwd(plan: _Plan, x, scale, bias):
  y, r = _forward(plan, x, scale, bias)
  if plan.residual == "input":
    return y, (x, None, scale, bias)
  # The barrier makes the kept y the returned array (one buffer) and keeps XLA from recomputing it
  # from x in the backward pass, which would keep x alive as well.
  y, r = lax.optimization_barrier((y, r))
  return y, (y, r, scale, bias)


def _norm_bwd(plan: _Plan, res, g):
  kept, r, scale, bias = res
  x_spec = plan.shardings[0]
  if plan.residual == "input" and x_spec is not None:
    g = shardings.to_spec(g, x_spec)  # the arithmetic below pairs g with x
  (kept, r), g = barriers.after_cotangent((kept, r), g)
  acc = plan.acc
  gamma, beta = _gamma(plan, scale, g), _param(plan, bias, g)
  if plan.residual == "input":
    x_hat, r = _normalized(plan, kept)
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
  return shardings.retype(((r * inner).astype(plan.x_dtype), d_scale, d_bias), plan.shardings)


_norm.defvjp(_norm_fwd, _norm_bwd)
_norm_jit = jax.jit(_norm, static_argnums=0)


def _check(
  fn_name,
  x,
  scale,
  bias,
  epsilon,
  axis,
  residual,
  out_dtype=None,
  scale_offset=0.0,
  out_sharding=None,
):
  x = validation.as_real_array(fn_name, x)
  if not validation.is_floating(x.dtype):
    raise TypeError(
      f"jaxact.{fn_name}: `x` has dtype {x.dtype}; accepted: floating-point dtypes (float16, "
      "bfloat16, float32, float64)"
    )
  if x.ndim == 0:
    raise ValueError(
      f"jaxact.{fn_name}: `x` must have at least one axis to normalize; got a scalar"
    )
  axes = validation.normalize_axes(fn_name, axis, x.ndim)
  if (
    isinstance(epsilon, bool)
    or not isinstance(epsilon, numbers.Real)
    or not np.isfinite(epsilon)
    or epsilon <= 0
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `epsilon` must be a positive finite float; got {epsilon!r}"
    )
  if residual not in ("output", "input"):
    raise ValueError(
      f"jaxact.{fn_name}: `residual` must be 'output' (keep y and 1/rms a row) or 'input' (keep "
      f"x); got {residual!r}"
    )
  if isinstance(scale_offset, (bool, np.bool_)) or not isinstance(scale_offset, numbers.Real):
    raise TypeError(
      f"jaxact.{fn_name}: `scale_offset` must be a Python float (0.0, or 1.0 for Gemma's "
      f"x_hat * (1 + scale)); got {type(scale_offset).__name__} {scale_offset!r}"
    )
  if not np.isfinite(scale_offset):
    raise ValueError(f"jaxact.{fn_name}: `scale_offset` must be finite; got {scale_offset!r}")
  if scale is None and scale_offset != 0:
    raise ValueError(
      f"jaxact.{fn_name}: `scale_offset` {scale_offset!r} is added to `scale` (y = x_hat * "
      "(scale_offset + scale)), but `scale` is None; pass the scale, or scale_offset=0.0"
    )
  features = tuple(x.shape[d] for d in axes)
  params = []
  for arg, p in (("scale", scale), ("bias", bias)):
    if p is not None:
      p = validation.as_real_array(fn_name, p, arg)
      if not validation.is_floating(p.dtype):
        raise TypeError(
          f"jaxact.{fn_name}: `{arg}` has dtype {p.dtype}; accepted: floating-point dtypes"
        )
      if p.shape != features:
        raise ValueError(
          f"jaxact.{fn_name}: `{arg}` has shape {p.shape}, but `x` {x.shape} has {features} on the "
          f"normalized axes {axes}; accepted: shape {features} or None"
        )
    params.append(p)
  acc = np.dtype(jnp.promote_types(validation.compute_dtype(x.dtype), np.float32))
  out = np.dtype(x.dtype if out_dtype is None else out_dtype)
  acc = np.dtype(jnp.promote_types(acc, validation.compute_dtype(out)))
  plan = _Plan(
    fn_name == "layer_norm",
    axes,
    float(epsilon),
    residual,
    acc,
    np.dtype(x.dtype),
    out,
    float(scale_offset),
    shardings.specs(x, *params),
    shardings.typed(shardings.check(fn_name, out_sharding, x.ndim)),
  )
  return plan, x, *params


def _run(plan: _Plan, x, scale, bias, out_sharding):
  return shardings.constrain(_norm_jit(plan, x, scale, bias), out_sharding)


def norm(
  layer: str,
  center: bool,
  x,
  scale,
  bias,
  *,
  epsilon,
  axis,
  residual,
  out_dtype,
  scale_offset=0.0,
  out_sharding=None,
):
  """The op for a Flax layer named `layer` (errors name it): `center` layer norm, else RMS norm;
  the output in `out_dtype` (Flax's promoted dtype)."""
  fn_name = "layer_norm" if center else "rms_norm"
  with jax.named_scope(f"jaxact.{fn_name}"):
    try:
      plan, x, scale, bias = _check(
        fn_name, x, scale, bias, epsilon, axis, residual, out_dtype, scale_offset, out_sharding
      )
    except (TypeError, ValueError) as e:
      raise type(e)(str(e).replace(f"jaxact.{fn_name}", layer, 1)) from None
    return _run(plan, x, scale, bias, out_sharding)


def rms_norm(
  x: ArrayLike,
  scale: ArrayLike | None = None,
  *,
  epsilon: float = 1e-6,
  axis: int | tuple[int, ...] = -1,
  residual: Residual = "output",
  scale_offset: float = 0.0,
  out_sharding=None,
) -> Array:
  r"""RMS norm keeping its output for the backward pass.

  .. math::
    y = \frac{x}{\sqrt{\overline{x^2} + \epsilon}} \, (o + \gamma)

  with the mean over `axis` and :math:`o` the ``scale_offset``. With the default :math:`o = 0`
  this is ``flax.linen.RMSNorm`` (Llama's, Mistral's, T5's norm). Gemma's ``RMSNorm`` computes
  ``x_hat * (1 + scale)`` with a scale initialised to zeros: pass ``scale_offset=1.0`` to load its
  checkpoints (without it a Gemma scale of zeros gives an output of zeros and, from ``y = 0``, a
  scale gradient of 0: it would never train). The statistics are float32 for half precision
  inputs, the output in `x`'s dtype. The backward pass reads ``y``, one float32 ``1/rms`` a row
  and ``scale``, not ``x``: ``x_hat = y / (o + scale)``, exact wherever :math:`o + \gamma \ne 0`
  (with Gemma's offset a zero scale is a factor of 1); where :math:`o + \gamma` is exactly 0 that
  channel's ``d scale`` and its own ``dx`` term are 0 (``x`` cannot be recovered from ``y``
  there); ``residual="input"`` keeps ``x`` and is exact everywhere.

  Args:
    x: the input, floating point.
    scale: ``gamma``, of the shape of `x` on the normalized axes, or None (1).
    epsilon: added to the mean square, > 0.
    axis: the normalized axis or axes.
    residual: ``"output"`` (default: keep ``y`` and ``1/rms``) or ``"input"`` (keep ``x``).
    scale_offset: :math:`o`, a Python float added to ``scale`` (0.0; 1.0 for Gemma); needs a
      ``scale``.
    out_sharding: ``y``'s sharding (a ``PartitionSpec`` or ``NamedSharding``), or None for
      ``x``'s. Under Explicit mesh axes ``y`` is resharded to it and kept so (the backward
      computes in that sharding and gives ``dx`` ``x``'s); under Auto axes it is a sharding
      constraint. Each gradient has its input's sharding (a replicated ``scale`` of
      feature-sharded rows gets a replicated gradient).

  Returns:
    ``y``, of `x`'s shape and dtype.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> y = jaxact.rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]), epsilon=1e-12)
    >>> [round(v, 4) for v in y[0].tolist()]
    [0.8485, 2.2627]
    >>> gemma_scale = jnp.zeros(2)  # Gemma's initial scale: x_hat * (1 + 0)
    >>> y = jaxact.rms_norm(jnp.array([[3.0, 4.0]]), gemma_scale, scale_offset=1.0, epsilon=1e-12)
    >>> [round(v, 4) for v in y[0].tolist()]
    [0.8485, 1.1314]
  """
  fn_name = "rms_norm"
  with jax.named_scope(f"jaxact.{fn_name}"):
    plan, x, scale, _ = _check(
      fn_name,
      x,
      scale,
      None,
      epsilon,
      axis,
      residual,
      scale_offset=scale_offset,
      out_sharding=out_sharding,
    )
    return _run(plan, x, scale, None, out_sharding)


def layer_norm(
  x: ArrayLike,
  scale: ArrayLike | None = None,
  bias: ArrayLike | None = None,
  *,
  epsilon: float = 1e-6,
  axis: int | tuple[int, ...] = -1,
  residual: Residual = "output",
  scale_offset: float = 0.0,
  out_sharding=None,
) -> Array:
  r"""Layer norm keeping its output for the backward pass.

  .. math::
    y = \frac{x - \bar x}{\sqrt{\overline{(x - \bar x)^2} + \epsilon}} (o + \gamma) + \beta

  with the means over `axis` and :math:`o` the ``scale_offset``; with the default :math:`o = 0`,
  as ``flax.linen.LayerNorm`` computes it (the variance in two passes). ``scale_offset=1.0`` is
  the ``1 + scale`` parametrization (a scale initialised to zeros, as Gemma's RMS norm). Statistics
  are float32 for half precision inputs, the output in `x`'s dtype. The backward pass reads ``y``,
  one float32 ``1/sigma`` a row, ``scale`` and ``bias``, not ``x``: ``x_hat = (y - beta) / (o +
  scale)``; where :math:`o + \gamma` is exactly 0 that channel's ``d scale`` and its own ``dx``
  term ``-r x_hat mean(dx_hat x_hat)`` are 0; ``residual="input"`` keeps ``x``.

  Args:
    x: the input, floating point.
    scale: ``gamma``, of the shape of `x` on the normalized axes, or None (1).
    bias: ``beta``, of the same shape, or None (0).
    epsilon: added to the variance, > 0.
    axis: the normalized axis or axes.
    residual: ``"output"`` (default: keep ``y`` and ``1/sigma``) or ``"input"`` (keep ``x``).
    scale_offset: :math:`o`, a Python float added to ``scale`` (default 0.0); needs a ``scale``.
    out_sharding: ``y``'s sharding, or None for ``x``'s; as :func:`rms_norm` takes it.

  Returns:
    ``y``, of `x`'s shape and dtype.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> y = jaxact.layer_norm(jnp.array([[1.0, 3.0]]), bias=jnp.array([0.5, 0.5]))
    >>> [round(v, 4) for v in y[0].tolist()]
    [-0.5, 1.5]
  """
  fn_name = "layer_norm"
  with jax.named_scope(f"jaxact.{fn_name}"):
    plan, x, scale, bias = _check(
      fn_name,
      x,
      scale,
      bias,
      epsilon,
      axis,
      residual,
      scale_offset=scale_offset,
      out_sharding=out_sharding,
    )
    return _run(plan, x, scale, bias, out_sharding)
