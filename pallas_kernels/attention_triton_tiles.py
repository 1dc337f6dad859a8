"""The tiles of :mod:`pallas_kernels.attention_triton`'s kernels: :class:`AttentionTiles` a kernel,
:class:`AttentionBlockConfig` the three, and the choice of them from the shapes and dtype
(:func:`block_config`, its reasoning in its docstring)."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels._triton import pl

HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims a kernel tile takes whole


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
  """One kernel's tiling: ``block_q`` query rows by ``block_k`` keys a step."""

  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class AttentionBlockConfig:
  fwd: AttentionTiles  # o, stats: a program per query block, stepping over key blocks
  dq: AttentionTiles  # dq: a program per query block, stepping over key blocks
  dkv: AttentionTiles  # dk, dv: a program per key block, stepping over query blocks


# (fwd, dq, dkv) as (block_q, block_k, num_warps, num_stages), by the largest head dimension each
# row takes; 16-bit operands, then float32 (TF32 dots). See block_config.
_HALF_TILES = {
  64: ((128, 64, 8, 3), (64, 32, 4, 3), (32, 64, 4, 2)),
  128: ((128, 64, 8, 2), (64, 32, 8, 3), (32, 64, 8, 3)),
  256: ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
}
_FLOAT32_TILES = {
  32: ((128, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)),
  64: ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2)),
  128: ((128, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
  256: ((32, 32, 8, 1), (32, 32, 8, 1), (32, 16, 8, 1)),
}


def block_config(q_shape, k_shape, dtype) -> AttentionBlockConfig:
  """Tile sizes and launch parameters for attention of `q_shape`, `k_shape` in `dtype`.

  Reasoning. There is no GPU here to tune on: the sizes follow jax's Pallas attention op (128 x
  128 forward, 4 warps up to H = 64 and 8 above), tokamax's Triton flash attention (64 x 32 for
  dq, 32 x 64 for dk, dv) and Triton's fused-attention tutorial (128 x 64 forward on Hopper, more
  stages in the backward), tuned on A100s and H100s, then cut where XLA's register-spill check
  failed them compiled for an A100 or an H100 (tests/attention/test_attention_triton.py: B 4,
  T = S = 2048, every head dimension and dtype, causal alone and with a window, a soft cap and
  lengths, which cost registers):
  * Forward: 128 query rows by 64 keys a step. q and the float32 accumulator (block_q x H) stay in
    registers through the key loop beside the (128, 64) logits, over 8 warps (4 spilled at H = 64
    on an A100 with a soft cap, a window and lengths). Stages are k and v tiles, 2 x 64 x H x 2 B:
    three at H <= 64, two at H = 128 (64 KiB compiled on an A100, 96 KiB on an H100, beside q).
    H = 256 (Gemma) halves rows and keys.
  * dq holds q, dO and the float32 dq (block_q x H) through its loop: 64 rows by 32 keys; dk, dv
    hold k, v and two float32 accumulators (block_k x H): 64 keys by 32 rows. Three stages of
    q and dO tiles from H = 128 (at most 68 KiB on an A100); two for dk, dv below (three spilled
    at H = 16 on an A100 with the options above).
  * float32 operands (TF32 dots) take twice the registers and shared memory of a tile: 128 x 64
    forward tiles spilled at H = 64 on an H100, 64-row dq and 64-key dk, dv tiles at H = 64 on an
    A100 and at H = 128 on an H100, 64 x 32 forward tiles at H = 256 on an H100, 32-key dk, dv
    tiles at H = 256 on an A100 with the options above; those are halved.
  * A sequence shorter than a block takes the smallest power of two >= 16 (Triton's smallest dot
    operand side) that covers it, so short sequences do not compute mostly masked tiles.
  """
  t, s, h = q_shape[1], k_shape[1], q_shape[3]
  table = _FLOAT32_TILES if np.dtype(dtype).itemsize == 4 else _HALF_TILES
  fwd, dq, dkv = table[min(d for d in table if d >= h)]

  def tiles(block_q: int, block_k: int, warps: int, stages: int) -> AttentionTiles:
    return AttentionTiles(fit(block_q, t), fit(block_k, s), warps, stages)

  return AttentionBlockConfig(fwd=tiles(*fwd), dq=tiles(*dq), dkv=tiles(*dkv))


def fit(block: int, length: int) -> int:
  return min(block, max(16, pl.next_power_of_2(length)))
