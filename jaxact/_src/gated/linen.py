"""The gated MLP of transformers as one Flax linen layer, :class:`GatedMLP`: the parameters of three
``nn.Dense`` named ``gate_proj``, ``up_proj`` and ``down_proj``, computed with one
:func:`jaxact.gated_mlp` (the call the linen and nnx layers share:
:func:`~jaxact._src.gated.api_flax.layer_gated_mlp`).
"""

from collections.abc import Sequence

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import initializers
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import default_kernel_init
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jaxact._src.gated.api_flax import layer_gated_mlp
from jaxact._src.layers import common as layers
from jaxact._src.layers.common import Activation


class _Projection(nn.Module):
  """The ``kernel`` and ``bias`` of ``nn.Dense(features)`` on `in_features` inputs, created as
  ``nn.Dense`` creates them (names, shapes, initializers, RNG use) and returned, not applied."""

  features: int
  use_bias: bool
  param_dtype: Dtype
  kernel_init: Initializer
  bias_init: Initializer

  @nn.compact
  def __call__(self, in_features: int) -> tuple[Array, Array | None]:
    kernel = self.param("kernel", self.kernel_init, (in_features, self.features), self.param_dtype)
    bias = (
      self.param("bias", self.bias_init, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    return kernel, bias


class GatedMLP(nn.Module):
  """The gated MLP block of transformers (SwiGLU, GeGLU, ...) as one :func:`jaxact.gated_mlp`.

  Computes ``down_proj(activation(gate_proj(x)) * up_proj(x))``, where each ``*_proj`` is an
  ``nn.Dense``: the parameters are those of a module holding three ``nn.Dense`` named as Hugging
  Face transformers' ``FlaxLlamaMLP`` names them, ``gate_proj`` and ``up_proj`` (``kernel`` of
  shape ``(in, hidden_features)``) and ``down_proj`` (``(hidden_features, features)``), each with a
  ``bias`` when ``use_bias``, from the same initializers and RNG use, so ``init`` with the same key
  gives that module's parameters and its checkpoints load as they are. Other implementations name
  the same three kernels otherwise (MaxText ``wi_0`` / ``wi_1`` / ``wo``, EasyLM ``w1`` / ``w3`` /
  ``w2``); rename the keys to load theirs. Between the forward and the backward pass the op keeps
  ``x`` and the two projections, not the hidden activations autodiff of the three layers keeps.

  The input, kernels and biases are promoted to one dtype as ``flax.linen.dtypes.promote_dtype``
  promotes them (to ``dtype`` when set). Dtypes :func:`jaxact.gated_mlp` does not take (complex)
  run Flax's three ``Dense`` computations and the activation.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import GatedMLP
    >>> layer = GatedMLP(hidden_features=8)  # a SwiGLU MLP, 4 -> 8 -> 4
    >>> y, params = layer.init_with_output(jax.random.key(0), jnp.ones((2, 4)))
    >>> {name: p["kernel"].shape for name, p in sorted(params["params"].items())}
    {'down_proj': (8, 4), 'gate_proj': (4, 8), 'up_proj': (4, 8)}
    >>> y.shape
    (2, 4)

  Attributes:
    hidden_features: the number of hidden features (``intermediate_size``).
    features: the number of output features; None (default) keeps the input's.
    activation: the gate's activation, as :class:`jaxact.linen.DenseAct` takes it (default
      ``"silu"``).
    use_bias: whether the three projections add a bias (default: False, as Llama).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer of the three kernels.
    bias_init: initializer of the three biases.
    dropout_rate: ``nn.Dropout``'s ``rate`` for the hidden activations, between the gated product
      and ``down_proj`` (T5 v1.1's and Gemma's place; default 0: none): the layer is the three
      ``nn.Dense`` with ``nn.Dropout`` applied to ``activation(gate_proj(x)) * up_proj(x)``, with
      the same mask for the same key, keeping the key, not the mask (see
      :func:`jaxact.gated_mlp`).
    deterministic: as ``nn.Dropout``'s (also a call argument): True turns the dropout off.
    dropout_broadcast_dims: ``nn.Dropout``'s ``broadcast_dims``.
    rng_collection: the rng stream the dropout key comes from (default ``'dropout'``).
    residuals: what the op keeps for the backward pass, as :func:`jaxact.gated_mlp` takes it:
      ``"projections"`` (default) or ``"input"`` (the input alone; the gate and up projections
      recomputed in the backward pass).
  """

  hidden_features: int
  features: int | None = None
  activation: Activation = "silu"
  use_bias: bool = False
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  dropout_broadcast_dims: Sequence[int] = ()
  rng_collection: str = "dropout"
  residuals: str = "projections"

  @nn.compact
  def __call__(
    self,
    inputs: Array,
    deterministic: bool | None = None,
    rng: Array | None = None,
    *,
    out_sharding=None,
  ) -> Array:
    """``down_proj(dropout(activation(gate_proj(inputs)) * up_proj(inputs)))`` over the last
    dimension; `deterministic` and `rng` as ``nn.Dropout``'s call takes them, `out_sharding` (the
    output's) as :func:`jaxact.gated_mlp` takes it."""
    name = "jaxact.linen.GatedMLP"
    layers.check_features(name, "hidden_features", self.hidden_features)
    layers.check_features(name, "features", self.features, optional=True)
    layers.check_activation(name, self.activation)
    key = None
    if self.dropout_rate != 0 and not nn.merge_param(
      "deterministic", self.deterministic, deterministic
    ):
      key = rng if rng is not None else self.make_rng(self.rng_collection)
    drop = layers.dropout_kwargs(self.dropout_rate, self.dropout_broadcast_dims, key)
    in_features = jnp.shape(inputs)[-1]
    out_features = in_features if self.features is None else self.features

    def projection(name: str, n_in: int, n_out: int):
      make = _Projection(
        n_out, self.use_bias, self.param_dtype, self.kernel_init, self.bias_init, name=name
      )
      return make(n_in)

    w_gate, b_gate = projection("gate_proj", in_features, self.hidden_features)
    w_up, b_up = projection("up_proj", in_features, self.hidden_features)
    w_down, b_down = projection("down_proj", self.hidden_features, out_features)
    arrays = promote_dtype(inputs, w_gate, w_up, w_down, b_gate, b_up, b_down, dtype=self.dtype)
    return layer_gated_mlp(
      self.activation, self.precision, *arrays, drop, name, out_sharding, self.residuals
    )
