"""The preference losses' arithmetic on sequence log-probabilities, for
:func:`jaxact._src.lce.api_preference.preference_loss`: each (batch,) loss from its paper, written
in stable forms (``log_sigmoid``, ``sigmoid``, ``log1mexp``), the padding rule (a pair with an
empty sequence does not count) and the metrics trainers log, under TRL's names."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.lce import api_checks as checks

# TRL's DPOTrainer losses (jaxact's "dpo" is its "sigmoid"), then the reference-free ones and KTO.
DPO_LOSSES = (
  "dpo", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
  "apo_down", "discopop", "sigmoid_norm",
)  # fmt: skip
LOSSES = (*DPO_LOSSES, "simpo", "orpo", "cpo", "kto")
REFERENCED = frozenset({*DPO_LOSSES, "kto"})
NORMALISED = frozenset({"ipo", "sigmoid_norm", "simpo", "orpo"})  # mean per-token log-probs
SMOOTHED = frozenset({"dpo", "robust", "exo_pair", "simpo", "cpo"})
NLL = frozenset({"orpo", "cpo"})
# TRL's f_divergence_type: the divergence whose difference between the chosen and rejected
# completions replaces the log-ratio margin h in the losses TRL forms from it (its ``logits``).
F_DIVERGENCES = ("reverse_kl", "js_divergence", "alpha_divergence")
F_DIVERGENCE_LOSSES = frozenset({"dpo", "robust", "ipo", "hinge", "exo_pair"})
# Each option, the losses that take it, and its default (any other loss must leave it there).
_OPTIONS = {
  "label_smoothing": (SMOOTHED, 0.0),
  "simpo_gamma": (frozenset({"simpo"}), 0.5),
  "discopop_tau": (frozenset({"discopop"}), 0.05),
  "nll_weight": (NLL, 1.0),
  "rpo_alpha": (frozenset({*DPO_LOSSES, "simpo"}), None),
  "ld_alpha": (frozenset(DPO_LOSSES), None),
  "desirable_weight": (frozenset({"kto"}), 1.0),
  "undesirable_weight": (frozenset({"kto"}), 1.0),
  "f_alpha_divergence_coef": (F_DIVERGENCE_LOSSES, 1.0),
}
_LOW_OPEN = frozenset(
  {"discopop_tau", "desirable_weight", "undesirable_weight", "f_alpha_divergence_coef"}
)
_HIGH = {"label_smoothing": 0.5, "ld_alpha": 1.0}


def hyperparameters(fn: str, loss: str, **values) -> dict[str, float | str | None]:
  """The checked hyperparameters: numbers in their ranges, and options the loss does not use left
  at their defaults (``ValueError`` naming the option and the losses that take it)."""
  out = {"beta": checks.number(fn, "beta", values.pop("beta"), low=0.0, low_open=True)}
  divergence = values.pop("f_divergence_type")
  if divergence not in F_DIVERGENCES:
    raise ValueError(
      checks.err(fn, f"`f_divergence_type` is {divergence!r}; accepted: {F_DIVERGENCES}")
    )
  if divergence != "reverse_kl" and loss not in F_DIVERGENCE_LOSSES:
    raise ValueError(
      checks.err(
        fn,
        f"`f_divergence_type` is {divergence!r}, but loss={loss!r} does not use it; it is an "
        f"option of {', '.join(repr(t) for t in LOSSES if t in F_DIVERGENCE_LOSSES)} (leave it "
        "at 'reverse_kl')",
      )
    )
  if divergence != "alpha_divergence" and values["f_alpha_divergence_coef"] != 1.0:
    raise ValueError(
      checks.err(
        fn,
        f"`f_alpha_divergence_coef` is {values['f_alpha_divergence_coef']!r}, but "
        f"f_divergence_type={divergence!r} does not use it (leave it at 1.0)",
      )
    )
  out["f_divergence_type"] = divergence
  for name, value in values.items():
    takers, default = _OPTIONS[name]
    v = value
    if value is not None or default is not None:
      v = checks.number(fn, name, value, low=0.0, high=_HIGH.get(name), low_open=name in _LOW_OPEN)
    if loss not in takers and v != default:
      raise ValueError(
        checks.err(
          fn,
          f"`{name}` is {value!r}, but loss={loss!r} does not use it; it is an option of "
          f"{', '.join(repr(t) for t in LOSSES if t in takers)} (leave it at {default})",
        )
      )
    out[name] = v
  eps = out["label_smoothing"]
  if loss == "robust" and eps == 0.5:
    raise ValueError(
      checks.err(
        fn,
        "`label_smoothing` is 0.5; accepted for loss='robust': [0, 0.5) (it "
        "divides by 1 - 2 label_smoothing)",
      )
    )
  if loss == "exo_pair" and eps == 0:
    raise ValueError(
      checks.err(
        fn,
        "`label_smoothing` is 0.0; accepted for loss='exo_pair': (0, 0.5] (EXO's target puts "
        "label_smoothing on the rejected completion and takes its log; the paper uses 1e-3)",
      )
    )
  return out


def ld_weights(m_c: Array, m_r: Array, ld_alpha: float | None, dtype) -> tuple[Array, Array]:
  """LD-DPO's token weights (TRL's ``ld_alpha``): 1 on each completion's first
  ``min(|y_c|, |y_r|)`` counted tokens (the pair's shared length), ``ld_alpha`` on the rest; the
  masks themselves without it."""
  if ld_alpha is None:
    return m_c.astype(dtype), m_r.astype(dtype)
  shared = jnp.minimum(jnp.sum(m_c, -1), jnp.sum(m_r, -1))[..., None]
  return tuple(
    jnp.where(m, jnp.where(jnp.cumsum(m, -1) <= shared, 1.0, ld_alpha), 0.0).astype(dtype)
    for m in (m_c, m_r)
  )


def log1mexp(a: Array) -> Array:
  """``log(1 - exp(a))`` for ``a < 0``: ``log(-expm1(a))`` above ``-log 2``, ``log1p(-exp(a))``
  below (Mächler 2012), each branch fed only the arguments it is accurate and finite for."""
  near = a > -math.log(2)
  return jnp.where(
    near,
    jnp.log(-jnp.expm1(jnp.where(near, a, -1.0))),
    jnp.log1p(-jnp.exp(jnp.where(near, -1.0, a))),
  )


def _smoothed(u: Array, eps: float) -> Array:
  """``-(1 - eps) log_sigmoid(u) - eps log_sigmoid(-u)`` (cDPO's conservative loss)."""
  out = -jax.nn.log_sigmoid(u)
  return out if eps == 0 else (1 - eps) * out - eps * jax.nn.log_sigmoid(-u)


def _mean(values: Array, counted: Array) -> Array:
  """Mean over the counted entries; 0 (zero gradients) when none counts."""
  total = jnp.sum(jnp.where(counted, values, 0))
  return total / jnp.maximum(jnp.sum(counted), 1).astype(total.dtype)


def _sequences(lp: Array, mask: Array, weight: Array) -> tuple[Array, Array, Array]:
  """Sequence sums (each token weighted), mean log-probs (over the counted tokens, at least 1)
  and whether the sequence has a token."""
  count = jnp.sum(mask, axis=-1)
  total = jnp.sum(lp * weight, axis=-1)
  return total, total / jnp.maximum(count, 1).astype(lp.dtype), count > 0


def _margin(hyper, rho_c: Array, rho_r: Array) -> Array:
  """The margin h of TRL's f-DPO (Wang et al. 2023, TRL's ``f_divergence_type``), from the
  policy's log-ratios to the reference rho: the reverse KL's ``rho_c - rho_r``; the JS
  divergence's less ``softplus(rho_c) - softplus(rho_r)``; the alpha divergence's
  ``(exp(-a rho_r) - exp(-a rho_c)) / a``, each exponent capped (its gradient 0 beyond) as TRL's
  ``cap_exp`` caps it, but at a quarter of the float's log range rather than all of it, where
  float32's exp is already infinite: every loss on h and its gradients stay finite (TRL's IPO
  squares h)."""
  divergence = hyper["f_divergence_type"]
  if divergence == "alpha_divergence":
    a = hyper["f_alpha_divergence_coef"]
    cap = math.log(jnp.finfo(rho_c.dtype).max) / 4
    capped = lambda v: jnp.exp(jnp.minimum(v, cap))
    return (capped(-a * rho_r) - capped(-a * rho_c)) / a
  h = rho_c - rho_r
  if divergence == "js_divergence":
    h = h - (jax.nn.softplus(rho_c) - jax.nn.softplus(rho_r))
  return h


def _dpo_family(loss: str, hyper, rho_c: Array, rho_r: Array, delta: Array | None) -> Array:
  """Each pair's loss from the policy's log-ratios to the reference, as TRL's DPOTrainer forms
  it (``delta``: BCO's reward shift, or None)."""
  beta, eps = hyper["beta"], hyper["label_smoothing"]
  h = _margin(hyper, rho_c, rho_r) if loss in F_DIVERGENCE_LOSSES else rho_c - rho_r
  u, r_c, r_r = beta * h, beta * rho_c, beta * rho_r
  log_sig = jax.nn.log_sigmoid
  if loss in ("dpo", "sigmoid_norm"):  # sigmoid_norm: on the mean log-probabilities
    return _smoothed(u, eps)
  if loss == "robust":
    return (-(1 - eps) * log_sig(u) + eps * log_sig(-u)) / (1 - 2 * eps)
  if loss == "ipo":
    return jnp.square(h - 1 / (2 * beta))
  if loss == "hinge":
    return jax.nn.relu(1 - u)
  if loss == "exo_pair":  # KL(softmax over the pair || (1 - eps, eps)), EXO eq. 16
    return jax.nn.sigmoid(u) * (log_sig(u) - math.log1p(-eps)) + jax.nn.sigmoid(-u) * (
      log_sig(-u) - math.log(eps)
    )
  if loss == "nca_pair":
    return -log_sig(r_c) - 0.5 * log_sig(-r_c) - 0.5 * log_sig(-r_r)
  if loss == "bco_pair":
    if delta is not None:
      r_c, r_r = r_c - delta, r_r - delta
    return -log_sig(r_c) - log_sig(-r_r)
  if loss == "sppo_hard":
    return jnp.square(rho_c - 0.5 / beta) + jnp.square(rho_r + 0.5 / beta)
  if loss == "apo_zero":  # 1 - sigmoid(r_c) + sigmoid(r_r)
    return jax.nn.sigmoid(-r_c) + jax.nn.sigmoid(r_r)
  if loss == "apo_down":  # sigmoid(r_c) + 1 - sigmoid(u)
    return jax.nn.sigmoid(r_c) + jax.nn.sigmoid(-u)
  # discopop: the logistic loss and exp(-u) mixed by sigmoid(u / tau); the exponential's share
  # formed as exp(log_sigmoid(u / tau) - u), finite where exp(-u) alone overflows.
  tau = hyper["discopop_tau"]
  return jax.nn.sigmoid(-u / tau) * -log_sig(u) + jnp.exp(log_sig(u / tau) - u)


def _nll(lp_c: Array, m_c: Array, counted: Array) -> Array:
  """The chosen completions' negative log-likelihood: the mean over the counted pairs' counted
  chosen tokens (TRL's and Liger's cross-entropy over the batch's tokens)."""
  tokens = m_c & counted[..., None]
  return -jnp.sum(jnp.where(tokens, lp_c, 0)) / jnp.maximum(jnp.sum(tokens), 1).astype(lp_c.dtype)


def compute(
  loss, hyper, lp_c, lp_r, m_c, m_r, weights, ref, given, nll_mask=None
) -> tuple[Array, dict[str, Array]]:
  """``(loss, metrics)`` from the per-token log-probs (0 where masked), the masks, the tokens'
  weights in the sums (:func:`ld_weights`), the reference's sequence sums (or None), the given
  detached scalar (KTO's reference point or BCO's reward shift; or None) and the chosen
  positions the NLL counts (None: ``m_c``'s)."""
  beta = hyper["beta"]
  sum_c, mean_c, has_c = _sequences(lp_c, m_c, weights[0])
  sum_r, mean_r, has_r = _sequences(lp_r, m_r, weights[1])
  normalised = loss in NORMALISED
  pi_c, pi_r = (mean_c, mean_r) if normalised else (sum_c, sum_r)
  if ref is not None:
    ref_c, ref_r = ref
    if normalised:  # IPO, sigmoid_norm: the reference's sums over the same lengths
      ref_c = ref_c / jnp.maximum(jnp.sum(m_c, -1), 1).astype(ref_c.dtype)
      ref_r = ref_r / jnp.maximum(jnp.sum(m_r, -1), 1).astype(ref_r.dtype)
    rho_c, rho_r = pi_c - ref_c, pi_r - ref_r
  else:
    rho_c, rho_r = pi_c, pi_r
  if loss == "kto":
    return _kto(hyper, rho_c, rho_r, pi_c, pi_r, has_c, has_r, given)
  counted = has_c & has_r
  eps = hyper["label_smoothing"]
  metrics = {}
  if loss in DPO_LOSSES:
    per_pair = _dpo_family(loss, hyper, rho_c, rho_r, given)
  elif loss == "simpo":
    per_pair = _smoothed(beta * (pi_c - pi_r) - hyper["simpo_gamma"], eps)
  elif loss == "cpo":
    per_pair = _smoothed(beta * (pi_c - pi_r), eps)
  else:  # orpo
    tiny = jnp.finfo(pi_c.dtype).tiny
    a_c = jnp.where(counted, jnp.minimum(pi_c, -tiny), -1.0)
    a_r = jnp.where(counted, jnp.minimum(pi_r, -tiny), -1.0)
    log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
    ratio = jax.nn.log_sigmoid(log_odds)
    per_pair = -beta * ratio
    metrics["log_odds_ratio"] = _mean(ratio, counted)
    metrics["log_odds_chosen"] = _mean(log_odds, counted)
  value = _mean(per_pair, counted)
  nll_weight = hyper["nll_weight"] if loss in NLL else hyper["rpo_alpha"]
  if nll_weight is not None:
    nll = _nll(lp_c, m_c if nll_mask is None else nll_mask, counted)
    value = value + nll_weight * nll
    metrics["nll_loss"] = nll
  reward_c, reward_r = beta * rho_c, beta * rho_r
  metrics |= {
    "rewards/chosen": _mean(reward_c, counted),
    "rewards/rejected": _mean(reward_r, counted),
    "rewards/margins": _mean(reward_c - reward_r, counted),
    "rewards/accuracies": _mean((reward_c > reward_r).astype(value.dtype), counted),
    "logps/chosen": _mean(pi_c, counted),
    "logps/rejected": _mean(pi_r, counted),
  }
  return value, jax.tree.map(lax.stop_gradient, metrics)


def _kto(hyper, rho_c, rho_r, pi_c, pi_r, has_c, has_r, kl) -> tuple[Array, dict[str, Array]]:
  """KTO over unpaired desirable (chosen) and undesirable (rejected) completions."""
  beta = hyper["beta"]
  if kl is None:  # the batch's estimate: the mean log-ratio of its completions, at least 0
    total = jnp.sum(jnp.where(has_c, rho_c, 0)) + jnp.sum(jnp.where(has_r, rho_r, 0))
    count = jnp.sum(has_c) + jnp.sum(has_r)
    kl = jnp.maximum(total / jnp.maximum(count, 1).astype(total.dtype), 0)
  kl = lax.stop_gradient(kl)
  loss_c = hyper["desirable_weight"] * jax.nn.sigmoid(-beta * (rho_c - kl))
  loss_r = hyper["undesirable_weight"] * jax.nn.sigmoid(-beta * (kl - rho_r))
  total = jnp.sum(jnp.where(has_c, loss_c, 0)) + jnp.sum(jnp.where(has_r, loss_r, 0))
  count = jnp.sum(has_c) + jnp.sum(has_r)
  value = total / jnp.maximum(count, 1).astype(total.dtype)
  reward_c, reward_r = _mean(beta * rho_c, has_c), _mean(beta * rho_r, has_r)
  metrics = {
    "rewards/chosen": reward_c,
    "rewards/rejected": reward_r,
    "rewards/margins": reward_c - reward_r,
    "logps/chosen": _mean(pi_c, has_c),
    "logps/rejected": _mean(pi_r, has_r),
    "kl": kl,
  }
  return value, jax.tree.map(lax.stop_gradient, metrics)
