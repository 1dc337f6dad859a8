"""The mixture-of-experts MLP as a Flax nnx layer, :class:`MoEMLP`: Mixtral's parameters computed
with one :func:`jaxact.moe_mlp`. Public as ``jaxact.nnx.MoEMLP``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxact._src.layers import common as layers
from jaxact._src.layers.common import Activation
from jaxact._src.moe import api as moe

Array = jax.Array

# lecun_normal of each expert's (in, out) kernel: the stacked kernel's first axis is a batch axis.
default_expert_init = nnx.initializers.lecun_normal(batch_axis=(0,))


class RouterBias(nnx.Variable):
  """DeepSeek-V3's balancing bias of :class:`MoEMLP`: state, not an ``nnx.Param``, so that
  ``nnx.grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)`` leave it to the caller's update."""


class MoEMLP(nnx.Module):
  """A mixture-of-experts MLP (Mixtral's sparse MoE block) as one :func:`jaxact.moe_mlp`.

  The router ``gate`` is an ``nnx.Linear(in_features, num_experts, use_bias=False)`` (its kernel
  is read, the layer is not called); the experts' ``w1`` (gate), ``w3`` (up) and ``w2`` (down) are
  ``nnx.Param`` stacked over the experts, ``(num_experts, in_features, hidden_features)`` twice and
  ``(num_experts, hidden_features, out_features)``, drawn from `rngs` in that order after the
  router, as :class:`jaxact.linen.MoEMLP` lays them out (Mixtral's names; Qwen3-MoE's
  ``gate_proj`` / ``up_proj`` / ``down_proj``). The call returns ``(y, aux)`` (see
  :func:`jaxact.moe_mlp`).

  With ``use_router_bias=True`` the layer holds DeepSeek-V3's auxiliary-loss-free balancing bias
  (transformers' ``gate.e_score_correction_bias``) as ``router_bias``, a :class:`RouterBias`
  variable ``(num_experts,)`` of zeros (not an ``nnx.Param``): given to the op as its
  ``router_bias`` (added to the scores for the choice only, no gradient) and updated by the
  caller outside the gradient. It is cast to the computation dtype with the parameters.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import MoEMLP
    >>> layer = MoEMLP(4, 8, num_experts=4, top_k=2, rngs=nnx.Rngs(0))
    >>> layer.gate.kernel.shape, layer.w2.shape
    ((4, 4), (4, 8, 4))
    >>> y, aux = layer(jnp.ones((3, 4)))
    >>> y.shape
    (3, 4)

  Args:
    in_features: the number of input features.
    hidden_features: each expert's hidden features (Mixtral's ``intermediate_size``).
    out_features: the number of output features; None (default) is ``in_features``.
    num_experts: the number of experts.
    top_k: the number of experts each token goes to.
    activation: the gate's activation, as :func:`jaxact.moe_mlp` takes it (default ``"silu"``).
    score: ``"softmax"`` (default) or ``"sigmoid"``, as :func:`jaxact.moe_mlp`.
    normalize_top_k: as :func:`jaxact.moe_mlp` (default True, Mixtral's).
    capacity_factor: as :func:`jaxact.moe_mlp` (default None: dropless).
    capacity_per_sequence: as :func:`jaxact.moe_mlp` (default False: over every token).
    expert_groups: as :func:`jaxact.moe_mlp` (default 1; DeepSeek-V3's ``n_group``).
    top_k_groups: as :func:`jaxact.moe_mlp` (default None: every group; DeepSeek-V3's
      ``topk_group``).
    balance_loss: as :func:`jaxact.moe_mlp` (default ``"switch"``; ``"deepseek_v3"``: that
      report's sequence-wise L_Bal, over ``inputs``' last leading dimension).
    use_router_bias: hold a :class:`RouterBias` ``router_bias`` (default False; see above).
    return_stats: as :func:`jaxact.moe_mlp`: ``aux`` also holds the balance loss's statistics,
      for a model to pool over its layers (default False).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer of the router's kernel.
    expert_init: initializer of the stacked expert kernels.
    rngs: rng key.
  """

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    out_features: int | None = None,
    *,
    num_experts: int,
    top_k: int,
    activation: Activation = "silu",
    score: str = "softmax",
    normalize_top_k: bool = True,
    capacity_factor: float | None = None,
    capacity_per_sequence: bool = False,
    expert_groups: int = 1,
    top_k_groups: int | None = None,
    balance_loss: str = "switch",
    use_router_bias: bool = False,
    return_stats: bool = False,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = default_kernel_init,
    expert_init: Initializer = default_expert_init,
    rngs: nnx.Rngs,
  ):
    name = "jaxact.nnx.MoEMLP"
    layers.check_features(name, "in_features", in_features)
    layers.check_features(name, "hidden_features", hidden_features)
    layers.check_features(name, "out_features", out_features, optional=True)
    layers.check_features(name, "num_experts", num_experts)
    layers.check_activation(name, activation)
    out_features = in_features if out_features is None else out_features
    self.gate = nnx.Linear(
      in_features,
      num_experts,
      use_bias=False,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      rngs=rngs,
    )
    e, d, f = num_experts, in_features, hidden_features
    self.w1 = nnx.Param(expert_init(rngs.params(), (e, d, f), param_dtype))
    self.w3 = nnx.Param(expert_init(rngs.params(), (e, d, f), param_dtype))
    self.w2 = nnx.Param(expert_init(rngs.params(), (e, f, out_features), param_dtype))
    self.router_bias = RouterBias(jnp.zeros((e,), param_dtype)) if use_router_bias else None
    self.in_features = in_features
    self.hidden_features = hidden_features
    self.out_features = out_features
    self.num_experts = num_experts
    self.top_k = top_k
    self.activation = activation
    self.score = score
    self.normalize_top_k = normalize_top_k
    self.capacity_factor = capacity_factor
    self.capacity_per_sequence = capacity_per_sequence
    self.expert_groups = expert_groups
    self.top_k_groups = top_k_groups
    self.balance_loss = balance_loss
    self.return_stats = return_stats
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision

  def __call__(
    self, inputs: Array, token_mask: Array | None = None
  ) -> tuple[Array, dict[str, Array]]:
    """``(y, aux)`` of :func:`jaxact.moe_mlp` over the last dimension of `inputs`; `token_mask`
    (``inputs``' leading shape, zero at padding) as the op's."""
    bias = None if self.router_bias is None else self.router_bias[...]
    arrays = (inputs, self.gate.kernel[...], self.w1[...], self.w3[...], self.w2[...], bias)
    x, router, w1, w3, w2, bias = dtypes.promote_dtype(arrays, dtype=self.dtype)
    return moe.moe_mlp(
      x, router, w1, w3, w2, router_bias=bias, token_mask=token_mask, **moe.layer_options(self)
    )
