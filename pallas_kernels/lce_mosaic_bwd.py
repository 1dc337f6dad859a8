"""The backward tiles of the fused linear cross-entropy on Hopper GPUs (Mosaic GPU): the
softmax-minus-one-hot tile ``G`` formed in registers from the logits, without the logits ever
leaving them.

For a block of vocabulary columns (``w`` ``(D, Vb)``, ``b`` ``(Vb,)``) and every token, with the
per-token numbers of the forward pass (the log-sum-exp, and the scales the caller derives from the
cotangent ``g``, the z-loss and the label smoothing)::

    s = c tanh(z / c)  (or z),   z = x @ w + b
    G = (p_scale exp(s - m) - label_scale [v = y] - uniform_scale [s finite]) ds/dz

``G`` is written in the operands' dtype (what the ``dx = G wᵀ`` and ``dw = xᵀ G`` products take,
as the XLA path rounds it) and, with a bias, its float32 column sums over each tile of tokens
(``db``'s partial sums; the caller adds the ``T / tile_m`` rows). ``m`` is the row's largest logit
and ``p_scale`` holds the softmax's ``1 / sum exp(s - m)`` (kept apart from ``m``: one float32
log-sum-exp loses the sum next to logits of -1e9); ``s - m`` is clamped at 0 (a recomputed logit
an ulp above the forward's max would give a huge exponent next to huge logits). A row without a
finite logit is passed with ``p_scale`` 0.

Layout: :mod:`pallas_kernels.dense_mosaic`'s forward, with this epilogue in place of an activation.
A persistent CTA walks ``tile_m x 2 tile_n`` tiles of ``G`` in planar-snake order; a memory
warpgroup streams ``x`` and ``w`` tiles by TMA into a ring of ``stages`` buffers, two compute
warpgroups each accumulate a ``tile_m x tile_n`` logits tile by wgmma, bring their rows' numbers
and labels (and the bias tile) into shared memory by TMA while the main loop runs, form ``G`` and
write it through shared memory in ``epi_m x epi_n`` sub-tiles. The products ``G wᵀ`` and ``xᵀ G``
are left to the caller (XLA's GEMMs): accumulating ``dx`` ``(tile_m, D)`` or ``dw`` ``(D, Vb)``
inside the kernel fits neither registers nor shared memory at D = 4096, and accumulating them in
global memory from every tile (Cut Cross-Entropy's design) moves ``D x V x T / tile_m`` float32
additions, more than the products themselves at the issue's sizes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels._mosaic import (
  HALF,
  HOPPER_SMEM,
  half_tile_mma,
  launch,
  pipeline_allocations,
  pl,
  plgpu,
  transforms,
  write_tile,
  xw_pipeline,
)
from pallas_kernels.dense_mosaic import HopperTiles

# Per-token numbers the kernel reads: the row's max logit m, p_scale (with 1 / sum exp(s - m)),
# label_scale, uniform_scale.
_ROWS = 4


def lce_bwd_tiles(shape: tuple[int, int, int], dtype) -> HopperTiles:
  """Tiles for ``(T, D, Vb)``: the Hopper forward's with G's epilogue buffers.

  128 x 128 a compute warpgroup (128 accumulator registers a thread), 64-deep stages of
  (128 + 256) x 64 x 2 B = 48 KiB. G's double-buffered 64 x 64 sub-tiles take 32 KiB for the two
  warpgroups and the rows' numbers, labels, bias and column sums about 7 KiB, so three stages
  (144 KiB) fit Hopper's 227 KiB and four (192 KiB) do not.
  """
  del shape
  return HopperTiles(stages=3)


def _smem_bytes(t: HopperTiles, itemsize: int) -> int:
  per_wg = (_ROWS + 1) * t.tile_m * 4 + 2 * t.tile_n * 4  # rows, labels; bias, column sums
  return t.smem_bytes(itemsize, outputs=1) + 2 * per_wg


def lce_bwd_unsupported(
  shape: tuple[int, int, int], dtype, tiles: HopperTiles | None = None
) -> str | None:
  """Why the kernel cannot form ``G`` for ``(T, D, Vb)`` with `dtype` operands, or None."""
  t_, d, v = shape
  t = tiles or lce_bwd_tiles(shape, dtype)
  if np.dtype(dtype) not in HALF:
    return f"operand dtype {np.dtype(dtype).name} (the Hopper kernel takes bfloat16 or float16)"
  for name, n, step in (("tokens", t_, t.tile_m), ("V", v, 2 * t.tile_n), ("D", d, t.tile_k)):
    if n % step:
      return f"{name}={n} is not a multiple of {step} (the Hopper kernel's tile)"
  if _smem_bytes(t, np.dtype(dtype).itemsize) > HOPPER_SMEM:
    return f"tiles {t} need more shared memory than Hopper's {HOPPER_SMEM // 1024} KiB"
  return None


def dlogits(s, dcap, m, p_scale, label_scale, uniform_scale, hit):
  """``G`` in float32 from capped logits `s` (``dcap`` = ds/dz or None), per-row numbers
  broadcast to `s`'s shape and the label mask `hit`; a None scale is an absent term. The kernel
  and :func:`lce_bwd_reference` both evaluate this."""
  g = p_scale * jnp.exp(jnp.minimum(s - m, 0.0))
  if label_scale is not None:
    g = g - jnp.where(hit, label_scale, 0.0)
  if uniform_scale is not None:
    g = g - jnp.where(s > -jnp.inf, uniform_scale, 0.0)
  return g if dcap is None else g * dcap


def _capped(z, soft_cap):
  """``(s, ds/dz)``: -inf stays -inf, where ds/dz is 0."""
  if soft_cap is None:
    return z, None
  t = jnp.tanh(z * (1.0 / soft_cap))
  return jnp.where(z == -jnp.inf, -jnp.inf, soft_cap * t), 1.0 - t * t


def _bwd_kernel(
  x_gmem, w_gmem, b_gmem, labels_gmem, rows_gmem, g_gmem, db_gmem, *, t: HopperTiles, terms
):
  tokens, d = x_gmem.shape
  vocab = w_gmem.shape[1]
  cta_n = 2 * t.tile_n
  m_iters, n_iters, k_iters = tokens // t.tile_m, vocab // cta_n, d // t.tile_k
  soft_cap, label_term, uniform_term = terms
  row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

  pipeline = xw_pipeline(t, k_iters, x_gmem.dtype)

  out_dtype = g_gmem.dtype
  scratch = dict(
    pipeline_allocs=pipeline_allocations(pipeline, x_gmem, w_gmem),
    out_smem=plgpu.SMEM(
      (2, 1, 2, t.epi_m, t.epi_n), out_dtype, transforms=transforms(t.epi_n, out_dtype)
    ),
    rows_smem=plgpu.SMEM((2, _ROWS, t.tile_m), jnp.float32),
    labels_smem=plgpu.SMEM((2, t.tile_m), jnp.int32),
    barriers=plgpu.Barrier(num_barriers=2 * 3),  # rows, labels, bias: one each a warpgroup
    bias_smem=None if b_gmem is None else plgpu.SMEM((2, t.tile_n), jnp.float32),
    db_smem=None if db_gmem is None else plgpu.SMEM((2, t.tile_n), jnp.float32),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(pipeline_allocs, out_smem, rows_smem, labels_smem, barriers, bias_smem, db_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      mi, ni = plgpu.planar_snake(tile, (m_iters, n_iters), 1, min(t.snake_width, m_iters, n_iters))
      m_slice = pl.ds(mi * t.tile_m, t.tile_m)
      col0 = ni * cta_n + wg * t.tile_n  # this warpgroup's first column
      n_slice = pl.ds(col0, t.tile_n)

      def compute_context(run_pipeline):
        # This tile's per-row numbers, labels and bias land while the main loop runs; the last
        # tile's epilogue has finished reading them (program order within the warpgroup).
        rows_bar, labels_bar, bias_bar = (barriers.at[3 * wg + i] for i in range(3))
        plgpu.copy_gmem_to_smem(rows_gmem.at[:, m_slice], rows_smem.at[wg], rows_bar)
        plgpu.copy_gmem_to_smem(labels_gmem.at[m_slice], labels_smem.at[wg], labels_bar)
        if b_gmem is not None:
          plgpu.copy_gmem_to_smem(b_gmem.at[n_slice], bias_smem.at[wg], bias_bar)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          z = acc_ref[...]
          if b_gmem is not None:
            plgpu.barrier_wait(bias_bar)
            bias = plgpu.load(bias_smem.at[wg], layout=col)
            z = z + lax.broadcast_in_dim(bias, z.shape, [1])
          s, dcap = _capped(z, soft_cap)
          plgpu.barrier_wait(rows_bar)
          plgpu.barrier_wait(labels_bar)

          def per_row(i):
            v = plgpu.load(rows_smem.at[wg, i], layout=row)
            return lax.broadcast_in_dim(v, s.shape, [0])

          labels = plgpu.load(labels_smem.at[wg], layout=row)
          cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
          hit = cols + col0 == lax.broadcast_in_dim(labels, s.shape, [0])
          g = dlogits(
            s,
            dcap,
            per_row(0),
            per_row(1),
            per_row(2) if label_term else None,
            per_row(3) if uniform_term else None,
            hit,
          )
          write_tile(g, lambda g_sub: (g_sub,), [g_gmem.at[m_slice, n_slice]], out_smem.at[wg])
          if db_gmem is not None:
            # write_tile waited for every earlier store, the last tile's column sums included.
            db_smem.at[wg][...] = g.sum(axis=0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(db_smem.at[wg], db_gmem.at[mi, n_slice])

      pipeline(half_tile_mma(wg, t.tile_n), compute_context)(
        x_gmem.at[m_slice, :],
        w_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
        allocations=pipeline_allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check(x, w, b, labels, rows):
  (tokens, d), v = x.shape, w.shape[1]
  if w.shape[0] != d or x.dtype != w.dtype:
    raise ValueError(f"pallas_kernels.lce_mosaic_bwd: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
  if (
    labels.shape != (tokens,)
    or rows.shape != (_ROWS, tokens)
    or (b is not None and b.shape != (v,))
  ):
    raise ValueError(
      f"pallas_kernels.lce_mosaic_bwd: labels {labels.shape}, rows {rows.shape} and b "
      f"{None if b is None else b.shape} do not fit x {x.shape} and w {w.shape} (rows: "
      f"({_ROWS}, tokens))"
    )


def lce_bwd(
  x: Array,
  w: Array,
  b: Array | None,
  labels: Array,
  rows: Array,
  *,
  soft_cap: float | None,
  label_term: bool,
  uniform_term: bool,
  tiles: HopperTiles | None = None,
  num_sms: int = 132,
  interpret: Any = False,
) -> tuple[Array, Array | None]:
  """``(G, db_partial)`` of a block of vocabulary columns.

  `x` ``(T, D)`` and `w` ``(D, Vb)`` of one 16-bit dtype, `b` ``(Vb,)`` (float32) or None,
  `labels` ``(T,)`` int32 relative to `w`'s first column, `rows` ``(4, T)`` float32: each row's
  largest logit, ``p_scale`` (``g (1 + 2 k lse) / sum exp(s - max)``, 0 where no logit is
  finite), ``label_scale``, ``uniform_scale``; the last two are read only when `label_term` /
  `uniform_term`. Returns ``G`` ``(T, Vb)`` in x's dtype and, with a bias, ``(T / tile_m, Vb)``
  float32 column sums of the unrounded ``G`` (None without). `num_sms`: one persistent CTA each;
  `interpret`: False, True or a ``plgpu.InterpretGPUParams``. Raises ValueError for what
  :func:`lce_bwd_unsupported` refuses.
  """
  _check(x, w, b, labels, rows)
  (tokens, d), v = x.shape, w.shape[1]
  t = tiles or lce_bwd_tiles((tokens, d, v), x.dtype)
  why = lce_bwd_unsupported((tokens, d, v), x.dtype, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.lce_mosaic_bwd: {why}")
  with_bias = b is not None
  args = [x, w] + ([b.astype(jnp.float32)] if with_bias else [])
  args += [labels.astype(jnp.int32), rows.astype(jnp.float32)]
  out_type = [jax.ShapeDtypeStruct((tokens, v), x.dtype)]
  if with_bias:
    out_type.append(jax.ShapeDtypeStruct((tokens // t.tile_m, v), jnp.float32))

  def body(x_ref, w_ref, *refs):
    b_ref = refs[0] if with_bias else None
    labels_ref, rows_ref, g_ref = refs[with_bias : with_bias + 3]
    db_ref = refs[-1] if with_bias else None
    _bwd_kernel(
      x_ref,
      w_ref,
      b_ref,
      labels_ref,
      rows_ref,
      g_ref,
      db_ref,
      t=t,
      terms=(soft_cap, label_term, uniform_term),
    )

  kernel = launch(body, tuple(out_type), interpret=interpret, num_sms=num_sms)
  outs = kernel(*args)
  return outs[0], outs[1] if with_bias else None


def lce_bwd_reference(
  x: Array,
  w: Array,
  b: Array | None,
  labels: Array,
  rows: Array,
  *,
  soft_cap: float | None,
  label_term: bool,
  uniform_term: bool,
  tile_m: int = 128,
) -> tuple[Array, Array | None]:
  """What :func:`lce_bwd` computes, in plain jnp (float32 accumulation): the tests' oracle."""
  _check(x, w, b, labels, rows)
  z = jnp.dot(x, w, preferred_element_type=jnp.float32)
  if b is not None:
    z = z + b.astype(jnp.float32)[None, :]
  s, dcap = _capped(z, soft_cap)
  r = rows.astype(jnp.float32)[:, :, None]
  hit = jnp.arange(w.shape[1])[None, :] == labels[:, None]
  g = dlogits(
    s, dcap, r[0], r[1], r[2] if label_term else None, r[3] if uniform_term else None, hit
  )
  db = None
  if b is not None:
    db = g.reshape(x.shape[0] // tile_m, tile_m, -1).sum(1)
  return g.astype(x.dtype), db
