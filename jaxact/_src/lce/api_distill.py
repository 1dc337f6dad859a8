"""Knowledge distillation between two LM heads without either model's logits:
:func:`distillation_loss` (forward KL, reverse KL, the generalized Jensen-Shannon divergence, and a
hard-label cross-entropy term), on the blocked loops of :mod:`jaxact._src.lce.xla_distill`."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import args, shardings
from jaxact._src.core.dispatch import Decision
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import sharding_distill
from jaxact._src.lce.api import linear_cross_entropy
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.sharding import split_axes
from jaxact._src.lce.vjp_distill import per_token_divergence
from jaxact._src.lce.xla_distill import DIVERGENCES

_FN = "distillation_loss"


def _teacher(x: Array, tx: Array, tw: Array, tb, layout: str, vocab: int, pad) -> int:
  """The teacher's shapes against the student's: the same tokens, the same vocabulary (a larger
  one with a `pad`); its vocabulary."""
  if tx.ndim < 1 or tx.shape[:-1] != x.shape[:-1]:
    raise ValueError(
      checks.err(_FN, f"`teacher_x` has shape {tx.shape}; accepted: {x.shape[:-1]} + (features,)")
    )
  want = (tx.shape[-1], vocab) if layout == "dv" else (vocab, tx.shape[-1])
  vocab_t = tw.shape[layout.index("v")] if tw.ndim == 2 else 0
  if tw.ndim != 2 or tw.shape[layout.index("d")] != tx.shape[-1] or vocab_t < vocab:
    raise ValueError(
      checks.err(
        _FN,
        f"`teacher_w` has shape {tw.shape}; accepted: {want} (teacher_x's features, the "
        f"student's vocabulary {vocab}, teacher_w_layout={layout!r})",
      )
    )
  if vocab_t > vocab and pad is None:
    raise ValueError(
      checks.err(
        _FN,
        f"`teacher_w` has a vocabulary of {vocab_t}, the student's {vocab}; accepted: the "
        "student's, or a larger one with `student_pad_logit` set (0.0 pads the student's logits "
        "with zeros, as Liger-Kernel's distillation losses do)",
      )
    )
  if tb is not None and tb.shape != (vocab_t,):
    raise ValueError(
      checks.err(_FN, f"`teacher_bias` has shape {tb.shape}; accepted: ({vocab_t},)")
    )
  return vocab_t


def _pad_logit(value) -> float | None:
  """``student_pad_logit`` checked: None, a finite number or -inf."""
  if value is None:
    return None
  if isinstance(value, numbers.Real) and not isinstance(value, bool) and value == -math.inf:
    return -math.inf
  return checks.number(_FN, "student_pad_logit", value, low=-math.inf)


def distillation_loss(
  x: ArrayLike,
  w: ArrayLike,
  teacher_x: ArrayLike,
  teacher_w: ArrayLike,
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
  teacher_bias: ArrayLike | None = None,
  logit_soft_cap: float | None = None,
  teacher_logit_soft_cap: float | None = None,
  w_layout: Literal["dv", "vd"] = "dv",
  teacher_w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  vocab_block_size: int | None = None,
  student_pad_logit: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""Distil a teacher's next-token distribution into a student's, from both models' hidden
  states and heads, without either model's (tokens, vocabulary) logits.

  With the student's softmax :math:`q = \operatorname{softmax}(c_s \tanh(z_s / c_s) / T)` of
  :math:`z_s = x W + b` and the teacher's :math:`p` likewise from ``teacher_x``, ``teacher_w``
  (the feature sizes may differ; the vocabulary is one), each token's divergence is

  * ``"forward_kl"``: :math:`\mathrm{KL}(p \| q) = \sum_v p_v (\log p_v - \log q_v)` (Hinton et
    al. 2015's distillation loss, without the :math:`T^2` factor: multiply by it if you want it);
  * ``"reverse_kl"``: :math:`\mathrm{KL}(q \| p)` (mode-seeking, as MiniLLM and on-policy
    distillation use it);
  * ``"jsd"``: the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), as TRL's
    ``generalized_jsd_loss`` writes it: :math:`\beta\, \mathrm{KL}(p \| m) + (1 - \beta)\,
    \mathrm{KL}(q \| m)` with :math:`m = \beta p + (1 - \beta) q`, :math:`0 < \beta < 1` (its
    limits are the two KLs above, which TRL special-cases; here ask for them by name),

  and the loss is ``divergence_weight`` times the divergence reduced over the tokens ``mask``
  selects, plus ``hard_label_weight`` times the student's cross-entropy against ``labels``
  (:func:`jaxact.linear_cross_entropy` of the student head at temperature 1, its soft cap and
  ``mask``).

  The teacher is frozen: its arguments get zero gradients. One ``custom_vjp`` keeps both heads'
  inputs (held by the caller anyway), each head's row max and log-sum and one number a token;
  the forward loops twice over blocks of ``vocab_block_size`` columns of both heads (statistics,
  then the divergence), the backward once, recomputing both heads' logits. A vocabulary entry
  that a bias of ``-inf`` masks in both heads has probability 0 and counts 0 (no
  :math:`0 \cdot \infty`); one the student masks and the teacher does not gives a forward KL of
  ``+inf``, as it is. Half precision inputs are computed in float32.

  A teacher of a larger vocabulary ``V_t > V`` (one tokenizer, the teacher's head padded, as
  Qwen's are) needs ``student_pad_logit``: the student's logits are padded on the right to
  ``V_t`` columns with that value, after the temperature, before the softmax, as Liger-Kernel's
  distillation losses pad them with 0 (``student_pad_logit=0.0``: each padded entry then has the
  student's probability :math:`e^0 / Z`, not 0; ``-inf`` gives them probability 0, and a forward
  KL of ``+inf`` wherever the teacher gives one of them mass). The padded columns have no
  parameters and get no gradient; the hard-label term uses the student's ``V`` columns. They are
  computed in the vocabulary loop, never stored. Not under a mesh that splits the vocabulary.

  Args:
    x: the student's hidden states, ``(..., D)``.
    w: the student's head, ``(D, V)`` (``(V, D)`` for ``w_layout="vd"``).
    teacher_x: the teacher's hidden states, ``(..., D_t)`` over the same tokens.
    teacher_w: the teacher's head, ``(D_t, V)`` (``(V, D_t)`` for ``teacher_w_layout="vd"``);
      ``V_t > V`` columns with ``student_pad_logit``.
    divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
    beta: the JSD's :math:`\beta`, in ``(0, 1)`` (the teacher's weight in the mixture).
    temperature: both heads' logits are divided by it (the divergence's only).
    mask: bool, ``x.shape[:-1]``: the tokens that count (None: all).
    labels: the student's hard labels, ``x.shape[:-1]``, for ``hard_label_weight``.
    hard_label_weight: the cross-entropy term's weight (>= 0; 0: no term).
    divergence_weight: the divergence's weight (>= 0).
    reduction: ``"mean"`` over the selected tokens (0 when none), ``"sum"``, or ``"none"`` (each
      token's weighted terms, 0 where not selected).
    bias: the student's head bias ``(V,)`` or None.
    teacher_bias: the teacher's head bias ``(V,)`` (``(V_t,)``) or None.
    logit_soft_cap: the student's soft cap :math:`c_s`, or None.
    teacher_logit_soft_cap: the teacher's, or None.
    w_layout: ``"dv"`` or ``"vd"``, the student head's layout.
    teacher_w_layout: ``"dv"`` or ``"vd"``, the teacher head's layout.
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    vocab_block_size: columns a block of the loops (None: chosen from the sizes).
    student_pad_logit: None (the vocabularies must be one), or the student's logit at each of a
      larger teacher vocabulary's extra columns (0.0: Liger-Kernel's padding; -inf allowed).

  Returns:
    ``(loss, metrics)``: the loss (a scalar, or ``x.shape[:-1]`` for ``"none"``; float32, float64
    for float64 inputs) and, detached, ``"divergence"`` and ``"cross_entropy"`` (reduced as the
    loss is, unweighted; the latter 0 without labels).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxact
    >>> x = jax.random.normal(jax.random.key(0), (4, 8))
    >>> w = jax.random.normal(jax.random.key(1), (8, 32))
    >>> loss, metrics = jaxact.distillation_loss(x, w, x, w)  # a student equal to its teacher
    >>> abs(float(loss)) < 1e-6
    True
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    beta, temperature = check_options(_FN, divergence, beta, reduction, temperature)
    caps = []
    for name, cap in (
      ("logit_soft_cap", logit_soft_cap),
      ("teacher_logit_soft_cap", teacher_logit_soft_cap),
    ):
      caps.append(None if cap is None else checks.number(_FN, name, cap, low=0.0, low_open=True))
    hard = checks.number(_FN, "hard_label_weight", hard_label_weight, low=0.0)
    soft = checks.number(_FN, "divergence_weight", divergence_weight, low=0.0)
    checks.w_layout(_FN, w_layout)
    checks.w_layout(_FN, teacher_w_layout)
    arrays, acc_s, _ = args.prepare_arrays(_FN, {"x": x, "w": w, "bias": bias}, None)
    teacher = {"teacher_x": teacher_x, "teacher_w": teacher_w, "teacher_bias": teacher_bias}
    tarrays, acc_t, _ = args.prepare_arrays(_FN, teacher, None)
    xs, ws, bs = arrays["x"], arrays["w"], arrays["bias"]
    xt, wt, bt = tarrays["teacher_x"], tarrays["teacher_w"], tarrays["teacher_bias"]
    shape = xs.shape[:-1]
    vocab = checks.check_shapes(_FN, xs, ws, jnp.zeros(shape, jnp.int32), bs, w_layout, "x")
    pad = _pad_logit(student_pad_logit)
    vocab_t = _teacher(xs, xt, wt, bt, teacher_w_layout, vocab, pad)
    where = checks.as_where(_FN, mask, shape, "x", name="mask")
    labels = hard_labels(_FN, labels, hard, shape, where, vocab)
    acc = np.dtype(jnp.promote_types(acc_s, acc_t))
    count = math.prod(shape)
    block = checks.block_size(_FN, vocab_block_size, count, vocab, None)
    pad = pad if vocab_t > vocab else None
    flat = lambda a: a.reshape(count, a.shape[-1])
    xs, xt = flat(xs), flat(xt)
    plan = lambda cap, layout, x, w, b: LcePlan(
      block=block,
      soft_cap=cap,
      temperature=temperature,
      w_layout=layout,
      precision=args.hashable_precision(precision),
      acc_dtype=acc,
      shardings=shardings.specs(x, w, b),
    )
    ps, pt = plan(caps[0], w_layout, xs, ws, bs), plan(caps[1], teacher_w_layout, xt, wt, bt)
    pattern = sharding_distill.pattern_of(ps, pt, xs, ws, xt, wt)  # both heads run in it
    ps = dataclasses.replace(ps, decision=Decision(sharding=pattern))
    if pad is not None and pattern is not None and split_axes(pattern, pattern.model):
      raise NotImplementedError(
        checks.err(_FN, "`student_pad_logit` with the vocabulary split over devices")
      )
    d = per_token_divergence(
      ps,
      pt,
      divergence,
      float(beta),
      pad,
      xs,
      ws,
      bs,
      xt,
      wt,
      bt,
      None if where is None else where.reshape(count),
    ).reshape(shape)
    hard_label = dict(labels=labels, bias=bias, logit_soft_cap=logit_soft_cap, w_layout=w_layout)
    cross_entropy = functools.partial(
      linear_cross_entropy, x, w, precision=precision, vocab_block_size=vocab_block_size
    )
    return loss_and_metrics(d, cross_entropy, hard_label, where, reduction, soft, hard, acc)


def hard_labels(fn: str, labels, hard: float, shape, where, vocab: int) -> Array | None:
  """The hard labels of a distillation call (None: none), checked as `fn` takes them: integers of
  x's tokens' `shape`, in ``[0, V)`` where ``mask`` counts them (when concrete)."""
  if labels is None:
    if hard:
      raise ValueError(checks.err(fn, "`hard_label_weight` is not 0 but `labels` is None"))
    return None
  labels = checks.as_labels(fn, labels, "labels")
  if labels.shape != tuple(shape):
    raise ValueError(
      checks.err(fn, f"`labels` has shape {labels.shape}; accepted: x's tokens, {tuple(shape)}")
    )
  checks.check_label_range(fn, labels, where, None, vocab, "labels", mask="mask")
  return labels


def check_options(fn: str, divergence, beta, reduction, temperature) -> tuple[float, float]:
  """``(beta, temperature)`` of a distillation call, checked: a divergence it knows, a JSD's beta
  in (0, 1), a reduction, a positive temperature (errors name `fn` and the argument)."""
  if divergence not in DIVERGENCES:
    raise ValueError(checks.err(fn, f"`divergence` is {divergence!r}; accepted: {DIVERGENCES}"))
  if divergence == "jsd":
    beta = checks.number(fn, "beta", beta, low=0.0, high=1.0, low_open=True)
    if beta >= 1.0:
      raise ValueError(checks.err(fn, "`beta` must be below 1 (1 is divergence='reverse_kl')"))
  if reduction not in ("mean", "sum", "none"):
    raise ValueError(checks.err(fn, f"`reduction` is {reduction!r}; accepted: mean, sum, none"))
  return beta, checks.number(fn, "temperature", temperature, low=0.0, low_open=True)


def loss_and_metrics(d, cross_entropy, hard_label: dict, where, reduction, soft, hard, acc):
  """``(loss, metrics)`` of a distillation from each token's divergence `d`: the student's
  cross-entropy against ``hard_label["labels"]`` (when given) by `cross_entropy`
  (:func:`jaxact.linear_cross_entropy` of the student head), both reduced over the tokens
  `where` selects, weighted by `soft` and `hard`; the metrics detached."""
  ce = jnp.zeros(d.shape, acc)
  labels = hard_label.pop("labels")
  if labels is not None:
    ce = cross_entropy(labels, where=where, reduction="none", **hard_label).astype(acc)

  def reduce(v: Array) -> Array:
    if reduction == "none":
      return v
    if reduction == "sum":
      return jnp.sum(v)
    counted = d.size if where is None else jnp.sum(where, dtype=acc)
    return jnp.sum(v) / jnp.maximum(counted, 1)

  loss = reduce(soft * d + hard * ce) if hard else reduce(soft * d)
  metrics = {"divergence": reduce(d), "cross_entropy": reduce(ce)}
  return loss, jax.tree.map(lax.stop_gradient, metrics)
