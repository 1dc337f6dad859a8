"""The backward of :mod:`pallas_kernels.dense_mosaic`'s fused dense layer, on Hopper (Mosaic GPU).

Two kernels, ``dx = dz @ w.T`` and ``dw = x.T @ dz``, warp-specialized as the forward is (one
memory warpgroup streaming tiles by TMA, compute warpgroups each on its own rows of dx or columns
of dw), each forming ``dz = g * act'(residual)`` from the tiles of ``g`` and the residual its
pipeline brings in and writing it over ``g``'s shared-memory tile before wgmma reads it: dz never
reaches device memory, and while one compute warpgroup does that arithmetic the other's wgmma
runs; outputs leave through shared memory by TMA in double-buffered sub-tiles. A derivative code
(``Epilogue.residual == "code"``) comes in as its bytes, 1 / ``per_byte`` of a column each, and
is decoded into ``act'`` where ``dz`` is formed.

``db`` is not summed in the ``dw`` kernel, although it forms the same dz: a Mosaic GPU row sum
(``jnp.sum`` over a warpgroup's tile in the WGMMA layout) adds across warps through a scratch
buffer that Pallas puts at the same shared-memory offset for every warpgroup, so two compute
warpgroups summing at once overwrite each other's partial sums (``_reduce_lowering_rule`` in
``jax/_src/pallas/mosaic_gpu/lowering.py`` refuses that only for the strided layout; Mosaic GPU's
interpreter does not race). Nor is it XLA's reduction, which for some shapes materialises a
float32 dz before summing it. It is :func:`pallas_kernels.bias_act_triton.bias_grad`: one Triton
pass over ``g`` and the residual that writes only partial sums.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels import bias_act_triton
from pallas_kernels._mosaic import (
  HALF,
  code_transforms,
  for_kernel,
  launch,
  pl,
  plgpu,
  span,
  spreading_matrix_t,
  swizzled,
  tensor_core_product,
  transforms,
  unlowerable,
  write_tile,
)
from pallas_kernels.dense_mosaic_bwd_tiles import (  # the tiles, public here too
  CHUNK,
  HopperBwdTiles,
  hopper_bwd_tiles,
)
from pallas_kernels.dense_mosaic_bwd_tiles import deepest_pipeline as deepest_pipeline
from pallas_kernels.epilogue import DerivativeCode, Epilogue


def hopper_bwd_unsupported(
  shape: tuple[int, int, int], dtype, epilogue: Epilogue, tiles: HopperBwdTiles | None = None
) -> str | None:
  """Why the Hopper backward kernels cannot run an ``(M, K, N)`` layer, or None when they can."""
  m, k, n = shape
  code = epilogue.code
  t = tiles or hopper_bwd_tiles(shape, epilogue.residual != "none", code)
  if np.dtype(dtype) not in HALF:
    return f"operand dtype {np.dtype(dtype).name} (the Hopper kernels take bfloat16 or float16)"
  steps = (
    ("M", m, t.wgs * t.dx_m, t.dw_m),
    ("N", n, t.dx_n, t.wgs * t.dw_n),
    ("K", k, t.dx_k, t.dw_k),
  )
  for name, d, *tile in steps:
    step = math.lcm(*tile)
    if d % step:
      return f"{name}={d} is not a multiple of {step} (the Hopper backward kernels' tile)"
  if min(t.dx_stages, t.dw_stages) <= t.delay:
    return f"pipelines of {t.dx_stages} and {t.dw_stages} stages with delay {t.delay} (need more)"
  if epilogue.residual == "none":
    return None
  if code is not None:  # N, a multiple of the tiles, fills whole bytes
    per = code.per_byte()
    # Each dz block's bytes are a TMA box and, packed, a wgmma operand: 16 bytes wide at least.
    narrowest = min(t.dx_n, CHUNK, t.dw_n)
    if per > 1 and narrowest // per < 16:
      return (
        f"{code.bits}-bit codes in blocks of {narrowest} columns ({narrowest // per} bytes: TMA "
        "and the unpacking wgmma need 16)"
      )
    return None  # decoding compares and selects: no derivative evaluated
  return unlowerable(epilogue.derivative, "derivative")


def _dz_in_place(epilogue: Epilogue, g_smem, r_smem, part=None, spread=None):
  """Overwrite the shared-memory tile of ``g`` with ``dz = g * act'(r)`` (computed in float32),
  ready to be a wgmma operand; nothing to do for identity (``dz = g``).

  Column blocks of ``CHUNK`` (one swizzle span) at a time, so that a warpgroup holds at most two
  64 x 64-element float32 blocks beside its accumulator (64 registers a thread per 64 x 64 pair).
  `part`: ``(rows, first column, columns)`` of the tiles to work on (a warpgroup's own part), else
  all of them. With a derivative code, `r_smem` holds its bytes (``1 / per_byte`` a column) and
  ``act'`` is decoded from them; 4- and 2-bit codes are unpacked through `spread` (the staging
  tile and spreading matrix of :func:`pallas_kernels._mosaic.spreading_matrix_t`).
  """
  if r_smem is None:
    return
  rows, col0, cols = part or (slice(None), 0, g_smem.shape[1])
  code = epilogue.code
  per = code.per_byte() if code is not None else 1
  for c in range(0, cols, CHUNK):
    width = min(CHUNK, cols - c)
    g = g_smem.at[rows, pl.ds(col0 + c, width)]
    if code is None:
      d = epilogue.derivative(r_smem.at[rows, pl.ds(col0 + c, width)][...].astype(jnp.float32))
    else:
      # A few bytes a row: no bank-conflict-free load of them exists, and none is needed.
      packed = plgpu.load(
        r_smem.at[rows, pl.ds((col0 + c) // per, width // per)],
        layout=plgpu.Layout.WGMMA,
        optimized=per == 1,
      )
      if per == 1:
        codes = packed.astype(jnp.int32)
      else:
        # Each column's byte, exactly (below 256), then its field of it.
        stage, s_t = spread
        spread_bytes = tensor_core_product(packed.astype(jnp.bfloat16), stage, s_t.T)
        shape = spread_bytes.shape
        column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        shift = (column % per) * code.bits
        codes = lax.shift_right_logical(spread_bytes.astype(jnp.int32), shift)
        codes = codes & ((1 << code.bits) - 1)
      d = code.decode(codes)
    dz = g[...].astype(jnp.float32) * d
    g[...] = dz.astype(g_smem.dtype)
  plgpu.commit_smem()  # the generic-proxy writes, visible to wgmma (async proxy)


def _bwd_kernel(
  body,
  operands,
  specs,
  out_gmem,
  out_tile,
  *,
  t: HopperBwdTiles,
  steps: int,
  stages: int,
  code: DerivativeCode | None = None,
  block_rows: int = 0,
):
  """The CTA of one backward kernel: a warp-specialized pipeline of `steps` steps over `operands`
  (gmem refs, `specs` their blocks), `body(wg, smem_refs, acc_ref, spread)` run by each compute
  warpgroup, whose float32 accumulator then goes to its `out_tile(wg)` of `out_gmem`. `spread`:
  for a 4- or 2-bit `code`, the warpgroup's staging tile (`block_rows` rows of packed bytes) and
  spreading matrix that unpack it (:func:`_dz_in_place`), else None.
  """
  acc_shape = out_tile(0)[2]

  def pipeline(step_body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      step_body,
      grid=(steps,),
      memory_registers=40,
      in_specs=specs,
      wg_axis="wg",
      num_compute_wgs=t.wgs,
      max_concurrent_steps=stages,
      compute_context=compute_context,
    )

  def ignore(*_, **__):
    return None

  dtype = out_gmem.dtype
  per = code.per_byte() if code is not None else 1
  packed = CHUNK // per
  bf16_swizzle = swizzled(span(packed, jnp.bfloat16), jnp.bfloat16)  # one for both operands
  scratch = dict(
    allocs=pipeline(ignore, ignore).get_allocations(*operands),
    out_smem=plgpu.SMEM((t.wgs, 1, 2, t.epi, t.epi), dtype, transforms=transforms(t.epi, dtype)),
    spread_smem=None
    if per == 1
    else (
      plgpu.SMEM((t.wgs, block_rows, packed), jnp.bfloat16, transforms=bf16_swizzle),
      plgpu.SMEM((t.wgs, CHUNK, packed), jnp.bfloat16, transforms=bf16_swizzle),  # S.T
    ),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _(allocs, out_smem, spread_smem):
    wg = lax.axis_index("wg")
    spread = None if spread_smem is None else tuple(r.at[wg] for r in spread_smem)

    def compute_context(run_pipeline):
      if spread is not None:
        spread[1][...] = spreading_matrix_t(code, CHUNK, plgpu.Layout.WGMMA)

      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(acc_shape, jnp.float32))
      def _(acc_ref):
        run_pipeline(acc_ref)
        plgpu.wgmma_wait(0)  # the last step's wgmma, with `delay`
        rows, cols, _ = out_tile(wg)
        write_tile(acc_ref[...], lambda z: (z,), (out_gmem.at[rows, cols],), out_smem.at[wg])

    def step(_, *refs):
      *smem_refs, acc_ref = refs
      body(wg, smem_refs, acc_ref, spread)
      # With delay 1, this step's wgmma still runs (its slot is released a step later) while the
      # next step's dz is formed.
      plgpu.wgmma_wait(t.delay)
      return acc_ref

    pipeline(step, compute_context)(*operands, allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _residual_spec(gr_spec, code: DerivativeCode | None):
  """The residual's block beside g's `gr_spec`: the same, or for a derivative code its bytes
  (``1 / per_byte`` a column): 8-bit codes swizzled as g is, packed ones in plain rows (read a
  few bytes a row, they need no swizzle)."""
  if code is None:
    return gr_spec
  rows, cols = gr_spec.block_shape
  per = code.per_byte()
  layout = code_transforms(CHUNK) if per == 1 else ()
  return dataclasses.replace(gr_spec, block_shape=(rows, cols // per), transforms=layout)


def _dx_kernel(g_gmem, r_gmem, w_gmem, dx_gmem, *, epilogue: Epilogue, t: HopperBwdTiles):
  """``dx[mi, ki] = sum_n dz[mi, n] @ w[ki, n].T``, each compute warpgroup on its own rows."""
  n = g_gmem.shape[1]
  cta_m = t.wgs * t.dx_m
  cta_rows = pl.ds(lax.axis_index("m") * cta_m, cta_m)
  cols = pl.ds(lax.axis_index("k") * t.dx_k, t.dx_k)
  gr_transforms = transforms(t.dx_n, g_gmem.dtype)
  gr_spec = plgpu.BlockSpec(
    (cta_m, t.dx_n),
    lambda s: (0, s),
    transforms=gr_transforms,
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  w_spec = plgpu.BlockSpec(
    (t.dx_k, t.dx_n),
    lambda s: (0, s),
    transforms=transforms(t.dx_n, w_gmem.dtype),
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  code = epilogue.code

  def body(wg, refs, acc_ref, spread):
    *gr_smem, w_smem = refs
    own = pl.ds(wg * t.dx_m, t.dx_m)
    r_smem = gr_smem[1] if r_gmem is not None else None
    _dz_in_place(epilogue, gr_smem[0], r_smem, part=(own, 0, t.dx_n), spread=spread)
    plgpu.wgmma(acc_ref, gr_smem[0].at[own], w_smem.transpose((1, 0)))

  operands = [g_gmem.at[cta_rows, :]] + ([] if r_gmem is None else [r_gmem.at[cta_rows, :]])
  specs = [gr_spec] + ([] if r_gmem is None else [_residual_spec(gr_spec, code)]) + [w_spec]

  def out_tile(wg):
    rows = pl.ds(lax.axis_index("m") * cta_m + wg * t.dx_m, t.dx_m)
    return rows, cols, (t.dx_m, t.dx_k)

  operands.append(w_gmem.at[cols, :])
  _bwd_kernel(
    body,
    operands,
    specs,
    dx_gmem,
    out_tile,
    t=t,
    steps=n // t.dx_n,
    stages=t.dx_stages,
    code=code,
    block_rows=t.dx_m,
  )


def _dw_kernel(x_gmem, g_gmem, r_gmem, dw_gmem, *, epilogue: Epilogue, t: HopperBwdTiles):
  """``dw[ki, ni] = sum_m x[m, ki].T @ dz[m, ni]``, each compute warpgroup on its own columns."""
  m = x_gmem.shape[0]
  cta_n = t.wgs * t.dw_n
  rows = pl.ds(lax.axis_index("k") * t.dw_k, t.dw_k)
  cta_cols = pl.ds(lax.axis_index("n") * cta_n, cta_n)
  x_spec = plgpu.BlockSpec(
    (t.dw_m, t.dw_k),
    lambda s: (s, 0),
    transforms=transforms(t.dw_k, x_gmem.dtype),
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  gr_spec = plgpu.BlockSpec(
    (t.dw_m, cta_n),
    lambda s: (s, 0),
    transforms=transforms(t.dw_n, g_gmem.dtype),
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  code = epilogue.code
  operands = [x_gmem.at[:, rows], g_gmem.at[:, cta_cols]]
  specs = [x_spec, gr_spec]
  if r_gmem is not None:
    per = code.per_byte() if code is not None else 1
    operands.append(r_gmem.at[:, pl.ds(lax.axis_index("n") * cta_n // per, cta_n // per)])
    specs.append(_residual_spec(gr_spec, code))

  def body(wg, refs, acc_ref, spread):
    x_smem, *gr_smem = refs
    own = pl.ds(wg * t.dw_n, t.dw_n)
    r_smem = gr_smem[1] if r_gmem is not None else None
    part = (slice(None), wg * t.dw_n, t.dw_n)
    _dz_in_place(epilogue, gr_smem[0], r_smem, part=part, spread=spread)
    plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), gr_smem[0].at[:, own])

  def out_tile(wg):
    return rows, pl.ds(lax.axis_index("n") * cta_n + wg * t.dw_n, t.dw_n), (t.dw_k, t.dw_n)

  _bwd_kernel(
    body,
    operands,
    specs,
    dw_gmem,
    out_tile,
    t=t,
    steps=m // t.dw_m,
    stages=t.dw_stages,
    code=code,
    block_rows=t.dw_m,
  )


def hopper_dense_bias_act_bwd(
  x: Array,
  w: Array,
  residual: Array | None,
  g: Array,
  *,
  epilogue: Epilogue,
  has_bias: bool,
  tiles: HopperBwdTiles | None = None,
  interpret: Any = False,
) -> tuple[Array, Array, Array | None]:
  """``(dx, dw, db)`` as :func:`pallas_kernels.dense_bias_act_bwd` returns them, on Hopper.

  Two Mosaic GPU kernels, ``dx = dz @ w.T`` and ``dw = x.T @ dz``, each forming
  ``dz = g * act'(residual)`` from tiles of `g` and `residual` on the fly: dz never reaches device
  memory. With a derivative code (``epilogue.residual == "code"``) `residual` is its uint8 bytes
  as the forward kept them (``epilogue.kept_shape(g.shape)``), decoded in the kernels.
  ``db = sum(dz, rows)`` is a third kernel's, :func:`pallas_kernels.bias_act_triton.bias_grad`
  (Triton: one read of `g` and `residual`, float32 partial sums of dz before its rounding).
  """
  batch, (k, n) = x.shape[:-1], w.shape
  if g.shape != (*batch, n):
    raise ValueError(
      f"pallas_kernels.dense_mosaic: `g` must have shape {(*batch, n)}; got {g.shape}"
    )
  needs_r = epilogue.residual != "none"
  kept_shape = epilogue.kept_shape(g.shape)
  if needs_r and (residual is None or residual.shape != kept_shape):
    raise ValueError(
      f"pallas_kernels.dense_mosaic: a {epilogue.residual!r} epilogue needs the residual of shape "
      f"{kept_shape}; got {None if residual is None else residual.shape}"
    )
  r_dtype = epilogue.kept_dtype(x.dtype)
  if not (x.dtype == w.dtype == g.dtype) or (needs_r and residual.dtype != r_dtype):
    raise TypeError(
      "pallas_kernels.dense_mosaic: x, w and g must share one dtype, and the residual have it "
      "(uint8 "
      f"for a code); got {x.dtype}, {w.dtype}, {g.dtype}, "
      f"{None if residual is None else residual.dtype}"
    )
  x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
  r2 = residual.reshape(-1, kept_shape[-1]) if needs_r else None
  m = x2.shape[0]
  code = epilogue.code
  t = tiles or hopper_bwd_tiles((m, k, n), needs_r, code)
  why = hopper_bwd_unsupported((m, k, n), x.dtype, epilogue, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.dense_mosaic: {why}")
  db = None
  if has_bias:  # See the module's docstring for why not in the dw kernel.
    db = bias_act_triton.bias_grad(g2, r2, epilogue=epilogue, interpret=bool(interpret))
    db = db.astype(x.dtype)
  epilogue = for_kernel(epilogue)
  kernel = functools.partial(launch, interpret=interpret, compute_wgs=t.wgs)

  def dx_body(g_ref, *refs):
    *r_ref, w_ref, dx_ref = refs
    _dx_kernel(g_ref, r_ref[0] if r_ref else None, w_ref, dx_ref, epilogue=epilogue, t=t)

  def dw_body(x_ref, g_ref, *refs):
    *r_ref, dw_ref = refs
    _dw_kernel(x_ref, g_ref, r_ref[0] if r_ref else None, dw_ref, epilogue=epilogue, t=t)

  r_args = (r2,) if needs_r else ()
  dx = kernel(
    dx_body,
    jax.ShapeDtypeStruct((m, k), x.dtype),
    grid=(m // (t.wgs * t.dx_m), k // t.dx_k),
    grid_names=("m", "k"),
  )(g2, *r_args, w)
  dw = kernel(
    dw_body,
    jax.ShapeDtypeStruct((k, n), w.dtype),
    grid=(k // t.dw_k, n // (t.wgs * t.dw_n)),
    grid_names=("k", "n"),
  )(x2, g2, *r_args)
  return dx.reshape(*batch, k), dw, db
