"""The mixture-of-experts MLP as a Flax linen layer, :class:`MoEMLP`: Mixtral's parameters (the
router ``gate``, the experts' ``w1`` / ``w3`` / ``w2`` stacked over the experts) computed with one
:func:`jaxact.moe_mlp`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import default_kernel_init
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jaxact._src.layers import common as layers
from jaxact._src.layers.common import Activation
from jaxact._src.moe import api as moe

# lecun_normal of each expert's (in, out) kernel: the stacked (experts, in, out) kernel's first
# axis is a batch axis, not part of the fan-in.
default_expert_init = nn.initializers.lecun_normal(batch_axis=(0,))


class _Router(nn.Module):
  """The ``kernel`` of ``nn.Dense(experts, use_bias=False)`` on `in_features` inputs, created as
  ``nn.Dense`` creates it and returned, not applied (the op computes the logits in float32)."""

  experts: int
  param_dtype: Dtype
  kernel_init: Initializer

  @nn.compact
  def __call__(self, in_features: int) -> Array:
    return self.param("kernel", self.kernel_init, (in_features, self.experts), self.param_dtype)


class MoEMLP(nn.Module):
  """A mixture-of-experts MLP (Mixtral's sparse MoE block) as one :func:`jaxact.moe_mlp`.

  Parameters as Mixtral's ``MixtralSparseMoeBlock`` names them: the router ``gate`` (an
  ``nn.Dense(num_experts, use_bias=False)``'s ``kernel``, ``(in, num_experts)``), and each
  expert's SwiGLU ``w1`` (gate), ``w3`` (up) and ``w2`` (down), stacked over the experts:
  ``w1``, ``w3`` of shape ``(num_experts, in, hidden_features)`` and ``w2`` of shape
  ``(num_experts, hidden_features, features)``, each expert's ``(in, out)`` kernel laid out as a
  Flax ``Dense`` kernel (the transpose of PyTorch's ``Linear.weight``). Qwen3-MoE's
  ``gate_proj`` / ``up_proj`` / ``down_proj`` are ``w1`` / ``w3`` / ``w2``. The router's kernel is
  initialized as ``nn.Dense``'s, each expert's as an ``nn.Dense`` kernel of its own (lecun normal
  over its ``in``), in the order ``gate``, ``w1``, ``w3``, ``w2``.

  Returns ``(y, aux)``: ``aux`` holds the load-balancing loss and the router z-loss (see
  :func:`jaxact.moe_mlp`), unweighted.

  With ``use_router_bias=True`` the layer holds DeepSeek-V3's auxiliary-loss-free balancing bias
  (transformers' ``gate.e_score_correction_bias``) as the variable ``router_bias``
  ``(num_experts,)`` of the ``"routing"`` collection, not ``"params"``: zeros at init, given to
  the op as its ``router_bias`` (added to the scores for the choice only, no gradient) and updated
  by the caller outside the gradient, as ``batch_stats`` are. Pass it back with
  ``apply({"params": ..., "routing": ...}, x)``. It is cast to the computation dtype with the
  parameters.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import MoEMLP
    >>> layer = MoEMLP(num_experts=4, top_k=2, hidden_features=8)
    >>> (y, aux), params = layer.init_with_output(jax.random.key(0), jnp.ones((3, 5, 4)))
    >>> jax.tree_util.tree_map(jnp.shape, params["params"])
    {'gate': {'kernel': (4, 4)}, 'w1': (4, 4, 8), 'w2': (4, 8, 4), 'w3': (4, 4, 8)}
    >>> y.shape
    (3, 5, 4)

  Attributes:
    num_experts: the number of experts.
    top_k: the number of experts each token goes to.
    hidden_features: each expert's hidden features (Mixtral's ``intermediate_size``).
    features: the number of output features; None (default) keeps the input's.
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
    use_router_bias: hold a ``router_bias`` variable in the ``"routing"`` collection (default
      False; see above).
    return_stats: as :func:`jaxact.moe_mlp`: ``aux`` also holds the balance loss's statistics,
      for a model to pool over its layers (default False).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer of the router's kernel.
    expert_init: initializer of the stacked expert kernels.
  """

  num_experts: int
  top_k: int
  hidden_features: int
  features: int | None = None
  activation: Activation = "silu"
  score: str = "softmax"
  normalize_top_k: bool = True
  capacity_factor: float | None = None
  capacity_per_sequence: bool = False
  expert_groups: int = 1
  top_k_groups: int | None = None
  balance_loss: str = "switch"
  use_router_bias: bool = False
  return_stats: bool = False
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  expert_init: Initializer = default_expert_init

  @nn.compact
  def __call__(
    self, inputs: Array, token_mask: Array | None = None
  ) -> tuple[Array, dict[str, Array]]:
    """``(y, aux)`` of :func:`jaxact.moe_mlp` over the last dimension of `inputs`; `token_mask`
    (``inputs``' leading shape, zero at padding) as the op's."""
    name = "jaxact.linen.MoEMLP"
    layers.check_features(name, "num_experts", self.num_experts)
    layers.check_features(name, "hidden_features", self.hidden_features)
    layers.check_features(name, "features", self.features, optional=True)
    layers.check_activation(name, self.activation)
    d = jnp.shape(inputs)[-1]
    out = d if self.features is None else self.features
    e, f = self.num_experts, self.hidden_features
    router = _Router(e, self.param_dtype, self.kernel_init, name="gate")(d)
    w1 = self.param("w1", self.expert_init, (e, d, f), self.param_dtype)
    w3 = self.param("w3", self.expert_init, (e, d, f), self.param_dtype)
    w2 = self.param("w2", self.expert_init, (e, f, out), self.param_dtype)
    bias = None
    if self.use_router_bias:  # state, not a parameter: the caller updates it outside the gradient
      bias = self.variable("routing", "router_bias", jnp.zeros, (e,), self.param_dtype).value
    x, router, w1, w3, w2, bias = promote_dtype(inputs, router, w1, w3, w2, bias, dtype=self.dtype)
    return moe.moe_mlp(
      x, router, w1, w3, w2, router_bias=bias, token_mask=token_mask, **moe.layer_options(self)
    )
