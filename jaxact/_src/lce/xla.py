"""The XLA path of :func:`jaxact.linear_cross_entropy`: the loss's statistics and gradients on one
device's tokens and columns, blocked so that no (tokens, vocabulary) array exists.

It blocks over the vocabulary (:func:`stats_by_vocab`, :func:`grads_by_vocab`): a
``fori_loop`` over column blocks of ``w`` with an online log-sum-exp; ``dw`` and ``db`` are written
block by block into their output buffers, each block from one matmul over all tokens, so no
weight-sized float32 accumulator exists; ``dx`` accumulates in a (tokens, D) one. Blocking over
tokens instead (:func:`stats_by_tokens`, :func:`grads_by_tokens`, measured in the benchmarks)
needs a weight-sized accumulator for ``dw``.

With ``decision.backward == "mosaic"`` the Hopper kernel forms each block's ``G``
(:mod:`jaxact._src.lce.kernels`) for the same loop's products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.lce import kernels
from jaxact._src.lce.plan import LcePlan

# ------------------------------------------------------------------------------ tile math


def _logits(plan: LcePlan, x: Array, w: Array, b: Array | None) -> Array:
  """``x @ w + b`` in the accumulation dtype. The forward and the backward pass both call this one
  function on the same blocks, so the backward's logits are the forward's."""
  dims = (((x.ndim - 1,), (1 - plan.vocab_axis,)), ((), ()))
  z = lax.dot_general(x, w, dims, plan.precision, preferred_element_type=plan.acc_dtype)
  return z if b is None else z + b.astype(plan.acc_dtype)


def _input_grad(plan: LcePlan, g: Array, w: Array) -> Array:
  """``g @ wᵀ`` (``g`` (T, Vb) against a block of ``w``'s columns, or rows for ``"vd"``) in the
  accumulation dtype."""
  dims = (((1,), (plan.vocab_axis,)), ((), ()))
  return lax.dot_general(g, w, dims, plan.precision, preferred_element_type=plan.acc_dtype)


def _weight_grad(plan: LcePlan, x: Array, g: Array) -> Array:
  """``xᵀ g`` in ``w``'s layout: (D, Vb), or (Vb, D) for ``"vd"``; accumulation dtype."""
  dims = (((0,), (0,)), ((), ()))
  acc = plan.acc_dtype
  if plan.w_layout == "vd":
    return lax.dot_general(g, x, dims, plan.precision, preferred_element_type=acc)
  return lax.dot_general(x, g, dims, plan.precision, preferred_element_type=acc)


def _capped(plan: LcePlan, z: Array) -> tuple[Array, Array | None]:
  """``(s, ds/dz)``: the soft-capped logits (-inf stays -inf) and their derivative (None without
  a cap; 0 at -inf)."""
  if plan.soft_cap is None:
    return z, None
  c = plan.soft_cap
  t = jnp.tanh(z / c)
  return jnp.where(z == -jnp.inf, z, c * t), 1 - t * t


def _tile_stats(plan: LcePlan, s: Array, labels: Array, cols: Array, fresh: Array | None, vocab):
  """One tile's ``(max, Σ exp(s - max), label logit, Σ s / V)`` per row, over its `fresh`
  columns (all when None); the max is 0 where a row has no finite logit, as :func:`_merge` wants."""
  hit = cols == labels[:, None]
  if fresh is not None:
    s, hit = jnp.where(fresh, s, -jnp.inf), hit & fresh
  m = jnp.max(s, axis=-1)
  m = jnp.where(m == -jnp.inf, 0, m)
  se = jnp.sum(jnp.exp(s - m[:, None]), axis=-1)
  sy = jnp.sum(jnp.where(hit, s, 0), axis=-1)
  mean = None
  if plan.label_smoothing:
    mean = jnp.sum(jnp.where(jnp.isfinite(s), s / vocab, 0), axis=-1)
  return m, se, sy, mean


def _merge(a, b):
  """Two ``(m, Σ exp(s - m))`` pairs as one: the online log-sum-exp step."""
  (ma, sa), (mb, sb) = a, b
  m = jnp.maximum(ma, mb)
  return m, sa * jnp.exp(ma - m) + sb * jnp.exp(mb - m)


def _tile_argmax(s: Array, cols: Array) -> tuple[Array, Array]:
  """``(max, its column)`` per row of a tile whose non-fresh columns are -inf: the column of
  ``jnp.argmax`` (the first of equal maxima, a NaN before any number)."""
  i = jnp.argmax(s, axis=-1)
  return jnp.take_along_axis(s, i[:, None], axis=-1)[:, 0], cols[i].astype(jnp.int32)


def _merge_argmax(best, tile):
  """The running ``(max, column)`` and a later tile's as one, as ``jnp.argmax`` over both: a
  later column wins only by a strictly larger value (or a NaN against a number)."""
  (bv, bi), (tv, ti) = best, tile
  later = (tv > bv) | (jnp.isnan(tv) & ~jnp.isnan(bv))
  return jnp.where(later, tv, bv), jnp.where(later, ti, bi)


def _add(p, q):
  return None if p is None else p + q


def lse_of(m: Array, se: Array) -> Array:
  """The log-sum-exp from :func:`_tile_stats`'s max and sum: -inf where no logit is finite."""
  return m + jnp.log(se)


def _tile_grad(plan: LcePlan, s, dcap, labels, cols, lse_inf, scales, vocab_dtype) -> Array:
  """``G`` of one tile from the per-row scales (:func:`scales`); `lse_inf` is the lse with -inf
  replaced by +inf, so that ``exp(s - lse_inf)`` is 0 on rows without a finite logit."""
  p_scale, label_scale, uniform_scale = scales
  g = p_scale[:, None] * jnp.exp(s - lse_inf[:, None])
  if label_scale is not None:
    g = g - jnp.where(cols == labels[:, None], label_scale[:, None], 0)
  if uniform_scale is not None:
    g = g - jnp.where(jnp.isfinite(s), uniform_scale[:, None], 0)
  if dcap is not None:
    g = g * dcap
  return g.astype(vocab_dtype)


def scales(plan: LcePlan, g: Array, lse: Array, labels: Array, vocab: int):
  """The per-token factors of ``G``: ``(g (1 + 2 k lse), g (1 - a) [label valid], g a / V)``
  (None where a term is absent); an lse of -inf counts as 0 in the first."""
  acc = plan.acc_dtype
  g = g.astype(acc)
  p_scale = g
  if plan.z_loss:
    p_scale = g * (1 + 2 * plan.z_loss * jnp.where(jnp.isfinite(lse), lse, 0))
  label_scale = None
  if plan.label_smoothing != 1:
    valid = (labels >= 0) & (labels < vocab)
    label_scale = jnp.where(valid, g * (1 - plan.label_smoothing), 0).astype(acc)
  uniform_scale = g * (plan.label_smoothing / vocab) if plan.label_smoothing else None
  return p_scale, label_scale, uniform_scale


def loss_of(plan: LcePlan, lse: Array, sy: Array, mean: Array | None, labels, vocab) -> Array:
  """The loss from the statistics: +inf where the label is outside ``[0, V)`` or no logit is
  finite; NaN where the logits hold a NaN (an lse of NaN)."""
  loss = lse
  if plan.label_smoothing != 1:
    loss = loss - (1 - plan.label_smoothing) * sy
  if mean is not None:
    loss = loss - plan.label_smoothing * mean
  if plan.z_loss:
    loss = loss + plan.z_loss * lse * lse
  if plan.loss_offset:
    loss = loss - plan.loss_offset
  valid = (labels >= 0) & (labels < vocab) & (lse != -jnp.inf)
  return jnp.where(valid, loss, jnp.inf)


# ---------------------------------------------------------------- blocked over the vocabulary


def _column_block(plan: LcePlan, w, b, j, vocab_here):
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


def _loop(n: int, body, init):
  """``fori_loop(0, n, body, init)``, unrolled when there is one step."""
  return body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)


def _no_argmax(t: int, acc) -> tuple[Array, Array]:
  """The running argmax before any column: ``jnp.argmax`` of a row of -inf is column 0."""
  return jnp.full((t,), -jnp.inf, acc), jnp.zeros((t,), jnp.int32)


def stats_by_vocab(plan: LcePlan, x, w, b, labels, vocab: int):
  """``(max, sum, label logit, mean, argmax)`` per token of ``x @ w + b`` over `w`'s columns,
  for tokens ``x`` (T, D) and `labels` (T,) relative to `w`'s first column; `vocab` is the whole
  vocabulary (the mean's divisor). ``mean`` is None without smoothing, ``argmax`` (the running
  ``(max, column)`` of the capped logits) None unless ``plan.predictions``."""
  vocab_here = w.shape[plan.vocab_axis]
  n = -(-vocab_here // min(plan.block, vocab_here))
  acc, t = plan.acc_dtype, x.shape[0]

  def body(j, carry):
    m, se, sy, mean, best = carry
    _, wj, bj, cols, fresh = _column_block(plan, w, b, j, vocab_here)
    s, _ = _capped(plan, _logits(plan, x, wj, bj))
    tm, tse, tsy, tmean = _tile_stats(plan, s, labels, cols, fresh, vocab)
    m, se = _merge((m, se), (tm, tse))
    if best is not None:
      best = _merge_argmax(
        best, _tile_argmax(s if fresh is None else jnp.where(fresh, s, -jnp.inf), cols)
      )
    return m, se, sy + tsy, _add(mean, tmean), best

  zeros = jnp.zeros((t,), acc)
  init = (
    jnp.full((t,), -jnp.inf, acc),
    zeros,
    zeros,
    zeros if plan.label_smoothing else None,
    _no_argmax(t, acc) if plan.predictions else None,
  )
  return _loop(n, body, init)


def grads_by_vocab(plan: LcePlan, x, w, b, labels, lse, row_scales):
  """``(dx, dw, db)`` over `w`'s column blocks: `dw` and `db` written block by block, each block
  from one product over all tokens; `dx` accumulated in the accumulation dtype."""
  vocab_here = w.shape[plan.vocab_axis]
  n = -(-vocab_here // min(plan.block, vocab_here))
  acc = plan.acc_dtype
  lse_inf = jnp.where(lse == -jnp.inf, jnp.inf, lse)
  ops = x.dtype  # G is rounded to the operands' dtype for the products, as autodiff would feed them

  def xla_block(x, wj, bj, labels, cols, fresh, lse_inf=lse_inf, row_scales=row_scales):
    """``(G, G for dx, column sums of G)``: G unrounded; an overlapped column's G goes to dw
    and db again (rewritten with the same value), to dx once."""
    s, dcap = _capped(plan, _logits(plan, x, wj, bj))
    g = _tile_grad(plan, s, dcap, labels, cols, lse_inf, row_scales, acc)
    g_dx = g if fresh is None else jnp.where(fresh, g, 0)
    return g, g_dx, None if bj is None else jnp.sum(g, 0)

  if plan.decision.backward == "mosaic":  # every block whole (rules.mosaic_unsupported)
    zero = jnp.zeros_like(lse_inf)
    kernel_rows = jnp.stack([lse_inf] + [zero if r is None else r for r in row_scales])

    def block_grads(x, wj, bj, labels, cols, fresh):
      def xla(x, wj, bj, labels_j, rows):
        scales_j = tuple(None if r is None else rows[i + 1] for i, r in enumerate(row_scales))
        cols_j = jnp.arange(wj.shape[plan.vocab_axis])
        g, _, db = xla_block(x, wj, bj, labels_j, cols_j, None, rows[0], scales_j)
        return g.astype(ops), db

      g, db = kernels.backward(plan, x, wj, bj, labels - cols[0], kernel_rows, xla)
      return g, g, db
  else:
    block_grads = xla_block

  def body(j, carry):
    dx, dw, db = carry
    start, wj, bj, cols, fresh = _column_block(plan, w, b, j, vocab_here)
    g, g_dx, db_j = block_grads(x, wj, bj, labels, cols, fresh)
    dx = dx + _input_grad(plan, g_dx.astype(ops), wj)
    dwj = _weight_grad(plan, x, g.astype(ops))
    dw = lax.dynamic_update_slice_in_dim(dw, dwj.astype(dw.dtype), start, axis=plan.vocab_axis)
    if db is not None:
      db = lax.dynamic_update_slice_in_dim(db, db_j.astype(db.dtype), start, axis=0)
    return dx, dw, db

  init = (
    jnp.zeros(x.shape, acc),
    jnp.zeros_like(w),
    None if b is None else jnp.zeros_like(b),
  )
  dx, dw, db = _loop(n, body, init)
  return dx.astype(x.dtype), dw, db


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
    s, _ = _capped(plan, _logits(plan, xi, w, b))
    best = _tile_argmax(s, cols) if plan.predictions else None
    stats = (*_tile_stats(plan, s, li, cols, None, vocab), best)
    # Rows a block shares with its predecessor get the same values again.
    return jax.tree.map(
      lambda c, v: lax.dynamic_update_slice_in_dim(c, v, start, axis=0), carry, stats
    )

  zeros = jnp.zeros((t,), plan.acc_dtype)
  init = (
    zeros,
    zeros,
    zeros,
    zeros if plan.label_smoothing else None,
    _no_argmax(t, plan.acc_dtype) if plan.predictions else None,
  )
  return _loop(n, body, init)


def grads_by_tokens(plan: LcePlan, x, w, b, labels, lse, row_scales):
  """``(dx, dw, db)`` a block of tokens at a time: `dx` written block by block, `dw` and `db`
  accumulated in weight-sized buffers of the accumulation dtype."""
  t = x.shape[0]
  n = -(-t // min(plan.block, t))
  acc, ops = plan.acc_dtype, x.dtype
  cols = jnp.arange(w.shape[plan.vocab_axis])
  lse_inf = jnp.where(lse == -jnp.inf, jnp.inf, lse)

  def body(i, carry):
    dx, dw, db = carry
    bt, start, fresh = _row_block(plan, t, i)

    def rows(a):
      return None if a is None else lax.dynamic_slice_in_dim(a, start, bt, axis=0)

    xi, li = rows(x), rows(labels)
    s, dcap = _capped(plan, _logits(plan, xi, w, b))
    g = _tile_grad(plan, s, dcap, li, cols, rows(lse_inf), tuple(map(rows, row_scales)), acc)
    dxi = _input_grad(plan, g.astype(ops), w)
    dx = lax.dynamic_update_slice_in_dim(dx, dxi.astype(dx.dtype), start, axis=0)
    g_w = g if fresh is None else jnp.where(fresh[:, None], g, 0)  # each row once into dw, db
    dw = dw + _weight_grad(plan, xi, g_w.astype(ops))
    if db is not None:
      db = db + jnp.sum(g_w, 0)
    return dx, dw, db

  init = (
    jnp.zeros_like(x),
    jnp.zeros(w.shape, acc),
    None if b is None else jnp.zeros(b.shape, acc),
  )
  dx, dw, db = _loop(n, body, init)
  return dx, dw.astype(w.dtype), None if db is None else db.astype(b.dtype)
