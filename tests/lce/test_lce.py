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
from jaxact._src.lce import plan as lce_plan
from jaxact._src.lce import vjp as lce_vjp

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


# "bias" and "none" alone under -m exhaustive: the combinations have both.
@pytest.mark.sample(
  1, "where", "sum", "smoothing", "z_loss", "soft_cap", "all-mean", "all-sum", "all-none"
)
@pytest.mark.parametrize("name", OPTIONS)
def test_float64_matches_autodiff_of_the_composition(name):
  (v, grads), (v_ref, grads_ref) = _both(OPTIONS[name])
  assert v.dtype == jnp.float64
  assert rel_err(v, v_ref) < 1e-12
  for what, g, g_ref in zip(("dx", "dw", "db"), grads, grads_ref, strict=True):
    if OPTIONS[name].get("bias") or what != "db":
      assert rel_err(g, g_ref) < 1e-12, what


@pytest.mark.sample(2)
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
  by_tokens = lce_plan.LcePlan(block=5, by="tokens", **opts)

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


@pytest.mark.sample(1)
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
  # Each transformation compiled whole (op by op, the eager references cost seconds).
  g = jax.jit(jax.grad(jax.checkpoint(ours), (0, 1)))(x, w)
  for a, r in zip(g, jax.jit(jax.grad(theirs, (0, 1)))(x, w), strict=True):
    assert rel_err(a, r) < 1e-12
  # vmap over a leading batch of x (the same w) and over a stack of w
  xs = jnp.stack([x, 2 * x])
  both = [jax.jit(jax.vmap(f, (0, None)))(xs, w) for f in (ours, theirs)]
  assert rel_err(*both) < 1e-12
  ws = jnp.stack([w, -w])
  both = [jax.jit(jax.vmap(jax.grad(f, 1), (None, 0)))(x, ws) for f in (ours, theirs)]
  assert rel_err(*both) < 1e-12

  # scan over micro-batches, as gradient accumulation does
  def scanned(f):
    def total(w):
      return jax.lax.scan(lambda c, xi: (c + f(xi, w), None), 0.0, xs)[0]

    return jax.jit(jax.grad(total))(w)

  assert rel_err(scanned(ours), scanned(theirs)) < 1e-12

  # grad of grad: a Hessian-vector product in x
  v = jnp.ones_like(x)

  def hvp(f):
    return jax.jit(jax.grad(lambda x: jnp.vdot(jax.grad(f)(x, w), v)))(x)

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
def test_the_pullback_keeps_x_w_bias_labels_and_two_numbers_a_token(masked):
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
  assert len(per_token) == 2  # each row's largest logit and its sum of exponentials
  z = x @ w + b
  top = jnp.max(z, axis=-1)
  m, se = sorted(per_token, key=lambda k: float(jnp.max(jnp.abs(k - top))))
  np.testing.assert_allclose(m, top, rtol=1e-6)
  np.testing.assert_allclose(se, jnp.sum(jnp.exp(z - top[:, None]), axis=-1), rtol=1e-5)
  # and the labels, the mask: 4 + 1 bytes a token; the count of a mean's tokens: one number
  kept_bytes = x.nbytes + w.nbytes + b.nbytes + (4 + 4 + 4 + masked) * 32 + 4
  assert sum(k.nbytes for k in kept) <= kept_bytes


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

  block = lce_plan.default_block(t, v)
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


@pytest.mark.sample(1)
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


# ------------------------------------------------------------------ labels of every int dtype

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.sample(1, "int16", "uint16", "uint32", "int64", "uint64")
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_labels_of_every_integer_dtype_are_their_values(dtype):
  """V = 70000 is beyond int8/uint8/int16/uint16: each dtype's labels give the loss of the values
  they hold (the old clip to [-1, V] in the labels' own dtype wrapped -1 and V); under jit, -1
  and values >= V are +inf, never another token's loss."""
  v = 70000
  info = np.iinfo(dtype)
  held = [0, 1, min(info.max, 300), min(info.max, v - 1), min(int(info.max) // 3, v - 2), 7]
  x, w, _, _, _ = inputs(t=6, d=4, v=v)
  labels = np.asarray(held, dtype)
  got = jaxact.linear_cross_entropy(x, w, labels, reduction="none")
  want = reference(x, w, jnp.asarray(held, jnp.int32), reduction="none")
  assert rel_err(got, want) < 1e-12
  bad = [v] if info.max >= v else []
  bad += [-1] if info.min < 0 else []
  bad += [int(info.max)] if info.max >= v else []
  if bad:
    labels = np.asarray(bad + held[: 6 - len(bad)], dtype)
    got = jax.jit(functools.partial(jaxact.linear_cross_entropy, reduction="none"))(x, w, labels)
    assert np.all(np.asarray(got)[: len(bad)] == np.inf)
    assert np.all(np.isfinite(np.asarray(got)[len(bad) :]))
    with pytest.raises(ValueError, match=_FN + r"`labels` holds"):
      jaxact.linear_cross_entropy(x, w, labels)


# ---------------------------------------------------------------------------- D = 0, NaN in x


def test_no_features_gives_log_v():
  """x of shape (..., 0): every logit is the bias (0 without one), as the composition gives."""
  _, _, b, labels, _ = inputs()
  x, w = jnp.zeros((T, 0)), jnp.zeros((0, V))
  assert rel_err(jaxact.linear_cross_entropy(x, w, labels), np.log(V)) < 1e-12
  f = functools.partial(jaxact.linear_cross_entropy, labels=labels, z_loss=1e-3)
  value, (dx, dw, db) = jax.jit(jax.value_and_grad(lambda x, w, b: f(x, w, bias=b), (0, 1, 2)))(
    x, w, b
  )
  v_ref, (_, _, db_ref) = jax.jit(
    jax.value_and_grad(lambda x, w, b: reference(x, w, labels, bias=b, z_loss=1e-3), (0, 1, 2))
  )(x, w, b)
  assert rel_err(value, v_ref) < 1e-12 and rel_err(db, db_ref) < 1e-12
  assert dx.shape == (T, 0) and dw.shape == (0, V)


def test_nan_in_x_gives_nan_not_the_out_of_range_signal():
  x, w, _, labels, _ = inputs(jnp.float32)
  x = x.at[2, 3].set(jnp.nan)
  none = functools.partial(jaxact.linear_cross_entropy, reduction="none")
  for run in (none, jax.jit(none)):
    per_token = np.asarray(run(x, w, labels))
    assert np.isnan(per_token[2]) and np.all(np.isfinite(np.delete(per_token, 2)))
  assert np.isnan(jaxact.linear_cross_entropy(x, w, labels))
  # masked out, it is gone (numpy's where); an impossible label stays +inf
  where = jnp.arange(T) != 2
  assert np.isfinite(jaxact.linear_cross_entropy(x, w, labels, where=where))
  bad = jax.jit(functools.partial(jaxact.linear_cross_entropy, reduction="none"))(
    x, w, labels.at[0].set(V)
  )
  assert bad[0] == np.inf


# --------------------------------------------------------------------------------- predictions


def _capped_logits(x, w, b=None, cap=None):
  z = x @ w + (0 if b is None else b)
  return z if cap is None else cap * jnp.tanh(z / cap)


@pytest.mark.parametrize("cap", [None, 0.05], ids=["no_cap", "cap"])
def test_predictions_are_the_argmax_of_the_logits_from_the_same_pass(cap):
  """Ties across blocks (columns 20 and 60, blocks of 16 with an overlapping last one) go to the
  first column, as jnp.argmax; with a cap of 0.05 the logits above ~1 saturate to 0.05 exactly,
  and the prediction is the first of them, not the argmax of the uncapped logits."""
  x, w, b, labels, where = inputs(scale=3.0)
  w = w.at[:, 60].set(w[:, 20])
  b = b.at[20].set(4.0).at[60].set(4.0)
  kw = dict(bias=b, where=where, logit_soft_cap=cap, label_smoothing=0.1, vocab_block_size=BLOCK)

  def ours(x, w):
    return jaxact.linear_cross_entropy(x, w, labels, return_predictions=True, **kw)

  (value, predictions), grads = jax.value_and_grad(ours, (0, 1), has_aux=True)(x, w)
  want = jnp.argmax(_capped_logits(x, w, b, cap), axis=-1)
  assert predictions.dtype == jnp.int32 and predictions.shape == labels.shape
  np.testing.assert_array_equal(predictions, want)
  assert cap is not None or np.any(want == 20)  # a tie with column 60
  assert (cap is None) == np.array_equal(want, jnp.argmax(x @ w + b, -1))
  kw.pop("vocab_block_size")
  v_ref, g_ref = jax.value_and_grad(lambda x, w: reference(x, w, labels, **kw), (0, 1))(x, w)
  assert rel_err(value, v_ref) < 1e-12
  for g, r in zip(grads, g_ref, strict=True):
    assert rel_err(g, r) < 1e-12
  # by the token-blocked loop, and for a NaN row (jnp.argmax: the first NaN)
  by_tokens = lce_plan.LcePlan(block=5, by="tokens", predictions=True, soft_cap=cap)
  x_nan, w32 = x.at[4, 0].set(jnp.nan).astype(jnp.float32), w.astype(jnp.float32)
  _, pred_t = lce_vjp.per_token_loss(by_tokens, x_nan, w32, None, labels)
  logits = _capped_logits(x_nan, w32, None, cap)
  assert pred_t[4] == jnp.argmax(logits[4])  # the first NaN
  # Elsewhere the largest logit: in float32 two programs may round a saturated cap's ties apart.
  rows = np.arange(len(labels)) != 4
  chosen = jnp.take_along_axis(logits, pred_t[:, None], -1)[:, 0]
  np.testing.assert_allclose(chosen[rows], logits.max(-1)[rows], rtol=1e-6)


def test_predictions_under_jit_vmap_and_reductions():
  x, w, _, labels, _ = inputs(t=12)
  xs, ls = x.reshape(3, 4, D), labels[:12].reshape(3, 4)
  f = functools.partial(jaxact.linear_cross_entropy, return_predictions=True, vocab_block_size=20)
  loss, pred = jax.jit(jax.vmap(f, (0, None, 0)))(xs, w, ls)
  assert loss.shape == (3,) and pred.shape == (3, 4)
  np.testing.assert_array_equal(pred, jnp.argmax(xs @ w, -1))
  loss, pred = f(xs, w, ls, reduction="none")
  assert loss.shape == pred.shape == (3, 4)
  loss, pred = f(jnp.zeros((0, D)), w, jnp.zeros((0,), jnp.int8))
  assert loss == 0 and pred.shape == (0,) and pred.dtype == jnp.int32


# ------------------------------------------------------------------------------------- weights


def _weighted_reference(x, w, labels, weights, *, where=None, reduction="mean", **kw):
  """T5X's / flax examples/gemma's weighted loss: per-token loss times weight, over the sum of
  the weights."""
  loss = reference(x, w, labels, reduction="none", **kw) * weights
  if where is not None:
    loss, weights = jnp.where(where, loss, 0), jnp.where(where, weights, 0)
  if reduction == "none":
    return loss
  return jnp.sum(loss) / (jnp.sum(weights) if reduction == "mean" else 1)


@pytest.mark.sample(2)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_weights_scale_each_token_and_the_mean_divides_by_their_sum(reduction):
  x, w, b, labels, where = inputs()
  weights = jnp.asarray(np.random.default_rng(3).uniform(0, 2, size=(T,)))
  kw = dict(bias=b, where=where, reduction=reduction, z_loss=1e-3, label_smoothing=0.1)

  def ours(x, w, weights):
    return jaxact.linear_cross_entropy(x, w, labels, weights=weights, vocab_block_size=BLOCK, **kw)

  def theirs(x, w, weights):
    return _weighted_reference(x, w, labels, weights, **kw)

  ct = jnp.arange(T, dtype=jnp.float64) if reduction == "none" else 1.0
  v, pull = jax.vjp(ours, x, w, weights)
  v_ref, pull_ref = jax.vjp(theirs, x, w, weights)
  assert rel_err(v, v_ref) < 1e-12
  for g, r in zip(pull(ct * jnp.ones_like(v)), pull_ref(ct * jnp.ones_like(v_ref)), strict=True):
    assert rel_err(g, r) < 1e-12  # dx, dw and d weights


def test_zero_weights_drop_impossible_tokens_and_broadcast():
  x, w, _, labels, _ = inputs(jnp.float32)
  padded = labels.at[:3].set(-100)
  weights = (padded >= 0).astype(jnp.float32)  # train.py's weights: the padding mask
  f = jax.jit(
    jax.value_and_grad(
      lambda x, w: jaxact.linear_cross_entropy(x, w, padded, weights=weights), (0, 1)
    )
  )
  value, (dx, dw) = f(x, w)
  want = reference(x, w, jnp.maximum(padded, 0), where=padded >= 0)
  assert rel_err(value, want) < 1e-5 and np.all(np.isfinite(dw)) and np.all(dx[:3] == 0)
  # concrete: the zero-weight labels raise nothing (the check runs before any computation)
  with pytest.raises(ValueError, match=r"`labels` holds 3 value"):
    jaxact.linear_cross_entropy(x, w, padded)
  jaxact.linear_cross_entropy(x, w, padded, weights=weights)
  # a row of weights broadcasts; all-zero weights give 0
  x3, l3 = x[:12].reshape(3, 4, D), labels[:12].reshape(3, 4)
  row = jnp.array([1.0, 0.0, 2.0, 1.0], jnp.float32)

  @jax.jit
  def both(x3, w, zeros):
    return (
      jaxact.linear_cross_entropy(x3, w, l3, weights=row),
      jaxact.linear_cross_entropy(x, w, labels, weights=zeros),
    )

  got, zero = both(x3, w, jnp.zeros((T,), jnp.float32))
  assert rel_err(got, _weighted_reference(x3, w, l3, jnp.broadcast_to(row, (3, 4)))) < 1e-5
  assert zero == 0


# ------------------------------------------------------------------------ T5X label smoothing


def _t5x_reference(x, w, labels, alpha, *, bias=None, z_loss=0.0, weights=None):
  """T5X's compute_weighted_cross_entropy written out (soft targets, its normalizing constant;
  xlogy for 0 log 0 at alpha = 1), summed and divided by the weight sum as flax's train.py does."""
  z = x @ w + (0 if bias is None else bias)
  v = w.shape[1]
  confidence, low = 1.0 - alpha, alpha / (v - 1)
  constant = -(
    jax.scipy.special.xlogy(confidence, confidence)
    + (v - 1) * jax.scipy.special.xlogy(low, low + 1e-20)
  )
  targets = jnp.where(jax.nn.one_hot(labels, v) > 0, confidence, low)
  lse = jax.nn.logsumexp(z, axis=-1)
  loss = -jnp.sum(targets * (z - lse[:, None]), axis=-1) + z_loss * lse**2 - constant
  weights = jnp.ones_like(loss) if weights is None else weights
  return jnp.sum(loss * weights) / jnp.sum(weights)


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_t5x_label_smoothing_is_t5xs_loss(alpha):
  x, w, b, labels, _ = inputs()
  weights = jnp.asarray(np.random.default_rng(4).uniform(0, 1, size=(T,)))
  kw = dict(bias=b, z_loss=1e-3, weights=weights)

  def ours(x, w, b):
    return jaxact.linear_cross_entropy(
      x, w, labels, label_smoothing=alpha, label_smoothing_style="t5x", vocab_block_size=BLOCK, **kw
    )

  v, grads = jax.value_and_grad(ours, (0, 1, 2))(x, w, b)
  v_ref, g_ref = jax.value_and_grad(
    lambda x, w, b: _t5x_reference(x, w, labels, alpha, **kw), (0, 1, 2)
  )(x, w, b)
  assert rel_err(v, v_ref) < 1e-12
  for g, r in zip(grads, g_ref, strict=True):
    assert rel_err(g, r) < 1e-12
  # not optax's: T5X's loss is lower by about its constant
  optax_style = jaxact.linear_cross_entropy(x, w, labels, label_smoothing=alpha, **kw)
  assert float(optax_style - v) > 0.5


def test_t5x_smoothing_needs_another_class():
  x, w, _, labels, _ = inputs(jnp.float32)
  with pytest.raises(ValueError, match=_FN + r"`label_smoothing` 0\.1 with .*'t5x'.*V = 1"):
    jaxact.linear_cross_entropy(
      x, w[:, :1], labels * 0, label_smoothing=0.1, label_smoothing_style="t5x"
    )
  # V = 1 without smoothing is fine: loss 0
  assert jaxact.linear_cross_entropy(x, w[:, :1], labels * 0, label_smoothing_style="t5x") == 0


# ---------------------------------------------------------------------- tables as (V, D): "vd"


def test_vd_layout_slices_the_table_rows():
  """w_layout="vd" on the table (V, D) equals the head (D, V) = table.T: values, predictions and
  the gradients (d table in the table's layout), with overlapping blocks."""
  x, w, b, labels, where = inputs()
  table = jnp.asarray(np.asarray(w).T.copy())
  kw = dict(bias=b, where=where, label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=3.0)

  def ours(x, table, b):
    return jaxact.linear_cross_entropy(
      x,
      table,
      labels,
      **{**kw, "bias": b},
      w_layout="vd",
      vocab_block_size=BLOCK,
      return_predictions=True,
    )

  (v, pred), grads = jax.value_and_grad(ours, (0, 1, 2), has_aux=True)(x, table, b)
  v_ref, (gx, gw, gb) = jax.value_and_grad(
    lambda x, w, b: reference(x, w, labels, **{**kw, "bias": b}), (0, 1, 2)
  )(x, w, b)
  assert rel_err(v, v_ref) < 1e-12
  np.testing.assert_array_equal(pred, jnp.argmax(_capped_logits(x, w, b, 3.0), -1))
  for g, r in zip(grads, (gx, gw.T, gb), strict=True):
    assert rel_err(g, r) < 1e-12


def test_new_options_bad_input():
  x, w, _, labels, _ = inputs(jnp.float32)
  cases = [
    (dict(label_smoothing_style="T5X"), ValueError, r"`label_smoothing_style` 'T5X' is not known"),
    (dict(w_layout="dv2"), ValueError, r"`w_layout` 'dv2' is not known"),
    (dict(return_predictions=1), TypeError, r"`return_predictions` must be a Python bool"),
    (dict(weights=jnp.ones((T + 1,))), ValueError, r"`weights` has shape \(14,\)"),
    (dict(weights=jnp.ones((T,), jnp.complex64)), TypeError, r"`weights` has complex dtype"),
    (dict(w_layout="vd"), ValueError, r"`x` has 8 features but `w` expects 67 .*w_layout='vd'"),
  ]
  for kw, error, match in cases:
    with pytest.raises(error, match=_FN + match):
      jaxact.linear_cross_entropy(x, w, labels, **kw)
