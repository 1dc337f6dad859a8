"""The forward of the fused linear cross-entropy on Hopper GPUs (Mosaic GPU): per-token statistics
of the logits ``z = x @ w + b`` with no logits tile ever written to global memory.

For each token, with ``s = c * tanh(z / c)`` under a soft cap ``c`` (else ``s = z``; a ``z`` of
``-inf``, a masked vocabulary entry, stays ``-inf``):

* ``max_v s`` and ``sum_v exp(s - max)`` (online over the vocabulary: a running maximum and a
  rescaled sum), which the caller keeps apart (one float32 log-sum-exp loses the sum next to
  logits of -1e9); the maximum starts at, and never drops below, float32's lowest finite value, so
  a row whose every logit is ``-inf`` has a finite maximum and a sum of 0;
* ``s[label]`` (0 for a label outside ``[0, V)``);
* for label smoothing, ``sum_v (max - s) / V`` over the finite ``s`` (how far their mean lies
  below the max; each term divided by ``V``, so that no sum can overflow) and their count, kept
  relative to the running max as the sum is (summed from logits of -1e9, the mean itself would
  round away the loss).

Layout, as :mod:`pallas_kernels.dense_mosaic`'s forward: a CTA owns ``tile_m`` tokens and walks the
whole vocabulary in steps of ``2 * tile_n`` columns; for each step a memory warpgroup streams
``x`` and ``w`` tiles through a ring of ``stages`` shared-memory buffers (TMA,
``plgpu.emit_pipeline_warp_specialized``) and two compute warpgroups each accumulate a
``tile_m x tile_n`` logits tile by wgmma in registers, then fold it into their running row
statistics, kept in shared memory between steps (a compute warpgroup cannot carry registers
across the pipeline's calls). Each warpgroup writes its statistics for its half of the columns at
the end; :func:`lce_fwd` merges the two halves (five float32 numbers a token). Persistent: one CTA
an SM walks the token tiles.

The backward pass's softmax-minus-one-hot tiles are :mod:`pallas_kernels.lce_mosaic_bwd`'s; it
recomputes the logits in float32 from the same bf16/f16 operands, so its probabilities use these
statistics to float32 rounding.
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
  half_tile_mma,
  launch,
  pipeline_allocations,
  pl,
  plgpu,
  xw_pipeline,
)

# running max, rescaled sum of exp, label logit; sum of (max - s) / V and count of the finite s
_STATS = 5
_LOWEST = float(np.finfo(np.float32).min)  # the running max before any column


@dataclasses.dataclass(frozen=True)
class LceTiles:
  """Tiling of the forward kernel.

  Attributes:
    tile_m: tokens a CTA (both compute warpgroups); tile_n: vocabulary columns a compute warpgroup
      a step (a CTA's step covers ``2 * tile_n``); tile_k: contraction a pipeline stage;
    stages: the pipeline's depth.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4

  def smem_bytes(self, itemsize: int) -> int:
    ring = self.stages * (self.tile_m + 2 * self.tile_n) * self.tile_k * itemsize
    stats = 2 * _STATS * self.tile_m * 4 + 2 * self.tile_m * 4  # statistics, labels
    return ring + stats + 2 * self.tile_n * 4 + 1024  # bias tiles; barriers and alignment


def default_lce_tiles(shape: tuple[int, int, int], dtype) -> LceTiles:
  """Tiles for ``(T, D, V)``: the Hopper forward's 128 x 256 CTA tile, 64-deep stages.

  A compute warpgroup's 128 x 128 float32 accumulator is 128 registers a thread, as in the dense
  forward; a stage of x and w tiles is (128 + 256) x 64 x 2 B = 48 KiB, so four stages (192 KiB)
  fit the 227 KiB of shared memory beside the statistics (6 KiB) with no output tiles to stage
  (the kernel writes five numbers a token). Smaller shapes (tests) shrink nothing: shapes that
  the tiles do not divide are refused (:func:`lce_unsupported`).
  """
  del shape
  t = LceTiles()
  return t if t.smem_bytes(np.dtype(dtype).itemsize) <= HOPPER_SMEM else LceTiles(stages=3)


def lce_unsupported(
  shape: tuple[int, int, int], dtype, tiles: LceTiles | None = None
) -> str | None:
  """Why the kernel cannot compute ``(T, D, V)`` statistics of `dtype` operands, or None."""
  t_, d, v = shape
  t = tiles or default_lce_tiles(shape, dtype)
  if np.dtype(dtype) not in HALF:
    return f"operand dtype {np.dtype(dtype).name} (the Hopper kernel takes bfloat16 or float16)"
  for name, n, step in (("tokens", t_, t.tile_m), ("V", v, 2 * t.tile_n), ("D", d, t.tile_k)):
    if n % step:
      return f"{name}={n} is not a multiple of {step} (the Hopper kernel's tile)"
  if t.smem_bytes(np.dtype(dtype).itemsize) > HOPPER_SMEM:
    return f"tiles {t} need more shared memory than Hopper's {HOPPER_SMEM // 1024} KiB"
  return None


def _capped(z, soft_cap):
  if soft_cap is None:
    return z
  return jnp.where(z == -jnp.inf, -jnp.inf, soft_cap * jnp.tanh(z * (1.0 / soft_cap)))


def _fwd_kernel(x_gmem, w_gmem, b_gmem, labels_gmem, stats_gmem, *, t: LceTiles, soft_cap, mean):
  tokens, d = x_gmem.shape
  vocab = w_gmem.shape[1]
  cta_n = 2 * t.tile_n
  m_iters, n_iters, k_iters = tokens // t.tile_m, vocab // cta_n, d // t.tile_k
  row = plgpu.Layout.WGMMA.reduce(1)

  pipeline = xw_pipeline(t, k_iters, x_gmem.dtype)

  scratch = dict(
    pipeline_allocs=pipeline_allocations(pipeline, x_gmem, w_gmem),
    stats_smem=plgpu.SMEM((2, _STATS, t.tile_m), jnp.float32),
    labels_smem=plgpu.SMEM((2, t.tile_m), jnp.int32),
    labels_barrier=plgpu.Barrier(num_barriers=2),
    bias_smem=None if b_gmem is None else plgpu.SMEM((2, t.tile_n), jnp.float32),
    bias_barrier=None if b_gmem is None else plgpu.Barrier(num_barriers=2),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(pipeline_allocs, stats_smem, labels_smem, labels_barrier, bias_smem, bias_barrier):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters,), collective_axes="sm")
    def _token_loop(info):
      (mi,) = info.index
      m_slice = pl.ds(mi * t.tile_m, t.tile_m)

      @pl.loop(0, n_iters)
      def _vocab_loop(ni):
        col0 = ni * cta_n + wg * t.tile_n  # this warpgroup's first column
        n_slice = pl.ds(col0, t.tile_n)
        first, last = ni == 0, ni == n_iters - 1

        def compute_context(run_pipeline):
          @pl.when(first)
          def _():
            plgpu.copy_gmem_to_smem(
              labels_gmem.at[m_slice], labels_smem.at[wg], labels_barrier.at[wg]
            )

          if b_gmem is not None:  # lands while the main loop runs
            plgpu.copy_gmem_to_smem(b_gmem.at[n_slice], bias_smem.at[wg], bias_barrier.at[wg])

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
          def _acc_scope(acc_ref):
            run_pipeline(acc_ref)
            z = acc_ref[...]
            if b_gmem is not None:
              plgpu.barrier_wait(bias_barrier.at[wg])
              bias = plgpu.load(bias_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
              z = z + lax.broadcast_in_dim(bias, z.shape, [1])
            s = _capped(z, soft_cap)

            @pl.when(first)
            def _():
              plgpu.barrier_wait(labels_barrier.at[wg])

            # The previous token tile's statistics must have left shared memory (TMA store).
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(first)  # a new token tile: statistics of no column yet
            def _():
              for i, v in enumerate((_LOWEST, 0.0, 0.0, 0.0, 0.0)):
                fill = jnp.full((t.tile_m,), v, jnp.float32)
                stats_smem.at[wg, i][...] = plgpu.layout_cast(fill, row)

            m_prev, se_prev, sy_prev, gap_prev, count_prev = (
              plgpu.load(stats_smem.at[wg, i], layout=row) for i in range(_STATS)
            )

            m_new = jnp.maximum(m_prev, s.max(axis=1))  # finite: m_prev starts at _LOWEST
            shifted = s - lax.broadcast_in_dim(m_new, s.shape, [0])  # <= 0; -inf where masked
            se = se_prev * jnp.exp(m_prev - m_new) + jnp.exp(shifted).sum(axis=1)
            labels = plgpu.load(labels_smem.at[wg], layout=row)
            cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            hit = cols + col0 == lax.broadcast_in_dim(labels, s.shape, [0])
            sy = sy_prev + jnp.where(hit, s, 0.0).sum(axis=1)
            new = [m_new, se, sy, gap_prev, count_prev]
            if mean:
              finite = s > -jnp.inf
              # the earlier columns' gap measured from the new max (by halves: no overflow)
              lifted = gap_prev + count_prev * (1.0 / vocab) * (m_new * 0.5 - m_prev * 0.5) * 2.0
              below = jnp.where(finite, shifted * (-1.0 / vocab), 0.0)
              new[3] = lifted + below.sum(axis=1)
              one, zero = jnp.float32(1), jnp.float32(0)
              new[4] = count_prev + jnp.where(finite, one, zero).sum(axis=1)
            for i, v in enumerate(new):
              stats_smem.at[wg, i][...] = v

            @pl.when(last)
            def _():
              plgpu.commit_smem()
              for i in range(_STATS):
                plgpu.copy_smem_to_gmem(stats_smem.at[wg, i], stats_gmem.at[wg, i, m_slice])

        pipeline(half_tile_mma(wg, t.tile_n), compute_context)(
          x_gmem.at[m_slice, :],
          w_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
          allocations=pipeline_allocs,
        )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def lce_fwd(
  x: Array,
  w: Array,
  b: Array | None,
  labels: Array,
  *,
  soft_cap: float | None,
  want_mean: bool,
  tiles: LceTiles | None = None,
  num_sms: int = 132,
  interpret: Any = False,
) -> tuple[Array, Array, Array, Array | None]:
  """``(max, sum, label_logit, mean_gap)``, each float32 ``(T,)``, of ``s`` (``z = x @ w + b``,
  capped): each row's largest logit, ``sum_v exp(s - max)``, ``s[label]`` and ``max - mean``
  (the mean ``sum_v s / V`` over the finite ``s``, summed relative to the max).

  `x` ``(T, D)`` and `w` ``(D, V)`` of one 16-bit dtype, `b` ``(V,)`` float32 or None, `labels`
  ``(T,)`` int32. For a token whose every logit is ``-inf``, ``max`` is float32's lowest finite
  value and ``sum`` 0; ``label_logit`` is 0 for a label outside ``[0, V)``; ``mean_gap`` is None
  unless `want_mean`. `num_sms`: one persistent CTA each. `interpret`: False, True or a
  ``plgpu.InterpretGPUParams`` (Mosaic GPU's interpreter, one CTA). Raises ValueError for what
  :func:`lce_unsupported` refuses.
  """
  (tokens, d), v = x.shape, w.shape[1]
  if w.shape[0] != d or x.dtype != w.dtype:
    raise ValueError(f"pallas_kernels.lce_mosaic: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
  if labels.shape != (tokens,) or (b is not None and b.shape != (v,)):
    raise ValueError(
      f"pallas_kernels.lce_mosaic: labels {labels.shape} / b {None if b is None else b.shape} "
      f"do not fit x {x.shape} and w {w.shape}"
    )
  t = tiles or default_lce_tiles((tokens, d, v), x.dtype)
  why = lce_unsupported((tokens, d, v), x.dtype, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.lce_mosaic: {why}")
  args = [x, w] + ([] if b is None else [b.astype(jnp.float32)]) + [labels.astype(jnp.int32)]

  def body(x_ref, w_ref, *refs):
    b_ref = refs[0] if b is not None else None
    labels_ref, stats_ref = refs[-2:]
    _fwd_kernel(x_ref, w_ref, b_ref, labels_ref, stats_ref, t=t, soft_cap=soft_cap, mean=want_mean)

  out_type = jax.ShapeDtypeStruct((2, _STATS, tokens), jnp.float32)
  kernel = launch(body, out_type, interpret=interpret, num_sms=num_sms)
  stats = kernel(*args)
  return merge_halves(stats, want_mean, v)


def merge_halves(
  stats: Array, want_mean: bool, vocab: int
) -> tuple[Array, Array, Array, Array | None]:
  """The two compute warpgroups' ``(2, 5, T)`` statistics as ``(max, sum, label logit, gap)``."""
  m, se, sy, gap, count = (stats[:, i] for i in range(_STATS))
  top = jnp.max(m, 0, keepdims=True)
  # m - top by halves: the difference of two finite floats may overflow (m/2 - top/2 cannot).
  half = m / 2 - top / 2
  total = jnp.sum(se * jnp.exp(2 * jnp.maximum(half, -1e4)), 0)
  top = top[0]
  if want_mean:  # max - mean: the masked logits count as 0 in the mean
    masked = vocab - jnp.sum(count, 0)  # exact: 1 - count / V in a multiply-add is not
    gap = jnp.sum(gap - count / vocab * half * 2, 0) + masked / vocab * top
  return top, total, jnp.sum(sy, 0), gap if want_mean else None


def lce_reference(
  x: Array, w: Array, b: Array | None, labels: Array, *, soft_cap: float | None, want_mean: bool
) -> tuple[Array, Array, Array, Array | None]:
  """What :func:`lce_fwd` computes, in plain jnp (float32 accumulation): the tests' oracle."""
  z = jnp.dot(x, w, preferred_element_type=jnp.float32)
  if b is not None:
    z = z + b.astype(jnp.float32)[None, :]
  s = _capped(z, soft_cap)
  top = jnp.maximum(jnp.max(s, 1, keepdims=True), _LOWEST)
  total = jnp.sum(jnp.exp(s - top), 1)
  v = w.shape[1]
  inside = (labels >= 0) & (labels < v)
  sy = jnp.where(inside, jnp.take_along_axis(s, jnp.clip(labels, 0, v - 1)[:, None], 1)[:, 0], 0.0)
  finite = s > -jnp.inf
  masked = v - jnp.sum(finite, 1, dtype=jnp.float32)
  gap = jnp.sum(jnp.where(finite, (top - s) / v, 0.0), 1) + masked / v * top[:, 0]
  return top[:, 0], total, sy, gap if want_mean else None
