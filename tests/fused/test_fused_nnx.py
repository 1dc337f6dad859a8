"""jaxact.nnx.LinearAct / ConvAct against flax.nnx.Linear / Conv and the jax.nn activation.

As in test_linen: the same ``rngs`` give the same parameters (state tree, Variable types and
metadata, shapes, dtypes, values), and from the same random parameters the outputs and the
gradients in the parameters and the input equal Flax's, over a product of options; the fused op is
the path taken except for the fallbacks; an optax loop on the digits data trains to the same
losses as the Flax model.
"""

from __future__ import annotations

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, PartitionSpec

import jaxact
from jaxact.nnx import ConvAct, LinearAct
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


@pytest.fixture
def fused_calls(monkeypatch):
  return count_fused_calls(monkeypatch)


def abstract(make):
  """The module `make` builds, its parameters abstract (nothing is initialised or compiled)."""
  return nnx.split(nnx.eval_shape(make))


def check_layer(make_flax, make_act, reference_act, x, *, grads=True, tol_dtype=None) -> None:
  """The layer `make_act` builds against `reference_act` of `make_flax`'s, same random params.

  Tolerances are those of `tol_dtype`, by default the output's: gradients carry the rounding of
  the computation's dtype, whatever the dtype of the parameters they are cast back to.
  """
  flax_def, flax_state = abstract(make_flax)
  act_def, act_state = abstract(make_act)
  assert jax.tree.structure(act_state) == jax.tree.structure(flax_state)
  assert jax.tree.map(jax.typeof, act_state) == jax.tree.map(jax.typeof, flax_state)
  state = random_like(flax_state)

  @jax.jit
  def both(state, x):
    flax_fn = lambda s, x: reference_act(nnx.merge(flax_def, s)(x))
    act_fn = lambda s, x: nnx.merge(act_def, s)(x)
    if grads:
      return vjp_all(act_fn, state, x), vjp_all(flax_fn, state, x)
    return act_fn(state, x), flax_fn(state, x)

  got, want = both(state, x)
  if grads:
    (y, grads_got), (y_want, grads_want) = got, want
    assert_trees_close(grads_got, grads_want, "grad", tol_dtype=tol_dtype or y_want.dtype)
  else:
    y, y_want = got, want
  assert_close(y, y_want, "output", tol_dtype)


# ------------------------------------------------------------------ the arguments and attributes


@pytest.mark.parametrize(("ours", "theirs"), [(LinearAct, nnx.Linear), (ConvAct, nnx.Conv)])
def test_signature_is_flax_plus_activation(ours, theirs):
  assert issubclass(ours, theirs)  # Flax's attributes and parameters made by Flax's __init__
  params = list(inspect.signature(ours.__init__).parameters.values())
  flax_params = list(inspect.signature(theirs.__init__).parameters.values())
  describe = lambda p: (p.name, p.kind, p.default)
  # LinearAct adds nnx.Dropout's arguments after its own (dropout inside the op).
  ours_only = [("activation", "identity"), ("residual_bits", None)]
  if ours is LinearAct:
    ours_only += [
      ("dropout_rate", 0.0),
      ("dropout_broadcast_dims", ()),
      ("deterministic", False),
      ("rng_collection", "dropout"),
    ]
  n = len(flax_params)
  assert [describe(p) for p in params[:n]] == [describe(p) for p in flax_params]
  assert [(p.name, p.default) for p in params[n:]] == ours_only
  assert {p.kind for p in params[n:]} == {inspect.Parameter.KEYWORD_ONLY}


def test_attributes_are_flax_plus_activation():
  kw = dict(rngs=nnx.Rngs(0))
  ours = LinearAct(3, 4, activation="relu", **kw)
  dropout = ["dropout_rate", "dropout_broadcast_dims", "deterministic", "rng_collection", "rngs"]
  assert list(vars(ours)) == [
    *vars(nnx.Linear(3, 4, **kw)),
    "activation",
    "residual_bits",
    *dropout,
  ]
  ours = ConvAct(3, 4, (3,), activation="relu", **kw)
  assert list(vars(ours)) == [*vars(nnx.Conv(3, 4, (3,), **kw)), "activation", "residual_bits"]


# --------------------------------------------------------------------- parameters from rngs


@pytest.mark.parametrize(
  ("make_flax", "make_act"),
  [
    (
      lambda: nnx.Linear(5, 6, rngs=nnx.Rngs(0)),
      lambda: LinearAct(5, 6, activation="gelu", rngs=nnx.Rngs(0)),
    ),
    (
      lambda: nnx.Linear(5, 6, use_bias=False, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)),
      lambda: LinearAct(
        5, 6, use_bias=False, param_dtype=jnp.bfloat16, activation="relu", rngs=nnx.Rngs(1)
      ),
    ),
    (
      lambda: nnx.Linear(5, 6, bias_init=nnx.initializers.ones, rngs=nnx.Rngs(params=2)),
      lambda: LinearAct(5, 6, bias_init=nnx.initializers.ones, rngs=nnx.Rngs(params=2)),
    ),
    (
      lambda: nnx.Conv(4, 6, (3, 2), feature_group_count=2, rngs=nnx.Rngs(0)),
      lambda: ConvAct(4, 6, (3, 2), feature_group_count=2, activation="elu", rngs=nnx.Rngs(0)),
    ),
  ],
  ids=["linear", "linear-no-bias-bf16", "linear-inits", "conv-groups"],
)
def test_params_are_flax(make_flax, make_act):
  assert_trees_identical(nnx.state(make_act()), nnx.state(make_flax()))


@pytest.mark.parametrize("how", ["kernel_metadata", "with_partitioning"])
def test_sharding_metadata_is_flax(how):
  """`out_sharding` metadata: the same Params (metadata included), partition specs, shardings."""
  if how == "kernel_metadata":
    kw = dict(kernel_metadata={"out_sharding": (None, "model")})
    kw |= dict(bias_metadata={"out_sharding": ("model",)})
  else:
    kw = dict(
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
    )
  # Flax shards a Variable with `out_sharding` when it is created: it needs a mesh.
  mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    theirs = nnx.Linear(5, 6, rngs=nnx.Rngs(0), **kw)
    ours = LinearAct(5, 6, activation="relu", rngs=nnx.Rngs(0), **kw)
  assert_trees_identical(nnx.state(ours), nnx.state(theirs))
  specs = nnx.get_partition_spec(nnx.state(ours))
  assert specs == nnx.get_partition_spec(nnx.state(theirs))
  assert specs["kernel"].get_value() == PartitionSpec(None, "model")
  assert ours.kernel.sharding.spec == PartitionSpec(None, "model")


# ----------------------------------------------------------------- equivalence with Flax: Linear

LINEAR_OPTIONS = list(
  itertools.product(
    [True, False],  # use_bias
    [None, jnp.float32, jnp.bfloat16, jnp.float64],  # dtype
    [jnp.float32, jnp.bfloat16],  # param_dtype
  )
)


@pytest.mark.sample(2)
@pytest.mark.parametrize(("use_bias", "dtype", "param_dtype"), LINEAR_OPTIONS, ids=str)
def test_linear_options(use_bias, dtype, param_dtype):
  # The activation and the precision cycle, so that each meets several option combinations.
  i = LINEAR_OPTIONS.index((use_bias, dtype, param_dtype))
  activation, reference = ACTIVATIONS[ACTIVATION_IDS[i % len(ACTIVATION_IDS)]]
  kw = dict(
    use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=(None, HIGHEST)[i % 2]
  )
  check_layer(
    lambda: nnx.Linear(5, 6, rngs=nnx.Rngs(0), **kw),
    lambda: LinearAct(5, 6, activation=activation, rngs=nnx.Rngs(0), **kw),
    reference,
    normal((4, 3, 5), jnp.float32),
  )


@pytest.mark.sample(3)
@pytest.mark.parametrize("act", ACTIVATION_IDS)
def test_linear_activations(act):
  # float32 meets every activation in test_linear_options.
  activation, reference = ACTIVATIONS[act]
  dtype = jnp.bfloat16
  kw = dict(dtype=dtype, param_dtype=dtype)
  check_layer(
    lambda: nnx.Linear(5, 7, rngs=nnx.Rngs(0), **kw),
    lambda: LinearAct(5, 7, activation=activation, rngs=nnx.Rngs(0), **kw),
    reference,
    normal((8, 5), dtype),
  )


@pytest.mark.parametrize(
  ("dtype", "preferred_element_type", "use_bias"),
  [
    (jnp.bfloat16, jnp.float32, True),
    (jnp.float32, jnp.bfloat16, True),
    (jnp.float32, jnp.bfloat16, False),
    (None, jnp.float64, True),
  ],
  ids=str,
)
def test_linear_preferred_element_type(dtype, preferred_element_type, use_bias, fused_calls):
  """The output dtype is Flax's: the dot's ``preferred_element_type`` promoted with the bias.

  Flax rounds the dot to ``preferred_element_type`` before adding the bias; jaxact accumulates,
  adds and activates in the wider of the two and rounds once: bfloat16 tolerances.
  """
  kw = dict(dtype=dtype, preferred_element_type=preferred_element_type, use_bias=use_bias)
  check_layer(
    lambda: nnx.Linear(5, 6, rngs=nnx.Rngs(0), **kw),
    lambda: LinearAct(5, 6, activation="softplus", rngs=nnx.Rngs(0), **kw),
    jax.nn.softplus,
    normal((4, 5), jnp.float32),
    tol_dtype=jnp.bfloat16 if jnp.bfloat16 in (dtype, preferred_element_type) else None,
  )
  assert fused_calls["dense"] > 0


# ------------------------------------------------------------------- equivalence with Flax: Conv

PADDINGS = ["SAME", "VALID", ((1, 2), (0, 1)), "CIRCULAR", "REFLECT"]
# Every pair of values of (strides, kernel_dilation, feature_group_count) once (an L4 array), with
# every padding, outputs and gradients.
PAIRWISE = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)]
CONV_OPTIONS = [(p, *row) for p, row in itertools.product(PADDINGS, PAIRWISE)]


@pytest.mark.sample(2, "REFLECT-1-1-1")
@pytest.mark.parametrize(("padding", "strides", "kernel_dilation", "groups"), CONV_OPTIONS, ids=str)
def test_conv_options(padding, strides, kernel_dilation, groups):
  i = CONV_OPTIONS.index((padding, strides, kernel_dilation, groups))
  activation, reference = ACTIVATIONS[ACTIVATION_IDS[i % len(ACTIVATION_IDS)]]
  kw = dict(
    padding=padding,
    kernel_dilation=kernel_dilation,
    feature_group_count=groups,
    use_bias=i % 3 != 0,
  )
  check_layer(
    lambda: nnx.Conv(4, 6, (3, 2), strides, rngs=nnx.Rngs(0), **kw),
    lambda: ConvAct(4, 6, (3, 2), strides, activation=activation, rngs=nnx.Rngs(0), **kw),
    reference,
    normal((2, 7, 6, 4), jnp.float32),
  )


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  ("kw", "shape"),
  [
    (dict(kernel_size=3, padding="CAUSAL"), (2, 9, 3)),  # 1-D, an int kernel size
    (dict(kernel_size=(3,), padding=((2, 1),), input_dilation=2), (2, 5, 3)),
    (dict(kernel_size=(3,)), (9, 3)),  # unbatched
    (dict(kernel_size=(3,), strides=2), (2, 3, 9, 3)),  # two batch dimensions
    (dict(kernel_size=(3,), mask=jnp.tril(jnp.ones((3, 3, 4), jnp.float32))), (2, 8, 3)),
    (
      dict(kernel_size=(3, 3), dtype=jnp.bfloat16, preferred_element_type=jnp.float32),
      (2, 5, 5, 3),
    ),
    (dict(kernel_size=(3, 3), param_dtype=jnp.bfloat16, precision=HIGHEST), (2, 5, 5, 3)),
  ],
  ids=[
    "causal",
    "input-dilation",
    "unbatched",
    "two-batch-dims",
    "mask",
    "bf16-preferred-f32",
    "bf16-params",
  ],
)
def test_conv_shapes_paddings_dtypes(kw, shape, fused_calls):
  check_layer(
    lambda: nnx.Conv(3, 4, rngs=nnx.Rngs(0), **kw),
    lambda: ConvAct(3, 4, activation="gelu", rngs=nnx.Rngs(0), **kw),
    jax.nn.gelu,
    normal(shape, jnp.float32),
    tol_dtype=kw.get("dtype"),
  )
  # Padding modes, batch folding and the mask are array code around the fused op, not fallbacks.
  assert fused_calls["conv"] > 0


def test_fused_op_is_the_path_taken(fused_calls):
  LinearAct(5, 3, activation="relu", rngs=nnx.Rngs(0))(normal((4, 5)))
  ConvAct(5, 3, (3,), activation="relu", rngs=nnx.Rngs(0))(normal((1, 4, 5)))
  assert fused_calls == {"dense": 1, "conv": 1}


# ------------------------------------------------------------------------------- the fallbacks


def doubled_dot_general(lhs, rhs, dimension_numbers, precision=None, **kw):
  return 2 * lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kw)


def doubled_conv(*args, **kw):
  return 2 * lax.conv_general_dilated(*args, **kw)


@pytest.mark.parametrize("kind", ["dot_general", "conv_general_dilated"])
def test_custom_linear_op_falls_back(kind, fused_calls):
  """A custom dot/conv is used (doubling shows it), then the activation; the fused op is not."""
  if kind == "dot_general":
    kw = dict(dot_general=doubled_dot_general)
    make_flax = lambda: nnx.Linear(5, 4, rngs=nnx.Rngs(0), **kw)
    make_act = lambda: LinearAct(5, 4, activation="tanh", rngs=nnx.Rngs(0), **kw)
    x = normal((3, 5), jnp.float32)
  else:
    kw = dict(conv_general_dilated=doubled_conv, padding="REFLECT")
    make_flax = lambda: nnx.Conv(3, 4, (3,), rngs=nnx.Rngs(0), **kw)
    make_act = lambda: ConvAct(3, 4, (3,), activation="tanh", rngs=nnx.Rngs(0), **kw)
    x = normal((2, 6, 3), jnp.float32)
  check_layer(make_flax, make_act, jax.nn.tanh, x)
  assert fused_calls == {"dense": 0, "conv": 0}


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_out_sharding_runs_the_fused_op(layer, fused_calls):
  """Under explicit sharding `out_sharding` goes to the fused op (jnp.dot's meaning there), which
  gives Flax's dot/conv and the activation."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
  if layer == "linear":
    theirs = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
    ours = LinearAct(5, 4, activation="relu", rngs=nnx.Rngs(0))
    x, spec = normal((6, 5), jnp.float32), PartitionSpec("data", None)
  else:
    theirs = nnx.Conv(3, 4, (3,), rngs=nnx.Rngs(0))
    ours = ConvAct(3, 4, (3,), activation="relu", rngs=nnx.Rngs(0))
    x, spec = normal((2, 6, 3), jnp.float32), PartitionSpec("data", None, None)
  with jax.set_mesh(mesh):
    x = jax.device_put(x, jax.NamedSharding(mesh, spec))
    y = ours(x, out_sharding=spec)
    want = jax.nn.relu(theirs(x, out_sharding=spec))
  assert_close(y, want)
  assert y.sharding.spec == spec
  assert fused_calls == ({"dense": 1, "conv": 0} if layer == "linear" else {"dense": 0, "conv": 1})


def test_complex_dtype_falls_back(fused_calls):
  x = normal((3, 5), jnp.float32)
  y = LinearAct(5, 4, dtype=jnp.complex64, activation=lambda z: z * z, rngs=nnx.Rngs(0))(x)
  want = nnx.Linear(5, 4, dtype=jnp.complex64, rngs=nnx.Rngs(0))(x)
  assert y.dtype == jnp.complex64
  np.testing.assert_allclose(np.asarray(y), np.asarray(want * want), rtol=1e-5, atol=1e-5)
  assert fused_calls["dense"] == 0


# ------------------------------------------------------------------------------------- errors


def test_unknown_activation_name():
  with pytest.raises(ValueError, match=r"jaxact.nnx.LinearAct: activation 'relux' is not known"):
    LinearAct(2, 3, activation="relux", rngs=nnx.Rngs(0))


def test_activation_not_callable():
  with pytest.raises(TypeError, match=r"jaxact.nnx.ConvAct: `activation` must be .* got int 3"):
    ConvAct(2, 3, (3,), activation=3, rngs=nnx.Rngs(0))


def test_groups_must_divide_features():
  with pytest.raises(ValueError, match=r"has 3 features, which feature_group_count=2"):
    ConvAct(3, 4, (3,), feature_group_count=2, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------ training on digits


class MLP(nnx.Module):
  def __init__(self, jaxact_layers: bool, rngs: nnx.Rngs):
    self.jaxact_layers = jaxact_layers
    if jaxact_layers:
      self.hidden = LinearAct(64, 64, activation="relu", rngs=rngs)
      self.hidden2 = LinearAct(64, 64, activation=jaxact.gelu, rngs=rngs)
      self.out = LinearAct(64, 10, rngs=rngs)
    else:
      self.hidden = nnx.Linear(64, 64, rngs=rngs)
      self.hidden2 = nnx.Linear(64, 64, rngs=rngs)
      self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    if self.jaxact_layers:
      return self.out(self.hidden2(self.hidden(x)))
    return self.out(nnx.gelu(self.hidden2(nnx.relu(self.hidden(x)))))


def train(model, x, y, steps: int):
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return np.array([float(step(model, optimizer)) for _ in range(steps)])


@pytest.mark.exhaustive  # by default the swap's nnx tests train LinearAct against nnx.Linear
def test_digits_training():
  """LinearAct trains like nnx.Linear (the same losses, step by step), 93% held out."""
  x_tr, y_tr, x_te, y_te = digits()
  ours, theirs = MLP(True, nnx.Rngs(0)), MLP(False, nnx.Rngs(0))
  assert_trees_identical(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
  losses_ours = train(ours, x_tr, y_tr, steps=30)
  losses_theirs = train(theirs, x_tr, y_tr, steps=30)
  np.testing.assert_allclose(losses_ours, losses_theirs, rtol=1e-3, atol=1e-5)
  assert losses_ours[-1] < 0.1 * losses_ours[0]
  accuracy = float(jnp.mean(jnp.argmax(ours(x_te), -1) == y_te))
  assert accuracy > 0.93, accuracy


# ------------------------------------------------------------------------------------- memory


class DeepMLP(nnx.Module):
  def __init__(self, jaxact_layers: bool, activation: str, rngs: nnx.Rngs):
    self.activation = activation
    if jaxact_layers:
      self.layers = nnx.List(
        [LinearAct(256, 256, activation=activation, rngs=rngs) for _ in range(4)]
      )
    else:
      self.layers = nnx.List([nnx.Linear(256, 256, rngs=rngs) for _ in range(4)])
    self.jaxact_layers = jaxact_layers

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x) if self.jaxact_layers else getattr(jax.nn, self.activation)(layer(x))
    return x


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_training_memory_below_flax(activation):
  x = normal((512, 256), jnp.float32)
  temp = {}
  for jaxact_layers in (True, False):
    graphdef, state = abstract(lambda j=jaxact_layers: DeepMLP(j, activation, nnx.Rngs(0)))
    loss = lambda state, x, g=graphdef: jnp.sum(nnx.merge(g, state)(x) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(state, x).compile()
    temp[jaxact_layers] = compiled.memory_analysis().temp_size_in_bytes
  assert temp[True] < temp[False], temp
