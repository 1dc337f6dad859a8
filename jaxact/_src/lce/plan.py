"""The static plan of one :func:`jaxact.linear_cross_entropy` (or :func:`jaxact.linear_log_probs`)
call, T5X's smoothing in optax's terms, and the blocks of the XLA path and the Hopper kernel: what
every module of the family reads."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

from jaxact._src.core.dispatch import Decision

_FLOAT32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class LcePlan:
  """Everything static about one call.

  Attributes:
    block: logits columns a block (``by="vocab"``) or tokens a block (``by="tokens"``).
    by: the axis the XLA path blocks over.
    label_smoothing, z_loss, soft_cap: the loss's options (``soft_cap`` None: no cap);
      ``label_smoothing`` is optax's ``a`` (T5X's ``a V / (V - 1)``: :func:`t5x_smoothing`), and
      may exceed 1 for T5X's.
    loss_offset: subtracted from every token's loss (T5X's normalizing constant).
    predictions: whether the forward pass also returns each token's argmax column.
    temperature: the logits the softmax reads are the (capped) logits divided by it (a sampling
      temperature, :func:`jaxact.linear_log_probs`); 1 for the loss.
    entropy: whether the forward pass also returns each token's softmax entropy (one more number
      a token accumulated in the vocabulary loop, and kept for the backward).
    w_layout: ``"dv"`` for ``w`` of shape (D, V), ``"vd"`` for (V, D) (an embedding table, sliced
      by rows: no transposed copy).
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    acc_dtype: the logits', statistics' and loss's dtype: float32, or float64 for float64 inputs.
    decision: the backends of the forward and backward passes.
  """

  block: int
  by: Literal["vocab", "tokens"] = "vocab"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  soft_cap: float | None = None
  loss_offset: float = 0.0
  predictions: bool = False
  temperature: float = 1.0
  entropy: bool = False
  w_layout: Literal["dv", "vd"] = "dv"
  precision: Any = None
  acc_dtype: np.dtype = _FLOAT32
  decision: Decision = dataclasses.field(default_factory=Decision)
  shardings: tuple = (None, None, None)  # the specs of x, w, bias: their gradients' types

  @property
  def vocab_axis(self) -> int:
    """The axis of ``w`` that indexes the vocabulary."""
    return 1 if self.w_layout == "dv" else 0


def t5x_smoothing(alpha: float, vocab: int) -> tuple[float, float]:
  """``(optax's smoothing, T5X's normalizing constant)`` for T5X's label smoothing `alpha`.

  T5X's soft targets put ``1 - alpha`` on the label and ``alpha / (V - 1)`` on every other class;
  optax's put ``alpha / V`` everywhere on top of ``1 - alpha``. The two cross-entropies agree when
  optax's smoothing is ``alpha V / (V - 1)``; T5X then subtracts the targets' entropy (computed as
  T5X computes it, with its ``1e-20`` inside the second log), so that a prediction equal to the
  targets has loss 0."""
  if alpha == 0:
    return 0.0, 0.0
  confidence, low = 1.0 - alpha, alpha / (vocab - 1)
  entropy = -(vocab - 1) * low * math.log(low + 1e-20)
  if confidence > 0:
    entropy -= confidence * math.log(confidence)
  return alpha * vocab / (vocab - 1), entropy


# Bytes of one float32 block of logits the XLA path aims at. On CPU, 4096 tokens: blocks of 512
# columns (8 MiB) run as fast as 2048 (32 MiB) at V = 32768 and within 9% at 131072, for a
# quarter of the temp (benchmarks/results/lce.md); below 256 columns the matmuls slow down. On
# GPUs larger blocks amortize the loop's launches (not yet measured on one). Either way a block
# stays under an eighth of the logits.
_CPU_BLOCK_BYTES = 8 << 20
_GPU_BLOCK_BYTES = 256 << 20
# On a TPU a block's columns are its matmuls' arithmetic intensity (x is read again for every
# block, whatever the tokens), so they follow the chip's flops per HBM byte. Estimated from the
# compiled step (16384 tokens, D 4096, V 131072; benchmarks/results/tpu-families.md): a v6e's head
# at 256 columns took 4.3x the step of 2048 (HBM-bound; 1024: 1.4x; 4096 no faster); v5p's and
# v5e's are at their chips' flops from 512 columns.
_TPU_BLOCK_COLUMNS = {"TPU v5": 512, "TPU v4": 512}  # a device kind's start -> columns
_TPU_DEFAULT_COLUMNS = 2048  # v6e, and chips not measured


def default_block(tokens: int, vocab: int, platform: str = "cpu", device_kind: str = "") -> int:
  """Columns a block for the vocabulary-blocked XLA path: on a ``"tpu"`` those of its
  `device_kind` (``_TPU_BLOCK_COLUMNS``), else a multiple of 128 near
  ``_*_BLOCK_BYTES / (4 * tokens)`` (`platform` ``"cpu"`` or ``"gpu"``) and at least 256; at most
  an eighth of the vocabulary (rounded up to 128), and the whole vocabulary when it is small."""
  if platform == "tpu":
    starts = [c for k, c in _TPU_BLOCK_COLUMNS.items() if (device_kind or "").startswith(k)]
    block = starts[0] if starts else _TPU_DEFAULT_COLUMNS
  else:
    budget = (_GPU_BLOCK_BYTES if platform == "gpu" else _CPU_BLOCK_BYTES) // (4 * max(tokens, 1))
    block = max(256, budget // 128 * 128)
  block = min(block, max(128, -(-vocab // 8 // 128) * 128))
  return min(block, vocab)


def kernel_block(block: int, vocab: int, step: int = 256) -> int:
  """The Hopper backward kernel's block: the largest multiple of `step` (its CTA tile's columns)
  that divides `vocab` and is at most `block` (`step` when `block` is smaller)."""
  best = step
  for cols in range(step, min(block, vocab) + 1, step):
    if vocab % cols == 0:
      best = cols
  return best
