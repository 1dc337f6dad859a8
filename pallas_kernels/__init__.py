"""Pallas GPU kernels (Triton backend) for jaxact's fused layers.

Importable on its own: it depends only on jax. The activation epilogue is passed in as functions
(:class:`Epilogue`), so any elementwise activation works in every kernel; jaxact builds those from
its spec table. On CPU the kernels run in Pallas interpret mode (``interpret=True``), which is how
they are tested; lowered for CUDA they become Triton custom calls (:data:`CUSTOM_CALL_TARGET_NAME`).
"""

from pallas_kernels._triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL_TARGET_NAME
from pallas_kernels.bias_act import EltwiseTiles as EltwiseTiles
from pallas_kernels.bias_act import bias_act_bwd as bias_act_bwd
from pallas_kernels.bias_act import bias_act_fwd as bias_act_fwd
from pallas_kernels.bias_act import bias_act_reference as bias_act_reference
from pallas_kernels.bias_act import bias_grad as bias_grad
from pallas_kernels.dense import BlockConfig as BlockConfig
from pallas_kernels.dense import Epilogue as Epilogue
from pallas_kernels.dense import Tiles as Tiles
from pallas_kernels.dense import allow_tf32 as allow_tf32
from pallas_kernels.dense import dense_bias_act as dense_bias_act
from pallas_kernels.dense import dense_bias_act_bwd as dense_bias_act_bwd
from pallas_kernels.dense import dense_bias_act_fwd as dense_bias_act_fwd
from pallas_kernels.dense import dense_bias_act_reference as dense_bias_act_reference
from pallas_kernels.dense import supported_dtypes as supported_dtypes

__all__ = [
  "CUSTOM_CALL_TARGET_NAME",
  "BlockConfig",
  "EltwiseTiles",
  "Epilogue",
  "Tiles",
  "allow_tf32",
  "bias_act_bwd",
  "bias_act_fwd",
  "bias_act_reference",
  "bias_grad",
  "dense_bias_act",
  "dense_bias_act_bwd",
  "dense_bias_act_fwd",
  "dense_bias_act_reference",
  "supported_dtypes",
]
