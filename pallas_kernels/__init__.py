"""Pallas kernels for jaxact: its GPU kernels, and jax's TPU attention kernels adapted to it.

Importable on its own: it depends only on jax. The activation epilogue is passed in as functions
(:class:`Epilogue`), so any elementwise activation works in every kernel, and the tiles come from
the caller (each module's ``default_*`` function chooses them from the shape, dtype and, where it
matters, whether the caller targets a Hopper GPU): the kernels know nothing of devices or of when
they should run. jaxact builds the epilogues from its spec table and decides where each kernel runs
(each op family's ``rules.py`` under ``jaxact/_src/``).

* Triton backend (``_triton.py``, the one import): :mod:`pallas_kernels.dense_triton` (fused
  matmul + epilogue and its backward; its tiles in :mod:`pallas_kernels.dense_triton_tiles`),
  :mod:`pallas_kernels.bias_act_triton` (convolution epilogue and its backward, the bias gradient
  pass), :mod:`pallas_kernels.norm_act_triton` (a batch or group norm's normalize-and-activate
  epilogue from given statistics, and its two-pass backward from x_hat),
  :mod:`pallas_kernels.gated_triton` (the gated projection ``act(x @ w_gate + b_gate) * (x @
  w_up + b_up)``, both matmuls from the same tiles of ``x``, and its one-pass elementwise backward),
  :mod:`pallas_kernels.attention_triton` (FlashAttention-2's forward and backward keeping q, k, v, o
  and two float32 numbers a row, its maximum and log-sum: GQA/MQA, causal, sliding window, lengths,
  logit soft cap), :mod:`pallas_kernels.grouped_triton` (grouped matmuls over rows sorted by
  group, a mixture of experts' products: ``gmm`` and its weight gradient ``tgmm``).
* Mosaic GPU backend (``_mosaic.py``, the one import and the lowering helpers), for Hopper:
  :mod:`pallas_kernels.dense_mosaic` (dense forward), :mod:`pallas_kernels.dense_mosaic_bwd` (its
  backward; its tiles in :mod:`pallas_kernels.dense_mosaic_bwd_tiles`),
  :mod:`pallas_kernels.gated_mosaic` (the gated units' forward: a, b and h from one pass),
  :mod:`pallas_kernels.lce_mosaic` (the linear cross-entropy's forward: per-token statistics of
  the logits), :mod:`pallas_kernels.lce_mosaic_bwd` (its backward's softmax-minus-one-hot
  blocks).

* TPU: :mod:`pallas_kernels.attention_splash` adapts jax's own splash attention kernels (Mosaic
  TPU, ``jax.experimental.pallas.ops.tpu``) to jaxact's attention layouts and residuals (O and
  each row's log-sum-exp out of the forward, back into the backward); its one import of them.

On CPU the kernels run in Pallas interpret mode (``interpret=True``), which is how they are tested.
The package is installed as ``pallas_kernels`` beside ``jaxact`` rather than inside it so that it
stays importable, and testable, without jaxact's spec table: it is jaxact's, and the name says
what it holds.
"""

from pallas_kernels._triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL_TARGET_NAME
from pallas_kernels._triton import allow_tf32 as allow_tf32
from pallas_kernels._triton import supported_dtypes as supported_dtypes
from pallas_kernels._triton import unlowered_primitives as unlowered_primitives
from pallas_kernels.attention_triton import AttentionBlockConfig as AttentionBlockConfig
from pallas_kernels.attention_triton import AttentionTiles as AttentionTiles
from pallas_kernels.attention_triton import attention_backward as attention_backward
from pallas_kernels.attention_triton import attention_forward as attention_forward
from pallas_kernels.attention_triton import attention_reference as attention_reference
from pallas_kernels.attention_triton import attention_unsupported as attention_unsupported
from pallas_kernels.bias_act_triton import EltwiseTiles as EltwiseTiles
from pallas_kernels.bias_act_triton import bias_act_bwd as bias_act_bwd
from pallas_kernels.bias_act_triton import bias_act_fwd as bias_act_fwd
from pallas_kernels.bias_act_triton import bias_act_reference as bias_act_reference
from pallas_kernels.bias_act_triton import bias_grad as bias_grad
from pallas_kernels.bias_act_triton import default_tiles as default_tiles
from pallas_kernels.dense_triton import dense_bias_act as dense_bias_act
from pallas_kernels.dense_triton import dense_bias_act_bwd as dense_bias_act_bwd
from pallas_kernels.dense_triton import dense_bias_act_fwd as dense_bias_act_fwd
from pallas_kernels.dense_triton import dense_bias_act_reference as dense_bias_act_reference
from pallas_kernels.dense_triton_tiles import BlockConfig as BlockConfig
from pallas_kernels.dense_triton_tiles import Tiles as Tiles
from pallas_kernels.dense_triton_tiles import default_block_config as default_block_config
from pallas_kernels.epilogue import DerivativeCode as DerivativeCode
from pallas_kernels.epilogue import Epilogue as Epilogue
from pallas_kernels.gated_triton import GatedBlockConfig as GatedBlockConfig
from pallas_kernels.gated_triton import gated_bwd as gated_bwd
from pallas_kernels.gated_triton import gated_bwd_reference as gated_bwd_reference
from pallas_kernels.gated_triton import gated_dense as gated_dense
from pallas_kernels.gated_triton import gated_dense_reference as gated_dense_reference
from pallas_kernels.gated_triton import gated_fwd as gated_fwd
from pallas_kernels.grouped_triton import GroupedConfig as GroupedConfig
from pallas_kernels.grouped_triton import gmm as gmm
from pallas_kernels.grouped_triton import gmm_reference as gmm_reference
from pallas_kernels.grouped_triton import tgmm as tgmm
from pallas_kernels.grouped_triton import tgmm_reference as tgmm_reference
from pallas_kernels.norm_act_triton import NormActTiles as NormActTiles
from pallas_kernels.norm_act_triton import norm_act_bwd as norm_act_bwd
from pallas_kernels.norm_act_triton import norm_act_bwd_reference as norm_act_bwd_reference
from pallas_kernels.norm_act_triton import norm_act_fwd as norm_act_fwd
from pallas_kernels.norm_act_triton import norm_act_reference as norm_act_reference

__all__ = [
  "CUSTOM_CALL_TARGET_NAME",
  "AttentionBlockConfig",
  "AttentionTiles",
  "BlockConfig",
  "DerivativeCode",
  "EltwiseTiles",
  "Epilogue",
  "GatedBlockConfig",
  "NormActTiles",
  "GroupedConfig",
  "Tiles",
  "allow_tf32",
  "attention_backward",
  "attention_forward",
  "attention_reference",
  "attention_unsupported",
  "bias_act_bwd",
  "bias_act_fwd",
  "bias_act_reference",
  "bias_grad",
  "default_block_config",
  "default_tiles",
  "dense_bias_act",
  "dense_bias_act_bwd",
  "dense_bias_act_fwd",
  "dense_bias_act_reference",
  "gated_bwd",
  "gated_bwd_reference",
  "gated_dense",
  "gated_dense_reference",
  "gated_fwd",
  "norm_act_bwd",
  "norm_act_bwd_reference",
  "norm_act_fwd",
  "norm_act_reference",
  "gmm",
  "gmm_reference",
  "supported_dtypes",
  "tgmm",
  "tgmm_reference",
  "unlowered_primitives",
]
