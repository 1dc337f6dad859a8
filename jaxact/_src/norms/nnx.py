"""``flax.nnx.RMSNorm`` / ``LayerNorm`` computed by :func:`jaxact.rms_norm` /
:func:`jaxact.layer_norm`, which keep their output (and one float32 number a row) for the backward
pass instead of their input.

Each subclasses Flax's layer and adds the keyword arguments ``residual`` and ``scale_offset``:
the arguments, attributes and parameters (``scale``, ``bias`` drawn from ``rngs.params()`` in
Flax's order, with their metadata) are Flax's, made by its ``__init__``, so the same ``rngs`` give
the same parameters and checkpoints load; what a per-row statistic cannot express raises a
``ValueError`` naming it.
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.typing import Array, Axes, Dtype, Initializer, PromoteDtypeFn

from jaxact._src.norms import api as norms


def _call(layer: str, module, center: bool, x, mask, out_sharding=None):
  axes = norms.check_supported(layer, module, x, mask)
  if tuple(x.shape[a] for a in axes) != (module.num_features,):
    raise ValueError(
      f"{layer}: `x` has {tuple(x.shape[a] for a in axes)} on the normalized axes {axes}, but "
      f"num_features={module.num_features}"
    )
  scale = module.scale[...] if module.scale is not None else None
  if center:  # Flax's promote_dtype takes (x, scale, bias) in LayerNorm, (x, scale) in RMSNorm
    bias = module.bias[...] if module.bias is not None else None
    x, scale, bias = module.promote_dtype((x, scale, bias), dtype=module.dtype)
  else:
    (x, scale), bias = module.promote_dtype((x, scale), dtype=module.dtype), None
  return norms.norm(
    layer,
    center,
    x,
    scale,
    bias,
    epsilon=module.epsilon,
    axis=axes,
    residual=module.residual,
    out_dtype=x.dtype,
    scale_offset=module.scale_offset,
    out_sharding=out_sharding,
  )


class RMSNorm(nnx.RMSNorm):
  """``flax.nnx.RMSNorm`` keeping its output for the backward pass (:func:`jaxact.rms_norm`).

  A subclass of ``flax.nnx.RMSNorm`` (its arguments, attributes and ``scale``) whose call runs
  :func:`jaxact.rms_norm`.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import RMSNorm
    >>> norm = RMSNorm(4, rngs=nnx.Rngs(0))
    >>> norm(jnp.ones((2, 4))).shape
    (2, 4)

  Args:
    num_features, epsilon, dtype, param_dtype, use_scale, scale_init, reduction_axes,
      feature_axes, use_fast_variance, promote_dtype, rngs, scale_metadata: as
      ``flax.nnx.RMSNorm``'s (``feature_axes`` must equal ``reduction_axes``; the statistics are
      always computed in float32, or float64 for float64 inputs).
    axis_name, axis_index_groups: must be None (statistics across devices are not supported).
    residual: ``"output"`` (default: keep the output and its ``rms``) or ``"input"``.
    scale_offset: added to ``scale`` (default 0.0): ``y = x_hat * (scale_offset + scale)``. Gemma's
      norm is ``x_hat * (1 + scale)`` with a zero-initialised scale: ``scale_offset=1.0`` (and
      ``scale_init=nnx.initializers.zeros`` for a fresh model) loads its checkpoints, where
      ``flax.nnx.RMSNorm`` and this layer's default would output zeros.
  """

  def __init__(
    self,
    num_features: int,
    *,
    epsilon: float = 1e-6,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    use_scale: bool = True,
    scale_init: Initializer = initializers.ones,
    reduction_axes: Axes = -1,
    feature_axes: Axes = -1,
    axis_name: str | None = None,
    axis_index_groups: tp.Any = None,
    use_fast_variance: bool = True,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    rngs: nnx.Rngs,
    scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    residual: str = "output",
    scale_offset: float = 0.0,
  ):
    super().__init__(
      num_features,
      epsilon=epsilon,
      dtype=dtype,
      param_dtype=param_dtype,
      use_scale=use_scale,
      scale_init=scale_init,
      reduction_axes=reduction_axes,
      feature_axes=feature_axes,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      use_fast_variance=use_fast_variance,
      promote_dtype=promote_dtype,
      rngs=rngs,
      scale_metadata=scale_metadata,
    )
    self.residual = residual
    self.scale_offset = scale_offset

  def __call__(self, x: Array, mask: Array | None = None, *, out_sharding=None) -> Array:
    """The RMS norm of `x` over `reduction_axes` (in `out_sharding` when given: see
    :func:`jaxact.rms_norm`)."""
    return _call("jaxact.nnx.RMSNorm", self, False, x, mask, out_sharding)


class LayerNorm(nnx.LayerNorm):
  """``flax.nnx.LayerNorm`` keeping its output for the backward pass (:func:`jaxact.layer_norm`).

  A subclass of ``flax.nnx.LayerNorm`` (its arguments, attributes, ``scale`` and ``bias``) whose
  call runs :func:`jaxact.layer_norm`.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import LayerNorm
    >>> norm = LayerNorm(4, rngs=nnx.Rngs(0))
    >>> norm.bias.shape, norm(jnp.ones((2, 4))).shape
    ((4,), (2, 4))

  Args:
    num_features, epsilon, dtype, param_dtype, use_bias, use_scale, bias_init, scale_init,
      reduction_axes, feature_axes, use_fast_variance, promote_dtype, rngs, bias_metadata,
      scale_metadata: as ``flax.nnx.LayerNorm``'s (``feature_axes`` must equal
      ``reduction_axes``; the variance is always computed in two passes, in float32).
    axis_name, axis_index_groups: must be None.
    residual: ``"output"`` (default: keep the output and ``sigma``) or ``"input"``.
    scale_offset: added to ``scale`` (default 0.0): ``y = x_hat * (scale_offset + scale) + bias``.
  """

  def __init__(
    self,
    num_features: int,
    *,
    epsilon: float = 1e-6,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    use_bias: bool = True,
    use_scale: bool = True,
    bias_init: Initializer = initializers.zeros,
    scale_init: Initializer = initializers.ones,
    reduction_axes: Axes = -1,
    feature_axes: Axes = -1,
    axis_name: str | None = None,
    axis_index_groups: tp.Any = None,
    use_fast_variance: bool = True,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    rngs: nnx.Rngs,
    bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    residual: str = "output",
    scale_offset: float = 0.0,
  ):
    super().__init__(
      num_features,
      epsilon=epsilon,
      dtype=dtype,
      param_dtype=param_dtype,
      use_bias=use_bias,
      use_scale=use_scale,
      bias_init=bias_init,
      scale_init=scale_init,
      reduction_axes=reduction_axes,
      feature_axes=feature_axes,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      use_fast_variance=use_fast_variance,
      promote_dtype=promote_dtype,
      rngs=rngs,
      bias_metadata=bias_metadata,
      scale_metadata=scale_metadata,
    )
    self.residual = residual
    self.scale_offset = scale_offset

  def __call__(self, x: Array, *, mask: Array | None = None, out_sharding=None) -> Array:
    """The layer norm of `x` over `reduction_axes` (in `out_sharding` when given)."""
    return _call("jaxact.nnx.LayerNorm", self, True, x, mask, out_sharding)
