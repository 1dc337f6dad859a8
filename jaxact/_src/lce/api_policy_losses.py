"""The policy-gradient losses' arithmetic on per-token log-probabilities, for
:func:`jaxact._src.lce.api_policy.policy_gradient_loss`: each loss type's per-token objective in a
form that never meets ``0 * inf`` where a ratio would overflow, the masks and the sampling
correction TRL's ``GRPOTrainer._compute_loss`` applies, and each loss type's token weights. All of
them act on (sequences, tokens) arrays."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src.core import validation
from jaxact._src.lce import api_checks as checks

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "ppo", "cispo", "sapo")
CLIPPED = frozenset({"grpo", "dapo", "dr_grpo", "gspo", "ppo"})  # PPO's clipped surrogate
TOKEN_MEAN = frozenset({"dapo", "ppo", "cispo"})  # every token of the batch weighs the same
SEQUENCE_MEAN = frozenset({"grpo", "gspo", "sapo"})  # each sequence's token mean, then theirs
SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DAPO_EPSILON_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, section 3.1)
CISPO_EPSILON_HIGH = 5.0  # ScaleRL's cap of CISPO's ratio (Khatri et al. 2025)
_SAPO_SATURATED = 60.0  # sigmoid(z) is 1 to within 1e-26 for z past it: the ratio stops there
# Each option, the loss types that take it, and its default (any other loss type leaves it there).
OPTIONS = {
  "delta": (CLIPPED, None),
  "num_items_in_batch": (TOKEN_MEAN, None),
  "sapo_temperature_pos": (frozenset({"sapo"}), 1.0),
  "sapo_temperature_neg": (frozenset({"sapo"}), 1.05),
}


def check_options(fn: str, loss_type: str, given: dict) -> None:
  """``ValueError`` naming an option that `loss_type` does not use but was moved off its default."""
  for name, value in given.items():
    takers, default = OPTIONS[name]
    moved = value is not None if default is None else value != default
    if loss_type not in takers and moved:
      raise ValueError(
        checks.err(
          fn,
          f"`{name}` is {value!r}, but loss_type={loss_type!r} does not use it; it is an option "
          f"of {', '.join(repr(t) for t in LOSS_TYPES if t in takers)} (leave it at {default})",
        )
      )


def item_count(fn: str, n) -> float | Array | None:
  """`num_items_in_batch`: None, a number >= 0, or a scalar array (it may be traced)."""
  if n is None:
    return None
  if isinstance(n, (bool, np.bool_)):
    raise TypeError(checks.err(fn, f"`num_items_in_batch` must be a number; got {n!r}"))
  if isinstance(n, numbers.Real):
    if not (math.isfinite(n) and n >= 0):
      raise ValueError(checks.err(fn, f"`num_items_in_batch` is {n!r}; accepted: a count >= 0"))
    return float(n)
  a = validation.as_real_array(fn, n, "num_items_in_batch")
  if a.shape != ():
    raise ValueError(
      checks.err(fn, f"`num_items_in_batch` has shape {a.shape}; accepted: a scalar (a count)")
    )
  return a


def sampling_options(fn: str, mode, clip_min, clip_max) -> tuple[float | None, float | None]:
  """The sampling correction's mode and bounds checked as TRL's ``GRPOConfig`` checks them."""
  if mode not in SAMPLING_MODES:
    raise ValueError(
      checks.err(fn, f"`importance_sampling_mode` is {mode!r}; accepted: {SAMPLING_MODES}")
    )
  bounds = {"importance_sampling_clip_min": clip_min, "importance_sampling_clip_max": clip_max}
  lo, hi = (
    None if v is None else checks.number(fn, k, v, low=0.0, low_open=k.endswith("max"))
    for k, v in bounds.items()
  )
  if lo is not None and hi is not None and lo >= hi:
    raise ValueError(
      checks.err(fn, f"`importance_sampling_clip_min` ({lo}) must be below the max ({hi})")
    )
  if mode.endswith("truncate") and lo is None and hi is None:
    raise ValueError(
      checks.err(fn, f"`importance_sampling_mode` {mode!r} needs a clip_min or a clip_max")
    )
  return lo, hi


def surrogate(
  log_ratio: Array, adv: Array, low: float, high: float, delta: float | None
) -> tuple[Array, Array]:
  """``min(min(r, delta) A, clip(r, 1 - low, 1 + high) A)`` with ``r = exp(log_ratio)`` (TRL's
  two-sided clip: ``delta`` caps the unclipped ratio, None: no cap), and where the clip binds as
  TRL counts it. Each branch is ``exp`` of a clipped log-ratio: a ratio that would overflow where
  a clip holds is never formed, so neither the value nor the gradient meets ``0 * inf``. For
  ``A >= 0`` the product is ``A min(r, delta, 1 + high)``; below, ``A max(min(r, delta),
  clip(r, 1 - low, 1 + high))``."""
  top, bottom = float(np.log1p(high)), float(np.log1p(-low))  # Python floats: log_ratio's dtype
  capped = log_ratio if delta is None else jnp.minimum(log_ratio, float(np.log(delta)))
  positive = adv >= 0
  up = jnp.minimum(capped, top)
  down = jnp.maximum(capped, jnp.clip(log_ratio, bottom, top))
  value = adv * jnp.exp(jnp.where(positive, up, down))
  clipped = jnp.where(positive, capped > top, capped < bottom)
  return value, clipped & (adv != 0)


def cispo(logp: Array, log_ratio: Array, adv: Array, cap: float) -> tuple[Array, Array]:
  """CISPO (MiniMax-M1): ``sg(min(r, cap)) A log pi`` (the ratio capped and detached, so the
  gradient is the capped ratio times the policy gradient), and where the cap binds for ``A > 0``
  (TRL's ``cispo_clip_ratio``)."""
  top = float(np.log(cap))
  weight = lax.stop_gradient(jnp.exp(jnp.minimum(log_ratio, top)))
  return weight * adv * logp, (log_ratio > top) & (adv > 0)


def sapo(log_ratio: Array, adv: Array, tau_pos: float, tau_neg: float) -> Array:
  """SAPO (Gao et al. 2025): ``A sigmoid(tau (r - 1)) 4 / tau``, ``tau`` the positive advantages'
  temperature where ``A > 0``, else the other. The ratio stops where the sigmoid has saturated
  (its gradient there is below 1e-24), so it never overflows."""
  tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(log_ratio.dtype)
  r = jnp.exp(jnp.minimum(log_ratio, jnp.log1p(_SAPO_SATURATED / tau)))
  return adv * jax.nn.sigmoid(tau * (r - 1)) * 4 / tau


def sampling_ratio(
  log_diff: Array, mode: str, clip_min: float | None, clip_max: float | None
) -> Array:
  """TRL's ``importance_sampling_ratio`` for rollouts from another engine: ``exp`` of the
  old-minus-sampling log-probability differences `log_diff` (0 where not selected), per token or
  summed over each sequence, truncated to ``[clip_min, clip_max]`` (``*_truncate``) or set to 0
  outside it (``*_mask``); None is no bound. Compared and clipped in log space (no overflow)."""
  if mode.startswith("sequence"):
    log_diff = jnp.broadcast_to(jnp.sum(log_diff, -1, keepdims=True), log_diff.shape)
  lo = -np.inf if not clip_min else float(np.log(clip_min))
  hi = np.inf if clip_max is None else float(np.log(clip_max))
  if mode.endswith("truncate"):
    return jnp.exp(jnp.clip(log_diff, lo, hi))
  outside = (log_diff < lo) | (log_diff > hi)
  return jnp.where(outside, 0, jnp.exp(jnp.where(outside, 0, log_diff)))


def high_entropy_mask(entropy: Array, live: Array, top_quantile: float) -> Array:
  """TRL's ``get_high_entropy_mask`` ("Beyond the 80/20 rule"): the selected tokens whose entropy
  (detached) is at least the ``1 - top_quantile`` quantile (linear interpolation, as
  ``torch.quantile``) of the selected tokens' entropies; none when no token is selected."""
  h = lax.stop_gradient(entropy)
  threshold = jnp.nanquantile(jnp.where(live, h, jnp.nan), 1.0 - top_quantile)
  return (jnp.where(live, h, 0) >= threshold) & live


def off_policy_mask(adv: Array, sampling_kl: Array, lengths: Array, threshold: float) -> Array:
  """TRL's ``get_off_policy_mask`` (DeepSeek-V3.2's off-policy sequence masking): keep a token
  whose advantage is >= 0 or whose sequence's mean ``log pi_sampling - log pi`` (`sampling_kl`,
  detached, 0 where not selected) is at most `threshold`."""
  mean_kl = jnp.sum(sampling_kl, -1, keepdims=True) / jnp.maximum(lengths, 1)[..., None]
  return (adv >= 0) | (mean_kl <= threshold)


def token_weights(
  loss_type: str, count: Array, lengths: Array, sequences: float, length: int, num_items
) -> Array:
  """Each selected token's weight in the loss: the sequence means' mean (GRPO, GSPO, SAPO),
  ``1 / (G L)`` (Dr. GRPO), or one over the batch's selected tokens (DAPO, PPO, CISPO; over
  `num_items_in_batch` when given, so micro-batches' losses add up to the whole batch's)."""
  if loss_type in SEQUENCE_MEAN:
    return count / (jnp.maximum(lengths, 1)[..., None] * sequences)
  if loss_type == "dr_grpo":
    return count / (sequences * length)
  total = jnp.sum(count) if num_items is None else jnp.asarray(num_items, count.dtype)
  return count / jnp.maximum(total, 1)
