"""Flax linen layers whose bias and activation are fused: drop-ins for ``nn.Dense`` / ``nn.Conv``.

``DenseAct`` and ``ConvAct`` take exactly the attributes of ``flax.linen.Dense`` and
``flax.linen.Conv`` plus ``activation``, create the same ``kernel`` and ``bias`` parameters, and
compute ``activation(nn.Dense(...)(x))`` as one :func:`jaxact.dense_bias_act` /
:func:`jaxact.conv_bias_act`. ``GatedMLP`` is the gated MLP of transformers (SwiGLU, ...) with the
parameters of three ``nn.Dense`` (``gate_proj``, ``up_proj``, ``down_proj``) and one
:func:`jaxact.gated_mlp`. ``MoEMLP`` is Mixtral's sparse mixture-of-experts block (router
``gate``, experts ``w1`` / ``w3`` / ``w2``) as one :func:`jaxact.moe_mlp`. ``LMHead`` is
``nn.Dense`` that, called with labels, returns :func:`jaxact.linear_cross_entropy` of its kernel
and bias; ``attend_cross_entropy`` is that loss
for a head tied to an ``nn.Embed`` (its ``attend``). ``RMSNorm`` and ``LayerNorm`` are
Flax's, computed by :func:`jaxact.rms_norm` / :func:`jaxact.layer_norm` (keeping their output).
This module imports Flax;
``import jaxact`` alone does not::

  import jaxact.linen as jnn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnn.DenseAct(512, activation="gelu")(x)  # was: nn.gelu(nn.Dense(512)(x))
      return jnn.DenseAct(10)(x)
"""

from jaxact._src.core.validation import require_flax

require_flax("jaxact.linen")

from jaxact._src.attention.linen import (  # noqa: E402 (after the check)
  linen_dot_product_attention as dot_product_attention,
)
from jaxact._src.fused.linen import ConvAct as ConvAct  # noqa: E402 (after the check)
from jaxact._src.fused.linen import DenseAct as DenseAct  # noqa: E402 (after the check)
from jaxact._src.gated.linen import GatedMLP as GatedMLP  # noqa: E402 (after the check)
from jaxact._src.lce.linen import LMHead as LMHead  # noqa: E402 (after the check)
from jaxact._src.lce.linen import attend_cross_entropy as attend_cross_entropy  # noqa: E402 (after the check)
from jaxact._src.moe.linen import MoEMLP as MoEMLP  # noqa: E402 (after the check)
from jaxact._src.norm_act.linen import BatchNorm as BatchNorm  # noqa: E402 (after the check)
from jaxact._src.norm_act.linen import ConvNormAct as ConvNormAct  # noqa: E402 (after the check)
from jaxact._src.norm_act.linen import GroupNorm as GroupNorm  # noqa: E402 (after the check)
from jaxact._src.norm_act.linen_conv import NormActConv as NormActConv  # noqa: E402 (after the check)
from jaxact._src.norms.linen import LayerNorm as LayerNorm  # noqa: E402 (after the check)
from jaxact._src.norms.linen import RMSNorm as RMSNorm  # noqa: E402 (after the check)
from jaxact._src.swap.linen import intercept as intercept  # noqa: E402 (after the check)
from jaxact._src.swap.report import Report as Report  # noqa: E402 (after the check)

__all__ = [
  "DenseAct",
  "ConvAct",
  "GatedMLP",
  "MoEMLP",
  "LMHead",
  "attend_cross_entropy",
  "RMSNorm",
  "LayerNorm",
  "BatchNorm",
  "GroupNorm",
  "ConvNormAct",
  "NormActConv",
  "dot_product_attention",
  "intercept",
  "Report",
]
