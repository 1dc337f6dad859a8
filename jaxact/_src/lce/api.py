"""The LM head and its loss as one op: :func:`linear_cross_entropy`.

``softmax_cross_entropy(x @ w + b, labels)`` differentiated by JAX keeps the (tokens, vocabulary)
logits, their softmax and builds their gradient: with a 32k-256k vocabulary the largest arrays of a
language model's training step. The op here keeps ``x``, ``w``, ``b``, the labels and two float32
numbers a token (the row's largest logit and its sum of exponentials), and never builds an array
of that shape (:mod:`jaxact._src.lce.vjp`). This
module checks the arguments, builds the static plan (:mod:`jaxact._src.lce.plan`), asks
:mod:`jaxact._src.lce.rules` for the backend, and reduces the per-token losses (``where``,
``reduction``) in plain JAX, whose autodiff gives the rule its per-token cotangent.
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

from jaxact._src.core import args, dispatch, shardings, validation
from jaxact._src.core.dispatch import Implementation
from jaxact._src.lce import rules
from jaxact._src.lce.plan import LcePlan, default_block, kernel_block, t5x_smoothing
from jaxact._src.lce.vjp import per_token_loss

REDUCTIONS = ("mean", "sum", "none")
SMOOTHING_STYLES = ("optax", "t5x")
W_LAYOUTS = ("dv", "vd")
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


def _check_shapes(x: Array, w: Array, labels: Array, b: Array | None, layout: str) -> int:
  """The vocabulary size, after checking the shapes against each other."""
  shapes = f"x.shape={x.shape}, w.shape={w.shape}, labels.shape={labels.shape}"
  if x.ndim < 1:
    raise ValueError(_err(f"`x` must have rank >= 1 (..., features); got {shapes}"))
  axes = "(features, vocabulary)" if layout == "dv" else "(vocabulary, features): w_layout='vd'"
  if w.ndim != 2:
    raise ValueError(_err(f"`w` must have rank 2 {axes}; got {shapes}"))
  features, vocab = w.shape if layout == "dv" else w.shape[::-1]
  if x.shape[-1] != features:
    raise ValueError(
      _err(f"`x` has {x.shape[-1]} features but `w` expects {features} ({shapes}; w is {axes})")
    )
  if vocab == 0:
    raise ValueError(_err(f"`w` has an empty vocabulary ({shapes}); accepted: at least 1 class"))
  if labels.shape != x.shape[:-1]:
    raise ValueError(
      _err(f"`labels` must have x's shape without its last axis, {x.shape[:-1]}; got {shapes}")
    )
  if b is not None and b.shape != (vocab,):
    raise ValueError(
      _err(f"`bias` has shape {b.shape}; accepted: ({vocab},) (w's vocabulary) or None")
    )
  return vocab


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


def _broadcast(name: str, a: Array, shape) -> Array:
  try:
    ok = np.broadcast_shapes(a.shape, shape) == shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
      _err(f"`{name}` has shape {a.shape}, which does not broadcast to labels' shape {shape}")
    )
  return jnp.broadcast_to(a, shape)


def _as_where(where, shape) -> Array | None:
  if where is None:
    return None
  where = validation.as_real_array(_FN, where, "where")
  if where.dtype != jnp.bool_:
    raise TypeError(_err(f"`where` has dtype {where.dtype}; accepted: bool (or None)"))
  return _broadcast("where", where, shape)


def _as_weights(weights, shape, dtype) -> Array | None:
  if weights is None:
    return None
  weights = validation.as_real_array(_FN, weights, "weights")
  if not (jnp.issubdtype(weights.dtype, jnp.number) or weights.dtype == jnp.bool_) or (
    jnp.issubdtype(weights.dtype, jnp.complexfloating)
  ):
    raise TypeError(
      _err(f"`weights` has dtype {weights.dtype}; accepted: a real (float, int or bool) dtype")
    )
  return _broadcast("weights", weights, shape).astype(dtype)


def _labels_int32(labels: Array, vocab: int) -> Array:
  """`labels` as int32 with every value outside ``[0, V)`` mapped to -1 or V, whatever the
  dtype: converted before clipping where int32 holds every value of the dtype (so that -1 and V
  are not clipped in a dtype that cannot hold them: uint16, int8), clipped in the dtype itself
  where it is wider (int64, uint32, uint64 hold -1 where signed, and V)."""
  info = jnp.iinfo(labels.dtype)
  i32 = jnp.iinfo(jnp.int32)
  if i32.min <= info.min and info.max <= i32.max:
    return jnp.clip(labels.astype(jnp.int32), -1, vocab)
  low = jnp.asarray(max(info.min, -1), labels.dtype)
  return jnp.clip(labels, low, jnp.asarray(vocab, labels.dtype)).astype(jnp.int32)


def _concrete(a) -> bool:
  return a is None or not isinstance(a, jax.core.Tracer)


def _check_label_range(labels: Array, where: Array | None, weights: Array | None, vocab) -> None:
  """ValueError for counted labels outside ``[0, V)``, when the labels (and `where`, `weights`)
  are concrete values; under ``jit`` they cannot be read and give a loss of +inf instead
  (documented). A token counts where `where` is True and its weight is not 0."""
  if not (_concrete(labels) and _concrete(where) and _concrete(weights)) or labels.size == 0:
    return
  lab = np.asarray(labels)
  bad = (lab < 0) | (lab >= vocab)
  if where is not None:
    bad &= np.asarray(where)
  if weights is not None:
    bad &= np.asarray(weights) != 0
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
  weights: ArrayLike | None = None,
  reduction: Literal["mean", "sum", "none"] = "mean",
  label_smoothing: float = 0.0,
  label_smoothing_style: Literal["optax", "t5x"] = "optax",
  z_loss: float = 0.0,
  logit_soft_cap: float | None = None,
  return_predictions: bool = False,
  w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
  vocab_block_size: int | None = None,
) -> Array | tuple[Array, Array]:
  r"""Softmax cross-entropy of ``x @ w + bias`` against integer labels, without the logits.

  For each token :math:`t` with logits :math:`z_t = x_t W + b` and (optionally soft-capped) logits
  :math:`s_t = c \tanh(z_t / c)`, the loss is

  .. math::
    \ell_t = \operatorname{lse}(s_t) - (1 - \alpha)\, s_{t, y_t}
      - \frac{\alpha}{V} \sum_v s_{t, v} + \lambda \operatorname{lse}(s_t)^2,

  optax's ``softmax_cross_entropy`` with labels smoothed by :math:`\alpha` (``label_smoothing``)
  plus PaLM's z-loss :math:`\lambda` (``z_loss``) and Gemma 2's soft cap :math:`c`
  (``logit_soft_cap``), reduced over the tokens that ``where`` selects, each weighted by its
  ``weights`` entry when given.

  ``label_smoothing_style="t5x"`` smooths as T5X's ``compute_weighted_cross_entropy`` (and flax's
  ``examples/gemma`` ``train.py``): the label gets :math:`1 - \alpha`, every other class
  :math:`\alpha / (V - 1)` (optax: :math:`\alpha / V` on every class on top of
  :math:`1 - \alpha`), and the loss subtracts the targets' entropy
  :math:`-(1 - \alpha) \log(1 - \alpha) - \alpha \log(\alpha / (V - 1))`, T5X's normalizing
  constant, so that the loss is 0 when the softmax equals the targets. That is optax's loss with
  smoothing :math:`\alpha V / (V - 1)` minus the constant (1.36 at :math:`\alpha = 0.1`,
  V = 32000).

  One ``custom_vjp`` keeps ``x``, ``w``, ``bias``, ``labels`` and two numbers a token (float32;
  float64 for float64 inputs), each row's largest logit and its sum of exponentials (kept apart:
  one log-sum-exp loses the sum next to logits of -1e9), for the backward pass, which recomputes
  the logits block by block in exactly the forward's precision. No (tokens, vocabulary) array
  exists in either pass: the XLA path loops over blocks of ``vocab_block_size`` columns of ``w``
  with an online log-sum-exp, and writes each block of ``dw`` from one matmul over all tokens (no
  weight-sized float32 accumulator). Half precision inputs are multiplied with float32
  accumulation and every logit, statistic and loss is float32.

  Masked vocabulary entries (a ``bias`` of ``-inf``) have probability 0, count in neither the
  smoothing term nor the soft cap, and get zero gradients; the loss and gradients stay finite as
  long as each counted label's own logit is finite. Logits of any finite size never overflow, and
  the loss is formed from their differences to each row's max: exact for equal logits of -1e9 or
  1e30. ``jax.debug_infs`` stays quiet for finite inputs. A
  tied embedding passes its table as it is with ``w_layout="vd"``: the loop slices its rows, and
  no transposed copy of the table exists (``w=emb.T`` works too; XLA:CPU copies the table then).

  Labels of every integer dtype are taken as their values (uint16 token ids of a 50k vocabulary,
  int8 labels of a larger one). Labels outside ``[0, V)`` that count (``where`` True, weight not
  0) raise ``ValueError`` when the labels are concrete; under ``jit`` such a token's loss is
  ``+inf`` and its gradient the softmax term alone. A NaN in ``x`` (or ``w``, ``bias``) gives that
  token a NaN loss: ``+inf`` means an impossible label, NaN a diverged input. Mask padding tokens
  with ``where`` (e.g. ``where=labels >= 0``) or a weight of 0.

  Args:
    x: inputs of shape ``(..., D)``, floating point (D may be 0: every logit is then the bias).
    w: the head's kernel, ``(D, V)``; for ``w_layout="vd"``, ``(V, D)`` (an embedding table).
    labels: integer class indices of shape ``x.shape[:-1]``, of any integer dtype.
    bias: ``(V,)`` or None.
    where: bool, broadcastable to ``labels``' shape: the tokens that count (numpy's ``where`` of a
      reduction); None counts all.
    weights: real numbers broadcastable to ``labels``' shape, or None: each counted token's loss is
      multiplied by its weight, and ``"mean"`` divides by the sum of the counted tokens' weights
      (T5X's and flax's ``examples/gemma``'s weighted loss). A token of weight 0 counts as one
      where ``where`` is False: its loss is 0 even if it would be ``+inf`` or NaN. Liger-Kernel's
      per-class ``ce_weight`` is ``weights=ce_weight[labels]`` without smoothing and z-loss (Liger
      leaves its z-loss unweighted and weights its smoothing term by class).
    reduction: ``"mean"`` over the counted tokens (0, with zero gradients, when none count or
      their weights sum to 0), ``"sum"``, or ``"none"``: the per-token (weighted) losses, 0 where
      ``where`` is False.
    label_smoothing: :math:`\alpha \in [0, 1]`.
    label_smoothing_style: ``"optax"`` (``optax.smooth_labels``) or ``"t5x"`` (T5X's, above).
    z_loss: :math:`\lambda \ge 0`.
    logit_soft_cap: :math:`c > 0`, or None for no cap.
    return_predictions: also return each token's predicted class, the argmax of its (capped,
      biased) logits computed in the same pass as the loss (no logits array), for an accuracy
      metric: ``jnp.argmax(logits, -1)`` (the first of equal maxima), int32 of ``labels``' shape,
      for every token whatever ``where`` and ``weights`` say.
    w_layout: ``"dv"`` (default: ``w`` is ``(D, V)``, a Dense kernel) or ``"vd"`` (``w`` is
      ``(V, D)``, an ``nn.Embed`` table: the logits are ``x @ w.T`` without a transposed copy).
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    implementation: ``None`` (the best measured: XLA, see the dispatch docs), ``"xla"``, or
      ``"mosaic"`` (the Hopper kernels: the forward's statistics, and the backward's
      softmax-minus-one-hot blocks for XLA's products; raises ``NotImplementedError`` where they
      cannot run, e.g. with ``return_predictions`` or ``w_layout="vd"``).
    vocab_block_size: columns of ``w`` per block of the backward (and of the XLA path's forward);
      None: chosen from the sizes, about 8 MiB of float32 logits a block on CPU, 256 MiB for a GPU,
      and for ``"mosaic"`` a multiple of 256 that divides V.

  Returns:
    The loss: a scalar, or ``labels.shape`` for ``reduction="none"``; float32 for half precision
    and float32 inputs, float64 for float64. With ``return_predictions``, ``(loss, predictions)``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> w = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> labels = jnp.array([0, 2])
    >>> round(float(jaxact.linear_cross_entropy(x, w, labels)), 4)
    0.3955
    >>> jaxact.linear_cross_entropy(x, w, labels, reduction="none").round(4).tolist()
    [0.2395, 0.5514]
    >>> loss, predictions = jaxact.linear_cross_entropy(x, w, labels, return_predictions=True)
    >>> predictions.tolist()
    [0, 2]
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    dispatch.check_implementation(_FN, implementation)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
      raise ValueError(
        _err(f"`reduction` {reduction!r} is not known; choose one of: {', '.join(REDUCTIONS)}")
      )
    if not isinstance(label_smoothing_style, str) or label_smoothing_style not in SMOOTHING_STYLES:
      raise ValueError(
        _err(
          f"`label_smoothing_style` {label_smoothing_style!r} is not known; choose one of: "
          f"{', '.join(SMOOTHING_STYLES)}"
        )
      )
    if not isinstance(w_layout, str) or w_layout not in W_LAYOUTS:
      raise ValueError(
        _err(
          f"`w_layout` {w_layout!r} is not known; choose one of: 'dv' (w is (D, V)), 'vd' (w is "
          "(V, D), an embedding table)"
        )
      )
    if not isinstance(return_predictions, (bool, np.bool_)):
      raise TypeError(
        _err(
          f"`return_predictions` must be a Python bool; got {type(return_predictions).__name__} "
          f"{return_predictions!r}"
        )
      )
    alpha = _number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    lam = _number("z_loss", z_loss, low=0.0)
    cap = None
    if logit_soft_cap is not None:
      cap = _number("logit_soft_cap", logit_soft_cap, low=0.0, low_open=True)
    arrays, acc, _ = args.prepare_arrays(_FN, {"x": x, "w": w, "bias": bias}, None)
    x, w, b = arrays["x"], arrays["w"], arrays["bias"]
    labels = _as_labels(labels)
    vocab = _check_shapes(x, w, labels, b, w_layout)
    out_dtype = np.dtype(acc)
    where = _as_where(where, labels.shape)
    weights = _as_weights(weights, labels.shape, out_dtype)
    tokens = math.prod(labels.shape)
    _check_label_range(labels, where, weights, vocab)
    offset = 0.0
    if label_smoothing_style == "t5x":
      if vocab == 1 and alpha > 0:
        raise ValueError(
          _err(
            f"`label_smoothing` {label_smoothing!r} with label_smoothing_style='t5x' spreads over "
            "the V - 1 classes other than the label, and V = 1 has none; use 0 or 'optax'"
          )
        )
      alpha, offset = t5x_smoothing(alpha, vocab)
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

    if tokens == 0:  # nothing to reduce: 0 (mean, sum) or an empty array, with zero gradients
      loss = jnp.zeros(labels.shape if reduction == "none" else (), out_dtype)
      return (loss, jnp.zeros(labels.shape, jnp.int32)) if return_predictions else loss
    plan = LcePlan(
      block=block,
      label_smoothing=alpha,
      z_loss=lam,
      soft_cap=cap,
      loss_offset=offset,
      predictions=bool(return_predictions),
      w_layout=w_layout,
      precision=args.hashable_precision(precision),
      acc_dtype=out_dtype,
      shardings=shardings.specs(x, w, b),
    )
    decision = rules.decide(_FN, implementation, plan, x, w)
    plan = dataclasses.replace(plan, decision=decision)
    labels32 = _labels_int32(labels, vocab)
    counted = where
    if weights is not None:  # a token of weight 0 is masked: no +inf made for its label
      counted = weights != 0 if where is None else where & (weights != 0)
    loss = per_token_loss(plan, x, w, b, labels32, counted)
    predictions = None
    if return_predictions:
      loss, predictions = loss
    loss = _reduce(loss, where, weights, reduction, tokens)
    return (loss, predictions) if return_predictions else loss


def _reduce(loss: Array, where: Array | None, weights: Array | None, reduction: str, tokens: int):
  """The reduction of the per-token losses (0 where `where` is False), weighted."""
  count = tokens if where is None else jnp.sum(where, dtype=jnp.int32)
  if weights is not None:
    if where is not None:
      weights = jnp.where(where, weights, 0)
    # A weight of 0 drops the token, even an impossible one (+inf) or a NaN.
    loss = jnp.where((weights == 0) & ~jnp.isfinite(loss), 0, loss) * weights
    count = jnp.sum(weights)
  if reduction == "none":
    return loss
  total = jnp.sum(loss)
  if reduction == "sum":
    return total
  if weights is not None:
    return total / jnp.where(count == 0, 1, count)
  return total / jnp.maximum(count, 1).astype(loss.dtype)
