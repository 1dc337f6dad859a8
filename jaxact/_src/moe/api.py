"""Mixture-of-experts MLP: routing, the experts' gated MLPs as grouped matmuls, the weighted
combine, as one op keeping two hidden-sized arrays a routed token.

This module checks the arguments, builds the call's static plan, routes the tokens
(:mod:`jaxact._src.moe.api_routing`) and runs the experts' ``custom_vjp``
(:mod:`jaxact._src.moe.vjp`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from jaxact._src.activations.resolve import resolve_activation
from jaxact._src.core import args, dispatch, shardings
from jaxact._src.core.dispatch import Implementation
from jaxact._src.moe import api_routing, rules, sharding
from jaxact._src.moe.plan import MoEPlan
from jaxact._src.moe.vjp import experts

SCORES = ("softmax", "sigmoid")
BALANCE_LOSSES = ("switch", "deepseek_v3")
# The options the Flax layers (linen and nnx MoEMLP) hold as attributes of these names and pass on.
LAYER_OPTIONS = (
  "top_k", "activation", "score", "normalize_top_k", "capacity_factor", "capacity_per_sequence",
  "expert_groups", "top_k_groups", "balance_loss", "return_stats", "precision",
)  # fmt: skip


def layer_options(layer) -> dict:
  """A Flax MoE layer's :data:`LAYER_OPTIONS`, as :func:`moe_mlp`'s keyword arguments."""
  return {name: getattr(layer, name) for name in LAYER_OPTIONS}


def _shapes(x, router, w_gate, w_up, w_down, router_bias) -> str:
  named = [
    ("x", x),
    ("router", router),
    ("w_gate", w_gate),
    ("w_up", w_up),
    ("w_down", w_down),
    ("router_bias", router_bias),
  ]
  return ", ".join(f"{n}.shape={v.shape}" for n, v in named if v is not None)


def _check_shapes(fn_name, x, router, w_gate, w_up, w_down, router_bias) -> None:
  def fail(message):
    shapes = _shapes(x, router, w_gate, w_up, w_down, router_bias)
    raise ValueError(f"jaxact.{fn_name}: {message} ({shapes})")

  if x.ndim < 1:
    fail("`x` must have rank >= 1 (..., features)")
  if router.ndim != 2:
    fail(f"`router` must have rank 2 (features, experts); got rank {router.ndim}")
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if w.ndim != 3:
      fail(f"`{name}` must have rank 3 (experts, in, out); got rank {w.ndim}")
  d, e = router.shape
  if x.shape[-1] != d:
    fail(f"`x` has {x.shape[-1]} features but `router` expects {d}")
  if w_gate.shape[:2] != (e, d):
    fail(f"`w_gate` must have shape ({e}, {d}, hidden): (experts, features, hidden)")
  if w_up.shape != w_gate.shape:
    fail("`w_up` must have the shape of `w_gate` (experts, features, hidden)")
  if w_down.shape[:2] != (e, w_gate.shape[2]):
    fail(f"`w_down` must have shape ({e}, {w_gate.shape[2]}, out): (experts, hidden, out)")
  if router_bias is not None and router_bias.shape != (e,):
    fail(f"`router_bias` has shape {router_bias.shape}; accepted: shape ({e},) or None")


def _check_options(fn_name, top_k, experts_, score, capacity_factor) -> None:
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
    raise TypeError(f"jaxact.{fn_name}: `top_k` must be an int; got {type(top_k).__name__}")
  if not 1 <= top_k <= experts_:
    raise ValueError(
      f"jaxact.{fn_name}: `top_k` is {top_k}; accepted: 1 to the number of experts ({experts_})"
    )
  if score not in SCORES:
    raise ValueError(f"jaxact.{fn_name}: `score` {score!r} is not known; choose one of: {SCORES}")
  if capacity_factor is not None and (
    isinstance(capacity_factor, bool)
    or not isinstance(capacity_factor, (int, float, np.number))
    or not capacity_factor > 0
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `capacity_factor` is {capacity_factor!r}; accepted: None (dropless) or "
      "a positive number"
    )


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_groups(fn_name, expert_groups, top_k_groups, top_k, experts_) -> int:
  """The number of groups a token may draw from (`top_k_groups`, None: all of them)."""
  for name, v in (("expert_groups", expert_groups), ("top_k_groups", top_k_groups)):
    if v is not None and not _is_int(v):
      raise TypeError(f"jaxact.{fn_name}: `{name}` must be an int; got {type(v).__name__}")
  if not 1 <= expert_groups <= experts_ or experts_ % expert_groups:
    raise ValueError(
      f"jaxact.{fn_name}: `expert_groups` is {expert_groups!r}; accepted: an int dividing the "
      f"number of experts ({experts_})"
    )
  if top_k_groups is None:
    return int(expert_groups)
  if not 1 <= top_k_groups <= expert_groups:
    raise ValueError(
      f"jaxact.{fn_name}: `top_k_groups` is {top_k_groups!r}; accepted: None (every group) or "
      f"an int from 1 to `expert_groups` ({expert_groups})"
    )
  size = experts_ // expert_groups
  if top_k_groups < expert_groups and size < 2:
    raise ValueError(
      f"jaxact.{fn_name}: `expert_groups` is {expert_groups}: groups of {size} expert; a group "
      "is scored by its two best experts, so limiting groups (`top_k_groups`) needs at least 2"
    )
  if top_k > top_k_groups * size:
    raise ValueError(
      f"jaxact.{fn_name}: `top_k` is {top_k} but `top_k_groups`={top_k_groups} groups of {size} "
      f"experts hold only {top_k_groups * size}; accepted: top_k <= top_k_groups * experts / "
      "expert_groups"
    )
  return int(top_k_groups)


def _check_mask(fn_name, token_mask, lead) -> Array | None:
  """The (T,) bool mask of `token_mask` (x's leading shape, bool or integer; nonzero: a token)."""
  if token_mask is None:
    return None
  mask = jnp.asarray(token_mask)
  if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.integer)):
    raise TypeError(
      f"jaxact.{fn_name}: `token_mask` has dtype {mask.dtype}; accepted: bool or integer "
      "(nonzero: a token, zero: padding), or None"
    )
  if mask.shape != lead:
    raise ValueError(
      f"jaxact.{fn_name}: `token_mask` has shape {mask.shape}; accepted: x's leading shape "
      f"{lead}, one entry a token, or None"
    )
  return mask.reshape(-1) != 0


def _unflatten(y: Array, x: Array, lead: tuple[int, ...], out: int) -> Array:
  """The (T, out) `y` as (*lead, out); sharded, with x's leading dimensions' sharding."""
  spec = shardings.spec(x)
  if spec is None or shardings.spec(y) is None:
    return y.reshape(*lead, out)
  y = y.reshape(*lead, out, out_sharding=shardings.pspec((*spec[:-1], ())))
  return y


def moe_mlp(
  x: ArrayLike,
  router: ArrayLike,
  w_gate: ArrayLike,
  w_up: ArrayLike,
  w_down: ArrayLike,
  *,
  top_k: int,
  activation: str | Callable[..., Array] = "silu",
  score: str = "softmax",
  normalize_top_k: bool = True,
  capacity_factor: float | None = None,
  capacity_per_sequence: bool = False,
  router_bias: ArrayLike | None = None,
  expert_groups: int = 1,
  top_k_groups: int | None = None,
  balance_loss: str = "switch",
  token_mask: ArrayLike | None = None,
  return_stats: bool = False,
  precision: lax.PrecisionLike = None,
  implementation: Implementation | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""A mixture-of-experts MLP (Mixtral's, Qwen3-MoE's, DeepSeek-V3's), keeping ``x``, ``a``, ``b``.

  Each token :math:`x_t` is routed to the ``top_k`` experts of highest score and goes through
  their gated MLPs, weighted:

  .. math::
    s_t = \mathrm{score}(x_t R), \quad
    y_t = \sum_{e \in \mathrm{top}_k(s_t)} w_{te}\,
      \bigl(\mathrm{act}(x_t W_g^{e}) \odot x_t W_u^{e}\bigr) W_d^{e}

  with :math:`w_{te} = s_{te}`, divided by :math:`\sum_{e' \in \mathrm{top}_k} s_{te'}` when
  ``normalize_top_k``. Scores: ``"softmax"`` (Switch Transformer, top-1 without normalizing;
  Mixtral, top-2 normalized; Qwen3-MoE, top-8 normalized, ``norm_topk_prob=True``; Qwen2-MoE does
  not normalize) or ``"sigmoid"`` (DeepSeek-V3, top-8 normalized, then multiplied by its
  ``routed_scaling_factor``, which is left to the caller). ``router_bias`` is DeepSeek-V3's
  auxiliary-loss-free balancing bias: added to the scores to pick the experts, not to the weights,
  and given no gradient. With ``top_k_groups`` DeepSeek-V3's group-limited routing (its
  ``n_group``, ``topk_group``): the experts split into ``expert_groups`` groups of consecutive
  indices, each group scored by the sum of its two highest (bias-corrected) scores, and a token's
  top-k drawn from its ``top_k_groups`` best groups only. Ties pick the lower expert index (and
  group), as :func:`jax.lax.top_k` does. The
  router logits, scores and weights are computed in float32 (float64 for float64 inputs); the
  normalized weights as a softmax of the top-k log-scores, exact where the scores underflow.

  The tokens are sorted by expert and each expert's projections are one group of
  :func:`jax.lax.ragged_dot`. Between the forward and the backward pass the op keeps the input
  ``x``, the two projections ``a = x W_g`` and ``b = x W_u`` of every routed token (two
  ``(tokens * top_k, hidden)`` arrays), the top-k weights and the routing (two ``(tokens *
  top_k,)`` permutations and the group sizes), nothing else; ``h = act(a) * b`` is recomputed.
  Autodiff of the same composition keeps the sorted input, ``act(a)``, ``h`` and the experts'
  outputs besides. The router's gradient comes through the top-k weights (the choice of experts
  is not differentiable).

  Dropless by default: every expert computes every token routed to it. With ``capacity_factor``
  each expert computes at most ``ceil(capacity_factor * tokens * top_k / experts)`` tokens; the
  tokens beyond that, the later ones in token order, skip it (their weight times zero), as in
  Switch Transformer. With ``capacity_per_sequence`` the capacity is each sequence's (``x``'s
  second-to-last axis; the axes before it index the sequences), ``ceil(capacity_factor *
  sequence length * top_k / experts)``, and each sequence's tokens queue for it alone, as
  Switch Transformer counts it per group (not with expert parallelism).

  Expert parallel under Explicit mesh axes: with the experts' dimension of ``w_gate``, ``w_up``
  and ``w_down`` split over mesh axes, each device routes its tokens and sends each routed token
  to its expert's device and back (:func:`jax.lax.all_to_all` in :func:`jax.shard_map`); tokens
  split over data axes and hidden features over tensor axes beside, the result and gradients those
  of one device. Dropless, each device computes the most rows it can receive (``devices *
  tokens a device * min(top_k, experts a device)``); a capacity shrinks that to what it admits.
  See ``docs/moe.md``.

  No tokens give the empty output, losses 0 and zero gradients. Under :func:`jax.vmap` each mapped
  element is its own call (its routing, capacity and losses), its routed rows joining one grouped
  call over all of them (:mod:`jaxact._src.moe.vjp_batching`); expert-parallel calls refuse it.

  Also returns, unweighted, the load-balancing loss (Switch Transformer eq. 4, as Mixtral's and
  Qwen3-MoE's ``load_balancing_loss_func``) and the router z-loss (ST-MoE eq. 5):

  .. math::
    L_\mathrm{balance} = E \sum_e f_e P_e, \qquad
    L_z = \frac{1}{T} \sum_t \bigl(\log \textstyle\sum_e e^{z_{te}}\bigr)^2

  where :math:`f_e` is the fraction of tokens routed to expert :math:`e` (before any capacity
  drop; the :math:`f_e` sum to ``top_k``, so a uniform router gives ``top_k``), :math:`P_e` the
  mean over tokens of the softmax of the logits :math:`z = x R` (for sigmoid scores, the scores
  normalized per token, as DeepSeek-V3's balance loss) and :math:`T` the number of tokens. Its
  :math:`f_e` count the chosen experts (``router_bias`` and the group limit included), and it is
  ``top_k`` times DeepSeek-V3's :math:`L_\mathrm{Bal}`: weigh it :math:`\alpha / k` to copy that
  paper's :math:`\alpha`. ``balance_loss="deepseek_v3"`` gives :math:`L_\mathrm{Bal}` itself
  (its report's eq. 17-20, unweighted): per sequence (``x``'s last leading dimension, the others
  indexing sequences), :math:`\sum_e f_e P_e` with :math:`f_e = E / (k T)` times the tokens whose
  top-k scores (without bias or group limit) hold :math:`e`, the mean over the sequences.

  Args:
    x: input of shape ``(..., features)``, floating point; the leading dimensions are tokens.
    router: the router's kernel, ``(features, experts)``.
    w_gate: the experts' gate kernels, ``(experts, features, hidden)``.
    w_up: the experts' up kernels, ``(experts, features, hidden)``.
    w_down: the experts' down kernels, ``(experts, hidden, out)``.
    top_k: the number of experts each token goes to, 1 to ``experts``.
    activation: the gate's activation, as :func:`jaxact.gated_mlp` takes it (default ``"silu"``).
    score: ``"softmax"`` (default) or ``"sigmoid"``.
    normalize_top_k: divide each token's top-k weights by their sum (default True).
    capacity_factor: None (default: dropless) or a positive number (see above).
    capacity_per_sequence: count the capacity per sequence rather than over every token
      (default False; see above).
    router_bias: None or ``(experts,)``: added to the scores for the choice only (DeepSeek-V3).
    expert_groups: the experts' groups for ``top_k_groups``, dividing ``experts`` (default 1).
    top_k_groups: None (default: every group) or the number of best groups a token's experts
      come from, 1 to ``expert_groups``, holding at least ``top_k`` experts (see above).
    balance_loss: ``"switch"`` (default) or ``"deepseek_v3"``, the ``load_balancing_loss``
      returned (see below); the statistics of ``return_stats`` are the same for both.
    token_mask: None (default: every row a token) or a bool or integer array of ``x``'s leading
      shape, zero where a row is padding (transformers' ``attention_mask``): a padding row goes
      to no expert (its output is zero; it takes no capacity and no grouped-product rows, the
      capacity staying that of all the rows, a static size) and counts in no auxiliary loss or
      statistic. Not with expert parallelism (``NotImplementedError``).
    return_stats: also return the balance loss's statistics, summed over the tokens so that
      layers pool by adding them (default False; see Returns).
    precision: passed to the matmuls, forward and backward.
    implementation: the experts' grouped products: ``None`` (the best available: XLA until a GPU
      measures the kernels, see the dispatch docs), ``"xla"`` (:func:`jax.lax.ragged_dot`) or
      ``"pallas"`` (the Triton grouped matmuls, forward and backward, which compute each expert's
      rows alone; float32, bfloat16 and float16; per device under expert parallelism). Kernels
      run in interpret mode off CUDA; calls they do not support raise ``NotImplementedError``.

  Returns:
    ``(y, aux)``: ``y`` of shape ``(..., out)`` in the input dtype, and a dict of scalars
    ``{"load_balancing_loss": ..., "router_z_loss": ...}`` (float32, float64 for float64 inputs)
    for the caller to weigh (Switch: 0.01; ST-MoE: z-loss 0.001). With ``return_stats``,
    ``aux`` also holds ``"expert_counts"`` (``(experts,)``, the assignments each expert was given
    before any drop, a constant), ``"router_prob_sums"`` (``(experts,)``, the sums over the
    tokens of :math:`P`, differentiable) and ``"tokens"`` (their number): the balance loss of
    several layers pooled, as transformers' ``load_balancing_loss_func`` pools their router
    logits, is :math:`E \sum_e c_e p_e / N^2` of the layers' summed counts :math:`c`, sums
    :math:`p` and tokens :math:`N` (``docs/moe.md``).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxact
    >>> k = jax.random.split(jax.random.key(0), 5)
    >>> x = jax.random.normal(k[0], (6, 4))
    >>> router = jax.random.normal(k[1], (4, 3))
    >>> w_gate, w_up = jax.random.normal(k[2], (3, 4, 8)), jax.random.normal(k[3], (3, 4, 8))
    >>> w_down = jax.random.normal(k[4], (3, 8, 4))
    >>> y, aux = jaxact.moe_mlp(x, router, w_gate, w_up, w_down, top_k=2)
    >>> y.shape, sorted(aux)
    ((6, 4), ['load_balancing_loss', 'router_z_loss'])
  """
  fn_name = "moe_mlp"
  dispatch.check_implementation(fn_name, implementation, tuple(rules.FAMILY.implementations))
  with jax.named_scope(f"jaxact.{fn_name}"):
    arrays = {
      "x": x,
      "router": router,
      "w_gate": w_gate,
      "w_up": w_up,
      "w_down": w_down,
      "router_bias": router_bias,
    }
    prepared, acc, out = args.prepare_arrays(fn_name, arrays, None)
    x, router, w_gate, w_up, w_down, router_bias = prepared.values()
    _check_shapes(fn_name, x, router, w_gate, w_up, w_down, router_bias)
    n_experts = router.shape[1]
    _check_options(fn_name, top_k, n_experts, score, capacity_factor)
    top_k_groups = _check_groups(fn_name, expert_groups, top_k_groups, top_k, n_experts)
    if balance_loss not in BALANCE_LOSSES:
      raise ValueError(
        f"jaxact.{fn_name}: `balance_loss` {balance_loss!r} is not known; choose one of: "
        f"{BALANCE_LOSSES}"
      )
    if not isinstance(return_stats, bool):
      raise TypeError(
        f"jaxact.{fn_name}: `return_stats` must be a bool; got {type(return_stats).__name__}"
      )
    lead = x.shape[:-1]
    mask = _check_mask(fn_name, token_mask, lead)
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    tokens = x2.shape[0]
    if not isinstance(capacity_per_sequence, bool):
      raise TypeError(
        f"jaxact.{fn_name}: `capacity_per_sequence` must be a bool; got "
        f"{type(capacity_per_sequence).__name__}"
      )
    sequences = math.prod(lead[:-1])
    capacity = None
    if capacity_factor is not None:
      queue = tokens // sequences if capacity_per_sequence and sequences else tokens
      capacity = math.ceil(capacity_factor * queue * top_k / n_experts)
    a_shape = jax.ShapeDtypeStruct((tokens * top_k, w_gate.shape[2]), acc)
    act, dynamic = resolve_activation(fn_name, activation, a_shape, out)
    if act.rule is not None and act.rule.code is not None:
      raise ValueError(
        f"jaxact.{fn_name}: `activation` asks for residual_bits={act.rule.code.bits}, but the "
        "experts keep the gate's pre-activation a anyway; drop residual_bits"
      )
    if tokens == 0:  # nothing routed: the empty output, losses 0, every gradient 0
      zero = jnp.zeros((), acc)
      y = jnp.zeros((*lead, w_down.shape[2]), out)
      aux = {"load_balancing_loss": zero, "router_z_loss": zero}
      if return_stats:
        per_expert = jnp.zeros((n_experts,), acc)
        aux |= {"expert_counts": per_expert, "router_prob_sums": per_expert, "tokens": zero}
      return y, aux
    plan = MoEPlan(
      act=act,
      precision=args.hashable_precision(precision),
      acc_dtype=acc,
      out_dtype=out,
      tokens=tokens,
      experts=n_experts,
      top_k=int(top_k),
      score=score,
      normalize_top_k=bool(normalize_top_k),
      capacity=capacity,
      capacity_per_sequence=capacity_per_sequence,
      expert_groups=int(expert_groups),
      top_k_groups=top_k_groups,
      balance_loss=balance_loss,
      sequences=sequences,
    )
    pat = sharding.pattern(fn_name, plan, x2, router, w_gate, w_up, w_down, router_bias)
    decision = rules.decide(fn_name, implementation, plan, x2, w_gate, w_down)
    plan = dataclasses.replace(plan, decision=decision)
    pick = api_routing.top_k
    if pat is None:
      routing, z, log_s = api_routing.route(plan, x2, router, router_bias, mask)
      y = experts(
        plan,
        x2,
        routing.weights,
        w_gate,
        w_up,
        w_down,
        routing.order,
        routing.inverse,
        routing.group_sizes,
        *dynamic,
      )
      counts = routing.counts
    else:  # expert parallel: each device sorts and sends its own tokens
      if capacity_per_sequence and capacity is not None:
        raise NotImplementedError(
          f"jaxact.{fn_name}: `capacity_per_sequence` with the experts split over mesh axes "
          "(expert parallel) is not supported; its capacity is counted over the whole batch"
        )
      if mask is not None:
        raise NotImplementedError(
          f"jaxact.{fn_name}: `token_mask` with the experts split over mesh axes (expert "
          "parallel) is not supported; without it the padding is routed as tokens"
        )
      x2 = shardings.to_spec(x2, (pat.tokens, ()))
      pick = functools.partial(sharding.top_k, pat)
      weights, chosen, z, log_s = api_routing.choose(plan, x2, router, router_bias, pick)
      placed = sharding.place(pat, x2, weights, chosen, w_gate, w_up, w_down)
      y = sharding.experts(plan, pat, *placed[:2], *placed[3:], placed[2], *dynamic)
      counts = api_routing.counts_of(plan, chosen)
    stats = api_routing.statistics(plan, counts, log_s, mask)
    aux = api_routing.aux_losses(plan, stats, z, log_s, mask, pick)
    if return_stats:
      aux |= stats
    return _unflatten(y, x, lead, w_down.shape[2]), aux
