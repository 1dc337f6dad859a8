"""Flax linen layers with a fused bias and activation: :class:`DenseAct` and :class:`ConvAct`.

Each subclasses ``flax.linen.Dense`` / ``flax.linen.Conv`` and adds attributes of its own
(``activation``, ...) after Flax's: Flax's attributes (names, defaults, order) are inherited, the
``kernel`` and ``bias`` parameters are Flax's (shapes, initializers, RNG use), and the call
computes ``activation(nn.Dense(...)(x))`` as one :func:`jaxact.dense_bias_act` /
:func:`jaxact.conv_bias_act`, which keeps only the output for the backward pass where the
activation allows it. The gated MLP, ``jaxact.linen.GatedMLP``, is in ``gated/linen.py``.
"""

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
from flax import linen as nn
from flax.typing import Array
from jax import lax

from jaxact._src.fused import api as fused
from jaxact._src.layers import common as layers
from jaxact._src.layers.common import Activation


def check_params_found(module: nn.Module, layer: str, flax_layer: str, kernel_shape) -> None:
  """A clear error, in ``apply``, for parameters that lack this layer's kernel: most often a
  checkpoint of Flax layers whose auto-names (``Dense_0``, ...) the swap changed.

  Flax numbers auto-names by class, so replacing an ``nn.Dense`` with ``DenseAct`` renames it
  (``DenseAct_0``) and every ``nn.Dense`` after it in the module (``Dense_1`` becomes ``Dense_0``).
  The error names the missing path, the kernels beside it and the one of this layer's shape.
  """
  if module.is_mutable_collection("params") or module.has_variable("params", "kernel"):
    return  # initializing, or the parameters are there
  path = "/" + "/".join(module.scope.path)
  beside: dict[str, tuple[int, ...]] = {}
  parent = module.scope.parent
  if parent is not None:
    found = parent.variables().get("params", {})
    for name, value in found.items():
      if isinstance(value, Mapping) and "kernel" in value:
        beside[name] = tuple(jnp.shape(value["kernel"]))
  message = f"{layer} at {path}: the parameters given have no 'kernel' for this layer"
  if beside:
    listed = ", ".join(f"{name} (kernel {shape})" for name, shape in beside.items())
    message += f"; beside it they hold {listed}"
  same = [name for name, shape in beside.items() if shape == tuple(kernel_shape)]
  if same:
    message += (
      f". {same[0]} has this layer's kernel shape {tuple(kernel_shape)}: probably its name in the "
      f"checkpoint. Flax numbers auto-names by class, so the swap renamed this layer and every "
      f"{flax_layer} after it: pass name={same[0]!r} here and give each later {flax_layer} its "
      "checkpoint name too (docs: 'Flax layers', keeping checkpoint names)"
    )
  raise ValueError(message)


class DenseAct(nn.Dense):
  """``activation(nn.Dense(features)(x))`` as one fused op: a drop-in for ``nn.Dense`` + activation.

  A subclass of ``flax.linen.Dense``: its attributes, their defaults and order, and the parameters
  (``kernel`` of shape ``(in, features)``, ``bias`` of shape ``(features,)``, their initializers
  and RNG use) are Flax's, so ``DenseAct(f, activation=a).init(key, x)`` gives the parameters of
  ``nn.Dense(f).init(key, x)`` and existing checkpoints load. The matmul, bias and activation run
  as :func:`jaxact.dense_bias_act`, which keeps only the output for the backward pass where the
  activation allows it. A custom ``dot_general`` / ``dot_general_cls``, or a ``promote_dtype`` that
  gives other than real floating-point arrays, runs Flax's computation followed by the activation.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import DenseAct
    >>> layer = DenseAct(features=4, activation="gelu")
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> jax.tree_util.tree_map(jnp.shape, params)
    {'params': {'bias': (4,), 'kernel': (3, 4)}}

  Attributes:
    features: the number of output features.
    use_bias: whether to add a bias to the output (default: True).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer function for the weight matrix.
    bias_init: initializer function for the bias.
    promote_dtype: function promoting ``(inputs, kernel, bias)`` to a common dtype, as in Flax.
    dot_general: a custom dot product; when set (to other than ``lax.dot_general``), Flax's
      computation runs, then the activation.
    dot_general_cls: a factory of a custom dot product; likewise.
    activation: an activation name (``"relu"``), a jaxact function, one of ``jax.nn``'s
      (``nn.relu``), a ``functools.partial`` of either with keyword parameters, or any callable
      (applied to the pre-activation, which is then kept). Default ``"identity"``: the layer is
      ``nn.Dense``.
    residual_bits: None (default), or 8, 4, 2: the activation (gelu, gelu_quick, silu, mish,
      hard_silu) keeps its derivative coded in that many bits an element instead of the
      pre-activation, as ``partial(jaxact.gelu, residual_bits=...)`` does.
    dropout_rate: ``nn.Dropout``'s ``rate`` applied to the activation's output inside the op
      (default 0: none): the layer is ``nn.Dense`` + activation + ``nn.Dropout``, keeping no mask
      (see :func:`jaxact.dense_bias_act`).
    deterministic: as ``nn.Dropout``'s (also a call argument): True turns the dropout off.
    dropout_broadcast_dims: ``nn.Dropout``'s ``broadcast_dims``.
    rng_collection: the rng stream the dropout key comes from (default ``'dropout'``).
  """

  # nn.Dense's attributes, inherited: features, use_bias, dtype, param_dtype, precision,
  # kernel_init, bias_init, promote_dtype, dot_general, dot_general_cls.
  activation: Activation = "identity"
  residual_bits: int | None = None
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  dropout_broadcast_dims: Sequence[int] = ()
  rng_collection: str = "dropout"

  @nn.compact
  def __call__(
    self,
    inputs: Array,
    deterministic: bool | None = None,
    rng: Array | None = None,
    *,
    out_sharding=None,
  ) -> Array:
    """``activation(inputs @ kernel + bias)`` over the last dimension of `inputs`, then the
    dropout; `deterministic` and `rng` as ``nn.Dropout``'s call takes them, `out_sharding` as
    ``nnx.Linear``'s call (and :func:`jaxact.dense_bias_act`) takes it."""
    layers.check_activation("jaxact.linen.DenseAct", self.activation)
    key = None
    if self.dropout_rate != 0 and not nn.merge_param(
      "deterministic", self.deterministic, deterministic
    ):
      key = rng if rng is not None else self.make_rng(self.rng_collection)
    drop = layers.dropout_kwargs(self.dropout_rate, self.dropout_broadcast_dims, key)
    activation = layers.with_bits("jaxact.linen.DenseAct", self.activation, self.residual_bits)
    kernel_shape = (jnp.shape(inputs)[-1], self.features)
    check_params_found(self, "jaxact.linen.DenseAct", "nn.Dense", kernel_shape)
    kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
    bias = (
      self.param("bias", self.bias_init, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    if (
      self.dot_general in (None, lax.dot_general)
      and self.dot_general_cls is None
      and layers.fusable(inputs, kernel, bias)
    ):
      return fused.dense_bias_act(
        inputs,
        kernel,
        bias,
        activation=activation,
        precision=self.precision,
        out_sharding=out_sharding,
        **drop,
      )
    # Flax's own computation, then the activation and the dropout.
    if self.dot_general_cls is not None:
      dot_general = self.dot_general_cls()
    elif self.dot_general is not None:
      dot_general = self.dot_general
    else:
      dot_general = lax.dot_general
    sharded = {} if out_sharding is None else {"out_sharding": out_sharding}
    y = dot_general(
      inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision, **sharded
    )
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return layers.drop("jaxact.linen.DenseAct", layers.activate(activation, y), drop)


class ConvAct(nn.Conv):
  """``activation(nn.Conv(...)(x))`` as one fused op: a drop-in for ``nn.Conv`` + activation.

  A subclass of ``flax.linen.Conv``: its attributes, their defaults and order, and the parameters
  (``kernel`` of shape ``kernel_size + (in // feature_group_count, features)``, ``bias`` of shape
  ``(features,)``, their initializers and RNG use) are Flax's; the input is channels-last, batch
  dimensions folded into one (or one added) as Flax does. ``'CIRCULAR'``, ``'REFLECT'`` and
  ``'CAUSAL'`` padding pad the input explicitly, as Flax does, and a ``mask`` multiplies the
  kernel; both then run through :func:`jaxact.conv_bias_act`. A custom ``conv_general_dilated`` /
  ``conv_general_dilated_cls``, or non-real-floating promoted dtypes, run Flax's computation
  followed by the activation.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import ConvAct
    >>> layer = ConvAct(features=4, kernel_size=(3,), padding="VALID", activation="relu")
    >>> out, variables = layer.init_with_output(jax.random.key(0), jnp.ones((1, 8, 3)))
    >>> jax.tree_util.tree_map(jnp.shape, variables)
    {'params': {'bias': (4,), 'kernel': (3, 3, 4)}}
    >>> out.shape
    (1, 6, 4)

  Attributes:
    features: number of convolution filters.
    kernel_size: shape of the convolutional kernel; an int is a 1-D kernel.
    strides: an int or a sequence of ``n`` ints, the inter-window strides (default: 1).
    padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` (1-D), an int,
      or a sequence of ``n`` ints or ``(low, high)`` pairs, as in ``flax.linen.Conv``.
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
    promote_dtype: function promoting ``(inputs, kernel, bias)`` to a common dtype, as in Flax.
    conv_general_dilated: a custom convolution; when set (to other than
      ``lax.conv_general_dilated``), Flax's computation runs, then the activation.
    conv_general_dilated_cls: a factory of a custom convolution; likewise.
    activation: as :class:`DenseAct`. Default ``"identity"``: the layer is ``nn.Conv``.
    residual_bits: as :class:`DenseAct`.
  """

  # nn.Conv's attributes, inherited: features, kernel_size, strides, padding, input_dilation,
  # kernel_dilation, feature_group_count, use_bias, mask, dtype, param_dtype, precision,
  # kernel_init, bias_init, promote_dtype, conv_general_dilated, conv_general_dilated_cls.
  activation: Activation = "identity"
  residual_bits: int | None = None

  @nn.compact
  def __call__(self, inputs: Array, *, out_sharding=None) -> Array:
    """``activation(conv(inputs, kernel) + bias)``, inputs ``(*batch, *spatial, features)``;
    `out_sharding` as ``nnx.Conv``'s call (and :func:`jaxact.conv_bias_act`) takes it."""
    name = "jaxact.linen.ConvAct"
    layers.check_activation(name, self.activation)
    activation = layers.with_bits(name, self.activation, self.residual_bits)
    if isinstance(self.kernel_size, int):
      kernel_size = (self.kernel_size,)
    else:
      kernel_size = tuple(self.kernel_size)
    conv = layers.ConvInputs.prepare(
      inputs, kernel_size, self.strides, self.padding, self.input_dilation, self.kernel_dilation
    )
    in_features = jnp.shape(conv.inputs)[-1]
    layers.check_groups(name, in_features, self.feature_group_count)
    kernel_shape = (*kernel_size, in_features // self.feature_group_count, self.features)
    layers.check_mask(self.mask, kernel_shape)
    check_params_found(self, name, "nn.Conv", kernel_shape)
    kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
    if self.mask is not None:
      kernel *= self.mask
    bias = (
      self.param("bias", self.bias_init, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    x, kernel, bias = self.promote_dtype(conv.inputs, kernel, bias, dtype=self.dtype)
    if (
      self.conv_general_dilated in (None, lax.conv_general_dilated)
      and self.conv_general_dilated_cls is None
      and layers.fusable(x, kernel, bias)
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
        out_sharding=out_sharding,
      )
      return conv.restore(y)
    # Flax's own computation, then the activation.
    if self.conv_general_dilated_cls is not None:
      conv_general_dilated = self.conv_general_dilated_cls()
    elif self.conv_general_dilated is not None:
      conv_general_dilated = self.conv_general_dilated
    else:
      conv_general_dilated = lax.conv_general_dilated
    y = conv_general_dilated(
      x,
      kernel,
      conv.strides,
      conv.padding,
      lhs_dilation=conv.input_dilation,
      rhs_dilation=conv.kernel_dilation,
      dimension_numbers=layers.conv_dimension_numbers(x.ndim),
      feature_group_count=self.feature_group_count,
      precision=self.precision,
      **({} if out_sharding is None else {"out_sharding": out_sharding}),
    )
    if bias is not None:
      y += bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
    return layers.activate(activation, conv.restore(y))
