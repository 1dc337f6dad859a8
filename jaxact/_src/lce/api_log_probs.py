"""Per-token log-probabilities (and the softmax's entropy) of the LM head without the logits:
:func:`linear_log_probs`, the primitive of post-training (policy-gradient, preference and
distillation losses).

Without the entropy, ``log p(y) = s_y - m - log se`` is minus the per-token cross-entropy without
smoothing or z-loss, so the op is :func:`jaxact._src.lce.vjp.per_token_loss` negated: the same
plan, backend decision, vocabulary loop, sharding and backward (its gradient is the loss's with the
cotangent negated). The temperature and the soft cap are the plan's logit transforms, applied by
the forward and the backward alike; the entropy is one more number a token accumulated in the same
loop (:mod:`jaxact._src.lce.xla_tiles`).
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
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.vjp import per_token_loss

_FN = "linear_log_probs"


def linear_log_probs(
  x: ArrayLike,
  w: ArrayLike,
  tokens: ArrayLike,
  *,
  bias: ArrayLike | None = None,
  where: ArrayLike | None = None,
  temperature: float = 1.0,
  logit_soft_cap: float | None = None,
  return_entropy: bool = False,
  w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
  vocab_block_size: int | None = None,
) -> Array | tuple[Array, Array]:
  r"""Log-probability of each token under the softmax of ``x @ w + bias``, without the logits.

  For each position :math:`t` with logits :math:`z_t = x_t W + b`, (optionally soft-capped)
  logits :math:`c \tanh(z_t / c)` and temperature :math:`T`, the softmax reads
  :math:`s_t = c \tanh(z_t / c) / T` (sampling-temperature semantics, as vLLM and tunix apply it)
  and the op returns

  .. math::
    \log p_t(y_t) = s_{t, y_t} - \operatorname{lse}(s_t), \qquad
    H_t = \operatorname{lse}(s_t) - \sum_v p_t(v)\, s_{t, v}
      = -\sum_v p_t(v) \log p_t(v),

  the second (the entropy of the whole distribution) with ``return_entropy=True``. Both are
  differentiable in ``x``, ``w`` and ``bias``, with cotangents on either or both:
  :math:`\partial \log p(y) / \partial s_v = [v = y] - p(v)` and
  :math:`\partial H / \partial s_v = -p(v) (s_v - \mathbb{E}_p[s])`, times
  :math:`\partial s / \partial z = (1 - \tanh^2(z / c)) / T`.

  One ``custom_vjp`` keeps ``x``, ``w``, ``bias``, the tokens and two numbers a position
  (float32; float64 for float64 inputs): each row's largest logit :math:`m` and its sum of
  exponentials :math:`\sum_v e^{s_v - m}`, kept apart; with the entropy a third,
  :math:`\sum_v e^{s_v - m} (s_v - m)`. No (tokens, vocabulary) array exists in either pass: the
  forward loops over blocks of ``vocab_block_size`` columns of ``w`` with an online log-sum-exp
  (the entropy's sum rescaled with it when the running max moves), and the backward recomputes
  each block's logits from ``x`` and ``w``. It is :func:`jaxact.linear_cross_entropy`'s machinery
  (``log p(y)`` is minus the cross-entropy without smoothing): the same blocked XLA path, the same
  sharding (tokens split over data axes, the vocabulary over model axes: each device's sums
  rescaled to the global max and summed) and the same Hopper kernels where they apply.

  Numerics: half precision inputs are multiplied with float32 accumulation and every logit,
  statistic and output is float32. Both outputs are formed from differences to each row's max
  (:math:`\log p(y) = (s_y - m) - \log \sum e^{s - m}`,
  :math:`H = \log \sum e^{s - m} - \sum e^{s - m}(s - m) / \sum e^{s - m}`), exact for equal
  logits of -1e9 (:math:`H = \log V`) or 1e30; logits of any finite size never overflow, and the
  entropy is at least 0. The temperature multiplies those differences (the max is kept before it),
  never a logit, so the float32 gradients are as accurate at :math:`T = 10^{-3}` as at 1, and any
  finite :math:`T > 0` is taken (float32's smallest normal, or one whose :math:`1 / T` float32
  cannot hold): a value past float32's range is :math:`\pm\infty`.

  Masking: ``where`` False gives 0 in both outputs and zero gradients there (the token there is
  not read: any value, out-of-range too, is ignored). A vocabulary entry whose ``bias`` is
  ``-inf`` has probability 0, contributes 0 to the entropy and gets zero gradients (no
  :math:`0 \cdot \infty` is formed). Tokens of every integer dtype are taken as their values;
  tokens outside ``[0, V)`` where ``where`` is True raise ``ValueError`` when concrete, and under
  ``jit`` give a log-probability of ``-inf`` (an impossible token). A row with no finite logit
  (every entry masked) has log-probability ``-inf`` and entropy 0.

  Args:
    x: hidden states ``(..., D)``, floating point.
    w: the head's kernel, ``(D, V)``; for ``w_layout="vd"``, ``(V, D)`` (an embedding table).
    tokens: integer token ids of shape ``x.shape[:-1]``, of any integer dtype.
    bias: ``(V,)`` or None; ``-inf`` entries mask those vocabulary entries.
    where: bool, broadcastable to ``tokens``' shape: the positions computed; None computes all.
    temperature: :math:`T > 0`, finite: the (capped) logits are divided by it.
    logit_soft_cap: :math:`c > 0`, or None for no cap (applied before the temperature).
    return_entropy: also return each position's softmax entropy :math:`H_t`.
    w_layout: ``"dv"`` (``w`` is ``(D, V)``, a Dense kernel) or ``"vd"`` (``w`` is ``(V, D)``:
      the logits are ``x @ w.T`` without a transposed copy).
    precision: of the matmuls, as :func:`jax.lax.dot_general` takes it.
    implementation: ``None`` (the best measured: XLA, see the dispatch docs), ``"xla"``, or
      ``"mosaic"`` (the Hopper kernels of :func:`jaxact.linear_cross_entropy`; raises
      ``NotImplementedError`` where they cannot run: with the entropy, a temperature other than 1,
      ``w_layout="vd"``, float64, ...).
    vocab_block_size: columns of ``w`` per block of the loops; None: chosen from the sizes, as
      :func:`jaxact.linear_cross_entropy` chooses it.

  Returns:
    The log-probabilities, of ``tokens``' shape: float32 for half precision and float32 inputs,
    float64 for float64. With ``return_entropy``, ``(log_probs, entropy)``, both of that shape and
    dtype.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> w = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> jaxact.linear_log_probs(x, w, jnp.array([0, 2])).round(4).tolist()
    [-0.2395, -0.5514]
    >>> logp, entropy = jaxact.linear_log_probs(
    ...     x, w, jnp.array([0, 2]), temperature=2.0, return_entropy=True)
    >>> entropy.round(4).tolist()
    [0.9753, 1.0684]
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    return log_probs(
      _FN,
      x,
      w,
      tokens,
      bias=bias,
      where=where,
      temperature=temperature,
      logit_soft_cap=logit_soft_cap,
      return_entropy=return_entropy,
      w_layout=w_layout,
      precision=precision,
      implementation=implementation,
      vocab_block_size=vocab_block_size,
    )


def log_probs(
  fn: str,
  x,
  w,
  tokens,
  *,
  bias,
  where,
  temperature,
  logit_soft_cap,
  return_entropy,
  w_layout,
  precision,
  implementation,
  vocab_block_size,
  where_name: str = "where",
):
  """:func:`linear_log_probs` for the public function `fn`, which calls `where` `where_name`:
  every error names `fn` and the argument as `fn` calls it."""
  dispatch.check_implementation(fn, implementation)
  checks.w_layout(fn, w_layout)
  entropy = checks.flag(fn, "return_entropy", return_entropy)
  temperature = checks.number(fn, "temperature", temperature, low=0.0, low_open=True)
  cap = None
  if logit_soft_cap is not None:
    cap = checks.number(fn, "logit_soft_cap", logit_soft_cap, low=0.0, low_open=True)
  arrays, acc, _ = args.prepare_arrays(fn, {"x": x, "w": w, "bias": bias}, None)
  x, w, b = arrays["x"], arrays["w"], arrays["bias"]
  tokens = checks.as_labels(fn, tokens, "tokens")
  vocab = checks.check_shapes(fn, x, w, tokens, b, w_layout, "tokens")
  out_dtype = np.dtype(acc)
  where = checks.as_where(fn, where, tokens.shape, "tokens", name=where_name)
  checks.check_label_range(fn, tokens, where, None, vocab, "tokens", mask=where_name)
  count = math.prod(tokens.shape)
  block = checks.block_size(fn, vocab_block_size, count, vocab, implementation)
  if count == 0:  # nothing to compute: empty outputs (zero gradients)
    empty = jnp.zeros(tokens.shape, out_dtype)
    return (empty, empty) if entropy else empty
  plan = LcePlan(
    block=block,
    soft_cap=cap,
    temperature=temperature,
    entropy=entropy,
    w_layout=w_layout,
    precision=args.hashable_precision(precision),
    acc_dtype=out_dtype,
    shardings=shardings.specs(x, w, b),
  )
  plan = dataclasses.replace(plan, decision=rules.decide(fn, implementation, plan, x, w))
  out = per_token_loss(plan, x, w, b, checks.labels_int32(tokens, vocab), where)
  loss, h = out if entropy else (out, None)
  logp = 0 - loss  # minus the cross-entropy; +0 (not -0) where masked
  return (logp, h) if entropy else logp
