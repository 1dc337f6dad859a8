"""jaxact.linen.GatedMLP / jaxact.nnx.GatedMLP against the plain Flax gated MLP they replace.

The plain module is three ``nn.Dense`` / ``nnx.Linear`` named as Hugging Face transformers'
``FlaxLlamaMLP`` names them (``gate_proj``, ``up_proj``, ``down_proj``) and computing
``down_proj(act(gate_proj(x)) * up_proj(x))`` with the jax.nn activation. The layers' parameter
trees are the plain module's (structure, shapes, dtypes, values for the same key or ``rngs``,
metadata), a checkpoint of the plain module loads as it is, and from the same random parameters
the outputs and the gradients in the parameters and the input equal the plain module's within the
dtype's rounding, linen and nnx alike (nnx gets the linen parameters copied across).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import jaxact
from jaxact import linen as jlinen
from jaxact import nnx as jnnx
from jaxact._src.gated import api as gated
from layer_cases import (
  assert_close,
  assert_trees_close,
  assert_trees_identical,
  normal,
  random_like,
  vjp_all,
)

KEY = jax.random.key(0)
D, F = 8, 16  # input and hidden features
X_SHAPE = (2, 3, D)  # two batch dimensions: the layers act on the last one
REFERENCE = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


class PlainLinen(nn.Module):
  """The gated MLP written with three ``nn.Dense`` (what the layer replaces)."""

  hidden_features: int
  features: int
  activation: Callable = jax.nn.silu
  use_bias: bool = False
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: Callable = nn.linear.default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x):
    def dense(features, name):
      return nn.Dense(
        features,
        use_bias=self.use_bias,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=self.kernel_init,
        bias_init=self.bias_init,
        name=name,
      )

    gate = dense(self.hidden_features, "gate_proj")(x)
    up = dense(self.hidden_features, "up_proj")(x)
    return dense(self.features, "down_proj")(self.activation(gate) * up)


class FlaxLlamaMLP(nn.Module):
  """transformers' ``FlaxLlamaMLP`` as written there (``setup``, no bias, normal(0.02) kernels)."""

  hidden_size: int
  intermediate_size: int
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    kernel_init = jax.nn.initializers.normal(0.02)
    self.gate_proj = nn.Dense(self.intermediate_size, use_bias=False, dtype=self.dtype,
                              kernel_init=kernel_init)  # fmt: skip
    self.down_proj = nn.Dense(self.hidden_size, use_bias=False, dtype=self.dtype,
                              kernel_init=kernel_init)  # fmt: skip
    self.up_proj = nn.Dense(self.intermediate_size, use_bias=False, dtype=self.dtype,
                            kernel_init=kernel_init)  # fmt: skip

  def __call__(self, hidden_states):
    up_proj_states = self.up_proj(hidden_states)
    gate_states = jax.nn.silu(self.gate_proj(hidden_states))
    return self.down_proj(up_proj_states * gate_states)


class PlainNNX(nnx.Module):
  """The gated MLP written with three ``nnx.Linear``, made in the order gate, up, down (without
  bias unless asked, as Llama's); `down_kwargs` replace the metadata for ``down_proj``."""

  def __init__(self, in_features, hidden_features, out_features=None, *, activation=jax.nn.silu,
               use_bias=False, rngs, down_kwargs=None, **linear_kwargs):  # fmt: skip
    out_features = in_features if out_features is None else out_features
    linear_kwargs["use_bias"] = use_bias
    self.gate_proj = nnx.Linear(in_features, hidden_features, rngs=rngs, **linear_kwargs)
    self.up_proj = nnx.Linear(in_features, hidden_features, rngs=rngs, **linear_kwargs)
    down_kwargs = {k: v for k, v in linear_kwargs.items() if not k.endswith("_metadata")} | (
      down_kwargs or {}
    )
    self.down_proj = nnx.Linear(hidden_features, out_features, rngs=rngs, **down_kwargs)
    self.activation = activation

  def __call__(self, x):
    return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


@pytest.fixture
def gated_mlp_calls(monkeypatch):
  """The calls of jaxact.gated_mlp made by the layers: (activation, precision) of each."""
  calls = []
  op = gated.gated_mlp

  def spy(*args, **kwargs):
    calls.append((kwargs["activation"], kwargs["precision"]))
    return op(*args, **kwargs)

  monkeypatch.setattr(gated, "gated_mlp", spy)
  return calls


# ------------------------------------------------------------------------------ the attributes


def test_linen_attributes():
  fields = {
    f.name: f.default
    for f in dataclasses.fields(jlinen.GatedMLP)
    if f.name not in ("parent", "name")
  }
  dense = {f.name: f.default for f in dataclasses.fields(nn.Dense)}
  assert list(fields) == [
    "hidden_features",
    "features",
    "activation",
    "use_bias",
    "dtype",
    "param_dtype",
    "precision",
    "kernel_init",
    "bias_init",
    "dropout_rate",
    "deterministic",
    "dropout_broadcast_dims",
    "rng_collection",
    "residuals",
  ]
  assert fields["features"] is None and fields["activation"] == "silu"
  assert fields["residuals"] == "projections"
  assert (fields["dropout_rate"], fields["deterministic"], fields["rng_collection"]) == (
    0.0,
    None,
    "dropout",
  )
  assert fields["use_bias"] is False
  for name in ("dtype", "param_dtype", "precision", "kernel_init"):
    assert fields[name] is dense[name], name
  assert_close(fields["bias_init"](KEY, (3,)), dense["bias_init"](KEY, (3,)), "bias_init")


def test_nnx_signature():
  params = inspect.signature(jnnx.GatedMLP.__init__).parameters
  linear = inspect.signature(nnx.Linear.__init__).parameters
  assert list(params)[:4] == ["self", "in_features", "hidden_features", "out_features"]
  assert params["out_features"].default is None
  assert params["activation"].default == "silu" and params["use_bias"].default is False
  for name in ("dtype", "param_dtype", "precision", "kernel_init", "bias_init"):
    assert params[name].default is linear[name].default, name
  assert params["rngs"].default is inspect.Parameter.empty


# ------------------------------------------------------------------------------ the parameters


def key_init(key, shape, dtype=jnp.float32):
  """An initializer that writes out the key it is given (its bytes, repeated): equal parameters
  mean equal keys, so the RNG use is compared without drawing random numbers (threefry is slow
  to compile, and the default initializers are checked above to be Flax's own objects)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  key_bytes = (key.reshape(-1, 1) >> jnp.array([0, 8, 16, 24], key.dtype)) & 0xFF
  return jnp.resize(key_bytes.astype(dtype), shape)  # bytes are exact in bfloat16


INIT_CASES = {
  "no bias": dict(kernel_init=key_init),
  "bias, features=6": dict(use_bias=True, features=6, kernel_init=key_init, bias_init=key_init),
  "bf16 params": dict(param_dtype=jnp.bfloat16, use_bias=True, kernel_init=key_init),
}


def test_init_is_the_plain_modules():
  """linen: the same tree (gate_proj/up_proj/down_proj, each kernel and bias) and values for the
  same key; nnx: the same state (Param types, shapes, dtypes, values) for the same ``rngs``, and
  the linen tree. Every case is initialised in one compiled program."""
  x = normal(X_SHAPE)

  def init_all(key):
    trees = {}
    for name, kw in INIT_CASES.items():
      nnx_kw = dict(kw)
      out = nnx_kw.pop("features", None)
      ours = jnnx.GatedMLP(D, F, out, activation="relu", rngs=nnx.Rngs(key), **nnx_kw)
      plain = PlainNNX(D, F, out, rngs=nnx.Rngs(key), **nnx_kw)
      trees[name] = (
        jlinen.GatedMLP(F, activation="gelu", **kw).init(key, x),
        PlainLinen(F, **dict(kw, features=out or D)).init(key, x),
        nnx.state(ours),
        nnx.state(plain),
      )
    return trees

  for name, (ours, plain, ours_nnx, plain_nnx) in jax.jit(init_all)(KEY).items():
    kw = INIT_CASES[name]
    assert_trees_identical(ours, plain)
    assert_trees_identical(ours_nnx, plain_nnx)
    assert jax.tree.map(jax.typeof, nnx.to_pure_dict(ours_nnx)) == jax.tree.map(
      jax.typeof, ours["params"]
    )
    shapes = jax.tree.map(jnp.shape, ours["params"])
    assert {k: v["kernel"] for k, v in shapes.items()} == {
      "gate_proj": (D, F),
      "up_proj": (D, F),
      "down_proj": (F, kw.get("features", D)),
    }, name
    assert all(("bias" in v) == kw.get("use_bias", False) for v in shapes.values()), name


def test_nnx_sharding_metadata_is_the_plain_modules():
  """Column-parallel gate/up and row-parallel down: the metadata of each nnx.Linear (abstract
  modules: the values are compared above)."""
  col = dict(kernel_metadata={"out_sharding": (None, "model")})
  col |= dict(bias_metadata={"out_sharding": ("model",)})
  row = dict(kernel_metadata={"out_sharding": ("model", None)})
  kw = dict(use_bias=True)
  mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    ours = nnx.eval_shape(
      lambda: jnnx.GatedMLP(
        D, F, **kw, **col, down_kernel_metadata=row["kernel_metadata"], rngs=nnx.Rngs(0)
      )
    )
    plain = nnx.eval_shape(lambda: PlainNNX(D, F, **kw, **col, down_kwargs=row, rngs=nnx.Rngs(0)))
  assert nnx.state(ours) == nnx.state(plain)
  specs = nnx.get_partition_spec(nnx.state(ours))
  assert specs["up_proj"]["kernel"].get_value() == PartitionSpec(None, "model")
  assert specs["up_proj"]["bias"].get_value() == PartitionSpec("model")
  assert specs["down_proj"]["kernel"].get_value() == PartitionSpec("model", None)
  assert ours.down_proj.kernel.sharding.spec == PartitionSpec("model", None)


def test_plain_checkpoints_load():
  """A checkpoint of transformers' FlaxLlamaMLP (linen) or of the plain nnx module loads as it is
  into the GatedMLP, which then computes what the plain module computes."""
  x = normal(X_SHAPE)
  hf = FlaxLlamaMLP(D, F)
  # The checkpoint: the tree transformers' module initialises, random values.
  hf_params = random_like(jax.eval_shape(hf.init, KEY, x))
  checkpoint = flax.serialization.to_bytes(hf_params)
  ours = jlinen.GatedMLP(F)
  # Restored into the abstract tree of the GatedMLP's parameters, as a training script would.
  params = flax.serialization.from_bytes(jax.eval_shape(ours.init, KEY, x), checkpoint)
  assert_trees_identical(params, hf_params)
  assert_close(ours.apply(params, x), hf.apply(params, x), "linen output")

  plain = nnx.eval_shape(lambda: PlainNNX(D, F, rngs=nnx.Rngs(1)))
  nnx.update(plain, random_like(nnx.state(plain)))
  mlp = nnx.eval_shape(lambda: jnnx.GatedMLP(D, F, rngs=nnx.Rngs(0)))
  nnx.update(mlp, nnx.state(plain))
  assert_trees_identical(nnx.state(mlp), nnx.state(plain))
  assert_close(mlp(x), plain(x), "nnx output")


# ------------------------------------------------------- outputs and gradients: the plain module


def random_params(use_bias: bool, features: int, seed: int = 7):
  """Random linen parameters (random, not initialised: the zero bias init would hide the bias)."""
  rng = np.random.default_rng(seed)
  shapes = {"gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, features)}
  params = {}
  for name, shape in shapes.items():
    params[name] = {"kernel": jnp.asarray(0.4 * rng.standard_normal(shape), jnp.float32)}
    if use_bias:
      params[name]["bias"] = jnp.asarray(0.4 * rng.standard_normal(shape[1:]), jnp.float32)
  return {"params": params}


def nnx_apply(make):
  """``apply(params, x)`` of the nnx module `make` builds, its state copied from linen `params`."""
  graphdef, abstract = nnx.split(nnx.eval_shape(make))

  def apply(params, x):
    state = jax.tree.map(lambda v: v, abstract)
    nnx.replace_by_pure_dict(state, params["params"])
    return nnx.merge(graphdef, state)(x)

  return apply


def one_case(activation, reference, *, features=None, x_dtype=jnp.float32, plain_nnx=False, **kw):
  """The applies of the plain linen module, linen GatedMLP, nnx GatedMLP and, with `plain_nnx`,
  the plain nnx module (the nnx ones take the linen parameters, copied into their state), and
  their arguments."""
  out = D if features is None else features
  x = normal(X_SHAPE, x_dtype)
  ours_linen = jlinen.GatedMLP(F, features, activation=activation, **kw)
  plain_linen = PlainLinen(F, out, activation=reference, **kw)
  assert jax.eval_shape(ours_linen.init, KEY, x) == jax.eval_shape(plain_linen.init, KEY, x)
  ours_nnx = nnx_apply(lambda: jnnx.GatedMLP(D, F, features, activation=activation, **kw,
                                             rngs=nnx.Rngs(0)))  # fmt: skip
  applies = [plain_linen.apply, ours_linen.apply, ours_nnx]
  if plain_nnx:
    applies.append(nnx_apply(lambda: PlainNNX(D, F, features, activation=reference, **kw,
                                              rngs=nnx.Rngs(0))))  # fmt: skip
  params = random_params(kw.get("use_bias", False), out)
  params = jax.tree.map(lambda p: p.astype(kw.get("param_dtype", jnp.float32)), params)
  return applies, (params, x)


def check_against_plain(cases: dict[str, dict]) -> None:
  """For each case (``one_case``'s arguments), the output and the gradients in the parameters and
  the input of a random cotangent: linen and nnx GatedMLP (and the plain nnx module if asked)
  against the plain linen module, all in one compiled program."""
  built = {name: one_case(**case) for name, case in cases.items()}

  @jax.jit
  def run(arguments):
    return {name: [vjp_all(f, *arguments[name]) for f in built[name][0]] for name in arguments}

  for name, ((y_want, grads_want), *results) in run({n: b[1] for n, b in built.items()}).items():
    for what, (y, grads) in zip(["linen", "nnx", "plain nnx"], results, strict=False):
      # Gradients carry the rounding of the computation's dtype, whatever the parameters' dtype.
      assert_trees_close(grads, grads_want, f"{name}, {what}: grad", tol_dtype=y_want.dtype)
      assert_close(y, y_want, f"{name}, {what}: output")


def equality_cases() -> dict[str, dict]:
  """silu, gelu and relu, each with use_bias off and on (with 6 output features) and dtype float32
  and bfloat16; then dtype None (flax's promotion of the input and the parameters, the plain nnx
  module compared too) and the other ways to give the activation."""
  cases = {}
  for name, reference in REFERENCE.items():
    for use_bias in (False, True):
      for dtype in (jnp.float32, jnp.bfloat16):
        features = 6 if use_bias else None
        cases[f"{name}, use_bias={use_bias}, dtype={jnp.dtype(dtype).name}"] = dict(
          activation=name, reference=reference, use_bias=use_bias, dtype=dtype, features=features
        )
  silu = dict(activation="silu", reference=jax.nn.silu, plain_nnx=True)
  cases["bf16 x, f32 params"] = dict(silu, x_dtype=jnp.bfloat16)
  cases["f32 x, bf16 params"] = dict(silu, param_dtype=jnp.bfloat16, use_bias=True)
  cases["partial(jaxact.gelu)"] = dict(
    activation=functools.partial(jaxact.gelu, approximate=False),
    reference=functools.partial(jax.nn.gelu, approximate=False),
  )
  tanh_x = lambda z: z * jnp.tanh(z)  # a callable jaxact differentiates by autodiff
  cases["callable"] = dict(activation=tanh_x, reference=tanh_x, use_bias=True)
  return cases


def test_equals_the_plain_module():
  """Every case in one test and one compiled program: compiling is what these comparisons cost
  (about 0.3 s a case, a third less than one program each); the failure names the case."""
  check_against_plain(equality_cases())


# ------------------------------------------------------------------------------ the path taken


def test_one_gated_mlp_call(gated_mlp_calls):
  """One call of the op a layer call, with the layer's activation and precision."""
  x, params = normal(X_SHAPE), random_params(False, D)
  highest = jax.lax.Precision.HIGHEST
  jlinen.GatedMLP(F, activation="gelu", precision=highest).apply(params, x)
  nnx_apply(lambda: jnnx.GatedMLP(D, F, activation="relu", rngs=nnx.Rngs(0)))(params, x)
  assert gated_mlp_calls == [("gelu", highest), ("relu", None)]


def test_complex_dtype_runs_flaxs_computation(gated_mlp_calls):
  """jaxact.gated_mlp takes real floating point only: complex runs the three Dense computations."""
  x = normal(X_SHAPE)
  square = lambda z: z * z
  params = random_params(True, D)
  y = jlinen.GatedMLP(F, activation=square, use_bias=True, dtype=jnp.complex64).apply(params, x)
  want = PlainLinen(F, D, activation=square, use_bias=True, dtype=jnp.complex64).apply(params, x)
  assert y.dtype == jnp.complex64
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert gated_mlp_calls == []


# ------------------------------------------------------------------------------------- errors

BAD_ATTRIBUTES = [
  (dict(hidden_features=0), ValueError, "`hidden_features` must be a positive int; got 0"),
  (dict(hidden_features=16.0), TypeError, "`hidden_features` must be a positive int; got float"),
  (dict(features=-2), ValueError, "`features` must be a positive int or None; got -2"),
  (dict(features="8"), TypeError, "`features` must be a positive int or None; got str"),
  (dict(activation="relux"), ValueError, "activation 'relux' is not known; choose one of: celu"),
  (dict(activation=3), TypeError, "`activation` must be an activation name"),
]


@pytest.mark.parametrize(("kw", "error", "match"), BAD_ATTRIBUTES)
def test_linen_bad_attributes_are_named(kw, error, match):
  kw = {"hidden_features": F} | kw
  with pytest.raises(error, match=f"jaxact.linen.GatedMLP: {match}"):
    jlinen.GatedMLP(**kw).init(KEY, normal(X_SHAPE))


@pytest.mark.parametrize(("kw", "error", "match"), BAD_ATTRIBUTES)
def test_nnx_bad_arguments_are_named(kw, error, match):
  kw = {"hidden_features": F} | kw
  if "features" in kw:
    kw["out_features"] = kw.pop("features")
    match = match.replace("`features`", "`out_features`")
  with pytest.raises(error, match=f"jaxact.nnx.GatedMLP: {match}"):
    jnnx.GatedMLP(D, rngs=nnx.Rngs(0), **kw)


def test_nnx_bad_in_features_is_named():
  with pytest.raises(
    ValueError, match=r"jaxact.nnx.GatedMLP: `in_features` must be a positive int"
  ):
    jnnx.GatedMLP(0, F, rngs=nnx.Rngs(0))


def test_input_that_does_not_fit_the_checkpoint_is_named():
  """Parameters for 8 input features, an input with 5: the op names x and the kernel (linen's
  GatedMLP raises Flax's ScopeParamShapeError first, as nn.Dense does)."""
  with pytest.raises(ValueError, match=r"`x` has 5 features but `w_gate` expects 8"):
    nnx_apply(lambda: jnnx.GatedMLP(D, F, rngs=nnx.Rngs(0)))(
      random_params(False, D), normal((2, 5))
    )


# ------------------------------------------------------------------------ the hidden's dropout

RATE = 0.25


class PlainLinenDropout(nn.Module):
  """The three ``nn.Dense`` with ``nn.Dropout`` between the gated product and ``down_proj``."""

  @nn.compact
  def __call__(self, x, train: bool, rng=None):
    h = jax.nn.silu(nn.Dense(F, use_bias=False, name="gate_proj")(x))
    h = h * nn.Dense(F, use_bias=False, name="up_proj")(x)
    h = nn.Dropout(RATE)(h, deterministic=not train, rng=rng)
    return nn.Dense(D, use_bias=False, name="down_proj")(h)


class LinenDropout(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool, rng=None):
    return jlinen.GatedMLP(F, dropout_rate=RATE, name="mlp")(x, deterministic=not train, rng=rng)


def test_linen_dropout_is_nn_dropout_of_the_hidden():
  """With the same key, the output and gradients of the three Dense and nn.Dropout; deterministic
  is the plain MLP; the key from the 'dropout' stream when none is passed."""
  x = normal((4, 32, D))
  params = PlainLinenDropout().init(KEY, x, False)
  ours_params = {"params": {"mlp": params["params"]}}
  key = jax.random.key(3)

  def loss(model, p):
    return jnp.sum(model.apply(p, x, True, key) ** 2)

  assert_close(
    LinenDropout().apply(ours_params, x, True, key),
    PlainLinenDropout().apply(params, x, True, key),
    "y",
  )
  got = jax.grad(functools.partial(loss, LinenDropout()))(ours_params)["params"]["mlp"]
  assert_trees_close(
    got, jax.grad(functools.partial(loss, PlainLinenDropout()))(params)["params"], "grads"
  )
  plain = PlainLinen(F, D).apply(params, x)
  assert_close(LinenDropout().apply(ours_params, x, False), plain, "deterministic")
  drawn = LinenDropout().apply(ours_params, x, True, rngs={"dropout": jax.random.key(4)})
  assert not np.allclose(drawn, plain)
  with pytest.raises(ValueError, match="deterministic"):  # as nn.Dropout: say which
    jlinen.GatedMLP(F, dropout_rate=RATE).init(KEY, x)


class PlainNNXDropout(nnx.Module):
  """Three ``nnx.Linear`` then ``nnx.Dropout``, made in that order from one ``rngs``."""

  def __init__(self, rngs):
    self.gate_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(F, D, use_bias=False, rngs=rngs)
    self.dropout = nnx.Dropout(RATE, rngs=rngs)

  def __call__(self, x, *, rngs=None):
    h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(self.dropout(h, rngs=rngs))


def test_nnx_dropout_is_nnx_dropout_of_the_hidden():
  """The same rngs give the same parameters and masks, call after call (the streams advance
  alike), as do rngs passed to the call (what a block passes on: ``self.mlp(x, rngs=rngs)``);
  eval() turns the dropout off; the gradients are the plain module's."""
  x = normal((4, 32, D))
  ours, theirs = (
    jnnx.GatedMLP(D, F, dropout_rate=RATE, rngs=nnx.Rngs(0)),
    PlainNNXDropout(nnx.Rngs(0)),
  )
  for name in ("gate_proj", "up_proj", "down_proj"):
    np.testing.assert_array_equal(
      getattr(ours, name).kernel[...], getattr(theirs, name).kernel[...]
    )
  for _ in range(2):
    assert_close(ours(x), theirs(x), "y")
  assert_close(ours(x, rngs=nnx.Rngs(dropout=5)), theirs(x, rngs=nnx.Rngs(dropout=5)), "call rngs")
  g1 = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(ours)
  g2 = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(theirs)
  for name in ("gate_proj", "up_proj", "down_proj"):
    assert_close(getattr(g1, name).kernel[...], getattr(g2, name).kernel[...], name)
  ours.eval()
  theirs.eval()
  assert_close(ours(x), theirs(x), "eval")
  ours.train()
  assert not np.allclose(ours(x), ours(x))  # a new mask each call
  # without dropout the call's rngs are taken and ignored, and the stream is untouched
  plain = jnnx.GatedMLP(D, F, rngs=nnx.Rngs(0))
  assert_close(plain(x, rngs=nnx.Rngs(1)), plain(x), "rate 0")
