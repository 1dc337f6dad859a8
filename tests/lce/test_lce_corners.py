"""jaxact.linear_cross_entropy in the corners issue 44 lists for every family after attention's:
huge logits with equal maxima (one float32 log-sum-exp a token, ``m + log se``, lost ``log se``
next to logits of -1e9: the loss rounded to 0 and the backward's probabilities to 1 instead of
1/8, a silent wrong gradient), ``jax.debug_infs`` (a running max that started at -inf) and
``jax.numpy_rank_promotion("raise")`` (a bias and the label columns added by implicit rank
promotion), in the XLA path, the Hopper kernels (Mosaic GPU's interpreter) and the Flax heads.

The reference is a float64 formula of the logits written here, differentiated by JAX's autodiff,
of inputs whose logits are exact in every dtype (``x`` a scaled identity, so that each logit is one
entry of ``w``): optax's smoothed cross-entropy plus PaLM's z-loss under Gemma 2's cap, each row's
log-sum-exp and smoothing mean taken relative to its max, as float64 needs it for logits of 1e30.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxact
import jaxact.linen as jnn
import jaxact.nnx as jnnx

F64 = jnp.float64


def formula(z, labels, *, label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None):
  """The loss per token of float64 logits `z` (T, V): ``lse(s) - (1 - a) s_y - a Σ s / V + k
  lse(s)²`` over the finite ``s`` (a bias of -inf masks), ``lse = m + log Σ exp(s - m)`` with the
  row max ``m`` held constant (its derivatives cancel)."""
  s = z
  if logit_soft_cap is not None:
    s = jnp.where(z == -jnp.inf, z, logit_soft_cap * jnp.tanh(z / logit_soft_cap))
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  log_sum = jnp.log(jnp.sum(jnp.exp(s - m), axis=-1))
  finite = jnp.isfinite(s)
  v = z.shape[-1]
  # m - mean, the mean over V with masked logits counted as 0: relative to m, as lse is
  masked = v - jnp.sum(finite, -1)
  gap = jnp.sum(jnp.where(finite, m - s, 0), -1) / v + masked / v * m[:, 0]
  above_label = m[:, 0] - jnp.take_along_axis(s, labels[:, None], axis=-1)[:, 0]
  loss = log_sum + (1 - label_smoothing) * above_label + label_smoothing * gap
  return loss + z_loss * (m[:, 0] + log_sum) ** 2


def _near_equal(c: float, dtype, shape, seed: int):
  """`c` and one to three of the dtype's steps below it (ties at the maximum and just below)."""
  steps = np.random.default_rng(seed).integers(-3, 1, size=shape)
  w = jnp.full(shape, c, dtype)
  for k in range(1, 4):
    w = jnp.where(steps <= -k, jnp.nextafter(w, jnp.asarray(-jnp.inf, dtype)), w)
  return w


def _exact_inputs(c: float, dtype, form: str, *, t=6, v=24, bias=False, seed=0):
  """``x, w, bias, labels`` whose logits ``x @ w + bias`` are exact in the accumulation dtype and
  in float64: ``x`` a scaled identity (2^15 for float16, whose largest number is 65504, so that its
  logits reach 1e9), ``w`` the logits over the scale, ties at each row's maximum; a bias of zeros
  with a third of the vocabulary masked (-inf), never a label."""
  scale = 2.0**15 if dtype == jnp.float16 and abs(c) > 6e4 else 1.0
  x = jnp.asarray(np.eye(t) * scale, dtype)
  if form == "uniform":
    w = jnp.full((t, v), c / scale, dtype)
  else:
    w = _near_equal(c / scale, dtype, (t, v), seed)
  labels = jnp.asarray(np.random.default_rng(seed + 1).integers(0, v, size=t), jnp.int32)
  b = None
  if bias:
    masked = (np.arange(v) % 3 == 1) & ~np.isin(np.arange(v), np.asarray(labels))
    b = jnp.where(jnp.asarray(masked), -jnp.inf, jnp.zeros((v,), dtype))
  return x, w, b, labels


def _value_and_grads(f, x, w, b):
  """``Σ_t c_t f(...)_t`` (an uneven cotangent) and its gradients in x, w (and the bias)."""

  def total(x, w, b):
    loss = f(x, w, b).astype(F64)
    return jnp.sum(loss * jnp.cos(jnp.arange(loss.size, dtype=F64)))

  argnums = (0, 1) if b is None else (0, 1, 2)
  return jax.jit(jax.value_and_grad(total, argnums))(x, w, b)


def _check(c, dtype, form, options, *, tol, implementation=None, t=6, v=24, block=None):
  bias = options.pop("bias", False)
  x, w, b, labels = _exact_inputs(c, dtype, form, t=t, v=v, bias=bias)
  where = options.pop("where", None)

  def ours(x, w, b):
    return jaxact.linear_cross_entropy(
      x,
      w,
      labels,
      bias=b,
      where=where,
      reduction="none",
      implementation=implementation,
      vocab_block_size=block,
      **options,
    )

  def theirs(x, w, b):
    z = x @ w if b is None else x @ w + b
    loss = formula(z, labels, **options)
    return loss if where is None else jnp.where(where, loss, 0)

  value, grads = _value_and_grads(ours, x, w, b)
  as64 = [None if a is None else a.astype(F64) for a in (x, w, b)]
  want, want_grads = _value_and_grads(theirs, *as64)
  assert np.isfinite(value) and abs(value - want) <= tol * max(1.0, abs(want)), (value, want)
  # dx = G wᵀ sums terms of the logits' size to a small number: its rounding is relative to
  # Σ |G| |w|, with G = dw / the scale of x (x a scaled identity)
  g_z = np.asarray(want_grads[1], np.float64) / np.diag(np.asarray(as64[0]))[:, None]
  scale_dx = np.abs(g_z) @ np.abs(np.asarray(as64[1])).T
  for i, (got, ref) in enumerate(zip(grads, want_grads, strict=True)):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(got)), i
    atol = tol * (scale_dx if i == 0 else np.abs(ref).max())
    bad = np.abs(got - ref) > atol + tol * np.abs(ref)
    assert not bad.any(), (f"gradient {i}", got[bad][:4], ref[bad][:4])


# --------------------------------------------------------------- huge logits, equal maxima


def test_the_issue_case_eight_equal_logits_of_minus_1e9():
  """Two tokens, eight logits of -1e9 each (exact in float32): the softmax is 1/8 everywhere, so
  the loss is log 8 and dw = softmax - onehot; one float32 log-sum-exp rounded to -1e9 gave a loss
  of 0 and dw of 1 - onehot (and dx = -3.5e9 where it is 0)."""
  x = jnp.ones((2, 1), jnp.float32)
  w = jnp.full((1, 8), -1e9, jnp.float32)
  labels = jnp.array([0, 3])
  loss, (dx, dw) = jax.jit(
    jax.value_and_grad(lambda x, w: jaxact.linear_cross_entropy(x, w, labels), (0, 1))
  )(x, w)
  np.testing.assert_allclose(loss, np.log(8), rtol=1e-6)
  want = np.full((1, 8), 2 / 8 / 2) - np.isin(np.arange(8), [0, 3]) / 2  # mean over 2 tokens
  np.testing.assert_array_equal(dw, want)
  np.testing.assert_array_equal(dx, np.zeros((2, 1)))
  _check(-1e9, jnp.float32, "near-equal", dict(bias=True, where=jnp.arange(6) != 2), tol=1e-5)


# The z-loss and the cap scale with |c|: a z-loss of 1e-3 / |c| moves the gradient by 0.2%
# (1e-3 would make dw of 1e6 |x|: float16's range ends at 65504); a cap of 10 |c| keeps the capped
# logits of c's size.
OPTIONS = {
  "plain": dict(),
  "bias-masked-where": dict(bias=True, where=jnp.arange(6) % 4 != 1),
  "smoothing": dict(label_smoothing=0.1),
  "z_loss": dict(z_loss=1e-3),
  "cap": dict(logit_soft_cap=10.0),
  "all": dict(bias=True, label_smoothing=0.2, z_loss=1e-3, logit_soft_cap=10.0),
}
TOL = {jnp.float64: 1e-12, jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
SWEEP = [
  pytest.param(c, form, dtype, option, marks=pytest.mark.exhaustive)
  for c in (-1e9, 1e9, -1e30, 1e30, 2.0**23)
  for form in ("uniform", "near-equal")
  for dtype in TOL
  for option in OPTIONS
  if not (dtype == jnp.float16 and abs(c) > 2e9)  # float16 times float16 stays below 4.3e9
  # the capped logits are float32's tanh, rounded: exact ties stay ties, logits a step apart not
  if not ("logit_soft_cap" in OPTIONS[option] and form != "uniform")
  # the z-loss term overflows float32 beyond |lse| = 1.8e19 (documented)
  if not ("z_loss" in OPTIONS[option] and abs(c) > 1e19 and dtype != jnp.float64)
]


@pytest.mark.parametrize("c, form, dtype, option", SWEEP)
def test_huge_logits_with_equal_maxima_against_float64(c, form, dtype, option):
  """Values and the gradients in x, w and the bias against the float64 formula, logits of size
  |c| in every dtype and option, over blocks of 5 columns (the last overlapping)."""
  options = dict(OPTIONS[option])
  for name in ("z_loss", "logit_soft_cap"):
    if name in options:
      options[name] = options[name] * abs(c) ** (-1 if name == "z_loss" else 1)
  _check(c, dtype, form, options, tol=TOL[dtype], block=5)


@pytest.mark.parametrize("c", [pytest.param(c, marks=pytest.mark.exhaustive) for c in (-1e9, 1e30)])
def test_the_hopper_kernels_keep_the_max_and_the_sum_apart(c):
  """The same through implementation="mosaic" (Mosaic GPU's interpreter): the forward kernel's
  statistics and the backward kernel's G, bfloat16 operands, 128 tokens, V = 256 in one block."""
  options = dict(bias=True, label_smoothing=0.1, z_loss=1e-3 / abs(c) if abs(c) < 1e19 else 0.0)
  _check(c, jnp.bfloat16, "near-equal", options, tol=2e-2, implementation="mosaic", t=128, v=256)


# ---------------------------------------------------- debug_infs and rank promotion


CONTEXTS = {
  "debug_infs": lambda: jax.debug_infs(True),
  "rank_promotion": lambda: jax.numpy_rank_promotion("raise"),
}
B, S, D, V = 2, 3, 4, 20
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(B, S, D)), jnp.float32)
W = jnp.asarray(_rng.normal(size=(D, V)), jnp.float32)
LABELS = jnp.asarray(_rng.integers(0, V, size=(B, S)), jnp.int32)
CALLS = {
  "plain": dict(),
  # a bias, `where` of a broadcast shape, every loss option; blocks of 7 of 20 (the last overlaps)
  "options": dict(
    bias=jnp.linspace(-1.0, 1.0, V, dtype=jnp.float32),
    where=jnp.array([True, False, True]),
    label_smoothing=0.1,
    z_loss=1e-3,
    logit_soft_cap=5.0,
    vocab_block_size=7,
  ),
  # padding labels of -100 dropped by a weight of 0, T5X's smoothing, the sum
  "padding-weights-t5x": dict(
    labels=LABELS.at[0, 1].set(-100),
    weights=jnp.array([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]], jnp.float32),
    label_smoothing=0.1,
    label_smoothing_style="t5x",
    reduction="sum",
  ),
  "predictions-table": dict(return_predictions=True, w_layout="vd", vocab_block_size=8),
}


@pytest.mark.parametrize(
  "context, call",
  [
    (c, k)
    if (c, k) in {("debug_infs", "options"), ("rank_promotion", "predictions-table")}
    else pytest.param(c, k, marks=pytest.mark.exhaustive)
    for c in CONTEXTS
    for k in CALLS
  ],
)
def test_debug_infs_and_rank_promotion_stay_quiet(context, call):
  """The loss and its gradients of finite inputs: under jax.debug_infs run eagerly (every
  operation's output is checked then) and equal to the run without it; under rank promotion
  "raise" traced (where it raises)."""
  kw = dict(CALLS[call])
  labels = kw.pop("labels", LABELS)
  w = W.T if kw.get("w_layout") == "vd" else W

  def loss(x, w):
    out = jaxact.linear_cross_entropy(x, w, labels, **kw)
    return out if kw.get("return_predictions") else (out, None)

  step = jax.value_and_grad(loss, (0, 1), has_aux=True)
  if context == "rank_promotion":
    with CONTEXTS[context]():
      jax.make_jaxpr(step)(X, w)
    return
  want = step(X, w)
  with CONTEXTS[context]():
    got = step(X, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.all(np.isfinite(g)) or g.dtype == jnp.int32
    np.testing.assert_array_equal(g, r)


def test_the_flax_heads_promote_no_rank():
  """jaxact.linen.LMHead, jaxact.nnx.LMHead and the tied heads' attend_cross_entropy, with labels
  and without (the logits: Flax's own code), traced under rank promotion "raise" (abstract
  parameters: nothing runs)."""
  where = jnp.array([True, False, True])

  class Tied(nn.Module):
    @nn.compact
    def __call__(self, x, labels):
      embed = nn.Embed(V, D)
      return embed(labels).sum() * 0 + jnn.attend_cross_entropy(embed, x, labels, where=where)

  def nnx_grad(make, call):
    graph, state = nnx.split(nnx.eval_shape(make))
    return jax.grad(lambda state: call(nnx.merge(graph, state))), state

  head, tied = jnn.LMHead(V, label_smoothing=0.1, z_loss=1e-3), Tied()
  params = jax.eval_shape(head.init, jax.random.key(0), X)
  tied_params = jax.eval_shape(tied.init, jax.random.key(1), X, LABELS)
  steps = [
    (jax.grad(lambda p: head.apply(p, X, LABELS, where=where)), params),
    (jax.grad(lambda p: head.apply(p, X).sum()), params),
    (jax.grad(lambda p: tied.apply(p, X, LABELS)), tied_params),
    nnx_grad(lambda: jnnx.LMHead(D, V, z_loss=1e-3, rngs=nnx.Rngs(0)), lambda m: m(X, LABELS)),
    nnx_grad(
      lambda: nnx.Embed(V, D, rngs=nnx.Rngs(1)),
      lambda m: jnnx.attend_cross_entropy(m, X, LABELS, weights=where),
    ),
  ]
  with jax.numpy_rank_promotion("raise"):
    for step, args in steps:
      jax.make_jaxpr(step)(args)
