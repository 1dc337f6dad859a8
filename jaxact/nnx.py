"""Flax nnx layers whose bias and activation are fused: drop-ins for ``nnx.Linear`` / ``nnx.Conv``.

``LinearAct`` and ``ConvAct`` take exactly the arguments of ``flax.nnx.Linear`` and
``flax.nnx.Conv`` plus ``activation``, create the same ``kernel`` and ``bias`` parameters (sharding
metadata included), and compute ``activation(nnx.Linear(...)(x))`` as one
:func:`jaxact.dense_bias_act` / :func:`jaxact.conv_bias_act`. ``GatedMLP`` is the gated MLP of
transformers (SwiGLU, ...) holding three ``nnx.Linear`` (``gate_proj``, ``up_proj``,
``down_proj``) and computing with one :func:`jaxact.gated_mlp`. ``MoEMLP`` is Mixtral's sparse
mixture-of-experts block (router ``gate``, experts ``w1`` / ``w3`` / ``w2``) as one
:func:`jaxact.moe_mlp`. ``LMHead`` is ``nnx.Linear``
that, called with labels, returns :func:`jaxact.linear_cross_entropy` of its kernel and bias;
``attend_cross_entropy`` is that loss for a head tied to an ``nnx.Embed`` (its ``attend``).
``RMSNorm`` and ``LayerNorm`` are Flax's, computed by :func:`jaxact.rms_norm` /
:func:`jaxact.layer_norm` (keeping their output). ``swap(model)`` turns a model's own Flax layers
into these, in place, and ``route_activations()`` routes its activation functions to jaxact's
(docs/one-line.md). This module imports Flax; ``import jaxact`` alone does not::

  from flax import nnx
  from jaxact import nnx as jnnx

  layer = jnnx.LinearAct(784, 512, activation="relu", rngs=nnx.Rngs(0))
"""

from jaxact._src.core.validation import require_flax

require_flax("jaxact.nnx")

from jaxact._src.attention.nnx import (  # noqa: E402 (after the check)
  nnx_dot_product_attention as dot_product_attention,
)
from jaxact._src.fused.nnx import ConvAct as ConvAct  # noqa: E402 (after the check)
from jaxact._src.fused.nnx import LinearAct as LinearAct  # noqa: E402 (after the check)
from jaxact._src.gated.nnx import GatedMLP as GatedMLP  # noqa: E402 (after the check)
from jaxact._src.lce.nnx import LMHead as LMHead  # noqa: E402 (after the check)
from jaxact._src.lce.nnx import attend_cross_entropy as attend_cross_entropy  # noqa: E402 (after the check)
from jaxact._src.moe.nnx import MoEMLP as MoEMLP  # noqa: E402 (after the check)
from jaxact._src.moe.nnx import RouterBias as RouterBias  # noqa: E402 (after the check)
from jaxact._src.norm_act.nnx import BatchNorm as BatchNorm  # noqa: E402 (after the check)
from jaxact._src.norm_act.nnx import ConvNormAct as ConvNormAct  # noqa: E402 (after the check)
from jaxact._src.norm_act.nnx import GroupNorm as GroupNorm  # noqa: E402 (after the check)
from jaxact._src.norm_act.nnx_conv import NormActConv as NormActConv  # noqa: E402 (after the check)
from jaxact._src.norms.nnx import LayerNorm as LayerNorm  # noqa: E402 (after the check)
from jaxact._src.norms.nnx import RMSNorm as RMSNorm  # noqa: E402 (after the check)
from jaxact._src.swap.nnx import route_activations as route_activations  # noqa: E402 (after the check)
from jaxact._src.swap.nnx import swap as swap  # noqa: E402 (after the check)

__all__ = [
  "LinearAct",
  "ConvAct",
  "GatedMLP",
  "MoEMLP",
  "RouterBias",
  "LMHead",
  "attend_cross_entropy",
  "RMSNorm",
  "LayerNorm",
  "BatchNorm",
  "GroupNorm",
  "ConvNormAct",
  "NormActConv",
  "dot_product_attention",
  "swap",
  "route_activations",
]
