"""Offline distillation from a teacher's stored top-k: :func:`top_k_distillation_loss`, the
divergences of :func:`jaxact.distillation_loss` between the teacher's K stored probabilities (and
their tail) and the student's at the same K entries (and its tail), the student's from one loop
over its head (:mod:`jaxact._src.lce.vjp_top_k`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import args, shardings, validation
from jaxact._src.core.dispatch import Decision
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import rules
from jaxact._src.lce.api import linear_cross_entropy
from jaxact._src.lce.api_distill import check_options, hard_labels, loss_and_metrics
from jaxact._src.lce.api_preference_losses import log1mexp
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.vjp_top_k import bucket_log_probs

_FN = "top_k_distillation_loss"


def _teacher(indices, log_probs, shape, vocab: int) -> tuple[Array, Array]:
  """The stored top-k checked against the student's tokens and vocabulary: ``(indices, log
  probabilities)``, of shape ``shape + (K,)``, 1 <= K <= V."""
  indices = checks.as_labels(_FN, indices, "teacher_indices")
  log_probs = validation.as_real_array(_FN, log_probs, "teacher_log_probs")
  if not jnp.issubdtype(log_probs.dtype, jnp.floating):
    raise TypeError(
      checks.err(
        _FN,
        f"`teacher_log_probs` has dtype {log_probs.dtype}; accepted: a floating dtype (the "
        "teacher's log-probabilities)",
      )
    )
  if indices.ndim != len(shape) + 1 or indices.shape[:-1] != shape:
    raise ValueError(
      checks.err(
        _FN, f"`teacher_indices` has shape {indices.shape}; accepted: {shape} + (K,), x's tokens"
      )
    )
  k = indices.shape[-1]
  if not 1 <= k <= vocab:
    raise ValueError(
      checks.err(
        _FN, f"`teacher_indices` holds K = {k} entries a token; accepted: 1 <= K <= {vocab}"
      )
    )
  if log_probs.shape != indices.shape:
    raise ValueError(
      checks.err(
        _FN,
        f"`teacher_log_probs` has shape {log_probs.shape}; accepted: teacher_indices' "
        f"{indices.shape}",
      )
    )
  return indices, log_probs


def _check_values(indices: Array, log_probs: Array, where: Array | None, vocab: int) -> None:
  """ValueError for counted entries outside ``[0, V)``, listed twice in a token, or whose
  log-probability is NaN or above 0, when the arrays are concrete (under ``jit`` they cannot be
  read: documented)."""
  if any(isinstance(a, jax.core.Tracer) for a in (indices, log_probs, where)) or not indices.size:
    return
  each = None if where is None else jnp.broadcast_to(where[..., None], indices.shape)
  checks.check_label_range(_FN, indices, each, None, vocab, "teacher_indices", mask="mask")
  idx, lp = np.asarray(indices), np.asarray(log_probs)
  counted = np.ones(idx.shape[:-1], bool) if where is None else np.asarray(where)
  ordered = np.sort(idx, axis=-1)
  twice = np.any(ordered[..., 1:] == ordered[..., :-1], axis=-1) & counted
  if twice.any():
    first = tuple(int(i) for i in np.argwhere(twice)[0])
    raise ValueError(
      checks.err(
        _FN,
        f"`teacher_indices` lists an entry twice in {int(twice.sum())} token(s), e.g. "
        f"teacher_indices[{', '.join(map(str, first))}] = {idx[first].tolist()}; accepted: K "
        "distinct entries a token (a top-k)",
      )
    )
  bad = (np.isnan(lp) | (lp > 0)) & counted[..., None]
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      checks.err(
        _FN,
        f"`teacher_log_probs` holds {int(bad.sum())} value(s) that are NaN or above 0, e.g. "
        f"teacher_log_probs[{', '.join(map(str, first))}] = {float(lp[first])}; accepted: "
        "log-probabilities, <= 0 (-inf for probability 0)",
      )
    )


def _teacher_buckets(lp: Array, full: bool) -> Array:
  """``(T, K + 1)``: the teacher's K log-probabilities and its tail's, ``log(1 - Σ p_k)`` from
  :func:`log1mexp` of their log-sum-exp (-inf where they sum to 1 or more, and for ``K = V``
  (`full`): there the tail is the sum's rounding, and the student has none)."""
  top = jax.nn.logsumexp(lp, axis=-1)
  tail = jnp.where(top < 0, log1mexp(jnp.minimum(top, -1e-30)), -jnp.inf)
  tail = jnp.full_like(top, -jnp.inf) if full else tail
  return jnp.concatenate([lp, tail[:, None]], axis=1)


def _kl_terms(la: Array, lb: Array) -> Array:
  """``a (log a - log b)`` entrywise, 0 where ``a = 0`` (with no NaN in its gradient there)."""
  a = jnp.exp(la)
  ok = a > 0
  return jnp.where(ok, a * (jnp.where(ok, la, 0) - jnp.where(ok, lb, 0)), 0)


def bucket_divergence(kind: str, beta: float, lq: Array, lp: Array) -> Array:
  """Each row's divergence between the student's buckets ``exp(lq)`` and the teacher's
  ``exp(lp)`` (both ``(T, K + 1)``), plain ``jnp`` for JAX's autodiff."""
  if kind == "forward_kl":
    return jnp.sum(_kl_terms(lp, lq), axis=-1)
  if kind == "reverse_kl":
    return jnp.sum(_kl_terms(lq, lp), axis=-1)
  some = (lp > -jnp.inf) | (lq > -jnp.inf)  # a bucket both give 0 counts 0: no -inf mixture
  lp_s, lq_s = jnp.where(some, lp, 0), jnp.where(some, lq, 0)
  lm = jnp.logaddexp(float(np.log(beta)) + lp_s, float(np.log1p(-beta)) + lq_s)
  kl = beta * _kl_terms(lp_s, lm) + (1 - beta) * _kl_terms(lq_s, lm)
  return jnp.sum(jnp.where(some, kl, 0), axis=-1)


def _renormalized(lq: Array, lp: Array) -> tuple[Array, Array]:
  """``add_tail=False``: the student's K log-probabilities and the teacher's, each renormalized
  over the K entries (TRL's ``loss_add_tail=False``), the student's where the teacher's is -inf
  dropped as TRL drops them; a token whose teacher gives all K entries -inf gives equal rows of
  -inf (a divergence of 0)."""
  lq = jnp.where(lp == -jnp.inf, -jnp.inf, lq[:, :-1])
  none = jnp.all(lp == -jnp.inf, axis=-1, keepdims=True)
  own = lambda a: a - jnp.where(none, 0, jax.nn.logsumexp(jnp.where(none, 0, a), -1, keepdims=True))
  return own(lq), own(lp)


def top_k_distillation_loss(
  x: ArrayLike,
  w: ArrayLike,
  teacher_indices: ArrayLike,
  teacher_log_probs: ArrayLike,
  *,
  divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl",
  beta: float = 0.5,
  temperature: float = 1.0,
  mask: ArrayLike | None = None,
  labels: ArrayLike | None = None,
  hard_label_weight: float = 0.0,
  divergence_weight: float = 1.0,
  reduction: Literal["mean", "sum", "none"] = "mean",
  bias: ArrayLike | None = None,
  logit_soft_cap: float | None = None,
  w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  vocab_block_size: int | None = None,
  add_tail: bool = True,
) -> tuple[Array, dict[str, Array]]:
  r"""Distil a teacher's stored top-k log-probabilities into a student's head, without the
  student's (tokens, vocabulary) logits and without a teacher model.

  Each token carries the teacher's K entries :math:`i_1, \dots, i_K` and their log-probabilities
  :math:`\log p_k`, normalized over the whole vocabulary when stored (so that
  :math:`\sum_k p_k \le 1`; the rest, :math:`p_\text{tail} = 1 - \sum_k p_k`, is the mass of the
  entries not stored). The student's softmax
  :math:`q = \operatorname{softmax}(c \tanh(z / c) / T)` of :math:`z = x W + b` gives
  :math:`q_k = q_{i_k}` and :math:`q_\text{tail} = 1 - \sum_k q_k`, and the divergence is
  :func:`jaxact.distillation_loss`'s between these two distributions over K + 1 buckets:

  .. math::
    \mathrm{KL}(p \| q) = \sum_{b = 1}^{K + 1} p_b (\log p_b - \log q_b)

  for ``"forward_kl"``, :math:`\mathrm{KL}(q \| p)` for ``"reverse_kl"``, and
  :math:`\beta\, \mathrm{KL}(p \| m) + (1 - \beta)\, \mathrm{KL}(q \| m)`,
  :math:`m = \beta p + (1 - \beta) q`, for ``"jsd"``: the exact divergences of the coarse-grained
  distributions (each a lower bound of the full one), with :math:`0 \log 0 = 0` (a bucket of
  probability 0 on the left counts 0: a teacher tail of 0 adds nothing to the forward KL). The
  loss is ``divergence_weight`` times it reduced over the tokens ``mask`` selects, plus
  ``hard_label_weight`` times the student's cross-entropy against ``labels`` (temperature 1).

  With ``add_tail=False`` (TRL's ``loss_add_tail=False``) there is no tail bucket: both
  distributions are renormalized over the K entries, :math:`\hat p_k = p_k / \sum_j p_j` and
  :math:`\hat q_k = q_k / \sum_j q_j` (the student's softmax of its K logits alone), and the
  divergence is between these two over K entries (0 for K = 1). An entry whose stored
  log-probability is -inf is left out of both, as TRL leaves it out (a token whose K entries are
  all -inf counts 0).

  The temperature and the soft cap apply to the student only: the stored log-probabilities are
  used as given (store them at the temperature you want to match). The teacher's tail is
  :math:`\log(1 - e^{a})` of :math:`a = \operatorname{lse}_k \log p_k`, from ``log(-expm1(a))`` or
  ``log1p(-exp(a))`` on either side of :math:`-\log 2`; where the stored probabilities sum to 1
  or more (rounding) it is 0, and for K = V it is 0 (no entry is outside). The student's tail is
  never formed as :math:`1 - \sum_k q_k`: the vocabulary loop keeps the log-sum-exp of the
  columns that are none of the K apart from the K logits, so :math:`\log q_\text{tail}` is a
  difference of two log-sum-exps, exact where the K entries hold all but 1e-30 of the mass.

  One ``custom_vjp`` gives the student's K + 1 log-probabilities a token; it keeps ``x``, ``w``,
  ``bias``, the indices and four numbers a token (the softmax's max and sum of exponentials, the
  tail's), loops once over blocks of ``vocab_block_size`` columns (each block's K entries taken
  from its logits, the (tokens, K, features) gather of ``w`` never made), and its backward
  recomputes each block's logits. The divergences are plain ``jnp`` on (tokens, K + 1) numbers,
  differentiated by JAX. The teacher's log-probabilities get zero gradients. Half precision
  inputs are computed in float32.

  Values: entries outside ``[0, V)``, an entry listed twice in a token, and log-probabilities that
  are NaN or above 0 raise ``ValueError`` where ``mask`` counts them, when the arrays are concrete;
  under ``jit`` they are not checked: an entry outside is impossible for the student (log-
  probability ``-inf``), a repeated one counts once per listing (also in the student's normalizer,
  which is then not its softmax's). A teacher log-probability of ``-inf`` (probability 0, e.g. a
  padding entry) is allowed. Where a bucket's left-hand probability is positive and its right-
  hand one is 0 (a teacher tail of 0 for ``"reverse_kl"``; a student entry its bias masks for
  ``"forward_kl"``) the KL is ``+inf``, as it is; the JSD is always finite. Positions ``mask``
  drops are not read (any index, any value) and give 0 and zero gradients.

  Args:
    x: the student's hidden states, ``(..., D)``.
    w: the student's head, ``(D, V)`` (``(V, D)`` for ``w_layout="vd"``).
    teacher_indices: ``x.shape[:-1] + (K,)``, integer: the teacher's stored entries, distinct.
    teacher_log_probs: ``x.shape[:-1] + (K,)``, floating: their log-probabilities, <= 0.
    divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
    beta: the JSD's :math:`\beta`, in ``(0, 1)`` (the teacher's weight in the mixture).
    temperature: the student's (capped) logits are divided by it (the divergence's only).
    mask: bool, ``x.shape[:-1]``: the tokens that count (None: all).
    labels: the student's hard labels, ``x.shape[:-1]``, for ``hard_label_weight``.
    hard_label_weight: the cross-entropy term's weight (>= 0; 0: no term).
    divergence_weight: the divergence's weight (>= 0).
    reduction: ``"mean"`` over the selected tokens (0 when none), ``"sum"``, or ``"none"`` (each
      token's weighted terms, 0 where not selected).
    bias: the student's head bias ``(V,)`` or None.
    logit_soft_cap: the student's soft cap :math:`c`, or None.
    w_layout: ``"dv"`` or ``"vd"``, the student head's layout.
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    vocab_block_size: columns a block of the loops (None: chosen from the sizes).
    add_tail: True: the K + 1 buckets; False: the K entries renormalized (TRL's
      ``loss_add_tail``).

  Returns:
    ``(loss, metrics)``: the loss (a scalar, or ``x.shape[:-1]`` for ``"none"``; float32, float64
    for float64 inputs) and, detached, ``"divergence"`` and ``"cross_entropy"`` (reduced as the
    loss is, unweighted; the latter 0 without labels).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxact
    >>> x = jax.random.normal(jax.random.key(0), (4, 8))
    >>> w = jax.random.normal(jax.random.key(1), (8, 32))
    >>> top_log_probs, top = jax.lax.top_k(jax.nn.log_softmax(x @ w), 5)  # a teacher's, stored
    >>> loss, metrics = jaxact.top_k_distillation_loss(x, w, top, top_log_probs)
    >>> abs(float(loss)) < 1e-6  # the student is its teacher
    True
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    beta, temperature = check_options(_FN, divergence, beta, reduction, temperature)
    cap = None
    if logit_soft_cap is not None:
      cap = checks.number(_FN, "logit_soft_cap", logit_soft_cap, low=0.0, low_open=True)
    hard = checks.number(_FN, "hard_label_weight", hard_label_weight, low=0.0)
    soft = checks.number(_FN, "divergence_weight", divergence_weight, low=0.0)
    checks.w_layout(_FN, w_layout)
    if not isinstance(add_tail, (bool, np.bool_)):
      raise TypeError(checks.err(_FN, f"`add_tail` is {add_tail!r}; accepted: True or False"))
    arrays, acc, _ = args.prepare_arrays(_FN, {"x": x, "w": w, "bias": bias}, None)
    xs, ws, bs = arrays["x"], arrays["w"], arrays["bias"]
    shape = xs.shape[:-1]
    vocab = checks.check_shapes(_FN, xs, ws, jnp.zeros(shape, jnp.int32), bs, w_layout, "x")
    indices, log_probs = _teacher(teacher_indices, teacher_log_probs, shape, vocab)
    where = checks.as_where(_FN, mask, shape, "x", name="mask")
    _check_values(indices, log_probs, where, vocab)
    labels = hard_labels(_FN, labels, hard, shape, where, vocab)
    acc = np.dtype(acc)
    count, k = math.prod(shape), indices.shape[-1]
    idx = checks.labels_int32(indices, vocab).reshape(count, k)
    lp = lax.stop_gradient(log_probs.astype(acc).reshape(count, k))
    if where is not None:  # dropped positions are not read: K distinct entries of probability 0
      keep = where.reshape(count, 1)
      idx = jnp.where(keep, idx, jnp.arange(k, dtype=jnp.int32))
      lp = jnp.where(keep, lp, -jnp.inf)
    d = jnp.zeros(shape, acc)
    if count:
      xs = xs.reshape(count, xs.shape[-1])  # before its type is taken: dx's is the same shape
      plan = LcePlan(
        block=checks.block_size(_FN, vocab_block_size, count, vocab, None),
        soft_cap=cap,
        temperature=temperature,
        w_layout=w_layout,
        precision=args.hashable_precision(precision),
        acc_dtype=acc,
        shardings=shardings.specs(xs, ws, bs),
      )
      pattern = rules.per_device(rules.sharding_of(plan, xs, ws))
      plan = dataclasses.replace(plan, decision=Decision(sharding=pattern))
      lq = bucket_log_probs(plan, xs, ws, bs, idx)
      lq, lp = (lq, _teacher_buckets(lp, k == vocab)) if add_tail else _renormalized(lq, lp)
      if where is not None:  # equal buckets where dropped: 0, and zero gradients
        lq = jnp.where(keep, lq, lp)
      d = bucket_divergence(divergence, float(beta), lq, lp).reshape(shape)
      d = d if where is None else jnp.where(where, d, 0)
    hard_label = dict(labels=labels, bias=bias, logit_soft_cap=logit_soft_cap, w_layout=w_layout)
    cross_entropy = functools.partial(
      linear_cross_entropy, x, w, precision=precision, vocab_block_size=vocab_block_size
    )
    return loss_and_metrics(d, cross_entropy, hard_label, where, reduction, soft, hard, acc)
