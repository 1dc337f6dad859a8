"""jaxact.dot_product_attention in the corners an outside suite found wrong (issue 44): a huge
uniform bias (the row's log-sum-exp kept as one float32 lost its normaliser: a silent wrong
gradient), ``jax.debug_infs``, ``jax.numpy_rank_promotion("raise")``, logits past the float range
(clipped: their derivative is 0), ``jax.export`` with symbolic batch and sequence lengths, and
Flax's error contracts where jaxact stands in for Flax's attention function.

References: a float64 softmax formula written here (values and gradients by JAX autodiff), jax.nn's
own attention, Flax's own functions and their messages.
"""

from __future__ import annotations

import flax.linen
import flax.nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxact
import jaxact.linen
import jaxact.nnx

from cases import assert_trees_close

F64 = jnp.float64


def formula(q, k, v, bias):
  """softmax(q kᵀ / sqrt(H) + bias) v per head, float64, the whole (T, S) map; q (B, T, N, H)."""
  z = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(z, axis=-1), v)


def _grads(f, *args, weighted: bool = True):
  """Value and gradients of ``sum(f(...) * w)`` in float64: w a fixed, uneven cotangent, or 1."""

  def loss(*a):
    o = f(*a).astype(F64)
    w = jnp.cos(jnp.arange(o.size, dtype=F64)).reshape(o.shape) if weighted else 1.0
    return jnp.sum(o * w)

  return jax.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)


# ------------------------------------------------------------------- a huge uniform bias


def test_the_issue_case_a_bias_of_minus_1e9_keeps_dv_at_one_over_s_per_row():
  """B 1, T 4, S 8, N 1, H 8 and a bias of -1e9 everywhere: float32 rounds every logit to -1e9,
  so P is uniform (1/8) and dv = 4 rows x 1/8 = 0.5 for sum(O); the single float32 log-sum-exp
  lost log(8) and gave 4.0. jax.nn's float32 attention is the reference for every gradient."""
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (
    jax.random.normal(key, s, jnp.float32)
    for key, s in zip(ks, [(1, 4, 1, 8)] + [(1, 8, 1, 8)] * 2, strict=True)
  )
  bias = jnp.full((1, 1, 4, 8), -1e9, jnp.float32)
  got = _grads(jaxact.dot_product_attention, q, k, v, bias, weighted=False)
  np.testing.assert_array_equal(got[1][2], np.full(v.shape, 0.5))  # dv of sum(O)
  jax_nn = lambda *a: jax.nn.dot_product_attention(*a, implementation="xla")
  assert_trees_close(got, _grads(jax_nn, q, k, v, bias, weighted=False), 1e-6)


def _near_uniform(c: float, dtype, shape, seed: int):
  """Biases `c` and a few of the float's steps from it (ties at the maximum and just below),
  exact in `dtype` and in float64."""
  steps = jax.random.randint(jax.random.key(seed), shape, -3, 1)
  b = jnp.full(shape, c, dtype)
  for _ in range(3):
    b = jnp.where(steps < 0, jnp.nextafter(b, jnp.asarray(-jnp.inf, dtype)), b)
    steps = steps + 1
  return b


SWEEP = [
  pytest.param(c, form, dtype, marks=pytest.mark.exhaustive)
  for c in (-1e3, -1e6, -1e9, -1e15, -1e25, -1e35, -3e38)
  for form in ("uniform", "near-uniform")
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
]


@pytest.mark.parametrize("c, form, dtype", SWEEP)
def test_huge_uniform_and_near_uniform_biases_against_float64(c, form, dtype):
  """q = 0, so that each logit is its bias exactly in every dtype (the bias float32, float64 for
  float64 inputs): values and gradients of q, k, v and the bias against the float64 formula, with
  several blocks a row."""
  b, t, s, n, h = 2, 12, 21, 2, 8
  bias_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
  ks = jax.random.split(jax.random.key(1), 2)
  q = jnp.zeros((b, t, n, h), dtype)
  k = jax.random.normal(ks[0], (b, s, n, h), F64).astype(dtype)
  v = jax.random.normal(ks[1], (b, s, n, h), F64).astype(dtype)
  shape = (1, n, t, s)
  bias = (
    jnp.full(shape, c, bias_dtype) if form == "uniform" else _near_uniform(c, bias_dtype, shape, 2)
  )
  f = lambda *a: jaxact.dot_product_attention(*a, block_sizes=(5, 8))
  got = _grads(f, q, k, v, bias)
  want = _grads(formula, *(x.astype(F64) for x in (q, k, v, bias)))
  tol = {jnp.float64: 1e-12, jnp.float32: 1e-5}.get(dtype, 2e-2)
  assert_trees_close(got, want, tol)


# ---------------------------------------------------- debug_infs and rank promotion


CONTEXTS = {
  "debug_infs": lambda: jax.debug_infs(True),
  "rank_promotion": lambda: jax.numpy_rank_promotion("raise"),
}
B, T, S, N, K, H = 2, 8, 8, 2, 1, 4
OPTIONS = {
  "ones": dict(),
  "lengths": dict(
    query_seq_lengths=jnp.array([3, 8], jnp.int32),
    key_value_seq_lengths=jnp.array([0, 8], jnp.int32),  # batch row 0 sees no key
  ),
  "causal-window-cap": dict(is_causal=True, local_window_size=(2, 0), logits_soft_cap=1.0),
  "mask-bias": dict(
    mask=jnp.tril(jnp.ones((T, S), bool)),
    bias=jnp.linspace(-3e38, 0, T * S, dtype=jnp.float32).reshape(T, S),  # finfo.min-like masks
  ),
  "segments-dropout": dict(
    query_segment_ids=jnp.array([[0] * 5 + [1] * 3] * B, jnp.int32),
    dropout_rate=0.5,
    dropout_rng=jax.random.key(3),
    broadcast_dropout=False,
  ),
}


@pytest.mark.parametrize(
  "context, option",
  [
    (c, o)
    if (c, o) in {("debug_infs", "ones"), ("rank_promotion", "lengths")}
    else pytest.param(c, o, marks=pytest.mark.exhaustive)
    for c in CONTEXTS
    for o in OPTIONS
  ],
)
def test_debug_infs_and_rank_promotion_stay_quiet(context, option):
  """Called eagerly (jax.nn is quiet in both): no inf from finite inputs, no implicit rank
  promotion, the same values and gradients as outside the context."""
  x = jnp.ones((B, T, N, H), jnp.float32)
  kv = jnp.ones((B, S, K, H), jnp.float32) * jnp.arange(1, S + 1, dtype=jnp.float32)[:, None, None]
  kw = dict(OPTIONS[option])
  f = lambda q, k, v: jaxact.dot_product_attention(q, k, v, **kw)
  outside = _grads(f, x, kv, kv)
  with CONTEXTS[context]():
    inside = _grads(f, x, kv, kv)
  assert_trees_close(inside, outside, 0)


# --------------------------------------------------------------------- clipped logits


def test_logits_past_the_float_range_are_clipped_and_their_derivative_is_0():
  """q . k of about 1e39 overflows float32: the logits are clipped to the float's largest value, all
  of a row's tie, and the clipped function's derivative in q and k is 0 (the float64 truth's is 0
  too: its softmax is one-hot with gaps of 1e38); it was about 1e18."""
  q = jnp.full((1, 2, 1, 2), 2e19, jnp.float32)
  k = jnp.full((1, 3, 1, 2), 3e19, jnp.float32).at[0, 1].set(4e19)
  v = jnp.arange(6, dtype=jnp.float32).reshape(1, 3, 1, 2)
  (value, (dq, dk, dv)) = _grads(jaxact.dot_product_attention, q, k, v)
  assert np.isfinite(value)
  np.testing.assert_array_equal(dq, 0)
  np.testing.assert_array_equal(dk, 0)
  (_, (dq64, dk64, _)) = _grads(lambda *a: formula(*a, 0.0), *(x.astype(F64) for x in (q, k, v)))
  np.testing.assert_array_equal(dq64, 0)  # the truth agrees
  np.testing.assert_array_equal(dk64, 0)
  # the row's probabilities are uniform over the three tied (clipped) keys: dv = 2 rows x 1/3 x w
  assert np.all(np.isfinite(dv)) and float(np.abs(dv).sum()) > 0


# ------------------------------------------------------------------ symbolic shapes


def test_exported_with_symbolic_batch_and_length_equals_the_jitted_call():
  """``jax.export`` with the batch and the sequence length symbolic (default blocks), called at a
  length under one block and at one over several blocks."""
  b, t = export.symbolic_shape("b, t")

  def step(x):
    return _grads(lambda x: jaxact.dot_product_attention(x, x, x, is_causal=True), x)

  exported = export.export(jax.jit(step))(jax.ShapeDtypeStruct((b, t, 2, 8), jnp.float32))
  for length in (5, 600):
    x = jax.random.normal(jax.random.key(length), (3, length, 2, 8), jnp.float32)
    assert_trees_close(exported.call(x), jax.jit(step)(x), 1e-5)


# ------------------------------------------------------------------- Flax's contracts


BAD_SHAPES = {  # (query, key, value) shapes Flax refuses, and the phrase its message holds
  "rank": ((2, 4, 2, 8), (4, 2, 8), (4, 2, 8)),
  "batch": ((2, 4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)),
  "lengths": ((2, 4, 2, 8), (2, 5, 2, 8), (2, 6, 2, 8)),
  "depths": ((2, 4, 2, 8), (2, 5, 2, 4), (2, 5, 2, 8)),
  "heads": ((2, 4, 4, 8), (2, 4, 3, 8), (2, 4, 3, 8)),
}


def _flax_message(fn, *args, **kwargs) -> tuple[type, str]:
  try:
    fn(*args, **kwargs)
  except (ValueError, AssertionError) as e:
    return type(e), str(e)
  raise AssertionError(f"Flax accepted {[a.shape for a in args]}")


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_flax_attention_fns_raise_flaxs_own_messages(case):
  """Flax's functions raise first: jaxact's stand-ins raise an error of the same class whose message
  contains Flax's (linen's asserts: an error that is a ValueError and an AssertionError)."""
  q, k, v = (jnp.ones(s, jnp.float32) for s in BAD_SHAPES[case])
  kind, msg = _flax_message(flax.linen.dot_product_attention, q, k, v)
  with pytest.raises(kind) as raised:
    jaxact.linen.dot_product_attention(q, k, v)
  assert isinstance(raised.value, ValueError) and msg in str(raised.value)
  # nnx checks depths and heads in its weights' path (dropout on, deterministic)
  kind, msg = _flax_message(
    flax.nnx.dot_product_attention, q, k, v, dropout_rate=0.1, deterministic=True
  )
  with pytest.raises(kind, match=msg.replace("(", r"\(").replace(")", r"\)")):
    jaxact.nnx.dot_product_attention(q, k, v)


def test_attentions_own_errors_name_attention():
  x = jnp.ones((1, 4, 2, 8), jnp.complex64)
  with pytest.raises(
    TypeError, match=r"jaxact.dot_product_attention: `query` has complex dtype"
  ) as e:
    jaxact.dot_product_attention(x, x.real, x.real)
  assert "activations" not in str(e.value)
