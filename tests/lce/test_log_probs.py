"""jaxact.linear_log_probs against JAX's autodiff of the plain formulas (lce/reference.py).

Values and the gradients in x, w and bias under cotangents on the log-probabilities, the entropy
and both, in float64 to 1e-12; float32 to 1e-5; half precision against float32 of the same inputs;
temperature, soft cap, ``w_layout="vd"``, ``where``, masked vocabulary, extreme logits, every
integer token dtype, the transformations, what the pullback keeps and what the compiled step
holds, the backend decision, the errors; and (run as a script in a subprocess with 8 virtual CPU
devices, as tests/eight_devices.py does it) the LM head's sharding paths, equal to one device.
"""

from __future__ import annotations

import json
import os
import sys

# Only when run as the 8-device script: pytest's own process must not get 8 devices; the shared
# test helpers (eight_devices) are in tests/, which pytest's conftest puts on the path.
if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eight_devices
import jaxact
from jaxact._src.lce import rules as lce_rules
from jaxact._src.lce.plan import LcePlan, default_block
from jaxact._src.lce.reference import entropy_reference, log_probs_reference

EXHAUSTIVE = pytest.mark.exhaustive
# 67 columns in blocks of 16: four whole blocks and one overlapping its predecessor.
T, D, V, BLOCK = 13, 8, 67, 16
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
_FN = r"jaxact\.linear_log_probs: "


def rel_err(a, b) -> float:
  """The largest difference relative to the largest magnitude of `b`."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b), initial=0) / max(np.max(np.abs(b), initial=0), 1e-300))


def inputs(dtype=jnp.float64, t=T, d=D, v=V, seed=0, scale=3.0):
  """``x, w, b, tokens, where`` from a fixed seed; logits of order `scale`."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(t, d)), dtype)
  w = jnp.asarray(rng.normal(size=(d, v)) * scale / np.sqrt(d), dtype)
  b = jnp.asarray(rng.normal(size=(v,)), dtype)
  tokens = jnp.asarray(rng.integers(0, v, size=(t,)), jnp.int32)
  where = jnp.asarray(rng.random(t) > 0.3)
  return x, w, b, tokens, where


def cotangents(dtype, shape, seed=1):
  rng = np.random.default_rng(seed)
  acc = jnp.promote_types(dtype, jnp.float32)
  return tuple(jnp.asarray(rng.normal(size=shape), acc) for _ in range(2))


def _grads(f, x, w, b, c1, c2):
  """Values ``(log_probs, entropy)`` of ``f(x, w, b)`` and the gradients in ``(x, w, b)`` of
  ``Σ c1 log_probs``, ``Σ c2 entropy`` and their sum, compiled as one program."""

  def run(x, w, b):
    def on(a, c):
      return lambda x, w, b: jnp.sum(f(x, w, b)[a] * c)

    both = lambda x, w, b: on(0, c1)(x, w, b) + on(1, c2)(x, w, b)
    return f(x, w, b), [jax.grad(g, (0, 1, 2))(x, w, b) for g in (on(0, c1), on(1, c2), both)]

  return jax.jit(run)(x, w, b)


def _against_reference(dtype, options, reference_dtype=None):
  """``(ours, theirs)`` of :func:`_grads`, jaxact's and the reference's on the same inputs (cast
  exactly to `reference_dtype` for the reference when given)."""
  x, w, b, tokens, where = inputs(dtype)
  opts = dict(options)
  if opts.pop("where", False):
    opts["where"] = where
  if opts.get("w_layout") == "vd":
    w = w.T
  c1, c2 = cotangents(dtype, tokens.shape)

  def ours(x, w, b):
    return jaxact.linear_log_probs(
      x, w, tokens, bias=b, return_entropy=True, vocab_block_size=BLOCK, **opts
    )

  def theirs(x, w, b):
    return log_probs_reference(x, w, tokens, bias=b, **opts), entropy_reference(
      x, w, bias=b, **opts
    )

  up = [a.astype(reference_dtype or a.dtype) for a in (x, w, b, c1, c2)]
  return _grads(ours, x, w, b, c1, c2), _grads(theirs, *up)


def _assert_close(ours, theirs, tol):
  (values, grads), (values_ref, grads_ref) = ours, theirs
  for what, a, r in zip(("log_probs", "entropy"), values, values_ref, strict=True):
    assert np.all(np.isfinite(a)), what
    assert rel_err(a, r) < tol, (what, rel_err(a, r))
  for mode, g, g_ref in zip(("log_probs", "entropy", "both"), grads, grads_ref, strict=True):
    for what, a, r in zip(("dx", "dw", "db"), g, g_ref, strict=True):
      assert np.all(np.isfinite(a)), (mode, what)
      assert rel_err(a, r) < tol, (mode, what, rel_err(a, r))


# ------------------------------------------------------------------------- values, gradients

OPTIONS = {
  "plain": {},
  "temperature": {"temperature": 0.7},
  "cap-temperature-where": {"logit_soft_cap": 2.0, "temperature": 1.6, "where": True},
  "vd-where": {"w_layout": "vd", "where": True, "temperature": 2.5},
}
DEFAULT = {"plain", "cap-temperature-where"}


@pytest.mark.parametrize(
  "option", [pytest.param(n, marks=[] if n in DEFAULT else EXHAUSTIVE) for n in OPTIONS]
)
def test_float64_matches_autodiff_of_the_reference(option):
  """Both outputs, and dx, dw, db under cotangents on the log-probabilities, on the entropy and
  on both, equal JAX's autodiff of the full log_softmax to 1e-12."""
  ours, theirs = _against_reference(jnp.float64, OPTIONS[option])
  assert ours[0][0].dtype == ours[0][1].dtype == jnp.float64
  _assert_close(ours, theirs, 1e-12)


def test_without_the_entropy_log_probs_are_minus_the_cross_entropy():
  """``log p(y)`` alone (no entropy asked) is minus linear_cross_entropy's per-token loss, its
  gradient the loss's with the cotangent negated."""
  x, w, b, tokens, where = inputs()
  c, _ = cotangents(jnp.float64, tokens.shape)
  kw = dict(bias=b, where=where, logit_soft_cap=3.0, vocab_block_size=BLOCK)

  def ours(x, w):
    return jnp.sum(c * jaxact.linear_log_probs(x, w, tokens, **kw))

  def loss(x, w):
    return -jnp.sum(c * jaxact.linear_cross_entropy(x, w, tokens, reduction="none", **kw))

  def theirs(x, w):
    return jnp.sum(c * log_probs_reference(x, w, tokens, **kw_ref))

  kw_ref = dict(bias=b, where=where, logit_soft_cap=3.0)
  got = jax.jit(jax.value_and_grad(ours, (0, 1)))(x, w)
  for want in (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (loss, theirs)):
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert rel_err(a, r) < 1e-12


def test_float32_within_1e5_of_the_float64_reference():
  ours, theirs = _against_reference(jnp.float32, OPTIONS["cap-temperature-where"], jnp.float64)
  assert ours[0][0].dtype == ours[0][1].dtype == jnp.float32
  _assert_close(ours, theirs, 1e-5)


@pytest.mark.parametrize(
  "dtype",
  [jnp.bfloat16, pytest.param(jnp.float16, marks=EXHAUSTIVE)],
  ids=lambda d: np.dtype(d).name,
)
def test_half_precision_is_computed_in_float32(dtype):
  """Half precision inputs: float32 outputs equal to the float32 reference of the same (rounded,
  upcast) inputs; gradients in the inputs' dtype within a few of its ulps."""
  x, w, b, tokens, where = inputs(jnp.float32, t=64, v=300)
  half = [a.astype(dtype) for a in (x, w, b)]
  up = [a.astype(jnp.float32) for a in half]
  kw = dict(where=where, temperature=0.8, logit_soft_cap=4.0)
  c1, c2 = cotangents(jnp.float32, tokens.shape)

  def ours(x, w, b):
    return jaxact.linear_log_probs(
      x, w, tokens, bias=b, return_entropy=True, vocab_block_size=64, **kw
    )

  def theirs(x, w, b):
    return log_probs_reference(x, w, tokens, bias=b, **kw), entropy_reference(x, w, bias=b, **kw)

  (values, grads), (values_ref, grads_ref) = (
    _grads(ours, *half, c1, c2),
    _grads(theirs, *up, c1, c2),
  )
  assert [v.dtype for v in values] == [jnp.float32] * 2
  for a, r in zip(values, values_ref, strict=True):
    assert rel_err(a, r) < 1e-5
  for g, g_ref in zip(grads, grads_ref, strict=True):
    assert [a.dtype for a in g] == [dtype] * 3
    for a, r in zip(g, g_ref, strict=True):
      assert rel_err(a, r) < 4 * float(jnp.finfo(dtype).eps)


# ---------------------------------------------------------------------------------- masking


def test_where_gives_zero_values_and_zero_gradients_and_ignores_those_tokens():
  """Masked positions: 0 in both outputs, zero rows of dx, nothing in dw, db; their tokens (-100,
  V) are not read, concrete or under jit."""
  x, w, b, tokens, where = inputs()
  bad = jnp.where(where, tokens, jnp.where(jnp.arange(T) % 2 == 0, -100, V))
  c1, c2 = cotangents(jnp.float64, tokens.shape)
  kw = dict(bias=b, where=where, return_entropy=True, vocab_block_size=BLOCK)

  def f(x, w, b):
    return jaxact.linear_log_probs(x, w, bad, **{**kw, "bias": b})

  def g(x, w, b):
    return jaxact.linear_log_probs(x, w, tokens, **{**kw, "bias": b})

  jax.eval_shape(f, x, w, b)  # concrete tokens out of range where masked: no error
  (lp, h), grads = _grads(f, x, w, b, c1, c2)
  _, grads_valid = _grads(g, x, w, b, c1, c2)
  off = ~np.asarray(where)
  assert np.all(np.asarray(lp)[off] == 0) and np.all(np.asarray(h)[off] == 0)
  assert not np.any(np.signbit(np.asarray(lp)[off]))  # +0, not -0
  assert np.all(np.asarray(h)[~off] > 0)
  for g_bad, g_ok in zip(grads, grads_valid, strict=True):
    assert np.all(np.asarray(g_bad[0])[off] == 0)
    for a, r in zip(g_bad, g_ok, strict=True):
      np.testing.assert_array_equal(a, r)  # the masked tokens' values change nothing


def test_where_broadcasts_over_batch_dims():
  x, w, _, tokens, _ = inputs(t=6)
  x3, t3 = x.reshape(2, 3, D), tokens[:6].reshape(2, 3)
  row = jnp.array([True, False, True])
  lp, h = jax.jit(functools.partial(jaxact.linear_log_probs, return_entropy=True))(
    x3, w, t3, where=row
  )
  full = jnp.broadcast_to(row, (2, 3))
  assert lp.shape == h.shape == (2, 3)
  want = jax.jit(
    lambda x, w: (log_probs_reference(x, w, t3, where=full), entropy_reference(x, w, where=full))
  )(x3, w)
  assert rel_err(lp, want[0]) < 1e-12 and rel_err(h, want[1]) < 1e-12


@pytest.mark.parametrize("cap", [None, pytest.param(2.0, marks=EXHAUSTIVE)], ids=["no_cap", "cap"])
def test_masked_vocabulary_is_the_smaller_vocabulary(cap):
  """Columns with a bias of -inf: probability 0, no part in the entropy, zero gradients there,
  everything finite; the values and gradients of the vocabulary without those columns."""
  x, w, b, tokens, _ = inputs()
  masked = np.zeros(V, bool)
  masked[::3] = True
  kept = np.flatnonzero(~masked)
  tokens = jnp.asarray(kept[np.asarray(tokens) % len(kept)], jnp.int32)
  b_masked = jnp.where(masked, -jnp.inf, b)
  small = jnp.asarray(np.searchsorted(kept, np.asarray(tokens)), jnp.int32)
  c1, c2 = cotangents(jnp.float64, tokens.shape)
  kw = dict(return_entropy=True, temperature=1.5, logit_soft_cap=cap, vocab_block_size=BLOCK)

  def full(x, w, b):
    return jaxact.linear_log_probs(x, w, tokens, bias=b, **kw)

  def smaller(x, w, b):
    return jaxact.linear_log_probs(x, w, small, bias=b, **kw)

  (values, grads) = _grads(full, x, w, b_masked, c1, c2)
  (values_s, grads_s) = _grads(smaller, x, w[:, kept], b[kept], c1, c2)
  for a, r in zip(values, values_s, strict=True):
    assert np.all(np.isfinite(a)) and rel_err(a, r) < 1e-12
  for g, g_s in zip(grads, grads_s, strict=True):
    dx, dw, db = (np.asarray(a) for a in g)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw)) and np.all(np.isfinite(db))
    assert np.all(dw[:, masked] == 0) and np.all(db[masked] == 0)
    assert rel_err(dx, g_s[0]) < 1e-12
    assert rel_err(dw[:, kept], g_s[1]) < 1e-12 and rel_err(db[kept], g_s[2]) < 1e-12
  # and the reference (its log of 0 replaced by 0) agrees
  ref = _grads(
    lambda x, w, b: (
      log_probs_reference(x, w, tokens, bias=b, temperature=1.5, logit_soft_cap=cap),
      entropy_reference(x, w, bias=b, temperature=1.5, logit_soft_cap=cap),
    ),
    x,
    w,
    b_masked,
    c1,
    c2,
  )
  _assert_close((values, grads), ref, 1e-12)


# -------------------------------------------------------------------------------- numerics


def test_huge_and_equal_logits():
  """float32 logits of ±1e30 stay finite with finite gradients; V equal logits of -1e9 give
  ``log p = -log V`` and ``H = log V`` (one log-sum-exp a token would round both to 0)."""
  v = 24
  x = jnp.ones((4, 1), jnp.float32)
  w = jnp.asarray(np.resize([1e30, 5e29, -1e30, 1e30], (1, v)), jnp.float32)
  tokens = jnp.array([0, 1, 2, 3], jnp.int32)

  def f(x, w):
    return jaxact.linear_log_probs(x, w, tokens, return_entropy=True, vocab_block_size=7)

  (lp, h), grads = _grads(lambda x, w, b: f(x, w), x, w, None, *cotangents(jnp.float32, (4,)))
  top = v // 2  # columns at 1e30
  want = [-np.log(top), -5e29, -2e30, -np.log(top)]  # each token's distance below the max
  np.testing.assert_allclose(lp, want, rtol=1e-6)
  np.testing.assert_allclose(h, np.log(top), rtol=1e-6)
  for g in grads:
    assert all(np.all(np.isfinite(a)) for a in g[:2])
  assert np.all(np.isfinite(lp)) and np.all(np.isfinite(h))

  x = jnp.ones((3, 2), jnp.float32)
  w = jnp.zeros((2, v), jnp.float32)
  b = jnp.full((v,), -1e9, jnp.float32)
  lp, h = jaxact.linear_log_probs(x, w, tokens[:3], bias=b, return_entropy=True, temperature=0.5)
  np.testing.assert_allclose(lp, -np.log(v), rtol=1e-6)
  np.testing.assert_allclose(h, np.log(v), rtol=1e-6)


def test_debug_infs_stays_quiet_with_the_entropy():
  """Eagerly under jax.debug_infs (every operation's output checked): finite inputs, a partial
  last block, the entropy and its gradient make no infinity."""
  x, w, b, tokens, where = inputs(jnp.float32)

  def f(x, w):
    lp, h = jaxact.linear_log_probs(
      x, w, tokens, bias=b, where=where, return_entropy=True, temperature=0.7, vocab_block_size=16
    )
    return jnp.sum(lp) + jnp.sum(h)

  want = jax.value_and_grad(f, (0, 1))(x, w)
  with jax.debug_infs(True):
    got = jax.value_and_grad(f, (0, 1))(x, w)
  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize(
  "dtype",
  [pytest.param(d, marks=[] if d in (np.uint16, np.int64) else EXHAUSTIVE) for d in INT_DTYPES],
  ids=lambda d: np.dtype(d).name,
)
def test_tokens_of_every_integer_dtype_are_their_values(dtype):
  """V = 70000 is beyond 8- and 16-bit tokens: each dtype's tokens give the log-probabilities of
  the values they hold; under jit, -1 and values >= V give -inf (an impossible token)."""
  v = 70000
  info = np.iinfo(dtype)
  held = [0, 1, min(info.max, 300), min(info.max, v - 1), min(int(info.max) // 3, v - 2), 7]
  x, w, _, _, _ = inputs(jnp.float32, t=6, d=4, v=v, scale=1.0)
  f = jax.jit(jaxact.linear_log_probs)
  got = f(x, w, np.asarray(held, dtype))
  assert rel_err(got, log_probs_reference(x, w, jnp.asarray(held, jnp.int32))) < 1e-5
  bad = ([v, int(info.max)] if info.max >= v else []) + ([-1] if info.min < 0 else [])
  if bad:
    tokens = np.asarray(bad + held[: 6 - len(bad)], dtype)
    got = np.asarray(f(x, w, tokens))
    assert np.all(got[: len(bad)] == -np.inf) and np.all(np.isfinite(got[len(bad) :]))
    with pytest.raises(ValueError, match=_FN + r"`tokens` holds"):
      jaxact.linear_log_probs(x, w, tokens)


# --------------------------------------------------------------------------- transformations


def test_jit_vmap_and_grad_under_jit():
  x, w, b, tokens, _ = inputs()
  kw = dict(bias=b, temperature=0.9, logit_soft_cap=3.0)

  def ours(x, w):
    lp, h = jaxact.linear_log_probs(x, w, tokens, return_entropy=True, vocab_block_size=BLOCK, **kw)
    return jnp.sum(lp) + jnp.sum(h * jnp.arange(T))

  def theirs(x, w):
    lp = log_probs_reference(x, w, tokens, **kw)
    return jnp.sum(lp) + jnp.sum(entropy_reference(x, w, **kw) * jnp.arange(T))

  assert rel_err(jax.jit(ours)(x, w), theirs(x, w)) < 1e-12
  xs, ws = jnp.stack([x, 2 * x]), jnp.stack([w, -w])
  # vmap of grad over a batch of x, and over a stack of w, under jit
  for axes, args in (((0, None), (xs, w)), ((None, 0), (x, ws))):
    got, want = (jax.jit(jax.vmap(jax.grad(f, (0, 1)), axes))(*args) for f in (ours, theirs))
    for a, r in zip(got, want, strict=True):
      assert rel_err(a, r) < 1e-12


def test_empty_positions():
  x, w = jnp.zeros((0, D)), jnp.ones((D, V))
  lp, h = jaxact.linear_log_probs(x, w, jnp.zeros((0,), jnp.uint8), return_entropy=True)
  assert lp.shape == h.shape == (0,)
  assert np.all(
    jax.grad(lambda w: jaxact.linear_log_probs(x, w, jnp.zeros((0,), int)).sum())(w) == 0
  )


# ------------------------------------------------------------------------------ what it keeps


@pytest.mark.parametrize("entropy", [False, True], ids=["log_probs", "entropy"])
def test_the_pullback_keeps_x_w_bias_tokens_and_two_or_three_numbers_a_token(entropy):
  t, v = 32, 300
  x, w, b, tokens, where = inputs(jnp.float32, t=t, v=v)
  _, pull = jax.vjp(
    lambda x, w, b: jaxact.linear_log_probs(
      x, w, tokens, bias=b, where=where, return_entropy=entropy, temperature=0.5
    ),
    x,
    w,
    b,
  )
  kept = jax.tree.leaves(pull)
  assert max(k.size for k in kept) < t * v
  assert sorted(k.shape for k in kept if v in k.shape) == [(8, v), (v,)]  # w and bias
  per_token = [k for k in kept if k.shape == (t,) and k.dtype == jnp.float32]
  assert len(per_token) == 2 + entropy  # m, se (and the entropy's moment)
  kept_bytes = x.nbytes + w.nbytes + b.nbytes + (4 * (2 + entropy) + 4 + 1) * t
  assert sum(k.nbytes for k in kept) <= kept_bytes


def test_the_compiled_gradient_holds_no_tokens_by_vocabulary_array():
  """jit(grad) of both outputs at T = 512, V = 32768: the temp is a few blocks of logits (an
  eighth of the vocabulary by default; 16 MiB), whatever the vocabulary (with blocks of 512
  columns, 2 MiB), never one (T, V) float32 array (64 MiB) as the plain composition's (194 MiB):
  so the check can fail."""
  t, d, v = 512, 16, 32768
  x, w, b, tokens, _ = inputs(jnp.float32, t=t, d=d, v=v)

  def ours(x, w, b, block=None):
    lp, h = jaxact.linear_log_probs(
      x, w, tokens, bias=b, return_entropy=True, temperature=0.7, vocab_block_size=block
    )
    return jnp.sum(lp) + jnp.sum(h)

  def theirs(x, w, b):
    lp = log_probs_reference(x, w, tokens, bias=b, temperature=0.7)
    return jnp.sum(lp) + jnp.sum(entropy_reference(x, w, bias=b, temperature=0.7))

  def temp(f):
    compiled = jax.jit(jax.grad(f, (0, 1, 2))).lower(x, w, b).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits = t * v * 4
  block = t * default_block(t, v) * 4
  ours_temp, theirs_temp = temp(ours), temp(theirs)
  assert ours_temp <= 3 * block and ours_temp <= logits / 2, (ours_temp, block)
  assert theirs_temp >= 2 * logits, theirs_temp
  small = functools.partial(ours, block=512)
  assert temp(small) <= 3 * t * 512 * 4 <= logits / 16


# --------------------------------------------------------------------------------- dispatch


def test_the_hopper_kernels_decline_the_entropy_and_a_temperature():
  """implementation=None takes XLA; "mosaic" raises NotImplementedError with the reason for the
  entropy and a temperature; "xla" always runs."""
  x, w, _, tokens, _ = inputs(jnp.float32)
  base = LcePlan(block=BLOCK)
  reasons = {
    "return_entropy": LcePlan(block=BLOCK, entropy=True),
    "temperature": LcePlan(block=BLOCK, temperature=0.5),
  }
  for word, plan in reasons.items():
    why = lce_rules.mosaic_unsupported(plan, x, w, None)
    assert why is not None and word in why
    assert lce_rules.decide("linear_log_probs", None, plan, x, w).forward == "xla"
  assert lce_rules.decide("linear_log_probs", "xla", base, x, w).forward == "xla"
  for kw, match in (
    (dict(return_entropy=True), r"'mosaic' does not support this call: return_entropy=True"),
    (dict(temperature=2.0), r"'mosaic' does not support this call: temperature=2\.0"),
    (dict(), r"'pallas' has no Triton"),
  ):
    impl = "pallas" if not kw else "mosaic"
    with pytest.raises(NotImplementedError, match=_FN + "implementation=" + match):
      jaxact.linear_log_probs(x, w, tokens, implementation=impl, **kw)
  want = jaxact.linear_log_probs(x, w, tokens, return_entropy=True)
  got = jaxact.linear_log_probs(x, w, tokens, return_entropy=True, implementation="xla")
  for a, r in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, r)


@EXHAUSTIVE
def test_the_hopper_kernels_run_the_log_probs_without_entropy(monkeypatch):
  """Log-probabilities alone at temperature 1 are the cross-entropy's kernels' work: forced
  ("mosaic", Mosaic GPU's interpreter on CPU) they run and equal the XLA path (G rounded to
  bfloat16 on both, one ulp apart at most)."""
  from pallas_kernels import lce_mosaic

  x, w, b, tokens, _ = inputs(jnp.float32, t=128, d=128, v=512, scale=1.0)
  x, w, b = (a.astype(jnp.bfloat16) for a in (x, w, b))
  c, _ = cotangents(jnp.float32, tokens.shape)
  calls, kernel = [], lce_mosaic.lce_fwd
  monkeypatch.setattr(lce_mosaic, "lce_fwd", lambda *a, **k: calls.append(k) or kernel(*a, **k))

  def step(impl):
    def f(x, w, b):
      lp = jaxact.linear_log_probs(x, w, tokens, bias=b, logit_soft_cap=10.0, implementation=impl)
      return jnp.sum(c * lp)

    return jax.value_and_grad(f, (0, 1, 2))(x, w, b)

  got = step("mosaic")
  assert calls  # the kernel ran
  want = step("xla")
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for a, r in zip(got[1], want[1], strict=True):
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    assert np.linalg.norm(a - r) <= 2**-9 * np.linalg.norm(r)


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
  "change, error, match",
  [
    (dict(temperature=0.0), ValueError, r"`temperature` is 0\.0; accepted: .*\(0\.0, inf\)"),
    (dict(temperature=-1.0), ValueError, r"`temperature` is -1\.0"),
    (dict(temperature=float("inf")), ValueError, r"`temperature` is inf"),
    (dict(temperature=float("nan")), ValueError, r"`temperature` is nan"),
    (dict(temperature="hot"), TypeError, r"`temperature` must be a Python float; got str"),
    (dict(temperature=True), TypeError, r"`temperature` must be a Python float; got bool"),
    (dict(logit_soft_cap=0.0), ValueError, r"`logit_soft_cap` is 0\.0; accepted"),
    (dict(logit_soft_cap=float("inf")), ValueError, r"`logit_soft_cap` is inf"),
    (dict(logit_soft_cap="30"), TypeError, r"`logit_soft_cap` must be a Python float"),
    (dict(return_entropy="yes"), TypeError, r"`return_entropy` must be a Python bool"),
    (dict(tokens=jnp.zeros((T,), jnp.float32)), TypeError, r"`tokens` has dtype float32"),
    (dict(tokens=jnp.zeros((T,), bool)), TypeError, r"`tokens` has dtype bool"),
    (dict(tokens=jnp.zeros((T + 1,), jnp.int32)), ValueError, r"`tokens` must have x's shape"),
    (dict(tokens=[1, 2]), TypeError, r"`tokens` must be a JAX/NumPy array"),
    (dict(x=jnp.ones((T, D), jnp.int32)), TypeError, r"`x` has dtype int32"),
    (dict(w=jnp.ones((D, V), jnp.int8)), TypeError, r"`w` has dtype int8"),
    (dict(w=jnp.ones((D + 1, V))), ValueError, r"`x` has 8 features but `w` expects 9"),
    (dict(w=jnp.ones((D, V, 1))), ValueError, r"`w` must have rank 2"),
    (dict(bias=jnp.ones((V + 1,))), ValueError, r"`bias` has shape \(68,\); accepted: \(67,\)"),
    (dict(where=jnp.ones((T + 1,), bool)), ValueError, r"`where` has shape .* tokens' shape"),
    (dict(where=jnp.ones((T,))), TypeError, r"`where` has dtype float"),
    (dict(w_layout="vv"), ValueError, r"`w_layout` 'vv' is not known"),
    (dict(vocab_block_size=0), ValueError, r"`vocab_block_size` is 0"),
    (dict(implementation="cuda"), ValueError, r"`implementation` 'cuda' is not known"),
  ],
  ids=lambda v: None if isinstance(v, dict) else "",
)
def test_bad_input_names_the_argument(change, error, match):
  x, w, _, tokens, _ = inputs(jnp.float32)
  kw = dict(x=x, w=w, tokens=tokens) | change
  with pytest.raises(error, match=_FN + match):
    jaxact.linear_log_probs(kw.pop("x"), kw.pop("w"), kw.pop("tokens"), **kw)


def test_concrete_tokens_out_of_range_and_traced_options():
  x, w, _, tokens, _ = inputs(jnp.float32)
  bad = tokens.at[3].set(-100)
  with pytest.raises(
    ValueError,
    match=_FN + r"`tokens` holds 1 value\(s\) outside \[0, 67\).*tokens\[3\] = -100.*"
    r"where=tokens >= 0",
  ):
    jaxact.linear_log_probs(x, w, bad)
  with pytest.raises(TypeError, match=_FN + r"`temperature` must be a static Python float"):
    jax.jit(lambda t: jaxact.linear_log_probs(x, w, tokens, temperature=t))(0.5)


# ------------------------------------------------------------- sharding on 8 virtual devices

SCRIPT = Path(__file__)
# (mesh shape, axis names, Auto axes, w_layout): tokens over "data", the vocabulary over "model".
SHARDED = {
  "explicit_2x4": ((2, 4), ("data", "model"), False, "dv"),
  "explicit_vocab_table": ((8,), ("model",), False, "vd"),
  "explicit_data": ((8,), ("data",), False, "dv"),
  "auto_2x4": ((2, 4), ("data", "model"), True, "dv"),
}
SHARDED_DEFAULT = {"explicit_2x4"}


def sharded_case(name: str) -> None:
  """Both outputs and the gradients of a loss of both, sharded as `name` says, against one
  device; the shapes the compiled step's collectives produce (never the whole vocabulary)."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  shape, axes, auto, layout = SHARDED[name]
  kinds = (AxisType.Auto if auto else AxisType.Explicit,) * len(axes)
  mesh = jax.make_mesh(shape, axes, kinds)
  t, d, v = 32, 24, 256
  x, w, b, tokens, where = inputs(jnp.float32, t=t, d=d, v=v)
  c1, c2 = cotangents(jnp.float32, (t,))
  w = w.T if layout == "vd" else w
  kw = dict(
    return_entropy=True, temperature=0.8, logit_soft_cap=5.0, w_layout=layout, vocab_block_size=48
  )

  def step(x, w, b, tokens, where, c1, c2):
    def loss(x, w, b):
      lp, h = jaxact.linear_log_probs(x, w, tokens, bias=b, where=where, **kw)
      return jnp.sum(lp * c1) + jnp.sum(h * c2), (lp, h)

    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, w, b)

  args = (x, w, b, tokens, where, c1, c2)
  single = jax.jit(step)(*jax.device_put(args, jax.devices()[0]))
  data = "data" if "data" in axes else None
  model = "model" if "model" in axes else None
  rows = P(data)
  specs = (P(data, None), P(model, None) if layout == "vd" else P(None, model), P(model))
  specs += (rows,) * 4
  with jax.set_mesh(mesh):
    sharded_args = tuple(
      jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)
    )
    compiled = jax.jit(step).lower(*sharded_args).compile()
    got = jax.jit(step)(*sharded_args)
  text = compiled.as_text()
  produced = re.findall(
    r"= (.*?) (?:all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(", text
  )
  shapes = sorted({a for p in produced for a in re.findall(r"[a-z]+\d*\[[\d,]*\]", p)})
  ((value, (lp, h)), grads), ((value1, (lp1, h1)), grads1) = got, single
  result = dict(
    case=name,
    devices=jax.device_count(),
    value_err=rel_err(value, value1),
    log_probs_err=rel_err(lp, lp1),
    entropy_err=rel_err(h, h1),
    grad_err=max(rel_err(a, r) for a, r in zip(grads, grads1, strict=True)),
    grad_specs=[str(g.sharding.spec) for g in grads] if not auto else [],
    collective_shapes=shapes,
  )
  print(json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def sharded_results(request, tmp_path_factory) -> dict[str, dict]:
  names = eight_devices.selected_cases(request, __name__, {})
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=[] if n in SHARDED_DEFAULT else EXHAUSTIVE) for n in SHARDED]
)
def test_sharded_equals_one_device(sharded_results, name):
  """Tokens over data axes and the vocabulary over model axes (Megatron's vocab-parallel head:
  each device's sum and entropy moment rescaled to the global max and summed), Explicit and Auto
  axes, a (D, V) kernel and a (V, D) table: both outputs and every gradient as on one device; no
  collective moves a block of logits, and over an Explicit vocabulary split none moves an array
  of the whole vocabulary (256): per-token numbers, dx and each device's columns of dw, db."""
  result = eight_devices.get(sharded_results, name, SCRIPT)
  for key in ("value_err", "log_probs_err", "entropy_err", "grad_err"):
    assert result[key] < 1e-5, (key, result[key])
  shapes = result["collective_shapes"]
  # (tokens, columns) of a device: never moved (dx is (tokens, 24))
  assert not [s for s in shapes if re.fullmatch(r"f32\[(4|16|32),(?!24\])\d+\]", s)], shapes
  _, axes, auto, _ = SHARDED[name]
  if "model" in axes and not auto:  # only per-token numbers, dx and a device's columns move
    assert not [s for s in shapes if "256" in s], shapes
  if axes == ("data", "model") and not auto:
    assert result["grad_specs"] == [
      "P('data', None)",
      "P(None, 'model')",
      "P('model',)",
    ]


if __name__ == "__main__":
  eight_devices.run_cases({n: functools.partial(sharded_case, n) for n in SHARDED}, sys.argv[1:])


def test_certain_tokens_under_jit_never_get_a_positive_log_probability():
  """Logits of order 1e7 with a temperature, under jit: XLA may fuse the division into two kernels
  that round one logit a unit apart, which once gave log p(argmax) = +0.375. log p <= 0 and the
  entropy >= 0 hold whatever the rounding."""
  k = jax.random.split(jax.random.key(11), 3)
  x = jax.random.normal(k[0], (32, 16), jnp.float32) * 3e6
  w = jax.random.normal(k[1], (16, 96), jnp.float32)
  b = jax.random.normal(k[2], (96,), jnp.float32)
  certain = jnp.argmax(x @ w + b, -1)
  for temperature in (0.8, 1.3):
    f = jax.jit(
      lambda x, w, b, t=temperature: jaxact.linear_log_probs(
        x, w, certain, bias=b, temperature=t, return_entropy=True
      )
    )
    logp, entropy = f(x, w, b)
    assert float(jnp.max(logp)) <= 0.0 and float(jnp.min(entropy)) >= 0.0
