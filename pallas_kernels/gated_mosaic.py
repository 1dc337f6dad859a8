"""Fused gated-unit forward ``h = act(x @ w_gate + b_gate) * (x @ w_up + b_up)`` for Hopper GPUs.

One Mosaic GPU kernel computes both projections of the gated layers (SwiGLU, GeGLU, ReGLU, GLU)
from the same tiles of ``x``:

* **Two accumulators a tile**: a memory warpgroup streams an ``x`` tile and the matching ``w_gate``
  and ``w_up`` tiles into each stage of one shared-memory ring by TMA; each of two compute
  warpgroups issues two wgmma per stage, on its own rows of the ``x`` tile, into a float32
  accumulator for ``a`` and one for ``b``.
* **Gated epilogue in registers**: ``a = acc_gate + b_gate`` and ``b = acc_up + b_up`` (the bias
  tiles land in shared memory while the main loop runs), then ``h = act(a) * b`` sub-tile by
  sub-tile, each written through shared memory by TMA (:func:`pallas_kernels._mosaic.write_tile`):
  ``a``, ``b`` and ``h``, or ``h`` alone. ``h`` is formed from ``a`` and ``b`` as they are written
  (rounded to the output dtype), so that it is the function of the kept ``a`` and ``b`` that a
  backward pass recomputing it gets, a zero times an infinite intermediate gives 0, and an
  ``act(a)`` that overflows where ``act(a) * b`` does not gives the product
  (:func:`pallas_kernels.epilogue.times_act`; jaxact's gated path does all three the same way).
* **Persistent**: one CTA per SM (``num_sms``, the caller's) walks the output tiles in a planar
  snake (L2 reuse of the ``x`` rows and weight columns in flight together).

The reference the kernel is tested against is :func:`gated_forward_reference`.
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
  epilogue_unsupported,
  for_kernel,
  launch,
  pl,
  plgpu,
  transforms,
  unlowerable,
  write_tile,
)
from pallas_kernels.epilogue import Epilogue, may_overflow, safe_mul, times_act


@dataclasses.dataclass(frozen=True)
class GatedTiles:
  """Tiling of the gated forward kernel.

  Attributes:
    tile_m, tile_n: one compute warpgroup's tile of ``a`` (and of ``b``); a CTA's tile is
      ``2 * tile_m x tile_n`` (two compute warpgroups one above the other, sharing the weight
      tiles).
    tile_k: contraction step of one pipeline stage.
    stages: shared-memory pipeline depth (stages of x, w_gate and w_up tiles in flight).
    epi_m, epi_n: the sub-tile the epilogue writes through shared memory per TMA store.
    snake_width: tiles per band of the planar-snake walk over the output.
  """

  tile_m: int = 64
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  epi_m: int = 64
  epi_n: int = 64
  snake_width: int = 8

  def smem_bytes(self, itemsize: int, outputs: int) -> int:
    """Shared memory the kernel allocates: the ring (an x tile and two weight tiles a stage), two
    slots an output for each compute warpgroup's sub-tiles, and the bias tiles (float32 at most),
    plus barriers and alignment."""
    ring = self.stages * (2 * self.tile_m + 2 * self.tile_n) * self.tile_k * itemsize
    epilogue = 2 * outputs * 2 * self.epi_m * self.epi_n * itemsize
    return ring + epilogue + 2 * 2 * self.tile_n * 4 + 1024


def gated_block_config(shape: tuple[int, int, int], dtype, *, keep_ab: bool = True) -> GatedTiles:
  """Tiles for an ``(M, K, N)`` gated layer (``N`` the hidden size) writing a, b and h
  (`keep_ab`) or h alone.

  Registers bound the tile: a compute warpgroup holds two float32 accumulators, and 64 x 128 each
  (64 registers a thread each, 128 in all) is what dense_mosaic.py's single 128 x 128 accumulator
  takes, leaving the rest of the ~232 registers a compute thread gets beside a 40-register memory
  warpgroup for the epilogue. The warpgroups are stacked along M rather than side by side along
  N, so each wgmma is a single m64n128 instruction and both read the same weight tiles: a CTA
  computes 128 x 128 of a and of b, the MMA work of dense_mosaic.py's 128 x 256 tile.

  Shared memory bounds the pipeline: a stage holds x (128 x 64) and the two weight tiles
  (64 x 128 each), 48 KiB in 16-bit types, as in dense_mosaic.py. The epilogue sub-tile is the
  widest of 64 x 64 and 64 x 32 that fits beside at least three stages, then the pipeline the
  deepest (up to four) that fits: h alone gets 64 x 64 and four stages (224 KiB of 227); a, b and h
  (three outputs, 96 KiB of 64 x 64 slots) get 64 x 32 and three stages (192 KiB). No deeper
  than K's steps (the pipeline would shrink it anyway).
  """
  k_steps = max(1, shape[1] // GatedTiles.tile_k)
  itemsize, outputs = np.dtype(dtype).itemsize, 3 if keep_ab else 1
  for epi_n in (64, 32):
    for stages in (4, 3):
      t = GatedTiles(stages=min(stages, k_steps), epi_n=epi_n)
      if t.smem_bytes(itemsize, outputs) <= HOPPER_SMEM:
        return t
  return GatedTiles(stages=2, epi_n=32)  # pragma: no cover - 16-bit types fit above


def gated_unsupported(
  shape: tuple[int, int, int], dtype, epilogue: Epilogue, tiles: GatedTiles | None = None
) -> str | None:
  """Why the kernel cannot run an ``(M, K, N)`` gated layer of `dtype` at `tiles` (by default
  :func:`gated_block_config`'s, whose divisibility is the same with or without a and b), or None."""
  m, k, n = shape
  tiles = tiles or gated_block_config(shape, dtype)
  if np.dtype(dtype) not in HALF:
    return (
      f"operand dtype {np.dtype(dtype).name} (the gated Hopper kernel takes bfloat16 or float16)"
    )
  for name, d, step in (("M", m, 2 * tiles.tile_m), ("N", n, tiles.tile_n), ("K", k, tiles.tile_k)):
    if d % step:
      return f"{name}={d} is not a multiple of {step} (the gated Hopper kernel's tile)"
  if epilogue.fn is None:
    return None
  if may_overflow(epilogue):  # times_act reads act' where act(a) overflows
    why = unlowerable(epilogue.derivative, "activation's derivative")
    if why is not None:
      return why
  return epilogue_unsupported(epilogue)


def _gated_kernel(
  x_gmem,
  wg_gmem,
  wu_gmem,
  bg_gmem,
  bu_gmem,
  a_gmem,
  b_gmem,
  h_gmem,
  *,
  epilogue: Epilogue,
  t: GatedTiles,
):
  m, k = x_gmem.shape
  n = wg_gmem.shape[1]
  cta_m = 2 * t.tile_m
  m_iters, n_iters, k_iters = m // cta_m, n // t.tile_n, k // t.tile_k
  outs = (h_gmem,) if a_gmem is None else (a_gmem, b_gmem, h_gmem)
  out_dtype = h_gmem.dtype
  biases = (bg_gmem, bu_gmem)

  def spec(block, index):
    return plgpu.BlockSpec(
      block, index, transforms=transforms(t.tile_k, x_gmem.dtype), memory_space=plgpu.SMEM
    )

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
        spec((cta_m, t.tile_k), lambda s: (0, s)),
        spec((t.tile_k, t.tile_n), lambda s: (s, 0)),
        spec((t.tile_k, t.tile_n), lambda s: (s, 0)),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=t.stages,
      compute_context=compute_context,
    )

  def ignore(*_, **__):
    return None

  # One bias tile a compute warpgroup (both need all of the CTA's columns), each with a barrier.
  scratch = dict(
    pipeline_allocs=pipeline(ignore, ignore).get_allocations(x_gmem, wg_gmem, wu_gmem),
    out_smem=plgpu.SMEM(
      (2, len(outs), 2, t.epi_m, t.epi_n), out_dtype, transforms=transforms(t.epi_n, out_dtype)
    ),
    bias_smem=tuple(
      None if bias is None else plgpu.SMEM((2, t.tile_n), bias.dtype) for bias in biases
    ),
    bias_barrier=tuple(None if bias is None else plgpu.Barrier(num_barriers=2) for bias in biases),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(pipeline_allocs, out_smem, bias_smem, bias_barrier):
    wg = lax.axis_index("wg")
    rows = pl.ds(wg * t.tile_m, t.tile_m)  # this warpgroup's rows of the CTA's x tile

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      mi, ni = plgpu.planar_snake(tile, (m_iters, n_iters), 1, min(t.snake_width, m_iters, n_iters))
      m_slice = pl.ds(mi * cta_m + wg * t.tile_m, t.tile_m)
      n_slice = pl.ds(ni * t.tile_n, t.tile_n)

      def compute_context(run_pipeline):
        for bias, smem, barrier in zip(biases, bias_smem, bias_barrier, strict=True):
          if bias is not None:  # lands while the main loop runs
            plgpu.copy_gmem_to_smem(bias.at[n_slice], smem.at[wg], barrier.at[wg])

        acc = plgpu.ACC((t.tile_m, t.tile_n), jnp.float32)

        @functools.partial(pl.run_scoped, gate_acc=acc, up_acc=acc)
        def _acc_scope(gate_acc, up_acc):
          run_pipeline((gate_acc, up_acc))
          projections = []
          for acc_ref, bias, smem, barrier in zip(
            (gate_acc, up_acc), biases, bias_smem, bias_barrier, strict=True
          ):
            z = acc_ref[...]
            if bias is not None:
              plgpu.barrier_wait(barrier.at[wg])
              row = plgpu.load(smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
              z = z + lax.broadcast_in_dim(row.astype(jnp.float32), z.shape, [1])
            # Rounded once here: what is written and what h is formed from (and half the
            # registers of float32 while the epilogue runs).
            projections.append(z.astype(out_dtype))

          def values(a, b):
            a32 = a.astype(jnp.float32)
            act_a = a32 if epilogue.fn is None else epilogue.fn(a32)
            h = times_act(epilogue, act_a, a32, b.astype(jnp.float32))
            return (h,) if len(outs) == 1 else (a, b, h)

          out_tiles = [o.at[m_slice, n_slice] for o in outs]
          write_tile(tuple(projections), values, out_tiles, out_smem.at[wg])

      def mma(_, x_smem, wg_smem, wu_smem, carry):
        gate_acc, up_acc = carry
        plgpu.wgmma(gate_acc, x_smem.at[rows], wg_smem)
        plgpu.wgmma(up_acc, x_smem.at[rows], wu_smem)
        plgpu.wgmma_wait(0)
        return carry

      pipeline(mma, compute_context)(
        x_gmem.at[pl.ds(mi * cta_m, cta_m), :],
        wg_gmem.at[:, n_slice],
        wu_gmem.at[:, n_slice],
        allocations=pipeline_allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gated_forward(
  x: Array,
  w_gate: Array,
  w_up: Array,
  b_gate: Array | None,
  b_up: Array | None,
  *,
  epilogue: Epilogue,
  num_sms: int,
  keep_ab: bool = True,
  tiles: GatedTiles | None = None,
  interpret: Any = False,
) -> tuple[Array | None, Array | None, Array]:
  """``(a, b, h)`` of a gated layer, one Mosaic GPU kernel on a Hopper GPU.

  .. math::
    a = x w_{gate} + b_{gate}, \\quad b = x w_{up} + b_{up}, \\quad h = \\mathrm{fn}(a) \\cdot b

  Products accumulate in float32; `a` and `b` are rounded to x's dtype, and `h` is formed in
  float32 from those rounded values (``fn`` of a 0 times an infinite ``b``, or the reverse, gives
  0) and rounded once.

  Args:
    x: ``(..., K)``, bfloat16 or float16; ``M`` rows in all (the product of the leading dims).
    w_gate, w_up: ``(K, N)``, x's dtype.
    b_gate, b_up: ``(N,)`` (any float dtype: added in float32) or None.
    epilogue: the activation: ``epilogue.fn`` applied to float32 tiles, or None for identity (the
      bilinear GLU); its ``derivative`` (of its ``residual``) only where ``fn`` can overflow
      (:func:`pallas_kernels.epilogue.may_overflow`). Its operations must be ones
      Mosaic GPU lowers (``expm1`` and ``log1p`` are rewritten: :mod:`pallas_kernels._mosaic`),
      and its parameters Python numbers (as ``kernel_calls.epilogue`` builds it from a spec).
    num_sms: the GPU's streaming multiprocessors, one persistent CTA each (132 on an H100 SXM).
    keep_ab: write `a` and `b` as well as `h` (for a backward pass); else only `h`.
    tiles: the tiling; :func:`gated_block_config`'s by default. With the default, ``M`` must be a
      multiple of 128, ``N`` of 128 and ``K`` of 64.
    interpret: False, True or a ``plgpu.InterpretGPUParams`` (Mosaic GPU's interpreter, for CPU
      tests; one CTA).

  Returns:
    ``(a, b, h)``, each ``(..., N)`` in x's dtype; `a` and `b` are None without `keep_ab`.

  Raises:
    ValueError: shapes that do not match, or that the tiles do not divide, or an activation Mosaic
      GPU cannot lower (:func:`gated_unsupported` gives the reason without raising: a dispatcher
      asks it first and falls back to XLA).
    TypeError: operand dtypes that differ, or are not 16-bit floats.
  """
  batch, k = x.shape[:-1], x.shape[-1]
  if w_gate.ndim != 2 or w_gate.shape[0] != k or w_up.shape != w_gate.shape:
    raise ValueError(
      "pallas_kernels.gated_mosaic: `w_gate` and `w_up` must both be (K, N) with K = "
      f"x.shape[-1]; got x.shape={x.shape}, w_gate.shape={w_gate.shape}, w_up.shape={w_up.shape}"
    )
  n = w_gate.shape[1]
  for name, bias in (("b_gate", b_gate), ("b_up", b_up)):
    if bias is not None and bias.shape != (n,):
      raise ValueError(
        f"pallas_kernels.gated_mosaic: `{name}` must have shape ({n},); got {bias.shape}"
      )
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"pallas_kernels.gated_mosaic: `{name}` must be floating; got {bias.dtype}")
  if not x.dtype == w_gate.dtype == w_up.dtype:
    raise TypeError(
      "pallas_kernels.gated_mosaic: x, w_gate and w_up must share one dtype; got "
      f"{x.dtype}, {w_gate.dtype}, {w_up.dtype}"
    )
  if np.dtype(x.dtype) not in HALF:
    raise TypeError(
      f"pallas_kernels.gated_mosaic: operand dtype {x.dtype} (accepted: bfloat16, float16)"
    )
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  t = tiles or gated_block_config((m, k, n), x.dtype, keep_ab=keep_ab)
  why = gated_unsupported((m, k, n), x.dtype, epilogue, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.gated_mosaic: {why}")
  epilogue = for_kernel(epilogue)
  out = jax.ShapeDtypeStruct((m, n), x.dtype)

  def gated_hopper_forward(x_ref, wg_ref, wu_ref, *refs):  # names the kernel in profiles
    refs = list(refs)
    bg_ref = refs.pop(0) if b_gate is not None else None
    bu_ref = refs.pop(0) if b_up is not None else None
    a_ref, b_ref, h_ref = refs if keep_ab else (None, None, *refs)
    _gated_kernel(
      x_ref, wg_ref, wu_ref, bg_ref, bu_ref, a_ref, b_ref, h_ref, epilogue=epilogue, t=t
    )

  out_type = (out, out, out) if keep_ab else (out,)
  kernel = launch(gated_hopper_forward, out_type, interpret=interpret, num_sms=num_sms)
  outs = kernel(*(v for v in (x2, w_gate, w_up, b_gate, b_up) if v is not None))
  outs = [o.reshape(*batch, n) for o in outs]
  return tuple(outs) if keep_ab else (None, None, outs[0])


def gated_forward_reference(
  x: Array,
  w_gate: Array,
  w_up: Array,
  b_gate: Array | None,
  b_up: Array | None,
  *,
  fn=None,
  keep_ab: bool = True,
) -> tuple[Array | None, Array | None, Array]:
  """What :func:`gated_forward` computes, in ``jnp``: float32 products at the highest precision,
  a and b rounded to x's dtype, ``h = fn(a) * b`` from those in float32, rounded once."""
  dtype = x.dtype

  def project(w, bias):
    z = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return (z if bias is None else z + bias.astype(jnp.float32)).astype(dtype)

  a, b = project(w_gate, b_gate), project(w_up, b_up)
  act_a = a.astype(jnp.float32) if fn is None else fn(a.astype(jnp.float32))
  h = safe_mul(act_a, b.astype(jnp.float32)).astype(dtype)
  return (a, b, h) if keep_ab else (None, None, h)
