"""The XLA path of :func:`jaxact.distillation_loss`: a divergence between the softmaxes of two LM
heads (a student's ``x_s @ w_s``, a teacher's ``x_t @ w_t``, one vocabulary), blocked over the
vocabulary so that neither model's (tokens, vocabulary) logits exist.

Two loops of the forward pass, each over the same column blocks of both heads: the first takes
each head's row max and sum of exponentials (:func:`~jaxact._src.lce.xla_tiles.tile_stats`,
:func:`~jaxact._src.lce.xla_tiles.merge`, as the LM head's loss does), the second the divergence
itself. The backward recomputes both heads' blocks and forms the student's logit gradient:
``q - p`` (forward KL), ``q (log q - log p - KL)`` (reverse KL), ``(1 - beta) q (log(q / m) -
KL(q || m))`` (the generalized JSD's), so it keeps the two heads' statistics and one number a
token (the reverse KL, or ``KL(q || m)`` for the JSD).

Every entry is formed from the probabilities ``q = exp(s - m_s) / se_s`` and ``p`` likewise (each
to a few roundings, where ``exp(log q)`` would carry ``log se``'s rounding, ``log V`` ulps), and
the log-ratio ``d = log p - log q`` taken as a difference of differences to each row's max, minus
``log(se_t / se_s)``: exact where the two heads agree, where ``log p`` and ``log q`` would each be
rounded to their own size. The mixture's ``log(m / q)`` and ``log(m / p)`` are ``log1p`` of
``expm1(±d)`` (:func:`_mixture`), exact near ``d = 0``; ``q - p`` is ``-q expm1(d)`` or
``p expm1(-d)``. A term of ``p`` is 0 where ``p`` is 0 (a masked vocabulary entry: no
``0 * inf``), as one of ``q`` is; where the teacher gives an entry mass the student gives none, the
forward KL is ``+inf``, as it is.

A teacher of a larger vocabulary than the student's (``pad``, Liger-Kernel's padding) adds the
teacher's columns past the student's, each of the student's there one logit ``pad``: each
forward loop goes on over those columns, block by block, the student's block a constant; the
backward has nothing to add there (a constant logit), as the statistics and ``aux`` count them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.xla import add_block_grads, column_block, finish_grads, loop, zero_grads
from jaxact._src.lce.xla_tiles import capped, logits, lowest, merge, shift, spread, tile_stats

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _blocks(plan: LcePlan, w: Array) -> tuple[int, int]:
  vocab = w.shape[plan.vocab_axis]
  return vocab, -(-vocab // min(plan.block, vocab))


def _head_block(plan: LcePlan, x, w, b, j, vocab):
  """Block `j`'s ``(s, ds/dz, start, columns, fresh)`` of one head."""
  start, wj, bj, cols, fresh = column_block(plan, w, b, j, vocab)
  s, dcap = capped(plan, logits(plan, x, wj, bj))
  return s, dcap, start, wj, cols, fresh


def _pad_units(ps: LcePlan, pad: float) -> float:
  """The student's padding logit `pad` (in the softmax's units, after the temperature, as Liger
  pads) in :func:`~jaxact._src.lce.xla_tiles.capped`'s units, which its blocks hold."""
  return pad if ps.temperature == 1 else pad * ps.temperature / (ps.soft_cap or 1.0)


def _pad_blocks(ps: LcePlan, pt: LcePlan, xt, wt, bt, pad: float | None, vocab: int):
  """``(n, block)``: the stretch of the teacher's columns past the student's `vocab` in blocks,
  ``block(j)`` giving ``(s, tt, cols, fresh)`` (the student's a constant block of `pad`); ``n`` 0
  where the vocabularies are one."""
  extra = wt.shape[pt.vocab_axis] - vocab
  if pad is None or extra <= 0:
    return 0, None
  bv = min(pt.block, extra)

  def block(j):
    start = vocab + jnp.minimum(j * bv, extra - bv)
    wj = lax.dynamic_slice_in_dim(wt, start, bv, axis=pt.vocab_axis)
    bj = None if bt is None else lax.dynamic_slice_in_dim(bt, start, bv, axis=0)
    tt, _ = capped(pt, logits(pt, xt, wj, bj))
    s = jnp.full(tt.shape, _pad_units(ps, pad), ps.acc_dtype)
    cols = start + jnp.arange(bv)
    return s, tt, cols, None if extra % bv == 0 else cols - vocab >= j * bv

  return -(-extra // bv), block


def _block_probs(ps: LcePlan, pt: LcePlan, s, tt, norm_s, norm_t):
  """``(q, p, d)`` of a block: the student's and the teacher's probabilities and ``d = log p - log
  q`` (unclipped: +inf where only the teacher gives mass, -inf where only the student does, 0
  where neither does), from
  :func:`~jaxact._src.lce.xla_tiles.capped`'s logits `s`, `tt` and each head's ``(max, sum)``."""
  (ms, ses), (mt, set_) = norm_s, norm_t
  q = jnp.exp(shift(ps, s, ms[:, None])) * _inverse(ses)[:, None]
  p = jnp.exp(shift(pt, tt, mt[:, None])) * _inverse(set_)[:, None]
  both = (ses > 0) & (set_ > 0)  # the ratio of two sums in [1, V]: rounded once, not log V ulps
  ratio = jnp.log(jnp.where(both, set_, 1) / jnp.where(both, ses, 1))
  if (ps.temperature, ps.soft_cap) == (pt.temperature, pt.soft_cap):  # one k: one rounding
    d = spread(ps, jnp.where(tt == s, 0, tt - s) - (mt - ms)[:, None])
  else:
    d = spread(pt, tt - mt[:, None]) - spread(ps, s - ms[:, None])
    d = jnp.where((tt == -jnp.inf) & (s == -jnp.inf), 0, d)
  return q, p, d - ratio[:, None]


def _inverse(se: Array) -> Array:
  """``1 / se``; 0 where no logit is finite (``se = 0``: every probability of the row is 0)."""
  return jnp.where(se > 0, 1 / jnp.where(se > 0, se, 1), 0)


def _both(ps, pt, xs, ws, bs, xt, wt, bt, vocab):
  """Block `j`'s ``(s, tt, cols, fresh)`` of the student's and the teacher's heads."""

  def block(j):
    s, _, _, _, cols, fresh = _head_block(ps, xs, ws, bs, j, vocab)
    tt, _, _, _, _, _ = _head_block(pt, xt, wt, bt, j, vocab)
    return s, tt, cols, fresh

  return block


def row_sums(ps: LcePlan, pt: LcePlan, xs, ws, bs, xt, wt, bt, pad=None):
  """Each row's ``(max, Σ exp(s - max))`` of the student's and of the teacher's logits over the
  heads' columns, ``((m_s, se_s), (m_t, se_t))``, from one loop over both heads' column blocks
  (and one over the teacher's columns past the student's, for a `pad`)."""
  vocab, n = _blocks(ps, ws)
  acc, t = ps.acc_dtype, xs.shape[0]
  labels = jnp.zeros((t,), jnp.int32)

  def body(block, j, carry):
    (ms, ses), (mt, set_) = carry
    s, tt, cols, fresh = block(j)
    tms, tses, *_ = tile_stats(ps, s, labels, cols, fresh, vocab, None)
    tmt, tset, *_ = tile_stats(pt, tt, labels, cols, fresh, vocab, None)
    ms, ses, _, _ = merge(ps, (ms, ses, None, None), (tms, tses, None, None), vocab)
    mt, set_, _, _ = merge(pt, (mt, set_, None, None), (tmt, tset, None, None), vocab)
    return (ms, ses), (mt, set_)

  start = (jnp.full((t,), lowest(acc), acc), jnp.zeros((t,), acc))
  both = _both(ps, pt, xs, ws, bs, xt, wt, bt, vocab)
  sums = loop(n, lambda j, c: body(both, j, c), (start, start))
  n_pad, pad_block = _pad_blocks(ps, pt, xt, wt, bt, pad, vocab)
  return loop(n_pad, lambda j, c: body(pad_block, j, c), sums) if n_pad else sums


def statistics(ps: LcePlan, pt: LcePlan, xs, ws, bs, xt, wt, bt, pad=None):
  """Each row's ``(max, Σ exp(s - max))`` of the student's and of the teacher's logits,
  ``(norm_s, norm_t)`` (:func:`row_sums`)."""
  return row_sums(ps, pt, xs, ws, bs, xt, wt, bt, pad)


def _mixture(beta: float, d: Array) -> tuple[Array, Array]:
  """``(log(m / q), log(m / p))`` of the mixture ``m = beta p + (1 - beta) q`` from ``d = log p -
  log q``: the one of the two whose ``expm1`` cannot overflow as ``log1p`` of it, the other by
  ``± d`` (``log(m / q) = log(m / p) + d``); +inf where its denominator is 0."""
  up = d >= 0
  to_p = jnp.log1p((1 - beta) * jnp.expm1(-jnp.where(up, d, 0)))  # d >= 0: p's side is finite
  to_q = jnp.log1p(beta * jnp.expm1(jnp.where(up, 0, d)))
  return jnp.where(up, to_p + d, to_q), jnp.where(up, to_p, to_q - d)


def _terms(kind: str, beta: float, q: Array, p: Array, d: Array):
  """The block's per-entry divergence terms and, for the JSD, ``log(m / q)`` and ``q log(q / m)``
  (each term 0 where its probability is 0, NaN kept)."""
  if kind == "forward_kl":
    return jnp.where(p == 0, 0, p * d), None, None
  if kind == "reverse_kl":
    return jnp.where(q == 0, 0, -q * d), None, None
  to_q, to_p = _mixture(beta, d)
  kl_q = jnp.where(q == 0, 0, -q * to_q)
  kl_p = jnp.where(p == 0, 0, -p * to_p)
  return beta * kl_p + (1 - beta) * kl_q, to_q, kl_q


def divergence(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, pad=None):
  """``(D, aux)`` a row: the divergence and what its backward needs besides the statistics (the
  reverse KL itself, ``KL(q || m)`` for the JSD; None for the forward KL)."""
  vocab, n = _blocks(ps, ws)
  acc, t = ps.acc_dtype, xs.shape[0]

  def body(block, j, carry):
    d, aux = carry
    s, tt, _, fresh = block(j)
    terms, _, kl_q = _terms(kind, beta, *_block_probs(ps, pt, s, tt, norm_s, norm_t))
    if fresh is not None:  # an overlapped column counts once
      terms = jnp.where(fresh[None, :], terms, 0)
      kl_q = None if kl_q is None else jnp.where(fresh[None, :], kl_q, 0)
    d = d + jnp.sum(terms, 1)
    return d, (aux if kl_q is None else aux + jnp.sum(kl_q, 1))

  zeros = jnp.zeros((t,), acc)
  both = _both(ps, pt, xs, ws, bs, xt, wt, bt, vocab)
  d, kl_q = loop(n, lambda j, c: body(both, j, c), (zeros, zeros))
  n_pad, pad_block = _pad_blocks(ps, pt, xt, wt, bt, pad, vocab)
  if n_pad:
    d, kl_q = loop(n_pad, lambda j, c: body(pad_block, j, c), (d, kl_q))
  aux = {"forward_kl": None, "reverse_kl": d, "jsd": kl_q}[kind]
  return d, aux


def student_grads(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, aux, g):
  """``(dx_s, dw_s, db_s)`` for the cotangent `g` of each row's divergence: `dw_s` and `db_s`
  written block by block, `dx_s` accumulated in the accumulation dtype."""
  vocab, n = _blocks(ps, ws)

  def body(j, carry):
    s, dcap, start, wj, _, fresh = _head_block(ps, xs, ws, bs, j, vocab)
    tt, _, _, _, _, _ = _head_block(pt, xt, wt, bt, j, vocab)
    q, p, d = _block_probs(ps, pt, s, tt, norm_s, norm_t)
    if kind == "forward_kl":  # q - p from the larger one, by an expm1 that cannot overflow
      ds = jnp.where(d <= 0, q, -p) * -jnp.expm1(-jnp.abs(d))
    elif kind == "reverse_kl":
      ds = jnp.where(q == 0, 0, q * (-d - aux[:, None]))
    else:
      _, to_q, _ = _terms(kind, beta, q, p, d)
      ds = jnp.where(q == 0, 0, (1 - beta) * q * (-to_q - aux[:, None]))
    grad = g[:, None] * ds
    if dcap is not None:
      grad = grad * dcap
    g_dx = grad if fresh is None else jnp.where(fresh[None, :], grad, 0)
    db_j = None if bs is None else jnp.sum(grad, 0)
    return add_block_grads(ps, xs, wj, start, grad, g_dx, db_j, carry)

  return finish_grads(ps, xs, loop(n, body, zero_grads(ps, xs, ws, bs)))
