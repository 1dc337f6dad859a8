"""``flax.nnx.BatchNorm`` / ``GroupNorm`` followed by an activation, computed by
:func:`jaxact.batch_norm_act` / :func:`jaxact.group_norm_act`, which keep the normalized input
(and one float32 number a statistic) for the backward pass.

Each subclasses Flax's layer and adds the keyword argument ``activation`` (default
``"identity"``: the layer is Flax's): the arguments, attributes, parameters and batch statistics
are Flax's, made by its ``__init__``, so the same ``rngs`` give the same parameters and
checkpoints load both ways. A ``mask`` raises a ``ValueError``.

``ConvNormAct`` holds ``nnx.Conv`` (no bias) and one of those, and its backward pass keeps only
the layer's input: the convolution is made again in the backward pass (``jax.checkpoint``).
"""

from __future__ import annotations

import functools
import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.nnx.nn.linear import default_kernel_init
from flax.typing import Array, Axes, Dtype, Initializer, PaddingLike, PrecisionLike, PromoteDtypeFn

from jaxact._src.layers.common import Activation, check_activation
from jaxact._src.norm_act import api as norm_act


class BatchNorm(nnx.BatchNorm):
  """``flax.nnx.BatchNorm`` then ``activation``, as one op (:func:`jaxact.batch_norm_act`).

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import BatchNorm
    >>> bn = BatchNorm(3, activation="relu", rngs=nnx.Rngs(0))
    >>> bn(jnp.ones((4, 3))).shape, bn.mean.shape
    ((4, 3), (3,))

  Args:
    num_features, use_running_average, axis, momentum, epsilon, dtype, param_dtype, use_bias,
      use_scale, bias_init, scale_init, axis_name, axis_index_groups, use_fast_variance,
      promote_dtype, rngs, bias_metadata, scale_metadata: as ``flax.nnx.BatchNorm``'s.
    activation: applied to the normalized output (default ``"identity"``).
  """

  def __init__(
    self,
    num_features: int,
    *,
    use_running_average: bool | None = False,
    axis: int = -1,
    momentum: float = 0.99,
    epsilon: float = 1e-5,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    use_bias: bool = True,
    use_scale: bool = True,
    bias_init: Initializer = initializers.zeros,
    scale_init: Initializer = initializers.ones,
    axis_name: str | None = None,
    axis_index_groups: tp.Any = None,
    use_fast_variance: bool = True,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    rngs: nnx.Rngs,
    bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    activation: Activation = "identity",
  ):
    check_activation("jaxact.nnx.BatchNorm", activation)
    super().__init__(
      num_features,
      use_running_average=use_running_average,
      axis=axis,
      momentum=momentum,
      epsilon=epsilon,
      dtype=dtype,
      param_dtype=param_dtype,
      use_bias=use_bias,
      use_scale=use_scale,
      bias_init=bias_init,
      scale_init=scale_init,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      use_fast_variance=use_fast_variance,
      promote_dtype=promote_dtype,
      rngs=rngs,
      bias_metadata=bias_metadata,
      scale_metadata=scale_metadata,
    )
    self.activation = activation

  def __call__(self, x, use_running_average: bool | None = None, *, mask: Array | None = None):
    """``activation(BatchNorm(x))``; in training the batch statistics update ``mean`` / ``var``."""
    return self._run(x, use_running_average, mask)[0]

  def _run(self, x, use_running_average, mask, affine: bool = True):
    """``(y, scale, bias)`` (promoted as x is); without `affine`, y is x normalized alone, the
    scale, bias and activation left to the caller."""
    layer = "jaxact.nnx.BatchNorm"
    if use_running_average is None:
      use_running_average = self.use_running_average
    if use_running_average is None:
      raise ValueError(
        f"{layer}: no `use_running_average`: pass it to the constructor or to the call"
      )
    axes = norm_act.canonical_axes(layer, self.axis, x.ndim)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, mean, var, scale, bias = self.promote_dtype(
      (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
    )
    given = (mean, var) if use_running_average else (None, None)
    y, mean, var = norm_act.for_layer(
      layer,
      norm_act.batch,
      x,
      scale if affine else None,
      bias if affine else None,
      activation=self.activation if affine else "identity",
      axis=axes,
      epsilon=self.epsilon,
      mean=given[0],
      var=given[1],
      use_fast_variance=self.use_fast_variance,
      axis_name=self.axis_name,
      axis_index_groups=self.axis_index_groups,
      mask=mask,
    )
    if not use_running_average:
      # as Flax: stop_gradient only where the variables are array refs
      stop = jax.lax.stop_gradient if self.mean._can_update or self.var._can_update else None
      for v, stat in ((self.mean, mean), (self.var, var)):
        # in the variable's dtype, as Flax's assignment casts it (a float64 input under x64 would
        # otherwise write float64 into a float32 variable: a FutureWarning today, an error later)
        new = (self.momentum * v[...] + (1 - self.momentum) * stat).astype(v.dtype)
        v[...] = stop(new) if stop is not None else new
    return y, scale, bias


class GroupNorm(nnx.GroupNorm):
  """``flax.nnx.GroupNorm`` then ``activation``, as one op (:func:`jaxact.group_norm_act`).

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import GroupNorm
    >>> gn = GroupNorm(4, num_groups=2, activation="silu", rngs=nnx.Rngs(0))
    >>> gn(jnp.ones((2, 5, 4))).shape
    (2, 5, 4)

  Args:
    num_features, num_groups, group_size, epsilon, dtype, param_dtype, use_bias, use_scale,
      bias_init, scale_init, reduction_axes, axis_name, axis_index_groups, use_fast_variance,
      promote_dtype, rngs, bias_metadata, scale_metadata: as ``flax.nnx.GroupNorm``'s.
    activation: applied to the normalized output (default ``"identity"``).
  """

  def __init__(
    self,
    num_features: int,
    num_groups: int | None = 32,
    group_size: int | None = None,
    *,
    epsilon: float = 1e-6,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    use_bias: bool = True,
    use_scale: bool = True,
    bias_init: Initializer = initializers.zeros,
    scale_init: Initializer = initializers.ones,
    reduction_axes: Axes | None = None,
    axis_name: str | None = None,
    axis_index_groups: tp.Any = None,
    use_fast_variance: bool = True,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    rngs: nnx.Rngs,
    bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    activation: Activation = "identity",
  ):
    check_activation("jaxact.nnx.GroupNorm", activation)
    super().__init__(
      num_features,
      num_groups,
      group_size,
      epsilon=epsilon,
      dtype=dtype,
      param_dtype=param_dtype,
      use_bias=use_bias,
      use_scale=use_scale,
      bias_init=bias_init,
      scale_init=scale_init,
      reduction_axes=reduction_axes,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      use_fast_variance=use_fast_variance,
      promote_dtype=promote_dtype,
      rngs=rngs,
      bias_metadata=bias_metadata,
      scale_metadata=scale_metadata,
    )
    self.activation = activation

  def __call__(self, x, *, mask: Array | None = None):
    """``activation(GroupNorm(x))``."""
    return self._run(x, mask)[0]

  def _run(self, x, mask, affine: bool = True):
    """``(y, scale, bias)`` (promoted as x is); without `affine`, y is x normalized alone, the
    scale, bias and activation left to the caller."""
    layer = "jaxact.nnx.GroupNorm"
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    y = norm_act.for_layer(
      layer,
      norm_act.group,
      x,
      scale if affine else None,
      bias if affine else None,
      activation=self.activation if affine else "identity",
      num_groups=self.num_groups,
      group_size=None,
      epsilon=self.epsilon,
      reduction_axes=self.reduction_axes,
      use_fast_variance=self.use_fast_variance,
      axis_name=self.axis_name,
      axis_index_groups=self.axis_index_groups,
      mask=mask,
    )
    return y, scale, bias


class ConvNormAct(nnx.Module):
  """``activation(norm(nnx.Conv(..., use_bias=False)(x)))``, keeping only `x` for the backward pass.

  Holds ``conv`` (Flax's ``nnx.Conv``, no bias) and ``norm`` (this module's :class:`BatchNorm`,
  batch statistics updated as Flax updates them, or :class:`GroupNorm`), made by their own
  ``__init__`` from the same `rngs` in that order: a Flax module holding ``self.conv`` and
  ``self.norm`` has the same state. The call runs both under ``jax.checkpoint``: the backward pass
  makes the convolution, the statistics and the normalized input again from `x` (which the layer
  before keeps anyway) instead of keeping the convolution's output and the norm's.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import ConvNormAct
    >>> layer = ConvNormAct(3, 8, (3, 3), activation="relu", rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 6, 6, 3))).shape, layer.norm.mean.shape
    ((2, 6, 6, 8), (8,))

  Args:
    in_features, out_features, kernel_size, strides, padding, input_dilation, kernel_dilation,
      feature_group_count, precision, kernel_init: ``nnx.Conv``'s.
    norm: ``"batch"`` (``nnx.BatchNorm``) or ``"group"`` (``nnx.GroupNorm``).
    activation: applied to the normalized output (default ``"identity"``).
    use_running_average, momentum, axis_name, axis_index_groups: ``nnx.BatchNorm``'s.
    num_groups, group_size: ``nnx.GroupNorm``'s.
    epsilon: the norm's; None is its default (1e-5 for batch, 1e-6 for group norm).
    use_scale, scale_init, bias_init, use_fast_variance: the norm's.
    norm_use_bias: the norm's ``use_bias`` (default True).
    dtype, param_dtype, rngs: both layers'.
    conv_use_bias: the convolution's ``use_bias`` (default False).
    use_bias: refused with a ``TypeError``: say ``conv_use_bias`` or ``norm_use_bias``.
  """

  _norm_first = False  # NormActConv: the norm on the input, made (from `rngs`) before the conv

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int | tp.Sequence[int],
    strides: int | tp.Sequence[int] = 1,
    *,
    padding: PaddingLike = "SAME",
    input_dilation: int | tp.Sequence[int] = 1,
    kernel_dilation: int | tp.Sequence[int] = 1,
    feature_group_count: int = 1,
    norm: tp.Literal["batch", "group"] = "batch",
    activation: Activation = "identity",
    use_running_average: bool | None = False,
    momentum: float = 0.99,
    epsilon: float | None = None,
    num_groups: int | None = 32,
    group_size: int | None = None,
    use_scale: bool = True,
    norm_use_bias: bool = True,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = default_kernel_init,
    scale_init: Initializer = initializers.ones,
    bias_init: Initializer = initializers.zeros,
    axis_name: str | None = None,
    axis_index_groups: tp.Any = None,
    use_fast_variance: bool = True,
    conv_use_bias: bool = False,
    use_bias: None = None,
    rngs: nnx.Rngs,
  ):
    layer = f"jaxact.nnx.{type(self).__name__}"
    norm_act.refuse_use_bias(layer, use_bias)
    if norm not in ("batch", "group"):
      raise ValueError(f"{layer}: `norm` {norm!r} is not known; choose 'batch' or 'group'")
    make_conv = functools.partial(
      nnx.Conv,
      in_features,
      out_features,
      kernel_size,
      strides,
      padding=padding,
      input_dilation=input_dilation,
      kernel_dilation=kernel_dilation,
      feature_group_count=feature_group_count,
      use_bias=conv_use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=kernel_init,
      rngs=rngs,
    )
    if not self._norm_first:
      self.conv = make_conv()
    kw = dict(
      use_scale=use_scale,
      use_bias=norm_use_bias,
      scale_init=scale_init,
      bias_init=bias_init,
      dtype=dtype,
      param_dtype=param_dtype,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      use_fast_variance=use_fast_variance,
      activation=activation,
      rngs=rngs,
    )
    if epsilon is not None:
      kw["epsilon"] = epsilon
    features = in_features if self._norm_first else out_features
    if norm == "batch":
      self.norm = BatchNorm(
        features, use_running_average=use_running_average, momentum=momentum, **kw
      )
    else:
      self.norm = GroupNorm(features, num_groups, group_size, **kw)
    if self._norm_first:
      self.conv = make_conv()

  def __call__(self, x, use_running_average: bool | None = None):
    """The layer on `x` ``(batch, *spatial, channels)``; in training with a batch norm the batch
    statistics update ``norm.mean`` / ``norm.var``."""
    batch = isinstance(self.norm, nnx.BatchNorm)
    call = dict(use_running_average=use_running_average) if batch else {}
    graph, state = nnx.split((self.conv, self.norm))

    def run(x, state):
      conv, norm = nnx.merge(graph, state)
      y = norm(conv(x), **call)
      return y, nnx.state(norm, nnx.BatchStat)

    # Nothing of the forward is saved but the arguments: the convolution, the statistics and the
    # normalized input are made again from x in the backward pass.
    y, stats = jax.checkpoint(run)(x, state)
    nnx.update(self.norm, stats)
    return y
