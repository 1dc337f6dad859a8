"""The attention kernels (``pallas_kernels.attention_triton``): FlashAttention-2's forward and
backward as Pallas Triton kernels.

On CPU the kernels run in Pallas interpret mode, against :func:`attention_reference` (the same
semantics over the whole T x S logits, in the same dtype) and against the float64 autodiff of an
independent formula: ``jax.nn.dot_product_attention(implementation="xla")`` for the rows that see a
key (it averages the values for a row that sees none, where the kernels give 0), a plain softmax
under a soft cap (jax.nn has none). Rows without keys: o = 0, stats 0, zero gradients. Blocks
outside the mask hold NaN and the outputs that do not depend on them stay finite: the loops skip
them. For CUDA: forward and backward lowered, and compiled for an A100 and an H100 at B 4,
T = S = 2048 through XLA's GPU compiler with its register-spill check, with no T x S buffer in the
program.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from kernel_cases import TRITON, lowered_text, needs_gpu_compiler
from pallas_kernels import attention_triton as kernels

from cases import representatives

F64 = jnp.float64
# Largest error allowed, relative to the largest entry of the float64 result (o, dq, dk, dv): the
# kernels round P (and dS) to the operands' dtype before their dots, and the outputs to theirs.
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
LSE_TOL = 1e-5  # stats are float32 from float32 logits in every dtype (relative to max(1, |lse|))


@dataclasses.dataclass(frozen=True)
class Case:
  t: int = 40
  s: int = 40
  heads: tuple[int, int] = (4, 2)  # N query heads, K kv heads
  h: int = 16
  dtype: type = jnp.float32
  causal: bool = False
  window: tuple[int, int] | None = None
  soft_cap: float | None = None
  q_lengths: tuple[int, ...] | None = None
  kv_lengths: tuple[int, ...] | None = None
  b: int = 2

  @property
  def options(self) -> dict:
    return dict(scale=self.h**-0.5, causal=self.causal, window=self.window, soft_cap=self.soft_cap)


def operands(case: Case, seed: int = 0):
  """q, k, v, the cotangent do (unit normal) and the lengths arrays, as numpy arrays: the tests
  compute on them in numpy, which compiles nothing (each eager jax operation compiles)."""
  n, k = case.heads
  rng = np.random.default_rng(seed)
  shapes = [(case.b, case.t, n, case.h), (case.b, case.s, k, case.h), (case.b, case.s, k, case.h)]
  q, kk, v, do = (
    rng.standard_normal(s, np.float32).astype(case.dtype) for s in (*shapes, shapes[0])
  )
  lengths = [
    None if x is None else np.asarray(x, np.int32) for x in (case.q_lengths, case.kv_lengths)
  ]
  return q, kk, v, do, *lengths


def quick(fn, *args, **static):
  """``jax.jit(fn, static)(*args)`` as numpy arrays, compiled without LLVM's optimizations, once
  for each `static` and argument shapes: XLA's CPU compiler takes most of these tests' time (an
  interpreted kernel's program above all), and the programs run for milliseconds."""
  avals = tuple(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)
  out = _quick(fn, tuple(static.items()), avals)(*args)
  return jax.tree.map(np.asarray, out)


@functools.cache
def _quick(fn, static: tuple, avals: tuple):
  call = functools.partial(fn, **dict(static))
  return jax.jit(call).lower(*avals).compile({"xla_backend_optimization_level": 0})


def reference(q, k, v, q_lengths=None, kv_lengths=None, *, case: Case):
  """attention_reference with `case`'s options."""
  return quick(kernels.attention_reference, q, k, v, q_lengths, kv_lengths, **case.options)


def kernel_results(case: Case, args):
  """o, stats, dq, dk, dv from the kernels in interpret mode, blocks of 16."""
  return quick(_kernels, *args, options=tuple(case.options.items()))


def _kernels(q, k, v, do, ql, kl, *, options):
  opts = dict(options, block_q=16, block_k=16, interpret=True)
  o, stats = kernels.attention_forward(q, k, v, ql, kl, **opts)
  return (o, stats, *kernels.attention_backward(q, k, v, o, stats, do, ql, kl, **opts))


def seen(case: Case) -> np.ndarray:
  """(B, T, S) numpy mask of the keys each row sees, written from the definitions."""
  t = np.arange(case.t)[None, :, None]
  u = np.arange(case.s)[None, None, :]
  ok = np.ones((case.b, case.t, case.s), bool)
  if case.causal:
    ok &= u <= t
  if case.window is not None:
    ok &= (u >= t - case.window[0]) & (u <= t + case.window[1])
  if case.q_lengths is not None:
    ok &= t < np.asarray(case.q_lengths)[:, None, None]
  if case.kv_lengths is not None:
    ok &= u < np.asarray(case.kv_lengths)[:, None, None]
  return ok


def plain_attention(case: Case, q, k, v):
  """softmax(cap(scale q k^T) masked) v in float64 for the rows that see a key, written out."""
  n, kv = case.heads
  k, v = (jnp.repeat(x, n // kv, axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * case.options["scale"]
  if case.soft_cap is not None:
    s = case.soft_cap * jnp.tanh(s / case.soft_cap)
  s = jnp.where(seen(case)[:, None], s, jnp.finfo(F64).min)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def float64_results(case: Case, args, formula: str | None = None):
  """o, lse, dq, dk, dv in float64 by autodiff of `formula`, the cotangent zero on rows that see no
  key: "jax.nn" (``jax.nn.dot_product_attention(implementation="xla")``, whose softmax is float32
  whatever the inputs), "plain" (:func:`plain_attention`), "reference"
  (:func:`attention_reference`); by default jax.nn, the plain formula under a soft cap."""
  formula = formula or ("plain" if case.soft_cap is not None else "jax.nn")
  return quick(_float64_results, *args, case=case, formula=formula)


def _float64_results(q, k, v, do, ql, kl, *, case: Case, formula: str):
  q, k, v, do = (x.astype(F64) for x in (q, k, v, do))
  rows = seen(case).any(-1)  # (B, T)
  do = jnp.where(rows[:, :, None, None], do, 0.0)

  def f(q, k, v):
    if formula == "reference":
      return kernels.attention_reference(q, k, v, ql, kl, **case.options)[0]
    if formula == "plain":
      return plain_attention(case, q, k, v)
    return jax.nn.dot_product_attention(
      q,
      k,
      v,
      scale=case.options["scale"],
      is_causal=case.causal,
      query_seq_lengths=ql,
      key_value_seq_lengths=kl,
      local_window_size=case.window,
      implementation="xla",
    )

  o, pull = jax.vjp(f, q, k, v)
  o = jnp.where(rows[:, :, None, None], o, 0.0)
  return (o, logsumexp(case, q, k), *pull(do))


def logsumexp(case: Case, q, k):
  """(B, N, T) float64 log-sum-exp of the logits each row sees; -inf where it sees none."""
  n, kv = case.heads
  s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, n // kv, axis=2)) * case.options["scale"]
  if case.soft_cap is not None:
    s = case.soft_cap * jnp.tanh(s / case.soft_cap)
  return jax.nn.logsumexp(jnp.where(seen(case)[:, None], s, -jnp.inf), axis=-1)


def assert_close(got, want, dtype, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), f"{what}: not finite"
  scale = max(float(np.max(np.abs(want))), 1e-30)
  err = float(np.max(np.abs(got - want))) / scale
  assert err <= TOL[dtype], f"{what}: error {err:.2e} of max |want| (tolerance {TOL[dtype]:.0e})"


def stats_lse(stats, case: Case) -> np.ndarray:
  """The log-sum-exp (B, N, T) in float64 from the kernels' stats (B, N, 2, T): the row maximum in
  z's units, then the log of the sum."""
  stats = np.asarray(stats, np.float64)
  unit = case.soft_cap if case.soft_cap is not None else case.options["scale"]
  return unit * stats[:, :, 0] + stats[:, :, 1]


def assert_lse(stats, want, case: Case):
  """The stats against a log-sum-exp `want`; the rows without keys (-inf there) keep (0, 0)."""
  got = stats_lse(stats, case)
  want = np.asarray(want, np.float64)
  empty = np.isneginf(want)
  assert np.all(np.asarray(stats)[:, :, 0][empty] == 0)
  assert np.all(np.asarray(stats)[:, :, 1][empty] == 0)
  finite = np.isfinite(want)
  err = np.abs(got[finite] - want[finite]) / np.maximum(1.0, np.abs(want[finite]))
  assert err.size == 0 or err.max() <= LSE_TOL, f"lse: error {err.max():.2e}"


# ------------------------------------------------------------------- interpret mode, values

CASES = {
  # The default suite: every feature, several at once. Batch 1 sees no key at all; batch 0 has
  # rows past q_lengths and keys past kv_lengths; T < S.
  "gqa-causal-lengths-softcap-bfloat16": Case(
    t=24,
    dtype=jnp.bfloat16,
    causal=True,
    h=32,
    soft_cap=1.0,
    q_lengths=(19, 24),
    kv_lengths=(17, 0),
  ),
  # T > S: rows past S + 2 see no key in a (2, 2) window; neither length is a block multiple
  "mqa-ragged-window-2-2": Case(heads=(4, 1), t=70, s=61, window=(2, 2)),
  # the rest under -m exhaustive
  "softcap-causal-t<s-bfloat16": Case(t=24, dtype=jnp.bfloat16, causal=True, soft_cap=1.0),
  "gqa-causal-bfloat16": Case(dtype=jnp.bfloat16, causal=True, h=32),
  "mqa-window-3-0": Case(heads=(4, 1), window=(3, 0)),
  "ragged-window-2-2": Case(t=37, s=29, window=(2, 2)),
  "lengths-causal": Case(causal=True, q_lengths=(23, 40), kv_lengths=(17, 0)),
  "mha-float32": Case(heads=(4, 4), t=33),
  "mha-float16": Case(heads=(4, 4), dtype=jnp.float16),
  "gqa-window-2-2-float16": Case(window=(2, 2), dtype=jnp.float16),
  "mqa-causal-t>s": Case(heads=(4, 1), t=40, s=23, causal=True),
  "causal-window-5-3": Case(causal=True, window=(5, 3), t=31, s=40),
  "window-0-6": Case(window=(0, 6)),
  "window-negative": Case(window=(-2, 7)),
  "window-wide": Case(window=(100, 2**40), t=29),
  "lengths": Case(q_lengths=(0, 31), kv_lengths=(40, 9)),
  "lengths-window-bfloat16": Case(
    window=(4, 1), q_lengths=(35, 20), kv_lengths=(11, 38), dtype=jnp.bfloat16
  ),
  "softcap": Case(soft_cap=0.5),
  "softcap-window-mqa-float16": Case(
    heads=(4, 1), soft_cap=2.0, window=(3, 3), dtype=jnp.float16, t=29, s=37
  ),
  "softcap-lengths-causal": Case(
    soft_cap=1.5, causal=True, q_lengths=(40, 7), kv_lengths=(30, 40), h=32
  ),
  "h64-causal-bfloat16": Case(h=64, causal=True, t=48, s=48, b=1),
  "one-block": Case(t=9, s=11, causal=True),
}
DEFAULT = {"gqa-causal-lengths-softcap-bfloat16"}


@pytest.mark.parametrize("name", representatives(list(CASES), DEFAULT))
def test_kernels_match_the_reference_and_float64_autodiff(name):
  case = CASES[name]
  args = operands(case)
  got = kernel_results(case, args)
  # The reference in the kernels' dtype: the same rounding, another order of summation.
  ref_o, ref_lse = reference(*args[:3], *args[4:], case=case)
  assert ref_o.dtype == got[0].dtype == case.dtype and got[1].dtype == jnp.float32
  assert_close(got[0], ref_o, case.dtype, "o against attention_reference")
  assert_lse(got[1], ref_lse, case)
  # float64 autodiff of the independent formula; the kernels' rows without keys are exact zeros.
  want = float64_results(case, args)
  like = (args[0], *args[:3])
  for what, g, w, x in zip(
    ("o", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:]), like, strict=True
  ):
    assert g.shape == x.shape and g.dtype == case.dtype, what
    assert_close(g, w, case.dtype, what)
  assert_lse(got[1], want[1], case)
  none = ~seen(case).any(-1)  # (B, T)
  assert np.all(np.asarray(got[0], np.float32)[none] == 0)
  assert np.all(np.asarray(got[2], np.float32)[none] == 0)


@pytest.mark.parametrize(
  "name",
  representatives(
    ["lengths-causal", "ragged-window-2-2", "softcap-causal-t<s-bfloat16"], {"lengths-causal"}
  ),
)
@pytest.mark.parametrize(
  "formula,tol", [("plain", 1e-12), pytest.param("jax.nn", 1e-6, marks=pytest.mark.exhaustive)]
)
def test_the_reference_matches_float64_autodiff(name, formula, tol):
  """attention_reference's own values and gradients in float64, against the plain formula to
  float64's precision and against jax.nn to float32's (its softmax is float32)."""
  case = CASES[name]
  if formula == "jax.nn" and case.soft_cap is not None:
    pytest.skip("jax.nn has no soft cap")
  args = operands(case)
  got = float64_results(case, args, formula="reference")
  want = float64_results(case, args, formula=formula)
  for what, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{what} against {formula}")


def test_rows_that_see_no_key_give_zero_and_huge_logits_stay_finite():
  """Logits of 1e32 (float32's largest is 3.4e38): the running maximum keeps exp from overflowing,
  rows past S + 2 (which see no key in the (2, 2) window) give o = 0, stats (0, 0) and no gradient,
  with a nonzero cotangent on them. (A default case's program, other inputs.)"""
  case = CASES["mqa-ragged-window-2-2"]
  q, k, v, do, _, _ = operands(case, seed=3)
  q = q * 1e16
  k = k * 1e16
  o, stats, dq, dk, dv = kernel_results(case, (q, k, v, do, None, None))
  for what, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(np.isfinite(x)), what
  none = ~seen(case).any(-1)  # (B, T): rows 63 .. 69
  assert none.sum() == 2 * 7
  assert np.all(o[none] == 0) and np.all(dq[none] == 0)
  rows = np.transpose(stats, (0, 3, 1, 2))  # (B, T, N, 2)
  assert np.all(rows[none] == 0) and np.all(np.isfinite(stats))
  assert float(np.max(np.abs(stats_lse(stats, case)))) > 1e31
  # the softmax is one-hot: each row's output is the value of its largest logit, exactly
  np.testing.assert_array_equal(o, reference(q, k, v, case=case)[0])


def test_blocks_outside_the_window_are_never_read():
  """A (2, 2) window over T = 70 rows and S = 61 keys in blocks of 16 (row t sees keys t - 2 ..
  t + 2): NaN in a block of keys that no row of a query block sees, or in a block of rows that see
  none of a key block's keys, must not reach that block's results, bit for bit. Computing such a
  block and masking it would: P = 0 times a NaN value is NaN. (A default case's program.)"""
  case = CASES["mqa-ragged-window-2-2"]
  q, k, v, do, _, _ = operands(case, seed=5)
  clean = kernel_results(case, (q, k, v, do, None, None))

  def poison(x, first, end):
    inside = (np.arange(x.shape[1]) >= first) & (np.arange(x.shape[1]) < end)
    return np.where(inside[None, :, None, None], np.nan, x).astype(x.dtype)

  def same(got, want, rows):
    for g, w, axis in zip(got, want, (1, 3, 1), strict=True):  # o, stats, dq
      np.testing.assert_array_equal(np.take(g, rows, axis), np.take(w, rows, axis))

  # key block 0 (keys 0 .. 15): query blocks 2 .. 4 (rows 32 ..) see keys from 30 on
  got = kernel_results(case, (q, poison(k, 0, 16), poison(v, 0, 16), do, None, None))
  same(got[:3], clean[:3], range(32, 70))
  # key block 3 (keys 48 .. 60): query blocks 0, 1 (rows .. 31) see keys up to 33
  got = kernel_results(case, (q, poison(k, 48, 61), poison(v, 48, 61), do, None, None))
  same(got[:3], clean[:3], range(0, 32))
  # query blocks 0 and 4 (rows 0 .. 15, 64 .. 69): key blocks 2, 3 (keys 32 ..) are seen by rows
  # 30 .. 62 only
  rows = lambda x: poison(poison(x, 0, 16), 64, 70)
  got = kernel_results(case, (rows(q), k, v, rows(do), None, None))
  for g, w in zip(got[3:], clean[3:], strict=True):  # dk, dv
    np.testing.assert_array_equal(g[:, 32:], w[:, 32:])
    assert np.all(np.isfinite(w))


def _grids(fn, *args) -> list[tuple]:
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [e.params["grid_mapping"].grid for e in jaxpr.eqns if e.primitive.name == "pallas_call"]


def test_the_callers_tiles_replace_the_block_config():
  case = Case(t=100, s=70, heads=(4, 2), h=32)
  q, k, v, do, _, _ = operands(case)
  opts = dict(scale=0.1, block_q=32, block_k=64, num_warps=2, num_stages=1)
  o, stats = jax.eval_shape(lambda *a: kernels.attention_forward(*a, **opts), q, k, v)
  assert o.shape == q.shape and o.dtype == q.dtype
  assert stats.shape == (2, 4, 2, 100) and stats.dtype == jnp.float32
  assert _grids(lambda *a: kernels.attention_forward(*a, **opts), q, k, v) == [(4, 2, 4)]
  bwd = lambda *a: kernels.attention_backward(*a, **opts)
  assert _grids(bwd, q, k, v, o, stats, do) == [
    (4, 2, 4),
    (2, 2, 2),
  ]  # dq by 32 rows, dk by 64 keys
  cfg = kernels.block_config(q.shape, k.shape, q.dtype)
  default = [(-(-100 // cfg.dq.block_q), 2, 4), (-(-70 // cfg.dkv.block_k), 2, 2)]
  assert (
    _grids(lambda *a: kernels.attention_backward(*a, scale=0.1), q, k, v, o, stats, do) == default
  )


# ------------------------------------------------------------------------------ the errors


def _call(q_shape=(2, 8, 4, 16), k_shape=(2, 8, 2, 16), dtype=jnp.float32, **kw):
  q = jax.ShapeDtypeStruct(q_shape, kw.pop("q_dtype", dtype))
  k = jax.ShapeDtypeStruct(k_shape, dtype)
  v = jax.ShapeDtypeStruct(kw.pop("v_shape", k_shape), dtype)
  lengths = kw.pop("lengths", (None, None))
  kw.setdefault("scale", 0.25)
  return jax.eval_shape(lambda q, k, v: kernels.attention_forward(q, k, v, *lengths, **kw), q, k, v)


@pytest.mark.parametrize(
  "kw,error,match",
  [
    (
      dict(q_shape=(2, 8, 16)),
      ValueError,
      r"`q` must be \(B, L, heads, H\); got q.shape=\(2, 8, 16\)",
    ),
    (dict(q_dtype=jnp.bfloat16), TypeError, "`q`, `k` and `v` must have one dtype; got bfloat16"),
    (
      dict(k_shape=(2, 8, 3, 16)),
      ValueError,
      "K dividing q's N; got q.shape=.*k.shape=.2, 8, 3, 16",
    ),
    (dict(k_shape=(2, 8, 2, 32)), ValueError, r"head dimensions differ \(q 16, k 32, v 32\)"),
    (dict(v_shape=(2, 8, 2, 32)), ValueError, "`k` and `v` must be"),
    (dict(q_shape=(2, 8, 4, 48), k_shape=(2, 8, 2, 48)), ValueError, "head dimension 48"),
    (dict(dtype=jnp.float64), ValueError, "dtype float64 .the kernels take float32, bfloat16"),
    (dict(scale=jnp.float32(0.5)), TypeError, "`scale` must be a positive finite Python number"),
    (dict(scale=-0.5), ValueError, "`scale` must be a positive finite Python number; got -0.5"),
    (dict(soft_cap=-1.0), ValueError, "`soft_cap` must be None or a positive finite"),
    (dict(window=(1, 2, 3)), ValueError, r"`window` must be None or a \(left, right\) pair"),
    (dict(block_q=24), ValueError, "`block_q` must be a power of two >= 16; got 24"),
    (dict(block_k=8), ValueError, "`block_k` must be a power of two >= 16; got 8"),
    (dict(num_warps=3), ValueError, "`num_warps` must be a power of two; got 3"),
    (
      dict(lengths=(jnp.zeros((3,), jnp.int32), None)),
      ValueError,
      r"`q_lengths` must be an integer array of shape \(2,\); got shape \(3,\)",
    ),
    (
      dict(lengths=(None, jnp.zeros((2,), jnp.float32))),
      ValueError,
      "`kv_lengths` must be an integer array.*dtype float32",
    ),
  ],
)
def test_bad_calls_raise_naming_the_argument(kw, error, match):
  with pytest.raises(error, match=match):
    _call(**kw)


def test_backward_checks_what_the_forward_returned():
  q, k = (
    jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32),
    jax.ShapeDtypeStruct((2, 8, 2, 16), jnp.float32),
  )
  stats = jax.ShapeDtypeStruct((2, 4, 2, 8), jnp.float32)
  bad = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)  # one lse a row, as before the stats
  bwd = lambda *a: kernels.attention_backward(*a, scale=0.25)
  with pytest.raises(
    ValueError, match=r"`stats` must have shape \(2, 4, 2, 8\); got stats.shape=\(2, 4, 8\)"
  ):
    jax.eval_shape(bwd, q, k, k, q, bad, q)
  with pytest.raises(TypeError, match="`stats` must be float32; got bfloat16"):
    jax.eval_shape(bwd, q, k, k, q, jax.ShapeDtypeStruct((2, 4, 2, 8), jnp.bfloat16), q)
  dq, dk, dv = jax.eval_shape(bwd, q, k, k, q, stats, q)
  assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_unsupported_says_why():
  ok = ((4, 2048, 16, 128), (4, 2048, 4, 128))
  for h in (16, 32, 64, 128, 256):
    assert kernels.attention_unsupported((1, 8, 2, h), (1, 8, 1, h), jnp.bfloat16) is None
  assert kernels.attention_unsupported(*ok, jnp.float32, v_shape=ok[1]) is None
  assert "dtype float64" in kernels.attention_unsupported(*ok, jnp.float64)
  for h in (8, 48, 96, 512):
    why = kernels.attention_unsupported((1, 8, 2, h), (1, 8, 1, h), jnp.float16)
    assert f"head dimension {h}" in why
  why = kernels.attention_unsupported(*ok, jnp.bfloat16, v_shape=(4, 2048, 4, 64))
  assert "head dimensions differ (q 128, k 128, v 64)" in why
  # exact float32 dots spill registers: TF32 (the default precision, as XLA's on GPU) only
  assert "exact float32 dots (precision 'highest'" in kernels.attention_unsupported(
    *ok, jnp.float32, precision="highest"
  )
  assert kernels.attention_unsupported(*ok, jnp.bfloat16, precision="highest") is None
  with jax.default_matmul_precision("highest"):
    assert "exact float32 dots" in kernels.attention_unsupported(*ok, jnp.float32)
  with pytest.raises(ValueError, match="the kernels cannot take exact float32 dots"):
    _call(precision=jax.lax.Precision.HIGHEST)


# ------------------------------------------------------------------- compiled for the GPUs


def test_the_kernels_lower_to_three_triton_calls_for_cuda():
  """Lowering for an abstract A100 needs no CUDA plugin (jax 0.11, which the GPU machines carry,
  lowers here too): the forward and the two backward kernels, with every option."""
  opts = dict(scale=0.1, causal=True, window=(64, 0), soft_cap=30.0)

  def f(q, k, v, do, ql, kl):
    o, stats = kernels.attention_forward(q, k, v, ql, kl, **opts)
    return kernels.attention_backward(q, k, v, o, stats, do, ql, kl, **opts)

  shapes = [(2, 200, 4, 128), (2, 200, 2, 128), (2, 200, 2, 128), (2, 200, 4, 128)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  args += [jax.ShapeDtypeStruct((2,), jnp.int32)] * 2
  with jax.enable_x64(False):
    text = lowered_text(f, args, kind="A100")
  assert text.count(f"@{TRITON}(") == 3


def _training_kernels(options: dict, lengths: bool):
  def f(q, k, v, do, *ls):
    ql, kl = ls if lengths else (None, None)
    o, stats = kernels.attention_forward(q, k, v, ql, kl, **options)
    return o, stats, kernels.attention_backward(q, k, v, o, stats, do, ql, kl, **options)

  return f


# (gpu, head dim, kv heads, dtype, options): B 4, T = S = 2048, 16 query heads; every row of the
# block config's tables, causal alone and with a window, a soft cap and lengths (Gemma 2's).
_COMPILED = [
  (gpu, h, kv, dt, opts)
  for gpu in ("A100", "H100")
  for h, kv, dt, opts in [
    *(
      (h, 4, dt, opts)
      for h in (16, 32, 64, 128, 256)
      for dt in (jnp.bfloat16, jnp.float32)
      for opts in ("causal", "gemma")
    ),
    (128, 4, jnp.float16, "causal"),
    (128, 16, jnp.bfloat16, "causal"),
    (128, 1, jnp.bfloat16, "plain"),
  ]
]
_OPTIONS = {
  "causal": dict(causal=True),
  "plain": dict(),
  "gemma": dict(causal=True, window=(1024, 0), soft_cap=50.0, lengths=True),
}


@needs_gpu_compiler
@pytest.mark.parametrize(
  "gpu,h,kv,dtype,options",
  representatives(
    _COMPILED,
    # the A100: less shared memory (164 KiB) than an H100 (227 KiB) for the same tiles
    {"A100-128-4-bfloat16-causal"},
    ids=[f"{g}-{h}-{kv}-{jnp.dtype(d).name}-{o}" for g, h, kv, d, o in _COMPILED],
  ),
)
def test_the_kernels_compile_without_spills_and_keep_no_t_by_s_buffer(gpu, h, kv, dtype, options):
  b, t, n = 4, 2048, 16
  opts = dict(_OPTIONS[options])
  lengths = opts.pop("lengths", False)
  fn = _training_kernels(dict(scale=h**-0.5, **opts), lengths)
  shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)]
  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  args += [jax.ShapeDtypeStruct((b,), jnp.int32)] * (2 if lengths else 0)
  with jax.enable_x64(False):  # as a GPU user's program: 32-bit index arithmetic
    # NO_SPILLS: XLA fails a kernel ptxas spilled registers for; Triton fails one asking for more
    # shared memory than the GPU has.
    compiled = support.compile_for(fn, args, support.GPUS[gpu], support.NO_SPILLS)
  assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') == 3
  # Temp holds delta (B, N, T) float32 and little else: one (T, S) float32 tile is 16 MiB.
  delta = b * n * t * 4
  assert compiled.memory_analysis().temp_size_in_bytes <= delta + 2**16
  assert math.prod((t, t)) * 4 > 16 * (delta + 2**16)
