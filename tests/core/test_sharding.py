"""Sharded training of jaxact's Flax layers on 8 virtual CPU devices (JAX's own SPMD engine).

The cases live in ``tests/sharding_cases.py`` and run in a subprocess: XLA:CPU offers 8 devices only
if ``--xla_force_host_platform_device_count=8`` is in ``XLA_FLAGS`` when JAX initialises its
backend, and in this pytest process the backend is already up with one device (tests/conftest.py
imports JAX, other tests run first). A subprocess gets its own backend whatever the test order,
selection or plugins, and leaves this process's devices alone. The script runs once per session
(about 15 s) and prints one JSON result per case; the tests below assert on them.

Cases: a data-parallel and a tensor-parallel (column-parallel then row-parallel) MLP block of
``jaxact.linen.DenseAct`` (Auto mesh, ``nn.with_partitioning`` metadata), the same with
``jaxact.nnx.LinearAct`` (``kernel_metadata={"out_sharding": ...}``; data-parallel on an Explicit
mesh, tensor-parallel on an Auto mesh and on an Explicit one with ``out_sharding`` for the
row-parallel layer), a data-parallel ``ConvAct`` network, and ``jaxact.gated_mlp`` data-parallel
(Auto and Explicit axes) and Megatron tensor-parallel. And (``tests/explicit_sharding_cases.py``)
every op as Flax's Gemma example shards its model: FSDP and tensor-parallel weights, feature-sharded
activations, ``out_sharding`` arguments, on the example's meshes, against the example's own
composition under the same mesh.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact
import jaxact.linen
import jaxact.nnx

from cases import representatives

SCRIPT = Path(__file__).resolve().parents[1] / "sharding_cases.py"
CASES = [
  "linen_dp",
  "linen_tp",
  "nnx_dp_explicit",
  "nnx_tp",
  "nnx_tp_explicit",
  "conv_dp",
  "gated_dp",
  "gated_dp_explicit",
  "gated_tp",
  "lce_dp",
  "lce_vocab",
  "lce_2d",
  "lce_2d_table",
  "lce_dp_auto",
]
TENSOR_PARALLEL = ["linen_tp", "nnx_tp", "nnx_tp_explicit"]

# The sharded programs sum the batch (and, tensor-parallel, the hidden features) in another order:
# float32 rounding, relative to each gradient's largest entry.
RTOL = 1e-5


# The default suite keeps one case of each sharding mode: tensor parallelism on Explicit axes
# (nnx_tp_explicit) and on Auto axes (gated_tp), FSDP with tensor parallelism on Explicit axes (the
# convolutions below), and issue 33's bug; `pytest -m exhaustive` runs them all. The vocab-parallel
# loss (lce_2d_table) is linear_log_probs' 2x4 case by default (tests/lce/test_log_probs.py).
DEFAULT = {"nnx_tp_explicit", "gated_tp"}
# The case each unparametrized test reads.
READS = {
  "test_tensor_parallel_gated_mlp_reduces_y_once_and_gathers_nothing": "gated_tp",
  "test_vocab_parallel_table_predicts_as_one_device": "lce_2d_table",
  "test_gemma_decoder_on_the_examples_4x2_mesh": "gemma_4x2",
  "test_gemma_decoder_under_auto_axes": "gemma_4x2_auto",
  "test_fsdp_and_tensor_parallel_convolutions": "conv_4x2",
  "test_rms_norm_of_feature_sharded_rows_with_a_replicated_scale": "norm_bug_1x1",
}


@pytest.fixture(scope="session")
def results(request, tmp_path_factory) -> dict[str, dict]:
  names = eight_devices.selected_cases(request, __name__, READS)
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


def some(names):
  """`names` as parameters, those outside DEFAULT under ``pytest -m exhaustive`` only."""
  return representatives(names, DEFAULT & set(names))


def get(results, name: str) -> dict:
  return eight_devices.get(results, name, SCRIPT)


@pytest.mark.parametrize("name", some(CASES))
def test_same_loss_and_gradients_as_one_device(results, name):
  result = get(results, name)
  assert result["loss_err"] < RTOL, result["loss_err"]
  assert result["grad_err"] < RTOL, result["grad_err"]
  np.testing.assert_allclose(result["losses"], result["losses_1dev"], rtol=RTOL)
  assert result["losses"][-1] < result["losses"][0]  # it trains


@pytest.mark.parametrize("name", some(TENSOR_PARALLEL))
def test_partitioning_metadata_is_honoured(results, name):
  specs = get(results, name)["param_specs"]
  prefix = "['params']" if name.startswith("linen") else ""
  suffix = "" if name.startswith("linen") else ".value"
  want = {
    "['column']['kernel']": "P(None, 'model')",
    "['column']['bias']": "P('model',)",
    "['row']['kernel']": "P('model', None)",
    "['row']['bias']": "P(None,)",
  }
  assert specs == {f"{prefix}{k}{suffix}": v for k, v in want.items()}


@pytest.mark.parametrize("name", some(TENSOR_PARALLEL))
def test_column_parallel_layer_gathers_no_weights(results, name):
  """The compiled forward of the column-parallel layer alone holds no collective at all; the
  training step of the block only all-reduces (the row-parallel output, gradients, the loss)."""
  result = get(results, name)
  assert result["fwd_collectives"] == []
  assert set(result["step_collectives"]) == {"all-reduce"}


def test_tensor_parallel_gated_mlp_reduces_y_once_and_gathers_nothing(results):
  """Megatron's split: w_gate and w_up over the hidden features, w_down over its input. The
  forward's one collective is the all-reduce of y (per device: a quarter of the batch's rows, OUT
  features); no hidden-sized array moves. The step only all-reduces."""
  result = get(results, "gated_tp")
  assert result["fwd_collectives"] == ["all-reduce"]
  assert result["fwd_collective_shapes"] == ["f32[16,16]"]  # BATCH / 2 data shards, OUT
  assert set(result["step_collectives"]) == {"all-reduce"}


@pytest.mark.parametrize(
  "name", some(["linen_dp", "nnx_dp_explicit", "conv_dp", "gated_dp", "gated_dp_explicit"])
)
def test_data_parallel_step_only_all_reduces(results, name):
  """Data parallelism all-reduces gradients and nothing else: no activation moves between devices
  (for the convolution: XLA:CPU's batch-chunked kernel gradient takes device-local chunks)."""
  result = get(results, name)
  assert result["fwd_collectives"] == []
  assert set(result["step_collectives"]) == {"all-reduce"}


@pytest.mark.parametrize("name", some(["lce_vocab", "lce_2d", "lce_2d_table"]))
def test_vocab_parallel_loss_moves_only_per_token_numbers(results, name):
  """Megatron's vocab-parallel loss: w split over its columns, each device reduces its own slice.
  The step's collectives produce per-token statistics (tokens a device: 32 on a vocabulary-only
  mesh, 16 beside two data shards), dx (tokens, 24) and, over the data axis only, the device's
  columns of dw and db: never w's or the logits' whole vocabulary (256)."""
  result = get(results, name)
  assert set(result["step_collectives"]) == {"all-reduce"}
  tokens = 32 if name == "lce_vocab" else 16
  allowed = {f"f32[{tokens}]", f"f32[{tokens},24]", "f32[]", "s32[]"}
  if name == "lce_2d":
    allowed |= {"f32[24,64]", "f32[64]", "f32[24]"}  # dw, db (a quarter of V), d scale over data
  elif name == "lce_2d_table":  # the table's gradient in its own layout; the weights' sum
    allowed |= {"f32[64,24]", "f32[64]", "f32[24]"}
  else:
    allowed |= {"f32[24]"}
  assert set(result["step_collective_shapes"]) <= allowed, result["step_collective_shapes"]
  assert f"f32[{tokens}]" in result["step_collective_shapes"]  # the check can fail


@pytest.mark.exhaustive  # the vocab-parallel loss by default: tests/lce/test_log_probs.py
def test_vocab_parallel_table_predicts_as_one_device(results):
  """w_layout="vd" over a table split by rows: the argmax of each token's logits comes from a
  pmin over the devices holding the largest, the first column of it, as on one device."""
  assert get(results, "lce_2d_table")["predictions_equal"]


@pytest.mark.parametrize("name", some(["lce_dp", "lce_dp_auto"]))
def test_data_parallel_loss_reduces_gradients_and_the_loss_only(results, name):
  result = get(results, name)
  assert set(result["step_collectives"]) == {"all-reduce"}
  # no activation-sized (tokens a device: 4) array moves
  assert not any(s.startswith("f32[4,") or s == "f32[4]" for s in result["step_collective_shapes"])


# ------------------------------------------- issue 33: the ops as Flax's Gemma example shards them


def _decoder_equals_one_device(result, explicit: bool = True) -> None:
  assert result["loss_err"] < RTOL, result["loss_err"]
  assert result["grad_err"] < RTOL, result["grad_err"]
  assert result["predictions_equal"]
  # Each gradient takes its parameter's sharding (the custom_vjp's cotangents retyped).
  assert result["grad_specs_equal"]
  # Per device, no more memory than the plain composition under the same mesh.
  assert result["temp"] <= result["plain_temp"], (result["temp"], result["plain_temp"])
  if explicit:
    # What the products do is XLA's partitioning of the same dot_generals: the same gathers of
    # the weights, and no more bytes moved in all (here fewer: reduce-scatters where XLA:CPU
    # all-reduces, and the gathered input kept for the weight gradient). None inside a loop,
    # where it would run once an iteration (the LM head's vocabulary blocks run per device).
    got, plain = result["collectives"], result["plain_collectives"]
    assert got["bytes"] <= plain["bytes"], (got, plain)
    assert got["largest"] <= plain["largest"], (got, plain)
    assert got["in_loops"] == 0, got


@pytest.mark.exhaustive  # FSDP + tensor parallel on Explicit axes by default: the convolutions'
def test_gemma_decoder_on_the_examples_4x2_mesh(results):
  """Gemma's block (RMS norm with 1 + scale, GQA attention with a window and a soft cap, GeGLU
  MLP), a layer norm, a Megatron dense pair and the tied head with T5X smoothing, weights and
  predictions, sharded by fsdp_tp_sharding with act_btd activations over Explicit axes: equal to
  one device, the gradients in the parameters' shardings, no more collective bytes or temp than
  the example's own composition (einsums and dots with out_sharding)."""
  result = get(results, "gemma_4x2")
  _decoder_equals_one_device(result)
  assert "reduce-scatter" in result["collectives"]["kinds"]  # the table's and dx's gradients


@pytest.mark.exhaustive
def test_gemma_decoder_under_auto_axes(results):
  """The same program on a mesh of Auto axes (the out_sharding arguments become sharding
  constraints): equal to one device, no more temp, no larger collective. XLA partitions both
  programs; it runs the LM head's vocabulary loop a block of the table at a time, each gathered
  and its gradient reduced once an iteration (documented: for a sharded head use Explicit axes)."""
  result = get(results, "gemma_4x2_auto")
  _decoder_equals_one_device(result, explicit=False)
  assert result["collectives"]["largest"] <= result["plain_collectives"]["largest"]


def test_fsdp_and_tensor_parallel_convolutions(results):
  result = get(results, "conv_4x2")
  _decoder_equals_one_device(result)


def test_rms_norm_of_feature_sharded_rows_with_a_replicated_scale(results):
  """Issue 33's bug: on a 1 x 1 mesh the scale's gradient came out split like the features and
  the custom_vjp refused it ("must produce an output with the same type")."""
  result = get(results, "norm_bug_1x1")
  assert result["grad_err"] < RTOL
  assert result["grad_specs"] == ["P('fsdp', None, 'tensor')", "P(None,)"]


@pytest.fixture(scope="module")
def exhaustive_results() -> dict[str, dict]:
  return eight_devices.run_script(SCRIPT, ["gemma_1x1", "gemma_2x1", "gemma_1x2"])


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", ["gemma_1x1", "gemma_2x1", "gemma_1x2"])
def test_gemma_decoder_on_the_examples_other_meshes(exhaustive_results, name):
  _decoder_equals_one_device(get(exhaustive_results, name))


# ----------------------------------------------------- this process: one device, a 1 x 1 mesh

ACT = P("fsdp", None, "tensor")


def _mesh_1x1():
  return jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])


def test_out_sharding_is_checked_and_an_ambiguous_product_names_it():
  from jaxact._src.core.shardings import ShardingTypeError

  x = jnp.ones((2, 4, 8), jnp.float32)
  w, w_down = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)
  with pytest.raises(TypeError, match=r"dense_bias_act: `out_sharding` must be a .*PartitionSpec"):
    jaxact.dense_bias_act(x, w, activation="relu", out_sharding=("fsdp", None, "tensor"))
  with pytest.raises(
    ValueError, match=r"rms_norm: `out_sharding` P\('fsdp',\) is a .* needs a mesh"
  ):
    jaxact.rms_norm(x, out_sharding=P("fsdp"))
  with jax.set_mesh(_mesh_1x1()):
    with pytest.raises(ValueError, match=r"`out_sharding` .* has 4 entries, but the output has 3"):
      jaxact.gated_mlp(x, w, w, w_down, out_sharding=P("fsdp", None, None, None))
    xs = jax.device_put(x, ACT)
    ws, w_downs = (
      jax.device_put(w, P("fsdp", "tensor")),
      jax.device_put(w_down, P("tensor", "fsdp")),
    )
    # Both contraction dimensions split: jnp.dot needs an out_sharding, and so do the ops.
    with pytest.raises(ShardingTypeError, match=r"jaxact.dense_bias_act: .*pass `out_sharding=`"):
      jaxact.dense_bias_act(xs, ws, activation="relu")
    with pytest.raises(ShardingTypeError, match=r"jaxact.gated_mlp: .*pass `out_sharding=`"):
      jaxact.gated_mlp(xs, ws, ws, w_downs)
    y = jaxact.gated_mlp(xs, ws, ws, w_downs, out_sharding=ACT)
    h = jaxact.gated_dense(xs, ws, ws, out_sharding=ACT)  # its hidden, the output here
  assert y.sharding.spec == ACT and h.sharding.spec == ACT
  np.testing.assert_allclose(y, jaxact.gated_mlp(x, w, w, w_down), rtol=1e-6)
  np.testing.assert_allclose(h, jaxact.gated_dense(x, w, w), rtol=1e-6)


def _layers():
  """(name, module, input, parameter specs by name, out_sharding), linen and nnx, FSDP and tensor
  parallel as Gemma's weights."""
  from flax import nnx

  rngs = lambda: nnx.Rngs(0)
  x3, x4 = (2, 4, 8), (2, 4, 4, 8)
  dense = {"kernel": P("fsdp", "tensor"), "bias": P("tensor")}
  gated = {"gate_proj": P("fsdp", "tensor"), "up_proj": P("fsdp", "tensor")}
  gated["down_proj"] = P("tensor", "fsdp")
  norm = {"scale": P("tensor"), "bias": P(None)}
  conv = {"kernel": P(None, None, "fsdp", "tensor"), "bias": P("tensor")}
  conv_out = P("fsdp", None, None, "tensor")
  return (
    [
      ("linen.DenseAct", jaxact.linen.DenseAct(16, activation="gelu"), x3, dense, ACT),
      ("linen.GatedMLP", jaxact.linen.GatedMLP(16, activation="gelu"), x3, gated, ACT),
      ("linen.RMSNorm", jaxact.linen.RMSNorm(scale_offset=1.0), x3, norm, ACT),
      ("linen.LayerNorm", jaxact.linen.LayerNorm(), x3, norm, ACT),
      ("linen.ConvAct", jaxact.linen.ConvAct(16, (3, 3), activation="relu"), x4, conv, conv_out),
      (
        "nnx.LinearAct",
        jaxact.nnx.LinearAct(8, 16, activation="gelu", rngs=rngs()),
        x3,
        dense,
        ACT,
      ),
      ("nnx.GatedMLP", jaxact.nnx.GatedMLP(8, 16, activation="gelu", rngs=rngs()), x3, gated, ACT),
      ("nnx.RMSNorm", jaxact.nnx.RMSNorm(8, scale_offset=1.0, rngs=rngs()), x3, norm, ACT),
      ("nnx.LayerNorm", jaxact.nnx.LayerNorm(8, rngs=rngs()), x3, norm, ACT),
      (
        "nnx.ConvAct",
        jaxact.nnx.ConvAct(8, 16, (3, 3), activation="relu", rngs=rngs()),
        x4,
        conv,
        conv_out,
      ),
    ],
    nnx,
  )


@pytest.mark.sample(4)
@pytest.mark.parametrize("index", range(10))
def test_flax_layers_take_out_sharding_at_the_call(index):
  """Each Flax layer with FSDP + tensor-parallel parameters on feature-sharded input, called with
  out_sharding (nnx as nnx.Linear takes it; linen as a keyword): its output takes that sharding
  and equals the unsharded call, and each parameter's gradient takes its parameter's sharding."""
  table, nnx = _layers()
  name, module, shape, specs, out = table[index]
  x = jnp.asarray(np.random.default_rng(index).standard_normal(shape), jnp.float32)

  def spec_of(path):  # the innermost name the table knows (a projection's, or the parameter's)
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return specs[next(n for n in reversed(names) if n in specs)]

  if name.startswith("linen"):
    params = module.init(jax.random.key(0), x)
    apply = lambda p, x, **kw: module.apply(p, x, **kw)
  else:
    graphdef, params = nnx.split(module)
    apply = lambda p, x, **kw: nnx.merge(graphdef, p)(x, **kw)
  want = apply(params, x)
  with jax.set_mesh(_mesh_1x1()):
    sharded = jax.tree_util.tree_map_with_path(
      lambda path, a: jax.device_put(a, spec_of(path)), params
    )
    xs = jax.device_put(x, P("fsdp", *(None,) * (x.ndim - 2), "tensor"))
    y = jax.jit(lambda p, x: apply(p, x, out_sharding=out))(sharded, xs)
    loss = lambda p, x: jnp.sum(jnp.sin(apply(p, x, out_sharding=out)))
    grads = jax.jit(jax.grad(loss))(sharded, xs)
  assert y.sharding.spec == out, name
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
  got_specs = jax.tree.map(lambda g: g.sharding.spec, grads)
  assert got_specs == jax.tree.map(lambda a: a.sharding.spec, sharded), name


@pytest.mark.exhaustive
def test_the_gemma_port_under_the_examples_mesh():
  """``python -m benchmarks gemma --check``: the jaxact port of Flax's examples/gemma (a trimmed
  model: Gemma's norms, GQA attention with windows and soft caps, GeGLU MLP, the tied head with
  T5X smoothing and weights), built under the example's ("fsdp", "tensor") mesh with its
  fsdp_tp_sharding metadata and no other change, 8 x 1 (every shipped config's on 8 devices) and
  4 x 2 (tensor parallelism on), gives the loss, accuracy and gradients of the same model on one
  device, each gradient in its parameter's sharding; and on one device the original's, its
  parameters loaded by the same names."""
  results = eight_devices.run_command(["-m", "benchmarks", "gemma", "--check"], "benchmarks gemma")
  assert sorted(results) == ["gemma_4x2", "gemma_8x1"], sorted(results)
  for result in results.values():
    assert result["devices"] == 8
    assert result["weights_sharded"] == "P('fsdp', 'tensor')"  # the FSDP + tensor-parallel layout
    assert result["loss_err"] < RTOL and result["grad_err"] < RTOL, result
    assert result["correct_equal"] and result["grad_specs_equal"], result
    assert result["same_names"], result
    assert result["original_loss_err"] < RTOL and result["original_grad_err"] < RTOL, result
    assert result["original_correct_equal"], result
