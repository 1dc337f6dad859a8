"""Dropout inside dense_bias_act / DenseAct / LinearAct: Flax's dropout with the same key, the key
kept instead of the mask, nothing more kept than without dropout.

References draw the mask with jax.random.bernoulli (what nn.Dropout draws) and differentiate the
plain composition by autodiff.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import jaxact.linen as jnn
import jaxact.nnx as jnnx

KEY = jax.random.key(11)


def _operands(rows=300, dtype=jnp.float32):
  # 300 rows of 512: blocks of 128 rows and a tail of 44 (see jaxact._src.core.dropout).
  ks = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(ks[0], (rows, 24), jnp.float32).astype(dtype)
  w = (jax.random.normal(ks[1], (24, 512), jnp.float32) / 4).astype(dtype)
  b = jax.random.normal(ks[2], (512,), jnp.float32).astype(dtype)
  return x, w, b


def _dropped(y, key, rate, broadcast_dims=()):
  return nn.Dropout(rate, broadcast_dims=broadcast_dims).apply({}, y, deterministic=False, rng=key)


def _check(ours, ref, args, rtol):
  y1, pull1 = jax.vjp(ours, *args)
  y2, pull2 = jax.vjp(ref, *args)
  np.testing.assert_allclose(y1, y2, rtol=rtol, atol=rtol)
  ct = jax.random.normal(jax.random.key(5), y1.shape, jnp.float32).astype(y1.dtype)
  for g1, g2 in zip(pull1(ct), pull2(ct), strict=True):
    assert np.isfinite(np.asarray(g1, np.float64)).all()
    np.testing.assert_allclose(g1, g2, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(g2))))
  return y1, pull1


ACTIVATIONS = {
  "relu": ("relu", jax.nn.relu),  # keeps the dropped output
  "tanh": ("tanh", jnp.tanh),
  "gelu": ("gelu", jax.nn.gelu),  # keeps the pre-activation
  "identity": ("identity", lambda z: z),  # keeps nothing
  "callable": (lambda z: jnp.sin(z) * z, lambda z: jnp.sin(z) * z),  # autodiff's
}


@pytest.mark.sample(1, "callable-whole")
@pytest.mark.parametrize("rows", [300, 4], ids=["blocks", "whole"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_equals_flax_dropout_of_the_plain_layer(name, rows):
  activation, f = ACTIVATIONS[name]
  x, w, b = _operands(rows)

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation=activation, dropout_rate=0.3, dropout_rng=KEY)

  y, _ = _check(ours, lambda x, w, b: _dropped(f(x @ w + b), KEY, 0.3), (x, w, b), 1e-6)
  assert 0.6 < float(jnp.mean(y != 0)) < 0.8 or name == "relu"


def test_coded_residual_with_dropout():
  x, w, b = _operands()
  act = functools.partial(jaxact.gelu, residual_bits=8)

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation=act, dropout_rate=0.2, dropout_rng=KEY)

  def ref(x, w, b):  # the coded layer without dropout, then Flax's dropout
    return _dropped(jaxact.dense_bias_act(x, w, b, activation=act), KEY, 0.2)

  _check(ours, ref, (x, w, b), 1e-6)


def test_bfloat16_against_float32():
  x, w, b = _operands(dtype=jnp.bfloat16)

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation="relu", dropout_rate=0.3, dropout_rng=KEY)

  y = ours(x, w, b)
  assert y.dtype == jnp.bfloat16
  ref = _dropped(jax.nn.relu(x.astype(jnp.float32) @ w.astype(jnp.float32) + b), KEY, 0.3)
  np.testing.assert_allclose(y.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("activation", ["relu", "gelu", "identity"])
def test_keeps_the_key_not_the_mask(activation):
  x, w, b = _operands()
  kw = {"activation": activation, "dropout_rate": 0.3, "dropout_rng": KEY}
  y, pull = jax.vjp(lambda x, w, b: jaxact.dense_bias_act(x, w, b, **kw), x, w, b)
  leaves = jax.tree.leaves(pull)
  assert not [a for a in leaves if a.dtype == jnp.bool_]
  big = [a for a in leaves if a.size >= y.size]
  if activation == "relu":  # the dropped output itself
    assert len(big) == 1
    np.testing.assert_array_equal(big[0], y)
  elif activation == "gelu":  # the pre-activation, as without dropout
    (z,) = big
    np.testing.assert_allclose(z, x @ w + b, rtol=1e-6, atol=1e-6)
  else:
    assert big == []


@pytest.mark.parametrize("rows", [300, 4], ids=["blocks", "whole"])
def test_a_bias_under_dropout_promotes_no_rank(rows):
  """relu keeps its dropped output, so the bias is added with the dropout, a block of rows at a
  time or whole (over batch axes): traced under jax.numpy_rank_promotion("raise"), where adding
  the (N,) bias to the (..., N) block by implicit rank promotion raised."""
  x, w, b = _operands(rows)
  x = x.reshape(2, rows // 2, -1)

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation="relu", dropout_rate=0.5, dropout_rng=KEY)

  with jax.numpy_rank_promotion("raise"):
    jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(ours(*a)), (0, 1, 2)))(x, w, b)


def test_rate_one_drops_everything_without_nans():
  x, w, b = _operands()

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation="softplus", dropout_rate=1.0, dropout_rng=KEY)

  y, pull = jax.vjp(ours, x, w, b)
  assert not jnp.any(y)
  for g in pull(jnp.ones_like(y)):
    assert not jnp.any(g)


@pytest.mark.parametrize(
  "key",
  [jax.random.PRNGKey(3), jax.random.key(3, impl="rbg")],
  ids=["raw-uint32", "rbg"],
)
def test_other_keys(key):
  x, w, b = _operands()

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation="elu", dropout_rate=0.5, dropout_rng=key)

  _check(ours, lambda x, w, b: _dropped(jax.nn.elu(x @ w + b), key, 0.5), (x, w, b), 1e-6)


def test_broadcast_dims_share_the_mask():
  x, w, b = _operands()
  kw = {"dropout_rate": 0.4, "dropout_rng": KEY, "dropout_broadcast_dims": (0,)}

  def ours(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation="tanh", **kw)

  y, _ = _check(
    ours, lambda x, w, b: _dropped(jnp.tanh(x @ w + b), KEY, 0.4, (0,)), (x, w, b), 1e-6
  )
  np.testing.assert_array_equal(y[0] == 0, y[-1] == 0)


def test_jit_and_vmap_over_keys():
  x, w, b = _operands(rows=8)
  keys = jax.random.split(KEY, 3)

  @jax.jit
  def grad_x(k):
    def loss(x):
      y = jaxact.dense_bias_act(x, w, b, activation="relu", dropout_rate=0.5, dropout_rng=k)
      return jnp.sum(y**2)

    return jax.grad(loss)(x)

  def ref(k):
    return jax.grad(lambda x: jnp.sum(_dropped(jax.nn.relu(x @ w + b), k, 0.5) ** 2))(x)

  batched = jax.vmap(grad_x)(keys)
  for k, g in zip(keys, batched, strict=True):
    # float32 sums of 512 products: the order vmap sums them in moves with jax's version
    r = ref(k)
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"dropout_rate": 1.5, "dropout_rng": KEY}, ValueError, r"`dropout_rate` must be .* got 1.5"),
    ({"dropout_rate": True, "dropout_rng": KEY}, ValueError, r"`dropout_rate`"),
    ({"dropout_rate": 0.1}, ValueError, r"`dropout_rng` is required"),
    ({"dropout_rate": 0.1, "dropout_rng": 3}, TypeError, r"`dropout_rng` must be one PRNG key"),
    (
      {"dropout_rate": 0.1, "dropout_rng": KEY, "dropout_broadcast_dims": (2,)},
      ValueError,
      r"`dropout_broadcast_dims` must be .* axes of the 2-d output",
    ),
    (
      {"dropout_rate": 0.1, "dropout_rng": KEY, "implementation": "pallas"},
      NotImplementedError,
      r"dropout inside the op",
    ),
  ],
  ids=["rate-above-1", "rate-bool", "no-key", "int-key", "bad-dims", "pallas"],
)
def test_bad_dropout_arguments(kwargs, error, match):
  x, w, b = _operands(rows=4)
  with pytest.raises(error, match=match):
    jaxact.dense_bias_act(x, w, b, activation="relu", **kwargs)


def test_linen_dense_act_is_dense_relu_dropout():
  x, _, _ = _operands(rows=64)

  class Flax(nn.Module):
    @nn.compact
    def __call__(self, x, train, rng=None):
      y = nn.relu(nn.Dense(32)(x))
      return nn.Dropout(0.25)(y, deterministic=not train, rng=rng)

  class Ours(nn.Module):
    @nn.compact
    def __call__(self, x, train, rng=None):
      return jnn.DenseAct(32, activation=nn.relu, dropout_rate=0.25, name="Dense_0")(
        x, deterministic=not train, rng=rng
      )

  params = Flax().init(jax.random.key(1), x, False)
  assert jax.tree.map(jnp.shape, Ours().init(jax.random.key(1), x, False)) == jax.tree.map(
    jnp.shape, params
  )
  np.testing.assert_array_equal(Ours().apply(params, x, False), Flax().apply(params, x, False))

  def loss(model):
    return lambda p: jnp.sum(model.apply(p, x, True, KEY) ** 2)

  np.testing.assert_allclose(Ours().apply(params, x, True, KEY), Flax().apply(params, x, True, KEY))
  chex_close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
  jax.tree.map(chex_close, jax.grad(loss(Ours()))(params), jax.grad(loss(Flax()))(params))
  with pytest.raises(ValueError, match="deterministic"):
    jnn.DenseAct(4, dropout_rate=0.1).init(jax.random.key(0), x)  # as nn.Dropout: say which


def test_nnx_linear_act_is_linear_relu_dropout():
  x, _, _ = _operands(rows=64)

  class Flax(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(24, 32, rngs=rngs)
      self.dropout = nnx.Dropout(0.25, rngs=rngs)
      self.out = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
      return self.out(self.dropout(nnx.relu(self.linear(x))))

  class Ours(nnx.Module):
    def __init__(self, rngs):
      self.linear = jnnx.LinearAct(24, 32, activation=nnx.relu, dropout_rate=0.25, rngs=rngs)
      self.out = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
      return self.out(self.linear(x))

  theirs, ours = Flax(nnx.Rngs(0)), Ours(nnx.Rngs(0))
  np.testing.assert_array_equal(ours.out.kernel[...], theirs.out.kernel[...])
  for _ in range(2):  # the streams advance alike
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
  ours.eval()
  theirs.eval()
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
  ours.train()
  assert not np.allclose(ours(x), ours(x))  # a new mask each call


# ------------------------------------------------------------- gated_mlp: the hidden's dropout


def _gated_operands(rows, dtype=jnp.float64):
  ks = jax.random.split(jax.random.key(1), 7)
  shapes = [(rows, 24), (24, 256), (24, 256), (256, 16), (256,), (256,), (16,)]
  scales = [1.0, 0.4, 0.2, 0.05, 0.5, 0.5, 0.5]
  return tuple(
    (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    for k, shape, s in zip(ks, shapes, scales, strict=True)
  )


def _gated_plain(act, rate, key, broadcast_dims=()):
  """The three projections with nn.Dropout between the gated product and the down projection."""

  def f(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    h = act(x @ w_gate + b_gate) * (x @ w_up + b_up)
    return _dropped(h, key, rate, broadcast_dims) @ w_down + b_down

  return f


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "rows, activation, broadcast_dims",
  [(300, "silu", ()), (40, "gelu", (0,))],
  ids=["blocks-silu", "whole-shared-mask-gelu"],
)
def test_gated_mlp_dropout_is_flax_dropout_of_the_hidden(rows, activation, broadcast_dims):
  """float64: the values and every gradient of the plain composition with nn.Dropout of the same
  key (300 rows of 256 hidden: the mask drawn in blocks of 256 rows and a tail of 44)."""
  args = _gated_operands(rows)
  act = {"silu": jax.nn.silu, "gelu": jax.nn.gelu}[activation]

  def ours(*a):
    return jaxact.gated_mlp(
      *a,
      activation=activation,
      dropout_rate=0.3,
      dropout_rng=KEY,
      dropout_broadcast_dims=broadcast_dims,
    )

  y, pull = jax.vjp(jax.jit(ours), *args)
  y_ref, pull_ref = jax.vjp(_gated_plain(act, 0.3, KEY, broadcast_dims), *args)
  np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
  ct = jax.random.normal(jax.random.key(5), y.shape, jnp.float64)
  for g, r in zip(pull(ct), pull_ref(ct), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-11 * float(jnp.max(jnp.abs(r))))
  # the key is kept, not the mask nor the dropped hidden: x, a and b are the big residuals
  big = [leaf for leaf in jax.tree.leaves(pull) if leaf.size >= rows * 16 and leaf.ndim == 2]
  assert sorted(leaf.shape for leaf in big if leaf.shape[0] == rows) == [
    (rows, 24),
    (rows, 256),
    (rows, 256),
  ]
  assert not any(leaf.dtype == jnp.bool_ for leaf in jax.tree.leaves(pull))


def test_gated_mlp_dropout_other_cases():
  args = _gated_operands(8, jnp.float32)
  plain = jaxact.gated_mlp(*args)
  # rate 0 needs no key and is no dropout
  np.testing.assert_array_equal(jaxact.gated_mlp(*args, dropout_rate=0.0), plain)
  # a new key, a new mask
  assert not np.allclose(
    jaxact.gated_mlp(*args, dropout_rate=0.5, dropout_rng=jax.random.key(1)),
    jaxact.gated_mlp(*args, dropout_rate=0.5, dropout_rng=jax.random.key(2)),
  )
  # rate 1 drops every hidden unit: only the down bias remains, gradients finite
  y, grads = jax.value_and_grad(
    lambda a: jnp.sum(jaxact.gated_mlp(*a, dropout_rate=1.0, dropout_rng=KEY) ** 2)
  )(args)
  assert np.isfinite(y) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  with pytest.raises(NotImplementedError, match=r"dropout inside the op"):
    jaxact.gated_mlp(*args, dropout_rate=0.1, dropout_rng=KEY, implementation="pallas")
  with pytest.raises(ValueError, match=r"jaxact\.gated_mlp: `dropout_rng` is required"):
    jaxact.gated_mlp(*args, dropout_rate=0.1)
  with pytest.raises(ValueError, match=r"jaxact\.gated_mlp: `dropout_rate` must be"):
    jaxact.gated_mlp(*args, dropout_rate=1.5, dropout_rng=KEY)
