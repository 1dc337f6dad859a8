"""``jaxact.linen.intercept``: Flax models run unchanged on jaxact's ops, compared with the same
models without it (Flax's own modules and jax.nn: the independent reference)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxact.linen as jnn
import lm1b_example as lm1b
import resnet_example as resnet


def _close(a, b, rtol, atol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


TOKENS = jnp.array([[3, 5, 7, 9, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]])  # padding in row 0


def _lm1b(dtype=jnp.float32):
  model = lm1b.TransformerLM(lm1b.Config(dtype=dtype, deterministic=True))
  params = model.init(jax.random.key(0), TOKENS)["params"]
  return model, jax.tree.map(lambda p: p.astype(dtype), params)


def test_lm1b_runs_unchanged_with_flax_s_parameters_logits_and_gradients():
  model = lm1b.TransformerLM(lm1b.Config(deterministic=True))

  def loss(params):  # and every logit, the padding rows' too (their every key is masked)
    logits = model.apply({"params": params}, TOKENS)
    return lm1b.weighted_cross_entropy(logits, TOKENS), logits

  def run(key):  # the parameters init makes, then the loss, logits and gradients at them
    params = model.init(key, TOKENS)["params"]
    return params, jax.value_and_grad(loss, has_aux=True)(params)

  want = jax.jit(run)(jax.random.key(0))
  with jnn.intercept() as report:  # a new function: jit's cache keeps what a function traced
    got = jax.jit(lambda key: run(key))(jax.random.key(0))
  assert jax.tree.structure(got[0]) == jax.tree.structure(want[0])
  _close(got[0], want[0], 0, 0)  # the same initializers drawing the same keys
  _close(got[1], want[1], 2e-5, 2e-6)
  ran = {(c.what, c.ran) for c in report.calls}
  assert ("flax.linen.Dense + flax.linen.relu", "jaxact.dense_bias_act(relu)") in ran
  assert ("flax.linen.SelfAttention", "jaxact.dot_product_attention") in ran
  assert ("flax.linen.LayerNorm", "jaxact.layer_norm") in ran
  assert ("jax.nn.log_softmax", "jaxact.log_softmax") in ran
  assert report.left == [] and len(report.taken) == (2 * 5 + 2) + (2 * 5 + 3)  # init, then apply
  assert jax.nn.relu is nn.relu and not hasattr(nn.relu, "_jaxact_routed_original")  # given back


@pytest.mark.exhaustive  # the float32 test runs the same calls by default
def test_lm1b_in_float64_to_float64_rounding():
  with jax.enable_x64(True):
    model, params = _lm1b(jnp.float64)
    loss = functools.partial(lm1b.loss_fn, model)
    want = jax.jit(jax.value_and_grad(loss))(params, TOKENS)
    with jnn.intercept():
      got = jax.jit(jax.value_and_grad(loss))(params, TOKENS)
    assert got[0].dtype == jnp.float64
    _close(got, want, 1e-11, 1e-13)


@pytest.mark.exhaustive  # steps agreeing: the ResNet test's by default
def test_lm1b_trains_the_same_with_dropout_off_and_draws_dropout_with_it_on():
  model, params = _lm1b()
  tx = optax.adam(1e-2)

  def train(params, steps=3):
    state = tx.init(params)
    step = jax.jit(jax.value_and_grad(functools.partial(lm1b.loss_fn, model)))
    for _ in range(steps):
      loss, grads = step(params, TOKENS)
      updates, state = tx.update(grads, state)
      params = optax.apply_updates(params, updates)
    return loss, params

  want = train(params)
  with jnn.intercept():
    got = train(params)
  _close(got, want, 1e-4, 1e-5)
  # dropout 0.1 but in the attention weights: the dropouts fused into the dense ops draw Flax's
  # bits from Flax's keys, so the training matches; jaxact's attention draws its own
  dropping = lm1b.TransformerLM(lm1b.Config(attention_dropout_rate=0.0))
  step = jax.value_and_grad(functools.partial(lm1b.loss_fn, dropping))
  want = step(params, TOKENS, jax.random.key(1))
  with jnn.intercept():
    got = jax.jit(jax.value_and_grad(functools.partial(lm1b.loss_fn, dropping)))(
      params, TOKENS, jax.random.key(1)
    )
  _close(got, want, 2e-5, 2e-6)


@pytest.mark.exhaustive  # by default: the same layers in the small block below
def test_resnet_batch_norm_statistics_and_gradients_match_flax_under_its_axis_name():
  model = resnet.ResNet(
    stage_sizes=[1, 1], block_cls=resnet.ResNetBlock, num_classes=10, num_filters=8
  )
  images = jax.random.normal(jax.random.key(1), (2, 2, 16, 16, 3))  # 2 "devices" of 2 images
  init = jax.vmap(lambda x: model.init(jax.random.key(0), x, train=False), axis_name="batch")
  variables = jax.tree.map(lambda a: a[0], init(images))

  def loss(params, x):  # train.py's loss_fn: the logits' cross-entropy, the batch statistics
    logits, state = model.apply(
      {"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"]
    )
    return resnet.cross_entropy_loss(logits, jnp.array([1, 2])), state

  def step():  # a new function each time: jit's cache keeps what a function traced
    grad = jax.value_and_grad(loss, has_aux=True)
    return jax.vmap(grad, in_axes=(None, 0), axis_name="batch")(variables["params"], images)

  want = jax.jit(step)()
  with jnn.intercept() as report:
    got = jax.jit(lambda: step())()
  _close(got, want, 2e-4, 2e-5)  # loss, batch statistics (averaged over "batch"), gradients
  ran = {(c.what, c.ran) for c in report.calls}
  assert ("flax.linen.BatchNorm + jax.nn.relu", "jaxact.batch_norm_act(relu)") in ran  # self.act
  assert ("flax.linen.BatchNorm + flax.linen.relu", "jaxact.batch_norm_act(relu)") in ran
  assert report.left == []


class _Block(nn.Module):
  """ResNet's block in small: conv -> BatchNorm -> relu as an attribute (``act``), and as
  ``nn.relu`` after the residual add; batch statistics over the example's ``axis_name``."""

  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=False, axis_name="batch")
    y = self.act(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
    return nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(y)) + x)


def test_batch_norm_statistics_and_gradients_match_flax_under_an_axis_name():
  x = jax.random.normal(jax.random.key(1), (2, 2, 6, 6, 8))  # 2 "devices" of 2 images
  variables = jax.vmap(lambda x: _Block().init(jax.random.key(0), x), axis_name="batch")(x)
  variables = jax.tree.map(lambda a: a[0], variables)

  def loss(params, x):
    y, state = _Block().apply(
      {"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"]
    )
    return jnp.sum(jnp.sin(y)), state

  def step():  # a new function each time: jit's cache keeps what a function traced
    grad = jax.value_and_grad(loss, has_aux=True)
    return jax.vmap(grad, in_axes=(None, 0), axis_name="batch")(variables["params"], x)

  want = jax.jit(step)()
  with jnn.intercept() as report:
    got = jax.jit(lambda: step())()
  _close(got, want, 2e-5, 2e-5)  # loss, batch statistics (averaged over "batch"), gradients
  assert sorted(c.ran for c in report.calls) == [  # the first norm fused with `act`; the
    "jaxact.batch_norm_act",  # second's relu follows an add; the convolutions feed norms, the
    "jaxact.batch_norm_act(relu)",  # second from the first norm's x_hat
    "jaxact.conv_bias_act",
    "jaxact.conv_bias_act, its input made again from the norm's x_hat",
    "jaxact.relu",
  ]
  assert report.calls[0].what == "flax.linen.BatchNorm + jax.nn.relu"


class _Odd(nn.Module):
  """What the interceptor must leave to Flax: each reported with its reason."""

  act: Callable = nn.gelu

  @nn.compact
  def __call__(self, x):
    custom = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)
    x = nn.Dense(8, dot_general=custom)(x)
    x = type("MyDense", (nn.Dense,), {})(8)(x)  # a subclass: its own call
    x = nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=-1)(x)  # a scale per feature only
    x = self.act(nn.Dense(8)(x))  # an attribute holding jax.nn.gelu: routed and fused
    x = x + nn.Dense(8, dtype=jnp.complex64, param_dtype=jnp.float32)(x).real  # not real floats
    return nn.relu(x.astype(jnp.int32))  # integers: jax.nn's own


def test_what_it_cannot_take_runs_flax_s_code_and_says_why():
  x = jax.random.normal(jax.random.key(0), (3, 4, 8))
  params = _Odd().init(jax.random.key(1), x)
  with jnn.intercept() as report:
    got = _Odd().apply(params, x)
  np.testing.assert_array_equal(got, _Odd().apply(params, x))
  left = {(c.what, c.why) for c in report.left}
  assert ("flax.linen.Dense", "a custom dot_general / dot_general_cls") in left
  assert ("flax.linen.Dense", "dtype complex64, param_dtype float32: not real floats") in left
  left = {c.what: c.why for c in report.left}
  assert left["MyDense"] == "a subclass of flax.linen.Dense: its own call runs"
  assert "feature_axes" in left["flax.linen.LayerNorm"]
  assert "int32" in left["flax.linen.relu"]
  ran = {(c.what, c.ran) for c in report.taken}
  assert ("flax.linen.Dense + jax.nn.gelu", "jaxact.dense_bias_act(gelu)") in ran
  assert "left" in str(report) and "taken" in str(report)


def test_a_dropout_straight_after_a_dense_op_joins_it_with_flax_s_bits():
  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(32)(x)))
      return nn.Dropout(0.3)(nn.Dense(16)(h), deterministic=False)

  x = jax.random.normal(jax.random.key(0), (4, 16))
  params = Mlp().init(jax.random.key(1), x)

  def loss(params):
    return jnp.sum(jnp.sin(Mlp().apply(params, x, rngs={"dropout": jax.random.key(5)})))

  want = jax.value_and_grad(loss)(params)
  with jnn.intercept() as report:
    got = jax.value_and_grad(loss)(params)
  _close(got, want, 1e-5, 1e-6)
  assert [c.ran for c in report.calls] == [
    "jaxact.dense_bias_act(relu, dropout)",
    "jaxact.dense_bias_act(identity, dropout)",
  ]


def test_nn_sequential_s_activations_are_routed_and_given_back():
  model = nn.Sequential([nn.Dense(32), nn.gelu, nn.LayerNorm(), nn.Dense(4)])
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = model.init(jax.random.key(1), x)
  want = jax.grad(lambda p: jnp.sum(jnp.sin(model.apply(p, x))))(params)
  with jnn.intercept() as report:
    got = jax.grad(lambda p: jnp.sum(jnp.sin(model.apply(p, x))))(params)
  _close(got, want, 1e-5, 1e-6)
  assert report.calls[0].ran == "jaxact.dense_bias_act(gelu)"
  assert model.layers[1] is jax.nn.gelu


def test_the_decorator_form_routes_what_jit_traces_and_prints_its_report(capsys):
  x = jax.random.normal(jax.random.key(0), (4, 8))
  layer = nn.Dense(16)
  params = layer.init(jax.random.key(1), x)

  @jax.jit
  @jnn.intercept(report=True)
  def f(params, x):
    return jax.nn.silu(layer.apply(params, x))

  np.testing.assert_allclose(f(params, x), jax.nn.silu(layer.apply(params, x)), rtol=1e-6)
  assert "flax.linen.Dense + jax.nn.silu -> jaxact.dense_bias_act(silu)" in capsys.readouterr().out


def test_bad_arguments_name_themselves():
  with pytest.raises(TypeError, match=r"jaxact.linen.intercept: `report` must be True or False"):
    jnn.intercept(report="yes")


class _UNetBlock(nn.Module):
  """A diffusion U-Net's residual block as Flax users write it: GroupNorm -> silu -> Conv, twice."""

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(x.shape[-1], (3, 3))(nn.silu(nn.GroupNorm(num_groups=4)(x)))
    return x + nn.Conv(x.shape[-1], (3, 3))(nn.silu(nn.GroupNorm(num_groups=4)(h)))


def test_a_conv_on_a_norm_s_activation_keeps_the_norm_s_x_hat_alone():
  model = nn.Sequential([_UNetBlock(), _UNetBlock()])
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 16))
  params = model.init(jax.random.key(1), x)["params"]
  f = lambda p, x: model.apply({"params": p}, x)
  g = jax.random.normal(jax.random.key(2), x.shape)
  step = lambda p, x: (lambda y, pull: (y, pull(g)))(*jax.vjp(f, p, x))
  kept = lambda p, x: [a for a in jax.tree.leaves(jax.vjp(f, p, x)[1]) if a.size >= x.size]
  want = jax.jit(step)(params, x)
  with jnn.intercept() as report:
    _close(jax.jit(lambda p, x: step(p, x))(params, x), want, 2e-5, 2e-5)
    ours = jax.eval_shape(kept, params, x)
  assert report.summary() == {  # 4 norms and 4 convolutions, traced twice
    ("flax.linen.GroupNorm + flax.linen.silu", "jaxact.group_norm_act(silu)", ""): 8,
    ("flax.linen.Conv", "jaxact.conv_bias_act, its input made again from the norm's x_hat", ""): 8,
  }
  # What the backward pass keeps: each norm's x_hat (4 norms), not also the silu's output that
  # each convolution takes (8 arrays of x's size without the x_hat path)
  assert len(ours) == 4, ours


@pytest.mark.exhaustive  # the float32 test above runs the same path by default
def test_a_conv_on_a_norm_s_x_hat_in_bfloat16_is_as_close_to_float32_as_flax_is():
  model = nn.Sequential([_UNetBlock(), _UNetBlock()])
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 16))
  params = model.init(jax.random.key(1), x)["params"]
  g = jax.random.normal(jax.random.key(2), x.shape)

  def step(params, x):  # the output and every gradient, in float32
    y, pull = jax.vjp(lambda p, x: model.apply({"params": p}, x), params, x)
    return jax.tree.map(lambda a: a.astype(jnp.float32), (y, pull(g.astype(y.dtype))))

  half = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
  want = jax.jit(step)(params, x)
  flax = jax.jit(step)(half(params), half(x))
  with jnn.intercept():
    ours = jax.jit(lambda p, x: step(p, x))(half(params), half(x))
  for o, f, w in zip(*(jax.tree.leaves(t) for t in (ours, flax, want)), strict=True):
    scale = float(jnp.max(jnp.abs(w))) + 1e-6
    # bfloat16 holds 8 bits: both within a few of its ulps of each array's scale (2^-8); measured
    # below 2.2x Flax's error for every array, and below Flax's for most
    ours, flax_err = float(jnp.max(jnp.abs(o - w))), float(jnp.max(jnp.abs(f - w)))
    assert ours <= max(2.5 * flax_err, 2**-7 * scale)
