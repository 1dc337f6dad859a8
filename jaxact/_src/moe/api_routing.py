"""The routing of :func:`jaxact.moe_mlp`, plain JAX: router scores, the top-k experts and their
weights, the assignments sorted by expert (what the grouped matmuls read), the capacity drop and
the padding's, the balance statistics and the auxiliary losses.

Only the top-k weights carry a gradient (to the router and the input, through the scores); the
indices, the sort and the group sizes are integers. Everything here is of (tokens, experts) or
(tokens * top_k,) size, small beside the experts' hidden arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.activations.api import log_sigmoid, softmax
from jaxact._src.core import shardings
from jaxact._src.moe.plan import MoEPlan


class Routing(NamedTuple):
  """Where each token goes. An assignment is one (token, slot) pair, flat index ``t * k + j``."""

  weights: Array  # (T, k) the top-k weights, acc dtype: differentiable
  experts: Array  # (T, k) int32, the top-k experts, best first
  order: Array  # (T*k,) int32: the assignments sorted by expert; dropped ones last
  inverse: Array  # (T*k,) int32: where each assignment sits in `order`
  group_sizes: Array  # (E,) int32: the assignments each expert computes (after the drop)
  counts: Array  # (E,) int32: the assignments each expert was given (before the drop)


def logits(plan: MoEPlan, x: Array, router: Array) -> Array:
  """``x @ router`` in the accumulation dtype (float32 for half precision): (T, E)."""
  dims = (((1,), (0,)), ((), ()))
  return lax.dot_general(x, router, dims, plan.precision, preferred_element_type=plan.acc_dtype)


def log_scores(plan: MoEPlan, z: Array) -> Array:
  """The logarithms of the router's scores up to a constant a token: the logits for ``softmax(z)``
  (Switch, Mixtral, Qwen3-MoE), ``log_sigmoid(z)`` for ``sigmoid(z)`` (DeepSeek-V3). Finite where
  the scores underflow, and in the order of the scores."""
  return z if plan.score == "softmax" else log_sigmoid(z)


def top_k(plan: MoEPlan, select: Array) -> Array:
  """(T, k) int32: the indices of each row's `plan.top_k` largest, the lower index first on ties;
  within its `plan.top_k_groups` best groups where those are fewer than the groups."""
  if plan.top_k_groups < plan.expert_groups:
    select = _limit_groups(plan, select)
  return lax.top_k(select, plan.top_k)[1].astype(jnp.int32)


def choose(plan: MoEPlan, x: Array, router: Array, router_bias: Array | None, pick=top_k):
  """``(weights, experts, logits, log_scores)`` of the (T, D) input: each token's top-k experts
  (T, k) (``pick(plan, select)``, :func:`top_k` or one run on each device's rows) and their
  weights (T, k), before any sort; plain JAX, which XLA partitions as it partitions `x` (the
  expert-parallel path sorts on each device)."""
  z = logits(plan, x, router)
  log_s = log_scores(plan, z)
  if router_bias is None and plan.top_k_groups == plan.expert_groups:
    select = lax.stop_gradient(log_s)
  else:  # DeepSeek-V3: the bias is added to the scores to pick the experts, not to their weights;
    # the groups are scored by the (bias-corrected) scores themselves.
    select = lax.stop_gradient(_scores(plan, z, log_s))
    if router_bias is not None:
      select = select + router_bias.astype(plan.acc_dtype)
  experts = pick(plan, select)
  chosen = jnp.take_along_axis(log_s, experts, axis=-1)
  if plan.normalize_top_k:
    # s_i / sum_j s_j over the top k as a softmax of their log-scores: exact (and NaN-free, in
    # value and gradient) where the scores underflow.
    weights = softmax(chosen, axis=-1)
  else:
    weights = jnp.exp(chosen - _log_norm(plan, z))
  return weights, experts, z, log_s


def _drop_per_sequence(plan: MoEPlan, flat: Array) -> tuple[Array, Array]:
  """``(order, group_sizes)`` of the (T*k,) experts `flat` (E: masked) when each sequence's
  assignments queue for their own `plan.capacity` of each expert, the later ones in token order
  dropped: the assignments ranked within each (sequence, expert) segment."""
  n_seg = plan.sequences * plan.experts
  sequence = jnp.arange(flat.size, dtype=jnp.int32) // (flat.size // plan.sequences)
  segment = jnp.where(flat < plan.experts, sequence * plan.experts + flat, n_seg)
  by_segment = jnp.argsort(segment, stable=True)
  sizes = jnp.bincount(segment, length=n_seg + 1)
  ranked = segment[by_segment]
  position = jnp.arange(flat.size, dtype=jnp.int32) - jnp.take(jnp.cumsum(sizes) - sizes, ranked)
  kept = jnp.zeros(flat.shape, bool).at[by_segment].set(position < plan.capacity)
  key = jnp.where(kept & (flat < plan.experts), flat, plan.experts)  # dropped: after every group
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  return order, jnp.bincount(key, length=plan.experts + 1)[: plan.experts].astype(jnp.int32)


def _scores(plan: MoEPlan, z: Array, log_s: Array) -> Array:
  """The scores themselves, not the log-scores' exp: for softmax those lack the normalizer."""
  return jnp.exp(log_s - _log_norm(plan, z))


def _limit_groups(plan: MoEPlan, select: Array) -> Array:
  """The (bias-corrected) scores `select` with the experts outside each token's
  `plan.top_k_groups` best groups at -inf (DeepSeek-V3's group-limited routing): the experts split
  into `plan.expert_groups` groups of consecutive indices, a group scored by the sum of its two
  largest."""
  groups = select.reshape(select.shape[0], plan.expert_groups, -1)
  group_scores = jnp.sum(lax.top_k(groups, 2)[0], axis=-1)  # (T, G)
  best = lax.top_k(group_scores, plan.top_k_groups)[1]  # ties: the lower group
  eligible = jnp.sum(jax.nn.one_hot(best, plan.expert_groups, dtype=jnp.int32), axis=1) > 0
  eligible = jnp.repeat(eligible, plan.experts // plan.expert_groups, axis=1)  # (T, E)
  # -inf, as DeepSeek's inference code masks them; transformers fills 0.0, which picks the same
  # experts unless fewer than top_k eligible ones have a positive bias-corrected score.
  return jnp.where(eligible, select, -jnp.inf)


def route(plan: MoEPlan, x: Array, router: Array, router_bias: Array | None, mask=None):
  """``(routing, logits, log_scores)`` of the (T, D) input; the tokens of a False (T,) `mask`
  go to no expert: they are sorted after every group, as the capacity's drop, and not counted."""
  weights, experts, z, log_s = choose(plan, x, router, router_bias)
  flat = experts.reshape(-1)
  if mask is not None:  # a masked token's assignments: expert E, past every group
    flat = jnp.where(jnp.repeat(mask, plan.top_k), flat, plan.experts)
  # Stable: within an expert, its assignments stay in token order (the capacity drops the last).
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  counts = jnp.bincount(flat, length=plan.experts + 1)[: plan.experts].astype(jnp.int32)
  group_sizes = counts
  if plan.capacity is not None and plan.capacity_per_sequence:
    order, group_sizes = _drop_per_sequence(plan, flat)
  elif plan.capacity is not None:
    ranked = flat[order]
    starts = jnp.cumsum(counts) - counts
    position = jnp.arange(flat.size, dtype=jnp.int32) - jnp.take(starts, ranked, mode="clip")
    # The dropped assignments go after every group: ragged_dot gives their rows zeros.
    key = jnp.where((position < plan.capacity) & (ranked < plan.experts), ranked, plan.experts)
    order = order[jnp.argsort(key, stable=True)]
    group_sizes = jnp.minimum(counts, plan.capacity)
  inverse = jnp.argsort(order).astype(jnp.int32)
  return Routing(weights, experts, order, inverse, group_sizes, counts), z, log_s


def _log_norm(plan: MoEPlan, z: Array) -> Array:
  """What the log-scores lack of the log-probabilities: logsumexp(z) for softmax, 0 for sigmoid."""
  if plan.score == "softmax":
    return jax.nn.logsumexp(z, axis=-1, keepdims=True)
  return jnp.zeros((), z.dtype)


def counts_of(plan: MoEPlan, experts: Array) -> Array:
  """(E,) int32: the assignments each expert was given, as a sum of one-hot rows (a reduction
  over the tokens, which XLA partitions where the tokens are sharded; a bincount would gather
  them)."""
  return jnp.sum(jax.nn.one_hot(experts, plan.experts, dtype=jnp.int32), axis=(0, 1))


def statistics(plan: MoEPlan, counts: Array, log_s: Array, mask=None) -> dict[str, Array]:
  """What the load-balancing loss is made of, summed over the (unmasked) tokens, so that layers
  pool by adding them: the (E,) assignments each expert was given (before any drop), the (E,)
  sums of the router probabilities (differentiable) and the number of tokens."""
  # P: the router probabilities; sigmoid scores are normalized per token (DeepSeek-V3).
  p = softmax(log_s, axis=-1)
  if mask is None:
    tokens = jnp.asarray(plan.tokens, plan.acc_dtype)
  else:
    p = jnp.where(mask[:, None], p, 0)
    tokens = jnp.sum(mask, dtype=plan.acc_dtype)
  return {
    "expert_counts": counts.astype(plan.acc_dtype),
    "router_prob_sums": jnp.sum(p, axis=0),
    "tokens": tokens,
  }


def balance_loss(stats: dict[str, Array]) -> Array:
  """Switch's / transformers' load-balancing loss of (pooled) :func:`statistics`: E sum_e f_e P_e,
  0 for no tokens."""
  tokens = jnp.maximum(stats["tokens"], 1)
  fraction = stats["expert_counts"] / tokens  # f_e: sums to k, a constant
  return fraction.size * jnp.sum(fraction * (stats["router_prob_sums"] / tokens))


def sequence_balance_loss(plan: MoEPlan, log_s: Array, mask=None, pick=top_k) -> Array:
  """DeepSeek-V3's sequence-wise balance loss L_Bal (its eq. 17-20, without alpha), the mean over
  the sequences that hold a token: sum_i f_i P_i with f_i = E / (k T) times the tokens whose
  top-k scores (no bias, no group limit) hold i and P_i the mean normalized score, over the T
  (unmasked) tokens of the sequence. `pick` as :func:`choose` takes it."""
  plain = dataclasses.replace(plan, top_k_groups=plan.expert_groups)  # no group limit
  raw = pick(plain, lax.stop_gradient(log_s))
  hits = jnp.sum(jax.nn.one_hot(raw, plan.experts, dtype=plan.acc_dtype), axis=1)  # (T, E)
  p = softmax(log_s, axis=-1)  # the scores normalized per token
  if mask is not None:
    hits, p = jnp.where(mask[:, None], hits, 0), jnp.where(mask[:, None], p, 0)
  real = jnp.ones((plan.tokens, 1), plan.acc_dtype) if mask is None else mask[:, None]
  hits, p, tokens = (_per_sequence(plan, v.astype(plan.acc_dtype)) for v in (hits, p, real))
  n = jnp.maximum(tokens, 1)
  per_sequence = jnp.sum(plan.experts / (plan.top_k * n) * hits * (p / n), axis=-1)
  return jnp.sum(per_sequence) / jnp.maximum(jnp.sum(tokens > 0), 1)


def _per_sequence(plan: MoEPlan, v: Array) -> Array:
  """(S, C): the sums of the (T, C) `v` over each sequence's consecutive tokens."""
  if shardings.spec(v) is None:
    return jnp.sum(v.reshape(plan.sequences, -1, v.shape[-1]), axis=1)
  # Tokens split over devices: a one-hot product, reduced where the tokens are (a reshape to
  # (S, T / S) would split the sharded axis where the devices do not divide S).
  seq = jnp.arange(plan.tokens, dtype=jnp.int32) // (plan.tokens // plan.sequences)
  one_hot = jax.nn.one_hot(seq, plan.sequences, dtype=v.dtype)
  one_hot = shardings.to_spec(one_hot, (shardings.spec(v)[0], ()))
  return jnp.einsum("ts,tc->sc", one_hot, v, out_sharding=shardings.pspec(((), ())))


def aux_losses(
  plan: MoEPlan, stats: dict[str, Array], z: Array, log_s: Array, mask=None, pick=top_k
) -> dict[str, Array]:
  """The load-balancing loss (Switch / Mixtral, or DeepSeek-V3's sequence-wise one) and the
  router z-loss (ST-MoE), unweighted, over the unmasked tokens."""
  lse2 = jax.nn.logsumexp(z, axis=-1) ** 2
  if mask is None:
    z_loss = jnp.mean(lse2)
  else:
    z_loss = jnp.sum(jnp.where(mask, lse2, 0)) / jnp.maximum(stats["tokens"], 1)
  if plan.balance_loss == "deepseek_v3":
    balance = sequence_balance_loss(plan, log_s, mask, pick)
  else:
    balance = balance_loss(stats)
  return {"load_balancing_loss": balance, "router_z_loss": z_loss}
