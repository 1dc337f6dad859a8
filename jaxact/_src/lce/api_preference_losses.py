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

LOSSES = ("dpo", "ipo", "hinge", "robust", "simpo", "orpo", "cpo", "kto")
REFERENCED = frozenset({"dpo", "ipo", "hinge", "robust", "kto"})
NORMALISED = frozenset({"ipo", "simpo", "orpo"})  # mean per-token log-probs
SMOOTHED = frozenset({"dpo", "robust", "simpo", "cpo"})
NLL = frozenset({"orpo", "cpo"})
# Each option, the losses that take it, and its default (any other loss must leave it there).
_OPTIONS = {
  "label_smoothing": (SMOOTHED, 0.0),
  "simpo_gamma": (frozenset({"simpo"}), 0.5),
  "nll_weight": (NLL, 1.0),
  "desirable_weight": (frozenset({"kto"}), 1.0),
  "undesirable_weight": (frozenset({"kto"}), 1.0),
}


def hyperparameters(fn: str, loss: str, **values) -> dict[str, float]:
  """The checked hyperparameters: numbers in their ranges, and options the loss does not use left
  at their defaults (``ValueError`` naming the option and the losses that take it)."""
  out = {"beta": checks.number(fn, "beta", values.pop("beta"), low=0.0, low_open=True)}
  for name, value in values.items():
    takers, default = _OPTIONS[name]
    low_open = name in ("desirable_weight", "undesirable_weight")
    high = None
    if name == "label_smoothing":
      high = 0.5
    v = checks.number(fn, name, value, low=0.0, high=high, low_open=low_open)
    if loss not in takers and v != default:
      raise ValueError(
        checks.err(
          fn,
          f"`{name}` is {value!r}, but loss={loss!r} does not use it; it is an option of "
          f"{', '.join(repr(t) for t in LOSSES if t in takers)} (leave it at {default})",
        )
      )
    out[name] = v
  if loss == "robust" and out["label_smoothing"] == 0.5:
    raise ValueError(
      checks.err(
        fn,
        "`label_smoothing` is 0.5; accepted for loss='robust': [0, 0.5) (it "
        "divides by 1 - 2 label_smoothing)",
      )
    )
  return out


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


def _sequences(lp: Array, mask: Array) -> tuple[Array, Array, Array]:
  """Sequence sums, mean log-probs (length clamped at 1) and whether the sequence has a token."""
  count = jnp.sum(mask, axis=-1)
  total = jnp.sum(lp, axis=-1)
  return total, total / jnp.maximum(count, 1).astype(lp.dtype), count > 0


def compute(loss, hyper, lp_c, lp_r, m_c, m_r, ref, kl) -> tuple[Array, dict[str, Array]]:
  """``(loss, metrics)`` from the per-token log-probs (0 where masked), the masks, the
  reference's sequence sums (or None) and KTO's given reference point (or None)."""
  beta = hyper["beta"]
  sum_c, mean_c, has_c = _sequences(lp_c, m_c)
  sum_r, mean_r, has_r = _sequences(lp_r, m_r)
  normalised = loss in NORMALISED
  pi_c, pi_r = (mean_c, mean_r) if normalised else (sum_c, sum_r)
  if ref is not None:
    ref_c, ref_r = ref
    if normalised:  # IPO: the reference's sums over the same lengths
      ref_c = ref_c / jnp.maximum(jnp.sum(m_c, -1), 1).astype(ref_c.dtype)
      ref_r = ref_r / jnp.maximum(jnp.sum(m_r, -1), 1).astype(ref_r.dtype)
    rho_c, rho_r = pi_c - ref_c, pi_r - ref_r
  else:
    rho_c, rho_r = pi_c, pi_r
  if loss == "kto":
    return _kto(hyper, rho_c, rho_r, pi_c, pi_r, has_c, has_r, kl)
  counted = has_c & has_r
  eps = hyper["label_smoothing"]
  metrics = {}
  if loss in ("dpo", "robust", "ipo", "hinge"):
    h = rho_c - rho_r
    if loss == "dpo":
      per_pair = _smoothed(beta * h, eps)
    elif loss == "robust":
      per_pair = (
        -(1 - eps) * jax.nn.log_sigmoid(beta * h) + eps * jax.nn.log_sigmoid(-beta * h)
      ) / (1 - 2 * eps)
    elif loss == "ipo":
      per_pair = jnp.square(h - 1 / (2 * beta))
    else:
      per_pair = jax.nn.relu(1 - beta * h)
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
  if loss in NLL:
    tokens = m_c & counted[..., None]
    nll = -jnp.sum(jnp.where(tokens, lp_c, 0)) / jnp.maximum(jnp.sum(tokens), 1).astype(lp_c.dtype)
    value = value + hyper["nll_weight"] * nll
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
