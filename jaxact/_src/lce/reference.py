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

  def kl(la, lb):  # KL(a || b), 0 log 0 = 0
    a = jnp.exp(la)
    return jnp.sum(jnp.where(a > 0, a * (la - jnp.where(a > 0, lb, 0)), 0), -1)

  if divergence == "forward_kl":
    d = kl(lp, lq)
  elif divergence == "reverse_kl":
    d = kl(lq, lp)
  else:
    lm = jnp.log(beta * jnp.exp(lp) + (1 - beta) * jnp.exp(lq))
    d = beta * kl(lp, lm) + (1 - beta) * kl(lq, lm)
  loss = divergence_weight * d
  if hard_label_weight:
    ce = cross_entropy_reference(
      x, w, labels, bias=bias, logit_soft_cap=logit_soft_cap, reduction="none"
    )
    loss = loss + hard_label_weight * ce
  if mask is None:
    return jnp.mean(loss)
  return jnp.sum(jnp.where(mask, loss, 0)) / jnp.maximum(jnp.sum(mask), 1)
