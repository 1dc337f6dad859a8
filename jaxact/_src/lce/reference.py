"""The LM head's plain formulas, for the tests: :func:`jaxact.linear_cross_entropy`'s loss and
:func:`jaxact.linear_log_probs`' log-probabilities and entropy.

What a JAX user writes without jaxact: ``x @ w + b``, Gemma 2's cap, a sampling temperature,
optax's ``softmax_cross_entropy`` against ``optax.smooth_labels`` of the one-hot labels (written out
here with ``jax.nn.log_softmax``), PaLM's z-loss on ``jax.nn.logsumexp``, and numpy's ``where`` /
mean, every (tokens, vocabulary) array built and differentiated by JAX's autodiff. Masked
vocabulary entries (logits of -inf) would make the smoothed loss infinite; there the reference
takes the smoothing mean over finite logits only, as jaxact documents (``masked=True``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_reference(
  x,
  w,
  labels,
  *,
  bias=None,
  where=None,
  reduction="mean",
  label_smoothing=0.0,
  z_loss=0.0,
  logit_soft_cap=None,
  precision=None,
  masked=False,
):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  z = jnp.matmul(x, w, precision=precision, preferred_element_type=acc)
  if bias is not None:
    z = z + bias.astype(acc)
  if logit_soft_cap is not None:
    z = jnp.where(z == -jnp.inf, z, logit_soft_cap * jnp.tanh(z / logit_soft_cap))
  vocab = w.shape[-1]
  onehot = jax.nn.one_hot(labels, vocab, dtype=acc)
  if not masked:
    targets = (1 - label_smoothing) * onehot + label_smoothing / vocab  # optax.smooth_labels
    loss = -jnp.sum(targets * jax.nn.log_softmax(z, axis=-1), axis=-1)  # softmax_cross_entropy
  else:
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.sum(jnp.where(onehot > 0, z, 0), axis=-1)
    mean = jnp.sum(jnp.where(jnp.isfinite(z), z, 0), axis=-1) / vocab
    loss = lse - label_smoothing * mean
    if label_smoothing < 1:  # full smoothing does not look at the label (0 * -inf would be NaN)
      loss = loss - (1 - label_smoothing) * picked
  if z_loss:
    loss = loss + z_loss * jax.nn.logsumexp(z, axis=-1) ** 2
  if where is not None:
    loss = jnp.where(where, loss, 0)
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  count = loss.size if where is None else jnp.sum(where)
  return jnp.sum(loss) / jnp.maximum(count, 1)


def _log_softmax(x, w, *, bias=None, temperature=1.0, logit_soft_cap=None, w_layout="dv"):
  """``log_softmax(c tanh((x @ w + b) / c) / T)`` over the whole vocabulary, in float32 (float64
  for float64 inputs); -inf logits (a bias of -inf) stay -inf under the cap."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  z = jnp.matmul(x, w if w_layout == "dv" else w.T, preferred_element_type=acc)
  if bias is not None:
    z = z + bias.astype(acc)
  if logit_soft_cap is not None:
    z = jnp.where(z == -jnp.inf, z, logit_soft_cap * jnp.tanh(z / logit_soft_cap))
  return jax.nn.log_softmax(z / temperature, axis=-1)


def log_probs_reference(x, w, tokens, *, where=None, **options):
  """``log p(token | x)`` of each position: the token's entry of :func:`jax.nn.log_softmax` of the
  full logits (0 where `where` is False); `options` as :func:`jaxact.linear_log_probs` takes them
  (``bias``, ``temperature``, ``logit_soft_cap``, ``w_layout``)."""
  logp = _log_softmax(x, w, **options)
  picked = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked if where is None else jnp.where(where, picked, 0)


def entropy_reference(x, w, *, where=None, **options):
  """The entropy ``-Σ p log p`` of each position's softmax over the full logits (0 where `where`
  is False), a masked entry (probability 0, log-probability -inf) counting 0: its log is replaced
  by 0 before the product, so that neither the value nor JAX's gradient meets ``0 · -inf``."""
  logp = _log_softmax(x, w, **options)
  finite = jnp.where(jnp.isfinite(logp), logp, 0)
  h = -jnp.sum(jnp.exp(logp) * finite, axis=-1)
  return h if where is None else jnp.where(where, h, 0)


def policy_gradient_reference(
  x,
  w,
  tokens,
  advantages,
  *,
  mask=None,
  old_log_probs=None,
  ref_log_probs=None,
  loss_type="grpo",
  epsilon=0.2,
  epsilon_high=None,
  beta=0.0,
  entropy_coef=0.0,
  max_length=None,
  **options,
):
  """:func:`jaxact.policy_gradient_loss` written from the papers over the full logits: the ratio
  ``exp(log pi - log pi_old)``, ``min(r A, clip(r, 1 - eps, 1 + eps_high) A)``, the k3 KL and the
  entropy bonus, averaged as each variant averages (GRPO and GSPO over each sequence's tokens and
  then the sequences, DAPO and PPO over the batch's tokens, Dr. GRPO over sequences times a
  constant length). Returns the loss alone."""
  logp = log_probs_reference(x, w, tokens, **options)
  entropy = entropy_reference(x, w, **options)
  m = jnp.ones(tokens.shape, logp.dtype) if mask is None else mask.astype(logp.dtype)
  adv = jnp.asarray(advantages, logp.dtype)
  if adv.ndim == tokens.ndim - 1:
    adv = jnp.broadcast_to(adv[..., None], tokens.shape)
  old = jax.lax.stop_gradient(logp) if old_log_probs is None else old_log_probs
  high = epsilon_high if epsilon_high is not None else (0.28 if loss_type == "dapo" else epsilon)
  lengths = jnp.maximum(jnp.sum(m, -1), 1)
  if loss_type == "gspo":
    ratio = jnp.exp(jnp.sum((logp - old) * m, -1) / lengths)
    seq_adv = jnp.sum(adv * m, -1) / lengths
    surrogate = jnp.minimum(ratio * seq_adv, jnp.clip(ratio, 1 - epsilon, 1 + high) * seq_adv)
    per_token = jnp.broadcast_to(surrogate[..., None], tokens.shape)
  else:
    ratio = jnp.exp(logp - old)
    per_token = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - epsilon, 1 + high) * adv)
  if ref_log_probs is not None:
    d = ref_log_probs - logp
    per_token = per_token - beta * (jnp.exp(d) - d - 1)
  per_token = per_token + entropy_coef * entropy
  sequences = per_token.size // tokens.shape[-1]
  if loss_type in ("grpo", "gspo"):
    return -jnp.mean(jnp.sum(per_token * m, -1) / lengths)
  if loss_type == "dr_grpo":
    return -jnp.sum(per_token * m) / (sequences * (max_length or tokens.shape[-1]))
  return -jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1)


def distillation_reference(
  x,
  w,
  teacher_x,
  teacher_w,
  *,
  divergence="forward_kl",
  beta=0.5,
  temperature=1.0,
  mask=None,
  labels=None,
  hard_label_weight=0.0,
  divergence_weight=1.0,
  bias=None,
  teacher_bias=None,
  logit_soft_cap=None,
  teacher_logit_soft_cap=None,
):
  """:func:`jaxact.distillation_loss` over both models' full logits, ``"mean"`` reduction: the KLs
  and GKD's generalized JSD written from their definitions with ``jax.nn.log_softmax`` (a term of
  zero probability counts 0), the teacher detached. Returns the loss alone."""
  lq = _log_softmax(x, w, bias=bias, temperature=temperature, logit_soft_cap=logit_soft_cap)
  lp = jax.lax.stop_gradient(
    _log_softmax(
      teacher_x,
      teacher_w,
      bias=teacher_bias,
      temperature=temperature,
      logit_soft_cap=teacher_logit_soft_cap,
    )
  )

  d = _divergence(divergence, beta, lp, lq)
  weights = dict(divergence_weight=divergence_weight, hard_label_weight=hard_label_weight)
  return _distillation_mean(d, x, w, labels, bias, logit_soft_cap, mask, **weights)


def _divergence(divergence, beta, lp, lq):
  """Each token's forward KL(p || q), reverse KL(q || p) or GKD's JSD(beta) of the distributions
  whose log-probabilities are `lp` and `lq` (last axis), from their definitions: a term of zero
  probability counts 0 (0 log 0 = 0)."""

  def kl(la, lb):  # KL(a || b)
    a = jnp.exp(la)
    la, lb = jnp.where(a > 0, la, 0), jnp.where(a > 0, lb, 0)
    return jnp.sum(jnp.where(a > 0, a * (la - lb), 0), -1)

  if divergence == "forward_kl":
    return kl(lp, lq)
  if divergence == "reverse_kl":
    return kl(lq, lp)
  m = beta * jnp.exp(lp) + (1 - beta) * jnp.exp(lq)
  lm = jnp.log(jnp.where(m > 0, m, 1))
  return beta * kl(lp, lm) + (1 - beta) * kl(lq, lm)


def _distillation_mean(
  d, x, w, labels, bias, logit_soft_cap, mask, *, divergence_weight, hard_label_weight
):
  """The distillation losses' "mean": `divergence_weight` times each token's divergence `d`,
  plus `hard_label_weight` times the student's cross-entropy, averaged over the `mask`ed tokens."""
  loss = divergence_weight * d
  if hard_label_weight:
    ce = cross_entropy_reference(
      x, w, labels, bias=bias, logit_soft_cap=logit_soft_cap, reduction="none"
    )
    loss = loss + hard_label_weight * ce
  if mask is None:
    return jnp.mean(loss)
  return jnp.sum(jnp.where(mask, loss, 0)) / jnp.maximum(jnp.sum(mask), 1)


# ----------------------------------------------------------------- preference losses (issue 45)
# Each written from its paper on the full logits' log-probabilities (log_probs_reference), in the
# plain forms (1 - sigmoid, log1p(-exp)), with jaxact's documented padding rule: a pair (KTO: a
# completion) with no unmasked token does not count, and the mean is over the counted ones.


def preference_sequence_reference(x, w, tokens, mask, **options):
  """``(sum, mean, counted)`` of each sequence's token log-probabilities over `mask` (the last
  axis): the sum, the sum over the count of unmasked tokens (at least 1), whether it has one."""
  logp = log_probs_reference(x, w, tokens, where=mask, **options)
  total = jnp.sum(logp, axis=-1)
  count = jnp.sum(mask, axis=-1)
  return total, total / jnp.maximum(count, 1), count > 0


def preference_dpo_reference(h, beta, label_smoothing=0.0):
  """DPO (Rafailov et al. 2023, eq. 7) with cDPO's label smoothing (Mitchell 2023)."""
  e = label_smoothing
  return -(1 - e) * jax.nn.log_sigmoid(beta * h) - e * jax.nn.log_sigmoid(-beta * h)


def preference_robust_reference(h, beta, label_smoothing):
  """Robust DPO (Chowdhury et al. 2024, eq. 5): the unbiased loss under flip rate ε."""
  e = label_smoothing
  up, down = -jax.nn.log_sigmoid(beta * h), -jax.nn.log_sigmoid(-beta * h)
  return ((1 - e) * up - e * down) / (1 - 2 * e)


def preference_ipo_reference(h, beta):
  """IPO (Azar et al. 2024, eq. 17): ``(h - 1/(2τ))²``, τ = beta."""
  return (h - 1 / (2 * beta)) ** 2


def preference_hinge_reference(h, beta):
  """SLiC-HF's hinge (Zhao et al. 2023) on RSO's reference-normalised margin: ``max(0, 1 - βh)``."""
  return jnp.maximum(0, 1 - beta * h)


def preference_simpo_reference(mean_c, mean_r, beta, gamma, label_smoothing=0.0):
  """SimPO (Meng et al. 2024, eq. 6):
  ``-log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma)``."""
  return preference_dpo_reference(mean_c - mean_r - gamma / beta, beta, label_smoothing)


def preference_orpo_reference(mean_c, mean_r, beta):
  """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4-7), times λ = beta: the odds
  ``P / (1 - P)`` of ``P = exp(mean log-prob)``. Returns ``(term, log odds ratio)``."""
  log_odds = (mean_c - jnp.log1p(-jnp.exp(mean_c))) - (mean_r - jnp.log1p(-jnp.exp(mean_r)))
  return -beta * jnp.log(jax.nn.sigmoid(log_odds)), log_odds


def preference_kto_reference(rho_c, rho_r, has_c, has_r, beta, w_d, w_u, kl=None):
  """KTO (Ethayarajh et al. 2024, eq. 8): ``λ_y - v(x, y)`` per completion, the reference point
  the batch's mean log-ratio clamped at 0 (or `kl`), detached; the mean over the completions."""
  both = jnp.concatenate([has_c, has_r])
  if kl is None:
    kl = jnp.maximum(_counted_mean(jnp.concatenate([rho_c, rho_r]), both), 0)
  kl = jax.lax.stop_gradient(kl)
  v_c = w_d * jax.nn.sigmoid(beta * (rho_c - kl))
  v_r = w_u * jax.nn.sigmoid(beta * (kl - rho_r))
  return _counted_mean(jnp.concatenate([w_d - v_c, w_u - v_r]), both), kl


def _counted_mean(values, counted):
  """The mean of `values` where `counted` (0 where nothing counts), jit-compatible."""
  return jnp.sum(jnp.where(counted, values, 0)) / jnp.maximum(jnp.sum(counted), 1)


def preference_reference(
  x_chosen,
  x_rejected,
  w,
  chosen_tokens,
  rejected_tokens,
  *,
  chosen_mask,
  rejected_mask,
  loss="dpo",
  beta=0.1,
  label_smoothing=0.0,
  simpo_gamma=0.5,
  nll_weight=1.0,
  desirable_weight=1.0,
  undesirable_weight=1.0,
  kto_kl=None,
  ref_chosen_log_probs=None,
  ref_rejected_log_probs=None,
  **options,
):
  """``(loss, metrics)`` of :func:`jaxact.preference_loss` from the full logits, each loss from its
  paper above, averaged over the counted pairs. `options`: ``bias``, ``temperature``,
  ``logit_soft_cap``, ``w_layout``."""
  sum_c, mean_c, has_c = preference_sequence_reference(
    x_chosen, w, chosen_tokens, chosen_mask, **options
  )
  sum_r, mean_r, has_r = preference_sequence_reference(
    x_rejected, w, rejected_tokens, rejected_mask, **options
  )
  length_c = jnp.maximum(jnp.sum(chosen_mask, -1), 1)
  length_r = jnp.maximum(jnp.sum(rejected_mask, -1), 1)
  normalised = loss in ("ipo", "simpo", "orpo")
  pi_c, pi_r = (mean_c, mean_r) if normalised else (sum_c, sum_r)
  rho_c, rho_r = pi_c, pi_r
  if ref_chosen_log_probs is not None:
    ref_c = jax.lax.stop_gradient(ref_chosen_log_probs)
    ref_r = jax.lax.stop_gradient(ref_rejected_log_probs)
    if normalised:
      ref_c, ref_r = ref_c / length_c, ref_r / length_r
    rho_c, rho_r = pi_c - ref_c, pi_r - ref_r
  if loss == "kto":
    value, kl = preference_kto_reference(
      rho_c, rho_r, has_c, has_r, beta, desirable_weight, undesirable_weight, kto_kl
    )
    return value, {
      "rewards/chosen": _counted_mean(beta * rho_c, has_c),
      "rewards/rejected": _counted_mean(beta * rho_r, has_r),
      "logps/chosen": _counted_mean(pi_c, has_c),
      "logps/rejected": _counted_mean(pi_r, has_r),
      "kl": kl,
    }
  keep = has_c & has_r
  h = rho_c - rho_r
  metrics = {}
  if loss == "dpo":
    losses = preference_dpo_reference(h, beta, label_smoothing)
  elif loss == "robust":
    losses = preference_robust_reference(h, beta, label_smoothing)
  elif loss == "ipo":
    losses = preference_ipo_reference(h, beta)
  elif loss == "hinge":
    losses = preference_hinge_reference(h, beta)
  elif loss == "simpo":
    losses = preference_simpo_reference(pi_c, pi_r, beta, simpo_gamma, label_smoothing)
  elif loss == "cpo":  # CPO (Xu et al. 2024, eq. 6): DPO's form without the reference
    losses = preference_dpo_reference(pi_c - pi_r, beta, label_smoothing)
  else:  # a pair that does not count has no odds: -1 stands in (log1p(-exp(0)) = -inf)
    losses, log_odds = preference_orpo_reference(
      jnp.where(keep, pi_c, -1), jnp.where(keep, pi_r, -1), beta
    )
    metrics["log_odds_chosen"] = _counted_mean(log_odds, keep)
  value = _counted_mean(losses, keep)
  if loss in ("orpo", "cpo"):  # + the chosen completions' NLL, TRL's token mean
    logp = log_probs_reference(x_chosen, w, chosen_tokens, **options)
    nll = -_counted_mean(logp, chosen_mask & keep[..., None])
    value = value + nll_weight * nll
    metrics["nll_loss"] = nll
  rewards_c, rewards_r = beta * rho_c, beta * rho_r
  metrics |= {
    "rewards/chosen": _counted_mean(rewards_c, keep),
    "rewards/rejected": _counted_mean(rewards_r, keep),
    "rewards/margins": _counted_mean(rewards_c - rewards_r, keep),
    "rewards/accuracies": _counted_mean(rewards_c > rewards_r, keep),
    "logps/chosen": _counted_mean(pi_c, keep),
    "logps/rejected": _counted_mean(pi_r, keep),
  }
  return value, metrics


def top_k_distillation_reference(
  x,
  w,
  teacher_indices,
  teacher_log_probs,
  *,
  divergence="forward_kl",
  beta=0.5,
  temperature=1.0,
  mask=None,
  labels=None,
  hard_label_weight=0.0,
  divergence_weight=1.0,
  bias=None,
  logit_soft_cap=None,
):
  """:func:`jaxact.top_k_distillation_loss` over the student's full logits, ``"mean"``
  reduction: :func:`jax.nn.log_softmax`, the K entries gathered, the student's tail the
  log-sum-exp of the other entries' log-probabilities, the teacher's ``log(1 - Σ p_k)`` (0 for
  K = V), and the divergences of the K + 1 buckets from their definitions (a term of zero
  probability counts 0), the teacher detached. Returns the loss alone."""
  lq_all = _log_softmax(x, w, bias=bias, temperature=temperature, logit_soft_cap=logit_soft_cap)
  vocab, k = lq_all.shape[-1], teacher_indices.shape[-1]
  lq_k = jnp.take_along_axis(lq_all, teacher_indices, axis=-1)
  listed = jnp.put_along_axis(
    jnp.zeros(lq_all.shape, bool), teacher_indices, True, axis=-1, inplace=False
  )
  rest = jnp.where(listed, -jnp.inf, lq_all)
  if k < vocab:
    lq_tail = jax.nn.logsumexp(rest, axis=-1)
  else:
    lq_tail = jnp.full(lq_all.shape[:-1], -jnp.inf, lq_all.dtype)
  lq = jnp.concatenate([lq_k, lq_tail[..., None]], axis=-1)
  lp_k = jax.lax.stop_gradient(teacher_log_probs.astype(lq.dtype))
  p_tail = jnp.maximum(1 - jnp.sum(jnp.exp(lp_k), axis=-1), 0) if k < vocab else 0 * lq_tail
  lp = jnp.concatenate([lp_k, jnp.log(p_tail)[..., None]], axis=-1)

  d = _divergence(divergence, beta, lp, lq)
  weights = dict(divergence_weight=divergence_weight, hard_label_weight=hard_label_weight)
  return _distillation_mean(d, x, w, labels, bias, logit_soft_cap, mask, **weights)
