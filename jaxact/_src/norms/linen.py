"""``flax.linen.RMSNorm`` / ``LayerNorm`` computed by :func:`jaxact.rms_norm` /
:func:`jaxact.layer_norm`, which keep their output (and one float32 number a row) for the backward
pass instead of their input.

Each subclasses Flax's layer and adds ``residual`` and ``scale_offset`` after its attributes: the
attributes (names, defaults, order) are inherited and the parameters (``scale``, ``bias``: shapes,
initializers, dtypes) are Flax's, so checkpoints load; what a per-row statistic cannot express
(statistics over devices, a mask, feature axes other than the reduction axes) raises a
``ValueError`` naming the attribute.
"""

from __future__ import annotations

from flax import linen as nn
from flax.linen import dtypes
from flax.typing import Array

from jaxact._src.norms import api as norms


class RMSNorm(nn.RMSNorm):
  """``flax.linen.RMSNorm`` keeping its output for the backward pass (:func:`jaxact.rms_norm`).

  A subclass of ``flax.linen.RMSNorm`` (its attributes inherited) whose call runs
  :func:`jaxact.rms_norm`.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import RMSNorm
    >>> x = jnp.ones((2, 4))
    >>> params = RMSNorm().init(jax.random.key(0), x)
    >>> jax.tree_util.tree_map(jnp.shape, params)
    {'params': {'scale': (4,)}}

  Attributes:
    epsilon, dtype, param_dtype, use_scale, scale_init, reduction_axes, feature_axes: as
      ``flax.linen.RMSNorm``'s (``feature_axes`` must equal ``reduction_axes``).
    axis_name, axis_index_groups: must be None (statistics across devices are not supported).
    use_fast_variance, force_float32_reductions: accepted; the statistics are always computed in
      float32 (float64 for float64 inputs).
    residual: ``"output"`` (default: keep the output and its ``rms``) or ``"input"``.
    scale_offset: added to ``scale`` (default 0.0): ``y = x_hat * (scale_offset + scale)``. Gemma's
      norm is ``x_hat * (1 + scale)`` with a zero-initialised scale: ``scale_offset=1.0`` (and
      ``scale_init=nn.initializers.zeros`` for a fresh model) loads its checkpoints, where
      ``flax.linen.RMSNorm`` and this layer's default would output zeros.
  """

  # nn.RMSNorm's attributes, inherited: epsilon, dtype, param_dtype, use_scale, scale_init,
  # reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
  # force_float32_reductions.
  residual: str = "output"
  scale_offset: float = 0.0

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None, out_sharding=None) -> Array:
    """The RMS norm of `x` over `reduction_axes` (in `out_sharding` when given: see
    :func:`jaxact.rms_norm`)."""
    layer = "jaxact.linen.RMSNorm"
    axes = norms.check_supported(layer, self, x, mask)
    shape = tuple(x.shape[a] for a in axes)
    scale = (
      self.param("scale", self.scale_init, shape, self.param_dtype) if self.use_scale else None
    )
    out = dtypes.canonicalize_dtype(*(a for a in (x, scale) if a is not None), dtype=self.dtype)
    return norms.norm(
      layer,
      False,
      x,
      scale,
      None,
      epsilon=self.epsilon,
      axis=axes,
      residual=self.residual,
      out_dtype=out,
      scale_offset=self.scale_offset,
      out_sharding=out_sharding,
    )


class LayerNorm(nn.LayerNorm):
  """``flax.linen.LayerNorm`` keeping its output for the backward pass (:func:`jaxact.layer_norm`).

  A subclass of ``flax.linen.LayerNorm`` (its attributes inherited) whose call runs
  :func:`jaxact.layer_norm`.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import LayerNorm
    >>> params = LayerNorm().init(jax.random.key(0), jnp.ones((2, 4)))
    >>> jax.tree_util.tree_map(jnp.shape, params)
    {'params': {'bias': (4,), 'scale': (4,)}}

  Attributes:
    epsilon, dtype, param_dtype, use_bias, use_scale, bias_init, scale_init, reduction_axes,
      feature_axes: as ``flax.linen.LayerNorm``'s (``feature_axes`` must equal
      ``reduction_axes``).
    axis_name, axis_index_groups: must be None.
    use_fast_variance, force_float32_reductions: accepted; the variance is always computed in two
      passes, in float32 (float64 for float64 inputs).
    residual: ``"output"`` (default: keep the output and ``sigma``) or ``"input"``.
    scale_offset: added to ``scale`` (default 0.0): ``y = x_hat * (scale_offset + scale) + bias``.
  """

  # nn.LayerNorm's attributes, inherited: epsilon, dtype, param_dtype, use_bias, use_scale,
  # bias_init, scale_init, reduction_axes, feature_axes, axis_name, axis_index_groups,
  # use_fast_variance, force_float32_reductions.
  residual: str = "output"
  scale_offset: float = 0.0

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None, out_sharding=None) -> Array:
    """The layer norm of `x` over `reduction_axes` (in `out_sharding` when given)."""
    layer = "jaxact.linen.LayerNorm"
    axes = norms.check_supported(layer, self, x, mask)
    shape = tuple(x.shape[a] for a in axes)
    scale = (
      self.param("scale", self.scale_init, shape, self.param_dtype) if self.use_scale else None
    )
    bias = self.param("bias", self.bias_init, shape, self.param_dtype) if self.use_bias else None
    args = (a for a in (x, scale, bias) if a is not None)
    out = dtypes.canonicalize_dtype(*args, dtype=self.dtype)
    return norms.norm(
      layer,
      True,
      x,
      scale,
      bias,
      epsilon=self.epsilon,
      axis=axes,
      residual=self.residual,
      out_dtype=out,
      scale_offset=self.scale_offset,
      out_sharding=out_sharding,
    )
