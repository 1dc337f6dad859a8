"""Policy-gradient losses of RL post-training from the hidden states and the head, without logits:
:func:`policy_gradient_loss` (GRPO, DAPO, Dr. GRPO, GSPO, PPO-clip, CISPO, SAPO, with TRL
``GRPOTrainer``'s options), on :func:`jaxact.linear_log_probs`.

The per-token log-probabilities and entropies come from one :func:`jaxact.linear_log_probs` call
(its ``custom_vjp``: ``x``, ``w``, the tokens and three numbers a token kept), and everything after
them (``api_policy_losses``: each loss type's objective, the masks, the weights) is a few
(sequences, tokens) arrays.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.core import validation
from jaxact._src.core.dispatch import Implementation
from jaxact._src.lce import api_checks as checks
from jaxact._src.lce import api_policy_losses as losses
from jaxact._src.lce.api_log_probs import log_probs

_FN = "policy_gradient_loss"
LossType = Literal["grpo", "dapo", "dr_grpo", "gspo", "ppo", "cispo", "sapo"]
SamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


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
  delta: float | None = None,
  beta: float = 0.0,
  use_bias_correction_kl: bool = False,
  entropy_coef: float = 0.0,
  top_entropy_quantile: float = 1.0,
  sampling_log_probs: ArrayLike | None = None,
  importance_sampling_mode: SamplingMode = "sequence_mask",
  importance_sampling_clip_min: float | None = None,
  importance_sampling_clip_max: float | None = 3.0,
  off_policy_mask_threshold: float | None = None,
  sapo_temperature_pos: float = 1.0,
  sapo_temperature_neg: float = 1.05,
  max_length: int | None = None,
  num_items_in_batch: int | ArrayLike | None = None,
  bias: ArrayLike | None = None,
  temperature: float = 1.0,
  logit_soft_cap: float | None = None,
  w_layout: Literal["dv", "vd"] = "dv",
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
  vocab_block_size: int | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""The policy-gradient loss of a batch of completions, from hidden states and the head.

  With :math:`\log\pi_t` the policy's log-probability of completion token :math:`t`
  (:func:`jaxact.linear_log_probs` of ``x``, ``w``, ``tokens``: no logits are built),
  :math:`\log\pi^{old}_t` the sampling policy's (``old_log_probs``; None: on-policy, the detached
  current ones, so every ratio is 1 and the gradient is the policy gradient) and :math:`A` the
  advantages (one a sequence or one a token), each variant minimises

  .. math::
    \mathcal{L} = -\sum_{i, t} \omega_{i t} \left[\rho_{i t}\, m^{H}_{i t} m^{off}_{i t}\,
      f(r, A) - \beta\, \mathrm{KL}_{i t} + c_H m^{H}_{i t} H_{i t}\right]

  over the tokens ``mask`` selects, where for the clipped losses
  :math:`f = \min(\min(r, \delta) A, \operatorname{clip}(r, 1 - \epsilon, 1 + \epsilon_{high}) A)`
  (``delta``: INTELLECT-2's cap of the unclipped ratio, None: none) and

  * ``"grpo"`` (Shao et al. 2024, DeepSeekMath): token ratio :math:`r = \pi_t / \pi^{old}_t`,
    :math:`\omega = 1 / (|y_i| \cdot G)`: the mean over each sequence's tokens, then over the
    :math:`G` sequences;
  * ``"dapo"`` (Yu et al. 2025): token ratio, :math:`\omega = 1 / \sum_i |y_i|` (every token of the
    batch weighs the same; ``num_items_in_batch`` in place of the sum when given), and DAPO's
    clip-higher :math:`\epsilon_{high} = 0.28` unless given;
  * ``"dr_grpo"`` (Liu et al. 2025, "Understanding R1-Zero-like training"): token ratio,
    :math:`\omega = 1 / (G \cdot L)` with the constant :math:`L` = ``max_length`` (the padded
    length ``tokens.shape[-1]`` by default): no length bias;
  * ``"gspo"`` (Zheng et al. 2025): the sequence ratio
    :math:`r_i = \exp(\frac{1}{|y_i|} \sum_t (\log\pi_t - \log\pi^{old}_t))` clipped per
    sequence (the paper's :math:`\epsilon` are of order 3e-4 and 4e-4), the GRPO weights;
  * ``"ppo"`` (Schulman et al. 2017): token ratio and advantages, the weights of ``"dapo"``;
  * ``"cispo"`` (MiniMax-M1): :math:`f = \mathrm{sg}(\min(r, \epsilon_{high})) A \log\pi_t`, the
    ratio capped at ``epsilon_high`` (5.0, ScaleRL's, unless given) and detached, the weights of
    ``"dapo"``;
  * ``"sapo"`` (Gao et al. 2025): :math:`f = A \sigma(\tau (r - 1)) 4 / \tau`, :math:`\tau` =
    ``sapo_temperature_pos`` where :math:`A > 0`, else ``sapo_temperature_neg``; GRPO's weights.

  :math:`\mathrm{KL}_{it}` is the k3 estimator of :math:`\mathrm{KL}(\pi \| \pi^{ref})`,
  :math:`e^{d} - d - 1` with :math:`d = \log\pi^{ref}_t - \log\pi_t` (``ref_log_probs``, weighted
  by ``beta``; times the ratio :math:`r` with ``use_bias_correction_kl``), and :math:`H_{it}` the
  entropy of the policy's whole softmax at token :math:`t` (weighted by ``entropy_coef``: a
  bonus). The masks and the correction are TRL ``GRPOTrainer``'s: :math:`m^{H}` keeps the tokens
  whose (detached) entropy is in the top ``top_entropy_quantile`` of the selected ones';
  :math:`m^{off}` (``off_policy_mask_threshold`` :math:`\delta_{off}`, DeepSeek-V3.2) drops a
  sequence whose advantage is negative and whose mean :math:`\log\pi^{samp} - \log\pi` exceeds
  :math:`\delta_{off}`; :math:`\rho` (with ``sampling_log_probs``, the log-probabilities of the
  engine that sampled, vLLM's) is :math:`\pi^{old} / \pi^{samp}` per token or its product over the
  sequence, truncated to or masked outside ``[clip_min, clip_max]`` (``importance_sampling_mode``).

  Numerics: the surrogates are formed from clipped log-ratios (a ratio that would overflow where a
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
    loss_type: ``"grpo"``, ``"dapo"``, ``"dr_grpo"``, ``"gspo"``, ``"ppo"``, ``"cispo"`` or
      ``"sapo"``.
    epsilon: the lower clip :math:`\epsilon`, in ``[0, 1)``.
    epsilon_high: the upper clip (None: ``epsilon``; ``"dapo"``: 0.28); ``"cispo"``'s cap of the
      ratio itself (None: 5.0).
    delta: the clipped losses' cap of the unclipped ratio (TRL's two-sided clip; INTELLECT-2
      advises a value above ``1 + epsilon_high``), or None.
    beta: the KL coefficient (>= 0).
    use_bias_correction_kl: multiply the k3 KL by the importance ratio (DeepSeek-V3.2).
    entropy_coef: the entropy bonus's coefficient (>= 0).
    top_entropy_quantile: the share of the selected tokens, by entropy, that the policy term and
      the entropy bonus keep, in ``[0, 1]`` (1: all; 0: the highest only).
    sampling_log_probs: the sampling engine's per-token log-probabilities (TRL's
      ``sampling_per_token_logps``), or None: no correction.
    importance_sampling_mode: ``"token_truncate"``, ``"token_mask"``, ``"sequence_truncate"`` or
      ``"sequence_mask"``, as TRL's ``vllm_importance_sampling_mode``.
    importance_sampling_clip_min: the correction's lower bound, or None.
    importance_sampling_clip_max: the correction's upper bound, or None.
    off_policy_mask_threshold: DeepSeek-V3.2's :math:`\delta_{off}` (>= 0), or None: no mask.
    sapo_temperature_pos: ``"sapo"``'s temperature where :math:`A > 0` (> 0).
    sapo_temperature_neg: ``"sapo"``'s temperature elsewhere (> 0).
    max_length: ``"dr_grpo"``'s constant :math:`L` (None: ``tokens.shape[-1]``).
    num_items_in_batch: ``"dapo"``, ``"ppo"``, ``"cispo"``: the selected tokens of the whole
      batch that this micro-batch is part of (a number or a scalar array), so that the
      micro-batches' losses and gradients add up to the whole batch's; None: this call's.
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
    whose clip binds; for ``"gspo"`` of all the sequences, an empty one never clipped; for
    ``"cispo"`` TRL's ``cispo_clip_ratio``; 0 for ``"sapo"``), and jaxact's own ``"ratio"`` (the
    mean importance ratio over the selected tokens; over the non-empty sequences for ``"gspo"``)
    and ``"log_probs"`` (the per-token log-probabilities, 0 where not selected: the next step's
    ``old_log_probs``).

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
    if loss_type not in losses.LOSS_TYPES:
      raise ValueError(
        checks.err(_FN, f"`loss_type` is {loss_type!r}; accepted: {losses.LOSS_TYPES}")
      )
    low = checks.number(_FN, "epsilon", epsilon, low=0.0, high=1.0)
    if low >= 1.0:
      raise ValueError(checks.err(_FN, f"`epsilon` must be below 1; got {epsilon!r}"))
    if epsilon_high is None:
      defaults = {"dapo": losses.DAPO_EPSILON_HIGH, "cispo": losses.CISPO_EPSILON_HIGH}
      high = defaults.get(loss_type, low)
    else:
      cap = loss_type == "cispo"  # a cap of the ratio itself: above 0
      high = checks.number(_FN, "epsilon_high", epsilon_high, low=0.0, low_open=cap)
    if delta is not None:
      delta = checks.number(_FN, "delta", delta, low=0.0, low_open=True)
    beta = checks.number(_FN, "beta", beta, low=0.0)
    bias_kl = checks.flag(_FN, "use_bias_correction_kl", use_bias_correction_kl)
    entropy_coef = checks.number(_FN, "entropy_coef", entropy_coef, low=0.0)
    top_q = checks.number(_FN, "top_entropy_quantile", top_entropy_quantile, low=0.0, high=1.0)
    clip_lo, clip_hi = losses.sampling_options(
      _FN, importance_sampling_mode, importance_sampling_clip_min, importance_sampling_clip_max
    )
    if off_policy_mask_threshold is not None:
      off_policy_mask_threshold = checks.number(
        _FN, "off_policy_mask_threshold", off_policy_mask_threshold, low=0.0
      )
    tau_pos, tau_neg = (
      checks.number(_FN, name, v, low=0.0, low_open=True)
      for name, v in (
        ("sapo_temperature_pos", sapo_temperature_pos),
        ("sapo_temperature_neg", sapo_temperature_neg),
      )
    )
    num_items = losses.item_count(_FN, num_items_in_batch)
    losses.check_options(
      _FN,
      loss_type,
      dict(
        delta=delta,
        num_items_in_batch=num_items_in_batch,
        sapo_temperature_pos=tau_pos,
        sapo_temperature_neg=tau_neg,
      ),
    )
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
    if bias_kl and ref_log_probs is None:
      raise ValueError(
        checks.err(_FN, "`use_bias_correction_kl` is set but `ref_log_probs` is None")
      )
    sampling_set = (importance_sampling_mode, clip_lo, clip_hi) != ("sequence_mask", None, 3.0)
    if sampling_set and sampling_log_probs is None:
      raise ValueError(
        checks.err(
          _FN,
          "`importance_sampling_mode`, `importance_sampling_clip_min` or "
          "`importance_sampling_clip_max` is set but `sampling_log_probs` is None (no correction)",
        )
      )
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
    sampling = _per_token("sampling_log_probs", sampling_log_probs, shape, acc)
    live = jnp.ones(shape, bool) if mask is None else mask
    count = live.astype(acc)
    lengths = jnp.sum(count, -1)  # tokens a sequence
    sequences = float(max(math.prod(shape[:-1]), 1))  # of a batch with none, the weights are 0
    old = lax.stop_gradient(logp) if old is None else jnp.where(live, old, 0)
    log_ratio = jnp.where(live, _difference(logp, old), 0)
    clipped = jnp.zeros(shape, bool)
    if loss_type == "gspo":  # one ratio a sequence, from its mean log-ratio
      seq_log_ratio = jnp.sum(log_ratio, -1) / jnp.maximum(lengths, 1)
      seq_adv = jnp.sum(adv * count, -1) / jnp.maximum(lengths, 1)  # the sequence's advantage
      seq_value, seq_clipped = losses.surrogate(seq_log_ratio, seq_adv, low, high, delta)
      value = jnp.broadcast_to(seq_value[..., None], shape)
      is_log_ratio = jnp.broadcast_to(seq_log_ratio[..., None], shape)  # what weights the KL
      ratio_of = jnp.exp(lax.stop_gradient(seq_log_ratio))
      # TRL's sequence-level mean: over every sequence, an empty one's ratio 1 (never clipped)
      clip_fraction = jnp.sum(seq_clipped) / sequences
      units = (lengths > 0).astype(acc)
    else:
      if loss_type == "cispo":
        value, clipped = losses.cispo(jnp.where(live, logp, 0), log_ratio, adv, high)
      elif loss_type == "sapo":
        value = losses.sapo(log_ratio, adv, tau_pos, tau_neg)
      else:
        value, clipped = losses.surrogate(log_ratio, adv, low, high, delta)
      units, clip_fraction, is_log_ratio = count, None, log_ratio
      ratio_of = jnp.exp(lax.stop_gradient(log_ratio))
    weight = losses.token_weights(loss_type, count, lengths, sequences, length, num_items)
    if off_policy_mask_threshold is not None:  # against the sampling engine's, else the old's
      behaviour = old if sampling is None else sampling
      drift = jnp.where(live, _difference(behaviour, lax.stop_gradient(logp)), 0)
      value = value * losses.off_policy_mask(adv, drift, lengths, off_policy_mask_threshold)
    keep = live
    if top_q < 1.0:
      keep = losses.high_entropy_mask(entropy, live, top_q)
      value = value * keep
    if sampling is not None:
      log_diff = jnp.where(live, _difference(lax.stop_gradient(old), sampling), 0)
      value = value * losses.sampling_ratio(log_diff, importance_sampling_mode, clip_lo, clip_hi)
    per_token = value
    kl = jnp.zeros(shape, acc)
    if ref is not None:
      d = jnp.where(live, _difference(ref, logp), 0)
      kl = jnp.expm1(d) - d  # k3: e^d - d - 1, exact near d = 0
      if bias_kl:  # DeepSeek-V3.2's unbiased estimate under the sampling policy
        kl = kl * jnp.exp(is_log_ratio)
      per_token = per_token - beta * kl
    per_token = per_token + entropy_coef * jnp.where(keep, entropy, 0)
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
