"""The ``custom_vjp`` of :func:`jaxact.linear_cross_entropy` and its XLA path.

Per token ``t``, with logits ``z = x_t @ w + b`` accumulated in float32 (float64 for float64
inputs), capped logits ``s = c tanh(z / c)`` (or ``s = z``), label smoothing ``a`` and z-loss
``k``, the op returns the per-token loss

    loss_t = lse_t - (1 - a) s[t, y_t] - a mean_v s[t, v] + k lse_t^2

and keeps ``x``, ``w``, ``b``, ``labels`` and ``lse_t`` (one number a token) for the backward
pass, which recomputes the logits block by block and forms

    G[t, v] = g_t ((1 + 2 k lse_t) p[t, v] - (1 - a) [v = y_t] - a / V) ds/dz,   p = softmax(s),

from the per-token cotangent ``g_t`` (whatever it is: the caller's reduction over tokens is JAX
code outside this rule), then ``dx = G wᵀ``, ``dw = xᵀ G``, ``db = Σ_t G``. No array of shape
(tokens, vocabulary) exists in either pass: the largest temporaries are one block of logits and
its ``G``.

T5X's label smoothing is optax's with ``a V / (V - 1)`` and a constant subtracted from every loss
(``loss_offset``: :func:`t5x_smoothing`); per-token weights multiply ``g_t`` outside this rule. With
``predictions`` the forward also returns each token's argmax column of ``s``, tracked in the same
loop (a running max and its column; across vocabulary shards a ``pmax`` and a ``pmin``). ``w`` is
(D, V), or (V, D) for ``w_layout="vd"`` (an embedding table, sliced by rows, its gradient written
by rows: no transposed copy).

Masked vocabulary entries (``z = -inf``, from a bias of -inf) stay ``-inf`` under the cap, count
neither in the smoothing mean nor in ``G``, and get zero gradients. A row whose every logit is
``-inf`` has ``lse = -inf`` and loss ``+inf`` (its label is impossible), as has a token whose
label is outside ``[0, V)``; their gradients stay finite, and zero where their cotangent is zero.

The XLA path blocks over the vocabulary (:func:`stats_by_vocab`, :func:`grads_by_vocab`): a
``fori_loop`` over column blocks of ``w`` with an online log-sum-exp; ``dw`` and ``db`` are written
block by block into their output buffers, each block from one matmul over all tokens, so no
weight-sized float32 accumulator exists; ``dx`` accumulates in a (tokens, D) one. Blocking over
tokens instead (:func:`stats_by_tokens`, :func:`grads_by_tokens`, measured in the benchmarks)
needs a weight-sized accumulator for ``dw``. Under Explicit mesh axes each device runs the loop
on its shards (:mod:`jaxact._src.core.pallas_sharding`'s dense pattern: tokens over data axes, the
vocabulary over model axes, as Megatron's vocab-parallel loss) and only per-token statistics,
``dx``, and for data-parallel ``dw`` and ``db`` are reduced across devices. A sharded contraction
dimension (an FSDP table, feature-sharded ``x``) is gathered on each device, ``x`` once in the
forward and kept so; ``dx`` and ``dw`` are reduce-scattered back to their primals' shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src.core import pallas_sharding, shardings
from jaxact._src.core.dispatch import Decision

_FLOAT32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class LcePlan:
  """Everything static about one call.

  Attributes:
    block: logits columns a block (``by="vocab"``) or tokens a block (``by="tokens"``).
    by: the axis the XLA path blocks over.
    label_smoothing, z_loss, soft_cap: the loss's options (``soft_cap`` None: no cap);
      ``label_smoothing`` is optax's ``a`` (T5X's ``a V / (V - 1)``: :func:`t5x_smoothing`), and
      may exceed 1 for T5X's.
    loss_offset: subtracted from every token's loss (T5X's normalizing constant).
    predictions: whether the forward pass also returns each token's argmax column.
    w_layout: ``"dv"`` for ``w`` of shape (D, V), ``"vd"`` for (V, D) (an embedding table, sliced
      by rows: no transposed copy).
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    acc_dtype: the logits', statistics' and loss's dtype: float32, or float64 for float64 inputs.
    decision: the backends of the forward and backward passes.
  """

  block: int
  by: Literal["vocab", "tokens"] = "vocab"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  soft_cap: float | None = None
  loss_offset: float = 0.0
  predictions: bool = False
  w_layout: Literal["dv", "vd"] = "dv"
  precision: Any = None
  acc_dtype: np.dtype = _FLOAT32
  decision: Decision = dataclasses.field(default_factory=Decision)
  shardings: tuple = (None, None, None)  # the specs of x, w, bias: their gradients' types

  @property
  def vocab_axis(self) -> int:
    """The axis of ``w`` that indexes the vocabulary."""
    return 1 if self.w_layout == "dv" else 0


def t5x_smoothing(alpha: float, vocab: int) -> tuple[float, float]:
  """``(optax's smoothing, T5X's normalizing constant)`` for T5X's label smoothing `alpha`.

  T5X's soft targets put ``1 - alpha`` on the label and ``alpha / (V - 1)`` on every other class;
  optax's put ``alpha / V`` everywhere on top of ``1 - alpha``. The two cross-entropies agree when
  optax's smoothing is ``alpha V / (V - 1)``; T5X then subtracts the targets' entropy (computed as
  T5X computes it, with its ``1e-20`` inside the second log), so that a prediction equal to the
  targets has loss 0."""
  if alpha == 0:
    return 0.0, 0.0
  confidence, low = 1.0 - alpha, alpha / (vocab - 1)
  entropy = -(vocab - 1) * low * math.log(low + 1e-20)
  if confidence > 0:
    entropy -= confidence * math.log(confidence)
  return alpha * vocab / (vocab - 1), entropy


# Bytes of one float32 block of logits the XLA path aims at. On CPU, 4096 tokens: blocks of 512
# columns (8 MiB) run as fast as 2048 (32 MiB) at V = 32768 and within 9% at 131072, for a
# quarter of the temp (benchmarks/results/lce.md); below 256 columns the matmuls slow down. On
# GPUs larger blocks amortize the loop's launches (not yet measured on one). Either way a block
# stays under an eighth of the logits.
_CPU_BLOCK_BYTES = 8 << 20
_GPU_BLOCK_BYTES = 256 << 20


def default_block(tokens: int, vocab: int, gpu: bool = False) -> int:
  """Columns a block for the vocabulary-blocked XLA path: a multiple of 128 near
  ``_*_BLOCK_BYTES / (4 * tokens)`` and at least 256, at most an eighth of the vocabulary
  (rounded up to 128), and the whole vocabulary when it is small."""
  budget = (_GPU_BLOCK_BYTES if gpu else _CPU_BLOCK_BYTES) // (4 * max(tokens, 1))
  block = max(256, budget // 128 * 128)
  block = min(block, max(128, -(-vocab // 8 // 128) * 128))
  return min(block, vocab)


def kernel_block(block: int, vocab: int, step: int = 256) -> int:
  """The Hopper backward kernel's block: the largest multiple of `step` (its CTA tile's columns)
  that divides `vocab` and is at most `block` (`step` when `block` is smaller)."""
  best = step
  for cols in range(step, min(block, vocab) + 1, step):
    if vocab % cols == 0:
      best = cols
  return best


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

  if plan.decision.backward == "mosaic":  # every block whole (dispatch.lce_mosaic_unsupported)
    from jaxact._src import kernel_calls

    zero = jnp.zeros_like(lse_inf)
    kernel_rows = jnp.stack([lse_inf] + [zero if r is None else r for r in row_scales])

    def block_grads(x, wj, bj, labels, cols, fresh):
      def xla(x, wj, bj, labels_j, rows):
        scales_j = tuple(None if r is None else rows[i + 1] for i, r in enumerate(row_scales))
        cols_j = jnp.arange(wj.shape[plan.vocab_axis])
        g, _, db = xla_block(x, wj, bj, labels_j, cols_j, None, rows[0], scales_j)
        return g.astype(ops), db

      g, db = kernel_calls.lce_backward(plan, x, wj, bj, labels - cols[0], kernel_rows, xla)
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


# ------------------------------------------------------------------------ per device (shards)


def _flat(x: Array, labels: Array) -> tuple[Array, Array]:
  """``x`` as (tokens, D) and the labels as (tokens,) (D may be 0)."""
  tokens = math.prod(labels.shape)
  return x.reshape(tokens, x.shape[-1]), labels.reshape(tokens)


def _local_stats(plan: LcePlan, x, w, b, labels, *, vocab: int, model: tuple[str, ...] = ()):
  """``(lse, label logit, mean, argmax column)`` for one device's tokens ``x`` (..., D) and
  columns `w`; over `model` axes (the vocabulary split across devices) the statistics are
  combined by ``pmax``/``psum``/``pmin`` of per-token numbers."""
  shape = x.shape[:-1]
  x2, labels2 = _flat(x, labels)
  first = 0  # the global index of this device's first column
  if model:
    first = lax.axis_index(model) * w.shape[plan.vocab_axis]
    labels2 = labels2 - first
  if plan.decision.forward == "mosaic":
    from jaxact._src import kernel_calls

    def xla(x, w, b, labels):
      m, se, sy, mean = stats_by_vocab(plan, x, w, b, labels, vocab)
      return lse_of(m, se), sy, mean

    # Never with the vocabulary split over `model` axes, nor with predictions
    # (dispatch.lce_mosaic_unsupported).
    lse, sy, mean = kernel_calls.lce_forward(plan, x2, w, b, labels2, xla)
    pred = None
  else:
    by = stats_by_vocab if plan.by == "vocab" else stats_by_tokens
    m, se, sy, mean, best = by(plan, x2, w, b, labels2, vocab)
    if model:
      m_all = lax.pmax(m, model)
      se = lax.psum(se * jnp.exp(m - m_all), model)
      m = m_all
    lse = lse_of(m, se)
    pred = None
    if best is not None:
      value, pred = best
      pred = pred + first
      if model:  # the first column of the largest value over the devices (NaN: as jnp.argmax)
        top = lax.pmax(jnp.where(jnp.isnan(value), jnp.inf, value), model)
        mine = (value == top) | (jnp.isnan(value) & (top == jnp.inf))
        pred = lax.pmin(jnp.where(mine, pred, vocab), model)
  if model:
    sy = lax.psum(sy, model)
    mean = None if mean is None else lax.psum(mean, model)
  return tuple(None if v is None else v.reshape(shape) for v in (lse, sy, mean, pred))


def _local_grads(
  plan: LcePlan,
  x,
  w,
  b,
  labels,
  lse,
  p_scale,
  label_scale,
  uniform_scale,
  *,
  model: tuple[str, ...] = (),
):
  """``(dx, dw, db)`` of one device's shards (dx still to be summed over `model`, dw and db over
  the data axes: :func:`pallas_sharding.per_shard` does it)."""
  x2, labels2 = _flat(x, labels)
  if model:
    labels2 = labels2 - lax.axis_index(model) * w.shape[plan.vocab_axis]

  def flat(v):
    return None if v is None else v.reshape(labels2.shape)

  row_scales = (flat(p_scale), flat(label_scale), flat(uniform_scale))
  # The Hopper kernel forms G block by block inside grads_by_vocab (plan.decision.backward).
  by = grads_by_vocab if plan.by == "vocab" else grads_by_tokens
  dx, dw, db = by(plan, x2, w, b, labels2, flat(lse), row_scales)
  return dx.reshape(x.shape), dw, db


def _sharding(plan: LcePlan, x: Array, w: Array):
  """The dense sharding pattern of ``x @ w`` (``x @ w.T`` for ``"vd"``; None unsharded), the
  contraction dimension whole on each device; raises for the patterns the loop cannot run per
  device."""
  found = pallas_sharding.dense_pattern(x, w, w_transposed=plan.w_layout == "vd", gather=True)
  if isinstance(found, str):
    raise NotImplementedError(
      f"jaxact.linear_cross_entropy: {found}; shard the tokens of `x` and the vocabulary of `w` "
      "over different mesh axes"
    )
  if found is None or not (found.data or found.model):
    return None
  return found


def _w_spec(plan: LcePlan, spec):
  """A (D, V) spec in `w`'s own layout."""
  return spec if plan.w_layout == "dv" else spec[::-1]


def _split(pattern, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The `axes` of more than one device (over one, the reductions would be collectives that do
  nothing)."""
  return tuple(a for a in axes if pattern.mesh.shape[a] > 1)


def gathered(plan: LcePlan, x, w):
  """`x` with its features whole on each device (gathered where they are split, as the product
  needs them): the array the forward multiplies and the backward keeps."""
  pattern = _sharding(plan, x, w)
  return x if pattern is None else shardings.to_spec(x, pattern.x)


def statistics(plan: LcePlan, x, w, b, labels, vocab: int):
  """``(lse, label logit, mean, argmax column)`` per token, on each device's shards when
  sharded."""
  pattern = _sharding(plan, x, w)
  if pattern is None:
    return _local_stats(plan, x, w, b, labels, vocab=vocab)
  rows = pattern.x[:-1]
  return pallas_sharding.per_shard(
    functools.partial(_local_stats, plan, vocab=vocab, model=_split(pattern, pattern.model)),
    (x, w, b, labels),
    (pattern.x, _w_spec(plan, pattern.w), (pattern.model,), rows),
    (rows, rows, rows, rows),
    mesh=pattern.mesh,
  )


def gradients(plan: LcePlan, x, w, b, labels, lse, row_scales):
  """``(dx, dw, db)``, on each device's shards when sharded: dx summed over the vocabulary's axes
  and dw, db over the tokens', each then split as its primal is (``plan.shardings``; a
  reduce-scatter where a summed axis splits it: an FSDP table's gradient)."""
  pattern = _sharding(plan, x, w)
  if pattern is None:
    return _local_grads(plan, x, w, b, labels, lse, *row_scales)
  rows = pattern.x[:-1]
  w_local = _w_spec(plan, pattern.w)
  x_spec, w_spec, _ = plan.shardings
  x_final = pattern.x if x_spec is None else x_spec
  w_final = w_local if w_spec is None else w_spec
  return pallas_sharding.per_shard(
    functools.partial(_local_grads, plan, model=_split(pattern, pattern.model)),
    (x, w, b, labels, lse, *row_scales),
    (pattern.x, w_local, (pattern.model,), rows, rows, rows, rows, rows),
    (x_final, w_final, (pattern.model,)),
    mesh=pattern.mesh,
    sum_over=(pattern.model, pattern.data, pattern.data),
    local_specs=(pattern.x, w_local, (pattern.model,)),
  )


# ------------------------------------------------------------------------- the custom_vjp


def _fwd(plan: LcePlan, x, w, b, labels, where):
  vocab = w.shape[plan.vocab_axis]
  x = gathered(plan, x, w)  # kept so: the backward needs the features whole again
  lse, sy, mean, pred = statistics(plan, x, w, b, labels, vocab)
  loss = loss_of(plan, lse, sy, mean, labels, vocab)
  if where is not None:
    loss = jnp.where(where, loss, 0)
  out = (loss, pred) if plan.predictions else loss
  return out, (x, w, b, labels, where, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_token_loss(
  plan: LcePlan, x: Array, w: Array, b: Array | None, labels: Array, where: Array | None = None
) -> Array | tuple[Array, Array]:
  """The loss per token (``labels.shape``, the accumulation dtype; 0 where `where` is False),
  keeping ``x``, ``w``, ``b``, ``labels``, ``where`` and the lse; see the module docstring. With
  ``plan.predictions``, ``(loss, argmax column)``, the columns int32 (of every token)."""
  return _fwd(plan, x, w, b, labels, where)[0]


def _bwd(plan: LcePlan, res, g):
  x, w, b, labels, where, lse = res
  if plan.predictions:
    g = g[0]  # the predictions' cotangent is float0
  if where is not None:
    g = jnp.where(where, g, 0)
  row_scales = scales(plan, g, lse, labels, w.shape[plan.vocab_axis])
  dx, dw, db = gradients(plan, x, w, b, labels, lse, row_scales)
  dx, dw, db = shardings.retype((dx, dw, db), plan.shardings)
  return dx, dw, db, None, None


per_token_loss.defvjp(_fwd, _bwd)
