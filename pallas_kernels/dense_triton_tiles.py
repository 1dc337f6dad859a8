"""The tiles of :mod:`pallas_kernels.dense_triton`'s kernels: :class:`BlockConfig` and the choice
of it from a layer's shape and dtype, :func:`default_block_config`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel's tiling: a ``(rows, cols)`` output tile, reduced over ``step`` at a time."""

  rows: int
  cols: int
  step: int
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  fwd: Tiles  # y (M, N): rows=block_m, cols=block_n, step over K
  dx: Tiles  # dx (M, K): rows=block_m, cols=block_k, step over N
  dw: Tiles  # dw (K, N): rows=block_k, cols=block_n, step over M


def tile_side(d: int) -> int:
  return 16 if d <= 16 else 64 if d <= 64 else 128


def default_block_config(
  shape: tuple[int, int, int], dtype, *, hopper: bool = False, coded: bool = False
) -> BlockConfig:
  """Tile sizes and launch parameters for a dense layer of ``(M, K, N)`` in ``dtype``; `coded`:
  the forward's epilogue writes a derivative code (``Epilogue.code``) beside ``y``.

  Reasoning:
  * Output tiles are 128 x 128 where the dimension allows: a float32 accumulator of that size is
    64 registers a thread over 8 warps, and 128-wide tiles keep the tensor cores' operand reuse high
    (the usual Triton matmul configuration on A100/H100). Dimensions of at most 64 (or 16) get 64
    (or 16) so that small layers do not compute mostly masked tiles; 16 is the smallest ``tl.dot``
    operand side. Three sizes per dimension keep the set of compiled kernels small.
  * The forward's reduction step is 64 for 16-bit and 32 for float32 operands: both are 32 KiB of
    shared memory per pipeline stage ((128 + 128) x step x itemsize), so three stages (96 KiB) fit
    the A100's 164 KiB and leave room for Triton's epilogue scratch.
  * The backward kernels load three tiles per step (g and the residual beside x or w), so their
    step is 32: 24 KiB a stage in 16-bit (three stages), 48 KiB in float32 (two stages, 96 KiB).
  * A contraction of at most 16 uses a step of 16 (no wasted masked work).
  * 8 warps for tiles with a side of 128, 4 below: compiled for an A100 with XLA's register-spill
    check, 4 warps spilled on 128 x 16 and 128 x 64 backward tiles; 8 do not.
  * With `hopper` (the caller's target is a Hopper GPU), bfloat16 layers that 128 x 256 tiles
    divide (M a multiple of 128, K and N of 256) take 128 x 256 x 64 tiles for the forward and dx
    and 256 x 128 x 64 for dw, 8 warps, 3 stages (the fastest of a tile sweep on an H100; 192 KiB
    of shared memory, more than the A100 has). Ragged layers keep the tiles below: the masks cost
    the registers the wide tiles lack (they spill), as does float16 gelu's backward.
  * A `coded` forward evaluates the activation and its code (for 8 bits, the derivative too) on
    the accumulator at once, which spilled registers when compiled at 128 rows (gelu, 8 bits at
    128 x 128 on an A100; 4 and 2 bits, whose packing moves codes between threads, at 128 x 256
    on an H100) and at 64 x 256 (mish, 8 bits, H100): its tile is at most 64 x 128. The backward
    tiles are unchanged.
  """
  m, k, n = shape
  half = np.dtype(dtype).itemsize == 2
  bf16 = np.dtype(dtype) == np.dtype(jnp.bfloat16)
  if coded:
    cfg = default_block_config(shape, dtype, hopper=hopper)
    fwd = dataclasses.replace(cfg.fwd, rows=min(cfg.fwd.rows, 64), cols=min(cfg.fwd.cols, 128))
    return dataclasses.replace(cfg, fwd=fwd)
  if hopper and bf16 and m % 128 == 0 and k % 256 == 0 and n % 256 == 0:
    return BlockConfig(
      fwd=Tiles(128, 256, 64, 8, 3), dx=Tiles(128, 256, 64, 8, 3), dw=Tiles(256, 128, 64, 8, 3)
    )

  def tiles(rows: int, cols: int, step: int, stages: int) -> Tiles:
    warps = 8 if max(rows, cols) >= 128 else 4
    return Tiles(rows, cols, step, warps, stages)

  def step(d: int, cap: int) -> int:
    return 16 if d <= 16 else cap

  bwd_stages = 3 if half else 2
  return BlockConfig(
    fwd=tiles(tile_side(m), tile_side(n), step(k, 64 if half else 32), 3),
    dx=tiles(tile_side(m), tile_side(k), step(n, 32), bwd_stages),
    dw=tiles(tile_side(k), tile_side(n), step(m, 32), bwd_stages),
  )
