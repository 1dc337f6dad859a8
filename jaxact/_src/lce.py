"""The LM head and its loss as one op: :func:`linear_cross_entropy`.

``softmax_cross_entropy(x @ w + b, labels)`` differentiated by JAX keeps the (tokens, vocabulary)
logits, their softmax and builds their gradient: with a 32k-256k vocabulary the largest arrays of a
language model's training step. The op here keeps ``x``, ``w``, ``b``, the labels and one float32
log-sum-exp a token, and never builds an array of that shape (:mod:`jaxact._src.lce_vjp`). This
module checks the arguments, builds the static plan, asks :mod:`jaxact._src.dispatch` for the
backend, and reduces the per-token losses (``where``, ``reduction``) in plain JAX, whose autodiff
gives the rule its per-token cotangent.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src import dispatch, validation
from jaxact._src import fused_args as args
from jaxact._src.dispatch import Implementation
from jaxact._src.lce_vjp import LcePlan, default_block, kernel_block, per_token_loss

REDUCTIONS = ("mean", "sum", "none")
_FN = "linear_cross_entropy"


def _err(msg: str) -> str:
  return f"jaxact.{_FN}: {msg}"


def _number(name: str, value, *, low: float, high: float | None = None, low_open=False) -> float:
  """A static Python number in ``[low, high]`` (``(low, ...`` when `low_open`), else an error."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Real, np.ndarray, Array)
  ):
    raise TypeError(_err(f"`{name}` must be a Python float; got {type(value).__name__} {value!r}"))
  try:
    v = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise TypeError(
      _err(
        f"`{name}` must be a static Python float (it shapes the computation), not a traced "
        "array; pass it as a number outside jit"
      )
    ) from None
  bad = (
    not math.isfinite(v) or v < low or (low_open and v == low) or (high is not None and v > high)
  )
  if bad:
    lo = f"({low}" if low_open else f"[{low}"
    hi = f"{high}]" if high is not None else "inf)"
    raise ValueError(_err(f"`{name}` is {value!r}; accepted: a finite number in {lo}, {hi}"))
  return v


def _check_shapes(x: Array, w: Array, labels: Array, b: Array | None) -> None:
  shapes = f"x.shape={x.shape}, w.shape={w.shape}, labels.shape={labels.shape}"
  if x.ndim < 1:
    raise ValueError(_err(f"`x` must have rank >= 1 (..., features); got {shapes}"))
  if w.ndim != 2:
    raise ValueError(_err(f"`w` must have rank 2 (features, vocabulary); got {shapes}"))
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
      _err(f"`x` has {x.shape[-1]} features but `w` expects {w.shape[0]} ({shapes})")
    )
  if w.shape[1] == 0:
    raise ValueError(_err(f"`w` has an empty vocabulary ({shapes}); accepted: at least 1 column"))
  if labels.shape != x.shape[:-1]:
    raise ValueError(
      _err(f"`labels` must have x's shape without its last axis, {x.shape[:-1]}; got {shapes}")
    )
  if b is not None and b.shape != (w.shape[1],):
    raise ValueError(
      _err(f"`bias` has shape {b.shape}; accepted: ({w.shape[1]},) (w's vocabulary) or None")
    )


def _as_labels(labels) -> Array:
  labels = validation.as_real_array(_FN, labels, "labels")
  if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.dtype == jnp.bool_:
    raise TypeError(
      _err(
        f"`labels` has dtype {labels.dtype}; accepted: an integer dtype (class indices in "
        "[0, vocabulary))"
      )
    )
  return labels


def _as_where(where, shape) -> Array | None:
  if where is None:
    return None
  where = validation.as_real_array(_FN, where, "where")
  if where.dtype != jnp.bool_:
    raise TypeError(_err(f"`where` has dtype {where.dtype}; accepted: bool (or None)"))
  try:
    ok = np.broadcast_shapes(where.shape, shape) == shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
      _err(f"`where` has shape {where.shape}, which does not broadcast to labels' shape {shape}")
    )
  return jnp.broadcast_to(where, shape)


def _concrete(a) -> bool:
  return a is None or not isinstance(a, jax.core.Tracer)


def _check_label_range(labels: Array, where: Array | None, vocab: int) -> None:
  """ValueError for counted labels outside ``[0, V)``, when the labels (and `where`) are concrete
  values; under ``jit`` they cannot be read and give a loss of +inf instead (documented)."""
  if not (_concrete(labels) and _concrete(where)) or labels.size == 0:
    return
  lab = np.asarray(labels)
  bad = (lab < 0) | (lab >= vocab)
  if where is not None:
    bad &= np.asarray(where)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      _err(
        f"`labels` holds {int(bad.sum())} value(s) outside [0, {vocab}) where they count, e.g. "
        f"labels[{', '.join(map(str, first))}] = {int(lab[first])}; mask such tokens with `where` "
        "(e.g. where=labels >= 0 for a padding label of -100)"
      )
    )


def linear_cross_entropy(
  x: ArrayLike,
  w: ArrayLike,
  labels: ArrayLike,
  *,
  bias: ArrayLike | None = None,
  where: ArrayLike | None = None,
  reduction: Literal["mean", "sum", "none"] = "mean",
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  logit_soft_cap: float | None = None,
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
  vocab_block_size: int | None = None,
) -> Array:
  r"""Softmax cross-entropy of ``x @ w + bias`` against integer labels, without the logits.

  For each token :math:`t` with logits :math:`z_t = x_t W + b` and (optionally soft-capped) logits
  :math:`s_t = c \tanh(z_t / c)`, the loss is

  .. math::
    \ell_t = \operatorname{lse}(s_t) - (1 - \alpha)\, s_{t, y_t}
      - \frac{\alpha}{V} \sum_v s_{t, v} + \lambda \operatorname{lse}(s_t)^2,

  optax's ``softmax_cross_entropy`` with labels smoothed by :math:`\alpha` (``label_smoothing``)
  plus PaLM's z-loss :math:`\lambda` (``z_loss``) and Gemma 2's soft cap :math:`c`
  (``logit_soft_cap``), reduced over the tokens that ``where`` selects.

  One ``custom_vjp`` keeps ``x``, ``w``, ``bias``, ``labels`` and one log-sum-exp a token (float32;
  float64 for float64 inputs) for the backward pass, which recomputes the logits block by block in
  exactly the forward's precision. No (tokens, vocabulary) array exists in either pass: the XLA
  path loops over blocks of ``vocab_block_size`` columns of ``w`` with an online log-sum-exp, and
  writes each block of ``dw`` from one matmul over all tokens (no weight-sized float32
  accumulator). Half precision inputs are multiplied with float32 accumulation and every logit,
  statistic and loss is float32.

  Masked vocabulary entries (a ``bias`` of ``-inf``) have probability 0, count in neither the
  smoothing term nor the soft cap, and get zero gradients; the loss and gradients stay finite as
  long as each counted label's own logit is finite. Logits of any finite size never overflow. A
  tied embedding passes ``w=emb.T``: XLA folds the transpose into the matmuls (no copy of the
  table).

  Labels outside ``[0, V)`` that count (``where`` True) raise ``ValueError`` when the labels are
  concrete; under ``jit`` such a token's loss is ``+inf`` (never NaN) and its gradient is the
  softmax term alone. Mask padding tokens with ``where`` (e.g. ``where=labels >= 0``).

  Args:
    x: inputs of shape ``(..., D)``, floating point.
    w: the head's kernel, ``(D, V)``.
    labels: integer class indices of shape ``x.shape[:-1]``.
    bias: ``(V,)`` or None.
    where: bool, broadcastable to ``labels``' shape: the tokens that count (numpy's ``where`` of a
      reduction); None counts all.
    reduction: ``"mean"`` over the counted tokens (0, with zero gradients, when none count),
      ``"sum"``, or ``"none"``: the per-token losses, 0 where ``where`` is False.
    label_smoothing: :math:`\alpha \in [0, 1]`, as ``optax.smooth_labels``.
    z_loss: :math:`\lambda \ge 0`.
    logit_soft_cap: :math:`c > 0`, or None for no cap.
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    implementation: ``None`` (the best measured: XLA, see the dispatch docs), ``"xla"``, or
      ``"mosaic"`` (the Hopper kernels: the forward's statistics, and the backward's
      softmax-minus-one-hot blocks for XLA's products; raises ``NotImplementedError`` where they
      cannot run).
    vocab_block_size: columns of ``w`` per block of the backward (and of the XLA path's forward);
      None: chosen from the sizes, about 8 MiB of float32 logits a block on CPU, 256 MiB for a GPU,
      and for ``"mosaic"`` a multiple of 256 that divides V.

  Returns:
    The loss: a scalar, or ``labels.shape`` for ``reduction="none"``; float32 for half precision
    and float32 inputs, float64 for float64.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> w = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> labels = jnp.array([0, 2])
    >>> round(float(jaxact.linear_cross_entropy(x, w, labels)), 4)
    0.3955
    >>> jaxact.linear_cross_entropy(x, w, labels, reduction="none").round(4).tolist()
    [0.2395, 0.5514]
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    dispatch.check_implementation(_FN, implementation)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
      raise ValueError(
        _err(f"`reduction` {reduction!r} is not known; choose one of: {', '.join(REDUCTIONS)}")
      )
    alpha = _number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    lam = _number("z_loss", z_loss, low=0.0)
    cap = None
    if logit_soft_cap is not None:
      cap = _number("logit_soft_cap", logit_soft_cap, low=0.0, low_open=True)
    arrays, acc, _ = args.prepare_arrays(_FN, {"x": x, "w": w, "bias": bias}, None)
    x, w, b = arrays["x"], arrays["w"], arrays["bias"]
    labels = _as_labels(labels)
    _check_shapes(x, w, labels, b)
    where = _as_where(where, labels.shape)
    vocab, tokens = w.shape[1], math.prod(labels.shape)
    _check_label_range(labels, where, vocab)
    if vocab_block_size is None:
      block = default_block(tokens, vocab, gpu=dispatch.target().cuda)
      if implementation == "mosaic":  # whole blocks of the backward kernel's 256 columns
        block = kernel_block(block, vocab)
    elif (
      isinstance(vocab_block_size, bool)
      or not isinstance(vocab_block_size, (int, np.integer))
      or vocab_block_size < 1
    ):
      raise ValueError(
        _err(f"`vocab_block_size` is {vocab_block_size!r}; accepted: a positive int or None")
      )
    else:
      block = min(int(vocab_block_size), vocab)

    out_dtype = np.dtype(acc)
    if tokens == 0:  # nothing to reduce: 0 (mean, sum) or an empty array, with zero gradients
      return jnp.zeros(labels.shape if reduction == "none" else (), out_dtype)
    plan = LcePlan(
      block=block,
      label_smoothing=alpha,
      z_loss=lam,
      soft_cap=cap,
      precision=args.hashable_precision(precision),
      acc_dtype=out_dtype,
    )
    decision = dispatch.decide_lce(_FN, implementation, plan, x, w)
    plan = dataclasses.replace(plan, decision=decision)
    # int32 for the kernels and the column arithmetic; out-of-range values stay out of range.
    labels32 = jnp.clip(labels, -1, vocab).astype(jnp.int32)
    loss = per_token_loss(plan, x, w, b, labels32, where)
    if reduction == "none":
      return loss
    total = jnp.sum(loss)
    if reduction == "sum":
      return total
    count = tokens if where is None else jnp.sum(where, dtype=jnp.int32)
    return total / jnp.maximum(count, 1).astype(out_dtype)
