"""jaxact.top_k_distillation_loss against the student's full logits (``jaxact/_src/lce/
reference.py``: ``log_softmax``, the K entries gathered, the tails, the K + 1 buckets' divergences
from their definitions), differentiated by JAX: every divergence with a temperature, a soft cap,
a bias, a mask, hard labels and an overlapping last vocabulary block; K = 1 and K = V; a teacher
tail of 0, a student whose K entries hold all its mass; reductions and masks; bad input; and that
no (tokens, vocabulary) array is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.lce.reference import top_k_distillation_reference

from cases import assert_trees_close

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
B, T, D, V, K = 2, 5, 8, 37, 6  # V = 37 in blocks of 16: the last block overlaps


def _case(dtype=jnp.float64, k=K, seed=0):
  """The student's ``(x, w, b)``, a teacher's K entries a token (distinct, in random order) and
  their log-probabilities under its full softmax, labels and a mask."""
  keys = jax.random.split(jax.random.key(seed), 6)
  f = lambda key, shape, s=1.0: (s * jax.random.normal(key, shape, jnp.float64)).astype(dtype)
  x, w, b = f(keys[0], (B, T, D)), f(keys[1], (D, V), 0.7), f(keys[2], (V,), 0.3)
  teacher = jax.nn.log_softmax(1.5 * jax.random.normal(keys[3], (B, T, V), jnp.float64))
  idx = jnp.argsort(jax.random.uniform(keys[4], (B, T, V)), axis=-1)[..., :k]
  lp = jnp.take_along_axis(teacher, idx, axis=-1).astype(dtype)
  labels = jax.random.randint(keys[5], (B, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([T, 3])[:, None]
  return x, w, b, idx, lp, labels, mask


OPTIONS = {
  "plain": {},
  "all": dict(
    temperature=0.7,
    logit_soft_cap=3.0,
    hard_label_weight=0.3,
    divergence_weight=0.8,
    beta=0.3,
  ),
}


def _pair(idx, lp, labels, **kw):
  """``(ours, plain)`` as functions of ``(x, w, b)``."""
  if kw.get("divergence") != "jsd":
    kw.pop("beta", None)
  if kw.get("hard_label_weight"):
    kw["labels"] = labels

  def ours(x, w, b):
    return jaxact.top_k_distillation_loss(x, w, idx, lp, bias=b, vocab_block_size=16, **kw)[0]

  def plain(x, w, b):
    return top_k_distillation_reference(x, w, idx, lp, bias=b, **kw)

  return ours, plain


@pytest.mark.sample(2, "jsd-all")
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_float64_equals_autodiff_of_the_definitions(divergence, option):
  x, w, b, idx, lp, labels, mask = _case()
  ours, plain = _pair(idx, lp, labels, divergence=divergence, mask=mask, **OPTIONS[option])
  got = jax.jit(jax.value_and_grad(ours, range(3)))(x, w, b)
  want = jax.jit(jax.value_and_grad(plain, range(3)))(x, w, b)
  assert_trees_close(got, want, 1e-12)
  assert got[0].dtype == jnp.float64


@pytest.mark.sample(1, "KV-jsd")  # K = 1 and K = V
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("k", [1, V], ids=["K1", "KV"])
def test_one_entry_and_the_whole_vocabulary(k, divergence):
  """K = 1, and K = V, where both tails are empty."""
  x, w, b, idx, lp, labels, mask = _case(k=k)
  ours, plain = _pair(idx, lp, labels, divergence=divergence, mask=mask, temperature=1.3)
  got = jax.jit(jax.value_and_grad(ours, range(3)))(x, w, b)
  assert_trees_close(got, jax.jit(jax.value_and_grad(plain, range(3)))(x, w, b), 1e-12)


def test_the_whole_vocabulary_is_distillation_loss():
  """K = V: the stored entries are the teacher's whole distribution, and the forward KL is
  :func:`jaxact.distillation_loss`'s with a teacher whose logits are those log-probabilities."""
  x, w, b, idx, lp, _, mask = _case(k=V)
  sorted_lp = jnp.take_along_axis(lp, jnp.argsort(idx, axis=-1), -1)
  teacher_w = jnp.eye(V, dtype=jnp.float64)

  @jax.jit
  def both(x, w, b):
    full = jaxact.distillation_loss(x, w, sorted_lp, teacher_w, bias=b, mask=mask)[0]
    return full, jaxact.top_k_distillation_loss(x, w, idx, lp, bias=b, mask=mask)[0]

  full, ours = both(x, w, b)
  np.testing.assert_allclose(float(ours), float(full), rtol=1e-12)


@pytest.mark.sample(1, "bfloat16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_lower_precisions_against_the_float32_definition(dtype):
  """float32 within 1e-5 of the definition; bfloat16 inputs computed in float32 (the loss float32,
  each gradient its primal's dtype)."""
  x, w, b, idx, lp, _, mask = _case(dtype)
  kw = dict(divergence="jsd", mask=mask, logit_soft_cap=4.0)
  ours = lambda x, w, b: jaxact.top_k_distillation_loss(x, w, idx, lp, bias=b, **kw)[0]
  up = lambda a: a.astype(jnp.float32)
  plain = lambda x, w, b: top_k_distillation_reference(x, w, idx, up(lp), bias=b, **kw)
  got = jax.jit(jax.value_and_grad(ours, range(3)))(x, w, b)
  assert got[0].dtype == jnp.float32 and got[1][0].dtype == dtype
  want = jax.jit(jax.value_and_grad(plain, range(3)))(up(x), up(w), up(b))
  assert_trees_close(got, want, {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}[dtype])


def test_reductions_masks_and_the_teacher_frozen():
  """``"none"`` is each token's weighted terms (0 where masked), ``"sum"`` their sum, ``"mean"``
  over the counted tokens; masked positions are not read (out-of-range or repeated entries, NaN
  log-probabilities there) and get zero gradients; all masked gives 0 and zero gradients; the
  stored log-probabilities get zero gradients; a student equal to its teacher has loss 0."""
  x, w, b, idx, lp, labels, mask = _case()
  junk = ~mask[..., None]
  bad_idx = jnp.where(junk, jnp.full_like(idx, V + 3).at[..., 1].set(-1), idx)
  bad_lp = jnp.where(junk, jnp.nan, lp)
  kw = dict(divergence="reverse_kl", labels=labels, hard_label_weight=0.5, bias=b)

  def loss(x, lp, reduction, mask=mask):
    return jaxact.top_k_distillation_loss(x, w, bad_idx, lp, mask=mask, reduction=reduction, **kw)

  each, metrics = loss(x, bad_lp, "none")  # concrete: the junk is not checked where masked
  assert each.shape == (B, T) and np.all(np.asarray(each)[~np.asarray(mask)] == 0)
  assert metrics["divergence"].shape == (B, T) and np.all(np.asarray(metrics["divergence"]) >= 0)
  none = jnp.zeros((B, T), bool)
  clean = jnp.where(junk, 0.0, lp)

  @jax.jit
  def rest(x, lp):
    reduced = loss(x, lp, "sum")[0], loss(x, lp, "mean")[0]
    grads = jax.grad(lambda x, lp: loss(x, lp, "mean")[0], (0, 1))(x, clean)
    return reduced, grads, jax.value_and_grad(lambda x: loss(x, lp, "mean", none)[0])(x)

  (total, mean), (dx, dlp), (value, grads) = rest(x, bad_lp)
  np.testing.assert_allclose(float(total), float(jnp.sum(each)), rtol=1e-14)
  np.testing.assert_allclose(float(mean), float(jnp.sum(each)) / int(mask.sum()), rtol=1e-14)
  assert np.all(np.asarray(dx)[~np.asarray(mask)] == 0) and np.all(np.asarray(dlp) == 0)
  assert float(value) == 0 and np.all(np.asarray(grads) == 0)
  # the student is its teacher: the stored entries are its own top-k
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x, w) + b)
  top_lp, top = jax.lax.top_k(logp, K)
  same = jax.jit(
    lambda x: [
      jaxact.top_k_distillation_loss(x, w, top, top_lp, bias=b, divergence=d)[0]
      for d in DIVERGENCES
    ]
  )
  assert all(abs(float(v)) < 1e-14 for v in same(x))


def test_a_teacher_tail_of_zero():
  """A teacher whose K entries hold all its mass (tail exactly 0): the forward KL and the JSD
  finite and equal to the definition, the reverse KL +inf where the student's tail is not 0 (as
  documented)."""
  x, w, b, idx, _, labels, _ = _case()
  # their sum e^1e-9 > 1: the tail is exactly 0 (rounding of a stored top-k can do this)
  lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(9), (B, T, K), jnp.float64)) + 1e-9
  for divergence in ("forward_kl", "jsd"):
    ours, plain = _pair(idx, lp, labels, divergence=divergence)
    got = jax.jit(jax.value_and_grad(ours, range(3)))(x, w, b)
    assert_trees_close(got, jax.jit(jax.value_and_grad(plain, range(3)))(x, w, b), 1e-12)
  ours, _ = _pair(idx, lp, labels, divergence="reverse_kl")
  assert float(jax.jit(ours)(x, w, b)) == np.inf


@pytest.mark.parametrize(
  ("dtype", "gap", "tol"), [(jnp.float64, 1000.0, 1e-12), (jnp.float32, 30.0, 1e-5)]
)
def test_a_student_whose_entries_hold_its_mass(dtype, gap, tol):
  """The student's K entries hold all but e^-1000 of its mass (float64), or e^-30 (float32, where
  1 - Σ q_k rounds to 0): finite values and gradients, each divergence equal to the float64
  definition on the same inputs (its tail the log-sum-exp of the other entries)."""
  x, w, _, idx, _, _, _ = _case()
  keep = jnp.broadcast_to(idx[0, 0], (B, T, K))  # the same entries every token, a bias `gap` up
  lp = jnp.full((B, T, K), -np.log(K) - 0.5)
  x, w, lp = x.astype(dtype), (w * 0.01).astype(dtype), lp.astype(dtype)
  big = jnp.zeros((V,), dtype).at[idx[0, 0]].set(gap)

  @jax.jit
  def ours(x, w, b):
    def f(x, w, b, divergence):
      return jaxact.top_k_distillation_loss(x, w, keep, lp, bias=b, divergence=divergence)[0]

    return [jax.value_and_grad(f, range(3))(x, w, b, d) for d in DIVERGENCES]

  up = lambda a: a.astype(jnp.float64)
  want = jax.jit(
    lambda x, w, b: [
      top_k_distillation_reference(x, w, keep, up(lp), bias=b, divergence=d) for d in DIVERGENCES
    ]
  )(up(x), up(w), up(big))
  for (value, grads), expected in zip(ours(x, w, big), want, strict=True):
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_allclose(float(value), float(expected), rtol=tol)


def test_duplicates_under_jit_stay_finite():
  """Not checkable under jit (documented): a repeated entry counts per listing, finitely."""
  x, w, _, idx, lp, _, _ = _case()
  twice = idx.at[..., 1].set(idx[..., 0])
  f = jax.jit(lambda x: jaxact.top_k_distillation_loss(x, w, twice, lp - 1, divergence="jsd")[0])
  value, grad = jax.value_and_grad(f)(x)
  assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()


def _bad(name):
  x, w, b, idx, lp, _, mask = _case(jnp.float32)
  return {
    "K0": dict(teacher_indices=idx[..., :0], teacher_log_probs=lp[..., :0]),
    "K>V": dict(
      teacher_indices=jnp.zeros((B, T, V + 1), jnp.int32),
      teacher_log_probs=jnp.zeros((B, T, V + 1)),
    ),
    "idx shape": dict(teacher_indices=idx[:, :-1]),
    "lp shape": dict(teacher_log_probs=lp[..., :-1]),
    "idx float": dict(teacher_indices=idx.astype(jnp.float32)),
    "idx bool": dict(teacher_indices=idx > 3),
    "lp int": dict(teacher_log_probs=idx),
    "out of range": dict(teacher_indices=idx.at[1, 2, 0].set(V)),
    "negative": dict(teacher_indices=idx.at[0, 0, 3].set(-1)),
    "twice": dict(teacher_indices=idx.at[0, 1, 1].set(idx[0, 1, 4])),
    "positive lp": dict(teacher_log_probs=lp.at[0, 0, 0].set(0.1)),
    "nan lp": dict(teacher_log_probs=lp.at[0, 0, 0].set(jnp.nan)),
    "x features": dict(x=x[..., :-1]),
    "bias": dict(bias=b[:-1]),
    "mask dtype": dict(mask=mask.astype(jnp.int32)),
    "divergence": dict(divergence="kl"),
    "beta": dict(divergence="jsd", beta=1.0),
    "temperature": dict(temperature=0.0),
    "logit_soft_cap": dict(logit_soft_cap=-1.0),
    "labels": dict(hard_label_weight=0.5),
    "weight": dict(divergence_weight=True),
    "reduction": dict(reduction="max"),
    "w_layout": dict(w_layout="vv"),
  }[name], (x, w, idx, lp)


@pytest.mark.parametrize(
  ("case", "error", "match"),
  [
    ("K0", ValueError, "teacher_indices.*K = 0"),
    ("K>V", ValueError, "teacher_indices.*K = 38"),
    ("idx shape", ValueError, "teacher_indices.*shape"),
    ("lp shape", ValueError, "teacher_log_probs.*shape"),
    ("idx float", TypeError, "teacher_indices.*dtype float32"),
    ("idx bool", TypeError, "teacher_indices.*dtype bool"),
    ("lp int", TypeError, "teacher_log_probs.*dtype int"),
    ("out of range", ValueError, "teacher_indices.*outside \\[0, 37\\)"),
    ("negative", ValueError, "teacher_indices.*= -1"),
    ("twice", ValueError, "teacher_indices.*twice"),
    ("positive lp", ValueError, "teacher_log_probs.*above 0"),
    ("nan lp", ValueError, "teacher_log_probs.*NaN"),
    ("x features", ValueError, "`x` has 7 features"),
    ("bias", ValueError, "bias"),
    ("mask dtype", TypeError, "mask"),
    ("divergence", ValueError, "divergence"),
    ("beta", ValueError, "beta"),
    ("temperature", ValueError, "temperature"),
    ("logit_soft_cap", ValueError, "logit_soft_cap"),
    ("labels", ValueError, "labels"),
    ("weight", TypeError, "divergence_weight"),
    ("reduction", ValueError, "reduction"),
    ("w_layout", ValueError, "w_layout"),
  ],
)
def test_bad_input_names_the_argument(case, error, match):
  kwargs, (x, w, idx, lp) = _bad(case)
  x, w = kwargs.pop("x", x), kwargs.pop("w", w)
  idx, lp = kwargs.pop("teacher_indices", idx), kwargs.pop("teacher_log_probs", lp)
  with pytest.raises(error, match=f"top_k_distillation_loss.*{match}"):
    jaxact.top_k_distillation_loss(x, w, idx, lp, **kwargs)


def test_vd_layout_equals_dv():
  x, w, b, idx, lp, labels, mask = _case()
  kw = dict(divergence="jsd", mask=mask, labels=labels, hard_label_weight=0.2, bias=b)
  f = lambda x, w, layout: jaxact.top_k_distillation_loss(x, w, idx, lp, w_layout=layout, **kw)[0]
  dv = jax.value_and_grad(f, (0, 1))(x, w, "dv")
  vd = jax.value_and_grad(f, (0, 1))(x, w.T, "vd")
  assert_trees_close((vd[0], vd[1][0], vd[1][1].T), (dv[0], *dv[1]), 1e-13)


def test_no_tokens_by_vocabulary_array_in_the_compiled_step():
  """256 tokens, V 32768, K 32, D 64, float32: the compiled ``jit(grad)`` temp against one
  (tokens, V) float32 array and against the plain composition's; it scales with the block (the
  default here is V / 8 columns)."""
  t, v, k = 256, 32768, 32
  x = jax.ShapeDtypeStruct((t, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((64, v), jnp.float32)
  idx = jnp.broadcast_to(jnp.arange(k) * 997, (t, k))
  lp = jnp.full((t, k), -5.0, jnp.float32)

  def temp(f):
    return jax.jit(jax.grad(f, (0, 1))).lower(x, w).compile().memory_analysis().temp_size_in_bytes

  def ours(block):
    return lambda x, w: jaxact.top_k_distillation_loss(
      x, w, idx, lp, divergence="jsd", vocab_block_size=block
    )[0]

  plain = temp(lambda x, w: top_k_distillation_reference(x, w, idx, lp, divergence="jsd"))
  default, small = temp(ours(None)), temp(ours(1024))
  logits = t * v * 4
  assert plain >= 2 * logits and default < logits / 2 and small < logits / 8, (
    default,
    small,
    plain,
    logits,
  )


def _trl_without_tail(x, w, b, idx, lp, mask, divergence, beta, temperature, cap):
  """TRL's ``loss_add_tail=False`` (``trl/experimental/iw_opd/iw_opd_trainer.py``'s
  ``generalized_jsd_loss`` with a given support, ``server_distillation``'s forward KL), written on
  the student's full logits in plain jnp: the student's full log-softmax gathered at the teacher's
  entries, both set to -inf where the teacher's is -inf (``valid``), each renormalized by its
  log-sum-exp over the K, ``_jsd_divergence`` with that support mask, mean over the counted
  tokens."""
  z = jnp.einsum("btd,dv->btv", x, w) + b
  z = z if cap is None else cap * jnp.tanh(z / cap)
  student = jnp.take_along_axis(jax.nn.log_softmax(z / temperature), idx, -1)
  valid = lp > -jnp.inf
  student, teacher = jnp.where(valid, student, -jnp.inf), jnp.where(valid, lp, -jnp.inf)
  student = student - jax.nn.logsumexp(student, -1, keepdims=True)
  teacher = teacher - jax.nn.logsumexp(teacher, -1, keepdims=True)
  safe_s, safe_t = jnp.where(valid, student, 0), jnp.where(valid, teacher, 0)
  q, p = jnp.where(valid, jnp.exp(student), 0), jnp.where(valid, jnp.exp(teacher), 0)
  beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": beta}[divergence]
  if beta == 0:
    terms = p * (safe_t - safe_s)
  elif beta == 1:
    terms = q * (safe_s - safe_t)
  else:
    tiny = jnp.finfo(q.dtype).tiny
    m = jnp.where(valid, jnp.log(jnp.maximum((1 - beta) * q + beta * p, tiny)), 0)
    terms = beta * p * (safe_t - m) + (1 - beta) * q * (safe_s - m)
  per_token = jnp.sum(terms, -1)
  return jnp.sum(jnp.where(mask, per_token, 0)) / jnp.maximum(jnp.sum(mask), 1)


@pytest.mark.sample(1, "jsd")
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_without_the_tail_is_trls_renormalized_top_k(divergence):
  """``add_tail=False`` equals TRL's ``loss_add_tail=False`` transcribed on full logits, value and
  gradients (float64), under a temperature, a soft cap and a mask, with a teacher entry of -inf
  (left out of both sides) in one token; K = 1 gives 0."""
  x, w, b, idx, lp, _, mask = _case()
  lp = lp.at[0, 1, 2].set(-jnp.inf)
  kw = dict(divergence=divergence, beta=0.3, temperature=0.7)
  if divergence != "jsd":
    kw.pop("beta")

  def ours(x, w, b):
    return jaxact.top_k_distillation_loss(
      x,
      w,
      idx,
      lp,
      bias=b,
      mask=mask,
      logit_soft_cap=3.0,
      add_tail=False,
      vocab_block_size=16,
      **kw,
    )[0]

  def trl(x, w, b):
    return _trl_without_tail(x, w, b, idx, lp, mask, divergence, 0.3, 0.7, 3.0)

  got = jax.jit(jax.value_and_grad(ours, range(3)))(x, w, b)
  assert_trees_close(got, jax.jit(jax.value_and_grad(trl, range(3)))(x, w, b), 1e-12)
  assert float(got[0]) > 0
  one = jaxact.top_k_distillation_loss(x, w, idx[..., :1], lp[..., :1], add_tail=False, **kw)
  assert abs(float(one[0])) < 1e-15  # one entry each side: the same distribution
  with pytest.raises(TypeError, match=r"top_k_distillation_loss.*add_tail"):
    jaxact.top_k_distillation_loss(x, w, idx, lp, add_tail="no")
