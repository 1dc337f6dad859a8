"""Policy-gradient losses of RL post-training from the hidden states and the head, without logits:
:func:`policy_gradient_loss` (GRPO, DAPO, Dr. GRPO, GSPO, PPO-clip), on
:func:`jaxact.linear_log_probs`.

Each variant is the clipped surrogate of PPO (Schulman et al. 2017) with its own importance ratio
and normalisation; the per-token log-probabilities and entropies come from one
:func:`jaxact.linear_log_probs` call (its ``custom_vjp``: ``x``, ``w``, the tokens and three
numbers a token kept), and everything after them is a few (sequences, tokens) arrays.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import validation
from jaxact._src.core.dispatch import Implementation
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce.api_log_probs import log_probs

_FN = "policy_gradient_loss"
LossType = Literal["grpo", "dapo", "dr_grpo", "gspo", "ppo"]
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "ppo")
DAPO_EPSILON_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, section 3.1)


def _per_token(name: str, a, shape, dtype, *, sequence_ok: bool = False) -> Array | None:
  """`a` as a float array of the tokens' `shape` (or, with `sequence_ok`, of ``shape[:-1]``,
  one value a sequence, broadcast over its tokens)."""
  if a is None:
    return None
  a = validation.as_real_array(_FN, a, name)
  if not jnp.issubdtype(a.dtype, jnp.floating):
    a = a.astype(dtype)
  if a.shape == tuple(shape):
    return a.astype(dtype)
  if sequence_ok and a.shape == tuple(shape[:-1]):
    return jnp.broadcast_to(a[..., None], shape).astype(dtype)
  accepted = f"{tuple(shape)}"
  if sequence_ok:
    accepted += f" or {tuple(shape[:-1])} (one a sequence)"
  raise ValueError(checks.err(_FN, f"`{name}` has shape {a.shape}; accepted: {accepted}"))


def _difference(a: Array, b: Array) -> Array:
  """``a - b``, 0 where both are the same infinity (a log-probability past the float's range, as
  the sampling policy's was: a ratio of 1, not NaN; no gradient flows there)."""
  same = (a == b) & jnp.isinf(a)
  return jnp.where(same, 0, a) - jnp.where(same, 0, b)


def _surrogate(log_ratio: Array, adv: Array, low: float, high: float) -> tuple[Array, Array]:
  """``min(r A, clip(r, 1 - low, 1 + high) A)`` with ``r = exp(log_ratio)``, and where the clip
  binds. Written per sign of ``A`` (``A min(r, 1 + high)`` for ``A >= 0``, ``A max(r, 1 - low)``
  below), each as ``exp`` of a clipped log-ratio: a ratio that would overflow where the clip holds
  is never formed, so neither the value nor the gradient meets ``0 * inf``."""
  top, bottom = float(np.log1p(high)), float(np.log1p(-low))  # Python floats: log_ratio's dtype
  up, down = jnp.minimum(log_ratio, top), jnp.maximum(log_ratio, bottom)
  positive = adv >= 0
  value = adv * jnp.exp(jnp.where(positive, up, down))
  clipped = jnp.where(positive, log_ratio > top, log_ratio < bottom)
  return value, clipped & (adv != 0)


def policy_gradient_loss(
  x: ArrayLike,
  w: ArrayLike,
  tokens: ArrayLike,
  advantages: ArrayLike,
  *,
  mask: ArrayLike | None = None,
  old_log_probs: ArrayLike | None = None,
  ref_log_probs: ArrayLike | None = None,
  loss_type: LossType = "grpo",
  epsilon: float = 0.2,
  epsilon_high: float | None = None,
  beta: float = 0.0,
  entropy_coef: float = 0.0,
  max_length: int | None = None,
  bias: ArrayLike | None = None,
  temperature: float = 1.0,
  logit_soft_cap: float | None = None,
  w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
  vocab_block_size: int | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""The clipped policy-gradient loss of a batch of completions, from hidden states and the head.

  With :math:`\log\pi_t` the policy's log-probability of completion token :math:`t`
  (:func:`jaxact.linear_log_probs` of ``x``, ``w``, ``tokens``: no logits are built),
  :math:`\log\pi^{old}_t` the sampling policy's (``old_log_probs``; None: on-policy, the detached
  current ones, so every ratio is 1 and the gradient is the policy gradient) and :math:`A` the
  advantages (one a sequence or one a token), each variant minimises

  .. math::
    \mathcal{L} = -\sum_{i, t} \omega_{i t} \left[\min\left(r A,\
      \operatorname{clip}(r, 1 - \epsilon, 1 + \epsilon_{high}) A\right)
      - \beta\, \mathrm{KL}_{i t} + c_H H_{i t}\right]

  over the tokens ``mask`` selects, where

  * ``"grpo"`` (Shao et al. 2024, DeepSeekMath): token ratio :math:`r = \pi_t / \pi^{old}_t`,
    :math:`\omega = 1 / (|y_i| \cdot G)`: the mean over each sequence's tokens, then over the
    :math:`G` sequences;
  * ``"dapo"`` (Yu et al. 2025): token ratio, :math:`\omega = 1 / \sum_i |y_i|` (every token of the
    batch weighs the same), and DAPO's clip-higher :math:`\epsilon_{high} = 0.28` unless given;
  * ``"dr_grpo"`` (Liu et al. 2025, "Understanding R1-Zero-like training"): token ratio,
    :math:`\omega = 1 / (G \cdot L)` with the constant :math:`L` = ``max_length`` (the padded
    length ``tokens.shape[-1]`` by default): no length bias;
  * ``"gspo"`` (Zheng et al. 2025): the sequence ratio
    :math:`r_i = \exp(\frac{1}{|y_i|} \sum_t (\log\pi_t - \log\pi^{old}_t))` clipped per
    sequence (the paper's :math:`\epsilon` are of order 3e-4 and 4e-4), the GRPO weights;
  * ``"ppo"`` (Schulman et al. 2017): token ratio and advantages, the token mean of ``"dapo"``.

  :math:`\mathrm{KL}_{it}` is the k3 estimator of :math:`\mathrm{KL}(\pi \| \pi^{ref})`,
  :math:`e^{d} - d - 1` with :math:`d = \log\pi^{ref}_t - \log\pi_t` (``ref_log_probs``, weighted
  by ``beta``), and :math:`H_{it}` the entropy of the policy's whole softmax at token :math:`t`
  (weighted by ``entropy_coef``: a bonus).

  Numerics: the surrogate is formed from clipped log-ratios (a ratio that would overflow where the
  clip binds is never formed), so values and gradients stay finite wherever the plain formula's
  are; a sequence with no selected token weighs 0 (its length counts as 1), and a batch with none
  gives a loss of 0 with zero gradients. Half precision inputs are computed in float32.

  Args:
    x: the policy's hidden states at the completion positions, ``(..., T, D)``: the leading axes
      index the sequences (the group of completions).
    w: the head's kernel, ``(D, V)`` (``(V, D)`` for ``w_layout="vd"``).
    tokens: the completion tokens, ``x.shape[:-1]``, any integer dtype.
    advantages: one a sequence (``tokens.shape[:-1]``) or one a token (``tokens.shape``).
    mask: bool, ``tokens.shape``: the completion tokens that count (None: all).
    old_log_probs: the sampling policy's per-token log-probabilities, or None (on-policy).
    ref_log_probs: the reference policy's per-token log-probabilities (needed when ``beta != 0``).
    loss_type: ``"grpo"``, ``"dapo"``, ``"dr_grpo"``, ``"gspo"`` or ``"ppo"``.
    epsilon: the lower clip :math:`\epsilon`, in ``[0, 1)``.
    epsilon_high: the upper clip (None: ``epsilon``; ``"dapo"``: 0.28).
    beta: the KL coefficient (>= 0).
    entropy_coef: the entropy bonus's coefficient (>= 0).
    max_length: ``"dr_grpo"``'s constant :math:`L` (None: ``tokens.shape[-1]``).
    bias: the head's bias, ``(V,)``, or None.
    temperature: the logits are divided by it (the sampling temperature).
    logit_soft_cap: Gemma 2's soft cap of the logits, or None.
    w_layout: ``"dv"`` or ``"vd"``, as :func:`jaxact.linear_log_probs` takes it.
    precision: of the head's matmuls.
    implementation: the LM head's backend, as :func:`jaxact.linear_log_probs` takes it.
    vocab_block_size: columns of ``w`` a block of the vocabulary loop (None: chosen).

  Returns:
    ``(loss, metrics)``: the scalar loss (float32; float64 for float64 inputs) and, detached, what
    TRL's ``GRPOTrainer`` logs (formulas and sources in the post-training docs): ``"kl"`` and
    ``"entropy"`` (their means over the selected tokens, whatever the loss's weights),
    ``"clip_fraction"`` (TRL's ``clip_ratio/region_mean``: the fraction of the selected tokens
    whose clip binds; for ``"gspo"`` of all the sequences, an empty one never clipped), and
    jaxact's own ``"ratio"`` (the mean importance ratio over the selected tokens; over the
    non-empty sequences for ``"gspo"``) and ``"log_probs"`` (the per-token log-probabilities, 0
    where not selected: the next step's ``old_log_probs``).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxact
    >>> x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    >>> w = jax.random.normal(jax.random.key(1), (4, 10))
    >>> tokens = jnp.array([[1, 2, 3], [4, 5, 0]])
    >>> loss, metrics = jaxact.policy_gradient_loss(
    ...     x, w, tokens, jnp.array([1.0, -1.0]), mask=jnp.array([[1, 1, 1], [1, 1, 0]], bool))
    >>> float(metrics["ratio"]), float(metrics["clip_fraction"])
    (1.0, 0.0)
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    if loss_type not in LOSS_TYPES:
      raise ValueError(checks.err(_FN, f"`loss_type` is {loss_type!r}; accepted: {LOSS_TYPES}"))
    low = checks.number(_FN, "epsilon", epsilon, low=0.0, high=1.0)
    if low >= 1.0:
      raise ValueError(checks.err(_FN, f"`epsilon` must be below 1; got {epsilon!r}"))
    if epsilon_high is None:
      high = DAPO_EPSILON_HIGH if loss_type == "dapo" else low
    else:
      high = checks.number(_FN, "epsilon_high", epsilon_high, low=0.0)
    beta = checks.number(_FN, "beta", beta, low=0.0)
    entropy_coef = checks.number(_FN, "entropy_coef", entropy_coef, low=0.0)
    tokens = checks.as_labels(_FN, tokens, "tokens")
    if tokens.ndim < 2:
      raise ValueError(
        checks.err(_FN, f"`tokens` has shape {tokens.shape}; accepted: (..., T), sequences first")
      )
    length = max(tokens.shape[-1], 1) if max_length is None else max_length  # no token: any L
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
      raise ValueError(checks.err(_FN, f"`max_length` must be an int >= 1; got {max_length!r}"))
    if beta and ref_log_probs is None:
      raise ValueError(checks.err(_FN, "`beta` is not 0 but `ref_log_probs` is None"))
    mask = checks.as_where(_FN, mask, tokens.shape, "tokens", name="mask")
    logp, entropy = log_probs(
      _FN,
      x,
      w,
      tokens,
      bias=bias,
      where=mask,
      where_name="mask",
      temperature=temperature,
      logit_soft_cap=logit_soft_cap,
      return_entropy=True,
      w_layout=w_layout,
      precision=precision,
      implementation=implementation,
      vocab_block_size=vocab_block_size,
    )
    acc = logp.dtype
    shape = tokens.shape
    adv = _per_token("advantages", advantages, shape, acc, sequence_ok=True)
    old = _per_token("old_log_probs", old_log_probs, shape, acc)
    ref = _per_token("ref_log_probs", ref_log_probs, shape, acc)
    live = jnp.ones(shape, bool) if mask is None else mask
    count = live.astype(acc)
    lengths = jnp.sum(count, -1)  # tokens a sequence
    sequences = float(max(math.prod(shape[:-1]), 1))  # of a batch with none, the weights are 0
    old = lax.stop_gradient(logp) if old is None else jnp.where(live, old, 0)
    log_ratio = jnp.where(live, _difference(logp, old), 0)
    if loss_type == "gspo":  # one ratio a sequence, from its mean log-ratio
      seq_log_ratio = jnp.sum(log_ratio, -1) / jnp.maximum(lengths, 1)
      seq_adv = jnp.sum(adv * count, -1) / jnp.maximum(lengths, 1)  # the sequence's advantage
      seq_value, seq_clipped = _surrogate(seq_log_ratio, seq_adv, low, high)
      value = jnp.broadcast_to(seq_value[..., None], shape)
      ratio_of = jnp.exp(lax.stop_gradient(seq_log_ratio))
      # TRL's sequence-level mean: over every sequence, an empty one's ratio 1 (never clipped)
      clip_fraction = jnp.sum(seq_clipped) / sequences
      units = (lengths > 0).astype(acc)
    else:
      value, clipped = _surrogate(log_ratio, adv, low, high)
      ratio_of, units = jnp.exp(lax.stop_gradient(log_ratio)), count
      clip_fraction = None
    if loss_type in ("grpo", "gspo"):
      weight = count / (jnp.maximum(lengths, 1)[..., None] * sequences)
    elif loss_type == "dr_grpo":
      weight = count / (sequences * length)
    else:  # dapo, ppo: every selected token of the batch weighs the same
      weight = count / jnp.maximum(jnp.sum(count), 1)
    per_token = value
    kl = jnp.zeros(shape, acc)
    if ref is not None:
      d = jnp.where(live, _difference(ref, logp), 0)
      kl = jnp.expm1(d) - d  # k3: e^d - d - 1, exact near d = 0
      per_token = per_token - beta * kl
    per_token = per_token + entropy_coef * entropy
    loss = -jnp.sum(jnp.where(live, weight * per_token, 0))
    n_units, n_tokens = jnp.maximum(jnp.sum(units), 1), jnp.maximum(jnp.sum(count), 1)
    if clip_fraction is None:  # the token mean over the selected tokens, as TRL and Liger log it
      clip_fraction = jnp.sum(jnp.where(live, clipped, False)) / n_tokens
    metrics = {  # their formulas and sources: docs/post-training.md
      "kl": jnp.sum(jnp.where(live, kl, 0)) / n_tokens,
      "clip_fraction": clip_fraction,
      "entropy": jnp.sum(jnp.where(live, entropy, 0)) / n_tokens,
      "ratio": jnp.sum(jnp.where(units > 0, ratio_of, 0)) / n_units,
      "log_probs": logp,
    }
    return loss, jax.tree.map(lax.stop_gradient, metrics)
