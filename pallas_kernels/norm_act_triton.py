"""The normalize-and-activate epilogue of a batch or group norm and its backward, as Pallas kernels
(Triton backend).

The statistics are the caller's (a mean and ``r = 1 / sqrt(var + eps)`` per statistic, float32, of
``x`` scaled by an optional power of two per statistic, so that no intermediate leaves float32's
range); these kernels replace the elementwise passes around them. ``x`` is channels-last, seen as
``(samples, rows, C)``: a batch norm is one sample (a statistic per channel), a group norm one
sample per example with its groups' statistics repeated over their channels, so that every
statistic the kernels read is a ``(samples, C)`` float32 array and a tile reads one row of it.

* forward, :func:`norm_act_fwd`: ``x_hat = (x s - mean) r`` (rounded to x's dtype) and ``y =
  act(scale x_hat + bias)``: reads x, writes y and, for the backward pass, x_hat.
* backward, :func:`norm_act_bwd`: ``dz = g act'(z)`` with ``z = scale x_hat + bias`` recomputed
  from x_hat (rounded to `dz_dtype` where the caller's autodiff would store it so), and, from it,

  - the per-(sample, channel) sums ``sum dz`` and ``sum dz x_hat`` (float32; every statistic's and
    parameter's sum is a small XLA sum of these): each program walks ``tiles.steps`` row tiles of
    one sample and one column tile and writes one row of partial sums, which XLA finishes;
  - ``dx = (rs dz - a - b x_hat) q`` with per-(sample, channel) ``rs``, ``a``, ``b`` (``rs = r
    scale``, ``a`` and ``b`` the centring terms; 0 for a norm by given statistics) and an optional
    power of two ``q`` (1 / sigma as ``r q`` where r alone would not be a normal float32).

  A training step runs it twice, reading x_hat and g each time: first the sums alone (no
  activation-sized write), then dx alone (dx's centring needs every sum); a norm by given
  statistics runs it once, the sums and dx from one read. For half precision inputs XLA's backward
  stores ``dz`` (in x's dtype) and reads it back with x_hat for the sums and again for dx; these
  read x_hat and g twice and write only dx.

Tiles are ``(block_rows, block_cols)`` of one sample, ragged edges masked. The arithmetic is float32
whatever the storage dtype; the activation is an :class:`pallas_kernels.Epilogue` whose derivative
is taken from the pre-activation (``residual="input"``, or ``"none"`` for the identity).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels import _triton as tr
from pallas_kernels._triton import DTYPES, CompilerParams, iota, load, load_tile, pl, slots
from pallas_kernels.epilogue import Epilogue

_WHERE = "pallas_kernels.norm_act_triton"


@dataclasses.dataclass(frozen=True)
class NormActTiles:
  rows: int
  cols: int
  num_warps: int
  # Row tiles a program of the backward's sums walks (one row of partial sums per `steps` tiles).
  steps: int = 1


# Programs the sums pass keeps at least (about 8 per SM of an H100's 132) before it walks several
# row tiles a program; at most 16 tiles a program.
_SUM_PROGRAMS = 1024
_MAX_STEPS = 16


def default_tiles(shape: tuple[int, int, int], dtype) -> NormActTiles:
  """Tiles of the passes over a ``(samples, rows, C)`` array.

  Reasoning: every pass is bound by memory bandwidth, like the convolution epilogue's
  (:func:`pallas_kernels.bias_act_triton.default_tiles`, whose H100 sweep found 4096 elements over
  4 warps the best tile, 8 warps for float32 storage): the columns are the channels rounded up to a
  power of two (Triton's requirement) up to 256, one contiguous run of memory a row, and the rows
  fill the rest, at most a sample's rows. The sums pass then walks as many row tiles a program
  (a power of two, at most 16) as keeps ``_SUM_PROGRAMS`` programs: its partial sums are a fraction
  ``1 / (steps * block_rows)`` of the bytes it reads.
  """
  samples, rows, cols = shape
  pow2 = lambda n: 1 << math.ceil(math.log2(max(n, 1)))
  block_cols = min(256, pow2(cols))
  block_rows = max(1, min(4096 // block_cols, pow2(rows)))
  programs = samples * pl.cdiv(rows, block_rows) * pl.cdiv(cols, block_cols)
  steps = 1
  while steps < _MAX_STEPS and programs // (2 * steps) >= _SUM_PROGRAMS:
    steps *= 2
  steps = min(steps, pow2(pl.cdiv(rows, block_rows)))
  return NormActTiles(block_rows, block_cols, 8 if np.dtype(dtype).itemsize == 4 else 4, steps)


# ---------------------------------------------------------------------------------- kernels


def _tile(ref, row0, tile, c0, tiles: NormActTiles, rows: int):
  """Row tile `tile` of the sample starting at `row0` of a 2-D ``(samples * rows, C)`` ref, and its
  mask (rows past the sample's, columns past C)."""
  r = tile * tiles.rows + iota(tiles.rows)
  mask = (r < rows)[:, None] & ((c0 + iota(tiles.cols)) < ref.shape[1])[None, :]
  block = ref.at[pl.ds(row0 + tile * tiles.rows, tiles.rows), pl.ds(c0, tiles.cols)]
  return block, mask


def _row(ref, s, c0, cols: int, default: float | None = None):
  """Row `s` of a ``(samples, C)`` ref as a float32 ``(1, cols)`` tile, or `default` without it."""
  if ref is None:
    return default
  return load_tile(ref, s, c0, 1, cols).astype(jnp.float32)


def _fwd_kernel(
  x_ref, mean_ref, r_ref, scale_ref, bias_ref, xs_ref, y_ref, xh_ref, *, epilogue, tiles, rows
):
  s, i = pl.program_id(0), pl.program_id(1)
  c0 = pl.program_id(2) * tiles.cols
  block, mask = _tile(x_ref, s * rows, i, c0, tiles, rows)
  x = load(block, mask=mask, other=jnp.zeros((), x_ref.dtype)).astype(jnp.float32)
  mean, r = _row(mean_ref, s, c0, tiles.cols), _row(r_ref, s, c0, tiles.cols)
  if xs_ref is not None:
    x = x * _row(xs_ref, s, c0, tiles.cols)
  # rounded to x's dtype before the scale and bias, as the XLA path and its backward see it
  x_hat = ((x - mean) * r).astype(x_ref.dtype)
  z = x_hat.astype(jnp.float32) * _row(scale_ref, 0, c0, tiles.cols, 1.0)
  z = z + _row(bias_ref, 0, c0, tiles.cols, 0.0)
  out, _ = _tile(y_ref, s * rows, i, c0, tiles, rows)
  tr.store(out, epilogue.fn(z).astype(y_ref.dtype), mask=mask)
  if xh_ref is not None:
    out, _ = _tile(xh_ref, s * rows, i, c0, tiles, rows)
    tr.store(out, x_hat.astype(xh_ref.dtype), mask=mask)


def _bwd_kernel(
  xh_ref,
  g_ref,
  scale_ref,
  bias_ref,
  rs_ref,
  a_ref,
  b_ref,
  q_ref,
  dx_ref,
  sum_ref,
  sum_xh_ref,
  *,
  epilogue,
  tiles,
  rows,
  dz_dtype,
):
  """dz over `tiles.steps` row tiles of sample ``program_id(0)``; dx of each tile (with `dx_ref`),
  and the tiles' column sums of dz and dz x_hat as one row of partial sums (with `sum_ref`)."""
  s, i = pl.program_id(0), pl.program_id(1)
  c0 = pl.program_id(2) * tiles.cols
  cols = tiles.cols
  scale, bias = _row(scale_ref, 0, c0, cols, 1.0), _row(bias_ref, 0, c0, cols, 0.0)
  if dx_ref is not None:
    rs, a, b = _row(rs_ref, s, c0, cols), _row(a_ref, s, c0, cols), _row(b_ref, s, c0, cols)
    q = _row(q_ref, s, c0, cols)

  def step(k, acc):
    tile = i * tiles.steps + k
    block, mask = _tile(xh_ref, s * rows, tile, c0, tiles, rows)
    x_hat = load(block, mask=mask, other=jnp.zeros((), xh_ref.dtype)).astype(jnp.float32)
    block, _ = _tile(g_ref, s * rows, tile, c0, tiles, rows)
    g = load(block, mask=mask, other=jnp.zeros((), g_ref.dtype)).astype(jnp.float32)
    dz = g
    if epilogue.derivative is not None:
      dz = jnp.where(mask, g * epilogue.derivative(x_hat * scale + bias), 0.0)
    if dz_dtype is not None:  # the dz autodiff of the half precision composition stores
      dz = dz.astype(dz_dtype).astype(jnp.float32)
    if dx_ref is not None:
      dx = rs * dz
      if a_ref is not None:
        dx = dx - a - b * x_hat
      if q_ref is not None:
        dx = dx * q
      out, _ = _tile(dx_ref, s * rows, tile, c0, tiles, rows)
      tr.store(out, dx.astype(dx_ref.dtype), mask=mask)
    sum_dz, sum_dz_xh = acc
    return sum_dz + jnp.sum(dz, 0, keepdims=True), sum_dz_xh + jnp.sum(dz * x_hat, 0, keepdims=True)

  acc = (jnp.zeros((1, cols), jnp.float32),) * 2
  acc = step(0, acc) if tiles.steps == 1 else lax.fori_loop(0, tiles.steps, step, acc)
  if sum_ref is not None:
    row = s * pl.num_programs(1) + i
    tr.store_tile(sum_ref, row, c0, acc[0])
    tr.store_tile(sum_xh_ref, row, c0, acc[1])


# ------------------------------------------------------------------------------ the wrappers


def _check(arrays: dict, samples: int, c: int) -> None:
  for name, v in arrays.items():
    if v is None:
      continue
    if np.dtype(v.dtype) not in DTYPES:
      raise TypeError(
        f"{_WHERE}: `{name}` has dtype {v.dtype}; accepted: float32, bfloat16, float16"
      )
    want = {"scale": (c,), "bias": (c,)}.get(name, (samples, c))  # x_scale, dx_scale: per sample
    if name not in ("x", "x_hat", "g") and v.shape != want:
      raise ValueError(f"{_WHERE}: `{name}` must have shape {want}; got {v.shape}")


def _as_params(scale, bias):
  return tuple(None if p is None else p.astype(jnp.float32).reshape(1, -1) for p in (scale, bias))


def norm_act_fwd(
  x: Array,
  mean: Array,
  r: Array,
  scale: Array | None,
  bias: Array | None,
  *,
  epilogue: Epilogue,
  out_dtype=None,
  keep_x_hat: bool = True,
  x_scale: Array | None = None,
  block_config: NormActTiles | None = None,
  interpret: bool = False,
) -> tuple[Array, Array | None]:
  """``(y, x_hat)`` of a ``(samples, rows, C)`` `x` normalized by ``(samples, C)`` float32 `mean`
  and `r` (``1 / sqrt(var + eps)``) of ``x * x_scale``: ``x_hat = (x x_scale - mean) r`` in x's
  dtype (None without `keep_x_hat`), ``y = act(scale x_hat + bias)`` in `out_dtype` (default
  x's). `x_scale`: ``(samples, C)`` float32 powers of two, or None (1)."""
  if x.ndim != 3:
    raise ValueError(f"{_WHERE}: `x` must be (samples, rows, C); got shape {x.shape}")
  samples, rows, c = x.shape
  arrays = {"x": x, "mean": mean, "r": r, "scale": scale, "bias": bias, "x_scale": x_scale}
  _check(arrays, samples, c)
  out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
  t = block_config or default_tiles(x.shape, x.dtype)
  shape = (samples * rows, c)
  out_shape = [jax.ShapeDtypeStruct(shape, out_dtype)]
  if keep_x_hat:
    out_shape.append(jax.ShapeDtypeStruct(shape, x.dtype))
  scale, bias = _as_params(scale, bias)
  present = (True, True, True, scale is not None, bias is not None, x_scale is not None)
  present += (True, keep_x_hat)
  inputs = (x.reshape(shape), mean, r, scale, bias, x_scale)
  outs = pl.pallas_call(
    slots(_fwd_kernel, present, epilogue=epilogue, tiles=t, rows=rows),
    out_shape=tuple(out_shape),
    grid=(samples, pl.cdiv(rows, t.rows), pl.cdiv(c, t.cols)),
    compiler_params=CompilerParams(num_warps=t.num_warps, num_stages=1),
    interpret=interpret,
    name="jaxact_norm_act_fwd",
  )(*(v for v in inputs if v is not None))
  return outs[0].reshape(x.shape), (outs[1].reshape(x.shape) if keep_x_hat else None)


def norm_act_bwd(
  x_hat: Array,
  g: Array,
  scale: Array | None,
  bias: Array | None,
  *,
  epilogue: Epilogue,
  sums: bool = True,
  dx: tuple[Array, Array | None, Array | None] | None = None,
  dx_scale: Array | None = None,
  dx_dtype=None,
  dz_dtype=None,
  block_config: NormActTiles | None = None,
  interpret: bool = False,
) -> tuple[Array | None, tuple[Array, Array] | None]:
  """``(dx, (sum dz, sum dz x_hat))`` from a ``(samples, rows, C)`` `x_hat` and the cotangent `g`
  of ``y = act(scale x_hat + bias)``, ``dz = g act'(scale x_hat + bias)``.

  Args:
    sums: compute the float32 ``(samples, C)`` sums over each sample's rows (else None).
    dx: ``(rs, a, b)``, each ``(samples, C)`` float32 (`a` and `b` both None for 0): write
      ``dx = rs dz - a - b x_hat`` in `dx_dtype` (default x_hat's); None: no dx.
    dx_scale: ``(samples, C)`` float32 powers of two ``q``: ``dx = (rs dz - a - b x_hat) q``;
      None: 1.
    dz_dtype: round dz to this dtype before using it (the rounding autodiff of a half precision
      composition does); None: dz in float32.
  """
  if x_hat.ndim != 3 or g.shape != x_hat.shape:
    raise ValueError(
      f"{_WHERE}: `x_hat` and `g` must both be (samples, rows, C); got {x_hat.shape}, {g.shape}"
    )
  if epilogue.residual not in ("input", "none"):
    raise ValueError(
      f"{_WHERE}: the epilogue's derivative must be taken from the pre-activation "
      f"(residual 'input' or 'none'); got {epilogue.residual!r}"
    )
  samples, rows, c = x_hat.shape
  rs, a, b = dx if dx is not None else (None, None, None)
  if (a is None) != (b is None):
    raise ValueError(f"{_WHERE}: `dx`'s a and b are given together or not at all")
  if dx_scale is not None and dx is None:
    raise ValueError(f"{_WHERE}: `dx_scale` scales dx, but no `dx` is asked for")
  arrays = {"x_hat": x_hat, "g": g, "scale": scale, "bias": bias, "rs": rs, "a": a, "b": b}
  _check({**arrays, "dx_scale": dx_scale}, samples, c)
  t = block_config or default_tiles(x_hat.shape, x_hat.dtype)
  if not sums:
    t = dataclasses.replace(t, steps=1)
  chunks = pl.cdiv(pl.cdiv(rows, t.rows), t.steps)
  shape = (samples * rows, c)
  out_shape = []
  if dx is not None:
    out_shape.append(jax.ShapeDtypeStruct(shape, x_hat.dtype if dx_dtype is None else dx_dtype))
  if sums:
    out_shape += [jax.ShapeDtypeStruct((samples * chunks, c), jnp.float32)] * 2
  scale, bias = _as_params(scale, bias)
  present = (True, True, scale is not None, bias is not None, rs is not None, a is not None)
  present += (b is not None, dx_scale is not None, dx is not None, sums, sums)
  dz_dtype = None if dz_dtype is None or np.dtype(dz_dtype) == np.float32 else np.dtype(dz_dtype)
  static = {"epilogue": epilogue, "tiles": t, "rows": rows, "dz_dtype": dz_dtype}
  outs = pl.pallas_call(
    slots(_bwd_kernel, present, **static),
    out_shape=tuple(out_shape),
    grid=(samples, chunks, pl.cdiv(c, t.cols)),
    compiler_params=CompilerParams(num_warps=t.num_warps, num_stages=1),
    interpret=interpret,
    name="jaxact_norm_act_bwd" if dx is not None else "jaxact_norm_act_sums",
  )(
    *(
      v
      for v in (x_hat.reshape(shape), g.reshape(shape), scale, bias, rs, a, b, dx_scale)
      if v is not None
    )
  )
  out_dx = outs[0].reshape(x_hat.shape) if dx is not None else None
  if not sums:
    return out_dx, None
  finish = lambda p: jnp.sum(p.reshape(samples, chunks, c), axis=1)
  return out_dx, (finish(outs[-2]), finish(outs[-1]))


# -------------------------------------------------------------------------------- references


def norm_act_reference(
  x, mean, r, scale, bias, *, epilogue: Epilogue, out_dtype=None, x_scale=None
):
  """Pure-jnp :func:`norm_act_fwd`: ``(y, x_hat)``."""
  xs = x.astype(jnp.float32) * (1.0 if x_scale is None else x_scale[:, None])
  x_hat = ((xs - mean[:, None]) * r[:, None]).astype(x.dtype)
  z = x_hat.astype(jnp.float32)
  if scale is not None:
    z = z * scale.astype(jnp.float32)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  return epilogue.fn(z).astype(x.dtype if out_dtype is None else out_dtype), x_hat


def norm_act_bwd_reference(
  x_hat, g, scale, bias, *, epilogue: Epilogue, dx=None, dx_scale=None, dz_dtype=None
):
  """Pure-jnp :func:`norm_act_bwd` (every output): ``(dx or None, (sum dz, sum dz x_hat))``."""
  xh = x_hat.astype(jnp.float32)
  z = xh * (1.0 if scale is None else scale.astype(jnp.float32))
  z = z + (0.0 if bias is None else bias.astype(jnp.float32))
  dz = g.astype(jnp.float32)
  if epilogue.derivative is not None:
    dz = dz * epilogue.derivative(z)
  if dz_dtype is not None:
    dz = dz.astype(dz_dtype).astype(jnp.float32)
  out = None
  if dx is not None:
    rs, a, b = dx
    out = rs[:, None] * dz
    if a is not None:
      out = out - a[:, None] - b[:, None] * xh
    if dx_scale is not None:
      out = out * dx_scale[:, None]
    out = out.astype(x_hat.dtype)
  return out, (jnp.sum(dz, axis=1), jnp.sum(dz * xh, axis=1))
