"""The LM head's losses under a temperature, in float32 against float64 formulas written here.

The temperature multiplies differences to each row's max (never a logit: a logit recomputed in the
backward an ulp apart from the forward's is ``1 / T`` ulps apart once divided), so the float32
gradients keep their accuracy as ``T`` falls, and a ``T`` of float32's smallest normal (``1e-38``)
gives the finite values the formula gives. The inputs are dyadic numbers whose products float32
holds exactly: the logits are exact and every error measured is the algorithm's, compared with
the plain composition's (the logits divided by ``T``, then ``log_softmax``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

N, D, V, K, BLOCK = 128, 32, 512, 8, 128
TEMPERATURES = (1.0, 0.1, 0.01, 1e-3)


def dyadic(seed=0):
  """``x, w, tokens, cotangent, teacher_x, teacher_w``: a student and a teacher near it, each
  value ``i / 2^k`` so that every logit is exact in float32."""
  r = np.random.default_rng(seed)
  x = r.integers(-128, 129, (N, D)) / 128
  w = r.integers(-256, 257, (D, V)) / 2048
  xt = np.clip(x * 128 + r.integers(-32, 33, (N, D)), -128, 128) / 128
  wt = np.clip(w * 2048 + r.integers(-64, 65, (D, V)), -256, 256) / 2048
  tokens = jnp.asarray(r.integers(0, V, N), jnp.int32)
  c = r.integers(-64, 65, N) / 64
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  return f32(x), f32(w), tokens, f32(c), f32(xt), f32(wt)


def _log_softmax(x, w, t):
  return jax.nn.log_softmax((x @ w) / t, axis=-1)


def _kl(la, lb):
  """``Σ a (log a - log b)`` a row, 0 where ``a = 0``."""
  ok = la > -jnp.inf
  return jnp.sum(jnp.where(ok, jnp.exp(la) * (jnp.where(ok, la, 0) - lb), 0), -1)


def plain_loss(name, t, tokens, c, xt, wt, top):
  """The plain composition of `name` at temperature `t`, a function of ``(x, w)``."""
  beta = 0.5

  def loss(x, w):
    lq = _log_softmax(x, w, t)
    if name == "log_probs":
      return jnp.sum(c * jnp.take_along_axis(lq, tokens[:, None], -1)[:, 0])
    if name == "top_k":
      idx, lp = top
      inside = jnp.sum(jax.nn.one_hot(idx, V, dtype=bool), -2)
      lq_tail = jax.nn.logsumexp(jnp.where(inside, -jnp.inf, lq), -1)
      lp_tail = jnp.log(-jnp.expm1(jnp.minimum(jax.nn.logsumexp(lp, -1), -1e-30)))
      lq_b = jnp.concatenate([jnp.take_along_axis(lq, idx, -1), lq_tail[:, None]], -1)
      return jnp.mean(_kl(jnp.concatenate([lp, lp_tail[:, None]], -1).astype(lq.dtype), lq_b))
    lp = _log_softmax(xt.astype(x.dtype), wt.astype(x.dtype), t)
    if name == "forward_kl":
      return jnp.mean(_kl(lp, lq))
    if name == "reverse_kl":
      return jnp.mean(_kl(lq, lp))
    lm = jnp.logaddexp(float(np.log(beta)) + lp, float(np.log1p(-beta)) + lq)
    return jnp.mean(beta * _kl(lp, lm) + (1 - beta) * _kl(lq, lm))

  return loss


def jaxact_loss(name, t, tokens, c, xt, wt, top):
  if name == "log_probs":
    opts = dict(temperature=t, vocab_block_size=BLOCK)
    return lambda x, w: jnp.sum(c * jaxact.linear_log_probs(x, w, tokens, **opts))
  if name == "top_k":
    idx, lp = top
    return lambda x, w: jaxact.top_k_distillation_loss(
      x, w, idx, lp, temperature=t, vocab_block_size=BLOCK
    )[0]
  return lambda x, w: jaxact.distillation_loss(
    x, w, xt, wt, divergence=name, temperature=t, vocab_block_size=BLOCK
  )[0]


def _errors(f, x, w, want):
  got = jax.jit(jax.grad(f, (0, 1)))(x, w)
  norm = lambda a: float(np.linalg.norm(np.asarray(a, np.float64).ravel()))
  return [norm(np.asarray(g, np.float64) - r) / norm(r) for g, r in zip(got, want, strict=True)]


@pytest.mark.sample(
  1, "log_probs-0.001", "forward_kl-1.0", "reverse_kl-0.001", "jsd-0.001", "top_k-0.01"
)
@pytest.mark.parametrize("t", TEMPERATURES, ids=str)
@pytest.mark.parametrize("name", ["log_probs", "forward_kl", "reverse_kl", "jsd", "top_k"])
def test_float32_gradients_as_close_to_float64_as_the_plain_compositions(name, t):
  """The relative error (Frobenius) of float32 ``dx`` and ``dw`` against float64 is at most the
  plain composition's (a quarter more, for the last ulp's luck), or 3e-7: a float32 gradient's
  own rounding. Before, it grew as ``1 / T`` (20x the plain composition's at ``T = 1e-3``), and
  the JSD's was 4x at ``T = 1``."""
  x, w, tokens, c, xt, wt = dyadic()
  teacher = jax.nn.log_softmax((xt.astype(jnp.float64) @ wt.astype(jnp.float64)) / t, -1)
  lp_k, idx = jax.lax.top_k(teacher, K)
  top32, top64 = (idx, lp_k.astype(jnp.float32)), (idx, lp_k.astype(jnp.float32))
  args = (name, t, tokens, c, xt, wt)
  with jax.enable_x64(True):
    x64, w64 = x.astype(jnp.float64), w.astype(jnp.float64)
    c64 = c.astype(jnp.float64)
    want = jax.grad(plain_loss(name, t, tokens, c64, xt, wt, top64), (0, 1))(x64, w64)
    want = [np.asarray(a) for a in want]
  ours = _errors(jaxact_loss(*args, top32), x, w, want)
  plain = _errors(plain_loss(*args, top32), x, w, want)
  for e_ours, e_plain in zip(ours, plain, strict=True):
    assert e_ours <= max(1.25 * e_plain, 3e-7), (ours, plain)


def test_a_temperature_of_float32s_smallest_normal_gives_the_finite_values():
  """``T = 1e-38`` with logits below 1: the log-probabilities (about -1e37) and the entropy (0)
  are finite and equal the float64 formula's, and so are the gradients (about 1e37); before, the
  temperature was float32's 0 and every value NaN."""
  x, w, tokens, c, _, _ = dyadic()
  x, w = x / 64, w  # logits below 1
  t = 1e-38
  lp, h = jaxact.linear_log_probs(x, w, tokens, temperature=t, return_entropy=True)
  f = lambda x, w: jnp.sum(c * jaxact.linear_log_probs(x, w, tokens, temperature=t))
  dx, dw = jax.grad(f, (0, 1))(x, w)
  with jax.enable_x64(True):
    x64, w64, c64 = (a.astype(jnp.float64) for a in (x, w, c))
    s = (x64 @ w64) / t
    want = jnp.take_along_axis(jax.nn.log_softmax(s, -1), tokens[:, None], -1)[:, 0]
    g = jax.grad(
      lambda x, w: jnp.sum(
        c64 * jnp.take_along_axis(jax.nn.log_softmax((x @ w) / t, -1), tokens[:, None], -1)[:, 0]
      ),
      (0, 1),
    )(x64, w64)
  for got, ref in ((lp, want), (dx, g[0]), (dw, g[1])):
    assert np.all(np.isfinite(got))
    scale = float(np.max(np.abs(ref)))  # float64's own rounding of sums of terms of 1e37
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-6, atol=1e-12 * scale)
  np.testing.assert_array_equal(h, 0)
