"""jaxact.linen.DenseAct / ConvAct against flax.linen.Dense / Conv and the jax.nn activation.

For a product of options: the parameter tree of ``init`` is Flax's (structure, shapes, dtypes and
values for the same key), and from the same (random) parameters the output and the gradients with
respect to the parameters and the input equal Flax's within the dtype's rounding. The fused op is
checked to be the path taken (or not, for the fallbacks), and an optax loop on the digits data
trains to the same losses as the Flax model and to a held-out accuracy.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxact
from jaxact.linen import ConvAct, DenseAct
from layer_cases import (
  ACTIVATION_IDS,
  ACTIVATIONS,
  assert_close,
  assert_trees_close,
  assert_trees_identical,
  count_fused_calls,
  digits,
  normal,
  random_like,
  vjp_all,
)

HIGHEST = lax.Precision.HIGHEST
KEY = jax.random.key(0)


@pytest.fixture
def fused_calls(monkeypatch):
  return count_fused_calls(monkeypatch)


def check_layer(flax_layer, act_layer, reference_act, x, *, grads: bool = True) -> None:
  """`act_layer` against `reference_act(flax_layer)` from the same random parameters.

  The parameter trees' structure, shapes and dtypes are compared from ``eval_shape`` (their values
  for the same key in :func:`test_init_is_flax`); then the outputs and, with `grads`, the
  gradients of a random cotangent in the parameters and the input, all in one compiled program.
  """
  shapes = jax.eval_shape(flax_layer.init, KEY, x)
  assert jax.eval_shape(act_layer.init, KEY, x) == shapes
  params = random_like(shapes)

  @jax.jit
  def both(params, x):
    flax_fn = lambda p, x: reference_act(flax_layer.apply(p, x))
    if grads:
      return vjp_all(act_layer.apply, params, x), vjp_all(flax_fn, params, x)
    return act_layer.apply(params, x), flax_fn(params, x)

  got, want = both(params, x)
  if grads:
    (y, grads_got), (y_want, grads_want) = got, want
    # Gradients carry the rounding of the computation's dtype (that of the output), whatever the
    # dtype of the parameters they are cast back to.
    assert_trees_close(grads_got, grads_want, "grad", tol_dtype=y_want.dtype)
  else:
    y, y_want = got, want
  assert_close(y, y_want, "output")


# ------------------------------------------------------------------------------ the attributes


@pytest.mark.parametrize(("ours", "theirs"), [(DenseAct, nn.Dense), (ConvAct, nn.Conv)])
def test_attributes_are_flax_plus_activation(ours, theirs):
  assert issubclass(ours, theirs)  # Flax's attributes inherited, not re-declared
  fields = [f for f in dataclasses.fields(ours) if f.name not in ("parent", "name")]
  flax_fields = [f for f in dataclasses.fields(theirs) if f.name not in ("parent", "name")]
  # DenseAct adds nn.Dropout's attributes after its own (dropout inside the op).
  dropout = {"dropout_rate": 0.0, "deterministic": None, "dropout_broadcast_dims": ()}
  dropout = {**dropout, "rng_collection": "dropout"} if ours is DenseAct else {}
  names = [f.name for f in flax_fields] + ["activation", "residual_bits", *dropout]
  assert [f.name for f in fields] == names
  assert [f.default for f in fields[len(flax_fields) :]] == ["identity", None, *dropout.values()]
  for f, g in zip(fields, flax_fields, strict=False):
    if f.name.endswith("_init"):  # initializers are made by factories: compare what they draw
      shape = (3, 4)
      assert_close(f.default(KEY, shape, jnp.float32), g.default(KEY, shape, jnp.float32), f.name)
    else:
      assert f.default is g.default or f.default == g.default, f.name


def test_import_jaxact_does_not_import_flax():
  code = "import sys, jaxact; assert 'flax' not in sys.modules; import jaxact.linen, jaxact.nnx"
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.exhaustive
@pytest.mark.parametrize("module", ["jaxact.linen", "jaxact.nnx"])
def test_the_flax_layers_without_flax_name_the_extra_to_install(module):
  """Flax is an extra (`jaxact[flax]`): without it, jaxact works and the layers say what to do."""
  code = (
    "import sys; sys.modules['flax'] = None\n"  # `import flax` now raises ImportError
    "import jax.numpy as jnp, jaxact; jaxact.relu(jnp.ones(2))\n"
    f"try:\n  import {module}\nexcept ImportError as e:\n  print(e)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  assert f"{module} needs Flax" in out.stdout and "pip install 'jaxact[flax]'" in out.stdout


# --------------------------------------------------------------------- parameters from init


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  ("flax_layer", "act_layer", "shape"),
  [
    (nn.Dense(6), DenseAct(6, activation="gelu"), (4, 5)),
    (
      nn.Dense(6, use_bias=False, param_dtype=jnp.bfloat16),
      DenseAct(6, use_bias=False, param_dtype=jnp.bfloat16, activation="relu"),
      (2, 3, 5),
    ),
    (
      nn.Dense(6, kernel_init=nn.initializers.orthogonal(), bias_init=nn.initializers.ones),
      DenseAct(
        6,
        kernel_init=nn.initializers.orthogonal(),
        bias_init=nn.initializers.ones,
        activation=jaxact.tanh,
      ),
      (4, 5),
    ),
    (nn.Conv(6, (3, 2)), ConvAct(6, (3, 2), activation="relu"), (2, 7, 6, 4)),
    (
      nn.Conv(6, 3, feature_group_count=2, padding="CIRCULAR", param_dtype=jnp.float64),
      ConvAct(
        6, 3, feature_group_count=2, padding="CIRCULAR", param_dtype=jnp.float64, activation="elu"
      ),
      (9, 4),  # unbatched
    ),
  ],
  ids=["dense", "dense-no-bias-bf16", "dense-inits", "conv", "conv-1d-groups-unbatched"],
)
def test_init_is_flax(flax_layer, act_layer, shape):
  """The same key gives the same parameters: tree, shapes, dtypes and values."""
  x = normal(shape, jnp.float32)
  got, want = jax.jit(lambda k, x: (act_layer.init(k, x), flax_layer.init(k, x)))(KEY, x)
  assert_trees_identical(got, want)


# ------------------------------------------------------------------ equivalence with Flax: Dense

DENSE_OPTIONS = list(
  itertools.product(
    [True, False],  # use_bias
    [None, jnp.float32, jnp.bfloat16, jnp.float64],  # dtype
    [jnp.float32, jnp.bfloat16],  # param_dtype
  )
)


@pytest.mark.sample(2)
@pytest.mark.parametrize(("use_bias", "dtype", "param_dtype"), DENSE_OPTIONS, ids=str)
def test_dense_options(use_bias, dtype, param_dtype):
  # The activation and the precision cycle, so that each meets several option combinations.
  i = DENSE_OPTIONS.index((use_bias, dtype, param_dtype))
  activation, reference = ACTIVATIONS[ACTIVATION_IDS[i % len(ACTIVATION_IDS)]]
  kw = dict(
    use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=(None, HIGHEST)[i % 2]
  )
  x = normal((4, 3, 5), jnp.float32)
  check_layer(nn.Dense(6, **kw), DenseAct(6, activation=activation, **kw), reference, x)


@pytest.mark.sample(5)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTIVATION_IDS)
def test_dense_activations(act, dtype):
  activation, reference = ACTIVATIONS[act]
  kw = dict(dtype=dtype, param_dtype=dtype)
  x = normal((8, 5), dtype)
  check_layer(nn.Dense(7, **kw), DenseAct(7, activation=activation, **kw), reference, x)


# ------------------------------------------------------------------- equivalence with Flax: Conv

PADDINGS = ["SAME", "VALID", ((1, 2), (0, 1)), "CIRCULAR", "REFLECT"]
CONV_OPTIONS = list(
  itertools.product(
    PADDINGS,
    [1, 2],  # strides
    [1, 2],  # kernel_dilation
    [1, 2],  # feature_group_count
  )
)


def conv_case(i, padding, strides, kernel_dilation, groups):
  activation, reference = ACTIVATIONS[ACTIVATION_IDS[i % len(ACTIVATION_IDS)]]
  kw = dict(
    kernel_size=(3, 2),
    padding=padding,
    strides=strides,
    kernel_dilation=kernel_dilation,
    feature_group_count=groups,
    use_bias=i % 3 != 0,
  )
  return nn.Conv(6, **kw), ConvAct(6, activation=activation, **kw), reference


# Every pair of values of (strides, kernel_dilation, feature_group_count) (an L4 array): with these
# the gradients are compared too, for every padding (a convolution's gradient is slow to compile on
# CPU; the other rows of the product compare outputs).
PAIRWISE = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)]


@pytest.mark.sample(3)
@pytest.mark.parametrize(("padding", "strides", "kernel_dilation", "groups"), CONV_OPTIONS, ids=str)
def test_conv_options(padding, strides, kernel_dilation, groups):
  i = CONV_OPTIONS.index((padding, strides, kernel_dilation, groups))
  layers = conv_case(i, padding, strides, kernel_dilation, groups)
  grads = (strides, kernel_dilation, groups) in PAIRWISE
  check_layer(*layers, normal((2, 7, 6, 4), jnp.float32), grads=grads)


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  ("dtype", "param_dtype", "precision", "act"),
  [
    (None, jnp.bfloat16, None, "gelu"),
    (jnp.bfloat16, jnp.float32, HIGHEST, "partial(leaky_relu)"),
    (jnp.float64, jnp.float32, HIGHEST, "lambda"),
  ],
  ids=str,
)
def test_conv_dtypes(dtype, param_dtype, precision, act):
  activation, reference = ACTIVATIONS[act]
  kw = dict(kernel_size=(3,), dtype=dtype, param_dtype=param_dtype, precision=precision)
  x = normal((2, 6, 3), jnp.float32)
  check_layer(nn.Conv(4, **kw), ConvAct(4, activation=activation, **kw), reference, x)


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  ("kw", "shape"),
  [
    (dict(kernel_size=3, padding="CAUSAL"), (2, 9, 3)),  # 1-D, an int kernel size
    (dict(kernel_size=(3,), padding="CAUSAL", kernel_dilation=2), (2, 9, 3)),
    (dict(kernel_size=(3,), padding=((2, 1),), input_dilation=2), (2, 5, 3)),
    (dict(kernel_size=(2, 2), padding=1, input_dilation=(2, 1), strides=(1, 2)), (2, 4, 5, 3)),
    (dict(kernel_size=(2, 2, 2), padding="SAME"), (2, 4, 3, 3, 2)),  # 3-D
    (dict(kernel_size=(3,)), (9, 3)),  # unbatched
    (dict(kernel_size=(3,), strides=2), (2, 3, 9, 3)),  # two batch dimensions
    (dict(kernel_size=(1, 1), padding="VALID"), (2, 4, 4, 3)),  # 1x1: the dense path
    (dict(kernel_size=(3,), padding="SAME_LOWER", strides=2), (2, 8, 3)),
  ],
  ids=[
    "causal",
    "causal-dilated",
    "input-dilation-1d",
    "input-dilation-2d",
    "3d",
    "unbatched",
    "two-batch-dims",
    "1x1",
    "same-lower",
  ],
)
def test_conv_shapes_and_paddings(kw, shape, fused_calls):
  x = normal(shape, jnp.float32)
  check_layer(nn.Conv(4, **kw), ConvAct(4, activation="elu", **kw), jax.nn.elu, x)
  # Padding modes and batch folding are array code before the fused op, not fallbacks.
  assert fused_calls["conv"] > 0


def test_conv_mask_goes_through_the_fused_op(fused_calls):
  mask = jnp.tril(jnp.ones((3, 3, 4), jnp.float32))
  kw = dict(kernel_size=(3,), padding="VALID", mask=mask)
  x = normal((2, 8, 3), jnp.float32)
  check_layer(nn.Conv(4, **kw), ConvAct(4, activation="relu", **kw), jax.nn.relu, x)
  assert fused_calls["conv"] > 0


def test_partitioned_params_are_flax(fused_calls):
  """nn.with_partitioning metadata: the same boxed tree (names included) as nn.Dense's."""
  kw = dict(
    kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")),
    bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ("model",)),
  )
  x = normal((4, 5), jnp.float32)
  want = nn.Dense(8, **kw).init(KEY, x)
  got = DenseAct(8, activation="relu", **kw).init(KEY, x)
  assert_trees_identical(got, want)
  assert isinstance(got["params"]["kernel"], nn.Partitioned)
  assert nn.get_partition_spec(got) == nn.get_partition_spec(want)
  check_layer(nn.Dense(8, **kw), DenseAct(8, activation="relu", **kw), jax.nn.relu, x)
  assert fused_calls["dense"] > 0


def test_fused_op_is_the_path_taken(fused_calls):
  x = normal((4, 5), jnp.float32)
  DenseAct(3, activation="relu").init(KEY, x)
  ConvAct(3, (3,), activation="relu").init(KEY, x[None])
  assert fused_calls == {"dense": 1, "conv": 1}
  # lax's own ops, named explicitly, are what the fused op computes.
  DenseAct(3, dot_general=lax.dot_general).init(KEY, x)
  ConvAct(3, (3,), conv_general_dilated=lax.conv_general_dilated).init(KEY, x[None])
  assert fused_calls == {"dense": 2, "conv": 2}


# ------------------------------------------------------------------------------- the fallbacks


def doubled_dot_general(lhs, rhs, dimension_numbers, precision=None, **kw):
  return 2 * lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kw)


def doubled_conv(*args, **kw):
  return 2 * lax.conv_general_dilated(*args, **kw)


@pytest.mark.parametrize(
  ("flax_layer", "act_layer", "x"),
  [
    (
      nn.Dense(4, dot_general=doubled_dot_general),
      DenseAct(4, dot_general=doubled_dot_general, activation="tanh"),
      (3, 5),
    ),
    (
      nn.Dense(4, dot_general_cls=lambda: doubled_dot_general),
      DenseAct(4, dot_general_cls=lambda: doubled_dot_general, activation="tanh"),
      (3, 5),
    ),
    (
      nn.Conv(4, (3,), conv_general_dilated=doubled_conv),
      ConvAct(4, (3,), conv_general_dilated=doubled_conv, activation="tanh"),
      (2, 6, 3),
    ),
    (
      nn.Conv(4, (3,), conv_general_dilated_cls=lambda: doubled_conv, padding="CIRCULAR"),
      ConvAct(
        4,
        (3,),
        conv_general_dilated_cls=lambda: doubled_conv,
        padding="CIRCULAR",
        activation="tanh",
      ),
      (3, 6, 3),
    ),
  ],
  ids=["dot_general", "dot_general_cls", "conv_general_dilated", "conv_general_dilated_cls"],
)
def test_custom_linear_op_falls_back(flax_layer, act_layer, x, fused_calls):
  """A custom dot/conv is used (doubling shows it), then the activation; the fused op is not."""
  check_layer(flax_layer, act_layer, jax.nn.tanh, normal(x, jnp.float32))
  assert fused_calls == {"dense": 0, "conv": 0}


@pytest.mark.parametrize("activation", ["identity", lambda z: z * z], ids=["identity", "callable"])
def test_complex_dtype_falls_back(activation, fused_calls):
  x = normal((3, 5), jnp.float32)
  layer = DenseAct(4, dtype=jnp.complex64, activation=activation)
  params = random_like(nn.Dense(4).init(KEY, x))
  y = layer.apply(params, x)
  want = nn.Dense(4, dtype=jnp.complex64).apply(params, x)
  want = want if activation == "identity" else want * want
  assert y.dtype == jnp.complex64
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert fused_calls["dense"] == 0


# ------------------------------------------------------------------------------------- errors


def test_unknown_activation_name():
  with pytest.raises(ValueError, match=r"jaxact.linen.DenseAct: activation 'relux' is not known"):
    DenseAct(3, activation="relux").init(KEY, jnp.ones((2, 2), jnp.float32))


def test_activation_not_callable():
  with pytest.raises(TypeError, match=r"jaxact.linen.ConvAct: `activation` must be .* got int 3"):
    ConvAct(3, (3,), activation=3).init(KEY, jnp.ones((1, 4, 2), jnp.float32))


def test_groups_must_divide_features():
  with pytest.raises(ValueError, match=r"has 3 features, which feature_group_count=2"):
    ConvAct(4, (3,), feature_group_count=2).init(KEY, jnp.ones((1, 4, 3), jnp.float32))


def test_mask_shape():
  with pytest.raises(ValueError, match=r"Mask needs to have the same shape as weights"):
    ConvAct(4, (3,), mask=jnp.ones((2, 3, 4))).init(KEY, jnp.ones((1, 4, 3), jnp.float32))


# ------------------------------------------------------------------------ training on digits


class MLP(nn.Module):
  jaxact_layers: bool

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    if self.jaxact_layers:
      x = DenseAct(64, activation="relu", name="hidden")(x)
      x = DenseAct(64, activation=jaxact.gelu, name="hidden2")(x)
      return DenseAct(10, name="out")(x)
    x = nn.relu(nn.Dense(64, name="hidden")(x))
    x = nn.gelu(nn.Dense(64, name="hidden2")(x))
    return nn.Dense(10, name="out")(x)


class CNN(nn.Module):
  jaxact_layers: bool

  @nn.compact
  def __call__(self, x):
    if self.jaxact_layers:
      x = ConvAct(16, (3, 3), activation="relu", name="c1")(x)
      x = ConvAct(32, (3, 3), strides=2, activation="relu", name="c2")(x)
      return DenseAct(10, name="out")(x.reshape(x.shape[0], -1))
    x = nn.relu(nn.Conv(16, (3, 3), name="c1")(x))
    x = nn.relu(nn.Conv(32, (3, 3), strides=2, name="c2")(x))
    return nn.Dense(10, name="out")(x.reshape(x.shape[0], -1))


def train(model, params, x, y, steps: int):
  tx = optax.adam(1e-2)

  def loss_fn(params):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = tx.init(params), []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return params, np.array(losses)


def accuracy(model, params, x, y) -> float:
  return float(jnp.mean(jnp.argmax(model.apply(params, x), -1) == y))


@pytest.mark.exhaustive
def test_digits_training_mlp():
  """jaxact layers train like Flax's (the same losses, step by step) and reach 93% held out."""
  x_tr, y_tr, x_te, y_te = digits()
  ours, theirs = MLP(jaxact_layers=True), MLP(jaxact_layers=False)
  params = theirs.init(KEY, x_tr[:1])
  assert jax.eval_shape(ours.init, KEY, x_tr[:1]) == jax.eval_shape(lambda: params)
  params_ours, losses_ours = train(ours, params, x_tr, y_tr, steps=30)
  _, losses_theirs = train(theirs, params, x_tr, y_tr, steps=30)
  np.testing.assert_allclose(losses_ours, losses_theirs, rtol=1e-3, atol=1e-5)
  assert losses_ours[-1] < 0.1 * losses_ours[0]
  assert accuracy(ours, params_ours, x_te, y_te) > 0.93


@pytest.mark.exhaustive
def test_digits_training_cnn():
  x_tr, y_tr, x_te, y_te = digits()
  model = CNN(jaxact_layers=True)
  params, losses = train(model, model.init(KEY, x_tr[:1]), x_tr, y_tr, steps=20)
  assert losses[-1] < 0.1 * losses[0]
  assert accuracy(model, params, x_te, y_te) > 0.93


# ------------------------------------------------------------------------------------- memory


def _temp_bytes(model, x) -> int:
  params = model.init(KEY, x)
  loss = lambda p, x: jnp.sum(model.apply(p, x) ** 2)
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


class DeepMLP(nn.Module):
  jaxact_layers: bool
  activation: str

  @nn.compact
  def __call__(self, x):
    for _ in range(4):
      if self.jaxact_layers:
        x = DenseAct(256, activation=self.activation)(x)
      else:
        x = getattr(jax.nn, self.activation)(nn.Dense(256)(x))
    return x


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_training_memory_below_flax(activation):
  x = normal((512, 256), jnp.float32)
  ours = _temp_bytes(DeepMLP(True, activation), x)
  theirs = _temp_bytes(DeepMLP(False, activation), x)
  assert ours < theirs, (ours, theirs)


# ------------------------------------------------------------------------ checkpoint names


class _FlaxBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32)(x))  # Dense_0
    return nn.Dense(8)(h)  # Dense_1


class _JaxactBlock(nn.Module):
  named: bool = True

  @nn.compact
  def __call__(self, x):
    names = ({"name": "Dense_0"}, {"name": "Dense_1"}) if self.named else ({}, {})
    h = DenseAct(32, activation=nn.relu, **names[0])(x)
    return nn.Dense(8, **names[1])(h)


def test_a_flax_block_checkpoint_loads_into_its_jaxact_version():
  x = jax.random.normal(KEY, (4, 16), jnp.float32)
  params = _FlaxBlock().init(KEY, x)
  assert_close(_JaxactBlock().apply(params, x), _FlaxBlock().apply(params, x), "output")
  # Unnamed, the swap renames both layers: the error names the path and the probable old name.
  with pytest.raises(
    ValueError,
    match=r"DenseAct at /DenseAct_0: .* Dense_0 has this layer's kernel shape \(16, 32\).* "
    r"name='Dense_0'",
  ):
    _JaxactBlock(named=False).apply(params, x)
