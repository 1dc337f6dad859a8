"""The Pallas kernels per shard (``jax.shard_map``) under Explicit mesh axes, on 8 CPU devices.

The cases live in ``tests/pallas_sharding_cases.py`` and run in a subprocess, as in
tests/core/test_sharding.py (XLA:CPU offers 8 devices only if ``XLA_FLAGS`` asks for them before JAX
initialises its backend, and this pytest process already has one). All run
``implementation="pallas"`` (interpret mode on CPU): data-parallel dense on an 8-device mesh,
data- and column-parallel dense on a 2x4 ``("data", "model")`` mesh, batch dimensions over two
axes, no bias, a data-parallel 1x1 convolution, a data-parallel elementwise kernel pair (a
convolution's bias-and-activation epilogue), replicated operands on an Explicit mesh, an Explicit
axis beside an Auto one, and a pattern the kernels do not cover (the contraction dimension
sharded); and ``implementation="mosaic"`` (the Hopper kernels in Mosaic GPU's interpreter, bf16)
data-parallel and data- and column-parallel. The CUDA lowering of sharded calls and the reasons
given for unsupported patterns are checked in this process: an abstract mesh of 8 CUDA devices
(A100s, H100s) needs no GPU.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact
import pallas_kernels
from jaxact._src.core import pallas_sharding

from cases import representatives

SCRIPT = Path(__file__).resolve().parents[1] / "pallas_sharding_cases.py"
TRITON = pallas_kernels.CUSTOM_CALL_TARGET_NAME

# Sharded and one-device kernels differ only in the order partial sums are added (float32).
RTOL = 1e-6
XLA_RTOL = 2e-5  # as tests/fused/test_dense_triton.py: the kernels against XLA:CPU
# The Mosaic GPU (Hopper) cases are bfloat16: each device's dw and db (and, column-parallel, dx)
# are bfloat16 partial sums that the all-reduce adds, a few roundings (2^-8) of the largest entry.
BF16_RTOL = 2e-2
MOSAIC = "mosaic_gpu_v2"


@dataclasses.dataclass(frozen=True)
class Want:
  specs: list[str]  # the partition spec of the value and of each gradient
  shard: list[int]  # the per-shard shape of the first operand of the first kernel
  kernels: int = 6  # forward, dx, dw; in the CUDA and the interpret branch of platform_dependent
  collectives: tuple[str, ...] = ("all-reduce",)  # dw, db (and, column-parallel, dx) are summed
  rtol: float = RTOL  # against one device (errs), and against XLA (xla_errs, at least XLA_RTOL)


CASES = {
  "dense_dp": Want(["P()", "P('data', None)", "P(None, None)", "P(None,)"], [2, 12]),
  "dense_dp_tp": Want(["P()", "P('data', None)", "P(None, 'model')", "P('model',)"], [8, 12]),
  "dense_batch_dims": Want(
    ["P()", "P('data', 'seq', None, None)", "P(None, 'model')", "P('model',)"], [16, 12]
  ),
  "dense_no_bias": Want(["P()", "P('data', None)", "P(None, 'model')"], [8, 12]),
  "dense_replicated": Want(
    ["P()", "P(None, None)", "P(None, None)", "P(None,)"], [8, 12], collectives=()
  ),
  "dense_dp_auto_axis": Want(["P()", "P('data', None)", "P(None, None)", "P(None,)"], [8, 12]),
  "conv1x1_dp": Want(
    ["P()", "P('data', None, None, None)", "P(None, None, None, None)", "P(None,)"], [9, 6]
  ),
  # Per shard: the epilogue over (1 x 6 x 6, 10) rows x channels, then its backward (x 2 branches).
  # Also the XLA path on an Explicit mesh (the CPU kernel-gradient chunks must not slice shards).
  "conv3x3_dp": Want(
    ["P()", "P('data', None, None, None)", "P(None, None, None, None)", "P(None,)"], [36, 10], 4
  ),
  "elementwise_dp": Want(["P()", "P('data', 'model', None, None)", "P(None,)"], [2, 2, 3, 5], 2),
  # implementation="mosaic": the Hopper forward and backward kernels (Mosaic GPU's interpreter),
  # and the backward's db pass (bias_act.bias_grad): 4 kernels in each branch.
  "mosaic_dp": Want(
    ["P()", "P('data', None)", "P(None, None)", "P(None,)"], [128, 64], 8, rtol=BF16_RTOL
  ),
  "mosaic_dp_tp": Want(
    ["P()", "P('data', None)", "P(None, 'model')", "P('model',)"], [128, 64], 8, rtol=BF16_RTOL
  ),
}


# The default suite: data and tensor parallel dense, a convolution, Auto axes. The other cases, and
# the mosaic ones (the Mosaic GPU kernels in their interpreter on 8 devices, ~16 s each; the default
# suite lowers them per shard for an H100 below), under `pytest -m exhaustive`.
NAMES = representatives(list(CASES), {"dense_dp_tp", "conv3x3_dp", "dense_dp_auto_axis"})
# What the tests below read besides the parametrized cases.
OTHER_CASES = ("forward_replicated_b", "unsupported_k")


@pytest.fixture(scope="session")
def results(request, tmp_path_factory) -> dict[str, dict]:
  selected = eight_devices.selected_cases(request, __name__, {})
  return eight_devices.run_script_once(
    SCRIPT, tmp_path_factory, sorted(set(selected) | set(OTHER_CASES))
  )


def get(results, name: str) -> dict:
  return eight_devices.get(results, name, SCRIPT)


@pytest.mark.parametrize("name", NAMES)
def test_same_value_and_gradients_as_one_device(results, name):
  result, rtol = get(results, name), CASES[name].rtol
  assert max(result["errs"]) < rtol, result["errs"]
  assert max(result["xla_errs"]) < max(rtol, XLA_RTOL), result["xla_errs"]
  # The outputs keep the inputs' shardings: nothing is gathered to one device's full copy.
  assert result["specs"] == CASES[name].specs


@pytest.mark.parametrize("name", NAMES)
def test_kernels_run_per_shard(results, name):
  calls, want = get(results, name)["pallas_calls"], CASES[name]
  assert len(calls) == want.kernels
  assert all(call["in_shard_map"] for call in calls), calls
  assert calls[0]["shapes"][0] == want.shard


@pytest.mark.parametrize("name", NAMES)
def test_step_only_all_reduces(results, name):
  """Gradients of w and b (and, column-parallel, of x) are summed; no operand is gathered."""
  assert tuple(get(results, name)["collectives"]) == CASES[name].collectives


def test_replicated_bias_is_sliced_not_gathered(results):
  result = get(results, "forward_replicated_b")
  assert result["errs"] == [0.0]
  assert result["specs"] == ["P('data', 'model')"]
  calls = result["pallas_calls"]
  assert calls and all(c["in_shard_map"] and c["shapes"][2] == [4] for c in calls), calls
  assert result["collectives"] == []
  # Gradients too: db is resharded to b's (replicated) sharding, on both paths.
  for impl in ("pallas", "xla"):
    assert max(result[f"grad_errs_{impl}"]) < RTOL, result
    assert result[f"db_spec_{impl}"] == "P(None,)"


def test_unsupported_pattern_falls_back_or_raises(results):
  """x sharded over the contraction dimension: None runs XLA (not a single pallas_call in the
  program, even for CUDA), "pallas" raises with the reason."""
  result = get(results, "unsupported_k")
  assert result["err"] < RTOL
  assert result["auto_pallas_calls"] == []
  assert re.search(
    r"does not support this call: .*contraction dimension is sharded", result["raised"]
  )


# ------------------------------------------------------------- this process: abstract meshes


def cuda_mesh(shape, names, kind="NVIDIA A100-SXM4-80GB") -> AbstractMesh:
  # An A100 by default: the Triton kernels (on Hopper `None` runs the Mosaic GPU kernels or XLA).
  device = AbstractDevice(device_kind=kind, num_cores=None, platform="cuda")
  return AbstractMesh(shape, names, (AxisType.Explicit,) * len(names), abstract_device=device)


def manual_regions(text: str) -> list[list[str]]:
  """The lines of each ``sdy.manual_computation`` region (the body of a shard_map)."""
  lines, regions = text.splitlines(), []
  for i, line in enumerate(lines):
    if "sdy.manual_computation" in line:
      indent = len(line) - len(line.lstrip())
      body = []
      for inner in lines[i + 1 :]:
        if len(inner) - len(inner.lstrip()) <= indent:
          break
        body.append(inner)
      regions.append([line, *body])
  return regions


def reasons(mesh, shapes_specs, reason):
  """`reason` applied, at trace time, to arrays of these shapes and specs on `mesh`."""
  got = []
  with jax.sharding.use_abstract_mesh(mesh):
    args = [
      jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
      for shape, spec in shapes_specs
    ]
    jax.jit(lambda *a: got.append(reason(*a))).trace(*args)
  return got[0]


def test_reasons_for_patterns_the_kernels_do_not_cover():
  mesh = cuda_mesh((2, 4), ("data", "model"))
  dense = lambda xs, ws: reasons(mesh, [((8, 16), xs), ((16, 8), ws)], pallas_sharding.dense_reason)
  assert dense(P("data", None), P(None, "model")) is None
  assert dense(P(), P()) is None
  assert "contraction dimension is sharded" in dense(P(None, "model"), P())
  assert "contraction dimension is sharded" in dense(P(), P("model", None))
  assert "same mesh axes" in dense(P("model", None), P(None, "model"))
  elementwise = lambda spec, axis: reasons(
    mesh, [((4, 8, 8, 8), spec)], lambda z: pallas_sharding.elementwise_reason(z, axis)
  )
  assert elementwise(P("data", "model"), -1) is None
  assert "feature axis is sharded" in elementwise(P("data", None, None, "model"), -1)
  assert "feature axis is sharded" in elementwise(P("data", "model"), 1)  # NCHW


@pytest.mark.parametrize(
  "mesh_shape, names, specs, shard_x",
  [
    ((8,), ("data",), [P("data", None), P(), P()], "8x32xbf16"),
    ((2, 4), ("data", "model"), [P("data", None), P(None, "model"), P("model")], "32x32xbf16"),
  ],
  ids=["data-parallel", "data-and-column-parallel"],
)
def test_sharded_call_lowers_for_cuda_to_triton_per_shard(mesh_shape, names, specs, shard_x):
  """``implementation=None`` lowered for CUDA: the Triton calls sit inside shard_map regions that
  take the per-shard operands; gradients are all-reduced, nothing is all-gathered."""
  mesh = cuda_mesh(mesh_shape, names)

  def loss(x, w, b):
    return jnp.sum(jaxact.dense_bias_act(x, w, b, activation="gelu").astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(mesh):
    args = [
      jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
      for shape, spec in zip(((64, 32), (32, 48), (48,)), specs, strict=True)
    ]
    traced = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(*args)
    try:
      text = traced.lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # pragma: no cover - depends on the installed jaxlib
      if "cuda" in str(e).lower() and "platform" in str(e).lower():
        pytest.skip(f"this jaxlib cannot lower for CUDA: {e}")
      raise
  regions = manual_regions(text)
  assert len(regions) == 2  # the forward kernel; the backward's two
  triton = [sum(f"custom_call @{TRITON}(" in line for line in r) for r in regions]
  assert triton == [1, 2]
  assert text.count(f"custom_call @{TRITON}(") == 3  # none outside
  assert all(f"tensor<{shard_x}>" in r[0] for r in regions)
  assert "all_reduce" in text
  assert "all_gather" not in text


@pytest.mark.sample(2)
@pytest.mark.parametrize("implementation", [None, "mosaic"], ids=["none", "mosaic"])
@pytest.mark.parametrize(
  "mesh_shape, names, specs, shapes",
  [
    ((8,), ("data",), [P("data", None), P(), P()], ((1024, 64), (64, 256), (256,))),
    (
      (2, 4),
      ("data", "model"),
      [P("data", None), P(None, "model"), P("model")],
      ((256, 64), (64, 1024), (1024,)),
    ),
  ],
  ids=["data-parallel", "data-and-column-parallel"],
)
def test_sharded_call_lowers_for_h100_to_mosaic_per_shard(
  mesh_shape, names, specs, shapes, implementation
):
  """Lowered for 8 H100s, the Mosaic GPU calls sit inside shard_map regions taking 128 x 64 row
  blocks of x: the forward under None (whose backward is XLA's), forward, dx and dw under
  "mosaic" (whose gradients are all-reduced) with db's Triton pass; nothing is all-gathered."""
  mesh = cuda_mesh(mesh_shape, names, "NVIDIA H100 80GB HBM3")

  def loss(x, w, b):
    y = jaxact.dense_bias_act(x, w, b, activation="gelu", implementation=implementation)
    return jnp.sum(y.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(mesh):
    args = [
      jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
      for shape, spec in zip(shapes, specs, strict=True)
    ]
    text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(*args)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
  regions = manual_regions(text)
  mosaic = [sum(f"custom_call @{MOSAIC}(" in line for line in r) for r in regions]
  assert mosaic == ([1] if implementation is None else [1, 2])
  assert text.count(f"custom_call @{MOSAIC}(") == sum(mosaic)  # none outside
  assert all("tensor<128x64xbf16>" in r[0] for r in regions)
  triton = [sum(f"custom_call @{TRITON}(" in line for line in r) for r in regions]
  assert triton == ([0] if implementation is None else [0, 1])  # "mosaic": db's pass
  assert text.count(f"custom_call @{TRITON}(") == sum(triton)
  # The kernels' gradients are summed in the program; XLA's backward (None) is partitioned later.
  assert ("all_reduce" in text) == (implementation == "mosaic")
  assert "all_gather" not in text


def test_mosaic_reason_names_the_per_device_block():
  """A sharded layer whose per-device block the Hopper kernels do not take: "mosaic" says which
  block; None takes XLA (no Mosaic GPU call)."""
  mesh = cuda_mesh((8,), ("data",), "NVIDIA H100 80GB HBM3")

  def loss(implementation):
    def f(x, w):
      y = jaxact.dense_bias_act(x, w, None, activation="gelu", implementation=implementation)
      return jnp.sum(y.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(f, (0, 1)))

  with jax.sharding.use_abstract_mesh(mesh):
    x = jax.ShapeDtypeStruct((8 * 64, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    with pytest.raises(NotImplementedError, match=r"M=64 is not .* in each device's block"):
      loss("mosaic").trace(x, w)
    text = loss(None).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert MOSAIC not in text and TRITON not in text


def test_the_kernels_refuse_gemmas_sharding_by_name_and_none_takes_xla():
  """Issue 33's patterns (Flax's Gemma example on a 4 x 2 fsdp x tensor mesh: FSDP weights,
  feature-sharded activations, out_sharding): "pallas" / "mosaic" say why (a contraction
  dimension split, an out_sharding the kernels do not give), and None lowers for CUDA to XLA's
  partitioned products with no kernel at all."""
  mesh = cuda_mesh((4, 2), ("fsdp", "tensor"))
  act = P("fsdp", None, "tensor")

  def struct(shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  x = struct((8, 16, 64), act)
  w_in, w_out = struct((64, 128), P("fsdp", "tensor")), struct((128, 64), P("tensor", "fsdp"))
  head, labels = struct((64, 256), P("fsdp", "tensor")), struct((8, 16), P("fsdp"), jnp.int32)

  def dense(impl):
    return lambda x, w: jaxact.dense_bias_act(
      x, w, activation="gelu", implementation=impl, out_sharding=act
    )

  def gated(impl):
    return lambda x, w, w_out: jaxact.gated_mlp(
      x, w, w, w_out, activation="gelu", implementation=impl, out_sharding=act
    )

  def lce(impl):
    return lambda x, w, y: jaxact.linear_cross_entropy(x, w, y, implementation=impl)

  cases = [(dense, "pallas", (x, w_in)), (gated, "pallas", (x, w_in, w_out))]
  cases.append((lce, "mosaic", (x, head, labels)))
  with jax.sharding.use_abstract_mesh(mesh):
    for make, impl, args in cases:
      with pytest.raises(NotImplementedError, match="contraction dimension is sharded"):
        jax.jit(make(impl)).trace(*args)
      text = jax.jit(make(None)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert TRITON not in text and MOSAIC not in text
    # Rows and columns as the kernels split them, but an out_sharding they do not give.
    rows, columns = struct((8, 16, 64), P("fsdp", None, None)), struct((64, 128), P(None, "tensor"))
    out = P("fsdp", None, None)
    with pytest.raises(NotImplementedError, match=r"out_sharding=P\('fsdp', None, None\) differs"):
      jax.jit(
        lambda x, w: jaxact.dense_bias_act(
          x, w, activation="gelu", implementation="pallas", out_sharding=out
        )
      ).trace(rows, columns)
