"""Flax nnx layers with a fused bias and activation: :class:`LinearAct` and :class:`ConvAct`.

Each subclasses ``flax.nnx.Linear`` / ``flax.nnx.Conv`` and adds keyword arguments of its own
(``activation``, ...): Flax's arguments, attributes and ``kernel`` / ``bias`` parameters (shapes,
initializers, RNG streams, ``kernel_metadata`` / ``bias_metadata`` such as ``out_sharding``) are
inherited, and the call computes ``activation(nnx.Linear(...)(x))`` as one
:func:`jaxact.dense_bias_act` / :func:`jaxact.conv_bias_act`. The gated MLP,
``jaxact.nnx.GatedMLP``, is in ``gated/nnx.py``.
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import (
  ConvGeneralDilatedT,
  DotGeneralT,
  Dtype,
  Initializer,
  PaddingLike,
  PrecisionLike,
  PromoteDtypeFn,
)
from jax import lax

from jaxact._src.fused import api as fused
from jaxact._src.layers import common as layers
from jaxact._src.layers.common import Activation
from jaxact._src.layers.nnx import dropout_key

Array = jax.Array


class LinearAct(nnx.Linear):
  """``activation(nnx.Linear(...)(x))`` as one fused op: a drop-in for ``nnx.Linear`` + activation.

  A subclass of ``flax.nnx.Linear``: its arguments, attributes and parameters (``kernel`` of
  shape ``(in_features, out_features)``, ``bias`` of shape ``(out_features,)``, drawn from
  ``rngs.params()`` in that order, with ``kernel_metadata`` / ``bias_metadata``) are Flax's,
  created by ``nnx.Linear.__init__``, so with the same ``rngs`` the parameters equal
  ``nnx.Linear``'s and its checkpoints load. The matmul, bias and activation run as
  :func:`jaxact.dense_bias_act` (an ``out_sharding`` in the call too). A custom ``dot_general``,
  or promoted dtypes other than real floating point, run ``nnx.Linear``'s own call followed by
  the activation.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import LinearAct
    >>> layer = LinearAct(3, 4, activation="relu", rngs=nnx.Rngs(0))
    >>> layer.kernel.shape, layer.bias.shape
    ((3, 4), (4,))
    >>> layer(jnp.ones((2, 3))).shape
    (2, 4)

  Args:
    in_features: the number of input features.
    out_features: the number of output features.
    use_bias: whether to add a bias to the output (default: True).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer function for the weight matrix.
    bias_init: initializer function for the bias.
    dot_general: dot product function; anything but ``lax.dot_general`` runs Flax's computation,
      then the activation.
    promote_dtype: function promoting ``(inputs, kernel, bias)`` to a common dtype, as in Flax.
    preferred_element_type: the dtype of the dot product's result, as in ``nnx.Linear``.
    rngs: rng key.
    kernel_metadata: metadata of the kernel ``Param`` (e.g. ``{"out_sharding": (None, "model")}``).
    bias_metadata: metadata of the bias ``Param``.
    activation: an activation name (``"relu"``), a jaxact function, one of ``jax.nn``'s
      (``nnx.relu``), a ``functools.partial`` of either with keyword parameters, or any callable
      (applied to the pre-activation, which is then kept). Default ``"identity"``: the layer is
      ``nnx.Linear``.
    residual_bits: None (default), or 8, 4, 2: the activation (gelu, gelu_quick, silu, mish,
      hard_silu) keeps its derivative coded in that many bits an element instead of the
      pre-activation, as ``partial(jaxact.gelu, residual_bits=...)`` does.
    dropout_rate: ``nnx.Dropout``'s ``rate`` applied to the activation's output inside the op
      (default 0: none): the layer is ``nnx.Linear`` + activation + ``nnx.Dropout``, keeping no
      mask (see :func:`jaxact.dense_bias_act`). Its key stream is forked from `rngs` after the
      parameters are drawn, as ``nnx.Dropout(rate, rngs=rngs)`` built after the ``nnx.Linear``.
    dropout_broadcast_dims: ``nnx.Dropout``'s ``broadcast_dims``.
    deterministic: as ``nnx.Dropout``'s (``model.eval()`` / ``model.train()`` set it).
    rng_collection: the rng stream the dropout key comes from (default ``'dropout'``).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = True,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    dot_general: DotGeneralT = lax.dot_general,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    preferred_element_type: Dtype | None = None,
    rngs: nnx.Rngs,
    kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    activation: Activation = "identity",
    residual_bits: int | None = None,
    dropout_rate: float = 0.0,
    dropout_broadcast_dims: tp.Sequence[int] = (),
    deterministic: bool | None = False,
    rng_collection: str = "dropout",
  ):
    layers.check_activation("jaxact.nnx.LinearAct", activation)
    layers.with_bits("jaxact.nnx.LinearAct", activation, residual_bits)
    super().__init__(
      in_features,
      out_features,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=kernel_init,
      bias_init=bias_init,
      dot_general=dot_general,
      promote_dtype=promote_dtype,
      preferred_element_type=preferred_element_type,
      rngs=rngs,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
    )
    self.activation = activation
    self.residual_bits = residual_bits
    self.dropout_rate = dropout_rate
    self.dropout_broadcast_dims = dropout_broadcast_dims
    self.deterministic = deterministic
    self.rng_collection = rng_collection
    # The dropout's stream, as nnx.Dropout forks it; none without dropout (the rngs stay untouched).
    self.rngs = rngs[rng_collection].fork() if dropout_rate != 0 else nnx.data(None)

  def set_view(self, deterministic: bool | None = None):
    """``nnx.view``'s hook, as ``nnx.Dropout``'s: True turns the dropout off."""
    if deterministic is not None:
      self.deterministic = deterministic

  def __call__(
    self,
    inputs: Array,
    out_sharding=None,
    *,
    deterministic: bool | None = None,
    rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
  ) -> Array:
    """``activation(inputs @ kernel + bias)`` over the last dimension of `inputs`, then the
    dropout.

    Args:
      inputs: the array to transform.
      out_sharding: as ``nnx.Linear``'s: the output's sharding (under Explicit mesh axes needed
        where the input's features and the kernel's rows are both sharded), given to
        :func:`jaxact.dense_bias_act`.
      deterministic: as ``nnx.Dropout``'s call: overrides the attribute.
      rngs: as ``nnx.Dropout``'s call: a key, stream or ``Rngs`` overriding the layer's stream.
    """
    layers.check_activation("jaxact.nnx.LinearAct", self.activation)
    key = dropout_key("jaxact.nnx.LinearAct", self, deterministic, rngs)
    drop = layers.dropout_kwargs(self.dropout_rate, self.dropout_broadcast_dims, key)
    activation = layers.with_bits("jaxact.nnx.LinearAct", self.activation, self.residual_bits)
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    pet = self.preferred_element_type
    if (
      self.dot_general is lax.dot_general
      and layers.fusable(inputs, kernel, bias)
      and (pet is None or jnp.issubdtype(pet, jnp.floating))
    ):
      return fused.dense_bias_act(
        inputs,
        kernel,
        bias,
        activation=activation,
        precision=self.precision,
        preferred_element_type=layers.fused_out_dtype(pet, bias),
        out_sharding=out_sharding,
        **drop,
      )
    # Flax's own computation (a custom dot_general, other dtypes), then the activation and the
    # dropout.
    y = super().__call__(inputs, out_sharding=out_sharding)
    return layers.drop("jaxact.nnx.LinearAct", layers.activate(activation, y), drop)


class ConvAct(nnx.Conv):
  """``activation(nnx.Conv(...)(x))`` as one fused op: a drop-in for ``nnx.Conv`` + activation.

  A subclass of ``flax.nnx.Conv``: its arguments, attributes and parameters (``kernel`` of shape
  ``kernel_size + (in_features // feature_group_count, out_features)``, ``bias`` of shape
  ``(out_features,)``, drawn from ``rngs.params()`` in that order, with ``kernel_metadata`` /
  ``bias_metadata``) are Flax's, created by ``nnx.Conv.__init__``. The input is channels-last,
  batch dimensions folded into one (or one added) as Flax does; ``'CIRCULAR'``, ``'REFLECT'`` and
  ``'CAUSAL'`` padding pad the input explicitly and a ``mask`` multiplies the kernel, as in Flax,
  and both then run through :func:`jaxact.conv_bias_act` (an ``out_sharding`` in the call too). A
  custom ``conv_general_dilated``, or promoted dtypes other than real floating point, run
  ``nnx.Conv``'s own call followed by the activation.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import ConvAct
    >>> layer = ConvAct(3, 4, kernel_size=(3,), padding="VALID", activation="relu",
    ...                 rngs=nnx.Rngs(0))
    >>> layer.kernel.shape
    (3, 3, 4)
    >>> layer(jnp.ones((1, 8, 3))).shape
    (1, 6, 4)

  Args:
    in_features: the number of input features.
    out_features: the number of output features.
    kernel_size: shape of the convolutional kernel; an int is a 1-D kernel.
    strides: an int or a sequence of ``n`` ints, the inter-window strides (default: 1).
    padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` (1-D), an int,
      or a sequence of ``n`` ints or ``(low, high)`` pairs, as in ``flax.nnx.Conv``.
    input_dilation: an int or a sequence of ``n`` ints, the input dilation (default: 1).
    kernel_dilation: an int or a sequence of ``n`` ints, the kernel dilation (default: 1).
    feature_group_count: the number of feature groups (default: 1).
    use_bias: whether to add a bias to the output (default: True).
    mask: optional mask for the weights, of the kernel's shape.
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer for the convolutional kernel.
    bias_init: initializer for the bias.
    conv_general_dilated: the convolution function; anything but ``lax.conv_general_dilated``
      runs Flax's computation, then the activation.
    promote_dtype: function promoting ``(inputs, kernel, bias)`` to a common dtype, as in Flax.
    preferred_element_type: the dtype of the convolution's result, as in ``nnx.Conv``.
    rngs: rng key.
    kernel_metadata: metadata of the kernel ``Param``.
    bias_metadata: metadata of the bias ``Param``.
    activation: as :class:`LinearAct`. Default ``"identity"``: the layer is ``nnx.Conv``.
    residual_bits: as :class:`LinearAct`.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int | tp.Sequence[int],
    strides: int | tp.Sequence[int] | None = 1,
    *,
    padding: PaddingLike = "SAME",
    input_dilation: int | tp.Sequence[int] | None = 1,
    kernel_dilation: int | tp.Sequence[int] | None = 1,
    feature_group_count: int = 1,
    use_bias: bool = True,
    mask: Array | None = None,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    conv_general_dilated: ConvGeneralDilatedT = lax.conv_general_dilated,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    preferred_element_type: Dtype | None = None,
    rngs: nnx.Rngs,
    kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    activation: Activation = "identity",
    residual_bits: int | None = None,
  ):
    layers.check_activation("jaxact.nnx.ConvAct", activation)
    layers.with_bits("jaxact.nnx.ConvAct", activation, residual_bits)
    layers.check_groups("jaxact.nnx.ConvAct", in_features, feature_group_count)
    super().__init__(
      in_features,
      out_features,
      kernel_size,
      strides,
      padding=padding,
      input_dilation=input_dilation,
      kernel_dilation=kernel_dilation,
      feature_group_count=feature_group_count,
      use_bias=use_bias,
      mask=mask,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=kernel_init,
      bias_init=bias_init,
      conv_general_dilated=conv_general_dilated,
      promote_dtype=promote_dtype,
      preferred_element_type=preferred_element_type,
      rngs=rngs,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
    )
    self.activation = activation
    self.residual_bits = residual_bits

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    """``activation(conv(inputs, kernel) + bias)``, inputs ``(*batch, *spatial, features)``.

    Args:
      inputs: channels-last input.
      out_sharding: as ``nnx.Conv``'s, given to :func:`jaxact.conv_bias_act`.
    """
    name = "jaxact.nnx.ConvAct"
    layers.check_activation(name, self.activation)
    activation = layers.with_bits(name, self.activation, self.residual_bits)
    conv = layers.ConvInputs.prepare(
      inputs,
      self.kernel_size,
      self.strides,
      self.padding,
      self.input_dilation,
      self.kernel_dilation,
    )
    layers.check_groups(name, self.in_features, self.feature_group_count)
    layers.check_mask(self.mask, self.kernel_shape)
    kernel = self.kernel[...]
    if self.mask is not None:
      kernel *= self.mask
    bias = self.bias[...] if self.bias is not None else None
    x, kernel, bias = self.promote_dtype((conv.inputs, kernel, bias), dtype=self.dtype)
    pet = self.preferred_element_type
    if (
      self.conv_general_dilated is lax.conv_general_dilated
      and layers.fusable(x, kernel, bias)
      and (pet is None or jnp.issubdtype(pet, jnp.floating))
    ):
      y = fused.conv_bias_act(
        x,
        kernel,
        bias,
        activation=activation,
        window_strides=conv.strides,
        padding=conv.padding,
        lhs_dilation=conv.input_dilation,
        rhs_dilation=conv.kernel_dilation,
        feature_group_count=self.feature_group_count,
        precision=self.precision,
        preferred_element_type=layers.fused_out_dtype(pet, bias),
        out_sharding=out_sharding,
      )
      return conv.restore(y)
    # Flax's own computation (a custom conv_general_dilated, other dtypes), then the activation.
    return layers.activate(activation, super().__call__(inputs, out_sharding=out_sharding))
