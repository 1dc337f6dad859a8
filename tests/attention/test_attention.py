"""jaxact.dot_product_attention: values and gradients (q, k, v, bias) against autodiff of the plain
formula in float64 and of jax.nn's XLA attention, for each option and their combinations; half
precision against float32; check_grads; jit/vmap/remat/scan; what the pullback keeps and what the
compiled step holds; rows that see no key; dropout equal to Flax's; the blocks that are skipped;
the errors."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import jaxact
from jaxact._src.attention import xla, xla_blocks
from jaxact._src.attention.plan import AttentionPlan
from jaxact._src.attention.reference import attention_reference

from cases import assert_trees_close

B, T, S, N, K, H = 2, 24, 19, 4, 2, 8
BLOCKS = ((8, 8), (5, 7))  # several blocks each way, last blocks moved back


def inputs(dtype, b=B, t=T, s=S, n=N, kh=K, h=H, hv=None, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float64).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float64).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, hv or h), jnp.float64).astype(dtype)
  bias = jax.random.normal(ks[3], (1, n, t, s), jnp.float64).astype(dtype)
  return q, k, v, bias


def _mask(t=T, s=S, seed=1):
  return jax.random.bernoulli(jax.random.key(seed), 0.7, (B, 1, t, s))


OPTIONS = {
  "plain": dict(),
  "causal": dict(is_causal=True),
  "window": dict(local_window_size=(3, 2)),
  "causal+window": dict(is_causal=True, local_window_size=(5, 0)),
  "soft_cap": dict(logits_soft_cap=2.0),
  "lengths": dict(
    query_seq_lengths=jnp.array([20, 24], jnp.int32),
    key_value_seq_lengths=jnp.array([19, 7], jnp.int32),
  ),
  "mask": dict(mask=_mask()),
  "scale": dict(scale=0.7),
  "segments": dict(
    query_segment_ids=jnp.asarray(np.arange(T)[None] // np.array([[5], [9]]), jnp.int32),
    key_value_segment_ids=jnp.asarray(np.arange(S)[None] // np.array([[4], [9]]), jnp.int32),
  ),
  "all": dict(
    is_causal=True,
    local_window_size=(6, 1),
    logits_soft_cap=1.5,
    mask=_mask(),
    query_seq_lengths=jnp.array([23, 24]),
    key_value_seq_lengths=jnp.array([19, 11]),
  ),
}


def _value_and_grads(f, q, k, v, bias):
  w = jnp.cos(jnp.arange(q.size // q.shape[-1] * v.shape[-1], dtype=jnp.float64))
  w = w.reshape(*q.shape[:-1], v.shape[-1]).astype(q.dtype)

  def loss(q, k, v, bias):
    return jnp.sum(f(q, k, v, bias).astype(jnp.float64) * w)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)


# Every option alone and together, with several blocks each way whose last ones move back; the
# default suite runs the combination and the skipping options (the others under -m exhaustive).
_DEFAULT = {"all": BLOCKS[1], "causal+window": BLOCKS[0], "segments": BLOCKS[0]}


@pytest.mark.sample(1, "causal+window-blocks1", "segments-blocks2")
@pytest.mark.parametrize(
  "option, blocks",
  [(o, b) for o, b in _DEFAULT.items()]
  + [
    pytest.param(o, b, marks=pytest.mark.exhaustive)
    for o in OPTIONS
    for b in BLOCKS
    if _DEFAULT.get(o) != b
  ],
)
def test_float64_values_and_gradients_equal_the_plain_formula(option, blocks):
  q, k, v, bias = inputs(jnp.float64)
  kw = OPTIONS[option]
  want = _value_and_grads(lambda *a: attention_reference(*a, **kw), q, k, v, bias)
  f = functools.partial(jaxact.dot_product_attention, block_sizes=blocks, **kw)
  assert_trees_close(_value_and_grads(f, q, k, v, bias), want, 1e-12)


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "option",
  ["mask", "lengths"]
  + [
    pytest.param(o, marks=pytest.mark.exhaustive)
    for o in ("plain", "causal", "window", "causal+window", "scale")
  ],
)
def test_float64_against_jax_nn_xla(option):
  """jax.nn's own attention, differentiated by JAX; its softmax runs in float32 even for float64
  inputs, hence the tolerance. T == S and lengths > 0 so that every row sees a key."""
  q, k, v, bias = inputs(jnp.float64, s=T)
  kw = dict(OPTIONS[option])
  if option == "mask":
    kw["mask"] = _mask(T, T) | jnp.eye(T, dtype=bool)
  if option == "lengths":
    kw["key_value_seq_lengths"] = jnp.array([24, 7], jnp.int32)
  ours = functools.partial(jaxact.dot_product_attention, block_sizes=(8, 8), **kw)
  theirs = functools.partial(jax.nn.dot_product_attention, implementation="xla", **kw)
  assert_trees_close(
    _value_and_grads(ours, q, k, v, bias), _value_and_grads(theirs, q, k, v, bias), 2e-6
  )


@pytest.mark.parametrize(
  "kv_heads", [1, pytest.param(4, marks=pytest.mark.exhaustive)], ids=["mqa", "mha"]
)
def test_gqa_mqa_mha_and_a_value_head_dim_of_its_own(kv_heads):
  q, k, v, bias = inputs(jnp.float64, kh=kv_heads, hv=5)
  f = functools.partial(jaxact.dot_product_attention, is_causal=True, block_sizes=(8, 8))
  want = _value_and_grads(functools.partial(attention_reference, is_causal=True), q, k, v, bias)
  assert_trees_close(_value_and_grads(f, q, k, v, bias), want, 1e-12)


@pytest.mark.parametrize(
  "shape",
  [(B, 1, 1, S)]
  + [pytest.param(s, marks=pytest.mark.exhaustive) for s in ((1, 1, T, S), (1, N, T, 1), (T, S))],
)
def test_the_bias_gradient_sums_over_its_broadcast_axes(shape):
  q, k, v, _ = inputs(jnp.float64)
  bias = jax.random.normal(jax.random.key(5), shape, jnp.float64)
  f = functools.partial(jaxact.dot_product_attention, is_causal=True, block_sizes=(5, 7))
  ref = functools.partial(attention_reference, is_causal=True)
  bias4 = bias.reshape((1,) * (4 - bias.ndim) + shape)
  got = _value_and_grads(f, q, k, v, bias)
  want = _value_and_grads(ref, q, k, v, bias4)
  assert got[1][3].shape == shape
  assert_trees_close((got[0], got[1][:3], got[1][3].reshape(bias4.shape)), want, 1e-12)
  assert got[1][3].shape == shape


def test_three_dimensional_inputs():
  q, k, v, bias = inputs(jnp.float64, b=1)
  got = jax.jit(functools.partial(jaxact.dot_product_attention, is_causal=True))(
    q[0], k[0], v[0], bias[0]
  )
  want = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True))(
    q[0], k[0], v[0], bias[0]
  )
  assert got.shape == q.shape[1:]
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
  "dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.exhaustive)]
)
def test_half_precision_against_float32(dtype):
  q, k, v, bias = (a.astype(dtype) for a in inputs(jnp.float32))
  kw = dict(is_causal=True, logits_soft_cap=3.0, block_sizes=(8, 8))
  f = functools.partial(jaxact.dot_product_attention, **kw)
  got = _value_and_grads(f, q, k, v, bias)
  up = tuple(a.astype(jnp.float32) for a in (q, k, v, bias))
  want = _value_and_grads(f, *up)
  assert got[0].dtype == jnp.float64 and got[1][0].dtype == dtype
  assert jax.eval_shape(jaxact.dot_product_attention, q, k, v).dtype == dtype
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r)


def test_check_grads_reverse():
  q, k, v, bias = inputs(jnp.float64, b=1, t=6, s=5, n=2, kh=1, h=4)

  @jax.jit
  def f(q, k, v, bias):
    return jaxact.dot_product_attention(
      q, k, v, bias, is_causal=True, logits_soft_cap=2.0, block_sizes=(4, 2)
    )

  check_grads(f, (q, k, v, bias), order=1, modes=["rev"])


def test_jit_vmap_remat_scan():
  """vmap over a leading axis, and the gradient through a scan of two layers with and without
  jax.checkpoint, equal the plain call (which the tests above compare with the references)."""
  q, k, v, bias = inputs(jnp.float64)
  f = functools.partial(jaxact.dot_product_attention, is_causal=True, block_sizes=(8, 8))
  want = jax.jit(f)(q, k, v, bias)
  stacked = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(q[None], k[None], v[None], bias)
  np.testing.assert_allclose(stacked[0], want, rtol=1e-13)

  def layers(q, checkpoint):
    body = jax.checkpoint(f) if checkpoint else f
    return jnp.sum(lax.scan(lambda x, _: (body(x, k, v, bias), None), q, None, length=2)[0])

  g, g_remat = (jax.jit(jax.grad(layers), static_argnums=1)(q, c) for c in (False, True))
  np.testing.assert_allclose(g_remat, g, rtol=1e-12)
  twice = jax.grad(lambda q: jnp.sum(f(f(q, k, v, bias), k, v, bias)))  # the scan unrolled
  np.testing.assert_allclose(g, jax.jit(twice)(q), rtol=1e-12)


# ------------------------------------------------------------------------- what it keeps


def test_the_pullback_keeps_q_k_v_bias_o_and_two_numbers_a_row():
  q, k, v, bias = inputs(jnp.float32)
  out, pull = jax.vjp(
    lambda q, k, v, b: jaxact.dot_product_attention(q, k, v, b, is_causal=True), q, k, v, bias
  )
  kept = jax.tree.leaves(pull)
  for a in (q, k, v, bias):
    assert any(x is a for x in kept)
  assert any(x.shape == out.shape and np.array_equal(x, out) for x in kept)
  stats = [x for x in kept if x.shape == (B, N, 2, T) and x.dtype == jnp.float32]
  assert len(stats) == 1  # each row's largest logit and the log of its softmax's sum
  z = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, 2)) / np.sqrt(H) + bias
  z = jnp.where(jnp.tril(jnp.ones((T, S), bool)), z, -jnp.inf)
  np.testing.assert_allclose(stats[0][:, :, 0], jnp.max(z, -1), rtol=1e-6)
  np.testing.assert_allclose(jnp.sum(stats[0], 2), jax.nn.logsumexp(z, -1), rtol=1e-5)
  budget = q.nbytes + k.nbytes + v.nbytes + bias.nbytes + out.nbytes + stats[0].nbytes
  assert sum(x.nbytes for x in kept) <= budget + 64


def _largest_arrays(compiled) -> list[int]:
  shapes = re.findall(r"\b(?:f32|f64|bf16|f16|pred)\[([\d,]+)\]", compiled.as_text())
  return sorted((int(np.prod([int(d) for d in s.split(",")])) for s in set(shapes)), reverse=True)


def test_the_compiled_step_holds_no_query_by_key_array():
  """Every array of the compiled gradient is at most one block of logits; jax.nn's holds (T, S)
  maps, so the check can fail."""
  b, t, n, h = 1, 512, 2, 16
  q = jax.random.normal(jax.random.key(0), (b, t, n, h), jnp.float32)

  def step(attn):
    return jax.jit(jax.grad(lambda q: jnp.sum(attn(q, q, q, is_causal=True) ** 2)))

  ours = step(functools.partial(jaxact.dot_product_attention, block_sizes=(64, 128)))
  theirs = step(jax.nn.dot_product_attention)
  ours_c, theirs_c = ours.lower(q).compile(), theirs.lower(q).compile()
  assert _largest_arrays(ours_c)[0] <= b * n * 64 * 128
  assert _largest_arrays(theirs_c)[0] >= b * n * t * t
  mem = [c.memory_analysis().temp_size_in_bytes for c in (ours_c, theirs_c)]
  assert mem[0] <= 0.25 * mem[1]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (5, 0), (3, 6), (0, 0)])
@pytest.mark.parametrize("t, s", [(40, 40), (37, 23), (23, 37)])
def test_the_visited_blocks_are_exactly_those_with_an_unmasked_entry(causal, window, t, s):
  """The loop bounds skip every block wholly outside the causal mask and the window, and visit
  every block with an unmasked entry (forward: key blocks a query block; backward: query blocks
  a key block)."""
  plan = AttentionPlan(scale=1.0, causal=causal, window=window, block_q=8, block_k=6)
  sh = xla_blocks.Shapes(1, t, s, 1, 1)
  rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
  allowed = np.ones((t, s), bool)
  if causal:
    allowed &= cols <= rows
  if window:
    allowed &= (cols >= rows - window[0]) & (cols <= rows + window[1])
  n_q, n_k = -(-t // 8), -(-s // 6)
  for i in range(n_q):
    q0 = min(i * 8, t - 8)
    lo, hi = (int(x) for x in xla_blocks.key_blocks(plan, sh, q0))
    for j in range(n_k):
      k0 = min(j * 6, s - 6)
      needed = allowed[q0 : q0 + 8, max(k0, j * 6) : k0 + 6].any()
      assert (lo <= j < hi) == needed, (i, j, lo, hi)
  for j in range(n_k):
    lo, hi = (int(x) for x in xla_blocks.query_blocks(plan, sh, j))
    k0 = min(j * 6, s - 6)
    for i in range(n_q):
      q0 = min(i * 8, t - 8)
      needed = allowed[max(q0, i * 8) : q0 + 8, max(k0, j * 6) : k0 + 6].any()
      if needed:
        assert lo <= i < hi, (i, j, lo, hi)
    assert (
      hi - lo
      <= sum(
        allowed[max(min(i * 8, t - 8), i * 8) : min(i * 8, t - 8) + 8, j * 6 : k0 + 6].any()
        for i in range(n_q)
      )
      + 1
    )  # at most one block more than needed (the row bound's rounding)


# ---------------------------------------------------------------------------------- NaN-free


def test_rows_that_see_no_key_give_zero_and_zero_gradients():
  q, k, v, _ = inputs(jnp.float32)
  mask = jnp.ones((B, 1, T, S), bool).at[0, 0, 3].set(False)  # row 3 of batch 0 sees nothing
  bias = jnp.zeros((B, 1, T, S), jnp.float32).at[1, 0, 5].set(-jnp.inf)  # nor row 5 of batch 1
  kv_len = jnp.array([S, 0], jnp.int32)  # nor, with the lengths, any row of batch 1

  def f(q, k, v, bias, kv_len):
    return jaxact.dot_product_attention(
      q, k, v, bias, mask, key_value_seq_lengths=kv_len, block_sizes=(8, 8)
    )

  step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3)))
  (_, g), out = step(q, k, v, bias, kv_len.at[1].set(S)), jax.jit(f)(q, k, v, bias, kv_len)
  assert np.all(out[0, 3] == 0) and np.all(out[1] == 0) and np.all(np.isfinite(out))
  assert all(np.all(np.isfinite(x)) for x in g)
  assert np.all(g[0][0, 3] == 0) and np.all(g[0][1, 5] == 0)
  assert np.all(g[3][0, 0, 3] == 0) and np.all(g[3][1, 0, 5] == 0)  # dbias too
  _, g = step(q, k, v, bias, kv_len)
  assert np.all(g[0][1] == 0) and np.all(g[1][1] == 0) and np.all(g[2][1] == 0)


@pytest.mark.parametrize(
  "dtype",
  [jnp.float32]
  + [pytest.param(d, marks=pytest.mark.exhaustive) for d in (jnp.bfloat16, jnp.float16)],
)
def test_logits_of_any_finite_size_give_no_nan(dtype):
  """Logits past the float32 range (q . k overflows: each product fits, their sum does not) are
  clipped to it; the softmax of huge logits stays finite, and so do the gradients."""
  q, k, v, _ = inputs(jnp.float32)
  big = 1e19 if dtype != jnp.float16 else float(jnp.finfo(dtype).max) / 4
  q, k, v = (a.astype(dtype) for a in (jnp.abs(q) * big, jnp.abs(k) * big, v))
  f = functools.partial(jaxact.dot_product_attention, is_causal=True, block_sizes=(8, 8))
  loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
  out, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in g)


# ---------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize(
  "broadcast",
  [True, pytest.param(False, marks=pytest.mark.exhaustive)],
  ids=["broadcast", "per_head"],
)
def test_dropout_equals_flax_attention_dropout(broadcast):
  """The same key gives Flax's mask: values and gradients equal flax.linen's attention with
  dropout (float32), blocked or whole."""
  q, k, v, _ = inputs(jnp.float32, kh=N)
  rng = jax.random.key(3)
  flax_kw = dict(dropout_rate=0.3, dropout_rng=rng, broadcast_dropout=broadcast)

  def theirs(q, k, v, bias):
    return nn.dot_product_attention(q, k, v, deterministic=False, **flax_kw)

  want = _value_and_grads(theirs, q, k, v, None)
  ours = functools.partial(jaxact.dot_product_attention, block_sizes=(8, 8), **flax_kw)
  assert_trees_close(_value_and_grads(ours, q, k, v, None), want, 2e-5)


def test_dropout_keeps_the_key_not_the_mask():
  q, k, v, _ = inputs(jnp.float32)
  f = functools.partial(
    jaxact.dot_product_attention, dropout_rate=0.5, dropout_rng=jax.random.key(0)
  )
  _, pull = jax.vjp(f, q, k, v)
  assert not any(
    x.dtype == jnp.bool_ or x.size >= T * S
    for x in jax.tree.leaves(pull)
    if x.shape != q.shape and x.shape != k.shape
  )


# --------------------------------------------------------------------------------- backends


# By default: test_attention_backends.py's pallas case (the kernels through jaxact, causal grouped
# heads with a soft cap) and test_attention_triton.py's rows that see no key.
@pytest.mark.exhaustive
def test_the_triton_kernels_through_jaxact_equal_the_xla_path():
  """implementation='pallas' runs pallas_kernels.attention_triton (interpret mode on CPU) inside
  the same custom_vjp: values and gradients equal the XLA path's (grouped heads, causal, soft cap,
  a batch row with no key)."""
  q, k, v, _ = inputs(jnp.float32, s=T, h=16)
  kw = dict(is_causal=True, logits_soft_cap=3.0, key_value_seq_lengths=jnp.array([T, 0], jnp.int32))
  got, want = (
    _value_and_grads(
      lambda q, k, v, _, impl=impl: jaxact.dot_product_attention(
        q, k, v, implementation=impl, **kw
      ),
      q,
      k,
      v,
      None,
    )
    for impl in ("pallas", "xla")
  )
  assert_trees_close(got, want, 2e-5)


# ----------------------------------------------------------------------------------- errors

_q, _k, _v, _ = inputs(jnp.float32)
ERRORS = [
  (dict(query=_q[0, 0]), ValueError, "all be 4-d"),
  (dict(key=_k.astype(jnp.float16)), TypeError, "one dtype"),
  (
    dict(query=_q.astype(jnp.int32), key=_k.astype(jnp.int32), value=_v.astype(jnp.int32)),
    TypeError,
    "`query` has dtype int32",
  ),
  (dict(query=_q[:, :, :3]), ValueError, "3 heads, which is not a multiple of `key`'s 2"),
  (dict(query=_q[..., :4]), ValueError, "different head dims"),
  (dict(value=_v[:, :5]), ValueError, "agree in batch, length and heads"),
  (dict(bias=jnp.zeros((3, N, T, S))), ValueError, "does not broadcast"),
  (dict(bias=jnp.zeros((1, 1, 1, T, S))), ValueError, "rank 5"),
  (dict(mask=jnp.ones((1, 1, T, S), jnp.float32)), TypeError, "`mask` has dtype float32"),
  (dict(local_window_size=(3,)), ValueError, "`local_window_size` is"),
  (dict(local_window_size=-1), ValueError, "ints >= 0"),
  (dict(local_window_size=(2.5, 1)), ValueError, "`local_window_size`"),
  (dict(query_seq_lengths=jnp.array([1, 2, 3])), ValueError, r"accepted: \(2,\)"),
  (dict(query_segment_ids=jnp.zeros((B, T), jnp.int32)), ValueError, "only when T == S"),
  (
    dict(query_segment_ids=jnp.zeros((B, T)), key_value_segment_ids=jnp.zeros((B, S))),
    TypeError,
    "`query_segment_ids` has dtype float",
  ),
  (dict(key_value_seq_lengths=jnp.array([1.0, 2.0])), TypeError, "integer dtype"),
  (dict(logits_soft_cap=0.0), ValueError, "`logits_soft_cap` is 0.0"),
  (dict(logits_soft_cap="1"), TypeError, "Python float"),
  (dict(scale=float("nan")), ValueError, "`scale` is nan"),
  (dict(is_causal="yes"), TypeError, "`is_causal` must be a bool"),
  (dict(dropout_rate=0.1), ValueError, "`dropout_rng` is required"),
  (dict(dropout_rate=1.5, dropout_rng=jax.random.key(0)), ValueError, "`dropout_rate`"),
  (dict(block_sizes=(0, 4)), ValueError, "`block_sizes`"),
  (dict(implementation="triton"), ValueError, "`implementation` 'triton' is not known"),
  (dict(implementation="pallas", bias=jnp.zeros((1, 1, T, S))), NotImplementedError, "additive"),
  (dict(implementation="pallas", scale=-1.0), NotImplementedError, "positive scale"),
  (dict(implementation="mosaic"), NotImplementedError, "no Mosaic GPU"),
  (dict(implementation="cudnn", logits_soft_cap=2.0), NotImplementedError, "soft cap"),
  (dict(implementation="cudnn"), NotImplementedError, "dtype float32"),
]


@pytest.mark.parametrize("kw, error, match", ERRORS, ids=[m for _, _, m in ERRORS])
def test_bad_arguments_raise_naming_them(kw, error, match):
  args = dict(query=_q, key=_k, value=_v) | kw
  q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
  with pytest.raises(error, match=match):
    jaxact.dot_product_attention(q, k, v, **args)


@pytest.mark.parametrize("length", [16, 160])  # one query block, several
def test_a_scanned_stack_hoists_no_head_sized_array_out_of_its_loop(length):
  """In a stack scanned over its layers no buffer the op starts from (O and the statistics, dq,
  dk, dv, a block's accumulators) nor a zero it selects is made once outside the loop: JAX hoists
  every loop-invariant computation of a scanned forward, and a hoisted buffer the loop writes in
  place is copied into every layer's loop (barriers.zeros_in_step)."""
  d = N * H
  x = jax.random.normal(jax.random.key(0), (B, length, d))
  ws = jnp.stack([jnp.eye(d)] * 2)

  def loss(ws, x):
    def block(x, w):
      q = (x @ w).reshape(B, length, N, H)
      o = jaxact.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
      return x + o.reshape(x.shape), None

    return jnp.sum(lax.scan(block, x, ws)[0] ** 2)

  outer = jax.make_jaxpr(jax.grad(loss))(ws, x).jaxpr.eqns
  hoisted = [
    (e.primitive.name, v.aval.shape)
    for e in outer
    if e.primitive.name != "scan"
    for v in e.outvars
    if len(getattr(v.aval, "shape", ())) >= 4
  ]
  assert hoisted == []


def test_the_backward_reads_do_and_o_only_inside_its_loop():
  """``D = rowsum(dO * O)`` is formed a query block at a time inside the loop; formed over the
  whole arrays before it, XLA wrote float32 transposed copies of dO and O (512 MiB of an H100 step
  at T 8192, B 4, 16 heads of 128)."""
  from jax.extend.core import Literal

  from jaxact._src.attention.plan import Aux

  q = jnp.ones((B, T, N, H), jnp.bfloat16)
  k = jnp.ones((B, S, K, H), jnp.bfloat16)
  o, do = q + 1, q + 2
  stats = jnp.zeros((B, N, 2, T), jnp.float32)
  plan = AttentionPlan(scale=1.0, block_q=8, block_k=8)
  closed = jax.make_jaxpr(functools.partial(xla.xla_backward, plan))(
    q, k, k, None, Aux(), o, stats, do
  )
  o_var, do_var = closed.jaxpr.invars[-3], closed.jaxpr.invars[-1]
  readers, seen = set(), {o_var, do_var}
  for e in closed.jaxpr.eqns:  # what reads dO or O (or a reshape of them) outside the loop
    if any(v in seen for v in e.invars if not isinstance(v, Literal)):
      if e.primitive.name == "reshape":
        seen.update(e.outvars)
      else:
        readers.add(e.primitive.name)
  assert readers == {"while"}, readers  # the fori_loop over key blocks
