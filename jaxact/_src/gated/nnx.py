"""The gated MLP of transformers (SwiGLU, GeGLU, ...) as a Flax nnx layer: :class:`GatedMLP`.

:class:`GatedMLP` holds three ``nnx.Linear`` named ``gate_proj``, ``up_proj`` and ``down_proj`` and
computes with one :func:`jaxact.gated_mlp`. Public as ``jaxact.nnx.GatedMLP``.
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxact._src.gated.api_flax import layer_gated_mlp
from jaxact._src.layers import common as layers
from jaxact._src.layers.common import Activation
from jaxact._src.layers.nnx import dropout_key

Array = jax.Array


class GatedMLP(nnx.Module):
  """The gated MLP block of transformers (SwiGLU, GeGLU, ...) as one :func:`jaxact.gated_mlp`.

  Computes ``down_proj(activation(gate_proj(x)) * up_proj(x))``. ``gate_proj``, ``up_proj``
  (``in_features -> hidden_features``) and ``down_proj`` (``hidden_features -> out_features``) are
  ``nnx.Linear`` attributes, named as Hugging Face transformers' ``FlaxLlamaMLP`` names them and
  created in that order from ``rngs``: the state equals that of a module holding those three
  ``nnx.Linear`` (made in that order with the same arguments), so its checkpoints load as they
  are; the layers' parameters are read, the layers are not called. Other implementations name the
  same kernels otherwise (MaxText ``wi_0`` / ``wi_1`` / ``wo``, EasyLM ``w1`` / ``w3`` / ``w2``);
  rename the keys to load theirs. Between the forward and the backward pass the op keeps ``x`` and
  the two projections, not the hidden activations autodiff of the three layers keeps.

  The input, kernels and biases are promoted to one dtype as ``flax.nnx`` promotes them (to
  ``dtype`` when set). Dtypes :func:`jaxact.gated_mlp` does not take (complex) run Flax's three
  ``Linear`` computations and the activation.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import GatedMLP
    >>> layer = GatedMLP(4, 8, rngs=nnx.Rngs(0))  # a SwiGLU MLP, 4 -> 8 -> 4
    >>> layer.gate_proj.kernel.shape, layer.down_proj.kernel.shape
    ((4, 8), (8, 4))
    >>> layer(jnp.ones((2, 4))).shape
    (2, 4)

  Args:
    in_features: the number of input features.
    hidden_features: the number of hidden features (``intermediate_size``).
    out_features: the number of output features; None (default) is ``in_features``.
    activation: the gate's activation, as :class:`jaxact.nnx.LinearAct` takes it (default
      ``"silu"``).
    use_bias: whether the three projections add a bias (default: False, as Llama).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer of the three kernels.
    bias_init: initializer of the three biases.
    rngs: rng key.
    kernel_metadata: metadata of the ``gate_proj`` and ``up_proj`` kernels (``(in, hidden)``),
      e.g. ``{"out_sharding": (None, "model")}`` for tensor parallelism.
    bias_metadata: metadata of the ``gate_proj`` and ``up_proj`` biases.
    down_kernel_metadata: metadata of the ``down_proj`` kernel (``(hidden, out)``), e.g.
      ``{"out_sharding": ("model", None)}``; the two shapes differ, so the metadata does too.
    down_bias_metadata: metadata of the ``down_proj`` bias.
    dropout_rate: ``nnx.Dropout``'s ``rate`` for the hidden activations, between the gated product
      and ``down_proj`` (T5 v1.1's and Gemma's place; default 0: none), inside the op, keeping the
      key, not the mask (see :func:`jaxact.gated_mlp`). Its key stream is forked from `rngs` after
      the three projections' parameters are drawn, as an ``nnx.Dropout(rate, rngs=rngs)`` built
      after them: the same `rngs` give the same masks.
    dropout_broadcast_dims: ``nnx.Dropout``'s ``broadcast_dims``.
    deterministic: as ``nnx.Dropout``'s (``model.eval()`` / ``model.train()`` set it).
    rng_collection: the rng stream the dropout key comes from (default ``'dropout'``).
    residuals: what the op keeps for the backward pass, as :func:`jaxact.gated_mlp` takes it:
      ``"projections"`` (default) or ``"input"`` (the input alone; the gate and up projections
      recomputed in the backward pass).
  """

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    out_features: int | None = None,
    *,
    activation: Activation = "silu",
    use_bias: bool = False,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    rngs: nnx.Rngs,
    kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    down_kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    down_bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    dropout_rate: float = 0.0,
    dropout_broadcast_dims: tp.Sequence[int] = (),
    deterministic: bool | None = False,
    rng_collection: str = "dropout",
    residuals: str = "projections",
  ):
    name = "jaxact.nnx.GatedMLP"
    layers.check_features(name, "in_features", in_features)
    layers.check_features(name, "hidden_features", hidden_features)
    layers.check_features(name, "out_features", out_features, optional=True)
    layers.check_activation(name, activation)
    if out_features is None:
      out_features = in_features

    def linear(n_in, n_out, kernel_metadata, bias_metadata):
      return nnx.Linear(
        n_in,
        n_out,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        kernel_init=kernel_init,
        bias_init=bias_init,
        rngs=rngs,
        kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata,
      )

    self.gate_proj = linear(in_features, hidden_features, kernel_metadata, bias_metadata)
    self.up_proj = linear(in_features, hidden_features, kernel_metadata, bias_metadata)
    self.down_proj = linear(hidden_features, out_features, down_kernel_metadata, down_bias_metadata)

    self.in_features = in_features
    self.hidden_features = hidden_features
    self.out_features = out_features
    self.activation = activation
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.dropout_rate = dropout_rate
    self.dropout_broadcast_dims = dropout_broadcast_dims
    self.deterministic = deterministic
    self.rng_collection = rng_collection
    self.residuals = residuals
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
    """``down_proj(dropout(activation(gate_proj(inputs)) * up_proj(inputs)))`` over the last
    dimension.

    Args:
      inputs: the array to transform.
      out_sharding: the output's sharding, as ``nnx.Linear``'s call takes it (Gemma's
        ``act_btd``), for :func:`jaxact.gated_mlp`; the hidden is split as ``inputs``' rows and
        the kernels' columns (``act_btf``).
      deterministic: as ``nnx.Dropout``'s call: overrides the attribute.
      rngs: as ``nnx.Dropout``'s call: a key, stream or ``Rngs`` overriding the layer's stream
        (what a block passes on, ``self.mlp(x, rngs=rngs)``; unused without dropout).
    """
    name = "jaxact.nnx.GatedMLP"
    layers.check_activation(name, self.activation)
    key = dropout_key(name, self, deterministic, rngs)
    drop = layers.dropout_kwargs(self.dropout_rate, self.dropout_broadcast_dims, key)
    projections = (self.gate_proj, self.up_proj, self.down_proj)
    kernels = [p.kernel[...] for p in projections]
    biases = [None if p.bias is None else p.bias[...] for p in projections]
    arrays = dtypes.promote_dtype((inputs, *kernels, *biases), dtype=self.dtype)
    return layer_gated_mlp(
      self.activation, self.precision, *arrays, drop, name, out_sharding, self.residuals
    )
