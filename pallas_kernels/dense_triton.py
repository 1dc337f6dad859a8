"""Fused ``act(x @ w + b)`` and its gradient as Pallas kernels (Triton backend).

Forward: one tiled matmul per ``(block_m, block_n)`` output tile, accumulated in float32 over
``block_k`` steps of the contraction, then the epilogue in registers: ``z = acc + b``,
``y = fn(z)``; ``y`` is stored, and ``z`` too only when the activation's derivative needs its input
(or, with a derivative code, the code's bytes of ``act'(z)``, packed in registers).

Backward, from the cotangent ``g`` and the kept residual ``r`` (``y``, ``z`` or the code of
``act'(z)``, which it decodes; none for identity):

* ``dx = dz @ w^T``: one kernel per ``(block_m, block_k)`` tile of ``dx``, looping over ``n``;
* ``dw = x^T @ dz`` and ``db = sum_m dz``: one kernel per ``(block_k, block_n)`` tile of ``dw``,
  looping over ``m``; the programs of the first ``k`` tile also reduce ``db`` from the same tiles.

``dz = g * act'(r)`` is never an array in memory: each kernel loads tiles of ``g`` and ``r`` and
forms the tile of ``dz`` in registers right before the dot that consumes it (the elementwise work is
done twice, once per kernel, which costs far less than writing and re-reading ``dz``).

Ragged shapes are masked, not padded: every tile is a power of two (Triton's requirement), loads
outside the array read 0 and stores outside it are dropped, so no input is copied. Masked ``dz``
entries are forced to 0, whatever the epilogue gives at 0.

The tiles (:class:`BlockConfig`) and their choice for a layer (:func:`default_block_config`) are in
:mod:`pallas_kernels.dense_triton_tiles`.

Precision: the dots accumulate in float32. float32 operands use TF32 exactly when
:func:`allow_tf32` says the caller's ``precision`` allows it (as XLA on GPU does); bfloat16 and
float16 operands run on the tensor cores as they are, and the backward kernels round the ``dz``
tile to the operands' dtype before its dot (what cuBLAS does with a half-precision cotangent).
"""

from __future__ import annotations

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
  load_tile,
  pl,
  slots,
  store,
  store_tile,
)
from pallas_kernels.dense_triton_tiles import BlockConfig, Tiles, default_block_config
from pallas_kernels.epilogue import Epilogue
from pallas_kernels.epilogue_triton import check_code, dz_tile, store_kept

# --------------------------------------------------------------------------------- kernels


def _dense_fwd_kernel(x_ref, w_ref, b_ref, y_ref, z_ref, *, epilogue, tiles, tf32):
  """y (and z) tile ``(i, j)``: ``fn(x[i, :] @ w[:, j] + b[j])``."""
  bm, bn, bk = tiles.rows, tiles.cols, tiles.step
  r0 = pl.multiple_of(pl.program_id(0) * bm, bm)
  c0 = pl.multiple_of(pl.program_id(1) * bn, bn)

  def body(s, acc):
    k0 = pl.multiple_of(s * bk, bk)
    xt = load_tile(x_ref, r0, k0, bm, bk)
    wt = load_tile(w_ref, k0, c0, bk, bn)
    return acc + dot(xt, wt, tf32=tf32)

  acc = lax.fori_loop(0, pl.cdiv(x_ref.shape[1], bk), body, jnp.zeros((bm, bn), jnp.float32))
  if b_ref is not None:
    cols = c0 + iota(bn)
    bias = load(b_ref.at[pl.ds(c0, bn)], mask=cols < b_ref.shape[0], other=0)
    acc = acc + bias.astype(jnp.float32)[None, :]
  store_tile(y_ref, r0, c0, epilogue.fn(acc))
  if z_ref is not None:
    store_kept(z_ref, r0, c0, acc, epilogue)


def _dense_dx_kernel(g_ref, r_ref, w_ref, dx_ref, *, epilogue, tiles, tf32):
  """dx tile ``(i, j)``: ``sum_n dz[i, n] w[j, n]``, dz formed per step in registers."""
  bm, bk, bn = tiles.rows, tiles.cols, tiles.step
  r0 = pl.multiple_of(pl.program_id(0) * bm, bm)
  c0 = pl.multiple_of(pl.program_id(1) * bk, bk)

  def body(s, acc):
    n0 = pl.multiple_of(s * bn, bn)
    dz = dz_tile(g_ref, r_ref, r0, n0, bm, bn, epilogue)
    wt = load_tile(w_ref, c0, n0, bk, bn)
    return acc + dot(dz.astype(wt.dtype), wt, trans_b=True, tf32=tf32)

  acc = lax.fori_loop(0, pl.cdiv(g_ref.shape[1], bn), body, jnp.zeros((bm, bk), jnp.float32))
  store_tile(dx_ref, r0, c0, acc)


def _dense_dw_kernel(x_ref, g_ref, r_ref, dw_ref, db_ref, *, epilogue, tiles, tf32):
  """dw tile ``(i, j)``: ``sum_m x[m, i] dz[m, j]``; the ``i = 0`` programs also store db[j]."""
  bk, bn, bm = tiles.rows, tiles.cols, tiles.step
  r0 = pl.multiple_of(pl.program_id(0) * bk, bk)
  c0 = pl.multiple_of(pl.program_id(1) * bn, bn)

  def body(s, carry):
    acc, db = carry
    m0 = pl.multiple_of(s * bm, bm)
    xt = load_tile(x_ref, m0, r0, bm, bk)
    dz = dz_tile(g_ref, r_ref, m0, c0, bm, bn, epilogue)
    acc = acc + dot(xt, dz.astype(xt.dtype), trans_a=True, tf32=tf32)
    if db_ref is not None:
      db = db + jnp.sum(dz, axis=0)
    return acc, db

  init = (jnp.zeros((bk, bn), jnp.float32), jnp.zeros((bn,), jnp.float32))
  acc, db = lax.fori_loop(0, pl.cdiv(x_ref.shape[0], bm), body, init)
  store_tile(dw_ref, r0, c0, acc)
  if db_ref is not None:

    @pl.when(pl.program_id(0) == 0)
    def _():
      cols = c0 + iota(bn)
      store(db_ref.at[pl.ds(c0, bn)], db.astype(db_ref.dtype), mask=cols < db_ref.shape[0])


# --------------------------------------------------------------------------- pallas_calls


def _params(t: Tiles) -> CompilerParams:
  return CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def _check(x: Array, w: Array, b: Array | None) -> None:
  if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(
      "pallas_kernels.dense_triton: `x` must be (..., in) and `w` (in, out); got "
      f"x.shape={x.shape}, "
      f"w.shape={w.shape}"
    )
  if b is not None and b.shape != (w.shape[1],):
    raise ValueError(
      f"pallas_kernels.dense_triton: `b` must have shape ({w.shape[1]},); got b.shape={b.shape}"
    )
  for name, v in (("x", x), ("w", w), ("b", b)):
    if v is not None and np.dtype(v.dtype) not in DTYPES:
      raise TypeError(
        f"pallas_kernels.dense_triton: `{name}` has dtype {v.dtype}; accepted: float32, bfloat16, "
        "float16"
      )
  if x.dtype != w.dtype:
    raise TypeError(
      f"pallas_kernels.dense_triton: `x` and `w` must have one dtype; got {x.dtype} and {w.dtype}"
    )


def dense_bias_act_fwd(
  x: Array,
  w: Array,
  b: Array | None,
  *,
  epilogue: Epilogue,
  out_dtype=None,
  precision: Any = None,
  block_config: BlockConfig | None = None,
  interpret: bool = False,
) -> tuple[Array, Array | None]:
  """``(y, z)``: ``y = fn(x @ w + b)`` in `out_dtype` (default x's), and ``z`` (same dtype) when
  ``epilogue.residual == "input"``, its packed derivative code (uint8, ``(..., N // per_byte)``)
  for ``"code"``, else None. `x` may have batch dimensions.

  `block_config` replaces :func:`default_block_config`'s choice (only ``.fwd`` is read)."""
  _check(x, w, b)
  out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
  if out_dtype not in DTYPES:
    raise TypeError(f"pallas_kernels.dense_triton: `out_dtype` {out_dtype} is not supported")
  batch, (k, n) = x.shape[:-1], w.shape
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  check_code("dense_triton", epilogue, n)
  t = (block_config or default_block_config((m, k, n), x.dtype)).fwd
  keep_z = epilogue.residual in ("input", "code")
  out = jax.ShapeDtypeStruct((m, n), out_dtype)
  kept = jax.ShapeDtypeStruct(epilogue.kept_shape((m, n)), epilogue.kept_dtype(out_dtype))
  kernel = slots(
    _dense_fwd_kernel,
    (True, True, b is not None, True, keep_z),
    epilogue=epilogue,
    tiles=t,
    tf32=allow_tf32(precision),
  )
  outs = pl.pallas_call(
    kernel,
    out_shape=(out, kept) if keep_z else (out,),
    grid=(pl.cdiv(m, t.rows), pl.cdiv(n, t.cols)),
    compiler_params=_params(t),
    interpret=interpret,
    name="jaxact_dense_fwd",
  )(*(v for v in (x2, w, b) if v is not None))
  y = outs[0].reshape(*batch, n)
  z = outs[1].reshape(*batch, kept.shape[-1]) if keep_z else None
  return y, z


def dense_bias_act_bwd(
  x: Array,
  w: Array,
  residual: Array | None,
  g: Array,
  *,
  epilogue: Epilogue,
  has_bias: bool,
  precision: Any = None,
  block_config: BlockConfig | None = None,
  interpret: bool = False,
) -> tuple[Array, Array, Array | None]:
  """``(dx, dw, db)`` for the cotangent `g` of ``y``; `residual` is what the forward kept.

  ``dx`` has x's dtype, ``dw`` w's; ``db`` (None unless `has_bias`) has x's dtype.
  `block_config` replaces :func:`default_block_config`'s choice.
  """
  _check(x, w, None)
  k, n = w.shape
  if g.shape != (*x.shape[:-1], n):
    raise ValueError(
      f"pallas_kernels.dense_triton: `g` must have shape {(*x.shape[:-1], n)}; got {g.shape}"
    )
  check_code("dense_triton", epilogue, n)
  needs_r = epilogue.residual != "none"
  kept_shape = epilogue.kept_shape(g.shape)
  if needs_r and (residual is None or residual.shape != kept_shape):
    raise ValueError(
      f"pallas_kernels.dense_triton: a {epilogue.residual!r} epilogue needs the residual of shape "
      f"{kept_shape}; got {None if residual is None else residual.shape}"
    )
  x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
  r2 = residual.reshape(-1, kept_shape[-1]) if needs_r else None
  m = x2.shape[0]
  cfg = block_config or default_block_config((m, k, n), x.dtype)
  tf32 = allow_tf32(precision)

  dx = pl.pallas_call(
    slots(
      _dense_dx_kernel, (True, needs_r, True, True), epilogue=epilogue, tiles=cfg.dx, tf32=tf32
    ),
    out_shape=jax.ShapeDtypeStruct((m, k), x.dtype),
    grid=(pl.cdiv(m, cfg.dx.rows), pl.cdiv(k, cfg.dx.cols)),
    compiler_params=_params(cfg.dx),
    interpret=interpret,
    name="jaxact_dense_bwd_dx",
  )(*(v for v in (g2, r2, w) if v is not None))

  out_shape = [jax.ShapeDtypeStruct((k, n), w.dtype)]
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((n,), x.dtype))
  outs = pl.pallas_call(
    slots(
      _dense_dw_kernel,
      (True, True, needs_r, True, has_bias),
      epilogue=epilogue,
      tiles=cfg.dw,
      tf32=tf32,
    ),
    out_shape=tuple(out_shape),
    grid=(pl.cdiv(k, cfg.dw.rows), pl.cdiv(n, cfg.dw.cols)),
    compiler_params=_params(cfg.dw),
    interpret=interpret,
    name="jaxact_dense_bwd_dw",
  )(*(v for v in (x2, g2, r2) if v is not None))
  return dx.reshape(x.shape), outs[0], outs[1] if has_bias else None


# ------------------------------------------------------------------------------ custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dense_bias_act(x, w, b, epilogue, precision, interpret):
  return dense_bias_act_fwd(x, w, b, epilogue=epilogue, precision=precision, interpret=interpret)[0]


def _dense_bias_act_vjp_fwd(x, w, b, epilogue, precision, interpret):
  y, z = dense_bias_act_fwd(x, w, b, epilogue=epilogue, precision=precision, interpret=interpret)
  kept = y if epilogue.residual == "output" else z
  return y, (x, w, kept, b is not None)


def _dense_bias_act_vjp_bwd(epilogue, precision, interpret, res, g):
  x, w, kept, has_bias = res
  return dense_bias_act_bwd(
    x, w, kept, g, epilogue=epilogue, has_bias=has_bias, precision=precision, interpret=interpret
  )


_dense_bias_act.defvjp(_dense_bias_act_vjp_fwd, _dense_bias_act_vjp_bwd)


def dense_bias_act(
  x: Array,
  w: Array,
  b: Array | None = None,
  *,
  epilogue: Epilogue,
  precision: Any = None,
  interpret: bool = False,
) -> Array:
  """``epilogue.fn(x @ w + b)`` with the fused kernels forward and backward (standalone use).

  jaxact's ``dense_bias_act(..., implementation="pallas")`` calls the fwd/bwd functions above from
  its own ``custom_vjp`` instead; this one exists for users of this package alone.
  """
  return _dense_bias_act(x, w, b, epilogue, precision, interpret)


# ------------------------------------------------------------------------------- reference


def dense_bias_act_reference(
  x: Array, w: Array, b: Array | None = None, *, epilogue: Epilogue, precision: Any = None
) -> Array:
  """Pure-jnp ``fn(x @ w + b)``: float32 accumulation and epilogue, x's dtype out."""
  z = jnp.matmul(x, w, precision=precision, preferred_element_type=jnp.float32)
  if b is not None:
    z = z + b.astype(jnp.float32)
  return epilogue.fn(z).astype(x.dtype)
