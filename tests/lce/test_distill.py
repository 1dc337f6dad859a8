"""jaxact.distillation_loss against both models' full logits (``jaxact/_src/lce/reference.py``:
the KLs and GKD's generalized JSD from their definitions over ``jax.nn.log_softmax``),
differentiated by JAX: every divergence with temperature, soft caps, biases, a mask, hard labels
and an overlapping last vocabulary block; the teacher frozen; masked vocabularies and extreme
logits; bad input; and that no (tokens, vocabulary) array is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.lce.reference import distillation_reference

from cases import assert_trees_close

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
B, T, D, DT, V = 2, 5, 8, 6, 37  # V = 37 in blocks of 16: the last block overlaps


def _heads(dtype=jnp.float64, seed=0):
  k = jax.random.split(jax.random.key(seed), 7)
  f = lambda key, shape, s=1.0: (s * jax.random.normal(key, shape, jnp.float64)).astype(dtype)
  x, w, b = f(k[0], (B, T, D)), f(k[1], (D, V), 0.7), f(k[2], (V,), 0.3)
  xt, wt, bt = f(k[3], (B, T, DT)), f(k[4], (DT, V), 0.8), f(k[5], (V,), 0.3)
  labels = jax.random.randint(k[6], (B, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([T, 3])[:, None]
  return x, w, b, xt, wt, bt, labels, mask


OPTIONS = {
  "plain": {},
  "all": dict(
    temperature=0.7,
    logit_soft_cap=3.0,
    teacher_logit_soft_cap=4.0,
    hard_label_weight=0.3,
    divergence_weight=0.8,
    beta=0.3,
  ),
}


@pytest.mark.sample(1, "jsd-all", "reverse_kl-all")
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_float64_equals_autodiff_of_the_definitions(divergence, option):
  x, w, b, xt, wt, bt, labels, mask = _heads()
  kw = dict(OPTIONS[option], divergence=divergence, mask=mask)
  if "hard_label_weight" in kw:
    kw["labels"] = labels
  if divergence != "jsd":
    kw.pop("beta", None)

  def ours(x, w, b, xt, wt):
    return jaxact.distillation_loss(
      x, w, xt, wt, bias=b, teacher_bias=bt, vocab_block_size=16, **kw
    )[0]

  def plain(x, w, b, xt, wt):
    return distillation_reference(x, w, xt, wt, bias=b, teacher_bias=bt, **kw)

  got = jax.value_and_grad(ours, range(5))(x, w, b, xt, wt)
  want = jax.value_and_grad(plain, range(5))(x, w, b, xt, wt)
  assert_trees_close(got, want, 1e-12)
  assert all(np.all(np.asarray(g) == 0) for g in got[1][3:])  # the teacher is frozen


@pytest.mark.sample(1, "bfloat16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_lower_precisions_against_the_float32_definition(dtype):
  x, w, _, xt, wt, _, _, mask = _heads(dtype)
  ours = lambda x, w: jaxact.distillation_loss(x, w, xt, wt, divergence="jsd", mask=mask)[0]
  up = lambda a: a.astype(jnp.float32)
  plain = lambda x, w: distillation_reference(x, w, up(xt), up(wt), divergence="jsd", mask=mask)
  got = jax.value_and_grad(ours, (0, 1))(x, w)
  assert got[0].dtype == jnp.float32 and got[1][0].dtype == dtype
  want = jax.value_and_grad(plain, (0, 1))(up(x), up(w))
  assert_trees_close(got, want, {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}[dtype])


def test_a_student_equal_to_its_teacher_has_zero_divergence_and_gradient():
  x, w, b, *_ = _heads()
  for divergence in DIVERGENCES:
    f = lambda x, w, divergence=divergence: jaxact.distillation_loss(
      x, w, x, w, bias=b, teacher_bias=b, divergence=divergence
    )[0]
    loss, grads = jax.value_and_grad(f, (0, 1))(x, w)
    assert abs(float(loss)) < 1e-14
    assert all(float(jnp.max(jnp.abs(g))) < 1e-14 for g in grads)


def test_masked_vocabulary_and_extreme_logits_stay_finite():
  """A bias of -inf on the same entries of both heads (they count 0), and logits of +-1e9 equal
  in every column but the masked ones: the divergence is 0 and every gradient finite (no 0 * inf,
  no rounding of the log-sum-exp to the max's ulp)."""
  x, w, b, xt, wt, bt, _, _ = _heads()
  masked = jnp.where(jnp.arange(V) % 5 == 0, -jnp.inf, 0.0)
  for divergence in DIVERGENCES:
    f = lambda x, w, divergence=divergence: jaxact.distillation_loss(
      x, w, xt, wt, bias=b + masked, teacher_bias=bt + masked, divergence=divergence
    )[0]
    loss, grads = jax.value_and_grad(f, (0, 1))(x, w)
    want = distillation_reference(
      x, w, xt, wt, bias=b + masked, teacher_bias=bt + masked, divergence=divergence
    )
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-12)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[1])[:, ::5] == 0)  # the masked columns get nothing
  flat = jnp.zeros((D, V), jnp.float64)
  for level in (-1e9, 1e9):
    big = jnp.full((V,), level, jnp.float64)
    f = lambda x, w, big=big: jaxact.distillation_loss(
      x, w, xt, wt * 0, bias=big, teacher_bias=big
    )[0]
    loss, grads = jax.value_and_grad(f, (0, 1))(x, flat)
    assert float(loss) == 0.0 and all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(divergence="kl"), ValueError, "divergence"),
    (dict(divergence="jsd", beta=1.0), ValueError, "beta"),
    (dict(divergence="jsd", beta=0.0), ValueError, "beta"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(teacher_logit_soft_cap=-1.0), ValueError, "teacher_logit_soft_cap"),
    (dict(hard_label_weight=0.5), ValueError, "labels"),
    (dict(divergence_weight=True), TypeError, "divergence_weight"),
    (dict(reduction="max"), ValueError, "reduction"),
    (dict(teacher_x=jnp.zeros((B, T + 1, DT))), ValueError, "teacher_x"),
    (dict(teacher_w=jnp.zeros((DT, V + 1))), ValueError, "teacher_w.*student_pad_logit"),
    (dict(teacher_w=jnp.zeros((DT, V - 1)), student_pad_logit=0.0), ValueError, "teacher_w"),
    (dict(teacher_w=jnp.zeros((DT, V + 1)), student_pad_logit=np.inf), ValueError, "pad_logit"),
    (dict(teacher_w=jnp.zeros((DT, V + 1)), student_pad_logit="0"), TypeError, "pad_logit"),
    (dict(teacher_bias=jnp.zeros((V - 1,))), ValueError, "teacher_bias"),
    (dict(mask=jnp.ones((B, T), jnp.int32)), TypeError, "mask"),
  ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
  x, w, _, xt, wt, _, _, _ = _heads(jnp.float32)
  xt, wt = kwargs.pop("teacher_x", xt), kwargs.pop("teacher_w", wt)
  with pytest.raises(error, match=f"distillation_loss.*{match}"):
    jaxact.distillation_loss(x, w, xt, wt, **kwargs)


def test_no_tokens_by_vocabulary_array_in_the_compiled_step():
  """512 tokens, V 32768, a student of D 64 and a teacher of D 128, float32: the compiled
  ``jit(grad)`` temp against the plain composition's (both models' logits and softmaxes)."""
  t, v = 512, 32768
  x = jax.ShapeDtypeStruct((t, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((64, v), jnp.float32)
  xt, wt = jnp.zeros((t, 128), jnp.float32), jnp.zeros((128, v), jnp.float32)
  ours = lambda x, w: jaxact.distillation_loss(x, w, xt, wt)[0]
  plain = lambda x, w: distillation_reference(x, w, xt, wt)
  temp = lambda f: jax.jit(jax.grad(f, (0, 1))).lower(x, w).compile().memory_analysis()
  ours, plain = temp(ours).temp_size_in_bytes, temp(plain).temp_size_in_bytes
  logits = t * v * 4
  assert ours < logits / 2 and plain >= 2 * logits and ours < plain / 5


VT = V + 21  # the teacher's padded vocabulary: 21 extra columns, in blocks of 16 that overlap


def _liger(x, w, b, xt, wt, bt, labels, mask, divergence, beta, temperature, pad, cap, weights):
  """Liger-Kernel's ``LigerFusedLinearDistillationBase._compute_loss`` with its JSD's
  ``distillation_loss_fn`` (``chunked_loss/fused_linear_distillation.py``, ``jsd_loss.py``; beta
  0 and 1 its two KLs), in plain jnp on full logits: the hard loss on the student's unpadded
  logits at temperature 1, both logits divided by the temperature, the student's then padded on
  the right with `pad` to the teacher's vocabulary, ``F.kl_div(..., log_target=True)`` as
  ``exp(target) (target - input)`` (0 where ``exp(target)`` is, for a pad of -inf), each sum over
  the vocabulary masked, everything over the counted tokens. `cap` (not Liger's) soft-caps both
  heads first."""
  zs, zt = jnp.einsum("btd,dv->btv", x, w) + b, jnp.einsum("btd,dv->btv", xt, wt) + bt
  if cap is not None:
    zs, zt = cap * jnp.tanh(zs / cap), cap * jnp.tanh(zt / cap)
  hard = -jnp.take_along_axis(jax.nn.log_softmax(zs), labels[..., None], -1)[..., 0]
  zs, zt = zs / temperature, zt / temperature
  zs = jnp.concatenate([zs, jnp.full((*zs.shape[:-1], zt.shape[-1] - V), pad)], -1)
  ls, lt = jax.nn.log_softmax(zs), jax.nn.log_softmax(zt)

  def kl_div(inp, target):
    on = jnp.exp(target) > 0
    return jnp.where(on, jnp.exp(target) * (jnp.where(on, target, 0) - jnp.where(on, inp, 0)), 0)

  beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": beta}[divergence]
  if beta == 0:
    soft = kl_div(ls, lt)
  elif beta == 1:
    soft = kl_div(lt, ls)
  else:
    lm = jnp.logaddexp(ls + np.log(1 - beta), lt + np.log(beta))
    soft = beta * kl_div(lm, lt) + (1 - beta) * kl_div(lm, ls)
  count = jnp.maximum(jnp.sum(mask), 1)
  per_token = weights[0] * hard + weights[1] * jnp.sum(soft, -1)
  return jnp.sum(jnp.where(mask, per_token, 0)) / count


PADS = {  # (student_pad_logit, soft cap, temperature)
  "liger": (0.0, None, 0.7),
  "capped": (0.5, 3.0, 0.7),
  "-inf": (-np.inf, None, 1.3),
}


@pytest.mark.sample(2, "jsd-liger")
@pytest.mark.parametrize(
  "pad", [pytest.param(p, marks=pytest.mark.exhaustive) if p == "-inf" else p for p in PADS]
)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_a_larger_teacher_vocabulary_pads_the_student_as_liger(divergence, pad):
  """``student_pad_logit``: a teacher of 58 columns, a student of 37, equal to Liger-Kernel's
  padding transcribed on full logits, values and gradients in float64 (the teacher's extra
  columns in blocks that overlap), with hard labels, a mask and a temperature; a pad of -inf
  gives the student probability 0 there (a forward KL of +inf)."""
  value, cap, temperature = PADS[pad]
  x, w, b, xt, _, _, labels, mask = _heads()
  k = jax.random.split(jax.random.key(5), 2)
  wt = 0.8 * jax.random.normal(k[0], (DT, VT), jnp.float64)
  bt = 0.3 * jax.random.normal(k[1], (VT,), jnp.float64)
  kw = dict(divergence=divergence, temperature=temperature, mask=mask, labels=labels)
  kw.update(hard_label_weight=0.4, divergence_weight=0.6, student_pad_logit=value)
  kw.update(logit_soft_cap=cap, teacher_logit_soft_cap=cap)
  if divergence == "jsd":
    kw["beta"] = 0.3

  def ours(x, w, b):
    return jaxact.distillation_loss(
      x, w, xt, wt, bias=b, teacher_bias=bt, vocab_block_size=16, **kw
    )[0]

  def liger(x, w, b):
    args = (labels, mask, divergence, 0.3, temperature, value, cap, (0.4, 0.6))
    return _liger(x, w, b, xt, wt, bt, *args)

  got = jax.jit(jax.value_and_grad(ours, range(3)))(x, w, b)
  if pad == "-inf" and divergence == "forward_kl":
    assert float(got[0]) == np.inf
    return
  assert_trees_close(got, jax.jit(jax.value_and_grad(liger, range(3)))(x, w, b), 1e-12)


@pytest.mark.exhaustive
def test_a_larger_teacher_vocabulary_builds_no_tokens_by_vocabulary_array():
  """The padded student's columns are computed in the loop: a teacher of V + 4096 columns keeps
  the compiled temp under half of one (tokens, V) float32 array."""
  t, v = 512, 32768
  x = jax.ShapeDtypeStruct((t, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((64, v), jnp.float32)
  xt, wt = jnp.zeros((t, 128), jnp.float32), jnp.zeros((128, v + 4096), jnp.float32)
  ours = lambda x, w: jaxact.distillation_loss(x, w, xt, wt, student_pad_logit=0.0)[0]
  temp = jax.jit(jax.grad(ours, (0, 1))).lower(x, w).compile().memory_analysis()
  assert temp.temp_size_in_bytes < t * v * 4 / 2, temp.temp_size_in_bytes
