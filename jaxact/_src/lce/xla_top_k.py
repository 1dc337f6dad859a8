"""The XLA path of :func:`jaxact.top_k_distillation_loss`'s student side: each token's log-
probabilities at K given vocabulary entries and of the rest of the vocabulary (the "tail"), from
one loop over column blocks of the head, so that no (tokens, vocabulary) array and no (tokens, K,
features) gather of the head exists.

The forward keeps, per row, the K entries' logits (each taken in the block that holds it, with
``take_along_axis`` on the block: O(K) a row) and the tail's own online log-sum-exp (its max and
sum of exponentials, over the columns that are none of the K). The whole softmax's normalizer is
then the K logits' and the tail's together (:func:`buckets`), so the tail's log-probability is a
difference of two log-sum-exps and never ``log(1 - Σ q_k)``: exact when the K entries hold all
but 1e-30 of the mass. The backward recomputes each block's logits and forms, for cotangents
``g_k`` of the K log-probabilities and ``g_tail`` of the tail's,

    G[t, v] = Σ_k g_k [v = i_k] + g_tail [v in tail] exp(s_v - lse_tail) - (Σ_k g_k + g_tail) q_v,

the scatter of the ``g_k`` into the block's columns done with ``mode="drop"`` for entries another
block holds. Both passes mark the K entries' columns of a block by one scatter into a (tokens,
block) mask, the size of the block's logits.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.xla import add_block_grads, column_block, finish_grads, loop, zero_grads
from jaxact._src.lce.xla_tiles import capped, logits, lowest, merge, rescale, shift, spread


def _n_blocks(plan: LcePlan, w: Array) -> tuple[int, int]:
  vocab = w.shape[plan.vocab_axis]
  return vocab, -(-vocab // min(plan.block, vocab))


def _entries(plan: LcePlan, x, w, b, idx, j, vocab):
  """Block `j`'s ``(s, ds/dz, start, w block, fresh, local, here, hit)``: the capped logits, the
  K entries' columns in the block (`local`: the block's width where outside it, for a dropped
  scatter), whether the block holds each (`here`: any of its columns; an overlapped column of the
  last block is in its predecessor too) and the (rows, block) mask of the K entries' columns."""
  start, wj, bj, _, fresh = column_block(plan, w, b, j, vocab)
  s, dcap = capped(plan, logits(plan, x, wj, bj))
  t, bv = s.shape
  local = idx - start
  here = (local >= 0) & (local < bv)
  local = jnp.where(here, local, bv)
  rows = jnp.arange(t)[:, None]
  hit = jnp.zeros((t, bv), jnp.bool_).at[rows, local].set(True, mode="drop")
  return s, dcap, start, wj, fresh, local, here, hit


def sums(plan: LcePlan, x, w, b, idx):
  """``(m_tail, se_tail, s_k)`` a row over `w`'s columns: the tail's max and ``Σ exp(s - max)``
  over the columns that are none of the row's K entries `idx` (T, K) (relative to `w`'s first
  column; outside ``[0, w's vocabulary)`` an entry is another device's), and the K entries'
  logits (T, K) (0 for another device's)."""
  vocab, n = _n_blocks(plan, w)
  acc, t = plan.acc_dtype, x.shape[0]
  low = lowest(acc)

  def body(j, carry):
    m, se, picked = carry
    s, _, _, _, fresh, local, here, hit = _entries(plan, x, w, b, idx, j, vocab)
    out = hit if fresh is None else hit | ~fresh[None, :]  # not the tail's, or counted before
    kept = jnp.where(out, low, s)
    tm = jnp.maximum(jnp.max(kept, axis=-1), low)
    tse = jnp.sum(jnp.where(out, 0, jnp.exp(shift(plan, kept, tm[:, None]))), axis=-1)
    m, se, _, _ = merge(plan, (m, se, None, None), (tm, tse, None, None), vocab)
    counted = here if fresh is None else here & (idx >= j * min(plan.block, vocab))
    at = jnp.take_along_axis(s, jnp.minimum(local, s.shape[1] - 1), axis=1)
    return m, se, picked + jnp.where(counted, at, 0)

  init = (jnp.full((t,), low, acc), jnp.zeros((t,), acc), jnp.zeros(idx.shape, acc))
  return loop(n, body, init)


def normalizer(plan: LcePlan, m_tail: Array, se_tail: Array, picked: Array) -> tuple[Array, Array]:
  """The whole softmax's ``(max, Σ exp(s - max))`` a row: the tail's and the K entries' together
  (each entry counted once per listing: K distinct entries are the vocabulary's partition)."""
  m = jnp.maximum(m_tail, jnp.max(picked, axis=-1))
  picked_sum = jnp.sum(jnp.exp(shift(plan, picked, m[:, None])), axis=-1)
  return m, se_tail * rescale(plan, m_tail, m) + picked_sum


def _log(se: Array) -> Array:
  """``log se``; 0 where ``se = 0`` (a row or tail with no finite logit: its ``s - m`` is -inf)."""
  return jnp.log(jnp.where(se > 0, se, 1))


def buckets(plan: LcePlan, m_tail, se_tail, picked, m, se) -> Array:
  """``(T, K + 1)``: the K entries' log-probabilities ``(s_k - m) - log se`` and the tail's
  ``(m_tail - m) + log se_tail - log se`` (-inf for an empty tail), each a difference to the
  row's max, as :mod:`jaxact._src.lce.xla_tiles` keeps them."""
  log_se = _log(se)[:, None]
  lq = spread(plan, picked - m[:, None]) - log_se
  full = se_tail > 0  # m_tail is then a logit, and m - m_tail a difference of two
  tail = spread(plan, jnp.where(full, m_tail, m) - m) + _log(se_tail) - log_se[:, 0]
  return jnp.concatenate([lq, jnp.where(full, tail, -jnp.inf)[:, None]], axis=1)


def grads(plan: LcePlan, x, w, b, idx, m_tail, se_tail, m, se, g):
  """``(dx, dw, db)`` for the cotangent `g` (T, K + 1) of :func:`buckets`' log-probabilities:
  `dw` and `db` written block by block, `dx` accumulated in the accumulation dtype."""
  vocab, n = _n_blocks(plan, w)
  acc, t = plan.acc_dtype, x.shape[0]
  g = g.astype(acc)
  g_k, g_tail = g[:, :-1], g[:, -1]
  p_scale = jnp.where(se > 0, -jnp.sum(g, axis=-1) / jnp.where(se > 0, se, 1), 0)
  t_scale = jnp.where(se_tail > 0, g_tail / jnp.where(se_tail > 0, se_tail, 1), 0)
  rows = jnp.arange(t)[:, None]

  def body(j, carry):
    s, dcap, start, wj, fresh, local, here, hit = _entries(plan, x, w, b, idx, j, vocab)
    grad = p_scale[:, None] * jnp.exp(jnp.minimum(shift(plan, s, m[:, None]), 0))
    tail = t_scale[:, None] * jnp.exp(jnp.minimum(shift(plan, s, m_tail[:, None]), 0))
    grad = grad + jnp.where(hit, 0, tail)
    grad = grad.at[rows, local].add(jnp.where(here, g_k, 0), mode="drop")
    if dcap is not None:
      grad = grad * dcap
    g_dx = grad if fresh is None else jnp.where(fresh[None, :], grad, 0)
    db_j = None if b is None else jnp.sum(grad, 0)
    return add_block_grads(plan, x, wj, start, grad, g_dx, db_j, carry)

  return finish_grads(plan, x, loop(n, body, zero_grads(plan, x, w, b)))
