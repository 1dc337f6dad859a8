"""jaxact.dot_product_attention on issue 54's inputs: rows of 1e30 and 1e-30 in q, k and v (a
one-hot row's dS was rounding times 1e30), dot products whose terms pass float32's range while the
logit fits (inf - inf was NaN), soft caps and scales at the float's limits (a cap near the largest
float flushed ``z / c`` to 0; one the float cannot hold made NaN), rows that see no key (jax.nn's
own behaviour beside jaxact's), empty batches and vmap over a batch axis.

The reference is the float64 formula written here: values, and gradients by JAX autodiff of it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

from cases import assert_trees_close

F64 = jnp.float64
F32 = np.finfo(np.float32)
B, T, S, N, K, H = 1, 8, 12, 2, 1, 16  # H 16: the Triton kernels' least head dim
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2, jnp.float64: 1e-12}


def formula(q, k, v, *, scale=None, cap=None, mask=None):
  """``softmax(c tanh(scale q kᵀ / c)) v`` per head in float64, the whole (T, S) map, k and v
  repeated over the query heads of a group; a row that sees no key gives 0."""
  n = q.shape[2]
  k, v = (jnp.repeat(a, n // a.shape[2], 2) for a in (k, v))
  z = jnp.einsum("btnh,bsnh->bnts", q, k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
  if cap is not None:
    z = cap * jnp.tanh(z / cap)
  valid = jnp.ones(z.shape, bool) if mask is None else jnp.broadcast_to(mask, z.shape)
  z = jnp.where(valid, z, -jnp.inf)
  m = jnp.max(z, -1, keepdims=True)
  e = jnp.where(valid, jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0)), 0)
  p = e / jnp.maximum(jnp.sum(e, -1, keepdims=True), np.finfo(np.float64).tiny)
  return jnp.einsum("bnts,bsnh->btnh", p, v)


def _value_and_grads(f, q, k, v):
  """Value and gradients of ``sum(f(q, k, v) * w)`` in float64, w a fixed uneven cotangent."""

  def loss(q, k, v):
    o = f(q, k, v).astype(F64)
    return jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=F64)).reshape(o.shape))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def check(q, k, v, dtype, *, scale=None, cap=None, implementation=None, shift=0):
  """jaxact's value and gradients in `dtype` against the float64 formula of the same inputs (q
  scaled by ``2**-shift`` inside it, and the scale by ``2**shift``: the same logits, for products
  past float64's range)."""
  q, k, v = (jnp.asarray(a, dtype) for a in (q, k, v))
  kw = dict(scale=scale, logits_soft_cap=cap, implementation=implementation)
  got = _value_and_grads(lambda *a: jaxact.dot_product_attention(*a, **kw), q, k, v)
  s = (1 / np.sqrt(q.shape[-1]) if scale is None else scale) * 2.0**shift
  f64 = lambda q, k, v: formula(q * 2.0**-shift, k, v, scale=s, cap=cap)
  want = _value_and_grads(f64, *(a.astype(F64) for a in (q, k, v)))
  assert_trees_close(got, want, TOL[dtype])


def _normal(seed: int = 0):
  ks = jax.random.split(jax.random.key(seed), 3)
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H)]
  return [np.array(jax.random.normal(key, s, F64)) for key, s in zip(ks, shapes, strict=True)]


# ---------------------------------------------------------------- rows of 1e30 and 1e-30

ROWS = [
  (operand, size, dtype, impl)
  for operand in ("q", "k", "v")
  for size in ("1e30", "1e-30")
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
  for impl in ("xla", "pallas")
  if not (impl == "pallas" and dtype == jnp.float64)
]
DEFAULT_ROWS = {("q", "1e30", jnp.float32, "xla"), ("k", "1e30", jnp.float32, "pallas")}


@pytest.mark.parametrize(
  "operand, size, dtype, impl",
  [r if r in DEFAULT_ROWS else pytest.param(*r, marks=pytest.mark.exhaustive) for r in ROWS],
)
def test_rows_of_1e30_and_1e_30_against_float64(operand, size, dtype, impl):
  """One row of q (key of k, of v) times 1e30 or 1e-30 (1e4 and 1e-4 in float16): a q row of
  1e30 makes its softmax one-hot, where dS is 0 (float64's P is exactly one-hot); rounding in
  ``dP - D`` times a q or k of 1e30 gave gradients of 1e22 on both backends."""
  q, k, v = _normal()
  factor = float(size) if dtype != jnp.float16 else {"1e30": 1e4, "1e-30": 1e-4}[size]
  {"q": q, "k": k, "v": v}[operand][0, 2] *= factor
  check(q, k, v, dtype, implementation=impl)


# --------------------------------------------- products past the float, a logit that fits


@pytest.mark.parametrize(
  "dtype",
  [jnp.float32]
  + [pytest.param(d, marks=pytest.mark.exhaustive) for d in (jnp.bfloat16, jnp.float64)],
)
def test_terms_past_the_float_range_with_a_logit_that_fits(dtype):
  """A query row and a key of ``a = 2**66`` (``2**513`` in float64) whose two products ``a**2``
  and ``-a**2 (1 - 2**-7)`` each pass the float's range while their sum, ``a**2 2**-7``, fits: the
  logit is exact, the row one-hot on that key, as in float64 (inf - inf made it NaN)."""
  a = 2.0**513 if dtype == jnp.float64 else 2.0**66
  q, k, v = _normal()
  q[0, 3, :, :2] = a
  k[0, 5, 0, :2] = a, -a * (1 - 2.0**-7)  # exact in bfloat16 too
  k[0, 7, 0, :2] = a, -a * (1 - 2.0**-8)  # half the logit: the row stays one-hot on key 5
  check(q, k, v, dtype, shift=20)
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  o = jax.jit(jaxact.dot_product_attention)(q, k, v)
  np.testing.assert_array_equal(o[0, 3], jnp.repeat(v[0, 5], N, 0))  # P exactly one-hot


# ------------------------------------------------------- soft caps and scales at the limits


@pytest.mark.parametrize(
  "cap, size",
  [(float(F32.max), 1.0), (float(F32.tiny), 1.0)]
  + [
    pytest.param(c, s, marks=pytest.mark.exhaustive)
    for c, s in ((float(F32.max), 1e3), (float(F32.tiny), 1e3), (2.0**86, 1e20), (1e-3, 1e30))
  ],
)
def test_soft_caps_at_float32s_limits_against_float64(cap, size):
  """The cap float32's largest: ``z / c`` is below its least normal number and was flushed to 0
  (every logit 0); its least normal number: every logit ``+-c``, the softmax uniform."""
  q, k, v = _normal()
  check(q * size, k, v, jnp.float32, cap=cap)


@pytest.mark.exhaustive
def test_a_soft_cap_near_float64s_largest_is_the_identity():
  """``c tanh(z / c)`` is z to float64's precision for ``c = 1e308``: the call equals the uncapped
  one, which equals the float64 formula."""
  q, k, v = (jnp.asarray(a) for a in _normal())
  f = lambda cap: lambda *a: jaxact.dot_product_attention(*a, logits_soft_cap=cap)
  assert_trees_close(_value_and_grads(f(1e308), q, k, v), _value_and_grads(f(None), q, k, v), 1e-13)
  check(q, k, v, jnp.float64)


@pytest.mark.parametrize(
  "dtype, name, value",
  [
    (jnp.float32, "logits_soft_cap", 1e-50),
    (jnp.bfloat16, "logits_soft_cap", 2e-39),  # a float32 subnormal: the logits' dtype
    (jnp.float16, "logits_soft_cap", 1e39),
    (jnp.float64, "logits_soft_cap", 1e-320),
    (jnp.float32, "scale", -1e39),
  ],
)
def test_caps_and_scales_the_logits_dtype_does_not_hold_raise(dtype, name, value):
  q, k, v = (jnp.asarray(a, dtype) for a in _normal())
  message = rf"`{name}` is {re.escape(repr(value))}, which .*does not hold; accepted"
  with pytest.raises(ValueError, match=message):
    jaxact.dot_product_attention(q, k, v, **{name: value})


def test_the_triton_kernels_decline_a_cap_they_cannot_hold():
  q, k, v = (jnp.asarray(a, jnp.float32) for a in _normal())
  with pytest.raises(NotImplementedError, match=r"logits_soft_cap=3\.4.* scale / c must be"):
    jaxact.dot_product_attention(q, k, v, logits_soft_cap=float(F32.max), implementation="pallas")


# --------------------------------------------------------- rows that see no key, as jax.nn


def test_a_row_that_sees_no_key_gives_0_where_jax_nn_gives_the_mean_or_nan():
  """The documented difference (docs/attention.md), pinned on both sides: jax.nn's masked row is
  the mean of the values and its row of -inf bias NaN; jaxact's are 0, with zero gradients."""
  q, k, v = (jnp.asarray(a, jnp.float32) for a in _normal())
  mask = jnp.ones((B, N, T, S), bool).at[0, 0, 1].set(False)
  bias = jnp.zeros((B, N, T, S), jnp.float32).at[0, 1, 4].set(-jnp.inf)
  ours = jax.jit(jaxact.dot_product_attention)(q, k, v, bias, mask)
  theirs = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla")
  np.testing.assert_allclose(theirs[0, 1, 0], jnp.mean(v[0, :, 0], 0), rtol=1e-6)
  assert np.all(np.isnan(theirs[0, 4, 1]))
  assert np.all(ours[0, 1, 0] == 0) and np.all(ours[0, 4, 1] == 0)
  want = formula(*(a.astype(F64) for a in (q, k, v)), mask=mask & (bias > -jnp.inf))
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)
  grads = jax.jit(jax.grad(lambda q: jnp.sum(jaxact.dot_product_attention(q, k, v, bias, mask))))(q)
  assert np.all(grads[0, 1, 0] == 0) and np.all(grads[0, 4, 1] == 0)


# --------------------------------------------------------------- empty batches and vmap


@pytest.mark.parametrize("b, t, s", [(0, T, S), (B, 0, S), (B, T, 0)])
def test_empty_batches_and_lengths_as_jax_nn(b, t, s):
  """A batch, a query length or a key length of 0: jax.nn's shape and values (0 for S = 0),
  and zero gradients of the operands' shapes."""
  q = jnp.ones((b, t, N, H), jnp.float32)
  k = v = jnp.ones((b, s, K, H), jnp.float32)
  ours = jaxact.dot_product_attention(q, k, v)
  theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
  np.testing.assert_array_equal(ours, theirs)
  grads = jax.grad(lambda *a: jnp.sum(jaxact.dot_product_attention(*a)), (0, 1, 2))(q, k, v)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
  assert all(np.all(g == 0) for g in grads)


def test_vmap_over_unbatched_calls_equals_the_batched_call():
  """``jax.vmap`` over a batch axis of 3-d (unbatched) calls, with a mask, a bias and segment
  ids a batch row each, equals the one 4-d call: values and gradients, float64."""
  ks = jax.random.split(jax.random.key(4), 4)
  b = 3
  q = jax.random.normal(ks[0], (b, T, N, H), F64)
  k, v = (jax.random.normal(key, (b, S, K, H), F64) for key in ks[1:3])
  bias = jax.random.normal(ks[3], (b, T, S), F64)
  mask = jnp.arange(S)[None, None, :] <= jnp.arange(T)[None, :, None] + jnp.arange(b)[:, None, None]
  seg = jnp.array([[0] * 4 + [1] * 8, [0] * 12, [0] * 6 + [1] * 6])  # the keys' segments, (b, S)
  seg_q = seg[:, :T]

  def one(q, k, v, bias, mask, seg_q, seg):
    return jaxact.dot_product_attention(
      q, k, v, bias, mask, query_segment_ids=seg_q, key_value_segment_ids=seg
    )

  def loss(f):
    return lambda q, k, v, bias: jnp.sum(jnp.sin(f(q, k, v, bias)))

  mapped = jax.vmap(one)
  batched = lambda q, k, v, bias: one(q, k, v, bias[:, None], mask[:, None], seg_q, seg)
  per_row = lambda q, k, v, bias: mapped(q, k, v, bias, mask, seg_q, seg)
  args = (q, k, v, bias)
  assert_trees_close(jax.jit(per_row)(*args), jax.jit(batched)(*args), 1e-13)
  grads = [jax.jit(jax.grad(loss(f), (0, 1, 2, 3)))(*args) for f in (per_row, batched)]
  assert_trees_close(grads[0], grads[1], 1e-13)
