"""jaxact: training ops for JAX that keep one array a layer for the backward pass, and never NaN.

Each op is one ``jax.custom_vjp`` keeping only what its backward needs (the output wherever the
derivative can be written from it): every ``jax.nn`` activation under its own name (plus
``gelu_quick``), ``dense_bias_act`` / ``conv_bias_act``, ``gated_dense`` / ``gated_mlp``,
``moe_mlp`` (mixture of experts), ``rms_norm`` / ``layer_norm``, ``batch_norm_act`` /
``group_norm_act``,
``dot_product_attention``, ``linear_cross_entropy`` (the LM head
and its loss without the logits), ``linear_log_probs`` (per-token log-probabilities and entropy,
without the logits) and ``preference_loss`` (DPO and its kin on them). Flax layers in
:mod:`jaxact.linen` and :mod:`jaxact.nnx`; GPU kernels in :mod:`pallas_kernels`. See the README
and ``docs/`` for what each keeps and where it differs from jax.nn.
"""

from jaxact._src.activations.api import ACTIVATIONS as ACTIVATIONS
from jaxact._src.activations.api import celu as celu
from jaxact._src.activations.api import elu as elu
from jaxact._src.activations.api import gelu as gelu
from jaxact._src.activations.api import gelu_quick as gelu_quick
from jaxact._src.activations.api import get_activation as get_activation
from jaxact._src.activations.api import get_spec as get_spec
from jaxact._src.activations.api import glu as glu
from jaxact._src.activations.api import hard_sigmoid as hard_sigmoid
from jaxact._src.activations.api import hard_silu as hard_silu
from jaxact._src.activations.api import hard_swish as hard_swish
from jaxact._src.activations.api import hard_tanh as hard_tanh
from jaxact._src.activations.api import identity as identity
from jaxact._src.activations.api import leaky_relu as leaky_relu
from jaxact._src.activations.api import log_sigmoid as log_sigmoid
from jaxact._src.activations.api import log_softmax as log_softmax
from jaxact._src.activations.api import mish as mish
from jaxact._src.activations.api import relu as relu
from jaxact._src.activations.api import relu6 as relu6
from jaxact._src.activations.api import selu as selu
from jaxact._src.activations.api import sigmoid as sigmoid
from jaxact._src.activations.api import silu as silu
from jaxact._src.activations.api import soft_sign as soft_sign
from jaxact._src.activations.api import softmax as softmax
from jaxact._src.activations.api import softplus as softplus
from jaxact._src.activations.api import sparse_plus as sparse_plus
from jaxact._src.activations.api import sparse_sigmoid as sparse_sigmoid
from jaxact._src.activations.api import squareplus as squareplus
from jaxact._src.activations.api import swish as swish
from jaxact._src.activations.api import tanh as tanh
from jaxact._src.attention.api import dot_product_attention as dot_product_attention
from jaxact._src.attention.api_project import project_heads as project_heads
from jaxact._src.attention.vjp import CHECKPOINT_NAMES as ATTENTION_CHECKPOINT_NAMES
from jaxact._src.fused.api import conv_bias_act as conv_bias_act
from jaxact._src.fused.api import dense_bias_act as dense_bias_act
from jaxact._src.fused.vjp import CHECKPOINT_NAMES as FUSED_CHECKPOINT_NAMES
from jaxact._src.gated.api import gated_dense as gated_dense
from jaxact._src.gated.api import gated_mlp as gated_mlp
from jaxact._src.gated.vjp import CHECKPOINT_NAMES as GATED_CHECKPOINT_NAMES
from jaxact._src.lce.api import linear_cross_entropy as linear_cross_entropy
from jaxact._src.lce.api_distill import distillation_loss as distillation_loss
from jaxact._src.lce.api_log_probs import linear_log_probs as linear_log_probs
from jaxact._src.lce.api_policy import policy_gradient_loss as policy_gradient_loss
from jaxact._src.lce.api_preference import preference_loss as preference_loss
from jaxact._src.lce.api_top_k import top_k_distillation_loss as top_k_distillation_loss
from jaxact._src.moe.api import moe_mlp as moe_mlp
from jaxact._src.moe.api_transformers import (
  moe_params_from_transformers as moe_params_from_transformers,
)
from jaxact._src.moe.vjp import CHECKPOINT_NAMES as MOE_CHECKPOINT_NAMES
from jaxact._src.norm_act.api import batch_norm_act as batch_norm_act
from jaxact._src.norm_act.api import group_norm_act as group_norm_act
from jaxact._src.norms.api import layer_norm as layer_norm
from jaxact._src.norms.api import rms_norm as rms_norm
from jaxact._src.norms.vjp import CHECKPOINT_NAMES as NORM_CHECKPOINT_NAMES

__version__ = "0.1.0.dev0"

__all__ = [
  "identity",
  "sigmoid",
  "tanh",
  "relu",
  "relu6",
  "leaky_relu",
  "elu",
  "selu",
  "celu",
  "softplus",
  "log_sigmoid",
  "soft_sign",
  "squareplus",
  "sparse_plus",
  "sparse_sigmoid",
  "hard_tanh",
  "hard_sigmoid",
  "hard_silu",
  "hard_swish",
  "gelu",
  "gelu_quick",
  "silu",
  "swish",
  "mish",
  "glu",
  "softmax",
  "log_softmax",
  "get_activation",
  "get_spec",
  "ACTIVATIONS",
  "dense_bias_act",
  "conv_bias_act",
  "FUSED_CHECKPOINT_NAMES",
  "gated_dense",
  "gated_mlp",
  "GATED_CHECKPOINT_NAMES",
  "moe_mlp",
  "moe_params_from_transformers",
  "MOE_CHECKPOINT_NAMES",
  "linear_cross_entropy",
  "linear_log_probs",
  "policy_gradient_loss",
  "distillation_loss",
  "top_k_distillation_loss",
  "preference_loss",
  "rms_norm",
  "NORM_CHECKPOINT_NAMES",
  "layer_norm",
  "batch_norm_act",
  "group_norm_act",
  "dot_product_attention",
  "project_heads",
  "ATTENTION_CHECKPOINT_NAMES",
]
