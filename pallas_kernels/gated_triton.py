"""The gated projection ``h = act(x @ w_gate + b_gate) * (x @ w_up + b_up)`` as Pallas kernels
(Triton backend).

Forward, :func:`gated_fwd`: one program per ``(block_m, block_f)`` tile of ``h``; both matmuls read
the same tile of ``x`` at each ``block_k`` step of the contraction and accumulate in float32 (two
accumulators), then the epilogue in registers: ``a = acc_gate + b_gate``, ``b = acc_up + b_up``,
``h = act(a) * b``. ``a`` and ``b`` are stored too unless the caller needs no gradient; ``h`` is
computed from ``a`` and ``b`` as stored (rounded to the output dtype), as the backward recomputes
it.

Backward, :func:`gated_bwd`: one memory-bound pass that reads the cotangent ``gh`` of ``h`` with
``a`` and ``b`` and writes ``da = gh * act'(a) * b`` and ``db = gh * act(a)``, and ``h`` as well
when asked (a down projection's weight gradient needs it): three reads, two or three writes, no
float32 intermediate in memory. The matmuls of the backward (``dx``, ``dw_gate``, ``dw_up``) are
the caller's.

The activation is an :class:`~pallas_kernels.Epilogue`, applied in float32 whatever the storage
dtype; ``act'(a)`` comes from the epilogue's derivative, given ``act(a)`` (output residuals) or
``a`` (input residuals). Products are formed so that an intermediate that overflows to infinity
times an exact zero gives 0, not NaN (NaN factors still give NaN), and ``act(a)`` times ``b`` or
``gh`` so that it overflows only where the product does, for the activations whose ``act(a)`` can
overflow (:func:`pallas_kernels.epilogue.times_act`). Ragged shapes are masked, as in
:mod:`pallas_kernels.dense_triton`.
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
  load_tile,
  pl,
  slots,
  store_tile,
)
from pallas_kernels.bias_act_triton import EltwiseTiles, default_tiles
from pallas_kernels.dense_triton_tiles import Tiles, tile_side
from pallas_kernels.epilogue import Epilogue, safe_mul, times_act


@dataclasses.dataclass(frozen=True)
class GatedBlockConfig:
  fwd: Tiles  # h, a, b (M, F): rows=block_m, cols=block_f, step over K
  bwd: EltwiseTiles  # da, db[, h] (M, F)


def default_block_config(shape: tuple[int, int, int], dtype) -> GatedBlockConfig:
  """Tile sizes and launch parameters for a gated projection of ``(M, K, F)`` in `dtype`.

  Reasoning:
  * The forward holds two float32 accumulators, so its output tile is half as wide as the dense
    kernel's: 128 x 64 over 8 warps is the register footprint of one 128 x 128 accumulator, the
    dense kernel's tile. Compiled at (8192, 4096, 11008) in bfloat16 with gelu, 128 x 64 takes 128
    registers a thread on an H100 and 190 on an A100, with no spill; 128 x 128 takes 229 on an H100
    and spills on an A100. Small dimensions take 64 or 16 rows as in the dense kernel.
  * The reduction step is 64 for 16-bit and 32 for float32 operands: a stage loads x (128 x step)
    and two weight tiles (step x 64), 32 KiB in either dtype, and three stages (96 KiB) fit the
    A100's 164 KiB of shared memory (compiled: 96 KiB on an H100, 64 KiB on an A100).
  * The backward pass is elementwise and memory-bound, tiled as the convolution epilogue's passes
    (:func:`pallas_kernels.bias_act_triton.default_tiles`: 4096 elements a program, rows of up to
    256 contiguous columns).
  """
  m, k, f = shape
  half = np.dtype(dtype).itemsize == 2
  rows, cols = tile_side(m), min(tile_side(f), 64)
  step = 16 if k <= 16 else 64 if half else 32
  fwd = Tiles(rows, cols, step, 8 if rows >= 128 else 4, 3)
  return GatedBlockConfig(fwd=fwd, bwd=default_tiles((m, f), dtype))


# --------------------------------------------------------------------------------- kernels


def _value_and_derivative(epilogue: Epilogue, z: Array) -> tuple[Array, Array]:
  """``(act(z), act'(z))`` in float32, the derivative from the residual the epilogue names."""
  y = epilogue.fn(z)
  if epilogue.residual == "output":
    return y, epilogue.derivative(y)
  if epilogue.residual == "input":
    return y, epilogue.derivative(z)
  return y, jnp.ones_like(z)


def _add_bias(acc: Array, b_ref, c0) -> Array:
  if b_ref is None:
    return acc
  cols = c0 + iota(acc.shape[1])
  bias = load(b_ref.at[pl.ds(c0, acc.shape[1])], mask=cols < b_ref.shape[0], other=0)
  return acc + bias.astype(jnp.float32)[None, :]


def _gated_fwd_kernel(
  x_ref, wg_ref, wu_ref, bg_ref, bu_ref, h_ref, a_ref, b_ref, *, epilogue, tiles, tf32
):
  """h (and a, b) tile ``(i, j)`` from the tiles of x, w_gate and w_up."""
  bm, bn, bk = tiles.rows, tiles.cols, tiles.step
  r0 = pl.multiple_of(pl.program_id(0) * bm, bm)
  c0 = pl.multiple_of(pl.program_id(1) * bn, bn)

  def body(s, accs):
    acc_a, acc_b = accs
    k0 = pl.multiple_of(s * bk, bk)
    xt = load_tile(x_ref, r0, k0, bm, bk)
    acc_a = acc_a + dot(xt, load_tile(wg_ref, k0, c0, bk, bn), tf32=tf32)
    acc_b = acc_b + dot(xt, load_tile(wu_ref, k0, c0, bk, bn), tf32=tf32)
    return acc_a, acc_b

  zeros = jnp.zeros((bm, bn), jnp.float32)
  acc_a, acc_b = lax.fori_loop(0, pl.cdiv(x_ref.shape[1], bk), body, (zeros, zeros))
  acc_a = _add_bias(acc_a, bg_ref, c0)
  acc_b = _add_bias(acc_b, bu_ref, c0)
  # h from a and b as they are kept, so that the backward's recomputed h is the forward's.
  a = acc_a.astype(h_ref.dtype)
  b = acc_b.astype(h_ref.dtype)
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  store_tile(h_ref, r0, c0, times_act(epilogue, epilogue.fn(a32), a32, b32))
  if a_ref is not None:
    store_tile(a_ref, r0, c0, a)
    store_tile(b_ref, r0, c0, b)


def _gated_bwd_kernel(gh_ref, a_ref, b_ref, da_ref, db_ref, h_ref, *, epilogue, tiles):
  """da, db (and h) over one ``(rows, cols)`` tile: three loads, the arithmetic in float32."""
  r0 = pl.program_id(0) * tiles.rows
  c0 = pl.program_id(1) * tiles.cols

  def tile(ref):
    return load_tile(ref, r0, c0, tiles.rows, tiles.cols).astype(jnp.float32)

  gh, a, b = tile(gh_ref), tile(a_ref), tile(b_ref)
  act_a, d_act = _value_and_derivative(epilogue, a)
  store_tile(da_ref, r0, c0, safe_mul(gh * d_act, b))
  store_tile(db_ref, r0, c0, times_act(epilogue, act_a, a, gh, d_act, plain=True))
  if h_ref is not None:
    store_tile(h_ref, r0, c0, times_act(epilogue, act_a, a, b, d_act))


# --------------------------------------------------------------------------- pallas_calls


def _check_dtype(name: str, v: Array | None) -> None:
  if v is not None and np.dtype(v.dtype) not in DTYPES:
    raise TypeError(
      f"pallas_kernels.gated_triton: `{name}` has dtype {v.dtype}; accepted: float32, bfloat16, "
      "float16"
    )


def _check_fwd(x, w_gate, w_up, b_gate, b_up) -> None:
  if x.ndim < 1 or w_gate.ndim != 2 or x.shape[-1] != w_gate.shape[0]:
    raise ValueError(
      "pallas_kernels.gated_triton: `x` must be (..., in) and `w_gate` (in, hidden); got "
      f"x.shape={x.shape}, w_gate.shape={w_gate.shape}"
    )
  if w_up.shape != w_gate.shape:
    raise ValueError(
      f"pallas_kernels.gated_triton: `w_up` must have w_gate's shape {w_gate.shape}; got "
      f"{w_up.shape}"
    )
  for name, bias in (("b_gate", b_gate), ("b_up", b_up)):
    if bias is not None and bias.shape != (w_gate.shape[1],):
      raise ValueError(
        f"pallas_kernels.gated_triton: `{name}` must have shape ({w_gate.shape[1]},); got "
        f"{bias.shape}"
      )
  for name, v in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("b_gate", b_gate), ("b_up", b_up)):
    _check_dtype(name, v)
  if not x.dtype == w_gate.dtype == w_up.dtype:
    raise TypeError(
      "pallas_kernels.gated_triton: `x`, `w_gate` and `w_up` must have one dtype; got "
      f"{x.dtype}, {w_gate.dtype} and {w_up.dtype}"
    )


def gated_fwd(
  x: Array,
  w_gate: Array,
  w_up: Array,
  b_gate: Array | None = None,
  b_up: Array | None = None,
  *,
  epilogue: Epilogue,
  out_dtype=None,
  keep: bool = True,
  precision: Any = None,
  block_config: GatedBlockConfig | None = None,
  interpret: bool = False,
) -> tuple[Array, Array | None, Array | None]:
  """``(h, a, b)`` in `out_dtype` (default x's); ``a`` and ``b`` are None unless `keep`.

  `x` may have batch dimensions. `block_config` replaces :func:`default_block_config`'s choice
  (only ``.fwd`` is read)."""
  _check_fwd(x, w_gate, w_up, b_gate, b_up)
  out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
  if out_dtype not in DTYPES:
    raise TypeError(f"pallas_kernels.gated_triton: `out_dtype` {out_dtype} is not supported")
  batch, (k, f) = x.shape[:-1], w_gate.shape
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  t = (block_config or default_block_config((m, k, f), x.dtype)).fwd
  out = jax.ShapeDtypeStruct((m, f), out_dtype)
  kernel = slots(
    _gated_fwd_kernel,
    (True, True, True, b_gate is not None, b_up is not None, True, keep, keep),
    epilogue=epilogue,
    tiles=t,
    tf32=allow_tf32(precision),
  )
  outs = pl.pallas_call(
    kernel,
    out_shape=(out, out, out) if keep else (out,),
    grid=(pl.cdiv(m, t.rows), pl.cdiv(f, t.cols)),
    compiler_params=CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
    interpret=interpret,
    name="jaxact_gated_fwd",
  )(*(v for v in (x2, w_gate, w_up, b_gate, b_up) if v is not None))
  h, *kept = (o.reshape(*batch, f) for o in outs)
  return (h, *kept) if keep else (h, None, None)


def gated_bwd(
  gh: Array,
  a: Array,
  b: Array,
  *,
  epilogue: Epilogue,
  with_h: bool = False,
  grad_dtype=None,
  h_dtype=None,
  block_config: GatedBlockConfig | None = None,
  in_place: bool = True,
  interpret: bool = False,
) -> tuple[Array, Array, Array | None]:
  """``(da, db, h)`` from the cotangent `gh` of ``h = act(a) * b``: ``da = gh * act'(a) * b`` and
  ``db = gh * act(a)`` in `grad_dtype` (default gh's), ``h`` in `h_dtype` (default a's) with
  `with_h`, else None.

  With `in_place`, da takes gh's buffer, db b's and h a's where the dtypes agree: none of the
  inputs is read after this pass in a backward pass. `block_config` replaces
  :func:`default_block_config`'s choice (only ``.bwd`` is read)."""
  for name, v in (("gh", gh), ("a", a), ("b", b)):
    _check_dtype(name, v)
  if not gh.shape == a.shape == b.shape:
    raise ValueError(
      "pallas_kernels.gated_triton: `gh`, `a` and `b` must have one shape; got "
      f"{gh.shape}, {a.shape} and {b.shape}"
    )
  grad_dtype = np.dtype(gh.dtype if grad_dtype is None else grad_dtype)
  h_dtype = np.dtype(a.dtype if h_dtype is None else h_dtype)
  _check_dtype("grad_dtype", jax.ShapeDtypeStruct((), grad_dtype))
  _check_dtype("h_dtype", jax.ShapeDtypeStruct((), h_dtype))
  f = gh.shape[-1]
  gh2, a2, b2 = (v.reshape(-1, f) for v in (gh, a, b))
  m = gh2.shape[0]
  t = (block_config or default_block_config((m, 1, f), gh.dtype)).bwd
  out_shape = [jax.ShapeDtypeStruct((m, f), grad_dtype)] * 2
  if with_h:
    out_shape.append(jax.ShapeDtypeStruct((m, f), h_dtype))
  aliases = {}
  if in_place:
    pairs = ((0, gh, 0, grad_dtype), (2, b, 1, grad_dtype), (1, a, 2, h_dtype if with_h else None))
    aliases = {i: o for i, v, o, dt in pairs if dt is not None and np.dtype(v.dtype) == dt}
  outs = pl.pallas_call(
    slots(_gated_bwd_kernel, (True, True, True, True, True, with_h), epilogue=epilogue, tiles=t),
    out_shape=tuple(out_shape),
    grid=(pl.cdiv(m, t.rows), pl.cdiv(f, t.cols)),
    input_output_aliases=aliases,
    compiler_params=CompilerParams(num_warps=t.num_warps, num_stages=1),
    interpret=interpret,
    name="jaxact_gated_bwd",
  )(gh2, a2, b2)
  da, db = outs[0].reshape(gh.shape), outs[1].reshape(gh.shape)
  return da, db, outs[2].reshape(gh.shape) if with_h else None


# ------------------------------------------------------------------------------ custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnames=("epilogue", "precision", "interpret"))
def _gated_dense(x, w_gate, w_up, b_gate, b_up, epilogue, precision, interpret):
  kw = dict(epilogue=epilogue, keep=False, precision=precision, interpret=interpret)
  return gated_fwd(x, w_gate, w_up, b_gate, b_up, **kw)[0]


def _gated_dense_vjp_fwd(x, w_gate, w_up, b_gate, b_up, epilogue, precision, interpret):
  h, a, b = gated_fwd(
    x, w_gate, w_up, b_gate, b_up, epilogue=epilogue, precision=precision, interpret=interpret
  )
  return h, (x, w_gate, w_up, a, b, b_gate is not None, b_up is not None)


def _gated_dense_vjp_bwd(epilogue, precision, interpret, res, gh):
  x, w_gate, w_up, a, b, has_gate_bias, has_up_bias = res
  da, db, _ = gated_bwd(gh, a, b, epilogue=epilogue, interpret=interpret)
  batch = tuple(range(x.ndim - 1))

  def weight_grad(dz):
    return jnp.tensordot(x, dz, (batch, batch), precision=precision).astype(w_gate.dtype)

  def bias_grad(present, dz):
    return jnp.sum(dz, batch, dtype=jnp.float32).astype(x.dtype) if present else None

  dx = jnp.matmul(da, w_gate.T, precision=precision) + jnp.matmul(db, w_up.T, precision=precision)
  return (
    dx.astype(x.dtype),
    weight_grad(da),
    weight_grad(db),
    bias_grad(has_gate_bias, da),
    bias_grad(has_up_bias, db),
  )


_gated_dense.defvjp(_gated_dense_vjp_fwd, _gated_dense_vjp_bwd)


def gated_dense(
  x: Array,
  w_gate: Array,
  w_up: Array,
  b_gate: Array | None = None,
  b_up: Array | None = None,
  *,
  epilogue: Epilogue,
  precision: Any = None,
  interpret: bool = False,
) -> Array:
  """``act(x @ w_gate + b_gate) * (x @ w_up + b_up)``: the forward kernel, and the backward pass
  kernel with jnp matmuls (standalone use; jaxact's ``gated_dense(..., implementation="pallas")``
  calls :func:`gated_fwd` and :func:`gated_bwd` from its own ``custom_vjp``)."""
  return _gated_dense(
    x, w_gate, w_up, b_gate, b_up, epilogue=epilogue, precision=precision, interpret=interpret
  )


# ------------------------------------------------------------------------------- reference


def gated_dense_reference(
  x: Array,
  w_gate: Array,
  w_up: Array,
  b_gate: Array | None = None,
  b_up: Array | None = None,
  *,
  epilogue: Epilogue,
  precision: Any = None,
) -> Array:
  """Pure-jnp ``fn(a) * b``: float32 accumulation and epilogue, a and b rounded to x's dtype as
  the kernel keeps them, x's dtype out."""

  def project(w, bias):
    z = jnp.matmul(x, w, precision=precision, preferred_element_type=jnp.float32)
    return (z if bias is None else z + bias.astype(jnp.float32)).astype(x.dtype)

  a, b = project(w_gate, b_gate), project(w_up, b_up)
  return (epilogue.fn(a.astype(jnp.float32)) * b.astype(jnp.float32)).astype(x.dtype)


def gated_bwd_reference(
  gh: Array, a: Array, b: Array, *, epilogue: Epilogue
) -> tuple[Array, Array, Array]:
  """Pure-jnp ``(da, db, h)`` of :func:`gated_bwd` in float32, by autodiff of ``fn(a) * b`` (no
  zero-times-infinity guard)."""
  gh, a, b = (v.astype(jnp.float32) for v in (gh, a, b))
  h, pull = jax.vjp(lambda a, b: epilogue.fn(a) * b, a, b)
  return (*pull(gh), h)
