"""The public norms: :func:`jaxact.rms_norm` and :func:`jaxact.layer_norm` (and the op the Flax
layers call, :func:`norm`): arguments checked, the plan built, the ``custom_vjp`` of
:mod:`jaxact._src.norms.vjp` run (what it keeps and why: that module's docstring).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jaxact._src.core import shardings, validation
from jaxact._src.norms import vjp
from jaxact._src.norms.plan import NormPlan, Residual


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
  validation.positive_epsilon(fn_name, epsilon)
  if residual not in ("output", "input"):
    raise ValueError(
      f"jaxact.{fn_name}: `residual` must be 'output' (keep y and its rms a row) or 'input' (keep "
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
  plan = NormPlan(
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


def _run(plan: NormPlan, x, scale, bias, out_sharding):
  return shardings.constrain(vjp.run(plan, x, scale, bias), out_sharding)


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
  inputs, on entries scaled into range (no overflow or NaN for any finite input), the output in
  `x`'s dtype. The backward pass reads ``y``, one float32 ``rms`` a row
  and ``scale``, not ``x``: ``x_hat = y / (o + scale)``, exact wherever :math:`o + \gamma \ne 0`
  (with Gemma's offset a zero scale is a factor of 1); where :math:`o + \gamma` is exactly 0 that
  channel's ``d scale`` and its own ``dx`` term are 0 (``x`` cannot be recovered from ``y``
  there); ``residual="input"`` keeps ``x`` and is exact everywhere.

  Args:
    x: the input, floating point.
    scale: ``gamma``, of the shape of `x` on the normalized axes, or None (1).
    epsilon: added to the mean square, > 0.
    axis: the normalized axis or axes.
    residual: ``"output"`` (default: keep ``y`` and ``rms``) or ``"input"`` (keep ``x``).
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
  are float32 for half precision inputs, as :func:`rms_norm`'s, the output in `x`'s dtype. The
  backward pass reads ``y``, one float32 ``sigma`` a row, ``scale`` and ``bias``, not ``x``:
  ``x_hat = (y - beta) / (o + scale)``, which carries ``y``'s rounding: an error of ``u (|x_hat|
  + |beta / (o + scale)|)`` (``u`` half an ulp of 1 in y's dtype), so prefer ``residual="input"``
  (keep ``x``, exact) where ``|beta|`` dwarfs ``|o + scale|``; where :math:`o + \gamma` is exactly
  0 that channel's ``d scale`` and its own ``dx`` term ``-r x_hat mean(dx_hat x_hat)`` are 0.

  Args:
    x: the input, floating point.
    scale: ``gamma``, of the shape of `x` on the normalized axes, or None (1).
    bias: ``beta``, of the same shape, or None (0).
    epsilon: added to the variance, > 0.
    axis: the normalized axis or axes.
    residual: ``"output"`` (default: keep ``y`` and ``sigma``) or ``"input"`` (keep ``x``).
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


def canonical_axes(ndim: int, axes) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted(a % ndim for a in axes))


def check_supported(layer: str, module, x, mask) -> tuple[int, ...]:
  """The normalized axes; ValueError for what one statistic a row of `x` cannot compute."""
  if mask is not None:
    raise ValueError(f"{layer}: `mask` is not supported (statistics over every element of a row)")
  if module.axis_name is not None or module.axis_index_groups is not None:
    raise ValueError(
      f"{layer}: `axis_name` / `axis_index_groups` (statistics across devices) are not supported; "
      f"got axis_name={module.axis_name!r}; use flax's layer for that"
    )
  axes = canonical_axes(x.ndim, module.reduction_axes)
  if canonical_axes(x.ndim, module.feature_axes) != axes:
    raise ValueError(
      f"{layer}: `feature_axes` {module.feature_axes!r} must be the `reduction_axes` "
      f"{module.reduction_axes!r} (a parameter per normalized element)"
    )
  return axes
