"""Fused ``act(x @ w + b)`` forward for Hopper GPUs (H100/H200) with Pallas' Mosaic GPU backend.

The Triton kernels (:mod:`pallas_kernels.dense_triton`) issue Ampere-style ``mma`` instructions and
cannot
reach Hopper's tensor-core rate; this kernel is written for Hopper's own machinery:

* **wgmma**: the matrix products are warpgroup MMAs reading both operands from shared memory, with
  a float32 accumulator in registers.
* **TMA, warp-specialized**: a memory warpgroup streams ``x`` and ``w`` tiles into a ring of
  ``stages`` shared-memory buffers (``plgpu.emit_pipeline_warp_specialized``) while two compute
  warpgroups run the MMAs, each on half of the CTA's output tile.
* **Epilogue in registers**: each compute warpgroup's bias tile is brought into shared memory by TMA
  while its main loop runs; then ``z = acc + b`` and ``y = fn(z)`` are computed on the accumulator
  and written back through shared memory by TMA, in ``epi_m x epi_n`` sub-tiles, double-buffered.
  ``z`` is written too (same way) when the activation's derivative needs its input, or, with a
  derivative code (``Epilogue.code``), the code of ``act'(z)`` through a uint8 buffer: 8-bit
  codes as they are, 4- and 2-bit ones packed 2 or 4 to a byte by a small wgmma against a constant
  matrix (:func:`pallas_kernels._mosaic.packing_matrix`), since a byte's codes lie in different
  threads of the accumulator's layout.
* **Persistent**: one CTA per SM (``num_sms``, the caller's) walks the output tiles in a "planar
  snake" order that keeps the tiles running together on neighbouring rows/columns (L2 reuse).

Only what this layout handles is accepted (:func:`hopper_unsupported` says why not): 16-bit ``x``
and ``w`` of one dtype, an output of the same dtype, ``M`` a multiple of ``tile_m``, ``N`` of
``2 * tile_n``, ``K`` of ``tile_k``, and an epilogue whose operations Mosaic GPU lowers
(:mod:`pallas_kernels._mosaic`). The backward is :mod:`pallas_kernels.dense_mosaic_bwd`; the
reference both are tested against is :func:`pallas_kernels.dense_bias_act_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels._mosaic import (
  HALF,
  HOPPER_SMEM,
  code_transforms,
  epilogue_unsupported,
  for_kernel,
  half_tile_mma,
  launch,
  packing_matrix,
  pipeline_allocations,
  pl,
  plgpu,
  span,
  swizzled,
  tensor_core_product,
  transforms,
  unlowerable,
  write_tile,
  xw_pipeline,
)
from pallas_kernels.epilogue import Epilogue


@dataclasses.dataclass(frozen=True)
class HopperTiles:
  """Tiling of the Hopper forward kernel.

  Attributes:
    tile_m, tile_n: the output tile of one compute warpgroup; a CTA's tile is
      ``tile_m x 2 * tile_n`` (two compute warpgroups side by side along N).
    tile_k: contraction step of one pipeline stage.
    stages: shared-memory pipeline depth (buffers of x and w tiles in flight).
    epi_m, epi_n: the sub-tile the epilogue writes through shared memory per TMA store.
    snake_width: tiles per band of the planar-snake walk over the output (L2 locality).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  epi_m: int = 64
  epi_n: int = 64
  snake_width: int = 8

  def smem_bytes(self, itemsize: int, outputs: int) -> int:
    """Shared memory the kernel allocates (pipeline ring, epilogue buffers, bias tiles)."""
    ring = self.stages * (self.tile_m + 2 * self.tile_n) * self.tile_k * itemsize
    epilogue = 2 * outputs * 2 * self.epi_m * self.epi_n * itemsize  # 2 warpgroups x 2 slots
    return ring + epilogue + 2 * self.tile_n * 4 + 1024  # bias tiles; barriers, alignment


def hopper_tiles(shape: tuple[int, int, int], outputs: int = 1) -> HopperTiles:
  """Tiles for an ``(M, K, N)`` layer writing `outputs` arrays (2 when z is kept).

  128 x 128 per compute warpgroup (a CTA computes 128 x 256): a float32 accumulator of 128
  registers a thread, and 128 x 256 x 64 is the CTA tile of the Triton tile sweep's fastest
  forward on an H100. Its ring stage is (128 + 256) x 64 x 2 B = 48 KiB: four
  stages (192 KiB) fit Hopper's 227 KiB of shared memory beside y's epilogue buffers (32 KiB),
  three when z is written too (64 KiB of epilogue buffers). A derivative code counts as z: its
  buffers (16 KiB at 8 bits; with the packing wgmma's operands 32 KiB at 4 bits, 24 at 2) take
  at most what z's do. Lowering checks the budget (tests lower every case).
  """
  del shape
  four = HopperTiles(stages=4)
  return four if four.smem_bytes(2, outputs) <= HOPPER_SMEM else HopperTiles(stages=3)


def hopper_unsupported(
  shape: tuple[int, int, int],
  dtype,
  out_dtype,
  epilogue: Epilogue,
  tiles: HopperTiles | None = None,
) -> str | None:
  """Why the Hopper kernel cannot run an ``(M, K, N)`` layer, or None when it can."""
  m, k, n = shape
  t = tiles or hopper_tiles(shape)
  if np.dtype(dtype) not in HALF:
    return f"operand dtype {np.dtype(dtype).name} (the Hopper kernel takes bfloat16 or float16)"
  if np.dtype(out_dtype) != np.dtype(dtype):
    return f"output dtype {np.dtype(out_dtype).name} differs from the operands' {np.dtype(dtype)}"
  for name, d, step in (("M", m, t.tile_m), ("N", n, 2 * t.tile_n), ("K", k, t.tile_k)):
    if d % step:
      return f"{name}={d} is not a multiple of {step} (the Hopper kernel's tile)"
  if epilogue.residual == "code":
    code = epilogue.code  # N, a multiple of the tile, fills whole bytes
    if code.bits != 8 and t.epi_n // code.per_byte() < 16:
      return (
        f"{code.bits}-bit codes in sub-tiles of {t.epi_n} columns ({t.epi_n // code.per_byte()} "
        "bytes: TMA and the packing wgmma need 16)"
      )
    if code.bits == 8:  # 4 and 2 bits compare z with boundaries: no derivative evaluated
      why = unlowerable(epilogue.derivative, "derivative the code quantizes")
      if why is not None:
        return why
  return epilogue_unsupported(epilogue)


def _fwd_kernel(x_gmem, w_gmem, b_gmem, y_gmem, z_gmem, *, epilogue: Epilogue, t: HopperTiles):
  m, k = x_gmem.shape
  n = w_gmem.shape[1]
  cta_n = 2 * t.tile_n
  m_iters, n_iters, k_iters = m // t.tile_m, n // cta_n, k // t.tile_k
  coded = epilogue.residual == "code"
  per = epilogue.code.per_byte() if coded else 1
  packed_n = t.epi_n // per
  pack_swizzle = span(packed_n, jnp.bfloat16)  # both wgmma operands at P's swizzle
  outs = (y_gmem,) if z_gmem is None or coded else (y_gmem, z_gmem)
  out_dtype = y_gmem.dtype

  pipeline = xw_pipeline(t, k_iters, x_gmem.dtype)

  scratch = dict(
    pipeline_allocs=pipeline_allocations(pipeline, x_gmem, w_gmem),
    out_smem=plgpu.SMEM(
      (2, len(outs), 2, t.epi_m, t.epi_n), out_dtype, transforms=transforms(t.epi_n, out_dtype)
    ),
    code_smem=None
    if not coded
    else plgpu.SMEM((2, 1, 2, t.epi_m, packed_n), jnp.uint8, transforms=code_transforms(packed_n)),
    # Packing 4- and 2-bit codes: the codes as a wgmma operand, and the packing matrix.
    pack_smem=None
    if per == 1
    else (
      plgpu.SMEM(
        (2, t.epi_m, t.epi_n), jnp.bfloat16, transforms=swizzled(pack_swizzle, jnp.bfloat16)
      ),
      plgpu.SMEM(
        (2, t.epi_n, packed_n), jnp.bfloat16, transforms=swizzled(pack_swizzle, jnp.bfloat16)
      ),
    ),
    bias_smem=None if b_gmem is None else plgpu.SMEM((2, t.tile_n), b_gmem.dtype),
    bias_barrier=None if b_gmem is None else plgpu.Barrier(num_barriers=2),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(pipeline_allocs, out_smem, code_smem, pack_smem, bias_smem, bias_barrier):
    wg = lax.axis_index("wg")
    if per > 1:  # each compute warpgroup's packing matrix, once, away from the accumulator

      @pl.when(wg < 2)
      def _():
        pack_smem[1].at[wg][...] = packing_matrix(epilogue.code, t.epi_n, plgpu.Layout.WGMMA)

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      mi, ni = plgpu.planar_snake(tile, (m_iters, n_iters), 1, min(t.snake_width, m_iters, n_iters))
      m_slice = pl.ds(mi * t.tile_m, t.tile_m)
      n_slice = pl.ds(ni * cta_n + wg * t.tile_n, t.tile_n)  # this warpgroup's columns

      def compute_context(run_pipeline):
        if b_gmem is not None:  # lands while the main loop runs
          plgpu.copy_gmem_to_smem(b_gmem.at[n_slice], bias_smem.at[wg], bias_barrier.at[wg])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          z = acc_ref[...]
          if b_gmem is not None:
            plgpu.barrier_wait(bias_barrier.at[wg])
            bias = plgpu.load(bias_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
            z = z + lax.broadcast_in_dim(bias.astype(jnp.float32), z.shape, [1])
          values = lambda z_sub: (epilogue.fn(z_sub), z_sub)[: len(outs)]
          write_tile(z, values, [o.at[m_slice, n_slice] for o in outs], out_smem.at[wg])
          if coded:
            code = epilogue.code
            if per > 1:
              codes_smem, p_smem = (r.at[wg] for r in pack_smem)

            def encode(z_sub):
              c = code.encode(z_sub, epilogue.derivative, native_round=True)
              if per > 1:  # codes @ P: the packed bytes, exact in float32
                c = tensor_core_product(c.astype(jnp.bfloat16), codes_smem, p_smem)
                c = c.astype(jnp.int32)
              return (c,)

            packed_cols = pl.ds(ni * (cta_n // per) + wg * (t.tile_n // per), t.tile_n // per)
            kept = z_gmem.at[m_slice, packed_cols]
            write_tile(z, encode, [kept], code_smem.at[wg], epi_n=t.epi_n)

      pipeline(half_tile_mma(wg, t.tile_n), compute_context)(
        x_gmem.at[m_slice, :],
        w_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
        allocations=pipeline_allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def hopper_dense_bias_act_fwd(
  x: Array,
  w: Array,
  b: Array | None,
  *,
  epilogue: Epilogue,
  num_sms: int,
  tiles: HopperTiles | None = None,
  interpret: Any = False,
) -> tuple[Array, Array | None]:
  """``(y, z)`` as :func:`pallas_kernels.dense_bias_act_fwd` returns them, on Hopper.

  `x` is ``(..., K)`` with ``M`` rows in all, `w` ``(K, N)``, `b` ``(N,)`` or None; the output has
  x's dtype. `num_sms`: the GPU's streaming multiprocessors, one persistent CTA each. Raises
  ValueError for a layer :func:`hopper_unsupported` rejects. `interpret`: False, True or a
  ``plgpu.InterpretGPUParams`` (Mosaic GPU's interpreter, for CPU tests; one CTA).
  """
  batch, (k, n) = x.shape[:-1], w.shape
  if x.shape[-1] != k:
    raise ValueError(
      f"pallas_kernels.dense_mosaic: x.shape={x.shape} does not match w.shape={w.shape}"
    )
  if b is not None and b.shape != (n,):
    raise ValueError(f"pallas_kernels.dense_mosaic: `b` must have shape ({n},); got {b.shape}")
  if x.dtype != w.dtype:
    raise TypeError(f"pallas_kernels.dense_mosaic: x and w dtypes differ ({x.dtype}, {w.dtype})")
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  keep_z = epilogue.residual in ("input", "code")
  t = tiles or hopper_tiles((m, k, n), 2 if keep_z else 1)
  why = hopper_unsupported((m, k, n), x.dtype, x.dtype, epilogue, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.dense_mosaic: {why}")
  epilogue = for_kernel(epilogue)
  out = jax.ShapeDtypeStruct((m, n), x.dtype)
  kept = jax.ShapeDtypeStruct(epilogue.kept_shape((m, n)), epilogue.kept_dtype(x.dtype))

  def body(x_ref, w_ref, *refs):
    b_ref = refs[0] if b is not None else None
    y_ref, *z_ref = refs[1:] if b is not None else refs
    _fwd_kernel(x_ref, w_ref, b_ref, y_ref, z_ref[0] if keep_z else None, epilogue=epilogue, t=t)

  kernel = launch(body, (out, kept) if keep_z else (out,), interpret=interpret, num_sms=num_sms)
  outs = kernel(*(v for v in (x2, w, b) if v is not None))
  y = outs[0].reshape(*batch, n)
  return y, (outs[1].reshape(epilogue.kept_shape((*batch, n))) if keep_z else None)
