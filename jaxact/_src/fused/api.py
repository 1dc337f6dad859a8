"""Fused ``activation(x @ w + b)`` and ``activation(conv(x, w) + b)`` that keep only the output.

A layer written as ``jax.nn.relu(x @ w + b)`` leaves the backward pass to autodiff, which keeps the
pre-activation and, depending on what XLA fuses, more. The ops here are one ``custom_vjp`` each
(:mod:`jaxact._src.fused.vjp`), keeping the output where the activation's derivative can be
written from it. This module holds the public functions: they check their arguments
(:mod:`jaxact._src.core.args`, :mod:`jaxact._src.activations.resolve`), build the call's static
plan (:mod:`jaxact._src.fused.plan`) and ask :mod:`jaxact._src.fused.rules` which backend runs
it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike, DTypeLike

from jaxact._src.activations.resolve import resolve_activation
from jaxact._src.core import args, dispatch, dropout, shardings
from jaxact._src.core.dispatch import Implementation
from jaxact._src.fused import rules
from jaxact._src.fused.plan import Conv, Dense, Plan
from jaxact._src.fused.vjp import fused


def _run(fn_name, linear, x, w, b, activation, acc_dtype, out_dtype, implementation, drop=None):
  z = shardings.product_shape(fn_name, functools.partial(linear, acc_dtype=acc_dtype), x, w)
  act, dynamic = resolve_activation(fn_name, activation, z, out_dtype)
  drop, key = drop if drop is not None else (None, None)
  plan = Plan(linear, act, acc_dtype, out_dtype, b is not None, dropout=drop)
  x_dim, w_dim = linear.contraction_dims(x.ndim)
  x_gather = shardings.product_input(x, x_dim, w, w_dim)
  specs = shardings.specs(x, w, b)
  plan = dataclasses.replace(
    plan, shardings=specs, x_gather=x_gather, sharded=shardings.spread(specs)
  )
  if implementation != "xla":
    decision = rules.decide(fn_name, implementation, plan, x, w)
    plan = dataclasses.replace(plan, decision=decision)
  return fused(plan, x, w, b, key, *dynamic)


def _dense(
  fn_name, x, w, b, activation, precision, acc_dtype, out_dtype, impl, drop=None, out_sharding=None
) -> Array:
  if x.ndim < 1 or w.ndim != 2:
    raise ValueError(
      f"jaxact.{fn_name}: `x` must have rank >= 1 and `w` rank 2 (in, out); got "
      f"x.shape={x.shape}, w.shape={w.shape}"
    )
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
      f"jaxact.{fn_name}: `x` has {x.shape[-1]} features but `w` expects {w.shape[0]} "
      f"(x.shape={x.shape}, w.shape={w.shape})"
    )
  args.check_bias(fn_name, b, w.shape[1], w)
  out_sharding = shardings.check(fn_name, out_sharding, x.ndim)
  linear = Dense(args.hashable_precision(precision), shardings.typed(out_sharding))
  y = _run(fn_name, linear, x, w, b, activation, acc_dtype, out_dtype, impl, drop)
  return shardings.constrain(y, out_sharding)


# ------------------------------------------------------------------------- public functions


def dense_bias_act(
  x: ArrayLike,
  w: ArrayLike,
  b: ArrayLike | None = None,
  *,
  activation: str | Callable[..., Array],
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  implementation: Implementation | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: ArrayLike | None = None,
  dropout_broadcast_dims: Sequence[int] = (),
  out_sharding: NamedSharding | PartitionSpec | None = None,
) -> Array:
  r"""Dense layer with bias and activation, keeping only the output for the backward pass.

  Computes

  .. math::
    y = \mathrm{activation}(x W + b)

  as one op whose gradient rule computes :math:`\bar z = \bar y \odot \mathrm{act}'` once, then
  :math:`\bar b = \sum \bar z` over every axis but the last, :math:`\bar x = \bar z W^\top` and
  :math:`\bar W = x^\top \bar z`.

  Saved residual: the output ``y`` (plus ``x`` and ``w``, which :math:`\bar W` and :math:`\bar x`
  need anyway) for activations whose derivative the output determines (relu, tanh, sigmoid, elu,
  softplus, ...); the pre-activation :math:`z = xW + b` instead for the others (gelu, silu, mish,
  ...) and for output ones whose parameters are traced or make the output insufficient (e.g.
  ``leaky_relu`` with a slope <= 0); nothing beyond ``x`` and ``w`` for identity. Derivatives at
  kinks follow the jaxact activation's convention (see its docstring).

  ``activation`` is a name (``"relu"``), a jaxact function (``jaxact.elu``), a :mod:`jax.nn`
  function (``jax.nn.relu``, or Flax's re-export ``nn.relu``), or a ``functools.partial`` of one
  with keyword parameters (``partial(jax.nn.leaky_relu, negative_slope=0.2)``); jaxact's own
  derivative rule is used. Any other callable (a lambda, and glu/softmax/log_softmax, which are not
  elementwise) is applied to the pre-activation in the output dtype; the pre-activation is then
  kept and the callable's gradient comes from JAX's autodiff of it, re-run in the backward pass.

  Inputs of different dtypes are promoted as ``x @ w + b`` promotes them. Half precision
  (float16/bfloat16) accumulates in float32, applies the activation in float32 and returns (and
  keeps) its own dtype.

  With ``dropout_rate > 0`` the op ends with Flax's dropout of its output, ``select(mask, y / (1 -
  rate), 0)`` with ``mask = jax.random.bernoulli(dropout_rng, 1 - rate, shape)`` (the values
  ``nn.Dropout`` gives with the same key), and keeps the key instead of the mask: the backward
  draws it again. It keeps nothing more than without dropout: for output-residual activations the
  dropped output itself, which the next layer keeps anyway. Dropout runs on XLA's path (the
  kernels decline it).

  Args:
    x: input of shape ``(..., in)``, floating point.
    w: kernel of shape ``(in, out)``.
    b: bias of shape ``(out,)``, or None for no bias.
    activation: the activation (see above).
    precision: passed to :func:`jax.lax.dot_general` in the forward and backward passes.
    preferred_element_type: dtype of the result; accumulation is at least float32 and at least
      this wide. Default: the (promoted) input dtype.
    implementation: ``None`` (the best available: when lowered for a Hopper GPU, the Mosaic GPU
      forward kernel with XLA's backward for the calls it supports; on other CUDA GPUs the Triton
      kernels for the calls they support; XLA otherwise), ``"xla"``, ``"pallas"`` (the Triton
      kernels) or ``"mosaic"`` (the Hopper kernels, forward and backward: bfloat16/float16, ``M``
      a multiple of 128, ``N`` of 256, ``K`` of 64). Kernels run in interpret mode off CUDA;
      calls they do not support raise ``NotImplementedError``.
    dropout_rate: the probability of dropping an element of the output (default 0: no dropout).
    dropout_rng: the dropout's PRNG key (``jax.random.key``, or a raw ``jax.random.PRNGKey``);
      required when ``dropout_rate > 0``.
    dropout_broadcast_dims: output axes that share one mask, as ``nn.Dropout``'s
      ``broadcast_dims``.
    out_sharding: the output's sharding, as ``jnp.dot`` takes it (a ``PartitionSpec`` of the
      current mesh or a ``NamedSharding``). Under Explicit mesh axes it is needed where ``x``'s and
      ``w``'s contraction dimensions are both sharded (FSDP weights with feature-sharded
      activations); it goes to the forward's ``lax.dot_general``, so XLA partitions the product
      as it would ``jnp.dot(x, w, out_sharding=...)``, and the backward's transposes give ``dx``
      and ``dw`` their inputs' shardings (``db`` too). Under Auto axes it is a sharding
      constraint on the output.

  Returns:
    ``activation(x @ w + b)``, of shape ``(..., out)``, dropped out when ``dropout_rate > 0``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, -2.0], [0.5, 1.0]])
    >>> w = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    >>> jaxact.dense_bias_act(x, w, jnp.array([0.5, 0.0]), activation="relu").tolist()
    [[0.0, 0.0], [2.0, 1.0]]
  """
  fn_name = "dense_bias_act"
  with jax.named_scope(f"jaxact.{fn_name}"):
    dispatch.check_implementation(fn_name, implementation)
    x, w, b, acc, out = args.prepare(fn_name, x, w, b, preferred_element_type)
    drop = dropout.check(fn_name, dropout_rate, dropout_rng, dropout_broadcast_dims, max(x.ndim, 1))
    return _dense(
      fn_name, x, w, b, activation, precision, acc, out, implementation, drop, out_sharding
    )


def conv_bias_act(
  x: ArrayLike,
  w: ArrayLike,
  b: ArrayLike | None = None,
  *,
  activation: str | Callable[..., Array],
  window_strides: int | Sequence[int] = 1,
  padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = "SAME",
  lhs_dilation: int | Sequence[int] = 1,
  rhs_dilation: int | Sequence[int] = 1,
  feature_group_count: int = 1,
  dimension_numbers: lax.ConvGeneralDilatedDimensionNumbers | None = None,
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  implementation: Implementation | None = None,
  out_sharding: NamedSharding | PartitionSpec | None = None,
) -> Array:
  r"""Convolution with bias and activation, keeping only the output for the backward pass.

  Computes

  .. math::
    y = \mathrm{activation}(\mathrm{conv}(x, W) + b)

  with :func:`jax.lax.conv_general_dilated`'s meaning for every argument, as one op whose gradient
  rule computes :math:`\bar z = \bar y \odot \mathrm{act}'` once, :math:`\bar b` as the sum of
  :math:`\bar z` over every axis but the output-feature one, and :math:`\bar x`, :math:`\bar W` from
  the transposes of the convolution. A 1x1 kernel with unit strides, no input dilation, one
  feature group and no padding takes :func:`dense_bias_act`'s path (a matmul).

  Saved residual, ``activation``, dtypes: as :func:`dense_bias_act` (the output ``y`` plus ``x``
  and ``w`` for output-residual activations; the pre-activation for the others).

  Args:
    x: input, channels-last by default: ``(N, W, C)``, ``(N, H, W, C)``, ``(N, D, H, W, C)``.
    w: kernel, by default ``(W, C // feature_group_count, O)``, ``(H, W, ..., O)``, ...
    b: bias of shape ``(O,)``, or None for no bias.
    activation: a name, a jaxact function, a ``functools.partial`` of one, or a callable.
    window_strides: an int or one int per spatial dimension.
    padding: ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``, an int (the same on both sides of every
      spatial dimension), one int per spatial dimension, or one ``(low, high)`` pair per spatial
      dimension.
    lhs_dilation: input dilation, an int or one per spatial dimension.
    rhs_dilation: kernel dilation, an int or one per spatial dimension.
    feature_group_count: number of feature groups (``C`` and ``O`` must be multiples of it).
    dimension_numbers: as :func:`jax.lax.conv_general_dilated`; default: Flax's channels-last
      layouts (NWC/WIO, NHWC/HWIO, NDHWC/DHWIO). The bias is added along the output's feature dim.
    precision: passed to the convolution in the forward and backward passes.
    preferred_element_type: dtype of the result; accumulation is at least float32.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"mosaic"``: with the Pallas kernels,
      the convolution and its transposes stay with XLA and the bias + activation epilogue and its
      backward (dz and db in one pass) are kernels; channels-last outputs only. ``"mosaic"`` (the
      Hopper dense kernels) applies to 1x1 unit-stride convolutions only, which are dense layers.
    out_sharding: the output's sharding, as :func:`jax.lax.conv_general_dilated` takes it (under
      Explicit mesh axes needed where the kernel is sharded; see :func:`dense_bias_act`).

  Returns:
    ``activation(conv(x, w) + b)``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.arange(4.0).reshape(1, 4, 1)  # (N, W, C)
    >>> w = jnp.array([1.0, -1.0]).reshape(2, 1, 1)  # (W, C, O)
    >>> y = jaxact.conv_bias_act(x, w, jnp.array([0.5]), activation="relu", padding="VALID")
    >>> y[0, :, 0].tolist()
    [0.0, 0.0, 0.0]
    >>> y = jaxact.conv_bias_act(x, -w, jnp.array([0.5]), activation="relu", padding="VALID")
    >>> y[0, :, 0].tolist()
    [1.5, 1.5, 1.5]
  """
  fn_name = "conv_bias_act"
  with jax.named_scope(f"jaxact.{fn_name}"):
    dispatch.check_implementation(fn_name, implementation)
    x, w, b, acc, out = args.prepare(fn_name, x, w, b, preferred_element_type)
    if x.ndim != w.ndim or x.ndim < 3:
      raise ValueError(
        f"jaxact.{fn_name}: `x` and `w` must have the same rank, at least 3 (batch, spatial..., "
        f"features); got x.shape={x.shape} (rank {x.ndim}), w.shape={w.shape} (rank {w.ndim})"
      )
    n = x.ndim - 2
    if dimension_numbers is None:
      dn = args.channels_last(x.ndim)
    else:
      try:
        dn = lax.conv_dimension_numbers(x.shape, w.shape, dimension_numbers)
      except (TypeError, ValueError) as e:
        raise ValueError(
          f"jaxact.{fn_name}: `dimension_numbers` {dimension_numbers!r} does not fit "
          f"x.shape={x.shape}, w.shape={w.shape}: {e}"
        ) from None
    strides = args.int_tuple(fn_name, "window_strides", window_strides, n)
    lhs_dil = args.int_tuple(fn_name, "lhs_dilation", lhs_dilation, n)
    rhs_dil = args.int_tuple(fn_name, "rhs_dilation", rhs_dilation, n)
    spatial = tuple(x.shape[d] for d in dn.lhs_spec[2:])
    kernel = tuple(w.shape[d] for d in dn.rhs_spec[2:])
    pads = args.conv_padding(fn_name, padding, spatial, kernel, strides, lhs_dil, rhs_dil)
    groups = feature_group_count
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
      raise ValueError(
        f"jaxact.{fn_name}: `feature_group_count` must be a positive int; got {groups!r}"
      )
    groups = int(groups)
    c_in, w_in, w_out = x.shape[dn.lhs_spec[1]], w.shape[dn.rhs_spec[1]], w.shape[dn.rhs_spec[0]]
    if c_in != w_in * groups:
      raise ValueError(
        f"jaxact.{fn_name}: `x` has {c_in} features but `w` expects {w_in * groups} "
        f"({w_in} per group x feature_group_count={groups}) (x.shape={x.shape}, w.shape={w.shape})"
      )
    if w_out % groups:
      raise ValueError(
        f"jaxact.{fn_name}: `w` has {w_out} output features, which feature_group_count={groups} "
        f"does not divide (w.shape={w.shape})"
      )
    args.check_bias(fn_name, b, w_out, w)
    if (
      dn == args.channels_last(x.ndim)
      and kernel == (1,) * n
      and pads == ((0, 0),) * n
      and strides == (1,) * n
      and lhs_dil == (1,) * n
      and groups == 1
    ):
      # A 1x1 kernel is a matmul over the channels; rhs_dilation of a size-1 window is a no-op.
      w2 = w.reshape(w.shape[-2], w.shape[-1])
      return _dense(
        fn_name, x, w2, b, activation, precision, acc, out, implementation, None, out_sharding
      )
    out_sharding = shardings.check(fn_name, out_sharding, x.ndim)
    precision = args.hashable_precision(precision)
    typed = shardings.typed(out_sharding)
    linear = Conv(strides, pads, lhs_dil, rhs_dil, dn, groups, precision, typed)
    y = _run(fn_name, linear, x, w, b, activation, acc, out, implementation)
    return shardings.constrain(y, out_sharding)
