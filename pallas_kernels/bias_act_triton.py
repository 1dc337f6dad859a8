"""The epilogue of a convolution and its gradient, as one-pass Pallas kernels (Triton backend).

The convolution and its transposes stay with XLA (cuDNN on GPUs); what these kernels replace are
the elementwise passes around them, each of which would otherwise be one or more XLA fusions:

* forward, :func:`bias_act_fwd`: ``y = fn(z + b)`` over the convolution's output ``z``, written in
  place of ``z`` when their dtypes agree (``input_output_aliases``); for input-residual activations
  the biased pre-activation ``z + b`` is written in place of ``z`` and ``y`` beside it, and with a
  derivative code (``Epilogue.code``) the code's packed bytes of ``act'(z + b)`` beside ``y``;
* backward, :func:`bias_act_bwd`: ``dz = g * act'(r)`` and the bias gradient ``db = sum dz`` in one
  read of ``g`` and ``r`` (``r`` is what the forward kept: ``y``, ``z + b`` or the code); ``dz`` is
  written in place of ``g`` when their dtypes agree, and each program adds its rows of ``dz`` into a
  float32 row of per-block partial sums, which a tiny XLA reduction finishes (``rows /
  block_rows`` by ``C`` values).

Arrays are channels-last, ``(..., C)``, seen as ``(rows, C)``; tiles are ``(block_rows,
block_cols)`` with ragged edges masked. Every activation of the spec table works, as an
:class:`pallas_kernels.Epilogue`. The elementwise arithmetic is float32 whatever the storage dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels._triton import DTYPES, CompilerParams, load_tile, pl, slots, store_tile
from pallas_kernels.epilogue import Epilogue
from pallas_kernels.epilogue_triton import check_code, dz_tile, store_kept


@dataclasses.dataclass(frozen=True)
class EltwiseTiles:
  rows: int
  cols: int
  num_warps: int
  # Row tiles one program of the backward walks, summing db as it goes: one row of partial sums
  # per `steps` tiles (the forward takes one tile a program).
  steps: int = 1


def default_tiles(shape: tuple[int, int], dtype) -> EltwiseTiles:
  """Tile of a ``(rows, C)`` elementwise pass.

  Reasoning: the kernels are bound by memory bandwidth, so a program should keep enough bytes in
  flight without leaving SMs idle at the tail. In a sweep on an H100 (tiles of 2048 to 32768
  elements, 4 or 8 warps) 4096 elements over 4 warps gave the best sum of the four passes; larger
  tiles were slower. The columns are the channels rounded up to a power of two (Triton's
  requirement) up to 256, so a row of the tile is one contiguous run of memory and the bias tile is
  loaded once per program; the rows fill the rest, at least 16. Float32 storage takes 8 warps (the
  same 4096 elements): at 4 warps hard_silu's backward spills registers on an A100.
  """
  rows, cols = shape
  block_cols = min(256, max(1, 1 << math.ceil(math.log2(max(cols, 1)))))
  block_rows = max(16, min(4096 // block_cols, 1 << math.ceil(math.log2(max(rows, 1)))))
  return EltwiseTiles(block_rows, block_cols, 8 if np.dtype(dtype).itemsize == 4 else 4)


def _fwd_kernel(z_ref, b_ref, y_ref, zb_ref, *, epilogue: Epilogue, tiles: EltwiseTiles):
  r0 = pl.program_id(0) * tiles.rows
  c0 = pl.program_id(1) * tiles.cols
  z = load_tile(z_ref, r0, c0, tiles.rows, tiles.cols).astype(jnp.float32)
  if b_ref is not None:
    bias = load_tile(b_ref, 0, c0, 1, tiles.cols).astype(jnp.float32)
    z = z + bias
  store_tile(y_ref, r0, c0, epilogue.fn(z))
  if zb_ref is not None:
    store_kept(zb_ref, r0, c0, z, epilogue)


def _bwd_kernel(g_ref, r_ref, dz_ref, db_ref, *, epilogue: Epilogue, tiles: EltwiseTiles):
  """dz over `tiles.steps` row tiles of one column tile (with `dz_ref`), and their column sums
  in row ``i`` of db's partial sums (with `db_ref`)."""
  i = pl.program_id(0)
  c0 = pl.program_id(1) * tiles.cols

  def step(s, acc):
    r0 = (i * tiles.steps + s) * tiles.rows
    dz = dz_tile(g_ref, r_ref, r0, c0, tiles.rows, tiles.cols, epilogue)  # 0 outside the array
    if dz_ref is not None:
      store_tile(dz_ref, r0, c0, dz)
    return acc + jnp.sum(dz, axis=0, keepdims=True)

  acc = jnp.zeros((1, tiles.cols), jnp.float32)
  acc = step(0, acc) if tiles.steps == 1 else lax.fori_loop(0, tiles.steps, step, acc)
  if db_ref is not None:
    store_tile(db_ref, i, c0, acc)


def _check(name: str, v: Array) -> None:
  if np.dtype(v.dtype) not in DTYPES:
    raise TypeError(
      f"pallas_kernels.bias_act_triton: `{name}` has dtype {v.dtype}; accepted: float32, "
      "bfloat16, float16"
    )


def _params(t: EltwiseTiles) -> CompilerParams:
  return CompilerParams(num_warps=t.num_warps, num_stages=1)


def bias_act_fwd(
  z: Array,
  b: Array | None,
  *,
  epilogue: Epilogue,
  out_dtype=None,
  block_config: EltwiseTiles | None = None,
  in_place: bool = True,
  interpret: bool = False,
) -> tuple[Array, Array | None]:
  """``(y, zb)``: ``y = fn(z + b)`` in `out_dtype` (default z's) and, when
  ``epilogue.residual == "input"``, ``zb = z + b`` in `out_dtype`; for ``"code"`` the packed
  derivative code of ``z + b`` (uint8, ``(..., C // per_byte)``); else None.

  `z` is channels-last ``(..., C)``; `b` is ``(C,)`` or None. The output that can take `z`'s
  buffer (``zb`` for input residuals, else ``y``) does so when the dtypes agree and `in_place`.
  """
  _check("z", z)
  if b is not None:
    _check("b", b)
    if b.shape != z.shape[-1:]:
      raise ValueError(
        f"pallas_kernels.bias_act_triton: `b` must have shape ({z.shape[-1]},); got "
        f"b.shape={b.shape}"
      )
  out_dtype = np.dtype(z.dtype if out_dtype is None else out_dtype)
  if out_dtype not in DTYPES:
    raise TypeError(f"pallas_kernels.bias_act_triton: `out_dtype` {out_dtype} is not supported")
  c = z.shape[-1]
  check_code("bias_act_triton", epilogue, c)
  z2 = z.reshape(-1, c)
  rows = z2.shape[0]
  t = block_config or default_tiles((rows, c), z.dtype)
  keep_zb = epilogue.residual in ("input", "code")
  out = jax.ShapeDtypeStruct((rows, c), out_dtype)
  kept = jax.ShapeDtypeStruct(epilogue.kept_shape((rows, c)), epilogue.kept_dtype(out_dtype))
  # The output written last from each tile (zb, else y) may share z's buffer; a code is smaller.
  last = 1 if epilogue.residual == "input" else 0
  aliases = {0: last} if in_place and out_dtype == z.dtype else {}
  outs = pl.pallas_call(
    slots(_fwd_kernel, (True, b is not None, True, keep_zb), epilogue=epilogue, tiles=t),
    out_shape=(out, kept) if keep_zb else (out,),
    grid=(pl.cdiv(rows, t.rows), pl.cdiv(c, t.cols)),
    input_output_aliases=aliases,
    compiler_params=_params(t),
    interpret=interpret,
    name="jaxact_bias_act_fwd",
  )(*(v for v in (z2, None if b is None else b.reshape(1, c)) if v is not None))
  y = outs[0].reshape(z.shape)
  return y, (outs[1].reshape(epilogue.kept_shape(z.shape)) if keep_zb else None)


def bias_act_bwd(
  g: Array,
  residual: Array | None,
  *,
  epilogue: Epilogue,
  has_bias: bool,
  dz_dtype=None,
  block_config: EltwiseTiles | None = None,
  in_place: bool = True,
  interpret: bool = False,
) -> tuple[Array, Array | None]:
  """``(dz, db)``: ``dz = g * act'(residual)`` in `dz_dtype` (default g's), and the float32
  ``db = sum dz`` over every axis but the last (None unless `has_bias`). ``dz`` takes `g`'s buffer
  when the dtypes agree and `in_place`."""
  return _backward(
    g,
    residual,
    epilogue=epilogue,
    has_bias=has_bias,
    keep_dz=True,
    dz_dtype=dz_dtype,
    block_config=block_config,
    in_place=in_place,
    interpret=interpret,
  )


def _backward(
  g, residual, *, epilogue, has_bias, keep_dz, dz_dtype, block_config, steps=1, in_place, interpret
):
  """:func:`bias_act_bwd`, and without `keep_dz` :func:`bias_grad`; `steps` row tiles a program
  where `block_config` is not given."""
  _check("g", g)
  c = g.shape[-1]
  check_code("bias_act_triton", epilogue, c)
  needs_r = epilogue.residual != "none"
  kept_shape = epilogue.kept_shape(g.shape)
  if needs_r and (residual is None or residual.shape != kept_shape):
    raise ValueError(
      f"pallas_kernels.bias_act_triton: a {epilogue.residual!r} epilogue needs the residual of "
      "shape "
      f"{kept_shape}; got {None if residual is None else residual.shape}"
    )
  dz_dtype = np.dtype(g.dtype if dz_dtype is None else dz_dtype)
  g2 = g.reshape(-1, c)
  rows = g2.shape[0]
  r2 = residual.reshape(-1, kept_shape[-1]) if needs_r else None
  t = block_config or dataclasses.replace(default_tiles((rows, c), g.dtype), steps=steps)
  blocks = pl.cdiv(rows, t.rows * t.steps)
  out_shape = [jax.ShapeDtypeStruct((rows, c), dz_dtype)] if keep_dz else []
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((blocks, c), jnp.float32))
  outs = pl.pallas_call(
    slots(_bwd_kernel, (True, needs_r, keep_dz, has_bias), epilogue=epilogue, tiles=t),
    out_shape=tuple(out_shape),
    grid=(blocks, pl.cdiv(c, t.cols)),
    input_output_aliases={0: 0} if keep_dz and in_place and dz_dtype == g.dtype else {},
    compiler_params=_params(t),
    interpret=interpret,
    name="jaxact_bias_act_bwd" if keep_dz else "jaxact_bias_grad",
  )(*(v for v in (g2, r2) if v is not None))
  dz = outs[0].reshape(g.shape) if keep_dz else None
  return dz, (jnp.sum(outs[-1], axis=0) if has_bias else None)


# Row tiles a program of bias_grad sums: partial sums of 1/32 of a 16-bit g's bytes (tiles of
# 16 x 256), and programs enough to fill a GPU from (1024, 4096) up. bias_act_bwd keeps one tile a
# program: several did not pay there when timed (benchmarks/results/gpu.md, the conv layer and
# its epilogue kernels).
DB_STEPS = 4


def bias_grad(
  g: Array,
  residual: Array | None,
  *,
  epilogue: Epilogue,
  block_config: EltwiseTiles | None = None,
  interpret: bool = False,
) -> Array:
  """The float32 ``db = sum dz`` over every axis but the last, of ``dz = g * act'(residual)``, in
  one read of `g` and `residual` with no dz written: for backward kernels that form dz on the fly
  and cannot reduce it themselves (:mod:`pallas_kernels.dense_mosaic`). As in :func:`bias_act_bwd`
  and the Triton dense backward, dz is summed in float32 before any rounding to g's dtype.

  Each program sums ``block_config.steps`` (:data:`DB_STEPS` by default) row tiles of one column
  tile into a row of partial sums (``rows / (steps * block_rows)`` by ``C``, float32), which a
  tiny XLA reduction finishes.
  """
  _, db = _backward(
    g,
    residual,
    epilogue=epilogue,
    has_bias=True,
    keep_dz=False,
    dz_dtype=None,
    block_config=block_config,
    steps=DB_STEPS,
    in_place=False,
    interpret=interpret,
  )
  return db


def bias_act_reference(z: Array, b: Array | None, *, epilogue: Epilogue, out_dtype=None) -> Array:
  """Pure-jnp ``fn(z + b)`` in float32, `out_dtype` (default z's) out."""
  v = z.astype(jnp.float32)
  if b is not None:
    v = v + b.astype(jnp.float32)
  return epilogue.fn(v).astype(z.dtype if out_dtype is None else out_dtype)
