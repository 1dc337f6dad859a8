"""``flax.linen.BatchNorm`` / ``GroupNorm`` followed by an activation, computed by
:func:`jaxact.batch_norm_act` / :func:`jaxact.group_norm_act`, which keep the normalized input
(and one float32 number a statistic) for the backward pass.

Each subclasses Flax's layer and adds ``activation`` after its attributes (default
``"identity"``: the layer is Flax's): the attributes (names, defaults, order), the parameters
(``scale``, ``bias``) and ``batch_stats`` (``mean``, ``var``, updated with ``momentum`` as Flax
updates them) are Flax's, so checkpoints load both ways. A ``mask`` raises a ``ValueError``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes
from flax.typing import Array

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
