"""jaxact.policy_gradient_loss against the plain formula over the full logits
(``jaxact/_src/lce/reference.py``: the ratio, the clipped surrogate, the k3 KL and the entropy bonus
as the papers write them), differentiated by JAX: every loss type, on- and off-policy, advantages
per sequence and per token, padding; ratios that would overflow; empty sequences; the metrics;
bad input; and that no (tokens, vocabulary) array is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.lce.reference import (
  entropy_reference,
  log_probs_reference,
  policy_gradient_reference,
)

from cases import assert_trees_close

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "ppo")
G, T, D, V = 3, 7, 8, 40


def _batch(dtype=jnp.float64, seed=0, spread=0.3):
  """Hidden states, head, bias, tokens, a padding mask (the last sequence shorter), and old and
  reference log-probs a little off the policy's, so that some ratios leave the clip range."""
  k = jax.random.split(jax.random.key(seed), 7)
  x = jax.random.normal(k[0], (G, T, D), jnp.float64)
  w = jax.random.normal(k[1], (D, V), jnp.float64) / np.sqrt(D) * 2
  b = 0.3 * jax.random.normal(k[2], (V,), jnp.float64)
  tokens = jax.random.randint(k[3], (G, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([T, T - 2, 3])[:, None]
  logp = log_probs_reference(x, w, tokens, bias=b)
  old = logp + spread * jax.random.normal(k[4], (G, T), jnp.float64)
  ref = logp + spread * jax.random.normal(k[5], (G, T), jnp.float64)
  adv = jax.random.normal(k[6], (G,), jnp.float64)
  cast = lambda a: a.astype(dtype)
  return cast(x), cast(w), cast(b), tokens, mask, old, ref, adv


def _both(loss_type, dtype=jnp.float64, *, per_token=False, off_policy=True, **options):
  x, w, b, tokens, mask, old, ref, adv = _batch(dtype)
  if per_token:
    adv = adv[:, None] * jnp.linspace(0.5, 1.5, T)[None, :]
  kw = dict(
    mask=mask,
    old_log_probs=old if off_policy else None,
    ref_log_probs=ref,
    loss_type=loss_type,
    beta=0.05,
    entropy_coef=0.01,
    epsilon=0.2,
    **options,
  )
  if loss_type == "gspo":
    kw["epsilon"], kw["epsilon_high"] = 0.03, 0.04  # a sequence's mean log-ratio moves less

  def ours(x, w, b):
    return jaxact.policy_gradient_loss(x, w, tokens, adv, bias=b, **kw)[0]

  def plain(x, w, b):
    return policy_gradient_reference(x, w, tokens, adv, bias=b, **kw)

  up = lambda a: a.astype(jnp.promote_types(dtype, jnp.float32))
  got = jax.value_and_grad(ours, (0, 1, 2))(x, w, b)
  want = jax.value_and_grad(plain, (0, 1, 2))(up(x), up(w), up(b))
  return got, want


@pytest.mark.sample(
  2, "gspo-per_sequence-off", "dr_grpo-per_token-on", "dapo-per_token-off", "ppo-per_token-off"
)
@pytest.mark.parametrize("policy", [True, False], ids=["off", "on"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sequence", "per_token"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_float64_equals_autodiff_of_the_papers_formula(loss_type, per_token, policy):
  got, want = _both(loss_type, per_token=per_token, off_policy=policy)
  assert_trees_close(got, want, 1e-12)


def test_some_ratios_are_clipped_in_the_off_policy_batch():
  """The cases above cross the clip: the comparison covers both branches of the surrogate."""
  x, w, b, tokens, mask, old, _, adv = _batch()
  _, metrics = jaxact.policy_gradient_loss(
    x, w, tokens, adv, bias=b, mask=mask, old_log_probs=old, loss_type="dapo"
  )
  assert 0.05 < float(metrics["clip_fraction"]) < 0.95


@pytest.mark.sample(1, "bfloat16")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_lower_precisions_against_the_float32_formula(dtype):
  got, want = _both("grpo", dtype, temperature=0.8, logit_soft_cap=20.0)
  assert got[0].dtype == jnp.float32 and got[1][0].dtype == dtype
  assert_trees_close(got, want, {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}[dtype])


def test_on_policy_ratio_is_one_and_the_log_probs_are_the_next_steps_old_ones():
  x, w, b, tokens, mask, _, _, adv = _batch()
  _, metrics = jaxact.policy_gradient_loss(x, w, tokens, adv, bias=b, mask=mask)
  assert float(metrics["ratio"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0
  want = jnp.where(mask, log_probs_reference(x, w, tokens, bias=b), 0)
  np.testing.assert_allclose(metrics["log_probs"], want, rtol=1e-12, atol=1e-12)
  assert float(metrics["kl"]) == 0.0


def test_ratios_that_would_overflow_stay_finite_where_the_clip_holds():
  """float32, old log-probs 200 below the policy's (a ratio of e^200 would overflow): with a
  positive advantage the clip holds and the loss is the clipped value with zero gradient; the
  plain formula's gradient is NaN there (0 * inf)."""
  x, w, _, tokens, mask, _, _, _ = _batch(jnp.float32)
  old = jnp.full((G, T), -200.0, jnp.float32)
  adv = jnp.ones((G,), jnp.float32)
  for loss_type in LOSS_TYPES:
    f = lambda x, w, loss_type=loss_type: jaxact.policy_gradient_loss(
      x, w, tokens, adv, mask=mask, old_log_probs=old, loss_type=loss_type, epsilon_high=0.2
    )[0]
    loss, grads = jax.value_and_grad(f, (0, 1))(x, w)
    share = float(jnp.sum(mask)) / (G * T) if loss_type == "dr_grpo" else 1.0  # of G * T
    assert np.isclose(float(loss), -1.2 * share, rtol=1e-6), loss_type
    assert all(np.all(np.asarray(g) == 0) for g in grads), loss_type
  plain = lambda x, w: policy_gradient_reference(x, w, tokens, adv, mask=mask, old_log_probs=old)
  assert np.isnan(np.asarray(jax.grad(plain)(x, w))).any()  # what the safe form avoids


def test_empty_sequences_and_an_empty_batch_give_zero_without_nan():
  x, w, _, tokens, _, old, ref, adv = _batch()
  one_empty = jnp.arange(T)[None, :] < jnp.array([T, 0, 2])[:, None]
  for mask, empty_batch in ((one_empty, False), (jnp.zeros((G, T), bool), True)):
    for loss_type in LOSS_TYPES:
      f = lambda x, w, mask=mask, loss_type=loss_type: jaxact.policy_gradient_loss(
        x,
        w,
        tokens,
        adv,
        mask=mask,
        old_log_probs=old,
        ref_log_probs=ref,
        beta=0.1,
        loss_type=loss_type,
      )
      (loss, metrics), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(x, w)
      assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in grads)
      assert np.all(np.asarray(grads[0])[1] == 0)  # the empty sequence gets no gradient
      if empty_batch:
        assert float(loss) == 0.0 and float(metrics["ratio"]) == 0.0
      else:
        want = policy_gradient_reference(
          x,
          w,
          tokens,
          adv,
          mask=mask,
          old_log_probs=old,
          ref_log_probs=ref,
          beta=0.1,
          loss_type=loss_type,
        )
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-12)


def trl_metrics(logp, entropy, mask, old, ref, adv, loss_type, eps_low, eps_high):
  """The metrics TRL's GRPOTrainer logs (``_compute_loss``: ``global_masked_mean`` of the per-token
  k3 KL, of the entropies and of ``is_region_clipped``; sequence-level importance sampling, GSPO,
  averages the clipped flags over every sequence, ``x.sum() / x.shape[0]``), in float64 numpy."""
  logp, entropy, old, ref = (np.asarray(a, np.float64) for a in (logp, entropy, old, ref))
  m = np.asarray(mask, np.float64)
  a = np.asarray(adv, np.float64)[:, None]
  mean = lambda v: float(np.sum(v * m) / max(np.sum(m), 1.0))
  d = ref - logp
  log_ratio = (logp - old) * m
  if loss_type == "gspo":
    coef = np.exp(log_ratio.sum(-1) / np.maximum(m.sum(-1), 1.0))[:, None]
  else:
    coef = np.exp(log_ratio)
  clipped = ((coef < 1 - eps_low) & (a < 0)) | ((coef > 1 + eps_high) & (a > 0))
  clip = float(clipped.mean()) if loss_type == "gspo" else mean(clipped)
  return {"kl": mean(np.exp(d) - d - 1), "entropy": mean(entropy), "clip_fraction": clip}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_metrics_are_what_trl_logs(loss_type):
  """``kl``, ``entropy`` and ``clip_fraction`` against TRL's formulas (above), with an empty
  sequence. Before, ``kl`` was the loss-weighted sum (Dr. GRPO's 1 / (G L), GRPO's over G
  sequences counting the empty one) and GSPO's ``clip_fraction`` divided by the non-empty
  sequences only."""
  x, w, b, tokens, _, old, ref, adv = _batch()
  mask = jnp.arange(T)[None, :] < jnp.array([T, 0, 4])[:, None]  # the second sequence empty
  eps = (0.03, 0.04) if loss_type == "gspo" else (0.2, 0.2)
  _, metrics = jaxact.policy_gradient_loss(
    x,
    w,
    tokens,
    adv,
    bias=b,
    mask=mask,
    old_log_probs=old,
    ref_log_probs=ref,
    beta=0.1,
    loss_type=loss_type,
    epsilon=eps[0],
    epsilon_high=eps[1],
  )
  logp = log_probs_reference(x, w, tokens, bias=b)
  entropy = entropy_reference(x, w, bias=b)
  want = trl_metrics(logp, entropy, mask, old, ref, adv, loss_type, *eps)
  for name, value in want.items():
    np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-12, err_msg=name)
  assert 0 < want["clip_fraction"] < 1  # the case crosses the clip


def test_dr_grpo_kl_is_the_token_mean_and_gspo_counts_the_empty_sequence():
  """The issue's cases: every token's k3 equal gives that k3 as ``kl`` under Dr. GRPO (not the
  sum weighted by 1 / (G L)); GSPO with three clipped sequences and an empty fourth logs 0.75."""
  g, t = 4, 5
  x = jnp.zeros((g, t, D))
  w = jnp.zeros((D, V))
  tokens = jnp.zeros((g, t), jnp.int32)
  mask = jnp.arange(t)[None, :] < jnp.array([5, 3, 2, 0])[:, None]
  logp = -np.log(V)
  d = 0.6
  ref = jnp.full((g, t), logp + d)
  old = jnp.full((g, t), logp - 1.0)  # every ratio e: clipped for a positive advantage
  _, metrics = jaxact.policy_gradient_loss(
    x, w, tokens, jnp.ones(g), mask=mask, ref_log_probs=ref, beta=0.1, loss_type="dr_grpo"
  )
  np.testing.assert_allclose(float(metrics["kl"]), np.exp(d) - d - 1, rtol=1e-12)
  _, metrics = jaxact.policy_gradient_loss(
    x, w, tokens, jnp.ones(g), mask=mask, old_log_probs=old, loss_type="gspo"
  )
  assert float(metrics["clip_fraction"]) == 0.75


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(loss_type="reinforce"), ValueError, "loss_type"),
    (dict(epsilon=1.0), ValueError, "epsilon"),
    (dict(epsilon=-0.1), ValueError, "epsilon"),
    (dict(epsilon_high=float("inf")), ValueError, "epsilon_high"),
    (dict(beta=0.1), ValueError, "ref_log_probs"),
    (dict(beta=-1.0, ref_log_probs=jnp.zeros((G, T))), ValueError, "beta"),
    (dict(entropy_coef="0.1"), TypeError, "entropy_coef"),
    (dict(max_length=0), ValueError, "max_length"),
    (dict(old_log_probs=jnp.zeros((G, T + 1))), ValueError, "old_log_probs"),
    (dict(advantages=jnp.zeros((G + 1,))), ValueError, "advantages"),
    (dict(mask=jnp.ones((G, T), jnp.int32)), TypeError, "mask"),
  ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
  x, w, _, tokens, _, _, _, adv = _batch(jnp.float32)
  adv = kwargs.pop("advantages", adv)
  with pytest.raises(error, match=f"policy_gradient_loss.*{match}"):
    jaxact.policy_gradient_loss(x, w, tokens, adv, **kwargs)


def test_no_tokens_by_vocabulary_array_in_the_compiled_step():
  """B 4 x T 128 tokens, V 32768, D 64, float32: the compiled ``jit(grad)`` temp against the
  plain composition's, which builds the (tokens, V) logits and their softmax."""
  g, t, d, v = 4, 128, 64, 32768
  x = jax.ShapeDtypeStruct((g, t, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)
  tokens = jnp.zeros((g, t), jnp.int32)
  old = jnp.zeros((g, t), jnp.float32)
  adv = jnp.ones((g,), jnp.float32)
  ours = lambda x, w: jaxact.policy_gradient_loss(x, w, tokens, adv, old_log_probs=old)[0]
  options = dict(  # TRL's options: a few more (tokens,) arrays, the entropy quantile's sort
    old_log_probs=old,
    sampling_log_probs=old - 0.1,
    top_entropy_quantile=0.2,
    off_policy_mask_threshold=0.1,
    delta=4.0,
    ref_log_probs=old,
    beta=0.1,
    use_bias_correction_kl=True,
    entropy_coef=0.01,
  )
  optioned = lambda x, w: jaxact.policy_gradient_loss(x, w, tokens, adv, **options)[0]
  plain = lambda x, w: policy_gradient_reference(x, w, tokens, adv, old_log_probs=old)
  temp = lambda f: jax.jit(jax.grad(f, (0, 1))).lower(x, w).compile().memory_analysis()
  logits = g * t * v * 4
  ours, plain = temp(ours).temp_size_in_bytes, temp(plain).temp_size_in_bytes
  optioned = temp(optioned).temp_size_in_bytes
  # ours: three (tokens, block) buffers of the vocabulary loop (log-probs, entropy); plain: the
  # logits, their softmax and its cotangent
  assert ours < logits / 2 and plain >= 2 * logits and ours < plain / 5
  assert optioned < logits / 2


# TRL GRPOTrainer's options (``_compute_loss``, and the importance-sampling ratio of
# ``_generate_and_score_completions``), transcribed line by line from torch to jnp on given
# per-token log-probabilities: one process, no gradient-accumulation scaling. Its keyword names are
# TRL's; `_TRL_NAMES` is the docs' table of jaxact argument -> TRL argument.
_TRL_NAMES = {
  "sampling_log_probs": "sampling_per_token_logps",
  "importance_sampling_mode": "vllm_importance_sampling_mode",
  "importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
  "importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
  "max_length": "max_completion_length",
}


def trl_compute_loss(
  per_token_logps,
  entropies,
  mask,
  advantages,
  old_per_token_logps,
  ref_per_token_logps,
  *,
  loss_type,
  importance_sampling_level="token",
  epsilon=0.2,
  epsilon_high=None,
  delta=None,
  beta=0.0,
  use_bias_correction_kl=False,
  entropy_coef=0.0,
  top_entropy_quantile=1.0,
  sampling_per_token_logps=None,
  vllm_importance_sampling_mode="sequence_mask",
  vllm_importance_sampling_clip_min=None,
  vllm_importance_sampling_clip_max=3.0,
  off_policy_mask_threshold=None,
  sapo_temperature_pos=1.0,
  sapo_temperature_neg=1.05,
  max_completion_length=None,
  num_items_in_batch=None,
):
  """Returns ``(loss, logged)``: TRL's loss and its logged ``kl`` and clip fraction."""
  sg = jax.lax.stop_gradient
  m = mask.astype(per_token_logps.dtype)
  eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
  if num_items_in_batch is None:
    num_items_in_batch = m.sum()
  old = sg(per_token_logps) if old_per_token_logps is None else old_per_token_logps
  is_ratio = None
  if sampling_per_token_logps is not None:  # _generate_and_score_completions
    diff = (old - sampling_per_token_logps) * m
    if vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
      diff = diff.sum(-1, keepdims=True)
    is_ratio = jnp.exp(diff)
    lo, hi = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max
    if vllm_importance_sampling_mode.endswith("truncate"):
      is_ratio = jnp.clip(is_ratio, lo, hi)
    else:
      lo, hi = -np.inf if lo is None else lo, np.inf if hi is None else hi
      is_ratio = jnp.where((is_ratio < lo) | (is_ratio > hi), 0.0, is_ratio)
  entropy_mask = None
  if top_entropy_quantile < 1.0:  # get_high_entropy_mask
    threshold = jnp.quantile(sg(entropies)[np.asarray(mask)], 1 - top_entropy_quantile)
    entropy_mask = ((sg(entropies) * m) >= threshold) & mask
  adv = advantages[:, None] if advantages.ndim == 1 else advantages
  if off_policy_mask_threshold is not None:  # get_off_policy_mask
    sampling = old if sampling_per_token_logps is None else sampling_per_token_logps
    kl_div = sampling - sg(per_token_logps)
    avg = (kl_div * m).sum(1, keepdims=True) / jnp.maximum(m.sum(1, keepdims=True), 1.0)
    off_policy_mask = ((adv >= 0) | (avg <= off_policy_mask_threshold)).astype(m.dtype)
  log_ratio = per_token_logps - old
  if importance_sampling_level == "token":
    liw = log_ratio
  else:
    liw = ((log_ratio * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0))[:, None]
  coef_1 = jnp.exp(liw)
  if beta != 0.0:
    d = ref_per_token_logps - per_token_logps
    per_token_kl = jnp.exp(d) - d - 1
    if use_bias_correction_kl:
      per_token_kl = per_token_kl * coef_1
  if loss_type == "cispo":
    per_token_loss = -sg(jnp.minimum(coef_1, eps_high)) * adv * per_token_logps
    clipped = (coef_1 > eps_high) & (adv > 0)
  elif loss_type == "sapo":
    t = jnp.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
    per_token_loss = -jax.nn.sigmoid(t * (coef_1 - 1)) * 4 / t * adv
    clipped = jnp.zeros(m.shape, bool)
  else:
    coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
    if delta is not None:
      coef_1 = jnp.minimum(coef_1, delta)
    per_token_loss = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    clipped = ((coef_1 < 1 - eps_low) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
  if off_policy_mask_threshold is not None:
    per_token_loss = per_token_loss * off_policy_mask
  if entropy_mask is not None:
    per_token_loss = per_token_loss * entropy_mask
  if is_ratio is not None:
    per_token_loss = per_token_loss * is_ratio
  if beta != 0.0:
    per_token_loss = per_token_loss + beta * per_token_kl
  if loss_type in ("grpo", "sapo"):
    loss = ((per_token_loss * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0)).mean()
  elif loss_type == "bnpo":
    loss = (per_token_loss * m).sum() / jnp.maximum(m.sum(), 1.0)
  elif loss_type == "dr_grpo":
    loss = (per_token_loss * m).sum() / (per_token_loss.shape[0] * max_completion_length)
  else:  # cispo, dapo
    normalizer = jnp.maximum(num_items_in_batch, 1.0)
    loss = (per_token_loss * m).sum() / normalizer
  if entropy_coef:
    effective = m if entropy_mask is None else m * entropy_mask
    if loss_type in ("cispo", "dapo"):
      loss = loss - entropy_coef * (entropies * effective).sum() / normalizer
    else:
      loss = loss - entropy_coef * (entropies * effective).sum() / jnp.maximum(effective.sum(), 1)
  masked = lambda v: (
    v.sum() / v.shape[0] if v.shape[1] == 1 else (v * m).sum() / jnp.maximum(m.sum(), 1)
  )
  logged = {"clip_fraction": masked(clipped.astype(m.dtype))}
  if beta != 0.0:
    logged["kl"] = masked(per_token_kl)
  return loss, logged


def _trl_batch():
  """`_batch` in float64 with old log-probs 0.5 off (ratios beyond a delta of 1.3), a sampling
  engine's log-probs 0.15 off the old ones, and two negative advantages (one sequence drifted
  from the sampling engine's by 0.09 a token, the other by -0.2)."""
  x, w, b, tokens, mask, old, ref, _ = _batch(spread=0.5)
  adv = jnp.array([0.8, -0.5, -0.6])
  sampling = old + 0.15 * jax.random.normal(jax.random.key(7), old.shape, jnp.float64)
  return x, w, b, tokens, mask, old, ref, adv, sampling


def _trl(loss_type, logp, entropy, mask, adv, old, ref, sampling, options):
  kw = {_TRL_NAMES.get(k, k): v for k, v in options.items()}
  if kw.pop("sampling_per_token_logps", None) is not None:
    kw["sampling_per_token_logps"] = sampling
  trl_type, level = {"gspo": ("grpo", "sequence"), "ppo": ("bnpo", "token")}.get(
    loss_type, (loss_type, "token")
  )
  kw.setdefault("max_completion_length", T)
  if loss_type == "dapo":
    kw.setdefault("epsilon_high", 0.28)  # jaxact's DAPO default; TRL's is epsilon
  if loss_type == "cispo":
    kw.setdefault("epsilon_high", 5.0)  # jaxact's CISPO default (ScaleRL's); TRL's is epsilon
  return trl_compute_loss(
    logp, entropy, mask, adv, old, ref, loss_type=trl_type, importance_sampling_level=level, **kw
  )


_ALL = dict(beta=0.05, use_bias_correction_kl=True, off_policy_mask_threshold=0.05)
_SAMPLED = dict(sampling_log_probs=True)
_BINDING = {  # the options whose removal must move the loss in each case that names them
  "delta",
  "use_bias_correction_kl",
  "top_entropy_quantile",
  "sampling_log_probs",
  "importance_sampling_clip_min",
  "importance_sampling_clip_max",
  "off_policy_mask_threshold",
  "num_items_in_batch",
  "sapo_temperature_pos",
  "sapo_temperature_neg",
}
TRL_CASES = [  # the default four combine every option; the surveys take one at a time
  (
    "dapo",
    dict(
      _ALL,
      **_SAMPLED,
      importance_sampling_mode="token_truncate",
      importance_sampling_clip_min=0.9,
      delta=1.3,
      top_entropy_quantile=0.8,
      entropy_coef=0.01,
      num_items_in_batch=40,
    ),
  ),
  (
    "gspo",
    dict(
      _ALL,
      **_SAMPLED,
      importance_sampling_mode="sequence_mask",
      importance_sampling_clip_max=1.5,
      delta=1.03,
      epsilon=0.01,
      epsilon_high=0.02,
    ),
  ),
  (
    "cispo",
    dict(
      _ALL,
      **_SAMPLED,
      importance_sampling_mode="sequence_truncate",
      importance_sampling_clip_max=1.5,
      epsilon_high=1.2,
      top_entropy_quantile=0.5,
      num_items_in_batch=25,
    ),
  ),
  (
    "sapo",
    dict(
      _ALL,
      **_SAMPLED,
      importance_sampling_mode="token_mask",
      importance_sampling_clip_min=0.9,
      importance_sampling_clip_max=1.2,
      sapo_temperature_neg=2.0,
    ),
  ),
] + [
  pytest.param(loss_type, options, marks=pytest.mark.exhaustive)
  for loss_type, options in [
    ("grpo", dict(delta=1.3)),
    ("dr_grpo", dict(delta=1.3, max_length=9)),
    ("ppo", dict(delta=1.3)),
    ("grpo", dict(top_entropy_quantile=0.2)),
    ("dr_grpo", dict(top_entropy_quantile=0.0)),
    ("grpo", dict(off_policy_mask_threshold=0.05, sampling_log_probs=True)),
    (
      "gspo",
      dict(
        off_policy_mask_threshold=0.0,
        sampling_log_probs=True,
        importance_sampling_mode="token_mask",
        importance_sampling_clip_max=1.1,
        epsilon=0.01,
        epsilon_high=0.02,
      ),
    ),
    ("grpo", dict(beta=0.1, use_bias_correction_kl=True)),
    (
      "ppo",
      dict(
        sampling_log_probs=True,
        importance_sampling_mode="sequence_truncate",
        importance_sampling_clip_min=0.9,
        importance_sampling_clip_max=None,
      ),
    ),
    ("grpo", dict(sampling_log_probs=True)),
    ("cispo", dict()),
    ("cispo", dict(epsilon_high=1.1)),
    ("sapo", dict()),
    ("sapo", dict(sapo_temperature_pos=3.0, beta=0.1)),
    ("dapo", dict(num_items_in_batch=7)),
  ]
]


@pytest.mark.parametrize(("loss_type", "options"), TRL_CASES)
def test_trl_options_in_float64_equal_trls_loss_and_its_autodiff(loss_type, options):
  """Loss, gradients and logged metrics against ``trl_compute_loss`` (above) on the plain
  composition's log-probs and entropies (full logits), differentiated by JAX; and each option
  binds in its case (removing it moves TRL's loss), so that the comparison covers it."""
  x, w, b, tokens, mask, old, ref, adv, sampling = _trl_batch()
  kw = dict(options)
  if kw.get("sampling_log_probs"):
    kw["sampling_log_probs"] = sampling

  def ours(x, w, b):
    return jaxact.policy_gradient_loss(
      x,
      w,
      tokens,
      adv,
      bias=b,
      mask=mask,
      old_log_probs=old,
      ref_log_probs=ref,
      loss_type=loss_type,
      **kw,
    )

  def plain(x, w, b, options=options):
    logp = log_probs_reference(x, w, tokens, bias=b)
    entropy = entropy_reference(x, w, bias=b)
    return _trl(loss_type, logp, entropy, mask, adv, old, ref, sampling, options)

  (loss, metrics), grads = jax.value_and_grad(ours, (0, 1, 2), has_aux=True)(x, w, b)
  (want, logged), want_grads = jax.value_and_grad(plain, (0, 1, 2), has_aux=True)(x, w, b)
  assert_trees_close((loss, grads), (want, want_grads), 1e-12)
  for name, value in logged.items():
    np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-12, err_msg=name)
  for name in set(options) & _BINDING:
    if options[name] is None:
      continue
    fewer = {k: v for k, v in options.items() if k != name}
    if name == "sampling_log_probs":
      fewer = {k: v for k, v in fewer.items() if not k.startswith("importance_sampling")}
    without = plain(x, w, b, fewer)[0]
    assert abs(float(without) - float(want)) > 1e-9, f"{name} does not bind in this case"


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "ppo", "grpo", "sapo"])
def test_micro_batches_gradients_add_up_to_the_batchs(loss_type):
  """Gradient accumulation: 3 micro-batches of one sequence each. DAPO, PPO and CISPO given the
  whole batch's token count as `num_items_in_batch` sum to the batch's loss and gradient; the
  sequence-mean losses (GRPO, SAPO), as TRL does, divided by the micro-batches' count."""
  x, w, b, tokens, mask, old, ref, adv = _batch()
  options = dict(ref_log_probs=ref, beta=0.05, entropy_coef=0.01, loss_type=loss_type)
  token_mean = loss_type in ("dapo", "cispo", "ppo")

  def loss_of(x, w, rows, **extra):
    return jaxact.policy_gradient_loss(
      x[rows],
      w,
      tokens[rows],
      adv[rows],
      bias=b,
      mask=mask[rows],
      old_log_probs=old[rows],
      **{**options, "ref_log_probs": ref[rows]},
      **extra,
    )[0]

  whole = jax.value_and_grad(loss_of, (0, 1))(x, w, slice(None))
  total = (jnp.zeros(()), (jnp.zeros_like(x), jnp.zeros_like(w)))
  extra = dict(num_items_in_batch=jnp.sum(mask)) if token_mean else {}
  scale = 1.0 if token_mean else 1.0 / G  # TRL's division by the accumulation steps
  for i in range(G):
    micro = lambda x, w, rows=slice(i, i + 1): loss_of(x, w, rows, **extra) * scale
    part = jax.value_and_grad(micro, (0, 1))(x, w)
    total = jax.tree.map(jnp.add, total, part)
  assert_trees_close(total, whole, 1e-12)
  if token_mean:  # without the batch's count each micro-batch is its own token mean
    alone = sum(float(loss_of(x, w, slice(i, i + 1))) for i in range(G))
    assert abs(alone - float(whole[0])) > 1e-3


def test_delta_bounds_a_negative_advantage_and_cispo_sapo_stay_finite_past_overflow():
  """float32, old log-probs 200 below the policy's (ratios of e^200 overflow): with a negative
  advantage the two-sided clip gives ``-A delta`` a token and zero gradient; CISPO's capped ratio
  and SAPO's saturated gate give finite values and gradients."""
  x, w, _, tokens, mask, _, _, _ = _batch(jnp.float32)
  old = jnp.full((G, T), -200.0, jnp.float32)
  adv = -jnp.ones((G,), jnp.float32)
  for loss_type, kw in (("dapo", dict(delta=4.0)), ("cispo", {}), ("sapo", {})):
    f = lambda x, w, loss_type=loss_type, kw=kw: jaxact.policy_gradient_loss(
      x, w, tokens, adv, mask=mask, old_log_probs=old, loss_type=loss_type, **kw
    )[0]
    loss, grads = jax.value_and_grad(f, (0, 1))(x, w)
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in grads)
    if loss_type == "dapo":
      assert np.isclose(float(loss), 4.0, rtol=1e-6)
      assert all(np.all(np.asarray(g) == 0) for g in grads)
    if loss_type == "sapo":  # the gate saturated: 4 / tau, and no gradient through it
      assert np.isclose(float(loss), 4 / 1.05, rtol=1e-6)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(delta=0.0), ValueError, "delta"),
    (dict(delta=2.0, loss_type="cispo"), ValueError, "delta"),
    (dict(num_items_in_batch=10, loss_type="grpo"), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=-1, loss_type="dapo"), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=jnp.ones(2), loss_type="dapo"), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=True, loss_type="dapo"), TypeError, "num_items_in_batch"),
    (dict(importance_sampling_mode="token"), ValueError, "importance_sampling_mode"),
    (dict(importance_sampling_clip_min=3.0), ValueError, "importance_sampling_clip_min"),
    (dict(importance_sampling_clip_max=0.0), ValueError, "importance_sampling_clip_max"),
    (
      dict(importance_sampling_mode="token_truncate", importance_sampling_clip_max=None),
      ValueError,
      "importance_sampling_mode",
    ),
    (dict(sampling_log_probs=jnp.zeros((G,))), ValueError, "sampling_log_probs"),
    (dict(importance_sampling_clip_max=2.0), ValueError, "sampling_log_probs"),
    (dict(use_bias_correction_kl=True), ValueError, "ref_log_probs"),
    (dict(top_entropy_quantile=1.5), ValueError, "top_entropy_quantile"),
    (dict(off_policy_mask_threshold=-0.1), ValueError, "off_policy_mask_threshold"),
    (dict(use_bias_correction_kl=1), TypeError, "use_bias_correction_kl"),
    (dict(sapo_temperature_neg=0.0, loss_type="sapo"), ValueError, "sapo_temperature_neg"),
    (dict(sapo_temperature_pos=2.0), ValueError, "sapo_temperature_pos"),
    (dict(epsilon_high=0.0, loss_type="cispo"), ValueError, "epsilon_high"),
  ],
)
def test_bad_trl_options_name_the_argument(kwargs, error, match):
  x, w, _, tokens, _, _, _, adv = _batch(jnp.float32)
  with pytest.raises(error, match=f"policy_gradient_loss.*{match}"):
    jaxact.policy_gradient_loss(x, w, tokens, adv, **kwargs)
