"""Grouped matmuls (a mixture of experts' products) as Pallas kernels (Triton backend).

The rows of ``lhs`` are sorted by group: group ``i`` owns rows ``[offsets[i], offsets[i + 1])``
with ``offsets = [0, cumsum(group_sizes)]``; the rows past ``sum(group_sizes)`` are padding.

* :func:`gmm`: ``out[rows of i] = lhs[rows of i] @ rhs[i]`` (``rhs`` (g, k, n)), or with
  ``transpose_rhs`` ``lhs[rows of i] @ rhs[i].T`` (``lhs`` (m, n), the input gradient); padding
  rows come out zero. One program per ``(block_m, block_n)`` output tile, as a dense matmul's.
  A tile whose rows straddle group boundaries loops over the groups it overlaps (their range is
  computed per row tile with XLA ops before the call, :func:`_tile_groups`), each time over the
  whole contraction with the rows of the other groups masked to zero, into one float32
  accumulator: the masked rows add exact zeros, so the tile is stored once and no two programs
  write the same rows. A row tile costs one contraction per group it touches, so over all tiles
  at most ``m / block_m + g`` contractions of a tile, against ``g * m / block_m`` for XLA's
  ragged_dot (a dense product over a masked (groups x rows) operand). Empty groups cost nothing.
* :func:`tgmm`: ``out[i] = lhs[rows of i].T @ dout[rows of i]`` (g, k, n), the weight gradient:
  one program per group and ``(block_k, block_n)`` tile, looping over its group's rows only
  (``block_m`` at a time from the group's first row); an empty group stores zeros.

This is megablox's ``gmm`` / ``tgmm`` split (the work list of row tiles and groups there is the
loop over a tile's groups here, which Triton runs with dynamic bounds). Accumulation is float32;
float32 operands use TF32 exactly when :func:`allow_tf32` allows it for the caller's
``precision``. Ragged shapes are masked, not padded; the output dtype is
``preferred_element_type`` (default: lhs's).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels._triton import (
  DTYPES,
  CompilerParams,
  allow_tf32,
  dot,
  iota,
  load,
  pl,
  store,
  store_tile,
)
from pallas_kernels.dense_triton_tiles import Tiles, tile_side


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
  gmm: Tiles  # out (m, n): rows=block_m, cols=block_n, step over k
  tgmm: Tiles  # out[i] (k, n): rows=block_k, cols=block_n, step over a group's rows


def default_block_config(shape: tuple[int, int, int], dtype) -> GroupedConfig:
  """Tiles for the grouped products of ``(M, K, N)`` (rows, contraction, output columns of
  :func:`gmm`; :func:`tgmm` writes ``(K, N)`` a group) in `dtype`.

  Reasoning: the output tiles of :mod:`pallas_kernels.dense_triton_tiles` (128 x 128 where the
  dimension allows: a float32 accumulator of 64 registers a thread over 8 warps; 64 or 16 for
  small dimensions), its reduction step (64 for 16-bit operands, 32 for float32: 32 KiB of shared
  memory a pipeline stage, three stages within the A100's 164 KiB), and 8 warps at a side of 128.
  :func:`tgmm` reduces over a group's rows 32 at a time (as dense's dw kernel steps over M),
  from the group's first row rather than a multiple of 32, so that a group of few rows wastes
  little.
  """
  m, k, n = shape
  half = np.dtype(dtype).itemsize == 2

  def tiles(rows: int, cols: int, step: int, stages: int) -> Tiles:
    return Tiles(rows, cols, step, 8 if max(rows, cols) >= 128 else 4, stages)

  step = 16 if k <= 16 else 64 if half else 32
  return GroupedConfig(
    gmm=tiles(tile_side(m), tile_side(n), step, 3),
    tgmm=tiles(tile_side(k), tile_side(n), 16 if m <= 16 else 32, 3 if half else 2),
  )


# --------------------------------------------------------------------------------- kernels


def _tile(ref, r0, c0, rows_ok: Array, cols_ok: Array) -> Array:
  """The tile of a 2-D ref at ``(r0, c0)`` of ``(len(rows_ok), len(cols_ok))``, zero where a row
  or a column is not ok."""
  mask = rows_ok[:, None] & cols_ok[None, :]
  block = ref.at[pl.ds(r0, rows_ok.shape[0]), pl.ds(c0, cols_ok.shape[0])]
  return load(block, mask=mask, other=jnp.zeros((), ref.dtype))


def _in(start, size: int, limit) -> Array:
  """Whether each of the `size` indices from `start` is below `limit`."""
  return (start + iota(size)) < limit


def _gmm_kernel(tiles_ref, offsets_ref, lhs_ref, rhs_ref, out_ref, *, tiles, transpose, tf32):
  """out tile ``(i, j)``: the sum over the groups its rows overlap of the group's rows (the
  others masked to zero) times the group's rhs. `rhs_ref` is (g * k, n): group g's slab from row
  ``g * k`` (Triton lowers one indexer a ref)."""
  bm, bn, bk = tiles.rows, tiles.cols, tiles.step
  i = pl.program_id(0)
  r0 = pl.multiple_of(i * bm, bm)
  c0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  rows = r0 + iota(bm)
  depth, width = lhs_ref.shape[1], out_ref.shape[1]
  slab = width if transpose else depth  # rows of rhs a group

  def group(g, acc):
    start, end = offsets_ref[g], offsets_ref[g + 1]
    keep = (rows >= start) & (rows < end)
    base = g * slab

    def step(s, acc):
      k0 = pl.multiple_of(s * bk, bk)
      lt = _tile(lhs_ref, r0, k0, keep, _in(k0, bk, depth))
      if transpose:
        rt = _tile(rhs_ref, base + c0, k0, _in(c0, bn, width), _in(k0, bk, depth))
        return acc + dot(lt, rt, trans_b=True, tf32=tf32)
      rt = _tile(rhs_ref, base + k0, c0, _in(k0, bk, depth), _in(c0, bn, width))
      return acc + dot(lt, rt, tf32=tf32)

    steps = jnp.minimum(jnp.maximum(end - start, 0), 1) * pl.cdiv(depth, bk)  # none if empty
    return lax.fori_loop(0, steps, step, acc)

  first, last = tiles_ref[2 * i], tiles_ref[2 * i + 1]
  acc = lax.fori_loop(first, last, group, jnp.zeros((bm, bn), jnp.float32))
  store_tile(out_ref, r0, c0, acc)


def _tgmm_kernel(offsets_ref, lhs_ref, dout_ref, out_ref, *, tiles, tf32):
  """out tile ``(g, i, j)``: ``lhs[rows of g, i-tile].T @ dout[rows of g, j-tile]``."""
  bk, bn, bm = tiles.rows, tiles.cols, tiles.step
  g = pl.program_id(0)
  r0 = pl.multiple_of(pl.program_id(1) * bk, bk)
  c0 = pl.multiple_of(pl.program_id(2) * bn, bn)
  start, end = offsets_ref[g], offsets_ref[g + 1]

  def step(s, acc):
    m0 = start + s * bm
    keep = (m0 + iota(bm)) < end
    lt = _tile(lhs_ref, m0, r0, keep, _in(r0, bk, lhs_ref.shape[1]))
    dt = _tile(dout_ref, m0, c0, keep, _in(c0, bn, dout_ref.shape[1]))
    return acc + dot(lt, dt, trans_a=True, tf32=tf32)

  steps = (jnp.maximum(end - start, 0) + bm - 1) // bm
  acc = lax.fori_loop(0, steps, step, jnp.zeros((bk, bn), jnp.float32))
  # out_ref is (g * k, n): the interpreter does not store through a view of a 3-D ref.
  depth, width = lhs_ref.shape[1], out_ref.shape[1]
  mask = ((r0 + iota(bk)) < depth)[:, None] & ((c0 + iota(bn)) < width)[None, :]
  block = out_ref.at[pl.ds(g * depth + r0, bk), pl.ds(c0, bn)]
  store(block, acc.astype(out_ref.dtype), mask=mask)


# --------------------------------------------------------------------------- pallas_calls


def _params(t: Tiles) -> CompilerParams:
  return CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def _offsets(group_sizes: Array, m: int) -> Array:
  """``[0, cumsum(group_sizes)]`` (g + 1,) int32, clipped to the `m` rows."""
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends.astype(jnp.int32)])


def _tile_groups(offsets: Array, m: int, bm: int) -> Array:
  """For each row tile, the groups ``[first, last)`` its rows overlap, flat (2 * tiles,) int32;
  ``first == last`` for a tile of padding rows alone."""
  g = offsets.shape[0] - 1
  r0 = jnp.arange(pl.cdiv(m, bm), dtype=jnp.int32) * bm
  r1 = jnp.minimum(r0 + bm, m)
  ends = offsets[1:]
  first = jnp.minimum(jnp.searchsorted(ends, r0, side="right"), g)
  last = jnp.minimum(jnp.searchsorted(ends, r1 - 1, side="right") + 1, g)
  return jnp.stack([first, jnp.maximum(last, first)], axis=1).reshape(-1).astype(jnp.int32)


def _check(name: str, lhs: Array, rhs: Array, group_sizes: Array, out_dtype) -> None:
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
      f"pallas_kernels.grouped_triton.{name}: `group_sizes` must be (groups,) integers; got "
      f"shape {group_sizes.shape}, dtype {group_sizes.dtype}"
    )
  for arg, v in (("lhs", lhs), ("rhs", rhs), ("preferred_element_type", out_dtype)):
    dtype = np.dtype(getattr(v, "dtype", v))
    if dtype not in DTYPES:
      raise TypeError(
        f"pallas_kernels.grouped_triton.{name}: `{arg}` has dtype {dtype.name}; accepted: "
        "float32, bfloat16, float16"
      )
  if lhs.dtype != rhs.dtype:
    raise TypeError(
      f"pallas_kernels.grouped_triton.{name}: `lhs` and `rhs` must have one dtype; got "
      f"{lhs.dtype} and {rhs.dtype}"
    )


def gmm(
  lhs: Array,
  rhs: Array,
  group_sizes: Array,
  *,
  transpose_rhs: bool = False,
  preferred_element_type=None,
  precision: Any = None,
  block_config: GroupedConfig | None = None,
  interpret: bool = False,
) -> Array:
  """``lhs[rows of i] @ rhs[i]`` for each group `i`, (m, n) (or ``@ rhs[i].T``, (m, k), with
  `transpose_rhs`): `lhs` (m, k) (m, n), `rhs` (g, k, n), `group_sizes` (g,) summing to at most
  m; rows past the sum are zero. `block_config` replaces :func:`default_block_config`'s."""
  out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
  _check("gmm", lhs, rhs, group_sizes, out_dtype)
  g, k, n = rhs.shape
  depth, width = (n, k) if transpose_rhs else (k, n)
  if lhs.ndim != 2 or lhs.shape[1] != depth or group_sizes.shape != (g,):
    raise ValueError(
      "pallas_kernels.grouped_triton.gmm: `lhs` must be (m, "
      f"{'n' if transpose_rhs else 'k'}) and `group_sizes` (g,) for `rhs` (g, k, n); got "
      f"lhs.shape={lhs.shape}, rhs.shape={rhs.shape}, group_sizes.shape={group_sizes.shape}"
    )
  m = lhs.shape[0]
  t = (block_config or default_block_config((m, depth, width), lhs.dtype)).gmm
  offsets = _offsets(group_sizes, m)
  kernel = pl.pallas_call(
    functools.partial(_gmm_kernel, tiles=t, transpose=transpose_rhs, tf32=allow_tf32(precision)),
    out_shape=jax.ShapeDtypeStruct((m, width), out_dtype),
    grid=(pl.cdiv(m, t.rows), pl.cdiv(width, t.cols)),
    compiler_params=_params(t),
    interpret=interpret,
    name="jaxact_gmm_t" if transpose_rhs else "jaxact_gmm",
  )
  return kernel(_tile_groups(offsets, m, t.rows), offsets, lhs, rhs.reshape(g * k, n))


def tgmm(
  lhs: Array,
  dout: Array,
  group_sizes: Array,
  *,
  preferred_element_type=None,
  precision: Any = None,
  block_config: GroupedConfig | None = None,
  interpret: bool = False,
) -> Array:
  """``lhs[rows of i].T @ dout[rows of i]`` for each group `i`: (g, k, n) from `lhs` (m, k) and
  `dout` (m, n); zeros for an empty group. `block_config` replaces :func:`default_block_config`'s
  (its ``tgmm``)."""
  out_dtype = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
  _check("tgmm", lhs, dout, group_sizes, out_dtype)
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(
      "pallas_kernels.grouped_triton.tgmm: `lhs` must be (m, k) and `dout` (m, n); got "
      f"lhs.shape={lhs.shape}, dout.shape={dout.shape}"
    )
  (m, k), n, g = lhs.shape, dout.shape[1], group_sizes.shape[0]
  t = (block_config or default_block_config((m, k, n), lhs.dtype)).tgmm
  kernel = pl.pallas_call(
    functools.partial(_tgmm_kernel, tiles=t, tf32=allow_tf32(precision)),
    out_shape=jax.ShapeDtypeStruct((g * k, n), out_dtype),
    grid=(g, pl.cdiv(k, t.rows), pl.cdiv(n, t.cols)),
    compiler_params=_params(t),
    interpret=interpret,
    name="jaxact_tgmm",
  )
  return kernel(_offsets(group_sizes, m), lhs, dout).reshape(g, k, n)


# ------------------------------------------------------------------------------- reference


def _group_of_rows(group_sizes: Array, m: int) -> Array:
  """Each row's group, g for padding rows."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(m), side="right")


def gmm_reference(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None):
  """Pure-jnp :func:`gmm`: every row against its group's rhs (zeros for padding), float32."""
  out = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
  w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  gid = _group_of_rows(group_sizes, lhs.shape[0])
  w = jnp.concatenate([w, jnp.zeros_like(w[:1])])[gid].astype(jnp.float32)
  hi = lax.Precision.HIGHEST
  return jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), w, precision=hi).astype(out)


def tgmm_reference(lhs, dout, group_sizes, *, preferred_element_type=None):
  """Pure-jnp :func:`tgmm`: a one-hot sum over the rows of each group, float32."""
  out = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
  g = group_sizes.shape[0]
  onehot = jax.nn.one_hot(_group_of_rows(group_sizes, lhs.shape[0]), g, dtype=jnp.float32)
  hi = lax.Precision.HIGHEST
  f32 = lambda v: v.astype(jnp.float32)
  return jnp.einsum("mg,mk,mn->gkn", onehot, f32(lhs), f32(dout), precision=hi).astype(out)
