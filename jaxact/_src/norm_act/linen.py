"""``flax.linen.BatchNorm`` / ``GroupNorm`` followed by an activation, computed by
:func:`jaxact.batch_norm_act` / :func:`jaxact.group_norm_act`, which keep the normalized input
(and one float32 number a statistic) for the backward pass.

Each subclasses Flax's layer and adds ``activation`` after its attributes (default
``"identity"``: the layer is Flax's): the attributes (names, defaults, order), the parameters
(``scale``, ``bias``) and ``batch_stats`` (``mean``, ``var``, updated with ``momentum`` as Flax
updates them) are Flax's, so checkpoints load both ways. A ``mask`` raises a ``ValueError``.

``ConvNormAct`` is ``nn.Conv`` (no bias) then one of those, whose backward pass keeps only the
layer's input: the convolution is made again in the backward pass (``jax.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes, initializers
from flax.linen.linear import default_kernel_init
from flax.typing import Array, Dtype, Initializer, PaddingLike, PrecisionLike

from jaxact._src.layers.common import Activation, check_activation
from jaxact._src.norm_act import api as norm_act


def _flax_params(module, shape):
  """``scale`` then ``bias``, in Flax's order, each only where used."""
  scale = (
    module.param("scale", module.scale_init, shape, module.param_dtype)
    if module.use_scale
    else None
  )
  bias = (
    module.param("bias", module.bias_init, shape, module.param_dtype) if module.use_bias else None
  )
  return scale, bias


class BatchNorm(nn.BatchNorm):
  """``flax.linen.BatchNorm`` then ``activation``, as one op (:func:`jaxact.batch_norm_act`).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import BatchNorm
    >>> bn = BatchNorm(use_running_average=False, activation="relu")
    >>> variables = bn.init(jax.random.key(0), jnp.ones((4, 3)))
    >>> jax.tree_util.tree_map(jnp.shape, variables)
    {'batch_stats': {'mean': (3,), 'var': (3,)}, 'params': {'bias': (3,), 'scale': (3,)}}
    >>> y, updates = bn.apply(variables, jnp.ones((4, 3)), mutable=["batch_stats"])

  Attributes:
    use_running_average, axis, momentum, epsilon, dtype, param_dtype, use_bias, use_scale,
      bias_init, scale_init, axis_name, axis_index_groups, use_fast_variance: as
      ``flax.linen.BatchNorm``'s.
    force_float32_reductions: accepted; the statistics are always float32 (float64 for float64).
    activation: applied to the normalized output (default ``"identity"``); a name, a jaxact or
      ``jax.nn`` function, a ``functools.partial`` of one, or a callable.
  """

  activation: Activation = "identity"

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask: Array | None = None):
    """``activation(BatchNorm(x))``; the batch statistics update ``batch_stats`` in training."""
    layer = "jaxact.linen.BatchNorm"
    check_activation(layer, self.activation)
    use_running_average = nn.merge_param(
      "use_running_average", self.use_running_average, use_running_average
    )
    axes = norm_act.canonical_axes(layer, self.axis, x.ndim)
    shape = tuple(x.shape[a] for a in axes)
    stats_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
    ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stats_dtype), shape)
    ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, stats_dtype), shape)
    scale, bias = _flax_params(self, shape)
    out = dtypes.canonicalize_dtype(
      *(a for a in (x, scale, bias) if a is not None), dtype=self.dtype
    )
    given = (ra_mean.value, ra_var.value) if use_running_average else (None, None)
    y, mean, var = norm_act.for_layer(
      layer,
      norm_act.batch,
      x,
      scale,
      bias,
      activation=self.activation,
      axis=axes,
      epsilon=self.epsilon,
      mean=given[0],
      var=given[1],
      use_fast_variance=self.use_fast_variance,
      axis_name=None if self.is_initializing() else self.axis_name,
      axis_index_groups=None if self.is_initializing() else self.axis_index_groups,
      out_dtype=out,
      mask=mask,
    )
    if not use_running_average and not self.is_initializing():
      ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
      ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
    return y


class GroupNorm(nn.GroupNorm):
  """``flax.linen.GroupNorm`` then ``activation``, as one op (:func:`jaxact.group_norm_act`).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import GroupNorm
    >>> gn = GroupNorm(num_groups=2, activation="silu")
    >>> params = gn.init(jax.random.key(0), jnp.ones((2, 5, 4)))
    >>> gn.apply(params, jnp.ones((2, 5, 4))).shape
    (2, 5, 4)

  Attributes:
    num_groups, group_size, epsilon, dtype, param_dtype, use_bias, use_scale, bias_init,
      scale_init, reduction_axes, axis_name, axis_index_groups, use_fast_variance: as
      ``flax.linen.GroupNorm``'s.
    force_float32_reductions: accepted; the statistics are always float32 (float64 for float64).
    activation: applied to the normalized output (default ``"identity"``).
  """

  activation: Activation = "identity"

  @nn.compact
  def __call__(self, x, *, mask: Array | None = None):
    """``activation(GroupNorm(x))``."""
    layer = "jaxact.linen.GroupNorm"
    check_activation(layer, self.activation)
    scale, bias = _flax_params(self, (x.shape[-1],))
    out = dtypes.canonicalize_dtype(
      *(a for a in (x, scale, bias) if a is not None), dtype=self.dtype
    )
    return norm_act.for_layer(
      layer,
      norm_act.group,
      x,
      scale,
      bias,
      activation=self.activation,
      num_groups=self.num_groups,
      group_size=self.group_size,
      epsilon=self.epsilon,
      reduction_axes=self.reduction_axes,
      use_fast_variance=self.use_fast_variance,
      axis_name=self.axis_name,
      axis_index_groups=self.axis_index_groups,
      out_dtype=out,
      mask=mask,
    )


class ConvNormAct(nn.Module):
  """``activation(norm(nn.Conv(..., use_bias=False)(x)))``, keeping only `x` for the backward pass.

  The convolution is Flax's ``nn.Conv`` (submodule ``Conv_0``) and the norm this module's
  :class:`BatchNorm` (``BatchNorm_0``, batch statistics updated as Flax updates them) or
  :class:`GroupNorm` (``GroupNorm_0``): the variables of a Flax module that writes
  ``nn.Conv(features, kernel_size, use_bias=False)``, ``nn.BatchNorm()`` then the activation in
  its ``@nn.compact`` call, so such checkpoints load as they are. The three run under
  ``jax.checkpoint``: the backward pass makes the convolution, the statistics and the normalized
  input again from `x`, which the layer before keeps anyway (it is that layer's output), instead
  of keeping the convolution's output and the norm's: one activation-sized array a layer.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import ConvNormAct
    >>> layer = ConvNormAct(8, (3, 3), activation="relu", use_running_average=False)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 6, 6, 3)))
    >>> jax.tree_util.tree_map(jnp.shape, variables["params"])
    {'BatchNorm_0': {'bias': (8,), 'scale': (8,)}, 'Conv_0': {'kernel': (3, 3, 3, 8)}}
    >>> y, updates = layer.apply(variables, jnp.ones((2, 6, 6, 3)), mutable=["batch_stats"])

  Attributes:
    features, kernel_size, strides, padding, input_dilation, kernel_dilation,
      feature_group_count, precision, kernel_init: ``nn.Conv``'s.
    norm: ``"batch"`` (``nn.BatchNorm``) or ``"group"`` (``nn.GroupNorm``).
    activation: applied to the normalized output (default ``"identity"``).
    use_running_average, momentum, axis_name, axis_index_groups: ``nn.BatchNorm``'s.
    num_groups, group_size: ``nn.GroupNorm``'s.
    epsilon: the norm's; None is its default (1e-5 for batch, 1e-6 for group norm).
    use_scale, scale_init, bias_init, use_fast_variance: the norm's.
    norm_use_bias: the norm's ``use_bias`` (default True).
    dtype, param_dtype: both layers'.
    conv_use_bias: the convolution's ``use_bias`` (default False: a batch norm's mean removes a
      bias; a group norm's does not, and diffusion U-Nets keep one before it).
    use_bias: refused with a ``TypeError`` (either layer's? ``nn.Conv(use_bias=False)``
      ported as it stands would drop the norm's bias): say ``conv_use_bias`` or
      ``norm_use_bias``.
  """

  features: int
  kernel_size: int | Sequence[int]
  strides: int | Sequence[int] = 1
  padding: PaddingLike = "SAME"
  input_dilation: int | Sequence[int] = 1
  kernel_dilation: int | Sequence[int] = 1
  feature_group_count: int = 1
  norm: Literal["batch", "group"] = "batch"
  activation: Activation = "identity"
  use_running_average: bool | None = None
  momentum: float = 0.99
  epsilon: float | None = None
  num_groups: int | None = 32
  group_size: int | None = None
  use_scale: bool = True
  norm_use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  scale_init: Initializer = initializers.ones
  bias_init: Initializer = initializers.zeros
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  conv_use_bias: bool = False
  use_bias: None = None  # refused: conv_use_bias or norm_use_bias

  def __post_init__(self):
    norm_act.refuse_use_bias(f"jaxact.linen.{type(self).__name__}", self.use_bias)
    super().__post_init__()

  def _layers(self, layer: str, use_running_average):
    """``(conv, norm, the norm's call keywords, whether it takes batch statistics)``, named as
    Flax names them; for `layer` (errors name it)."""
    check_activation(layer, self.activation)
    if self.norm not in ("batch", "group"):
      raise ValueError(f"{layer}: `norm` {self.norm!r} is not known; choose 'batch' or 'group'")
    batch = self.norm == "batch"
    if batch:
      use_running_average = nn.merge_param(
        "use_running_average", self.use_running_average, use_running_average
      )
    conv = nn.Conv(
      self.features,
      self.kernel_size,
      self.strides,
      self.padding,
      self.input_dilation,
      self.kernel_dilation,
      self.feature_group_count,
      use_bias=self.conv_use_bias,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      precision=self.precision,
      kernel_init=self.kernel_init,
      name="Conv_0",
    )
    norm_kw = dict(
      use_scale=self.use_scale,
      use_bias=self.norm_use_bias,
      scale_init=self.scale_init,
      bias_init=self.bias_init,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      axis_name=self.axis_name,
      axis_index_groups=self.axis_index_groups,
      use_fast_variance=self.use_fast_variance,
      activation=self.activation,
    )
    if self.epsilon is not None:
      norm_kw["epsilon"] = self.epsilon
    if batch:
      norm = BatchNorm(momentum=self.momentum, name="BatchNorm_0", **norm_kw)
      call = dict(use_running_average=use_running_average)
    else:
      groups = dict(num_groups=self.num_groups, group_size=self.group_size)
      norm, call = GroupNorm(**groups, name="GroupNorm_0", **norm_kw), {}
    return conv, norm, call, batch and not use_running_average

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    """The layer on `x` ``(batch, *spatial, channels)``; in training with ``norm="batch"`` the
    batch statistics update ``batch_stats``."""
    conv, norm, call, train = self._layers("jaxact.linen.ConvNormAct", use_running_average)
    if self.is_initializing():
      return norm(conv(x), **call)
    conv_fn, norm_fn = conv.clone(parent=None), norm.clone(parent=None)

    def run(x, conv_vars, norm_vars):
      z = conv_fn.apply(conv_vars, x)
      if not train:
        return norm_fn.apply(norm_vars, z, **call), None
      return norm_fn.apply(norm_vars, z, **call, mutable=["batch_stats"])

    # Nothing of the forward is saved but the arguments: the convolution, the statistics and the
    # normalized input are made again from x in the backward pass.
    y, updates = jax.checkpoint(run)(x, conv.variables, norm.variables)
    if train:
      for name, value in updates["batch_stats"].items():
        norm.put_variable("batch_stats", name, value)
    return y
