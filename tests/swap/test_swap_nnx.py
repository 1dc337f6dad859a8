"""jaxact.nnx.swap: a model written with Flax's own nnx layers, swapped in place, trains as the
original does (the original Flax model is the reference), and says what it took and left."""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxact.nnx as jnnx
import lm1b_nnx_example as lm1b_nnx
from jaxact._src.swap import nnx as swap_nnx


class Block(nnx.Module):
  def __init__(self, d: int, act: str, *, rngs: nnx.Rngs):
    self.act = act
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln(x), is_causal=True)
    return x + self.down(getattr(nnx, self.act)(self.up(self.norm(x))))


class LM(nnx.Module):
  def __init__(self, vocab: int = 11, d: int = 8, acts=("gelu",), *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, act, rngs=rngs) for act in acts])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


class CNN(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.conv2 = nnx.Conv(4, 8, (3, 3), strides=2, rngs=rngs)
    self.gn = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
    self.head = nnx.Linear(8, 5, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv1(x)))
    x = nnx.relu(self.gn(self.conv2(x)))
    return self.head(x.mean(axis=(1, 2)))


class MLP(nnx.Module):
  def __init__(self, d: int, depth: int, *, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(depth)])

  def __call__(self, x):
    for layer in self.layers:
      x = nnx.gelu(layer(x))
    return x


def _lm_batch(dtype=jnp.float32):
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 11)
  return tokens, jnp.roll(tokens, -1, axis=1)


def _cnn_batch(dtype=jnp.float32):
  x = jax.random.normal(jax.random.key(2), (4, 6, 6, 3), dtype)
  return x, jax.random.randint(jax.random.key(3), (4,), 0, 5)


def _cast(model, dtype=jnp.float64):
  """`model` with its floating-point state in `dtype`."""
  state = nnx.state(model)
  cast = lambda v: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v
  nnx.update(model, jax.tree.map(cast, state))
  return model


def _loss(model, x, labels):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _flat(state):
  return {tuple(map(str, p)): v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _assert_close(got, want, tol):
  got, want = _flat(got), _flat(want)
  assert got.keys() == want.keys()
  for path in want:
    assert got[path].shape == want[path].shape and got[path].dtype == want[path].dtype, path
    np.testing.assert_allclose(got[path], want[path], rtol=tol, atol=tol, err_msg=str(path))


def _train(model, batch, routed: bool, steps: int = 3, loss=_loss):
  """(loss, grads) of the first step, the routing's report, and the state after `steps` steps of
  adam on `loss(model, *batch)`, each step under nnx.jit (the routing active while it is
  traced)."""
  optimizer = nnx.Optimizer(model, optax.adam(1e-2, eps=1e-3), wrt=nnx.Param)
  route = jnnx.route_activations()

  def step(model, optimizer, *batch):
    value, grads = nnx.value_and_grad(loss)(model, *batch)
    optimizer.update(model, grads)
    return value, grads

  step = nnx.jit(route(step) if routed else step)
  first = step(model, optimizer, *batch)
  for _ in range(steps - 1):
    step(model, optimizer, *batch)
  return first, route.report, nnx.state(model)


def _parity(make, batch, tol: float, routes=(False, True)):
  """Swap a copy of `make()`, trained plainly and/or under the routing (`routes`), against the
  original Flax model; return the swap's report and the last routing's."""
  original = make()
  (want_loss, want_grads), _, want_state = _train(original, batch, False)
  reports = []
  for routed in routes:
    swapped = make()
    report = jnnx.swap(swapped)
    _assert_close(nnx.state(swapped), nnx.state(make()), 0)  # the same tree and values
    (loss, grads), routing, state = _train(swapped, batch, routed)
    np.testing.assert_allclose(loss, want_loss, rtol=tol)
    _assert_close(grads, want_grads, tol)
    _assert_close(state, want_state, tol)
    reports.append(report)
  assert all(report == reports[0] for report in reports)
  return reports[0], routing


@pytest.mark.exhaustive  # Flax's lm1b_nnx example runs the same path by default (but RMSNorm, gelu)
def test_transformer_trains_as_the_flax_original():
  # the swap alone, unrouted: test_swapped_without_and_with_the_routing_train_as_... (exhaustive)
  report, routing = _parity(lambda: LM(rngs=nnx.Rngs(0)), _lm_batch(), 2e-5, routes=(True,))
  assert {c.ran for c in report.taken} == {
    "jaxact.nnx.LinearAct",
    "jaxact.nnx.LayerNorm",
    "jaxact.nnx.RMSNorm",
    "jaxact.nnx.dot_product_attention",
  }
  # the MLPs' up-projections fuse with the activation after them: one op each
  fused = {c.ran for c in routing.taken if c.what.startswith("flax.nnx.Linear + ")}
  assert fused == {"jaxact.dense_bias_act(gelu)"}


def test_flax_lm1b_nnx_example_trains_unchanged_under_the_swap():
  # Flax's examples/lm1b_nnx model as written, dropout off (train.py's eval setting). Padding at
  # the ends of two rows: their query rows see no key, and only the logits read them (the loss
  # weighs them 0); the swap keeps Flax's value there.
  original = lm1b_nnx.TransformerLM(lm1b_nnx.TransformerConfig(), rngs=nnx.Rngs(0))
  original.set_attributes(deterministic=True, decode=False)
  swapped = copy.deepcopy(original)
  report = jnnx.swap(swapped)
  _assert_close(nnx.state(swapped), nnx.state(original), 0)  # the same tree and values
  tokens = jax.random.randint(jax.random.key(4), (3, 8), 1, 64, jnp.int32)
  tokens = tokens.at[0, 5:].set(0).at[2, 2:].set(0)
  logits = nnx.jit(jnnx.route_activations()(lambda model, x: model(x)))
  np.testing.assert_allclose(logits(swapped, tokens), original(tokens), rtol=2e-5, atol=2e-5)

  train = functools.partial(_train, batch=(tokens,), loss=lm1b_nnx.loss_fn)
  (want_loss, want_grads), _, want_state = train(original, routed=False)
  (loss, grads), routing, state = train(swapped, routed=True)
  np.testing.assert_allclose(loss, want_loss, rtol=2e-5)
  _assert_close(grads, want_grads, 2e-5)
  _assert_close(state, want_state, 2e-5)

  blocks = original.config.num_layers
  none = "jaxact has no layer for it"
  assert report.summary() == {
    ("flax.nnx.Embed", None, none): 1,
    # a block's, its MLP's, the decoder's; off here (deterministic), joined to a Linear before it
    # when on (test_a_dropout_after_a_swapped_linear_joins_its_op_with_nnx_s_bits)
    ("flax.nnx.Dropout", "jaxact's dense op before it (route_activations)", ""): 2 * blocks + 1,
    ("flax.nnx.LayerNorm", "jaxact.nnx.LayerNorm", ""): 2 * blocks + 1,
    ("flax.nnx.MultiHeadAttention", "jaxact.nnx.dot_product_attention", ""): blocks,
    ("flax.nnx.LinearGeneral", None, none): 4 * blocks,  # the attention's projections
    ("flax.nnx.Linear", "jaxact.nnx.LinearAct", ""): 2 * blocks + 1,
  }
  # each MLP's linear1 -> relu is one op; linear2 and the head run jaxact's dense alone
  assert routing.summary() == {
    ("flax.nnx.Linear + flax.nnx.relu", "jaxact.dense_bias_act(relu)", ""): blocks,
    ("flax.nnx.log_softmax", "jaxact.log_softmax", ""): 1,
    ("flax.nnx.Linear", "jaxact.dense_bias_act", ""): blocks + 1,
  }
  fused = [c.where for c in routing.taken if "relu" in c.what]
  assert fused == [f"decoder/encoderdecoderblock_{i}/mlp/linear1" for i in range(blocks)]


@pytest.mark.exhaustive
def test_swapped_without_and_with_the_routing_train_as_the_flax_original():
  make = lambda: LM(acts=("gelu", "relu"), rngs=nnx.Rngs(0))
  _, routing = _parity(make, _lm_batch(), 2e-5)
  fused = {c.ran for c in routing.taken if c.what.startswith("flax.nnx.Linear + ")}
  assert fused == {"jaxact.dense_bias_act(gelu)", "jaxact.dense_bias_act(relu)"}
  _parity(lambda: CNN(rngs=nnx.Rngs(0)), _cnn_batch(), 2e-5)


def test_cnn_trains_as_the_flax_original_batch_stats_included():
  make = lambda: CNN(rngs=nnx.Rngs(0))
  report, routing = _parity(make, _cnn_batch(), 2e-5, routes=(True,))
  assert {c.ran for c in report.taken} == {
    "jaxact.nnx.ConvAct",
    "jaxact.nnx.BatchNorm",
    "jaxact.nnx.GroupNorm",
    "jaxact.nnx.LinearAct",
  }
  # the batch statistics, updated by the fused call only, match Flax's (in _parity's state)
  fused = {c.ran for c in routing.taken if " + " in c.what}
  assert fused == {"jaxact.batch_norm_act(relu)", "jaxact.group_norm_act(relu)"}


# Flax's attention takes its softmax in float32 even for float64 inputs, jaxact's in float64
# (docs/attention.md): the transformer agrees to float32's rounding there, the CNN to float64's.
@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "make,batch,tol", [(LM, _lm_batch, 1e-6), (CNN, _cnn_batch, 1e-10)], ids=["lm", "cnn"]
)
def test_float64_trains_as_the_flax_original(make, batch, tol):
  with jax.enable_x64(True):
    _parity(lambda: _cast(make(rngs=nnx.Rngs(0))), batch(jnp.float64), tol)


class MyLinear(nnx.Linear):
  pass


def _my_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
  return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def _my_attention(query, key, value, **kw):
  return nnx.dot_product_attention(query, key, value, **kw)


class Mixed(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.plain = nnx.Linear(4, 4, rngs=rngs)
    self.custom = nnx.Linear(4, 4, dot_general=_my_dot, rngs=rngs)
    self.mine = MyLinear(4, 4, rngs=rngs)
    self.ints = nnx.Linear(4, 4, preferred_element_type=jnp.int32, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 4, attention_fn=_my_attention, decode=False, rngs=rngs)
    self.ln = nnx.LayerNorm(4, reduction_axes=(-2, -1), feature_axes=-1, rngs=rngs)
    self.rms = nnx.RMSNorm(4, rngs=rngs)

  def __call__(self, x):
    x = self.mine(self.custom(self.plain(x)))
    return self.rms(self.ln(self.attn(x)))


def test_report_names_what_it_took_and_what_it_left_and_why():
  model = Mixed(rngs=nnx.Rngs(0))
  original = copy.deepcopy(model)
  report = jnnx.swap(model)
  calls = {c.where: c for c in report.calls}
  assert {w for w, c in calls.items() if c.taken} == {"plain", "rms"}
  assert calls["plain"].what == "flax.nnx.Linear" and calls["plain"].ran == "jaxact.nnx.LinearAct"
  assert "custom dot_general" in calls["custom"].why
  assert (
    calls["mine"].what.endswith("MyLinear") and "subclass of flax.nnx.Linear" in calls["mine"].why
  )
  assert "int32" in calls["ints"].why
  assert calls["attn"].why == "a custom attention_fn"
  assert "feature_axes" in calls["ln"].why
  # the projections inside the attention: Flax layers jaxact has none for
  assert calls["attn/query"].what == "flax.nnx.LinearGeneral" and not calls["attn/query"].taken
  for where in ("custom", "mine", "ints", "ln"):
    assert type(getattr(model, where)) is type(getattr(original, where)), where
  assert model.attn.attention_fn is _my_attention
  x = jax.random.normal(jax.random.key(0), (2, 3, 4), jnp.float32)
  np.testing.assert_allclose(model(x), original(x), rtol=1e-6, atol=1e-6)
  assert str(report).startswith("2 taken, 9 left")
  assert "flax.nnx.Linear left: a custom dot_general" in str(report)


def test_swapped_layers_have_the_attributes_jaxact_layers_are_made_with():
  # A new attribute in jaxact's __init__ that swap does not set fails here.
  rngs = nnx.Rngs(0)
  cases = [
    (nnx.Linear(3, 4, rngs=rngs), jnnx.LinearAct(3, 4, rngs=rngs)),
    (nnx.Conv(3, 4, (3,), rngs=rngs), jnnx.ConvAct(3, 4, (3,), rngs=rngs)),
    (nnx.LayerNorm(4, rngs=rngs), jnnx.LayerNorm(4, rngs=rngs)),
    (nnx.RMSNorm(4, rngs=rngs), jnnx.RMSNorm(4, rngs=rngs)),
    (nnx.BatchNorm(4, rngs=rngs), jnnx.BatchNorm(4, rngs=rngs)),
    (nnx.GroupNorm(4, num_groups=2, rngs=rngs), jnnx.GroupNorm(4, num_groups=2, rngs=rngs)),
  ]
  for flax_layer, jaxact_layer in cases:
    jnnx.swap(flax_layer)
    assert isinstance(flax_layer, type(jaxact_layer))
    got = {k: v for k, v in vars(flax_layer).items() if k != swap_nnx._WHERE}
    want = vars(jaxact_layer)
    assert got.keys() == want.keys(), type(jaxact_layer)
    for name in vars(jaxact_layer).keys() - vars(nnx.Module).keys():
      if not isinstance(want[name], (nnx.Variable, nnx.Module, nnx.Pytree)) and name[0] != "_":
        assert np.all(got[name] == want[name]), (type(jaxact_layer), name)
    assert jax.tree.structure(nnx.state(flax_layer)) == jax.tree.structure(nnx.state(jaxact_layer))


def test_a_norm_called_with_a_mask_runs_flax_s_call():
  x = jax.random.normal(jax.random.key(0), (2, 4, 8), jnp.float32)
  mask = jnp.arange(8) < 6
  for make in (
    nnx.LayerNorm,
    nnx.RMSNorm,
    nnx.BatchNorm,
    lambda n, rngs: nnx.GroupNorm(n, 2, rngs=rngs),
  ):
    original = make(8, rngs=nnx.Rngs(0))
    swapped = copy.deepcopy(original)
    jnnx.swap(swapped)
    np.testing.assert_array_equal(swapped(x, mask=mask), original(x, mask=mask))
    _assert_close(nnx.state(swapped), nnx.state(original), 0)


def test_an_optimizer_made_before_the_swap_keeps_working_and_swap_twice_changes_nothing():
  model = MLP(4, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  kernel = model.layers[0].kernel
  assert len(jnnx.swap(model).taken) == 2
  assert model.layers[0].kernel is kernel and jnnx.swap(model).calls == []
  x = jnp.ones((3, 4), jnp.float32)
  grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
  before = kernel[...]
  optimizer.update(model, grads)
  want = before - 0.1 * grads["layers"][0]["kernel"][...]
  np.testing.assert_allclose(model.layers[0].kernel[...], want)


def _temp_bytes(model, routed: bool) -> int:
  def grads(model, x):
    return nnx.grad(lambda m: (m(x) ** 2).mean())(model)

  grads = jnnx.route_activations()(grads) if routed else grads
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda state, x: grads(nnx.merge(graphdef, state), x))
  compiled = step.lower(state, jnp.ones((256, 128), jnp.float32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_swapped_and_routed_train_step_keeps_less_than_flax_s():
  original = MLP(128, 4, rngs=nnx.Rngs(0))
  swapped = copy.deepcopy(original)
  jnnx.swap(swapped)
  flax_bytes = _temp_bytes(original, False)
  assert _temp_bytes(swapped, False) <= flax_bytes
  assert _temp_bytes(swapped, True) < flax_bytes


def test_bad_input_is_refused_by_name():
  with pytest.raises(
    TypeError, match=r"jaxact.nnx.swap: `model` must be a flax.nnx.Module; got dict"
  ):
    jnnx.swap({"layer": nnx.Linear(2, 2, rngs=nnx.Rngs(0))})
  with pytest.raises(TypeError, match=r"jaxact.nnx.swap: `report` must be a bool; got 'yes'"):
    jnnx.swap(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), report="yes")


def test_report_true_prints_it(capsys):
  jnnx.swap(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), report=True)
  assert (
    capsys.readouterr().out == "1 taken, 0 left\n     1 x flax.nnx.Linear -> jaxact.nnx.LinearAct\n"
  )


@pytest.mark.exhaustive  # the lm1b_nnx example's padding rows check it by default
def test_attention_rows_whose_every_key_is_masked_keep_flax_s_value():
  def make():
    return nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=nnx.Rngs(0))

  x = jax.random.normal(jax.random.key(1), (2, 5, 8), jnp.float32)
  tokens = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  mask = nnx.combine_masks(
    nnx.make_attention_mask(tokens > 0, tokens > 0), nnx.make_causal_mask(tokens)
  )
  call = nnx.jit(lambda model, x: model(x, mask=mask))
  want = call(make(), x)
  swapped = make()
  jnnx.swap(swapped)
  np.testing.assert_allclose(call(swapped, x), want, rtol=1e-5, atol=1e-6)  # padding rows too


class _DroppedMLP(nnx.Module):  # lm1b_nnx's MLP: Linear -> relu -> Dropout -> Linear -> Dropout
  def __init__(self, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(6, 16, rngs=rngs)
    self.down = nnx.Linear(16, 6, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.out_dropout = nnx.Dropout(0.5, broadcast_dims=(0,), deterministic=False, rngs=rngs)

  def __call__(self, x, *, rngs=None):
    x = self.dropout(nnx.relu(self.up(x)), rngs=rngs)
    return self.out_dropout(self.down(x)) + self.dropout(x.mean(-1, keepdims=True), rngs=rngs)


def test_a_dropout_after_a_swapped_linear_joins_its_op_with_nnx_s_bits():
  """nnx.Dropout of a swapped Linear's output (after its fused activation, or alone) joins the op
  with nnx's key and formula: the training matches the original's with dropout on, every key
  drawn from the same streams (the call's Rngs, the layer's own); a dropout of anything else,
  and a deterministic one, stay nnx's."""
  x = jax.random.normal(jax.random.key(1), (4, 6))

  def loss(model, x, rngs):
    return jnp.sum(model(x, rngs=rngs) ** 2)

  def train(routed: bool):
    model = _DroppedMLP(rngs=nnx.Rngs(0, dropout=1))
    model.set_attributes(deterministic=False)
    report = jnnx.swap(model) if routed else None
    return _train(model, (x, nnx.Rngs(dropout=2)), routed, loss=loss), report

  (want, _, want_state), _ = train(False)
  ((got, routing, state), report) = train(True)
  _assert_close(got, want, 1e-6)
  keys = lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
  # the parameters, and the streams' keys and counts: the same draws
  _assert_close(jax.tree.map(keys, state), jax.tree.map(keys, want_state), 1e-6)
  assert (
    report.summary()[("flax.nnx.Dropout", "jaxact's dense op before it (route_activations)", "")]
    == 2
  )
  assert routing.summary() == {
    (
      "flax.nnx.Linear + flax.nnx.relu + flax.nnx.Dropout",
      "jaxact.dense_bias_act(relu, dropout)",
      "",
    ): 1,
    ("flax.nnx.Linear + flax.nnx.Dropout", "jaxact.dense_bias_act(identity, dropout)", ""): 1,
  }


class _UNetBlock(nnx.Module):  # GroupNorm -> silu -> Conv, twice, and the residual
  def __init__(self, c: int, *, rngs: nnx.Rngs):
    self.gn1 = nnx.GroupNorm(c, num_groups=4, rngs=rngs)
    self.gn2 = nnx.GroupNorm(c, num_groups=4, rngs=rngs)
    self.conv1, self.conv2 = nnx.Conv(c, c, (3, 3), rngs=rngs), nnx.Conv(c, c, (3, 3), rngs=rngs)

  def __call__(self, x):
    h = self.conv1(nnx.silu(self.gn1(x)))
    return x + self.conv2(nnx.silu(self.gn2(h)))


def test_a_conv_on_a_norm_s_activation_keeps_the_norm_s_x_hat_alone():
  original = _UNetBlock(16, rngs=nnx.Rngs(0))
  swapped = copy.deepcopy(original)
  jnnx.swap(swapped)
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 16))
  g = jax.random.normal(jax.random.key(1), x.shape)

  def vjp(model):
    graphdef, state = nnx.split(model)
    return jax.vjp(lambda state, x: nnx.merge(graphdef, state)(x), state, x)

  y, pull = vjp(original)
  with jnnx.route_activations() as report:
    y_ours, pull_ours = vjp(swapped)
  np.testing.assert_allclose(y_ours, y, rtol=2e-5, atol=2e-5)
  for a, b in zip(jax.tree.leaves(pull_ours(g)), jax.tree.leaves(pull(g)), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  assert "jaxact.conv_bias_act, its input made again from the norm's x_hat" in {
    c.ran for c in report.calls
  }
  # each norm's x_hat, not also the silu's output each convolution takes (4 arrays without it)
  assert len([a for a in jax.tree.leaves(pull_ours) if a.size >= x.size]) == 2
