"""batch_norm_act / group_norm_act at the edges of the float range, by XLA and by the Triton kernels
(interpret mode): channels and groups of 1e30, 1e-30 and near the dtype's max, mixed magnitudes,
constant channels, an epsilon below float32's smallest normal, given statistics whose centring
overflows, the batch variance past float32 and the Flax layers' running averages, empty and
vmapped batches; values and gradients against ``jax.vjp`` of the plain formula in float64
(``norm_cases``)."""

from __future__ import annotations

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import jaxact.linen as jnn
import jaxact.nnx as jnnx
from norm_cases import TOL, assert_close, floor, reference, rows

F32_MAX = float(jnp.finfo(jnp.float32).max)


def _params(c, dtype):
  k = jax.random.split(jax.random.key(1), 2)
  p = jnp.promote_types(dtype, jnp.float32)
  scale = (jax.random.normal(k[0], (c,), jnp.float64) + 2).astype(p)
  return scale, jax.random.normal(k[1], (c,), jnp.float64).astype(p)


def _batch(x, scale, bias, **kw):
  return jaxact.batch_norm_act(x, scale, bias, activation="identity", **kw)[0]


def _group(x, scale, bias, **kw):
  return jaxact.group_norm_act(x, scale, bias, activation="identity", num_groups=2, **kw)


def _inputs(kind, dtype):
  """x whose statistics are :func:`norm_cases.rows`' kinds: a batch norm's channels (x ``(8,
  7)``), or a group norm's examples (x ``(7, 2, 8)``, two groups of 4 channels each)."""
  r = rows(dtype, n=16)
  return r[:, :8].T if kind == "batch" else r.reshape(7, 2, 8)


def _check(kind, x, tol, slack, eps=None, **kw):
  scale, bias = _params(x.shape[-1], x.dtype)
  ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(x.dtype)
  if eps is None:
    eps = 1e-5 if kind == "batch" else 1e-6
  f = _batch if kind == "batch" else _group
  y, pull = jax.vjp(lambda *a: f(*a, epsilon=eps, **kw), x, scale, bias)
  grads = pull(ct)
  if kind == "batch":
    y64, grads64 = reference(x, scale, bias, ct, eps=eps, axes=(0,))
    axes = (0,)  # a channel's entries
  else:
    y64, grads64 = reference(x, scale, bias, ct, eps=eps, groups=2)
    axes = (1, 2)  # an example's (its groups share a magnitude here)
  assert_close(y, y64, tol, slack, axes)
  assert_close(grads[0], grads64[0], tol, slack, axes)
  for a, b in zip(grads[1:], grads64[1:], strict=True):
    assert_close(a, b, tol, slack)


@pytest.mark.sample(2, "batch-pallas")
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("kind", ["batch", "group"])
def test_statistics_of_any_magnitude_match_float64(kind, implementation):
  """A channel (group) of 1e20 or more squared to inf: y was 0 or NaN and every gradient NaN; of
  entries near float32's max, centring overflowed; a constant 1e30 one was rounding noise."""
  x = _inputs(kind, jnp.float32)
  _check(kind, x, 1e-5, floor(jnp.float32), implementation=implementation)


@pytest.mark.parametrize("value", [1e20, 1e30])
def test_the_issues_batch_and_its_statistics(value):
  """``zeros((8, 1)).at[3, 0].set(1e20)`` gave y = 0 (var inf), at 1e30 NaN for y and every
  gradient. Its variance, ``value^2 * 7 / 64``, is past float32: it saturates at float32's max,
  not inf or NaN, and y and the gradients are float64's."""
  x = jnp.zeros((8, 1), jnp.float32).at[3, 0].set(value)
  y, mean, var = jaxact.batch_norm_act(x, activation="identity")
  np.testing.assert_allclose(y[:, 0], np.where(np.arange(8) == 3, 7, -1) / np.sqrt(7), rtol=1e-6)
  np.testing.assert_allclose(mean, [value / 8], rtol=1e-6)
  assert var[0] == F32_MAX
  _check("batch", x, 1e-5, floor(jnp.float32))


@pytest.mark.sample(3)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("kind", ["batch", "group"])
def test_every_kind_in_every_dtype(kind, implementation, dtype):
  if implementation == "pallas" and dtype == jnp.float64:
    pytest.skip("the kernels take float32, bfloat16 and float16")
  x = _inputs(kind, dtype)
  _check(kind, x, TOL[dtype], floor(dtype), implementation=implementation)


@pytest.mark.parametrize("kind", ["batch", "group"])
def test_an_epsilon_below_the_smallest_normal(kind):
  """epsilon=1e-40 (a float32 subnormal, which XLA flushes to 0) on a zero channel gave NaN;
  exact: y = bias and dx = scale ct / sqrt(eps) terms, finite."""
  x = _inputs(kind, jnp.float32)[..., :8] * 0
  x = x.at[..., 1].set(1e-30) if kind == "batch" else x.at[1].set(1e-30)
  _check(kind, x, 1e-5, 0.0, eps=1e-40)


def test_given_statistics_whose_centring_overflows():
  """``x - mean`` of entries near float32's max and a mean of the other sign overflowed to inf:
  y was inf where float64's is 6.8e37; and a variance past float32 (a running average at its
  max) or a subnormal epsilon stay finite."""
  x = jnp.array([[3.4e38, -1.0], [1.0, 2.0]], jnp.float32)
  mean, var = jnp.array([-3.4e38, 0.0], jnp.float32), jnp.array([100.0, F32_MAX], jnp.float32)
  scale, bias = jnp.ones(2, jnp.float32), jnp.zeros(2, jnp.float32)
  ct = jnp.ones_like(x)

  def f(x, scale, bias, mean, var):
    return _batch(x, scale, bias, mean=mean, var=var, epsilon=1e-40)

  y, pull = jax.vjp(f, x, scale, bias, mean, var)
  grads = pull(ct)
  f64 = [np.asarray(a, np.float64) for a in (x, scale, bias, mean, var)]
  y64, pull64 = jax.vjp(
    lambda x, s, b, m, v: (x - m) / jnp.sqrt(v + 1e-40) * s + b, *map(jnp.asarray, f64)
  )
  assert_close(y, y64, 1e-6, 0.0, axes=(0, 1))
  for a, b in zip(grads, pull64(jnp.ones_like(y64)), strict=True):
    assert_close(a, b, 1e-6, floor(jnp.float32), axes=tuple(range(b.ndim)))


def test_the_layers_running_averages_stay_finite():
  """A batch whose variance is past float32 (1e20 entries): the batch variance saturates at
  float32's max and the running variance moves to it, in linen and nnx alike (Flax's: inf, and y
  0 or NaN); the running mean is right, and normalizing by the running averages is finite."""
  x = jnp.zeros((8, 3), jnp.float32).at[3].set(1e20).at[5, 1].set(-2e19)
  bn = jnn.BatchNorm(momentum=0.5)
  variables = bn.init(jax.random.key(0), x, use_running_average=False)
  y, updates = bn.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
  stats = updates["batch_stats"]
  layer = jnnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
  y_nnx = layer(x)
  mean64 = np.asarray(x, np.float64).mean(0)
  for mean, var in ((stats["mean"], stats["var"]), (layer.mean[...], layer.var[...])):
    np.testing.assert_allclose(mean, 0.5 * mean64, rtol=1e-6)
    np.testing.assert_allclose(var, [0.5 + 0.5 * F32_MAX] * 3, rtol=1e-6)  # the batch's: the max
  np.testing.assert_array_equal(y, y_nnx)
  assert np.isfinite(np.asarray(y)).all()
  flax_y, _ = nn.BatchNorm(use_running_average=False).apply(variables, x, mutable=["batch_stats"])
  assert not np.isfinite(np.asarray(flax_y)).all() or not np.asarray(flax_y).any()
  for out in (bn.apply({**variables, **updates}, x, use_running_average=True), layer(x, True)):
    assert np.isfinite(np.asarray(out)).all()


def test_empty_and_vmapped_batches():
  """Batch statistics of no elements raise (Flax: NaN, which the running averages keep); given
  statistics and a group norm of no examples are empty; vmapped extremes are the unbatched."""
  x = jnp.zeros((0, 3), jnp.float32)
  with pytest.raises(ValueError, match=r"batch_norm_act: `x` \(0, 3\) has no elements"):
    jaxact.batch_norm_act(x, activation="relu")
  y = jaxact.batch_norm_act(x, activation="relu", mean=jnp.zeros(3), var=jnp.ones(3))[0]
  assert y.shape == (0, 3)
  dx = jax.grad(lambda x: jnp.sum(_group(x, None, None)))(jnp.zeros((0, 2, 8), jnp.float32))
  assert dx.shape == (0, 2, 8)
  x = _inputs("batch", jnp.float32).reshape(2, 4, 7)
  g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(_batch(x, None, None)))))
  np.testing.assert_array_equal(jax.vmap(g)(x), jnp.stack([g(a) for a in x]))
