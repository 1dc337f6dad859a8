"""Sharded training of jaxact Flax layers on 8 virtual CPU devices: run as a script.

``python tests/sharding_cases.py [case ...]`` prints one JSON object per case
(tests/core/test_sharding.py runs it in a subprocess and asserts on them). It needs 8 devices, which
XLA:CPU gives only if ``--xla_force_host_platform_device_count=8`` is in ``XLA_FLAGS`` before JAX
initialises its backend, so, run as a script, it sets that flag itself before importing JAX.

Every case builds a block of jaxact layers, shards it with JAX's own tools (``jax.jit`` with
``NamedSharding`` on a ``jax.sharding.Mesh``; Flax's partitioning metadata decides the parameter
shardings) and reports, against the same program on one device:

* ``loss_err`` / ``grad_err``: the largest relative difference of the loss and of every gradient
  leaf at the initial parameters (relative to the leaf's largest magnitude);
* ``losses`` / ``losses_1dev``: the losses of a few optax (adam) steps, sharded and on one device;
* ``param_specs``: the partition spec each parameter ends up with;
* ``fwd_collectives``: the collectives in the compiled forward of the first (column-parallel)
  layer alone, and ``step_collectives`` those of the compiled training step.

The cases of ``explicit_sharding_cases.py`` (the ops sharded as Flax's Gemma example shards them)
run here too, in the same process.
"""

from __future__ import annotations

import json
import os
import re
import sys

# Only when run: pytest's --doctest-modules imports this file too, and must not get 8 devices.
if __name__ == "__main__" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eight_devices
import explicit_sharding_cases
import jaxact.linen
import jaxact.nnx

BATCH, IN, HIDDEN, OUT = 32, 16, 64, 16
STEPS = 3
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(")


def collectives(compiled) -> list[str]:
  return sorted(COLLECTIVE.findall(compiled.as_text()))


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tree_err(a, b) -> float:
  # Leaf by leaf: the reference's nnx Params lack the sharding metadata, the values are the same.
  return max(rel_err(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((BATCH, IN)).astype(np.float32)
  y = rng.standard_normal((BATCH, OUT)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


def one_device(tree):
  return jax.device_put(tree, jax.devices()[0])


def train(loss_fn, params, x, y, **jit_kw):
  """Gradients at `params`, then the losses of STEPS adam steps; (loss, grads, losses, step)."""
  tx = optax.adam(1e-2)

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  step = jax.jit(step, **jit_kw)
  opt_state = tx.init(params)
  losses, first = [], None
  for _ in range(STEPS):
    params, opt_state, loss, grads = step(params, opt_state, x, y)
    losses.append(float(loss))
    first = first or (loss, grads)
  return first[0], first[1], losses, step.lower(params, opt_state, x, y).compile()


def report(name, sharded, single, param_specs, fwd, **extra) -> None:
  loss, grads, losses, compiled = sharded
  loss1, grads1, losses1, _ = single
  result = dict(
    case=name,
    devices=jax.device_count(),
    loss_err=rel_err(loss, loss1),
    grad_err=tree_err(grads, grads1),
    losses=losses,
    losses_1dev=losses1,
    param_specs=param_specs,
    fwd_collectives=fwd,
    step_collectives=collectives(compiled),
    **extra,
  )
  print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------- linen


class LinenBlock(nn.Module):
  """Column-parallel DenseAct (kernel split over its outputs), then row-parallel DenseAct."""

  tensor_parallel: bool

  @nn.compact
  def __call__(self, x):
    def part(init, names):
      return nn.with_partitioning(init, names) if self.tensor_parallel else init

    lecun, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros_init()
    x = jaxact.linen.DenseAct(
      HIDDEN,
      activation="gelu",
      kernel_init=part(lecun, (None, "model")),
      bias_init=part(zeros, ("model",)),
      name="column",
    )(x)
    return jaxact.linen.DenseAct(
      OUT,
      activation="tanh",
      kernel_init=part(lecun, ("model", None)),
      bias_init=part(zeros, (None,)),
      name="row",
    )(x)


def linen_case(name: str, mesh, tensor_parallel: bool) -> None:
  model = LinenBlock(tensor_parallel)
  x, y = data()
  batch = NamedSharding(mesh, P("data"))
  # The partitioning metadata decides the parameter shardings (replicated without it).
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  specs = nn.get_partition_spec(abstract)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
  params = nn.meta.unbox(params)
  param_specs = {
    jax.tree_util.keystr(k): str(v.sharding.spec)
    for k, v in jax.tree_util.tree_leaves_with_path(params)
  }

  def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)

  xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
  sharded = train(loss_fn, params, xs, ys)
  single = train(loss_fn, one_device(params), one_device(x), one_device(y))

  column = jaxact.linen.DenseAct(HIDDEN, activation="gelu")
  fwd = jax.jit(column.apply).lower({"params": params["params"]["column"]}, xs).compile()
  report(name, sharded, single, param_specs, collectives(fwd))


# --------------------------------------------------------------------------------------- nnx


class NnxBlock(nnx.Module):
  """Column-parallel LinearAct, then row-parallel LinearAct (out_sharding metadata)."""

  def __init__(self, tensor_parallel: bool, rngs: nnx.Rngs, row_out_sharding=None):
    self.row_out_sharding = row_out_sharding

    def meta(*names):
      return {"out_sharding": names} if tensor_parallel else {}

    self.column = jaxact.nnx.LinearAct(
      IN,
      HIDDEN,
      activation="relu",
      kernel_metadata=meta(None, "model"),
      bias_metadata=meta("model"),
      rngs=rngs,
    )
    self.row = jaxact.nnx.LinearAct(
      HIDDEN,
      OUT,
      activation="identity",
      kernel_metadata=meta("model", None),
      bias_metadata=meta(None),
      rngs=rngs,
    )

  def __call__(self, x):
    # Under explicit sharding the row-parallel matmul (contracting the sharded dimension) needs
    # its output sharding; with one, LinearAct runs Flax's dot_general(out_sharding=), then the
    # activation.
    return self.row(self.column(x), out_sharding=self.row_out_sharding)


def nnx_case(name: str, mesh, tensor_parallel: bool, row_out_sharding=None) -> None:
  x, y = data()

  def loss_fn(graphdef):
    return lambda state, x, y: jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

  # The reference first, outside any mesh context (JAX caches constants made inside one), from the
  # same Rngs: the same parameter values, without sharding metadata.
  graphdef1, state1 = nnx.split(NnxBlock(False, nnx.Rngs(0)))
  single = train(loss_fn(graphdef1), one_device(state1), one_device(x), one_device(y))

  with jax.set_mesh(mesh):
    # Flax shards each Param with `out_sharding` metadata as it creates it (eager sharding).
    graphdef, state = nnx.split(NnxBlock(tensor_parallel, nnx.Rngs(0), row_out_sharding))
    if not tensor_parallel:
      state = jax.device_put(state, NamedSharding(mesh, P()))
    param_specs = {
      jax.tree_util.keystr(k): str(v.sharding.spec)
      for k, v in jax.tree_util.tree_leaves_with_path(state)
    }
    batch = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    sharded = train(loss_fn(graphdef), state, xs, ys)
    col_def, col_state = nnx.split(nnx.merge(graphdef, state).column)
    fwd = jax.jit(lambda s, x: nnx.merge(col_def, s)(x)).lower(col_state, xs).compile()
  report(name, sharded, single, param_specs, collectives(fwd))


# -------------------------------------------------------------------------------------- conv


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jaxact.linen.ConvAct(6, (3, 3), activation="relu")(x)
    x = jaxact.linen.ConvAct(8, (3, 3), activation="elu")(x)
    return jnp.mean(x, axis=(1, 2))


def conv_dp_case(name: str, mesh) -> None:
  """Data-parallel ConvAct: XLA:CPU's batch-chunked kernel gradient must stay device-local.

  4 examples per device; 4 -> 6 -> 8 channels, where the kernel gradient is summed over 4 strided
  batch chunks (a contiguous split, or 3 chunks, would move activations between devices).
  """
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((32, 8, 8, 4)).astype(np.float32))
  y = jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32))
  model = ConvNet()
  params = model.init(jax.random.key(0), x[:1])
  replicated = jax.device_put(params, NamedSharding(mesh, P()))

  def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)

  batch = NamedSharding(mesh, P("data"))
  sharded = train(loss_fn, replicated, jax.device_put(x, batch), jax.device_put(y, batch))
  single = train(loss_fn, one_device(params), one_device(x), one_device(y))
  report(name, sharded, single, {}, [])


# ------------------------------------------------------------------------------- gated MLP


def gated_case(name: str, mesh, tensor_parallel: bool) -> None:
  """jaxact.gated_mlp, data-parallel or Megatron tensor-parallel (w_gate and w_up split over the
  hidden features, w_down over its input): the forward reduces y once and gathers nothing."""
  keys = jax.random.split(jax.random.key(2), 3)
  params = {
    "w_gate": jax.random.normal(keys[0], (IN, HIDDEN)) * IN**-0.5,
    "w_up": jax.random.normal(keys[1], (IN, HIDDEN)) * IN**-0.5,
    "w_down": jax.random.normal(keys[2], (HIDDEN, OUT)) * HIDDEN**-0.5,
  }
  x, y = data()
  split = {"w_gate": P(None, "model"), "w_up": P(None, "model"), "w_down": P("model", None)}
  specs = split if tensor_parallel else {k: P() for k in params}
  shardings = {k: NamedSharding(mesh, v) for k, v in specs.items()}

  def mlp(params, x):
    return jaxact.gated_mlp(x, params["w_gate"], params["w_up"], params["w_down"])

  def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)

  batch = NamedSharding(mesh, P("data"))
  single = train(loss_fn, one_device(params), one_device(x), one_device(y))
  with jax.set_mesh(mesh):  # Explicit axes: the sharding is in the types
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    sharded = train(loss_fn, jax.device_put(params, shardings), xs, ys)
    fwd = jax.jit(mlp).lower(jax.device_put(params, shardings), xs).compile()
  param_specs = {k: str(v.spec) for k, v in shardings.items()}
  # The shapes the forward's collectives produce (per device): y's rows and OUT features only.
  shapes = re.findall(r"(\w+\[[\d,]*\])\S* (?:all-reduce|all-gather)\(", fwd.as_text())
  report(name, sharded, single, param_specs, collectives(fwd), fwd_collective_shapes=shapes)


VOCAB, HEAD_IN = 256, 24  # HEAD_IN: no other array of the case has a dimension of 24


def lce_case(name: str, mesh, w_spec, table: bool = False) -> None:
  """jaxact.linear_cross_entropy (bias, where, smoothing, z-loss, cap), with the tokens split over
  "data" and/or the vocabulary over "model" (Megatron's vocab-parallel loss). With `table`, w is
  an embedding table (V, D) read with w_layout="vd", the tokens are weighted, the smoothing is
  T5X's, and the predictions of the sharded call are compared with one device's."""
  keys = jax.random.split(jax.random.key(3), 2)
  w = jax.random.normal(keys[0], (HEAD_IN, VOCAB)) * HEAD_IN**-0.5
  params = {
    "w": w.T if table else w,
    "b": jax.random.normal(keys[1], (VOCAB,)),
    "scale": jnp.ones((HEAD_IN,)),  # so that the step needs dx
  }
  x = jax.random.normal(jax.random.key(4), (BATCH, HEAD_IN))
  labels = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, BATCH), jnp.int32)
  options = {}
  if table:
    options = dict(
      w_layout="vd",
      weights=1.0 + (labels % 3),
      label_smoothing_style="t5x",
      return_predictions=True,
    )

  def loss_and_predictions(params, x, labels):
    out = jaxact.linear_cross_entropy(
      x * params["scale"],
      params["w"],
      labels,
      bias=params["b"],
      where=labels % 5 != 0,
      label_smoothing=0.1,
      z_loss=1e-3,
      logit_soft_cap=5.0,
      vocab_block_size=48,  # blocks that do not divide a device's columns
      **options,
    )
    return out if table else (out, None)

  def loss_fn(params, x, labels):
    return loss_and_predictions(params, x, labels)[0]

  vocab_axis = w_spec[0] if table else w_spec[1]
  specs = {"w": w_spec, "b": P(vocab_axis), "scale": P()}
  shardings = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  rows = NamedSharding(mesh, P("data" if "data" in mesh.axis_names else None))
  single = train(loss_fn, one_device(params), one_device(x), one_device(labels))
  with jax.set_mesh(mesh):
    xs, ls = jax.device_put(x, rows), jax.device_put(labels, rows)
    sharded = train(loss_fn, jax.device_put(params, shardings), xs, ls)
    fwd = jax.jit(loss_fn).lower(jax.device_put(params, shardings), xs, ls).compile()
    predictions = jax.jit(loss_and_predictions)(jax.device_put(params, shardings), xs, ls)[1]
  extra = {}
  if table:
    want = jax.jit(loss_and_predictions)(one_device(params), one_device(x), one_device(labels))[1]
    extra["predictions_equal"] = bool(np.array_equal(predictions, want))
  step_text = sharded[3].as_text()
  produced = re.findall(
    r"= (.*?) (?:all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(", step_text
  )
  # The shapes (per device) of every array the step's collectives produce.
  shapes = sorted({a for p in produced for a in re.findall(r"[a-z]+\d*\[[\d,]*\]", p)})
  param_specs = {k: str(v.spec) for k, v in shardings.items()}
  report(
    name, sharded, single, param_specs, collectives(fwd), step_collective_shapes=shapes, **extra
  )


def main(names) -> None:
  auto = AxisType.Auto
  cases = {
    "linen_dp": lambda: linen_case("linen_dp", jax.make_mesh((8,), ("data",), (auto,)), False),
    "linen_tp": lambda: linen_case(
      "linen_tp", jax.make_mesh((2, 4), ("data", "model"), (auto, auto)), True
    ),
    # jax.make_mesh's default axis type is Explicit: the sharding is part of the array types.
    "nnx_dp_explicit": lambda: nnx_case("nnx_dp_explicit", jax.make_mesh((8,), ("data",)), False),
    "nnx_tp": lambda: nnx_case(
      "nnx_tp", jax.make_mesh((2, 4), ("data", "model"), (auto, auto)), True
    ),
    "nnx_tp_explicit": lambda: nnx_case(
      "nnx_tp_explicit", jax.make_mesh((2, 4), ("data", "model")), True, P("data", None)
    ),
    "conv_dp": lambda: conv_dp_case("conv_dp", jax.make_mesh((8,), ("data",), (auto,))),
    "gated_dp": lambda: gated_case("gated_dp", jax.make_mesh((8,), ("data",), (auto,)), False),
    "gated_dp_explicit": lambda: gated_case(
      "gated_dp_explicit", jax.make_mesh((8,), ("data",)), False
    ),
    "gated_tp": lambda: gated_case(
      "gated_tp", jax.make_mesh((2, 4), ("data", "model"), (auto, auto)), True
    ),
    "lce_dp": lambda: lce_case("lce_dp", jax.make_mesh((8,), ("data",)), P(None, None)),
    "lce_vocab": lambda: lce_case("lce_vocab", jax.make_mesh((8,), ("model",)), P(None, "model")),
    "lce_2d": lambda: lce_case(
      "lce_2d", jax.make_mesh((2, 4), ("data", "model")), P(None, "model")
    ),
    "lce_2d_table": lambda: lce_case(
      "lce_2d_table", jax.make_mesh((2, 4), ("data", "model")), P("model", None), table=True
    ),
    "lce_dp_auto": lambda: lce_case(
      "lce_dp_auto", jax.make_mesh((8,), ("data",), (auto,)), P(None, None)
    ),
  }
  # The ops as Flax's Gemma example shards them; the exhaustive ones run only when named.
  cases |= explicit_sharding_cases.CASES
  everything = cases | explicit_sharding_cases.EXHAUSTIVE
  eight_devices.run_cases(everything, names or list(cases))


if __name__ == "__main__":
  main(sys.argv[1:])
