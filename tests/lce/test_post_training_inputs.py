"""The post-training losses on the inputs at the edges (issue 54's sweep), each against a float64
formula written here: errors naming the function called and its own argument; temperatures at
float32's limits; hidden states and heads of 1e30 and 1e-30 whose logits are ordinary; soft caps
of 1e-30 and 1e30; masked vocabulary entries; no token at all; ``vmap`` over a batch axis.

The float64 reference of each loss is its plain formula over the full logits (``log_softmax`` of
``c tanh((x W + b) / c) / T``) on the float32 inputs cast up. Where the exact value is past
float32's range (a log-probability of -1e40) the float32 one is infinite, as it must be; the
cases here keep every exact value and gradient inside the range, where nothing may be NaN or
infinite and everything must be within float32's rounding of the formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

B, S, D, V, K, BLOCK = 2, 3, 4, 20, 4, 7  # blocks of 7 of 20: the last overlaps its predecessor
_rng = np.random.default_rng(0)
X = _rng.normal(size=(B, S, D))
W = _rng.normal(size=(D, V)) / 2
XT = X + 0.3 * _rng.normal(size=(B, S, D))
WT = W + 0.2 * _rng.normal(size=(D, V))
TOKENS = jnp.asarray(_rng.integers(0, V, (B, S)), jnp.int32)
MASK = jnp.array([[True, True, False], [True, False, True]])
ADV = np.array([1.0, -0.5])
f32 = lambda a: jnp.asarray(a, jnp.float32)


# --------------------------------------------------------------------------------- the errors


def _policy(**kw):
  tokens = kw.pop("tokens", TOKENS)
  return jaxact.policy_gradient_loss(f32(X), f32(W), tokens, f32(ADV), mask=MASK, **kw)


def _preference(**kw):
  chosen = kw.pop("chosen_tokens", TOKENS)
  return jaxact.preference_loss(
    f32(X), f32(XT), f32(W), chosen, TOKENS, chosen_mask=MASK, loss="simpo", **kw
  )


def _distillation(**kw):
  return jaxact.distillation_loss(f32(X), f32(W), f32(XT), f32(WT), mask=MASK, **kw)


def _top_k(**kw):
  idx = kw.pop("teacher_indices", jnp.broadcast_to(jnp.arange(K), (B, S, K)))
  lp = jnp.full((B, S, K), -3.0, jnp.float32)
  return jaxact.top_k_distillation_loss(f32(X), f32(W), idx, lp, mask=MASK, **kw)


PADDED = TOKENS.at[0, 1].set(-100)  # counted by MASK
ERRORS = {
  "policy-padding-token": (_policy, dict(tokens=PADDED), ValueError, r"`tokens`.*`mask`"),
  "policy-temperature": (_policy, dict(temperature=0.0), ValueError, "`temperature`"),
  "policy-block": (_policy, dict(vocab_block_size=0), ValueError, "`vocab_block_size`"),
  "preference-padding-token": (
    _preference,
    dict(chosen_tokens=PADDED),
    ValueError,
    r"`chosen_tokens`.*`chosen_mask`",
  ),
  "preference-block": (_preference, dict(vocab_block_size=0), ValueError, "`vocab_block_size`"),
  "distillation-padding-label": (
    _distillation,
    dict(labels=PADDED, hard_label_weight=1.0),
    ValueError,
    r"`labels`.*`mask`",
  ),
  "distillation-label-dtype": (
    _distillation,
    dict(labels=f32(TOKENS), hard_label_weight=1.0),
    TypeError,
    "`labels`",
  ),
  "distillation-label-shape": (
    _distillation,
    dict(labels=TOKENS[:, :2], hard_label_weight=1.0),
    ValueError,
    "`labels`",
  ),
  "top_k-index-V": (
    _top_k,
    dict(teacher_indices=jnp.broadcast_to(jnp.arange(V - K + 1, V + 1), (B, S, K))),
    ValueError,
    r"`teacher_indices`.*drop such positions with `mask`",
  ),
  "top_k-padding-label": (
    _top_k,
    dict(labels=PADDED, hard_label_weight=0.5),
    ValueError,
    r"`labels`.*`mask`",
  ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_function_called_and_its_own_argument(case):
  """Before, an ignore-index label (-100) or a top-k index of V said "mask such tokens with
  `where`" (these losses take `mask`, `chosen_mask`) under another function's name
  (`jaxact.linear_log_probs`, `jaxact.linear_cross_entropy`), as did the options these losses
  hand to it (`temperature`, `vocab_block_size`)."""
  call, kwargs, error, match = ERRORS[case]
  name = {_policy: "policy_gradient_loss", _preference: "preference_loss"}.get(call)
  name = name or {_distillation: "distillation_loss", _top_k: "top_k_distillation_loss"}[call]
  with pytest.raises(error, match=f"^jaxact\\.{name}: .*{match}") as info:
    call(**kwargs)
  assert "`where`" not in str(info.value)


# ---------------------------------------------------------------- the sweep, against float64

# (temperature, soft cap, x's scale, w's scale, bias): every exact value and gradient in range.
CASES = {
  "T=1e-38": (1e-38, None, 0.03, 1.0, None),  # s of order 1e36: T was float32's 0 (NaN)
  "T=1e-40": (1e-40, None, 1e-3, 1e-3, None),  # 1/T past float32's range: applied in two factors
  "T=1e38": (1e38, None, 1.0, 1.0, None),  # k = 1e-38 below float32's normals; gradients flush
  "x=1e30,w=1e-30": (0.5, None, 1e30, 1e-30, None),
  "x=1e-30,w=1e30": (1.0, None, 1e-30, 1e30, None),
  "cap=1e-30,T=1e-32": (1e-32, 1e-30, 1.0, 1.0, None),  # s = ±c/T = ±100: tanh saturated
  "cap=1e30,T=1e-38": (1e-38, 1e30, 0.03, 1.0, None),  # c/T = 1e68: three factors
  "masked-vocabulary": (0.5, 2.0, 1.0, 1.0, "masked"),
}
LOSSES = ("cross_entropy", "log_probs", "policy", "simpo", "forward_kl", "jsd", "top_k")


def _log_softmax64(x, w, b, t, cap):
  z = x @ w if b is None else x @ w + b
  if cap is not None:  # -inf stays -inf (and its branch's gradient is 0, not NaN)
    masked = z == -jnp.inf
    z = jnp.where(masked, z, cap * jnp.tanh(jnp.where(masked, 0, z) / cap))
  return jax.nn.log_softmax(z / t, axis=-1)


def _kl64(la, lb):
  ok = la > -jnp.inf
  return jnp.sum(jnp.where(ok, jnp.exp(la) * (jnp.where(ok, la, 0) - jnp.where(ok, lb, 0)), 0), -1)


def _masked_mean(v, m):
  return jnp.sum(jnp.where(m, v, 0)) / jnp.maximum(jnp.sum(m), 1)


def _teacher_top_k(t, cap, b):
  lp = _log_softmax64(jnp.asarray(XT), jnp.asarray(WT), b, t, cap)
  values, idx = jax.lax.top_k(lp, K)
  return idx, values.astype(jnp.float32)


def formula(loss, t, cap, b, xt, wt, top):
  """`loss` in float64 from its plain formula over the full logits, a function of ``(x, w)``."""
  adv, c1, c2 = jnp.asarray(ADV), 0.3, 0.7

  def f(x, w):
    lq = _log_softmax64(x, w, b, t, cap)
    lp_y = jnp.take_along_axis(lq, TOKENS[..., None], -1)[..., 0]
    lp_y = jnp.where(MASK, lp_y, 0)  # a masked position's token may be a masked entry: -inf
    finite = jnp.where(lq > -jnp.inf, lq, 0)
    h = -jnp.sum(jnp.exp(lq) * finite, -1)
    if loss == "cross_entropy":
      return _masked_mean(-lp_y, MASK)
    if loss == "log_probs":
      return jnp.sum(jnp.where(MASK, c1 * lp_y + c2 * h, 0))
    if loss == "policy":  # GRPO on-policy: the ratio exp(lp - sg(lp)), an entropy bonus of 0.01
      per_token = adv[:, None] * jnp.exp(lp_y - jax.lax.stop_gradient(lp_y)) + 0.01 * h
      return -jnp.mean(jnp.sum(jnp.where(MASK, per_token, 0), -1) / jnp.sum(MASK, -1))
    if loss == "simpo":  # chosen: x's completions, rejected: the teacher's hidden states'
      lr = _log_softmax64(xt, w, b, t, cap)
      lr_y = jnp.take_along_axis(lr, TOKENS[..., None], -1)[..., 0]
      mean = lambda a: jnp.sum(jnp.where(MASK, a, 0), -1) / jnp.sum(MASK, -1)
      return jnp.mean(-jax.nn.log_sigmoid(2.0 * (mean(lp_y) - mean(lr_y)) - 0.5))
    if loss == "top_k":
      idx, lpk = top
      lpk = lpk.astype(jnp.float64)
      inside = jnp.sum(jax.nn.one_hot(idx, V, dtype=bool), -2)
      lq_tail = jax.nn.logsumexp(jnp.where(inside, -jnp.inf, lq), -1)
      lp_tail = jnp.log(-jnp.expm1(jnp.minimum(jax.nn.logsumexp(lpk, -1), -1e-30)))
      lq_b = jnp.concatenate([jnp.take_along_axis(lq, idx, -1), lq_tail[..., None]], -1)
      lp_b = jnp.concatenate([lpk, lp_tail[..., None]], -1)
      return _masked_mean(_kl64(lp_b, lq_b), MASK)
    lp = _log_softmax64(xt, wt, b, t, cap)
    if loss == "forward_kl":
      return _masked_mean(_kl64(lp, lq), MASK)
    some = (lp > -jnp.inf) | (lq > -jnp.inf)  # an entry both heads mask counts 0
    lp, lq = jnp.where(some, lp, 0), jnp.where(some, lq, 0)
    lm = jnp.logaddexp(np.log(0.5) + lp, np.log(0.5) + lq)
    jsd = jnp.where(some, 0.5 * jnp.exp(lp) * (lp - lm) + 0.5 * jnp.exp(lq) * (lq - lm), 0)
    return _masked_mean(jnp.sum(jsd, -1), MASK)

  return f


def jaxact_loss(loss, t, cap, b, xt, wt, top):
  kw = dict(bias=b, logit_soft_cap=cap, vocab_block_size=BLOCK)
  if loss == "cross_entropy":
    return lambda x, w: jaxact.linear_cross_entropy(x, w, TOKENS, where=MASK, **kw)
  if loss == "log_probs":

    def f(x, w):
      lp, h = jaxact.linear_log_probs(
        x, w, TOKENS, where=MASK, temperature=t, return_entropy=True, **kw
      )
      return jnp.sum(0.3 * lp + 0.7 * h)

    return f
  if loss == "policy":
    return lambda x, w: jaxact.policy_gradient_loss(
      x, w, TOKENS, f32(ADV), mask=MASK, entropy_coef=0.01, temperature=t, **kw
    )[0]
  if loss == "simpo":
    return lambda x, w: jaxact.preference_loss(
      x,
      xt,
      w,
      TOKENS,
      TOKENS,
      chosen_mask=MASK,
      rejected_mask=MASK,
      loss="simpo",
      beta=2.0,
      temperature=t,
      **kw,
    )[0]
  if loss == "top_k":
    return lambda x, w: jaxact.top_k_distillation_loss(x, w, *top, mask=MASK, temperature=t, **kw)[
      0
    ]
  kw.update(teacher_bias=b, teacher_logit_soft_cap=cap)
  return lambda x, w: jaxact.distillation_loss(
    x, w, xt, wt, divergence=loss, mask=MASK, temperature=t, **kw
  )[0]


@pytest.mark.sample(
  1, *(f"{loss}-{case}" for loss, case in zip(LOSSES + LOSSES[:1], CASES, strict=True))
)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("loss", LOSSES)
def test_values_and_gradients_at_the_edges_against_float64(loss, case):
  """float32 values and gradients in ``x`` and ``w`` against the float64 formula on the same
  inputs: finite, and within float32's rounding (relative to the largest magnitude; gradients
  below float32's normals, at ``T = 1e38``, flush to 0)."""
  t, cap, xs, ws, masked = CASES[case]
  if loss == "cross_entropy" and t != 1:
    t = 1.0  # it has no temperature: the case's scales and cap alone
  b = None
  if masked:
    b = np.where(np.arange(V) % 5 == 0, -np.inf, 0.1 * np.arange(V))
  x, w, xt, wt = (f32(a) for a in (X * xs, W * ws, XT * xs, WT * ws))
  b32 = None if b is None else f32(b)
  top = _teacher_top_k(t, cap, None if b is None else jnp.asarray(b))
  value, grads = jax.value_and_grad(jaxact_loss(loss, t, cap, b32, xt, wt, top), (0, 1))(x, w)
  up = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
  want_f = formula(loss, t, cap, up(b32), up(xt), up(wt), top)
  want, want_grads = jax.value_and_grad(want_f, (0, 1))(up(x), up(w))
  pairs = zip(grads, want_grads, ("dx", "dw"), strict=True)
  for got, ref, name in ((value, want, "value"), *pairs):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(got)), name
    scale = np.max(np.abs(ref))
    if name == "value":  # a divergence near 0 is a sum of terms of order 1 that cancel
      atol = 1e-5 * max(scale, 0.01)
    else:  # at T = 1e38 the gradients are below float32's normals: 0
      atol = 1e-4 * scale + (1e-37 * max(xs, ws) if t > 1e30 else 0)
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol, err_msg=f"{name}: {loss} {case}")


def test_the_entropy_of_a_temperature_past_1e34_stays_below_log_v():
  """``T = 1e38`` with a last block overlapping its predecessor: the softmax is uniform, its
  entropy ``log V``. Before, the overlapped columns (at the float's lowest value, which a
  temperature above 1e34 brings within 1e4 of the max) counted in the entropy's sum: 3.0014 for
  ``log 20 = 2.9957``."""
  lp, h = jaxact.linear_log_probs(
    f32(X), f32(W), TOKENS, temperature=1e38, return_entropy=True, vocab_block_size=BLOCK
  )
  np.testing.assert_allclose(h, np.log(V), rtol=1e-6)
  np.testing.assert_allclose(lp, -np.log(V), rtol=1e-6)


# ------------------------------------------------------------- no token, and vmap over batches


def _losses(x, xt, w, tokens, mask, adv, idx, lpk):
  """Each loss of the family on one batch: ``{name: () -> loss}``, each computed when called."""
  ref = jnp.zeros(tokens.shape[:-1], jnp.float32)
  pref = dict(chosen_mask=mask, rejected_mask=mask, vocab_block_size=BLOCK)

  def policy(lt):
    return lambda: jaxact.policy_gradient_loss(
      x, w, tokens, adv, mask=mask, loss_type=lt, ref_log_probs=0 * tokens - 3.0, beta=0.1
    )[0]

  return {
    "cross_entropy": lambda: jaxact.linear_cross_entropy(x, w, tokens, where=mask),
    "log_probs": lambda: jnp.sum(
      jaxact.linear_log_probs(x, w, tokens, where=mask, temperature=0.5)
    ),
    **{f"policy-{lt}": policy(lt) for lt in ("grpo", "dapo", "dr_grpo", "gspo", "ppo")},
    "dpo": lambda: jaxact.preference_loss(
      x, xt, w, tokens, tokens, ref_chosen_log_probs=ref, ref_rejected_log_probs=ref, **pref
    )[0],
    "kto": lambda: jaxact.preference_loss(
      x,
      xt,
      w,
      tokens,
      tokens,
      loss="kto",
      ref_chosen_log_probs=ref,
      ref_rejected_log_probs=ref,
      **pref,
    )[0],
    "jsd": lambda: jaxact.distillation_loss(
      x, w, xt, w, mask=mask, divergence="jsd", labels=tokens, hard_label_weight=0.5
    )[0],
    "top_k": lambda: jaxact.top_k_distillation_loss(x, w, idx, lpk, mask=mask, temperature=0.7)[0],
  }


def _all_losses(*args):
  """Each loss of the family on one batch (:func:`_losses`' arguments): ``{name: loss}``."""
  return {name: loss() for name, loss in _losses(*args).items()}


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)], ids=["no_sequence", "no_position"])
def test_no_token_gives_zero_losses_with_zero_gradients(shape):
  """Before, a policy batch of sequences without positions raised '`max_length` must be an int
  >= 1; got None' (the caller gave none), and GSPO's clip fraction of no sequence was NaN."""
  x = jnp.zeros((*shape, D), jnp.float32)
  tokens = jnp.zeros(shape, jnp.int32)
  mask = jnp.ones(shape, bool)
  args = (jnp.zeros(shape[:-1], jnp.float32), jnp.zeros((*shape, K), jnp.int32))
  lpk = jnp.full((*shape, K), -3.0, jnp.float32)
  losses = _all_losses(x, x, f32(W), tokens, mask, args[0], args[1] + jnp.arange(K), lpk)
  for name in losses:  # each loss and its gradient alone
    f = lambda x, name=name: _losses(x, x, f32(W), tokens, mask, args[0], args[1], lpk)[name]()
    value, grad = jax.value_and_grad(f)(x)
    assert float(value) == 0.0 and grad.shape == x.shape, name
  _, metrics = jaxact.policy_gradient_loss(x, f32(W), tokens, args[0], loss_type="gspo")
  assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())


@pytest.mark.exhaustive  # by default test_lce.py's jit/vmap/remat/scan test maps the head
def test_vmap_over_a_batch_axis_equals_the_calls_one_by_one():
  """Every loss under ``vmap`` over a leading axis of 3 batches (the tokens traced, so their
  range is not read): values and gradients in ``x`` as the three calls give them."""
  r = np.random.default_rng(1)
  n = 3
  x, xt = f32(r.normal(size=(n, B, S, D))), f32(r.normal(size=(n, B, S, D)))
  tokens = jnp.asarray(r.integers(0, V, (n, B, S)), jnp.int32)
  mask = jnp.asarray(r.random((n, B, S)) > 0.3).at[:, :, 0].set(True)
  adv = f32(r.normal(size=(n, B)))
  idx = jnp.asarray(np.argsort(r.random((n, B, S, V)), -1)[..., :K], jnp.int32)
  lpk = f32(-1.5 - r.random((n, B, S, K)))
  batched = (xt, tokens, mask, adv, idx, lpk)

  def total(x, *rest):
    return sum(_all_losses(x, rest[0], f32(W), *rest[1:]).values())

  step = jax.value_and_grad(total)
  got, got_grad = jax.jit(jax.vmap(step))(x, *batched)
  for i in range(n):
    want, want_grad = jax.jit(step)(x[i], *(a[i] for a in batched))
    np.testing.assert_allclose(got[i], want, rtol=1e-5)
    np.testing.assert_allclose(got_grad[i], want_grad, rtol=1e-4, atol=1e-6)


def test_log_probs_past_float32s_range_give_a_ratio_of_one_on_policy():
  """``T = 1e-40`` and a bias of order 1: the log-probabilities (about -1e40) are past float32's
  range, -inf; on-policy the ratio is still 1 (the loss ``-A``, the entropy 0), where ``-inf -
  (-inf)`` made the loss and the mean ratio NaN."""
  b = f32(0.1 * np.arange(V))
  loss, metrics = jaxact.policy_gradient_loss(
    f32(X * 1e-3), f32(W * 1e-3), TOKENS, f32(ADV), mask=MASK, bias=b, temperature=1e-40
  )
  assert np.isinf(np.asarray(metrics["log_probs"])[np.asarray(MASK)]).any()
  want = -np.mean(ADV)  # each sequence's mean of A over its tokens, then over the sequences
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  assert float(metrics["ratio"]) == 1.0


@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "case",
  {
    "cap=1e-30": (1.0, 1.0, 1e-30),
    "cap=1e30": (1.0, 1.0, 1e30),
    "x=1e30,w=1e-30": (1e30, 1e-30, None),
    "x=1e-30,w=1e30,cap": (1e-30, 1e30, 5.0),
  }.items(),
  ids=lambda c: c[0],
)
def test_the_hopper_kernels_at_the_edges(case):
  """The same edges through ``implementation="mosaic"`` (Mosaic GPU's interpreter; temperature 1,
  the kernels' only one): bfloat16 operands, 128 tokens, V = 256, against the float64 formula,
  within bfloat16's rounding of G."""
  _, (xs, ws, cap) = case
  r = np.random.default_rng(2)
  t, d, v = 128, 64, 256
  x = jnp.asarray(r.normal(size=(t, d)) * xs, jnp.bfloat16)
  w = jnp.asarray(r.normal(size=(d, v)) / 8 * ws, jnp.bfloat16)
  labels = jnp.asarray(r.integers(0, v, t), jnp.int32)
  c = jnp.cos(jnp.arange(t))

  def ours(x, w):
    loss = jaxact.linear_cross_entropy(
      x, w, labels, reduction="none", implementation="mosaic", logit_soft_cap=cap
    )
    return jnp.sum(c * loss)

  def plain(x, w):
    z = x @ w
    if cap is not None:
      z = cap * jnp.tanh(z / cap)
    return -jnp.sum(c * jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], -1)[:, 0])

  got = jax.value_and_grad(ours, (0, 1))(x, w)
  want = jax.value_and_grad(plain, (0, 1))(x.astype(jnp.float64), w.astype(jnp.float64))
  tols = (1e-5, 1e-2, 1e-2)
  for g, r64, tol in zip(jax.tree.leaves(got), jax.tree.leaves(want), tols, strict=True):
    g, r64 = np.asarray(g, np.float64), np.asarray(r64)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, r64, rtol=0, atol=tol * np.max(np.abs(r64)))
