"""The public ops: :func:`jaxact.batch_norm_act` and :func:`jaxact.group_norm_act` (and the entries
the Flax layers call, :func:`batch` and :func:`group`): arguments checked, the plan built, the
``custom_vjp`` of :mod:`jaxact._src.norm_act.vjp` run (what it keeps and why: that module's
docstring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jaxact._src.activations.resolve import resolve_activation
from jaxact._src.core import dispatch, validation
from jaxact._src.core.dispatch import Implementation
from jaxact._src.norm_act import rules, vjp
from jaxact._src.norm_act.plan import NormActPlan

Activation = str | Callable[..., Array]


def _axes(fn_name: str, arg: str, axes, ndim: int) -> tuple[int, ...]:
  try:
    return validation.normalize_axes(fn_name, axes, ndim)
  except (TypeError, ValueError) as e:
    raise type(e)(str(e).replace("`axis`", f"`{arg}`")) from None


def _check_params(fn_name: str, x: Array, shape: tuple[int, ...], what: str, **params):
  out = []
  for arg, p in params.items():
    if p is not None:
      p = validation.as_float_array(fn_name, p, arg)
      if p.shape != shape:
        raise ValueError(
          f"jaxact.{fn_name}: `{arg}` has shape {p.shape}, but `x` {x.shape} has {shape} on "
          f"{what}; accepted: shape {shape}" + (" or None" if arg in ("scale", "bias") else "")
        )
    out.append(p)
  return out


def _check_axis_name(fn_name: str, axis_name, axis_index_groups):
  if axis_index_groups is not None and axis_name is None:
    raise ValueError(
      f"jaxact.{fn_name}: `axis_index_groups` {axis_index_groups!r} needs an `axis_name` (the "
      "named axis whose devices it groups)"
    )
  if axis_index_groups is None:
    return None
  try:
    return tuple(tuple(int(i) for i in group) for group in axis_index_groups)
  except TypeError:
    raise TypeError(
      f"jaxact.{fn_name}: `axis_index_groups` must be a sequence of sequences of device indices, "
      f"as lax.pmean takes it; got {axis_index_groups!r}"
    ) from None


def _plan(fn_name, x, activation, out_dtype, **fields) -> tuple[NormActPlan, list]:
  acc = np.dtype(jnp.promote_types(validation.compute_dtype(x.dtype), np.float32))
  out = np.dtype(x.dtype if out_dtype is None else out_dtype)
  acc = np.dtype(jnp.promote_types(acc, validation.compute_dtype(out)))
  act, dynamic = resolve_activation(fn_name, activation, jax.ShapeDtypeStruct(x.shape, acc), out)
  if act.residual == "code":
    raise ValueError(
      f"jaxact.{fn_name}: `activation` sets residual_bits, which has no use here: the op keeps "
      "the normalized input, not the pre-activation or its derivative code"
    )
  return NormActPlan(act=act, acc=acc, x_dtype=np.dtype(x.dtype), out_dtype=out, **fields), dynamic


def _decided(fn_name, implementation, plan: NormActPlan, x, scale, bias) -> NormActPlan:
  decision = rules.decide(fn_name, implementation, plan, x, scale, bias)
  return dataclasses.replace(plan, decision=decision)


def _check_implementation(fn_name: str, implementation) -> None:
  dispatch.check_implementation(fn_name, implementation, tuple(rules.FAMILY.implementations))


# ------------------------------------------------------------------------------- batch norm


def batch(
  fn_name: str,
  x,
  scale,
  bias,
  *,
  activation: Activation,
  axis,
  epsilon,
  mean,
  var,
  use_fast_variance,
  axis_name,
  axis_index_groups,
  out_dtype=None,
  implementation=None,
) -> tuple[Array, Array, Array]:
  """:func:`batch_norm_act` for `fn_name` (a Flax layer's name where it calls), output in
  `out_dtype` (None: x's)."""
  _check_implementation(fn_name, implementation)
  x = validation.as_float_array(fn_name, x, "x")
  if x.ndim == 0:
    raise ValueError(f"jaxact.{fn_name}: `x` must have at least one axis; got a scalar")
  features = _axes(fn_name, "axis", axis, x.ndim)
  shape = tuple(x.shape[a] for a in features)
  what = f"the feature axes {features}"
  scale, bias = _check_params(fn_name, x, shape, what, scale=scale, bias=bias)
  if (mean is None) != (var is None):
    missing, given = ("mean", "var") if mean is None else ("var", "mean")
    raise ValueError(
      f"jaxact.{fn_name}: `{given}` is given but `{missing}` is None: pass both (normalize with "
      "running averages) or neither (batch statistics)"
    )
  mean, var = _check_params(fn_name, x, shape, what, mean=mean, var=var)
  if mean is None and x.size == 0 and all(x.shape[a] for a in features):
    raise ValueError(
      f"jaxact.{fn_name}: `x` {x.shape} has no elements to take a feature's batch statistics "
      "over; pass `mean` and `var` to normalize an empty batch"
    )
  groups = _check_axis_name(fn_name, axis_name, axis_index_groups)
  plan, dynamic = _plan(
    fn_name,
    x,
    activation,
    out_dtype,
    groups=0,
    axes=tuple(d for d in range(x.ndim) if d not in features),
    feature_axes=features,
    epsilon=validation.positive_epsilon(fn_name, epsilon),
    axis_name=axis_name,
    axis_index_groups=groups,
  )
  plan = _decided(fn_name, implementation, plan, x, scale, bias)
  if mean is not None:
    broadcast = plan.feature_shape(x.ndim, x.shape)
    m, v = (a.astype(plan.acc).reshape(broadcast) for a in (mean, var))
    return vjp.infer(plan, x, scale, bias, m, v, *dynamic), mean, var
  y, mean, var = vjp.train(plan, x, scale, bias, *dynamic)
  return y, mean.reshape(shape), var.reshape(shape)


def batch_norm_act(
  x: ArrayLike,
  scale: ArrayLike | None = None,
  bias: ArrayLike | None = None,
  *,
  activation: Activation,
  axis: int | Sequence[int] = -1,
  epsilon: float = 1e-5,
  mean: ArrayLike | None = None,
  var: ArrayLike | None = None,
  use_fast_variance: bool = True,
  axis_name: Any = None,
  axis_index_groups: Any = None,
  implementation: Implementation | None = None,
) -> tuple[Array, Array, Array]:
  r"""Batch norm followed by an activation, keeping one array for the backward pass.

  .. math::
    y = \mathrm{act}\left(\gamma \, \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta\right)

  with :math:`\mu, \sigma^2` the mean and variance of each feature over every other axis (the
  batch statistics; averaged over the devices of `axis_name` with ``lax.pmean``), in float32
  (float64 for float64 inputs), in two passes whatever ``use_fast_variance``, on entries scaled
  into range: no overflow and no NaN for any finite input (the returned variance saturates at the
  dtype's max). Given `mean` and `var` (running averages) it normalizes with those instead.

  Kept for the backward pass: the normalized input :math:`\hat x` in `x`'s dtype, one float32
  number a feature (:math:`\sqrt{\sigma^2 + \epsilon}`) and the parameters; the pre-activation
  and the activation's derivative are recomputed from them. Every gradient is that of autodiff of
  the composition, for every `scale`: a zero scale needs nothing special, since :math:`\hat x` is
  kept, not recovered from ``y`` (In-Place ABN's ``|gamma| + eps`` is not needed), and a constant
  feature (variance 0) gives :math:`\hat x = 0` and finite gradients. Half precision inputs round
  :math:`\hat x` to their dtype before the scale and bias (forward and backward alike).

  Args:
    x: the input, floating point; features along `axis`.
    scale: :math:`\gamma`, of the shape of `x` on `axis`, or None (1).
    bias: :math:`\beta`, of that shape, or None (0).
    activation: a name (``"relu"``), a jaxact function, a ``jax.nn`` function, a
      ``functools.partial`` of one with keyword parameters, or any callable (its derivative from
      autodiff, re-run in the backward pass); ``"identity"`` for none.
    axis: the feature axis or axes (Flax's ``axis``); the statistics reduce every other axis.
    epsilon: added to the variance, > 0 (Flax's default 1e-5).
    mean: the running mean to normalize with (inference), of the shape of `scale`; given with
      `var` or not at all.
    var: the running variance, likewise.
    use_fast_variance: accepted (Flax's); the variance is the two-pass one either way.
    axis_name: the named axis (``shard_map``, ``pmap``) whose devices share the batch statistics,
      as Flax's; under ``jit`` with a sharded batch the statistics are global without it.
    axis_index_groups: groups of device indices of `axis_name` that share statistics.
    implementation: ``None`` (the best available: XLA until a GPU measures the kernels, see the
      dispatch docs), ``"xla"``, or ``"pallas"``: the Triton kernels of the normalize-and-activate
      epilogue, forward and backward (the statistics stay XLA's; channels-last, float32, bfloat16
      or float16, a spec-table activation with Python-number parameters, no `axis_name`, no
      sharded inputs). Kernels run in interpret mode off CUDA; calls they do not support raise
      ``NotImplementedError`` with the reason.

  Returns:
    ``(y, mean, var)``: ``y`` of `x`'s shape and dtype; the batch statistics (float32, or
    float64), which Flax's running averages are updated with, or the given `mean` and `var`.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, 4.0], [3.0, 0.0]])
    >>> y, mean, var = jaxact.batch_norm_act(x, activation="relu", epsilon=1e-12)
    >>> y.tolist(), mean.tolist(), var.tolist()
    ([[0.0, 1.0], [1.0, 0.0]], [2.0, 2.0], [1.0, 4.0])
  """
  fn_name = "batch_norm_act"
  with jax.named_scope(f"jaxact.{fn_name}"):
    return batch(
      fn_name,
      x,
      scale,
      bias,
      activation=activation,
      axis=axis,
      epsilon=epsilon,
      mean=mean,
      var=var,
      use_fast_variance=use_fast_variance,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      implementation=implementation,
    )


# ------------------------------------------------------------------------------- group norm


def _num_groups(fn_name: str, channels: int, num_groups, group_size) -> int:
  if (num_groups is None) == (group_size is None):
    raise ValueError(
      f"jaxact.{fn_name}: give exactly one of `num_groups` and `group_size`; got "
      f"num_groups={num_groups!r}, group_size={group_size!r} (for `group_size`, pass "
      "num_groups=None)"
    )
  arg, value = ("group_size", group_size) if num_groups is None else ("num_groups", num_groups)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"jaxact.{fn_name}: `{arg}` must be a positive int; got {value!r}")
  if channels % value:
    raise ValueError(
      f"jaxact.{fn_name}: `{arg}` {value} does not divide the {channels} channels of `x` (its "
      "last axis)"
    )
  return int(num_groups) if num_groups is not None else channels // int(group_size)


def group(
  fn_name: str,
  x,
  scale,
  bias,
  *,
  activation: Activation,
  num_groups,
  group_size,
  epsilon,
  reduction_axes,
  use_fast_variance,
  axis_name,
  axis_index_groups,
  out_dtype=None,
  implementation=None,
) -> Array:
  """:func:`group_norm_act` for `fn_name`, output in `out_dtype` (None: x's)."""
  _check_implementation(fn_name, implementation)
  x = validation.as_float_array(fn_name, x, "x")
  if x.ndim < 2:
    raise ValueError(
      f"jaxact.{fn_name}: `x` must have a batch axis and a channel axis (rank >= 2); got "
      f"shape {x.shape}"
    )
  channels = x.shape[-1]
  groups = _num_groups(fn_name, channels, num_groups, group_size)
  if reduction_axes is None:
    reduction_axes = tuple(range(1, x.ndim))
  axes = _axes(fn_name, "reduction_axes", reduction_axes, x.ndim)
  if axes[-1] != x.ndim - 1:
    raise ValueError(
      f"jaxact.{fn_name}: `reduction_axes` {reduction_axes!r} must include the last axis (the "
      "channels, which the groups split)"
    )
  scale, bias = _check_params(fn_name, x, (channels,), "its last axis", scale=scale, bias=bias)
  plan, dynamic = _plan(
    fn_name,
    x,
    activation,
    out_dtype,
    groups=groups,
    axes=(*axes[:-1], x.ndim),  # in the view (..., groups, channels // groups)
    feature_axes=(x.ndim - 1,),
    epsilon=validation.positive_epsilon(fn_name, epsilon),
    axis_name=axis_name,
    axis_index_groups=_check_axis_name(fn_name, axis_name, axis_index_groups),
  )
  plan = _decided(fn_name, implementation, plan, x, scale, bias)
  return vjp.train(plan, x, scale, bias, *dynamic)[0]


def group_norm_act(
  x: ArrayLike,
  scale: ArrayLike | None = None,
  bias: ArrayLike | None = None,
  *,
  activation: Activation,
  num_groups: int | None = 32,
  group_size: int | None = None,
  epsilon: float = 1e-6,
  reduction_axes: int | Sequence[int] | None = None,
  use_fast_variance: bool = True,
  axis_name: Any = None,
  axis_index_groups: Any = None,
  implementation: Implementation | None = None,
) -> Array:
  r"""Group norm followed by an activation, keeping one array for the backward pass.

  The channels (the last axis of `x`) are split into `num_groups` groups (or groups of
  `group_size`); each group of each example is normalized by its mean and variance over
  `reduction_axes` (default: every axis but the first, the batch), then scaled and shifted per
  channel and activated, as ``flax.linen.GroupNorm`` followed by the activation computes it (the
  statistics in float32, the variance as with :func:`batch_norm_act`). The diffusion U-Net block's
  ``silu(GroupNorm(x))`` is ``group_norm_act(x, scale, bias, activation="silu")``.

  Kept for the backward pass: the normalized input in `x`'s dtype, one float32 number a group of
  each example, and the parameters; exact for every `scale`, zero included (see
  :func:`batch_norm_act`).

  Args:
    x: the input, ``(batch, ..., channels)``, floating point.
    scale: :math:`\gamma`, of shape ``(channels,)``, or None.
    bias: :math:`\beta`, of shape ``(channels,)``, or None.
    activation: as :func:`batch_norm_act` takes it.
    num_groups: the number of groups (default 32; None when `group_size` is given).
    group_size: the channels a group (default None).
    epsilon: added to the variance, > 0 (Flax's default 1e-6).
    reduction_axes: the axes the statistics reduce, the last included (default: all but the
      first).
    use_fast_variance: accepted (Flax's), as :func:`batch_norm_act` takes it.
    axis_name: average the statistics over the devices of this named axis, as Flax's
      ``GroupNorm`` does.
    axis_index_groups: groups of device indices of `axis_name` that share statistics.
    implementation: as :func:`batch_norm_act` takes it (the kernels: the default
      `reduction_axes`, a statistic per example and group).

  Returns:
    ``y``, of `x`'s shape and dtype.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[[1.0, 3.0, 0.0, 0.0]]])  # (batch, spatial, channels)
    >>> y = jaxact.group_norm_act(x, activation="relu", num_groups=2, epsilon=1e-12)
    >>> y[0, 0].tolist()
    [0.0, 1.0, 0.0, 0.0]
  """
  fn_name = "group_norm_act"
  with jax.named_scope(f"jaxact.{fn_name}"):
    return group(
      fn_name,
      x,
      scale,
      bias,
      activation=activation,
      num_groups=num_groups,
      group_size=group_size,
      epsilon=epsilon,
      reduction_axes=reduction_axes,
      use_fast_variance=use_fast_variance,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      implementation=implementation,
    )


# ----------------------------------------------------------------------------- for the layers


def for_layer(layer: str, op, x, scale, bias, **kw):
  """`op` (:func:`batch` or :func:`group`) for a Flax layer named `layer`: errors name it."""
  fn_name = "batch_norm_act" if op is batch else "group_norm_act"
  if kw.pop("mask", None) is not None:
    raise ValueError(f"{layer}: `mask` is not supported (statistics over every element)")
  with jax.named_scope(f"jaxact.{fn_name}"):
    try:
      return op(fn_name, x, scale, bias, **kw)
    except (TypeError, ValueError) as e:
      raise type(e)(str(e).replace(f"jaxact.{fn_name}", layer, 1)) from None


def canonical_axes(layer: str, axes, ndim: int) -> tuple[int, ...]:
  """A layer's `axis` attribute as sorted non-negative ints (errors name the layer)."""
  try:
    return validation.normalize_axes("batch_norm_act", axes, ndim)
  except (TypeError, ValueError) as e:
    raise type(e)(str(e).replace("jaxact.batch_norm_act", layer, 1)) from None


def activate(layer: str, x_hat, scale, bias, *, activation: Activation, feature_axes, out_dtype):
  """``activation(scale * x_hat + bias)`` as :func:`batch` / :func:`group` make it from their
  normalized input (scale and bias along x's `feature_axes`), output in `out_dtype`; for a layer
  that keeps `x_hat` alone and makes this again in its backward pass."""
  try:
    plan, dynamic = _plan(
      "batch_norm_act",
      x_hat,
      activation,
      out_dtype,
      groups=0,
      axes=(),
      feature_axes=tuple(feature_axes),
      epsilon=1.0,
    )
  except (TypeError, ValueError) as e:
    raise type(e)(str(e).replace("jaxact.batch_norm_act", layer, 1)) from None
  return vjp.activate(plan, x_hat, scale, bias, *dynamic)


def refuse_use_bias(layer: str, use_bias) -> None:
  """A conv-and-norm layer takes no bare `use_bias`: ported from ``nn.Conv(use_bias=False)`` it
  would read as the norm's and silently drop its bias (a checkpoint's ``bias`` then unused)."""
  if use_bias is not None:
    raise TypeError(
      f"{layer}: `use_bias` (got {use_bias!r}) could be the convolution's or the norm's: pass "
      "`conv_use_bias` for the convolution's bias (nn.Conv's use_bias) or `norm_use_bias` for "
      "the norm's"
    )
