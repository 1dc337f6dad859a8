"""batch_norm_act / group_norm_act: values and gradients against JAX autodiff of the plain
composition (float64, every activation of the table in a sampled survey), zero scales, constant
channels, half precision, what the pullback keeps, the compiled temp of a stack, bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.activations.reference import REFERENCES
from jaxact._src.norm_act import reference as R

from cases import ELEMENTWISE

SHAPE = (4, 3, 5, 8)  # (batch, height, width, channels)


def _inputs(dtype=jnp.float64, shape=SHAPE, scale_kind="zeros"):
  k = jax.random.split(jax.random.key(0), 4)
  x = (jax.random.normal(k[0], shape, jnp.float64) * 2 + 0.5).astype(dtype)
  c = shape[-1]
  pdt = jnp.promote_types(dtype, jnp.float32)
  scale = jax.random.normal(k[1], (c,), jnp.float64)
  scale = {"zeros": scale.at[::3].set(0.0), "random": scale, "all-zero": 0 * scale}[scale_kind]
  bias = jax.random.normal(k[2], (c,), jnp.float64)
  ct = jax.random.normal(k[3], shape, jnp.float64).astype(dtype)
  return x, scale.astype(pdt), bias.astype(pdt), ct


def _ops(act, ref_act, kind, **kw):
  """(ours, reference) as functions of (x, scale, bias) returning y."""
  if kind == "batch":
    return (
      lambda x, s, b: jaxact.batch_norm_act(x, s, b, activation=act, **kw)[0],
      lambda x, s, b: R.batch_norm_act(x, s, b, ref_act, **kw)[0],
    )
  return (
    lambda x, s, b: jaxact.group_norm_act(x, s, b, activation=act, num_groups=4, **kw),
    lambda x, s, b: R.group_norm_act(x, s, b, ref_act, num_groups=4, **kw),
  )


def _vjp(f, ct, *args):
  """``(f(*args), the pullback of ct)``, jitted (one compile, not hundreds of eager ops)."""

  def run(ct, *args):
    y, pull = jax.vjp(f, *args)
    return y, pull(ct)

  return jax.jit(run)(ct, *args)


def _assert_close(got, want, tol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))


@pytest.mark.sample(4, "batch-relu", "group-silu", "batch-identity", "group-leaky_relu")
@pytest.mark.parametrize("spec", ELEMENTWISE, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", ["batch", "group"])
def test_float64_matches_autodiff_for_every_activation(kind, spec):
  """Zero scales included (every third channel): every gradient is autodiff's."""
  ours, ref = _ops(spec.name, REFERENCES[spec.name], kind)
  x, scale, bias, ct = _inputs()
  y1, g1 = _vjp(ours, ct, x, scale, bias)
  y2, g2 = _vjp(ref, ct, x, scale, bias)
  _assert_close(y1, y2, 1e-12)
  _assert_close(g1, g2, 1e-11)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-variance", "two-pass"])
def test_batch_statistics_inference_and_their_cotangents(fast):
  x, scale, bias, ct = _inputs()
  act = functools.partial(jaxact.leaky_relu, negative_slope=0.2)
  ref_act = functools.partial(jax.nn.leaky_relu, negative_slope=0.2)
  ours = functools.partial(jaxact.batch_norm_act, activation=act, use_fast_variance=fast)
  ref = functools.partial(R.batch_norm_act, act=ref_act, fast=fast)
  cm = jax.random.normal(jax.random.key(5), (8,), jnp.float64)
  y1, g1 = _vjp(ours, (ct, cm, -2 * cm), x, scale, bias)  # the statistics' cotangents too
  y2, g2 = _vjp(ref, (ct, cm, -2 * cm), x, scale, bias)
  _assert_close(y1, y2, 1e-12)
  _assert_close(g1, g2, 1e-11)
  mean, var = jnp.linspace(-1, 1, 8), jnp.linspace(0.5, 3, 8)
  y1, g1 = _vjp(lambda *a: ours(*a[:3], mean=a[3], var=a[4])[0], ct, x, scale, bias, mean, var)
  y2, g2 = _vjp(lambda *a: ref(*a[:3], mean=a[3], var=a[4])[0], ct, x, scale, bias, mean, var)
  _assert_close(y1, y2, 1e-12)
  _assert_close(g1, g2, 1e-11)


@pytest.mark.parametrize("kind", ["batch", "group"])
def test_an_all_zero_scale_trains(kind):
  """ResNet's zero-initialised last scale: y = act(bias), and d scale is autodiff's, not 0 (what a
  backward recovering x_hat from y would give)."""
  x, scale, bias, ct = _inputs(scale_kind="all-zero")
  ours, ref = _ops("identity", lambda z: z, kind)  # the norm before a residual sum
  (_, (dx, ds, db)), (_, want) = _vjp(ours, ct, x, scale, bias), _vjp(ref, ct, x, scale, bias)
  _assert_close((dx, ds, db), want, 1e-12)
  assert float(jnp.abs(ds).min()) > 0 and not dx.any()


@pytest.mark.parametrize("kind", ["batch", "group"])
def test_constant_channels_are_nan_free(kind):
  x, scale, bias, ct = _inputs()
  x = x.at[..., :4].set(0.3)  # a constant channel (batch) and a constant group (group)
  ours, ref = _ops("silu", jax.nn.silu, kind)
  y1, g1 = _vjp(ours, ct, x, scale, bias)
  y2, g2 = _vjp(ref, ct, x, scale, bias)
  _assert_close(y1, y2, 1e-12)
  _assert_close(g1, g2, 1e-9)


@pytest.mark.parametrize("kind", ["batch", "group"])
def test_float32_within_1e_5_of_float64(kind):
  x, scale, bias, ct = _inputs(scale_kind="random")
  ours, ref = _ops("gelu", jax.nn.gelu, kind)
  _, g32 = _vjp(ours, *(a.astype(jnp.float32) for a in (ct, x, scale, bias)))
  _, g64 = _vjp(ref, ct, x, scale, bias)
  _assert_close(g32, g64, 1e-5)


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kind", ["batch", "group"])
def test_half_precision_is_computed_in_float32(kind, dtype):
  x, scale, bias, ct = _inputs(dtype)
  ours, ref = _ops("elu", jax.nn.elu, kind)
  y, g = _vjp(ours, ct, x, scale, bias)
  assert y.dtype == dtype and g[0].dtype == dtype and g[1].dtype == jnp.float32
  f32 = [a.astype(jnp.float32) for a in (ct, x)]
  y32, g32 = _vjp(ref, f32[0], f32[1], scale, bias)
  _assert_close(y, y32, 2e-2)
  _assert_close(g, g32, 3e-2)
  if kind == "batch":  # float32 statistics from a half input
    _, mean, var = jaxact.batch_norm_act(x, activation="identity")
    assert mean.dtype == var.dtype == jnp.float32


@pytest.mark.parametrize("kind", ["batch", "group"])
def test_the_pullback_keeps_one_activation_sized_array(kind):
  """x_hat in x's dtype, one float32 number a statistic, the parameters: nothing else."""
  x, scale, bias, _ = _inputs(jnp.bfloat16, scale_kind="random")
  ours, _ = _ops("silu", jax.nn.silu, kind)
  _, pull = jax.vjp(lambda x: ours(x, scale, bias), x)
  leaves = jax.tree.leaves(pull)
  big = [a for a in leaves if a.size >= x.size]
  assert len(big) == 1 and big[0].dtype == jnp.bfloat16
  stats = 8 if kind == "batch" else SHAPE[0] * 4
  small = sorted(a.size for a in leaves if a.size < x.size)
  assert small == sorted([stats, 8, 8])  # r, scale, bias


def test_compiled_temp_of_a_stack_is_below_the_plain_composition():
  """Four (matmul, batch norm, relu) layers, float32: jit(grad)'s temp below Flax's math's."""
  k = jax.random.split(jax.random.key(1), 2)
  x = jax.random.normal(k[0], (256, 128), jnp.float32)
  ws = jax.random.normal(k[1], (4, 128, 128), jnp.float32) / 12
  s, b = jnp.ones(128), jnp.zeros(128)

  def loss(norm_act):
    def f(ws, x):
      for w in ws:
        x = norm_act(x @ w, s, b)
      return jnp.sum(x * x)

    return f

  ours = loss(lambda z, s, b: jaxact.batch_norm_act(z, s, b, activation="relu")[0])
  ref = loss(lambda z, s, b: R.batch_norm_act(z, s, b, jax.nn.relu)[0])

  def temp(f):
    return jax.jit(jax.grad(f)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

  layer = x.size * 4
  assert temp(ours) < temp(ref) - 2 * layer, (temp(ours), temp(ref), layer)


def test_jit_vmap_and_a_plain_callable():
  x, scale, bias, ct = _inputs(shape=(3, 6, 8))
  cube = lambda z: z * z * z
  ours, ref = _ops(cube, cube, "group")
  g1 = jax.jit(jax.grad(lambda x: jnp.sum(ours(x, scale, bias) * ct)))(x)
  g2 = jax.jit(jax.grad(lambda x: jnp.sum(ref(x, scale, bias) * ct)))(x)
  _assert_close(g1, g2, 1e-11)
  ours, ref = _ops("tanh", jnp.tanh, "batch")
  v1 = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(ours(x, scale, bias) ** 2))))(x)
  v2 = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(ref(x, scale, bias) ** 2))))(x)
  _assert_close(v1, v2, 1e-11)


BN, GN = jaxact.batch_norm_act, jaxact.group_norm_act
BAD = {
  "axis": (lambda x, s: BN(x, s, activation="relu", axis=4), ValueError, r"`axis` 4 is out"),
  "scale-shape": (lambda x, s: BN(x, s[:3], activation="relu"), ValueError, r"`scale` has shape"),
  "bias-dtype": (
    lambda x, s: GN(x, s, s.astype(jnp.int32), activation="relu", num_groups=2),
    TypeError,
    r"`bias` has dtype int32",
  ),
  "x-dtype": (lambda x, s: BN(x.astype(int), s, activation="relu"), TypeError, r"`x` has dtype"),
  "groups": (lambda x, s: GN(x, s, activation="relu", num_groups=3), ValueError, r"`num_groups` 3"),
  "group-size": (
    lambda x, s: GN(x, s, activation="relu", group_size=4),
    ValueError,
    r"exactly one of `num_groups` and `group_size`",
  ),
  "reduction-axes": (
    lambda x, s: GN(x, s, activation="relu", num_groups=2, reduction_axes=(1, 2)),
    ValueError,
    r"`reduction_axes` \(1, 2\) must include the last axis",
  ),
  "mean-without-var": (
    lambda x, s: BN(x, s, activation="relu", mean=s),
    ValueError,
    r"`mean` is given but `var` is None",
  ),
  "var-shape": (
    lambda x, s: BN(x, s, activation="relu", mean=s, var=s[:2]),
    ValueError,
    r"`var` has shape \(2,\)",
  ),
  "epsilon": (lambda x, s: BN(x, s, activation="relu", epsilon=0), ValueError, r"`epsilon`"),
  "activation": (lambda x, s: BN(x, s, activation="relux"), ValueError, r"'relux' is not known"),
  "groups-no-name": (
    lambda x, s: BN(x, s, activation="relu", axis_index_groups=[[0, 1]]),
    ValueError,
    r"`axis_index_groups` .* needs an `axis_name`",
  ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_names_the_argument(case):
  call, error, match = BAD[case]
  x, scale, _, _ = _inputs(jnp.float32)
  with pytest.raises(error, match=f"jaxact\\.(batch|group)_norm_act: .*{match}"):
    call(x, scale)
