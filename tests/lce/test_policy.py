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
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
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
  plain = lambda x, w: policy_gradient_reference(x, w, tokens, adv, old_log_probs=old)
  temp = lambda f: jax.jit(jax.grad(f, (0, 1))).lower(x, w).compile().memory_analysis()
  logits = g * t * v * 4
  ours, plain = temp(ours).temp_size_in_bytes, temp(plain).temp_size_in_bytes
  # ours: three (tokens, block) buffers of the vocabulary loop (log-probs, entropy); plain: the
  # logits, their softmax and its cotangent
  assert ours < logits / 2 and plain >= 2 * logits and ours < plain / 5
