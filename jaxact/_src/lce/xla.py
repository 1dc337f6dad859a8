"""The XLA path of :func:`jaxact.linear_cross_entropy`: the loss's statistics and gradients on one
device's tokens and columns, blocked so that no (tokens, vocabulary) array exists.

It blocks over the vocabulary (:func:`stats_by_vocab`, :func:`grads_by_vocab`): a
``fori_loop`` over column blocks of ``w`` with an online log-sum-exp; ``dw`` and ``db`` are written
block by block into their output buffers, each block from one matmul over all tokens, so no
weight-sized float32 accumulator exists; ``dx`` accumulates in a (tokens, D) one. Blocking over
tokens instead (:func:`stats_by_tokens`, :func:`grads_by_tokens`, measured in the benchmarks)
needs a weight-sized accumulator for ``dw``. The math of one tile, and the per-token formulas
(the statistics kept apart, no infinity made from finite operands), is
:mod:`jaxact._src.lce.xla_tiles`.

With ``decision.backward == "mosaic"`` the Hopper kernel forms each block's ``G``
(:mod:`jaxact._src.lce.kernels`) for the same loop's products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.lce import kernels
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.xla_tiles import (
  capped,
  grad_scale,
  input_grad,
  logits,
  lowest,
  merge,
  merge_argmax,
  tile_argmax,
  tile_grad,
  tile_stats,
  weight_grad,
)

# ---------------------------------------------------------------- blocked over the vocabulary


def column_block(plan: LcePlan, w, b, j, vocab_here):
  """Block `j` of `w`'s columns (rows for ``"vd"``) and `b`'s: the last block ends at the last
  column and overlaps its predecessor when the block does not divide the vocabulary; `fresh`
  marks the columns no earlier block had (None when every block is whole)."""
  bv = min(plan.block, vocab_here)
  start = jnp.minimum(j * bv, vocab_here - bv)
  wj = lax.dynamic_slice_in_dim(w, start, bv, axis=plan.vocab_axis)
  bj = None if b is None else lax.dynamic_slice_in_dim(b, start, bv, axis=0)
  cols = start + jnp.arange(bv)
  fresh = None if vocab_here % bv == 0 else cols >= j * bv
  return start, wj, bj, cols, fresh


def loop(n: int, body, init):
  """``fori_loop(0, n, body, init)``, unrolled when there is one step."""
  return body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)


def _no_argmax(t: int, acc) -> tuple[Array, Array]:
  """The running argmax before any column: column -1, which any tile's replaces."""
  return jnp.zeros((t,), acc), jnp.full((t,), -1, jnp.int32)


def stats_by_vocab(plan: LcePlan, x, w, b, labels, vocab: int):
  """``(max, sum, label logit, gap, argmax, moment)`` per token of ``x @ w + b`` over `w`'s
  columns, for tokens ``x`` (T, D) and `labels` (T,) relative to `w`'s first column; `vocab` is
  the whole vocabulary (the mean's divisor). ``gap`` is :func:`tile_stats`'s ``(gap, count)``
  pair, None without smoothing; ``argmax`` (the running ``(max, column)`` of the capped logits)
  None unless ``plan.predictions``; ``moment`` (``Σ exp(s - max) (s - max)``, the entropy's) None
  unless ``plan.entropy``."""
  vocab_here = w.shape[plan.vocab_axis]
  n = -(-vocab_here // min(plan.block, vocab_here))
  acc, t = plan.acc_dtype, x.shape[0]

  def body(j, carry):
    m, se, sy, gap, best, moment = carry
    _, wj, bj, cols, fresh = column_block(plan, w, b, j, vocab_here)
    s, _ = capped(plan, logits(plan, x, wj, bj))
    tm, tse, tsy, tgap, tmoment = tile_stats(plan, s, labels, cols, fresh, vocab, bj)
    m, se, gap, moment = merge(plan, (m, se, gap, moment), (tm, tse, tgap, tmoment), vocab)
    if best is not None:
      best = merge_argmax(best, tile_argmax(s, cols))
    return m, se, sy + tsy, gap, best, moment

  zeros = jnp.zeros((t,), acc)
  init = (
    jnp.full((t,), lowest(acc), acc),
    zeros,
    zeros,
    (zeros, zeros) if plan.label_smoothing else None,
    _no_argmax(t, acc) if plan.predictions else None,
    zeros if plan.entropy else None,
  )
  return loop(n, body, init)


def grads_by_vocab(plan: LcePlan, x, w, b, labels, m, row_scales):
  """``(dx, dw, db)`` over `w`'s column blocks, from the rows' max `m` and the per-token factors
  of :func:`~jaxact._src.lce.xla_tiles.scales`: `dw` and `db` written block by block, each block
  from one product over all tokens; `dx` accumulated in the accumulation dtype."""
  vocab_here = w.shape[plan.vocab_axis]
  n = -(-vocab_here // min(plan.block, vocab_here))
  acc = plan.acc_dtype
  ops = x.dtype  # G is rounded to the operands' dtype for the products, as autodiff would feed them

  def xla_block(x, wj, bj, labels, cols, fresh, m=m, row_scales=row_scales):
    """``(G, G for dx, column sums of G)``: G unrounded; an overlapped column's G goes to dw
    and db again (rewritten with the same value), to dx once."""
    s, dcap = capped(plan, logits(plan, x, wj, bj))
    g = tile_grad(plan, s, dcap, labels, cols, m, row_scales, acc)
    g_dx = g if fresh is None else jnp.where(fresh[None, :], g, 0)
    return g, g_dx, None if bj is None else jnp.sum(g, 0)

  if plan.decision.backward == "mosaic":  # every block whole, no entropy (rules.mosaic_unsupported)
    zero = jnp.zeros_like(m)
    kernel_rows = jnp.stack([m] + [zero if r is None else r for r in row_scales[:3]])

    def block_grads(x, wj, bj, labels, cols, fresh):
      def xla(x, wj, bj, labels_j, rows):
        scales_j = tuple(None if r is None else rows[i + 1] for i, r in enumerate(row_scales[:3]))
        scales_j = (*scales_j, None)
        cols_j = jnp.arange(wj.shape[plan.vocab_axis])
        g, _, db = xla_block(x, wj, bj, labels_j, cols_j, None, rows[0], scales_j)
        return g.astype(ops), db

      g, db = kernels.backward(plan, x, wj, bj, labels - cols[0], kernel_rows, xla)
      return g, g, db
  else:
    block_grads = xla_block

  def body(j, carry):
    start, wj, bj, cols, fresh = column_block(plan, w, b, j, vocab_here)
    g, g_dx, db_j = block_grads(x, wj, bj, labels, cols, fresh)
    return add_block_grads(plan, x, wj, start, g, g_dx, db_j, carry)

  return finish_grads(plan, x, loop(n, body, zero_grads(plan, x, w, b)))


def finish_grads(plan: LcePlan, x, grads):
  """``(dx, dw, db)`` after the last block: dx, summed unscaled in the accumulation dtype, times
  the temperature's ``1 / T`` (:func:`~jaxact._src.lce.xla_tiles.grad_scale`), in x's dtype."""
  dx, dw, db = grads
  return grad_scale(plan, dx).astype(x.dtype), dw, db


def zero_grads(plan: LcePlan, x, w, b):
  """``(dx, dw, db)`` before any block: dx in the accumulation dtype, dw and db in theirs."""
  return (
    jnp.zeros(x.shape, plan.acc_dtype),
    jnp.zeros_like(w),
    None if b is None else jnp.zeros_like(b),
  )


def add_block_grads(plan: LcePlan, x, wj, start, g, g_dx, db_j, carry):
  """One column block's share of ``(dx, dw, db)`` from its logit gradient: ``g_dx @ wjᵀ`` added to
  dx, ``xᵀ g`` and the column sums `db_j` written into dw's and db's columns from `start` (an
  overlapped column is rewritten with the same value), G rounded to the operands' dtype for the
  products, as autodiff would feed them. dw's and db's columns are times the temperature's
  ``1 / T`` here; dx is, once, by :func:`finish_grads`."""
  dx, dw, db = carry
  ops = x.dtype
  dx = dx + input_grad(plan, g_dx.astype(ops), wj)
  dwj = grad_scale(plan, weight_grad(plan, x, g.astype(ops)))
  dw = lax.dynamic_update_slice_in_dim(dw, dwj.astype(dw.dtype), start, axis=plan.vocab_axis)
  if db is not None:
    db_j = grad_scale(plan, db_j)
    db = lax.dynamic_update_slice_in_dim(db, db_j.astype(db.dtype), start, axis=0)
  return dx, dw, db


# --------------------------------------------------------------------- blocked over tokens


def _row_block(plan: LcePlan, t: int, i):
  bt = min(plan.block, t)
  start = jnp.minimum(i * bt, t - bt)
  fresh = None if t % bt == 0 else (start + jnp.arange(bt)) >= i * bt
  return bt, start, fresh


def stats_by_tokens(plan: LcePlan, x, w, b, labels, vocab: int):
  """:func:`stats_by_vocab`'s statistics computed a block of tokens at a time, each block
  against every column (a (block, V) logits temporary)."""
  t = x.shape[0]
  n = -(-t // min(plan.block, t))
  cols = jnp.arange(w.shape[plan.vocab_axis])

  def body(i, carry):
    bt, start, _ = _row_block(plan, t, i)
    xi = lax.dynamic_slice_in_dim(x, start, bt, axis=0)
    li = lax.dynamic_slice_in_dim(labels, start, bt, axis=0)
    s, _ = capped(plan, logits(plan, xi, w, b))
    best = tile_argmax(s, cols) if plan.predictions else None
    m, se, sy, gap, moment = tile_stats(plan, s, li, cols, None, vocab, b)
    stats = (m, se, sy, gap, best, moment)
    # Rows a block shares with its predecessor get the same values again.
    return jax.tree.map(
      lambda c, v: lax.dynamic_update_slice_in_dim(c, v, start, axis=0), carry, stats
    )

  zeros = jnp.zeros((t,), plan.acc_dtype)
  init = (
    zeros,
    zeros,
    zeros,
    (zeros, zeros) if plan.label_smoothing else None,
    _no_argmax(t, plan.acc_dtype) if plan.predictions else None,
    zeros if plan.entropy else None,
  )
  return loop(n, body, init)


def grads_by_tokens(plan: LcePlan, x, w, b, labels, m, row_scales):
  """``(dx, dw, db)`` a block of tokens at a time: `dx` written block by block, `dw` and `db`
  accumulated in weight-sized buffers of the accumulation dtype."""
  t = x.shape[0]
  n = -(-t // min(plan.block, t))
  acc, ops = plan.acc_dtype, x.dtype
  cols = jnp.arange(w.shape[plan.vocab_axis])

  def body(i, carry):
    dx, dw, db = carry
    bt, start, fresh = _row_block(plan, t, i)

    def rows(a):
      return None if a is None else lax.dynamic_slice_in_dim(a, start, bt, axis=0)

    xi, li = rows(x), rows(labels)
    s, dcap = capped(plan, logits(plan, xi, w, b))
    g = tile_grad(plan, s, dcap, li, cols, rows(m), tuple(map(rows, row_scales)), acc)
    dxi = grad_scale(plan, input_grad(plan, g.astype(ops), w))
    dx = lax.dynamic_update_slice_in_dim(dx, dxi.astype(dx.dtype), start, axis=0)
    g_w = g if fresh is None else jnp.where(fresh[:, None], g, 0)  # each row once into dw, db
    dw = dw + weight_grad(plan, xi, g_w.astype(ops))
    if db is not None:
      db = db + jnp.sum(g_w, 0)
    return dx, dw, db

  init = (
    jnp.zeros_like(x),
    jnp.zeros(w.shape, acc),
    None if b is None else jnp.zeros(b.shape, acc),
  )
  dx, dw, db = loop(n, body, init)
  dw, db = grad_scale(plan, dw), None if db is None else grad_scale(plan, db)
  return dx, dw.astype(w.dtype), None if db is None else db.astype(b.dtype)
