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
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import args, dispatch, shardings
from jaxact._src.core.dispatch import Implementation
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import rules
from jaxact._src.lce.plan import LcePlan, t5x_smoothing
from jaxact._src.lce.vjp import per_token_loss

REDUCTIONS = ("mean", "sum", "none")
SMOOTHING_STYLES = ("optax", "t5x")
_FN = "linear_cross_entropy"


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
      2048 columns on a TPU v6e and 512 on a v5p or v5e, and for ``"mosaic"`` a multiple of 256
      that divides V.

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
        checks.err(
          _FN, f"`reduction` {reduction!r} is not known; choose one of: {', '.join(REDUCTIONS)}"
        )
      )
    if not isinstance(label_smoothing_style, str) or label_smoothing_style not in SMOOTHING_STYLES:
      raise ValueError(
        checks.err(
          _FN,
          f"`label_smoothing_style` {label_smoothing_style!r} is not known; choose one of: "
          f"{', '.join(SMOOTHING_STYLES)}",
        )
      )
    checks.w_layout(_FN, w_layout)
    checks.flag(_FN, "return_predictions", return_predictions)
    alpha = checks.number(_FN, "label_smoothing", label_smoothing, low=0.0, high=1.0)
    lam = checks.number(_FN, "z_loss", z_loss, low=0.0)
    cap = None
    if logit_soft_cap is not None:
      cap = checks.number(_FN, "logit_soft_cap", logit_soft_cap, low=0.0, low_open=True)
    arrays, acc, _ = args.prepare_arrays(_FN, {"x": x, "w": w, "bias": bias}, None)
    x, w, b = arrays["x"], arrays["w"], arrays["bias"]
    labels = checks.as_labels(_FN, labels)
    vocab = checks.check_shapes(_FN, x, w, labels, b, w_layout)
    out_dtype = np.dtype(acc)
    where = checks.as_where(_FN, where, labels.shape)
    weights = checks.as_weights(_FN, weights, labels.shape, out_dtype)
    tokens = math.prod(labels.shape)
    checks.check_label_range(_FN, labels, where, weights, vocab)
    offset = 0.0
    if label_smoothing_style == "t5x":
      if vocab == 1 and alpha > 0:
        raise ValueError(
          checks.err(
            _FN,
            f"`label_smoothing` {label_smoothing!r} with label_smoothing_style='t5x' spreads over "
            "the V - 1 classes other than the label, and V = 1 has none; use 0 or 'optax'",
          )
        )
      alpha, offset = t5x_smoothing(alpha, vocab)
    block = checks.block_size(_FN, vocab_block_size, tokens, vocab, implementation)

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
    labels32 = checks.labels_int32(labels, vocab)
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
