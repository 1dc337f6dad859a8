"""The static plan of one attention call, its arrays without gradients, the call they make with
the operands, and the XLA path's default blocks: what every module of the family reads."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import Array

from jaxact._src.core import args
from jaxact._src.core.dispatch import Decision
from jaxact._src.core.dropout import Dropout

_FLOAT32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """Everything static about one call.

  Attributes:
    scale: multiplies ``q . k``.
    causal: mask ``u > t`` (jax.nn's top-left aligned ``tril``).
    window: ``(left, right)``: mask ``u < t - left`` and ``u > t + right``; None for no window.
    soft_cap: ``c`` of ``c tanh(s / c)``, or None.
    block_q, block_k: query rows and key columns a block.
    dropout: the dropout of the probabilities, or None; ``broadcast_dropout`` shares one (T, S)
      mask over batch and heads (Flax's default).
    precision: of the products, as :func:`jax.lax.dot_general` takes it.
    acc_dtype: float32, or float64 for float64 inputs.
    decision: the backends of the two passes.
  """

  scale: float
  causal: bool = False
  window: tuple[int, int] | None = None
  soft_cap: float | None = None
  block_q: int = 512
  block_k: int = 512
  dropout: Dropout | None = None
  broadcast_dropout: bool = True
  precision: Any = None
  acc_dtype: np.dtype = _FLOAT32
  decision: Decision = dataclasses.field(default_factory=Decision)

  @property
  def right(self) -> int | None:
    """The largest ``u - t`` left unmasked by the causal mask and the window, or None."""
    bounds = ([0] if self.causal else []) + ([self.window[1]] if self.window else [])
    return min(bounds) if bounds else None

  @property
  def left(self) -> int | None:
    """The largest ``t - u`` left unmasked by the window, or None."""
    return self.window[0] if self.window else None


# Elements of one float32 block of logits (batch x heads x block_q x block_k) the XLA path aims at.
# On CPU 128 Ki (512 KiB): the few such arrays a block holds stay in cache, and small blocks let
# the causal mask skip more (the sweep: benchmarks/results/attention.md, "CPU step time"). For a
# GPU at most 16 Mi (64 MiB), and a block's logits a map at most T x H / 8: a block adds about
# 2 bq bk / (T H) to attention's compiled temp (14 bytes a logit, "Default GPU blocks" there), so
# /8 keeps it within about a third, while blocks still grow with T (the loop's launches grow as
# T^2). GPU time is not measured yet. A TPU takes the GPU's blocks: the CPU's small blocks made
# its estimated step several times slower at the same temp (benchmarks/results/tpu.md).
_CPU_BLOCK_ELEMENTS = 1 << 17
_GPU_BLOCK_ELEMENTS = 1 << 24
_GPU_BLOCK_FRACTION = 8
# The smallest side. On CPU 64: below it a block's loop overhead outweighs what the causal mask
# skips (short sequences, many maps: benchmarks/results/oneline.md, "Step time"). A GPU keeps 32
# (its T x H / 8 bound; not timed yet).
_CPU_MIN_SIDE, _GPU_MIN_SIDE = 64, 32


def _pow2_floor(n: int) -> int:
  return 1 << (max(1, n).bit_length() - 1)


def default_blocks(heads: int, q_len, kv_len, *, head_dim: int, gpu: bool) -> tuple:
  """``(block_q, block_k)`` for `heads` (batch x heads) attention maps of ``q_len x kv_len``:
  square blocks of a power of two filling the element budget, from 64 (a GPU: 32) to 512.
  Symbolic lengths (``jax.export``) give symbolic blocks ``min(T, side)``, and no T x H bound on
  a GPU."""
  elements = (_GPU_BLOCK_ELEMENTS if gpu else _CPU_BLOCK_ELEMENTS) // max(1, heads)
  if gpu and not jax.export.is_symbolic_dim(q_len):
    elements = min(elements, int(q_len) * head_dim // _GPU_BLOCK_FRACTION)
  low = _GPU_MIN_SIDE if gpu else _CPU_MIN_SIDE
  side = min(512, max(low, _pow2_floor(int(elements**0.5))))
  return args.dim_min(q_len, side), args.dim_min(kv_len, side)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["mask", "q_lengths", "kv_lengths", "q_segments", "kv_segments", "key_data"],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Aux:
  """The call's arrays that get no gradient, each None when not given: a bool mask (B|1, N|1,
  T|1, S|1), lengths (B,), segment ids (B, T) and (B, S), the dropout key's raw data."""

  mask: Array | None = None
  q_lengths: Array | None = None
  kv_lengths: Array | None = None
  q_segments: Array | None = None
  kv_segments: Array | None = None
  key_data: Array | None = None


class Call(NamedTuple):
  """One call, checked: the plan and the arrays it runs on, q ``(B, T, N, H)``, k ``(B, S, K,
  H)``, v ``(B, S, K, Hv)``, the bias ``(B|1, N|1, T|1, S|1)`` or None, and the :class:`Aux`
  arrays."""

  plan: AttentionPlan
  q: Array
  k: Array
  v: Array
  bias: Array | None
  aux: Aux
