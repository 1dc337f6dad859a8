"""jaxact.linear_cross_entropy against JAX's autodiff of the plain composition (tests/lce_cases.py).

Values and the gradients in x, w and bias, for each option and their combinations, in float64 to
1e-12; float32 against float64; half precision against float32; the transformations; what the
pullback keeps and what the compiled step holds; the NaN cases; the errors.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxact
from jaxact._src import lce_vjp

from lce_cases import BLOCK, D, T, V, inputs, reference, rel_err

# Each option alone, and together under each reduction.
OPTIONS = {
  "plain": {},
  "bias": {"bias": True},
  "where": {"where": True},
  "sum": {"reduction": "sum"},
  "none": {"reduction": "none"},
  "smoothing": {"label_smoothing": 0.1},
  "z_loss": {"z_loss": 1e-3},
  "soft_cap": {"logit_soft_cap": 2.0},
  "all-mean": {
    "bias": True,
    "where": True,
    "label_smoothing": 0.2,
    "z_loss": 1e-2,
    "logit_soft_cap": 3.0,
  },
  "all-sum": {
    "bias": True,
    "where": True,
    "reduction": "sum",
    "label_smoothing": 0.2,
    "z_loss": 1e-2,
    "logit_soft_cap": 3.0,
  },
  "all-none": {
    "bias": True,
    "where": True,
    "reduction": "none",
    "label_smoothing": 0.2,
    "z_loss": 1e-2,
    "logit_soft_cap": 3.0,
  },
}


def _kwargs(opts, b, where):
  kw = dict(opts)
  kw["bias"] = b if opts.get("bias") else None
  kw["where"] = where if opts.get("where") else None
  return kw


def _both(opts, dtype=jnp.float64, scale=3.0, block=BLOCK, **extra):
  """``(ours, theirs)``: each ``(value, (dx, dw, db))`` under a per-token cotangent for "none"."""
  x, w, b, labels, where = inputs(dtype, scale=scale)
  kw = _kwargs(opts, b, where)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=(T,)), jnp.promote_types(dtype, "float32"))

  def run(f):
    def loss(x, w, b):
      return f(x, w, labels, **{**kw, "bias": b if kw["bias"] is not None else None})

    value, pull = jax.vjp(loss, x, w, b)
    return value, pull(ct if value.ndim else jnp.ones_like(value))

  ours = run(functools.partial(jaxact.linear_cross_entropy, vocab_block_size=block, **extra))
  return ours, run(reference)


@pytest.mark.parametrize("name", OPTIONS)
def test_float64_matches_autodiff_of_the_composition(name):
  (v, grads), (v_ref, grads_ref) = _both(OPTIONS[name])
  assert v.dtype == jnp.float64
  assert rel_err(v, v_ref) < 1e-12
  for what, g, g_ref in zip(("dx", "dw", "db"), grads, grads_ref, strict=True):
    if OPTIONS[name].get("bias") or what != "db":
      assert rel_err(g, g_ref) < 1e-12, what


@pytest.mark.parametrize("block", [1, 7, V, 4096], ids=lambda b: f"block{b}")
def test_every_block_size_gives_the_same_result(block):
  (v, grads), (v_ref, grads_ref) = _both(OPTIONS["all-none"], block=block)
  assert rel_err(v, v_ref) < 1e-12
  for g, g_ref in zip(grads, grads_ref, strict=True):
    assert rel_err(g, g_ref) < 1e-12


def test_blocking_over_tokens_matches():
  """The token-blocked variant the benchmarks compare (blocks of 5 rows of 13: overlapping)."""
  x, w, b, labels, _ = inputs()
  opts = dict(label_smoothing=0.1, z_loss=1e-3, soft_cap=3.0, acc_dtype=np.dtype(np.float64))
  by_tokens = lce_vjp.LcePlan(block=5, by="tokens", **opts)

  def ours(x, w, b):
    return jnp.sum(lce_vjp.per_token_loss(by_tokens, x, w, b, labels) * jnp.arange(T))

  def theirs(x, w, b):
    loss = reference(
      x, w, labels, bias=b, reduction="none", label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=3.0
    )
    return jnp.sum(loss * jnp.arange(T))

  assert rel_err(ours(x, w, b), theirs(x, w, b)) < 1e-12
  grads = jax.grad(ours, (0, 1, 2))(x, w, b)
  for g, g_ref in zip(grads, jax.grad(theirs, (0, 1, 2))(x, w, b), strict=True):
    assert rel_err(g, g_ref) < 1e-12


def test_float32_loss_within_1e5_of_float64():
  (v32, g32), _ = _both(OPTIONS["all-mean"], jnp.float32)
  (v64, g64), _ = _both(OPTIONS["all-mean"], jnp.float64)
  assert v32.dtype == jnp.float32
  assert rel_err(v32, v64) < 1e-5
  for g, g_ref in zip(g32, g64, strict=True):
    assert rel_err(g, g_ref) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: np.dtype(d).name)
def test_half_precision_against_float32_of_the_same_inputs(dtype):
  """Half precision inputs give a float32 loss within 1e-2 of float32's on the same (rounded)
  inputs, gradients in their own dtype within a few of its ulps."""
  x, w, b, labels, where = inputs(jnp.float32, t=64, v=300, scale=4.0)
  half = [a.astype(dtype) for a in (x, w, b)]
  up = [a.astype(jnp.float32) for a in half]
  kw = dict(where=where, label_smoothing=0.1, z_loss=1e-3, vocab_block_size=64)

  def f(x, w, b):
    return jaxact.linear_cross_entropy(x, w, labels, bias=b, **kw)

  v, grads = jax.value_and_grad(f, (0, 1, 2))(*half)
  v_ref, grads_ref = jax.value_and_grad(f, (0, 1, 2))(*up)
  assert v.dtype == jnp.float32 and [g.dtype for g in grads] == [dtype] * 3
  assert rel_err(v, v_ref) < 1e-2
  for g, g_ref in zip(grads, grads_ref, strict=True):
    assert rel_err(g, g_ref) < 4 * float(jnp.finfo(dtype).eps)


def test_check_grads():
  x, w, b, labels, where = inputs(t=5, d=3, v=11)
  kw = dict(
    where=where[:5], label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=2.0, vocab_block_size=4
  )

  def f(x, w, b):
    return jaxact.linear_cross_entropy(x, w, labels[:5] % 11, bias=b, **kw)

  check_grads(f, (x, w, b), order=1, modes=["rev"])


def test_jit_vmap_remat_scan_and_grad_of_grad():
  x, w, b, labels, _ = inputs()
  kw = dict(bias=b, label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=3.0)

  def ours(x, w):
    return jaxact.linear_cross_entropy(x, w, labels, vocab_block_size=BLOCK, **kw)

  def theirs(x, w):
    return reference(x, w, labels, **kw)

  # jit, remat
  assert rel_err(jax.jit(ours)(x, w), theirs(x, w)) < 1e-12
  g = jax.grad(jax.checkpoint(ours), (0, 1))(x, w)
  for a, r in zip(g, jax.grad(theirs, (0, 1))(x, w), strict=True):
    assert rel_err(a, r) < 1e-12
  # vmap over a leading batch of x (the same w) and over a stack of w
  xs = jnp.stack([x, 2 * x])
  assert rel_err(jax.vmap(ours, (0, None))(xs, w), jax.vmap(theirs, (0, None))(xs, w)) < 1e-12
  ws = jnp.stack([w, -w])
  gw = jax.vmap(jax.grad(ours, 1), (None, 0))(x, ws)
  assert rel_err(gw, jax.vmap(jax.grad(theirs, 1), (None, 0))(x, ws)) < 1e-12

  # scan over micro-batches, as gradient accumulation does
  def scanned(f):
    def total(w):
      return jax.lax.scan(lambda c, xi: (c + f(xi, w), None), 0.0, xs)[0]

    return jax.grad(total)(w)

  assert rel_err(scanned(ours), scanned(theirs)) < 1e-12

  # grad of grad: a Hessian-vector product in x
  v = jnp.ones_like(x)

  def hvp(f):
    return jax.grad(lambda x: jnp.vdot(jax.grad(f)(x, w), v))(x)

  assert rel_err(hvp(ours), hvp(theirs)) < 1e-10


def test_batch_dims_and_cotangent_per_token():
  """``x`` (2, 3, D) with labels (2, 3); reduction="none" under an arbitrary cotangent."""
  x, w, b, labels, where = inputs(t=6)
  x3, l3, wh3 = x.reshape(2, 3, D), labels[:6].reshape(2, 3), where[:6].reshape(2, 3)
  kw = dict(bias=b, where=wh3, reduction="none", z_loss=1e-3)
  ct = jnp.arange(6.0).reshape(2, 3) - 2.5
  out, pull = jax.vjp(lambda x, w: jaxact.linear_cross_entropy(x, w, l3, **kw), x3, w)
  ref, pull_ref = jax.vjp(lambda x, w: reference(x, w, l3, **kw), x3, w)
  assert out.shape == (2, 3) and rel_err(out, ref) < 1e-12
  assert np.all(np.asarray(out)[~np.asarray(wh3)] == 0)
  for a, r in zip(pull(ct), pull_ref(ct), strict=True):
    assert rel_err(a, r) < 1e-12


def test_where_broadcasts_as_numpy():
  x, w, _, labels, _ = inputs(t=6)
  x3, l3 = x.reshape(2, 3, D), labels[:6].reshape(2, 3)
  row = jnp.array([True, False, True])
  got = jaxact.linear_cross_entropy(x3, w, l3, where=row)
  assert rel_err(got, reference(x3, w, l3, where=jnp.broadcast_to(row, (2, 3)))) < 1e-12


# ------------------------------------------------------------------------------ what it keeps


@pytest.mark.parametrize("masked", [False, True], ids=["all", "where"])
def test_the_pullback_keeps_x_w_bias_labels_and_one_lse_a_token(masked):
  x, w, b, labels, where = inputs(jnp.float32, t=32, v=300)
  f = functools.partial(
    jaxact.linear_cross_entropy, labels=labels, where=where if masked else None, z_loss=1e-3
  )
  _, pull = jax.vjp(lambda x, w, b: f(x, w, bias=b), x, w, b)
  kept = jax.tree.leaves(pull)
  vocab_sized = [k for k in kept if 300 in k.shape]
  assert sorted(k.shape for k in vocab_sized) == [(8, 300), (300,)]  # w and bias, nothing else
  assert any(k is w for k in kept) and any(k is x for k in kept)
  per_token = [k for k in kept if k.shape == (32,) and k.dtype == jnp.float32]
  assert len(per_token) == 1
  np.testing.assert_allclose(per_token[0], jax.nn.logsumexp(x @ w + b, axis=-1), rtol=1e-5)
  # and the labels, the mask: 4 + 1 bytes a token; the count of a mean's tokens: one number
  assert sum(k.nbytes for k in kept) <= x.nbytes + w.nbytes + b.nbytes + (4 + 4 + masked) * 32 + 4


def _largest_arrays(compiled) -> list[tuple[int, str]]:
  shapes = re.findall(r"\b(?:f32|f64|bf16|f16)\[([\d,]+)\]", compiled.as_text())
  sizes = {s: int(np.prod([int(d) for d in s.split(",")])) for s in set(shapes)}
  return sorted(((n, s) for s, n in sizes.items()), reverse=True)


def test_the_compiled_step_holds_no_tokens_by_vocabulary_array():
  """Every array in the compiled gradient is at most one block of logits (or the weights);
  the plain composition's holds (T, V) logits, so the check can fail."""
  t, d, v = 512, 16, 4096
  x, w, b, labels, _ = inputs(jnp.float32, t=t, d=d, v=v)

  def ours(x, w, b):
    return jaxact.linear_cross_entropy(x, w, labels, bias=b, label_smoothing=0.1)

  def theirs(x, w, b):
    return reference(x, w, labels, bias=b, label_smoothing=0.1)

  block = lce_vjp.default_block(t, v)
  assert block <= v // 8
  ours_c = jax.jit(jax.grad(ours, (0, 1, 2))).lower(x, w, b).compile()
  theirs_c = jax.jit(jax.grad(theirs, (0, 1, 2))).lower(x, w, b).compile()
  assert _largest_arrays(ours_c)[0][0] <= max(t * block, d * v)
  assert _largest_arrays(theirs_c)[0][0] >= t * v
  temp = ours_c.memory_analysis().temp_size_in_bytes
  assert temp <= 0.25 * theirs_c.memory_analysis().temp_size_in_bytes


# -------------------------------------------------------------------------------------- NaN


def _finite_value_and_grads(f, *args):
  value, grads = jax.jit(jax.value_and_grad(f, tuple(range(len(args)))))(*args)
  assert np.isfinite(value), value
  for g in grads:
    assert np.all(np.isfinite(g)), g
  return value, grads


@pytest.mark.parametrize("cap", [None, 2.0], ids=["no_cap", "cap"])
def test_masked_vocabulary_is_the_smaller_vocabulary(cap):
  """Columns with a bias of -inf: finite loss and gradients, zero gradients in those columns,
  and the loss of the vocabulary without them (no smoothing)."""
  x, w, b, labels, _ = inputs()
  masked = np.zeros(V, bool)
  masked[::3] = True
  masked[np.asarray(labels)] = False
  b_masked = jnp.where(masked, -jnp.inf, b)
  kw = dict(z_loss=1e-3, logit_soft_cap=cap, vocab_block_size=BLOCK)

  def f(x, w, b):
    return jaxact.linear_cross_entropy(x, w, labels, bias=b, **kw)

  value, (_, dw, db) = _finite_value_and_grads(f, x, w, b_masked)
  assert np.all(np.asarray(dw)[:, masked] == 0) and np.all(np.asarray(db)[masked] == 0)
  keep = ~masked
  small = jnp.searchsorted(jnp.flatnonzero(keep), labels)
  want = reference(x, w[:, keep], small, bias=b[keep], z_loss=1e-3, logit_soft_cap=cap)  # optax
  assert rel_err(value, want) < 1e-12
  # with smoothing too: the reference's smoothing mean over the finite logits
  smooth = jaxact.linear_cross_entropy(x, w, labels, bias=b_masked, label_smoothing=0.3, **kw)
  kw.pop("vocab_block_size")
  want = reference(x, w, labels, bias=b_masked, label_smoothing=0.3, masked=True, **kw)
  assert rel_err(smooth, want) < 1e-12


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_huge_finite_logits_do_not_overflow(dtype):
  x, w, _, labels, _ = inputs(jnp.float32)
  x = (x * 1e18).astype(dtype)
  w = (w * 1e18).astype(dtype)  # logits of order 1e36 (float32's max is 3.4e38)
  f = functools.partial(
    jaxact.linear_cross_entropy, labels=labels, label_smoothing=0.1, vocab_block_size=BLOCK
  )
  value, _ = _finite_value_and_grads(lambda x, w: f(x, w), x, w)
  want = reference(x.astype(jnp.float64), w.astype(jnp.float64), labels, label_smoothing=0.1)
  assert rel_err(value, want) < 1e-2


def test_all_masked_batch_is_zero_with_zero_gradients():
  x, w, b, labels, _ = inputs(jnp.float32)
  none = jnp.zeros((T,), bool)
  for reduction in ("mean", "sum"):

    def f(x, w, b, reduction=reduction):
      return jaxact.linear_cross_entropy(x, w, labels, bias=b, where=none, reduction=reduction)

    value, grads = _finite_value_and_grads(f, x, w, b)
    assert value == 0 and all(np.all(g == 0) for g in grads)


def test_rows_with_no_finite_logit_and_labels_out_of_range():
  """Under jit: a counted token whose label is out of range, or whose logits are all -inf, has
  loss +inf and finite gradients; masked by `where`, loss 0 and zero gradients. Never NaN."""
  x, w, b, labels, _ = inputs(jnp.float32, t=4)
  bad = labels.at[0].set(-100).at[1].set(V)
  b_all = jnp.full((V,), -jnp.inf, jnp.float32)

  @jax.jit
  def run(x, w, b, labels, where):
    return jax.value_and_grad(
      lambda x, w, b: jaxact.linear_cross_entropy(
        x, w, labels, bias=b, where=where, reduction="sum", label_smoothing=0.1
      ),
      (0, 1, 2),
    )(x, w, b)

  value, grads = run(x, w, b, bad, None)
  assert value == jnp.inf and all(np.all(np.isfinite(g)) for g in grads)
  value, grads = run(x, w, b, bad, bad >= 0)
  assert value == jnp.inf  # label V still counts
  value, grads = run(x, w, b, bad, (bad >= 0) & (bad < V))
  assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in grads)
  assert np.all(grads[0][:2] == 0)  # the masked tokens get no gradient
  value, grads = run(x, w, b_all, labels, None)
  assert value == jnp.inf and all(np.all(np.isfinite(g)) for g in grads)
  value, grads = run(x, w, b_all, labels, jnp.zeros((4,), bool))
  assert value == 0 and all(np.all(g == 0) for g in grads)


def test_full_smoothing_ignores_an_impossible_label():
  x, w, b, labels, _ = inputs()
  b = b.at[labels[0]].set(-jnp.inf)
  f = functools.partial(jaxact.linear_cross_entropy, labels=labels, label_smoothing=1.0)
  value, _ = _finite_value_and_grads(lambda x, b: f(x, w, bias=b), x, b)
  want = reference(x, w, labels, bias=b, label_smoothing=1.0, masked=True)
  assert rel_err(value, want) < 1e-12


def test_tied_embedding_transpose():
  x, w, _, labels, _ = inputs()
  emb = jnp.asarray(np.asarray(w).T.copy())

  def tied(emb, x):
    return jaxact.linear_cross_entropy(x, emb.T, labels)

  (g_emb, g_x) = jax.grad(tied, (0, 1))(emb, x)
  g_w, g_x2 = jax.grad(lambda w, x: reference(x, w, labels), (0, 1))(w, x)
  assert rel_err(g_emb, g_w.T) < 1e-12 and rel_err(g_x, g_x2) < 1e-12


def test_empty_token_batch():
  x = jnp.zeros((0, D))
  w = jnp.ones((D, V))
  labels = jnp.zeros((0,), jnp.int32)
  assert jaxact.linear_cross_entropy(x, w, labels) == 0
  assert jaxact.linear_cross_entropy(x, w, labels, reduction="none").shape == (0,)
  assert np.all(jax.grad(lambda w: jaxact.linear_cross_entropy(x, w, labels))(w) == 0)


# ------------------------------------------------------------------------------------ errors

_FN = r"jaxact\.linear_cross_entropy: "


@pytest.mark.parametrize(
  "change, error, match",
  [
    (dict(w=jnp.ones((D + 1, V))), ValueError, r"`x` has 8 features but `w` expects 9"),
    (dict(w=jnp.ones((D, V, 1))), ValueError, r"`w` must have rank 2"),
    (dict(w=jnp.ones((D, 0))), ValueError, r"`w` has an empty vocabulary"),
    (dict(labels=jnp.zeros((T + 1,), jnp.int32)), ValueError, r"`labels` must have x's shape"),
    (dict(labels=jnp.zeros((T,), jnp.float32)), TypeError, r"`labels` has dtype float32"),
    (dict(labels=jnp.zeros((T,), bool)), TypeError, r"`labels` has dtype bool"),
    (dict(bias=jnp.ones((V + 1,))), ValueError, r"`bias` has shape \(68,\); accepted: \(67,\)"),
    (dict(where=jnp.ones((T + 1,), bool)), ValueError, r"`where` has shape \(14,\)"),
    (dict(where=jnp.ones((T,))), TypeError, r"`where` has dtype float"),
    (dict(x=jnp.ones((T, D), jnp.int32)), TypeError, r"`x` has dtype int32"),
    (dict(x=[[1.0]]), TypeError, r"`x` must be a JAX/NumPy array.*list"),
    (dict(reduction="avg"), ValueError, r"`reduction` 'avg' is not known; choose one of: mean"),
    (dict(label_smoothing=-0.1), ValueError, r"`label_smoothing` is -0\.1; accepted: .*\[0\.0, 1"),
    (dict(label_smoothing=1.5), ValueError, r"`label_smoothing` is 1\.5"),
    (dict(z_loss=-1.0), ValueError, r"`z_loss` is -1\.0; accepted"),
    (dict(z_loss="big"), TypeError, r"`z_loss` must be a Python float; got str"),
    (dict(logit_soft_cap=0.0), ValueError, r"`logit_soft_cap` is 0\.0; accepted: .*\(0\.0"),
    (dict(logit_soft_cap=-30.0), ValueError, r"`logit_soft_cap` is -30\.0"),
    (dict(logit_soft_cap=float("inf")), ValueError, r"`logit_soft_cap` is inf"),
    (dict(vocab_block_size=0), ValueError, r"`vocab_block_size` is 0; accepted: a positive int"),
    (dict(implementation="cuda"), ValueError, r"`implementation` 'cuda' is not known"),
    (dict(implementation="pallas"), NotImplementedError, r"implementation=.pallas. has no Triton"),
  ],
  ids=lambda v: None if isinstance(v, dict) else "",
)
def test_bad_input_names_the_argument(change, error, match):
  x, w, _, labels, _ = inputs(jnp.float32)
  kw = dict(x=x, w=w, labels=labels) | change
  with pytest.raises(error, match=_FN + match):
    jaxact.linear_cross_entropy(kw.pop("x"), kw.pop("w"), kw.pop("labels"), **kw)


def test_traced_options_are_refused_with_the_reason():
  x, w, _, labels, _ = inputs(jnp.float32)
  with pytest.raises(TypeError, match=_FN + r"`z_loss` must be a static Python float"):
    jax.jit(lambda z: jaxact.linear_cross_entropy(x, w, labels, z_loss=z))(0.1)


def test_concrete_labels_out_of_range_are_a_value_error_unless_masked():
  x, w, _, labels, _ = inputs(jnp.float32)
  bad = labels.at[3].set(-100)
  with pytest.raises(
    ValueError,
    match=_FN + r"`labels` holds 1 value\(s\) outside \[0, 67\).*"
    r"labels\[3\] = -100.*where=labels >= 0",
  ):
    jaxact.linear_cross_entropy(x, w, bad)
  with pytest.raises(ValueError, match=r"labels\[4\] = 67"):
    jaxact.linear_cross_entropy(x, w, labels.at[4].set(V))
  fine = jaxact.linear_cross_entropy(x, w, bad, where=bad >= 0)
  assert rel_err(fine, reference(x, w, jnp.maximum(bad, 0), where=bad >= 0)) < 1e-5
