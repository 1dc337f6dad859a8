"""jaxact.preference_loss against JAX's autodiff of the plain formulas (lce/reference.py: each loss
from its paper on the full logits' log-probabilities).

Values, the metrics and the gradients in x_chosen, x_rejected, w and bias for every loss variant
in float64 to 1e-12; float32 to 1e-5; half precision against float32 of the same inputs; the
reference's log-probabilities passed in against computed in the call (no gradient to its inputs);
masks (padding, sequences with no unmasked token, an all-empty batch); extreme margins; the
errors; and that the compiled step holds no (tokens, vocabulary) array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.lce.plan import default_block
from jaxact._src.lce.reference import log_probs_reference, preference_reference

# Three pairs: chosen completions of 6 positions, rejected of 5; 67 columns in blocks of 16.
B, TC, TR, D, V, BLOCK = 3, 6, 5, 8, 67, 16
_FN = r"jaxact\.preference_loss: "


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b), initial=0) / max(np.max(np.abs(b), initial=0), 1e-300))


def batch(dtype=jnp.float64, seed=0, b=B, b_r=None, scale=2.0, d=D, v=V):
  """``x_c, x_r, w, bias, t_c, t_r, m_c, m_r, ref_c, ref_r``: a prompt position masked in each
  completion, padding at the ends, every sequence with at least two counted tokens."""
  rng = np.random.default_rng(seed)
  b_r = b if b_r is None else b_r
  x_c = jnp.asarray(rng.normal(size=(b, TC, d)), dtype)
  x_r = jnp.asarray(rng.normal(size=(b_r, TR, d)), dtype)
  w = jnp.asarray(rng.normal(size=(d, v)) * scale / np.sqrt(d), dtype)
  bias = jnp.asarray(rng.normal(size=(v,)) * 0.5, dtype)
  t_c = jnp.asarray(rng.integers(0, v, (b, TC)), jnp.int32)
  t_r = jnp.asarray(rng.integers(0, v, (b_r, TR)), jnp.int32)
  m_c = (np.arange(TC) >= 1) & (np.arange(TC) < TC - rng.integers(0, 3, (b, 1)))
  m_r = (np.arange(TR) >= 1) & (np.arange(TR) < TR - rng.integers(0, 2, (b_r, 1)))
  acc = jnp.promote_types(dtype, jnp.float32)
  ref_c = jnp.asarray(-rng.uniform(5, 15, b), acc)
  ref_r = jnp.asarray(-rng.uniform(5, 15, b_r), acc)
  return x_c, x_r, w, bias, t_c, t_r, jnp.asarray(m_c), jnp.asarray(m_r), ref_c, ref_r


# Each loss once plainly, and its options; `options` is what both sides take.
VARIANTS = {
  "dpo": dict(loss="dpo"),
  "dpo-smoothed": dict(loss="dpo", beta=0.3, label_smoothing=0.1, temperature=0.8),
  "robust": dict(loss="robust", beta=0.2, label_smoothing=0.2, logit_soft_cap=4.0),
  "ipo": dict(loss="ipo", beta=0.5),
  "hinge": dict(loss="hinge", beta=0.05),
  "simpo": dict(loss="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.05),
  "orpo": dict(loss="orpo", beta=0.2, temperature=1.3),
  "cpo": dict(loss="cpo", beta=0.1, nll_weight=0.5, label_smoothing=0.1),
  "kto": dict(loss="kto", beta=0.1, desirable_weight=1.33, undesirable_weight=0.8),
  "kto-kl": dict(loss="kto", beta=0.3, kto_kl=0.25),
}
IDS = list(VARIANTS)

# Each new loss type once, the options spread over them: TRL's defaults but where a case says.
TRL_CASES = {
  "exo_pair": dict(loss="exo_pair", beta=0.3, label_smoothing=1e-3),
  "nca_pair": dict(loss="nca_pair", rpo_alpha=0.5),
  "bco_pair": dict(loss="bco_pair", beta=0.2, bco_reward_mean=0.3),
  "sppo_hard": dict(loss="sppo_hard", ld_alpha=0.5),
  "apo_zero": dict(loss="apo_zero", rpo_alpha=1.0, ld_alpha=0.0),
  "apo_down": dict(loss="apo_down", beta=0.5),
  "discopop": dict(loss="discopop", discopop_tau=0.3, ld_alpha=0.3),
  "ipo-ld": dict(loss="ipo", beta=0.5, ld_alpha=0.7, rpo_alpha=0.1),
  "sigmoid_norm": dict(loss="sigmoid_norm", beta=2.0),
  "simpo-rpo": dict(loss="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.05, rpo_alpha=0.4),
  # TRL's f-DPO: the divergence's margin in place of the log-ratio margin
  "dpo-js": dict(loss="dpo", beta=0.5, label_smoothing=0.1, f_divergence_type="js_divergence"),
  "hinge-alpha": dict(
    loss="hinge", beta=0.3, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5
  ),
  "ipo-alpha": dict(loss="ipo", beta=0.5, f_divergence_type="alpha_divergence"),
  "robust-js": dict(loss="robust", label_smoothing=0.2, f_divergence_type="js_divergence"),
  "exo-alpha": dict(
    loss="exo_pair",
    label_smoothing=0.01,
    f_divergence_type="alpha_divergence",
    f_alpha_divergence_coef=2.0,
  ),
}
F_SURVEY = ("hinge-alpha", "ipo-alpha", "robust-js", "exo-alpha")  # -m exhaustive


def _args(name, data, dtype):
  ref_c, ref_r = data[-2:]
  opts = dict(VARIANTS[name] if name in VARIANTS else TRL_CASES[name])
  for given in ("kto_kl", "bco_reward_mean"):
    if given in opts:
      opts[given] = jnp.asarray(opts[given], jnp.promote_types(dtype, jnp.float32))
  if opts["loss"] not in ("simpo", "orpo", "cpo"):
    opts |= dict(ref_chosen_log_probs=ref_c, ref_rejected_log_probs=ref_r)
  return opts


def _run(name, data, dtype, reference_dtype=None, block=BLOCK):
  """``(ours, theirs)``: each ``((loss, metrics), (dx_c, dx_r, dw, dbias))``, compiled."""
  x_c, x_r, w, bias, t_c, t_r, m_c, m_r, *_ = data
  opts = _args(name, data, dtype)

  def ours(x_c, x_r, w, bias):
    return jaxact.preference_loss(
      x_c, x_r, w, t_c, t_r, chosen_mask=m_c, rejected_mask=m_r, bias=bias,
      vocab_block_size=block, **opts,
    )  # fmt: skip

  def theirs(x_c, x_r, w, bias):
    return preference_reference(
      x_c, x_r, w, t_c, t_r, chosen_mask=m_c, rejected_mask=m_r, bias=bias, **opts
    )

  def run(f, *a):
    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2, 3), has_aux=True))(*a)
    return (loss, metrics), grads

  up = [a.astype(reference_dtype or a.dtype) for a in (x_c, x_r, w, bias)]
  return run(ours, x_c, x_r, w, bias), run(theirs, *up)


def _assert_close(ours, theirs, tol, grad_tol=None):
  ((loss, metrics), grads), ((loss_ref, metrics_ref), grads_ref) = ours, theirs
  assert np.isfinite(loss) and rel_err(loss, loss_ref) < tol, (loss, loss_ref)
  for key, want in metrics_ref.items():
    assert rel_err(metrics[key], want) < tol, (key, metrics[key], want)
  for what, g, r in zip(("dx_chosen", "dx_rejected", "dw", "dbias"), grads, grads_ref, strict=True):
    assert np.all(np.isfinite(np.asarray(g, np.float64))), what
    assert rel_err(g, r) < (grad_tol or tol), (what, rel_err(g, r))


# ------------------------------------------------------------------------- values, gradients


# By default the losses and options no other default case here runs (dpo first); ipo, orpo, cpo
# and kto are checked against the float64 reference by the float32 test below, simpo in half
# precision.
@pytest.mark.sample(1, "dpo-smoothed", "robust", "hinge", "kto-kl")
@pytest.mark.parametrize("name", IDS)
def test_float64_matches_autodiff_of_the_reference(name):
  """The loss, every metric the reference gives and the gradients in x_chosen, x_rejected, w and
  bias equal JAX's autodiff of the paper's formula on the full log_softmax, to 1e-12."""
  data = batch(b_r=2 if name.startswith("kto") else B)
  ours, theirs = _run(name, data, jnp.float64)
  assert ours[0][0].dtype == jnp.float64
  _assert_close(ours, theirs, 1e-12)
  assert set(ours[0][1]) >= set(theirs[0][1])


@pytest.mark.sample(3, "orpo", "kto")
@pytest.mark.parametrize("name", IDS)
def test_float32_within_1e5_of_the_float64_reference(name):
  ours, theirs = _run(name, batch(jnp.float32), jnp.float32, jnp.float64)
  assert ours[0][0].dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in ours[1])
  _assert_close(ours, theirs, 1e-5)


@pytest.mark.sample(1)  # simpo-float16 (tests/lce/test_log_probs.py runs bfloat16 by default)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", ["simpo", "dpo", "orpo", "kto"])
def test_half_precision_is_computed_in_float32(name, dtype):
  """Half precision inputs: the loss float32 and equal to the float32 reference of the rounded
  inputs; gradients in the inputs' dtype within a few of its ulps."""
  data = batch(jnp.float32, d=16, v=300)
  half = [a.astype(dtype) for a in data[:4]]
  data = (*half, *data[4:])
  ours, theirs = _run(name, data, jnp.float32, jnp.float32, block=64)
  assert ours[0][0].dtype == jnp.float32
  assert [g.dtype for g in ours[1]] == [dtype] * 4
  _assert_close(ours, theirs, 1e-5, grad_tol=4 * float(jnp.finfo(dtype).eps))


# ----------------------------------------------------------- TRL's DPOTrainer losses, rpo, ld


def trl_dpo_loss(x_c, x_r, w, bias, t_c, t_r, m_c, m_r, ref_heads, case):
  """``(loss, metrics)`` transcribed from TRL's DPOTrainer (1.x ``_compute_loss``: ``ld_alpha``'s
  shared and tail masks, f-divergence ``reverse_kl``, each ``loss_type``'s per-sequence loss;
  0.28's ``rpo_alpha`` NLL, a cross-entropy over the chosen completions' tokens, and bco_pair's
  running mean ``delta``; CPOTrainer's ``simpo`` with ``cpo_alpha``) in plain jnp on the full
  log_softmax; the reference is the second head of ``ref_heads``."""
  beta, eps, ld = case.get("beta", 0.1), case.get("label_smoothing", 0.0), case.get("ld_alpha")
  t = max(TC, TR)  # TRL's batch: [chosen, rejected], right-padded to one length

  def padded(a_c, a_r):
    pad = lambda a: jnp.pad(a, [(0, 0), (0, t - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
    return jnp.concatenate([pad(a_c), pad(a_r)])

  mask = padded(m_c, m_r)

  def logps(x, w, b):
    logits = padded(*x) @ w + b
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits), padded(t_c, t_r)[..., None], -1)[..., 0]
    lp = jnp.where(mask, lp, 0.0)
    if ld is None:
      return lp.sum(1), lp
    comp_pos = jnp.cumsum(mask, 1)
    lens_c, lens_r = jnp.split(mask.sum(1), 2)
    shared = jnp.tile(jnp.minimum(lens_c, lens_r), 2)[:, None]
    shared_mask, tail_mask = (comp_pos > 0) & (comp_pos <= shared), comp_pos > shared
    return (lp * shared_mask).sum(1) + ld * (lp * tail_mask).sum(1), lp

  both, lp = logps((x_c, x_r), w, bias)
  chosen_logps, rejected_logps = jnp.split(both, 2)
  loss_type = case["loss"]
  if loss_type == "simpo":  # CPOTrainer, average_log_prob
    chosen_logps, rejected_logps = chosen_logps / m_c.sum(1), rejected_logps / m_r.sum(1)
    logits = (chosen_logps - rejected_logps) - case["simpo_gamma"] / beta
    losses = -jax.nn.log_sigmoid(beta * logits) * (1 - eps) - jax.nn.log_sigmoid(
      -beta * logits) * eps  # fmt: skip
    chosen_logratios, rejected_logratios = chosen_logps, rejected_logps
  else:
    rx_c, rx_r, rw, rb = ref_heads
    ref_chosen_logps, ref_rejected_logps = jnp.split(jax.lax.stop_gradient(logps(
      (rx_c, rx_r), rw, rb)[0]), 2)  # fmt: skip
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    sig, logsig = jax.nn.sigmoid, jax.nn.log_sigmoid

    def f_logits(chosen_logratios, rejected_logratios):  # TRL 0.28's dpo_loss, f-divergences
      alpha_coef = case.get("f_alpha_divergence_coef", 1.0)
      cap_exp = lambda v: jnp.exp(jnp.minimum(v, jnp.log(jnp.finfo(v.dtype).max)))
      if case.get("f_divergence_type") == "alpha_divergence":
        return (
          cap_exp(rejected_logratios * -alpha_coef) - cap_exp(chosen_logratios * -alpha_coef)
        ) / alpha_coef
      logits = chosen_logratios - rejected_logratios
      if case.get("f_divergence_type") == "js_divergence":
        logits -= jax.nn.softplus(chosen_logratios) - jax.nn.softplus(rejected_logratios)
      return logits

    delta_score = chosen_logratios - rejected_logratios
    logits = f_logits(chosen_logratios, rejected_logratios)
    if loss_type == "ipo":
      ipo_logits = f_logits(chosen_logratios / m_c.sum(1), rejected_logratios / m_r.sum(1))
      losses = (ipo_logits - 1 / (2 * beta)) ** 2
    elif loss_type == "dpo":  # TRL's "sigmoid"
      losses = -logsig(beta * logits) * (1 - eps) - logsig(-beta * logits) * eps
    elif loss_type == "robust":
      losses = (-logsig(beta * logits) * (1 - eps) + logsig(-beta * logits) * eps) / (1 - 2 * eps)
    elif loss_type == "hinge":
      losses = jax.nn.relu(1 - beta * logits)
    elif loss_type == "sigmoid_norm":
      delta = chosen_logratios / m_c.sum(1) - rejected_logratios / m_r.sum(1)
      losses = -logsig(beta * delta)
    elif loss_type == "exo_pair":
      qw, log_qw = sig(beta * logits), logsig(beta * logits)
      ql, log_ql = sig(-beta * logits), logsig(-beta * logits)
      losses = qw * (log_qw - jnp.log1p(-eps)) + ql * (log_ql - jnp.log(eps))
    elif loss_type == "nca_pair":
      cr, rr = beta * chosen_logratios, beta * rejected_logratios
      losses = -logsig(cr) - 0.5 * logsig(-cr) - 0.5 * logsig(-rr)
    elif loss_type == "bco_pair":
      delta = case.get("bco_reward_mean", 0.0)
      losses = -logsig(beta * chosen_logratios - delta) - logsig(
        -(beta * rejected_logratios - delta))  # fmt: skip
    elif loss_type == "sppo_hard":
      losses = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
      losses = 1 - sig(beta * chosen_logratios) + sig(beta * rejected_logratios)
    elif loss_type == "apo_down":
      losses = sig(beta * chosen_logratios) + 1 - sig(beta * delta_score)
    else:
      assert loss_type == "discopop"
      logits = delta_score * beta
      modulation = sig(logits / case.get("discopop_tau", 0.05))
      losses = -logsig(logits) * (1 - modulation) + jnp.exp(-logits) * modulation
  loss = losses.mean()
  metrics = {
    "rewards/chosen": (beta * chosen_logratios).mean(),
    "rewards/rejected": (beta * rejected_logratios).mean(),
    "rewards/accuracies": (chosen_logratios > rejected_logratios).mean(),
    "logps/chosen": chosen_logps.mean(),
    "logps/rejected": rejected_logps.mean(),
  }
  alpha = case.get("rpo_alpha")
  if alpha is not None:  # F.cross_entropy over the chosen completions' tokens
    nll = -jnp.sum(lp[: len(m_c)]) / m_c.sum()
    loss, metrics["nll_loss"] = loss + alpha * nll, nll
  return loss, metrics


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=pytest.mark.exhaustive) if n in F_SURVEY else n for n in TRL_CASES]
)
def test_trl_losses_equal_a_transcription_of_trl(name):
  """Each of TRL's DPOTrainer losses jaxact adds, ``rpo_alpha``, ``ld_alpha`` and the f-DPO
  divergences (``f_divergence_type``, as TRL 0.28 forms them): the loss, the metrics and the
  gradients in x_chosen, x_rejected, w and bias equal TRL's code transcribed
  (:func:`trl_dpo_loss`) and JAX's autodiff of it, float64, to 1e-12. Where ``ld_alpha`` is set
  the reference is computed in the call (weighted as the policy), else passed in as sums."""
  case = TRL_CASES[name]
  x_c, x_r, w, bias, t_c, t_r, m_c, m_r, *_ = batch()
  ref_heads = batch(seed=5)[:4]
  opts = dict(case)
  if "bco_reward_mean" in opts:
    opts["bco_reward_mean"] = jnp.asarray(opts["bco_reward_mean"], jnp.float64)
  if case["loss"] != "simpo":
    if "ld_alpha" in case:
      opts |= dict(
        zip(("ref_x_chosen", "ref_x_rejected", "ref_w", "ref_bias"), ref_heads, strict=True)
      )
    else:
      sums = [
        log_probs_reference(x, ref_heads[2], t, where=m, bias=ref_heads[3]).sum(-1)
        for x, t, m in ((ref_heads[0], t_c, m_c), (ref_heads[1], t_r, m_r))
      ]
      opts |= dict(ref_chosen_log_probs=sums[0], ref_rejected_log_probs=sums[1])

  def ours(x_c, x_r, w, bias):
    return jaxact.preference_loss(
      x_c, x_r, w, t_c, t_r, chosen_mask=m_c, rejected_mask=m_r, bias=bias,
      vocab_block_size=BLOCK, **opts,
    )  # fmt: skip

  def theirs(x_c, x_r, w, bias):
    return trl_dpo_loss(x_c, x_r, w, bias, t_c, t_r, m_c, m_r, ref_heads, case)

  (loss, metrics), grads = jax.jit(jax.value_and_grad(ours, (0, 1, 2, 3), has_aux=True))(
    x_c, x_r, w, bias
  )
  (want, want_metrics), want_grads = jax.value_and_grad(theirs, (0, 1, 2, 3), has_aux=True)(
    x_c, x_r, w, bias
  )
  assert loss.dtype == jnp.float64 and rel_err(loss, want) < 1e-12, (loss, want)
  for key, v in want_metrics.items():
    if case["loss"] in ("ipo", "sigmoid_norm") and key != "nll_loss":
      continue  # jaxact gives these rewards and logps on the means, as the loss; TRL on the sums
    assert rel_err(metrics[key], v) < 1e-12, (key, metrics[key], v)
  for what, g, r in zip(("dx_c", "dx_r", "dw", "dbias"), grads, want_grads, strict=True):
    assert np.any(np.asarray(r)) and rel_err(g, r) < 1e-12, (what, rel_err(g, r))


# ------------------------------------------------------------------------------- the reference


# kto by default (unpaired batches); ipo's reference sums passed in, divided by the lengths, are
# checked against the reference formula by test_float32_within_1e5_of_the_float64_reference[ipo].
@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["kto", "ipo"])
def test_reference_passed_in_equals_computed_in_the_call(name):
  """``ref_x_*`` and ``ref_w`` (a reference of another width) give what their sums passed in
  give, and no gradient reaches the reference's inputs."""
  x_c, x_r, w, bias, t_c, t_r, m_c, m_r, _, _ = data = batch(b_r=2 if name == "kto" else B)
  rx_c, rx_r, rw, rbias = batch(seed=7, b_r=2 if name == "kto" else B, d=5)[:4]
  opts = {k: v for k, v in _args(name, data, jnp.float64).items() if not k.startswith("ref_")}
  kw = dict(chosen_mask=m_c, rejected_mask=m_r, vocab_block_size=BLOCK, **opts)
  ref_c = log_probs_reference(rx_c, rw, t_c, where=m_c, bias=rbias).sum(-1)
  ref_r = log_probs_reference(rx_r, rw, t_r, where=m_r, bias=rbias).sum(-1)

  def passed(x_c, x_r, w, bias):
    return jaxact.preference_loss(
      x_c, x_r, w, t_c, t_r, bias=bias, ref_chosen_log_probs=ref_c,
      ref_rejected_log_probs=ref_r, **kw,
    )  # fmt: skip

  def computed(x_c, x_r, w, bias, rx_c, rx_r, rw, rbias):
    return jaxact.preference_loss(
      x_c, x_r, w, t_c, t_r, bias=bias, ref_x_chosen=rx_c, ref_x_rejected=rx_r, ref_w=rw,
      ref_bias=rbias, **kw,
    )  # fmt: skip

  (want, want_metrics), want_grads = jax.jit(
    jax.value_and_grad(passed, (0, 1, 2, 3), has_aux=True)
  )(x_c, x_r, w, bias)
  f = jax.jit(jax.value_and_grad(computed, tuple(range(8)), has_aux=True))
  (got, metrics), grads = f(x_c, x_r, w, bias, rx_c, rx_r, rw, rbias)
  assert rel_err(got, want) < 1e-12
  for key in want_metrics:
    assert rel_err(metrics[key], want_metrics[key]) < 1e-12, key
  for g, r in zip(grads[:4], want_grads, strict=True):
    assert rel_err(g, r) < 1e-12
  for g in grads[4:]:
    assert not np.any(np.asarray(g)), "a gradient reached the reference's inputs"


# ---------------------------------------------------------------------------------- masking


@pytest.mark.sample(1, "orpo", "kto")
@pytest.mark.parametrize("name", IDS)
def test_empty_sequences_do_not_count(name):
  """A pair with a sequence of no unmasked token (KTO: such a completion) adds nothing: the loss
  and metrics are those of the batch without it, its hidden states get zero gradients; a batch
  of nothing but empty sequences gives 0, zero gradients and no NaN."""
  x_c, x_r, w, bias, t_c, t_r, m_c, m_r, ref_c, ref_r = data = batch(b=4)
  opts = _args(name, data, jnp.float64)
  empty_c = m_c.at[1].set(False)  # pair 1: the chosen completion is all prompt/padding

  def f(x_c, x_r, m_c, m_r, keep):
    o = dict(opts)
    if "ref_chosen_log_probs" in o:
      o |= dict(ref_chosen_log_probs=ref_c[keep], ref_rejected_log_probs=ref_r[keep])
    return jaxact.preference_loss(
      x_c[keep], x_r[keep], w, t_c[keep], t_r[keep], chosen_mask=m_c[keep],
      rejected_mask=m_r[keep], bias=bias, vocab_block_size=BLOCK, **o,
    )  # fmt: skip

  every, without = np.arange(4), np.array([0, 2, 3])
  grad = jax.jit(
    jax.value_and_grad(lambda x_c, x_r, m_c, m_r: f(x_c, x_r, m_c, m_r, every), (0, 1), True)
  )
  (loss, metrics), (g_c, g_r) = grad(x_c, x_r, empty_c, m_r)
  assert not np.any(np.asarray(g_c[1]))
  if name.startswith("kto"):  # unpaired: the rejected completion of pair 1 still counts
    assert np.any(np.asarray(g_r[1]))
    keep_r = every
  else:
    assert not np.any(np.asarray(g_r[1]))
    keep_r = without
  o = dict(opts)
  if "ref_chosen_log_probs" in o:
    o |= dict(ref_chosen_log_probs=ref_c[without], ref_rejected_log_probs=ref_r[keep_r])
  want, want_metrics = jaxact.preference_loss(
    x_c[without], x_r[keep_r], w, t_c[without], t_r[keep_r], chosen_mask=m_c[without],
    rejected_mask=m_r[keep_r], bias=bias, vocab_block_size=BLOCK, **o,
  )  # fmt: skip
  assert rel_err(loss, want) < 1e-12, (loss, want)
  for key in want_metrics:
    assert rel_err(metrics[key], want_metrics[key]) < 1e-12, key
  nothing = jnp.zeros_like(m_c), jnp.zeros_like(m_r)
  (loss, metrics), grads = grad(x_c, x_r, *nothing)
  assert float(loss) == 0.0 and not any(np.any(np.asarray(g)) for g in grads)
  assert all(np.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------------- extremes


@pytest.mark.sample(1, "orpo", "ipo", "discopop", "exo_pair")
@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.exhaustive) if n in F_SURVEY else n
    for n in IDS + list(TRL_CASES)
  ],
)
def test_huge_margins_and_certain_tokens_stay_finite(name):
  """float32 log-probs of order -1e4 a token (margins of 1e4 and more), and chosen completions
  whose every token has probability 1 in float32 (a mean log-prob of 0: ORPO's odds would be
  infinite), give a finite loss, finite metrics and finite gradients."""
  x_c, x_r, w, bias, t_c, t_r, m_c, m_r, _, _ = data = batch(jnp.float32, scale=3e3)
  opts = _args(name, data, jnp.float32)
  certain = jnp.argmax(jnp.einsum("btd,dv->btv", x_c, w), -1)  # the row's largest logit
  grad = jax.jit(jax.value_and_grad(jaxact.preference_loss, (0, 1, 2), has_aux=True), **STATIC)
  (loss, metrics), grads = grad(
    x_c, x_r, w, t_c, t_r, chosen_mask=m_c, rejected_mask=m_r, bias=bias, **opts
  )
  assert np.isfinite(loss), (name, loss)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert all(np.all(np.isfinite(g)) for g in grads)
  # Every certain token's log-prob is 0 without a cap or a temperature: a cap ties every huge
  # logit, and logits of 1e7 divided by a temperature round onto float32's grid of whole units,
  # where near-maxima tie (a log-prob of -log 2; never positive: tests/lce/test_log_probs.py).
  opts = {k: v for k, v in opts.items() if k not in ("temperature", "logit_soft_cap")}
  (loss, metrics), grads = grad(
    x_c * 1e3, x_r, w, certain, t_r, chosen_mask=m_c, rejected_mask=m_r, bias=bias, **opts
  )
  assert float(metrics["logps/chosen"]) == 0.0
  assert np.isfinite(loss), (name, loss)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert all(np.all(np.isfinite(g)) for g in grads)


STATIC = dict(static_argnames=("loss", "beta", "label_smoothing", "simpo_gamma", "discopop_tau",
  "nll_weight", "rpo_alpha", "ld_alpha", "desirable_weight", "undesirable_weight", "temperature",
  "logit_soft_cap", "f_divergence_type", "f_alpha_divergence_coef"))  # fmt: skip


# ------------------------------------------------------------------------------------ memory


def test_the_compiled_gradient_holds_no_tokens_by_vocabulary_array():
  """jit(grad) of DPO at B = 4 pairs of 128 + 128 tokens, V = 32768, D = 64: the temp is a few
  blocks of logits, never one (tokens, V) float32 array (128 MiB over both completions) as the
  plain composition's; with ``rpo_alpha`` and ``ld_alpha`` too (their NLL and weights use the
  same log-probabilities)."""
  b, t, d, v = 4, 128, 64, 32768
  rng = np.random.default_rng(0)
  x_c, x_r = (jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.normal(size=(d, v)) / 8, jnp.float32)
  t_c, t_r = (jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32) for _ in range(2))
  mask = jnp.ones((b, t), bool)
  ref = jnp.full((b,), -100.0, jnp.float32)
  kw = dict(chosen_mask=mask, rejected_mask=mask, ref_chosen_log_probs=ref)
  kw |= dict(ref_rejected_log_probs=ref)

  def ours(x_c, x_r, w):
    return jaxact.preference_loss(x_c, x_r, w, t_c, t_r, rpo_alpha=1.0, ld_alpha=0.5, **kw)[0]

  def theirs(x_c, x_r, w):
    return preference_reference(x_c, x_r, w, t_c, t_r, **kw)[0]

  def temp(f):
    compiled = jax.jit(jax.grad(f, (0, 1, 2))).lower(x_c, x_r, w).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits = 2 * b * t * v * 4
  block = 2 * b * t * default_block(2 * b * t, v) * 4
  ours_temp, theirs_temp = temp(ours), temp(theirs)
  assert ours_temp <= 3 * block and ours_temp <= logits / 4, (ours_temp, block, logits)
  assert theirs_temp >= logits, theirs_temp


# ------------------------------------------------------------------------------------ errors


def _call(**change):
  x_c, x_r, w, _, t_c, t_r, m_c, m_r, ref_c, ref_r = batch(jnp.float32)
  kw = dict(
    x_chosen=x_c, x_rejected=x_r, w=w, chosen_tokens=t_c, rejected_tokens=t_r, chosen_mask=m_c,
    rejected_mask=m_r, ref_chosen_log_probs=ref_c, ref_rejected_log_probs=ref_r,
  ) | change  # fmt: skip
  kw = {k: v for k, v in kw.items() if v is not None}
  args = [kw.pop(k) for k in ("x_chosen", "x_rejected", "w", "chosen_tokens", "rejected_tokens")]
  return jaxact.preference_loss(*args, **kw)


NO_REF = dict(ref_chosen_log_probs=None, ref_rejected_log_probs=None)
ONES = jnp.ones((B, TC, D), jnp.float32)


def test_orpo_s_nll_over_the_prompt_too_as_trl_s_orpo_trainer():
  """``nll_mask`` (TRL's ORPOTrainer: the NLL over the chosen sequence's prompt and completion,
  the odds ratio over the completion): loss, NLL and gradients equal ORPO's formula on the full
  log_softmax, float64; without it the NLL is the completion's, which differs."""
  x_c, x_r, w, bias, t_c, t_r, m_c, m_r, *_ = batch()
  attended = m_c | (jnp.arange(TC) < 1)  # the prompt position and the completion
  beta = 0.3

  def theirs(x_c, x_r, w, bias):  # ORPOTrainer.odds_ratio_loss and its cross-entropy
    def lp(x, t):
      return jnp.take_along_axis(jax.nn.log_softmax(x @ w + bias), t[..., None], -1)[..., 0]

    lp_c, lp_r = lp(x_c, t_c), lp(x_r, t_r)
    mean_c = jnp.sum(lp_c * m_c, -1) / m_c.sum(-1)
    mean_r = jnp.sum(lp_r * m_r, -1) / m_r.sum(-1)
    log_odds = (mean_c - mean_r) - (jnp.log1p(-jnp.exp(mean_c)) - jnp.log1p(-jnp.exp(mean_r)))
    nll = -jnp.sum(lp_c * attended) / attended.sum()
    return nll - beta * jnp.mean(jax.nn.log_sigmoid(log_odds)), nll

  def ours(x_c, x_r, w, bias, nll_mask=attended):
    loss, metrics = jaxact.preference_loss(
      x_c, x_r, w, t_c, t_r, chosen_mask=m_c, rejected_mask=m_r, nll_mask=nll_mask, bias=bias,
      loss="orpo", beta=beta, vocab_block_size=BLOCK,
    )  # fmt: skip
    return loss, metrics["nll_loss"]

  args = (x_c, x_r, w, bias)
  (loss, nll), grads = jax.value_and_grad(ours, (0, 1, 2, 3), has_aux=True)(*args)
  (want, want_nll), want_grads = jax.value_and_grad(theirs, (0, 1, 2, 3), has_aux=True)(*args)
  assert rel_err(loss, want) < 1e-12 and rel_err(nll, want_nll) < 1e-12, (loss, want)
  for g, r in zip(grads, want_grads, strict=True):
    assert rel_err(g, r) < 1e-12
  assert rel_err(ours(*args, nll_mask=None)[1], want_nll) > 1e-3  # the completion's alone


@pytest.mark.parametrize(
  "change, error, match",
  [
    (dict(loss="sigmoid"), ValueError, r"`loss` 'sigmoid' is not known; choose one of: dpo, "),
    (dict(loss=1), ValueError, r"`loss` 1 is not known"),
    (dict(beta=0.0), ValueError, r"`beta` is 0\.0; accepted: a finite number in \(0\.0, inf\)"),
    (dict(beta=float("nan")), ValueError, r"`beta` is nan"),
    (dict(beta="0.1"), TypeError, r"`beta` must be a Python float; got str"),
    (dict(label_smoothing=0.6), ValueError, r"`label_smoothing` is 0\.6; accepted: .*0\.5\]"),
    (dict(label_smoothing=-0.1), ValueError, r"`label_smoothing` is -0\.1"),
    (dict(loss="robust", label_smoothing=0.5), ValueError, r"`label_smoothing` is 0\.5; .*robust"),
    (
      dict(loss="ipo", label_smoothing=0.1),
      ValueError,
      r"`label_smoothing` is 0\.1, but loss='ipo'",
    ),
    (dict(simpo_gamma=1.0), ValueError, r"`simpo_gamma` is 1\.0, but loss='dpo' does not use it"),
    (dict(nll_weight=2.0), ValueError, r"`nll_weight` is 2\.0, but .* of 'orpo', 'cpo'"),
    (dict(desirable_weight=2.0), ValueError, r"`desirable_weight` .* of 'kto'"),
    (dict(loss="kto", undesirable_weight=0.0), ValueError, r"`undesirable_weight` is 0\.0"),
    (dict(kto_kl=0.1), ValueError, r"`kto_kl` is KTO's reference point; loss='dpo' takes None"),
    (dict(loss="exo_pair"), ValueError, r"`label_smoothing` is 0\.0; accepted for loss='exo_pair'"),
    (dict(loss="discopop", discopop_tau=0.0), ValueError, r"`discopop_tau` is 0\.0; accepted"),
    (dict(discopop_tau=0.1), ValueError, r"`discopop_tau` is 0\.1, but loss='dpo' does not use"),
    (dict(rpo_alpha=-1.0), ValueError, r"`rpo_alpha` is -1\.0; accepted: .*\[0\.0, inf\)"),
    (dict(loss="orpo", rpo_alpha=1.0), ValueError, r"`rpo_alpha` is 1\.0, but loss='orpo'"),
    (dict(ld_alpha=1.5), ValueError, r"`ld_alpha` is 1\.5; accepted: .*\[0\.0, 1\.0\]"),
    (dict(loss="kto", ld_alpha=0.5), ValueError, r"`ld_alpha` is 0\.5, but loss='kto'"),
    (dict(bco_reward_mean=0.1), ValueError, r"`bco_reward_mean` is BCO's reward shift; loss='dpo'"),
    (
      dict(loss="bco_pair", bco_reward_mean=jnp.ones(2)),
      ValueError,
      r"`bco_reward_mean` must be a floating-point scalar",
    ),
    (dict(loss="kto", kto_kl=jnp.ones(2)), ValueError, r"`kto_kl` must be a floating-point scalar"),
    (dict(loss="simpo"), ValueError, r"loss='simpo' is reference-free; it takes no `ref_chosen_"),
    (NO_REF, ValueError, r"loss='dpo' needs the reference: pass `ref_chosen_log_probs`"),
    (dict(ref_rejected_log_probs=None), ValueError, r"`ref_rejected_log_probs` is missing"),
    (
      dict(ref_chosen_log_probs=jnp.ones(2)),
      ValueError,
      r"`ref_chosen_log_probs` must be .*\(3,\)",
    ),
    (dict(ref_x_chosen=ONES), ValueError, r"pass the reference's log-probabilities .* not both"),
    (
      NO_REF | dict(ref_x_chosen=ONES, ref_w=jnp.ones((D, V))),
      ValueError,
      r"loss='dpo' needs the reference.*\(`ref_x_rejected` is missing\)",
    ),
    (
      NO_REF | dict(ref_x_chosen=ONES, ref_x_rejected=ONES[:, :TR], ref_w=jnp.ones((D, V + 1))),
      ValueError,
      r"the reference's head must have the policy's vocabulary \(67\)",
    ),
    (dict(x_chosen=ONES[..., :-1]), ValueError, r"`x_chosen` has 7 features but `w` expects 8"),
    (dict(x_rejected=ONES), ValueError, r"`x_rejected` must have shape rejected_tokens.shape"),
    (dict(x_chosen=ONES.astype(jnp.int32)), TypeError, r"`x_chosen` has dtype int32"),
    (dict(w=jnp.ones((D, V, 1))), ValueError, r"`w` must have rank 2"),
    (dict(bias=jnp.ones(V + 1)), ValueError, r"`bias` has shape \(68,\); accepted: \(67,\)"),
    (dict(chosen_tokens=jnp.zeros((B, TC))), TypeError, r"`chosen_tokens` has dtype float"),
    (dict(rejected_tokens=jnp.zeros((B, TR + 1), jnp.int32)), ValueError, r"`x_rejected` must"),
    (
      dict(rejected_tokens=jnp.zeros((2, TR), jnp.int32)),
      ValueError,
      r"`chosen_tokens` and `rejected_tokens` must have the same batch shape",
    ),
    (dict(chosen_tokens=jnp.full((B, TC), V, jnp.int32)), ValueError, r"`chosen_tokens` holds"),
    (dict(chosen_mask=jnp.ones((B, TC))), TypeError, r"`chosen_mask` has dtype float"),
    (dict(rejected_mask=jnp.ones((B, TC), bool)), ValueError, r"`rejected_mask` has shape"),
    (dict(temperature=0.0), ValueError, r"`temperature` is 0\.0"),
    (dict(logit_soft_cap=-1.0), ValueError, r"`logit_soft_cap` is -1\.0"),
    (dict(w_layout="dd"), ValueError, r"`w_layout` 'dd' is not known"),
    (dict(implementation="cuda"), ValueError, r"`implementation` 'cuda' is not known"),
    (dict(f_divergence_type="kl"), ValueError, r"`f_divergence_type` is 'kl'; accepted"),
    (dict(nll_mask=jnp.ones((B, TC), bool)), ValueError, r"`nll_mask` is given, but loss='dpo'"),
    (
      dict(loss="orpo", nll_mask=jnp.ones((B, TR), bool), ref_chosen_log_probs=None),
      ValueError,
      r"`nll_mask` has shape",
    ),
    (
      dict(loss="nca_pair", f_divergence_type="js_divergence"),
      ValueError,
      r"`f_divergence_type` is 'js_divergence', but loss='nca_pair' does not use it",
    ),
    (dict(f_alpha_divergence_coef=0.5), ValueError, r"`f_alpha_divergence_coef` is 0\.5, but"),
    (
      dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.0),
      ValueError,
      r"`f_alpha_divergence_coef` is 0\.0",
    ),
  ],
  ids=lambda v: None if isinstance(v, dict) else "",
)
def test_bad_input_names_the_argument(change, error, match):
  with pytest.raises(error, match=_FN + match):
    _call(**change)
