"""Tiling of :mod:`pallas_kernels.dense_mosaic_bwd`'s kernels: the tiles, the shared memory they
take, and the deepest pipeline that fits Hopper's."""

from __future__ import annotations

import dataclasses

from pallas_kernels._mosaic import HOPPER_SMEM
from pallas_kernels.epilogue import DerivativeCode

# Columns of g (and of the residual) turned into dz at a time: one 128-byte swizzle span of 16-bit
# values.
CHUNK = 64


@dataclasses.dataclass(frozen=True)
class HopperBwdTiles:
  """Tiling of the Hopper backward kernels.

  Each CTA has ``wgs`` compute warpgroups and one memory warpgroup streaming tiles by TMA into a
  ring of ``dx_stages`` or ``dw_stages`` buffers (``plgpu.emit_pipeline_warp_specialized``). Each
  compute warpgroup owns its part of the ``g`` and residual tiles, turns it into ``dz`` over
  ``g``'s shared-memory buffer and runs wgmma on it (against ``w``, or ``x``, read transposed
  from shared memory); with two, one warpgroup's dz arithmetic overlaps the other's wgmma.

  Attributes:
    dx_m, dx_k: the ``dx`` tile of one compute warpgroup (a CTA: ``wgs * dx_m`` rows, the
      warpgroups one above the other); its contraction runs over N in steps of ``dx_n``.
    dw_k, dw_n: the ``dw`` tile of one compute warpgroup (a CTA: ``wgs * dw_n`` columns, side by
      side); its contraction runs over M in steps of ``dw_m``.
    dx_stages, dw_stages: pipeline depth of each kernel.
    wgs: compute warpgroups per CTA (1 or 2).
    epi: the square sub-tile in which results go out through shared memory (double-buffered).
    delay: wgmma groups a compute warpgroup leaves running when it goes on to the next step (0 or
      1). With 1, the next step's dz arithmetic overlaps this step's wgmma inside one warpgroup;
      each ring slot is then released a step later, so a pipeline of ``stages`` prefetches
      ``stages - 2`` steps ahead instead of ``stages - 1``.
  """

  dx_m: int = 64
  dx_k: int = 256
  dx_n: int = 64
  dw_k: int = 128
  dw_n: int = 128
  dw_m: int = 64
  dx_stages: int = 3
  dw_stages: int = 2
  wgs: int = 2
  epi: int = 64
  delay: int = 0

  def smem_bytes(
    self, itemsize: int, residual: bool, code: DerivativeCode | None = None
  ) -> tuple[int, int]:
    """Shared memory of the ``dx`` and ``dw`` kernels (ring, output sub-tiles, and 3 KiB for
    the pipeline's barriers and alignment: 2112 bytes at (dw_stages=4, wgs=2) by Mosaic GPU's
    count). With a derivative `code` the residual tile holds ``1 / per_byte`` bytes an element,
    and 4- and 2-bit codes add each warpgroup's operands of the wgmma that unpacks them."""
    per = code.per_byte() if code is not None else 1
    r_bytes = (1 / per if code is not None else itemsize) if residual else 0
    out = self.wgs * 2 * self.epi * self.epi * itemsize
    dx_rows = self.wgs * self.dx_m
    dx = self.dx_stages * (dx_rows * (itemsize + r_bytes) + self.dx_k * itemsize) * self.dx_n
    dw_cols = self.wgs * self.dw_n
    dw = self.dw_stages * (self.dw_k * itemsize + dw_cols * (itemsize + r_bytes)) * self.dw_m
    spread_dx = spread_dw = 0
    if residual and per > 1:  # bytes (rows x chunk / per) and S (chunk / per x chunk), bfloat16
      s_bytes = CHUNK // per * CHUNK * 2
      spread_dx = self.wgs * (self.dx_m * CHUNK // per * 2 + s_bytes)
      spread_dw = self.wgs * (self.dw_m * CHUNK // per * 2 + s_bytes)
    return int(dx) + out + spread_dx + 3072, int(dw) + out + spread_dw + 3072


def hopper_bwd_tiles(
  shape: tuple[int, int, int], residual: bool = True, code: DerivativeCode | None = None
) -> HopperBwdTiles:
  """Backward tiles for an ``(M, K, N)`` layer (`residual`: whether dz needs a residual tile;
  `code`: the derivative code that tile holds, if any: a smaller tile, a deeper pipeline).

  Two compute warpgroups a CTA, each holding a 64 x 256 (dx) or 128 x 128 (dw) float32
  accumulator, 128 registers a thread, beside the 64-column g and residual blocks it turns into
  dz (64 rows: a warpgroup's register layout; a 32-row step does not lower). dz is recomputed
  once per output tile it feeds (K / dx_k times for dx, K / dw_k for dw), so dx's tile is wide
  along K. Each kernel's pipeline is as deep as Hopper's shared memory holds, at most 4: with a
  residual, dx's ring stage (the CTA's 128 x 64 g and residual tiles, w's 256 x 64) is 64 KiB, 3
  stages; dw's (x's 64 x 128, the CTA's 64 x 256 g and residual tiles) 80 KiB, 2. Tiles narrow
  along K (to 128, then 64) for a K the wide ones do not divide, so every layer the forward
  kernel takes (K a multiple of 64) has a backward.
  """
  k = shape[1]
  dx_k = next(c for c in (256, 128, 64) if k % c == 0) if k % 64 == 0 else 256
  dw_k = 128 if k % 128 == 0 else 64
  return deepest_pipeline(HopperBwdTiles(dx_k=dx_k, dw_k=dw_k), residual, code)


def deepest_pipeline(
  t: HopperBwdTiles, residual: bool, code: DerivativeCode | None = None
) -> HopperBwdTiles:
  """`t` with each kernel's pipeline as deep as fits Hopper's shared memory (4 at most, 2 at
  least)."""

  def stages(kernel: int) -> int:
    for depth in (4, 3):
      deep = dataclasses.replace(t, dx_stages=depth, dw_stages=depth)
      if deep.smem_bytes(2, residual, code)[kernel] <= HOPPER_SMEM:
        return depth
    return 2

  return dataclasses.replace(t, dx_stages=stages(0), dw_stages=stages(1))
