"""The XLA path of :func:`jaxact.distillation_loss`: a divergence between the softmaxes of two LM
heads (a student's ``x_s @ w_s``, a teacher's ``x_t @ w_t``, one vocabulary), blocked over the
vocabulary so that neither model's (tokens, vocabulary) logits exist.

Two loops of the forward pass, each over the same column blocks of both heads: the first takes
each head's row max and sum of exponentials (:func:`~jaxact._src.lce.xla_tiles.tile_stats`,
:func:`~jaxact._src.lce.xla_tiles.merge`, as the LM head's loss does), the second the divergence
itself from the normalized log-probabilities ``log q = (s - m_s) - log Σ exp(s - m_s)`` (student)
and ``log p`` likewise (teacher), the max and the log-sum kept apart as the LM head's loss keeps
them. The backward recomputes both heads' blocks and forms the
student's logit gradient: ``q - p`` (forward KL), ``q (log q - log p - KL)`` (reverse KL),
``q (g - E_q[g])`` with ``g = (1 - beta) log(q / m)`` (the generalized JSD's), so it keeps the
two heads' statistics and one number a token (the reverse KL, or ``KL(q || m)`` for the JSD).

A term ``p (log p - log q)`` is taken as 0 where ``p`` is 0 (a masked vocabulary entry: no
``0 * inf``); where the teacher gives an entry mass the student gives none, the forward KL is
``+inf``, as it is.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.xla import add_block_grads, column_block, loop, zero_grads
from jaxact._src.lce.xla_tiles import (
  capped,
  logits,
  lowest,
  merge,
  tile_stats,
)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _blocks(plan: LcePlan, w: Array) -> tuple[int, int]:
  vocab = w.shape[plan.vocab_axis]
  return vocab, -(-vocab // min(plan.block, vocab))


def _head_block(plan: LcePlan, x, w, b, j, vocab):
  """Block `j`'s ``(s, ds/dz, start, columns, fresh)`` of one head."""
  start, wj, bj, cols, fresh = column_block(plan, w, b, j, vocab)
  s, dcap = capped(plan, logits(plan, x, wj, bj))
  return s, dcap, start, wj, cols, fresh


def normalizer(m: Array, se: Array) -> tuple[Array, Array]:
  """``(m, log se)``: the log-sum-exp kept as the row max and the log of the sum (at most
  ``log V``) apart, so that ``log q = (s - m) - log se`` is exact for logits of -1e9; ``log se`` is
  0 for a row with no finite logit (every ``s - m`` is -inf there)."""
  return m, jnp.where(se > 0, jnp.log(jnp.where(se > 0, se, 1)), 0)


def _log_probs(s: Array, norm: tuple[Array, Array]) -> Array:
  m, log_se = norm
  return (s - m[:, None]) - log_se[:, None]


def row_sums(ps: LcePlan, pt: LcePlan, xs, ws, bs, xt, wt, bt):
  """Each row's ``(max, Σ exp(s - max))`` of the student's and of the teacher's logits over the
  heads' columns, ``((m_s, se_s), (m_t, se_t))``, from one loop over both heads' column blocks."""
  vocab, n = _blocks(ps, ws)
  acc, t = ps.acc_dtype, xs.shape[0]
  labels = jnp.zeros((t,), jnp.int32)

  def body(j, carry):
    (ms, ses), (mt, set_) = carry
    s, _, _, _, cols, fresh = _head_block(ps, xs, ws, bs, j, vocab)
    tt, _, _, _, _, _ = _head_block(pt, xt, wt, bt, j, vocab)
    tms, tses, *_ = tile_stats(ps, s, labels, cols, fresh, vocab, None)
    tmt, tset, *_ = tile_stats(pt, tt, labels, cols, fresh, vocab, None)
    ms, ses, _, _ = merge((ms, ses, None, None), (tms, tses, None, None), vocab)
    mt, set_, _, _ = merge((mt, set_, None, None), (tmt, tset, None, None), vocab)
    return (ms, ses), (mt, set_)

  start = (jnp.full((t,), lowest(acc), acc), jnp.zeros((t,), acc))
  return loop(n, body, (start, start))


def statistics(ps: LcePlan, pt: LcePlan, xs, ws, bs, xt, wt, bt):
  """Each row's ``(max, log Σ exp(s - max))`` of the student's and of the teacher's logits,
  ``(norm_s, norm_t)`` (:func:`row_sums`, then :func:`normalizer`)."""
  (ms, ses), (mt, set_) = row_sums(ps, pt, xs, ws, bs, xt, wt, bt)
  return normalizer(ms, ses), normalizer(mt, set_)


def _terms(kind: str, beta: float, lq: Array, lp: Array):
  """The block's per-entry divergence terms and, for the JSD, ``log m`` and ``q log(q / m)``."""
  q, p = jnp.exp(lq), jnp.exp(lp)
  if kind == "forward_kl":
    return jnp.where(p > 0, p * (lp - lq), 0), None, None
  if kind == "reverse_kl":
    return jnp.where(q > 0, q * (lq - lp), 0), None, None
  lm = jnp.logaddexp(float(np.log(beta)) + lp, float(np.log1p(-beta)) + lq)  # weak: lq's dtype
  kl_q = jnp.where(q > 0, q * (lq - lm), 0)
  kl_p = jnp.where(p > 0, p * (lp - lm), 0)
  return beta * kl_p + (1 - beta) * kl_q, lm, kl_q


def divergence(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t):
  """``(D, aux)`` a row: the divergence and what its backward needs besides the statistics (the
  reverse KL itself, ``KL(q || m)`` for the JSD; None for the forward KL)."""
  vocab, n = _blocks(ps, ws)
  acc, t = ps.acc_dtype, xs.shape[0]

  def body(j, carry):
    d, aux = carry
    s, _, _, _, _, fresh = _head_block(ps, xs, ws, bs, j, vocab)
    tt, _, _, _, _, _ = _head_block(pt, xt, wt, bt, j, vocab)
    terms, _, kl_q = _terms(kind, beta, _log_probs(s, norm_s), _log_probs(tt, norm_t))
    if fresh is not None:  # an overlapped column counts once
      terms = jnp.where(fresh[None, :], terms, 0)
      kl_q = None if kl_q is None else jnp.where(fresh[None, :], kl_q, 0)
    d = d + jnp.sum(terms, 1)
    return d, (aux if kl_q is None else aux + jnp.sum(kl_q, 1))

  zeros = jnp.zeros((t,), acc)
  d, kl_q = loop(n, body, (zeros, zeros))
  aux = {"forward_kl": None, "reverse_kl": d, "jsd": kl_q}[kind]
  return d, aux


def student_grads(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, aux, g):
  """``(dx_s, dw_s, db_s)`` for the cotangent `g` of each row's divergence: `dw_s` and `db_s`
  written block by block, `dx_s` accumulated in the accumulation dtype."""
  vocab, n = _blocks(ps, ws)

  def body(j, carry):
    s, dcap, start, wj, _, fresh = _head_block(ps, xs, ws, bs, j, vocab)
    tt, _, _, _, _, _ = _head_block(pt, xt, wt, bt, j, vocab)
    lq, lp = _log_probs(s, norm_s), _log_probs(tt, norm_t)
    q = jnp.exp(lq)
    if kind == "forward_kl":
      ds = q - jnp.exp(lp)
    elif kind == "reverse_kl":
      ds = jnp.where(q > 0, q * (lq - lp - aux[:, None]), 0)
    else:
      _, lm, _ = _terms(kind, beta, lq, lp)
      ds = jnp.where(q > 0, (1 - beta) * q * (lq - lm - aux[:, None]), 0)
    grad = g[:, None] * ds
    if dcap is not None:
      grad = grad * dcap
    g_dx = grad if fresh is None else jnp.where(fresh[None, :], grad, 0)
    db_j = None if bs is None else jnp.sum(grad, 0)
    return add_block_grads(ps, xs, wj, start, grad, g_dx, db_j, carry)

  dx, dw, db = loop(n, body, zero_grads(ps, xs, ws, bs))
  return dx.astype(xs.dtype), dw, db
