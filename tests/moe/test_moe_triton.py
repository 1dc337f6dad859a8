"""The grouped Triton kernels (``pallas_kernels.grouped_triton``) behind
``moe_mlp(..., implementation="pallas")``.

On CPU the kernels run in Pallas interpret mode: against their pure-jnp references and against
``jax.lax.ragged_dot`` and its transposes (empty groups, a group longer than a tile, boundaries
inside a tile, padding rows past the groups), and ``moe_mlp`` through them against the XLA path
(values, auxiliary losses, the gradients of x, the router and every expert weight), on one device
and per device under expert parallelism (this module runs itself as the 8-device script in a
subprocess, tests/eight_devices.py, for the latter). For CUDA: the
dispatch under abstract H100 and A100 meshes, the lowered step's Triton calls, and a training step
at a real size (16384 routed rows, D 2048, hidden 1408, 64 experts, bf16) compiled for an H100
without register spills, whose matmuls cost 1/47 of the flops of XLA's ragged_dot step (1/64 for
the rows' own products; the rest is the kernels' tiles that straddle two experts).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

# Only when run as the 8-device script: pytest's own process must not get 8 devices.
if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding

import eight_devices
import jaxact
import support
from jaxact._src import docs
from jaxact._src.core import dispatch
from jaxact._src.moe import rules
from kernel_cases import TRITON, cuda_mesh, lowered_text, needs_gpu_compiler
from moe_cases import CASES
from pallas_kernels import grouped_triton as kernels
from pallas_kernels.dense_triton_tiles import Tiles

from cases import representatives

# 16-row tiles, so that a few dozen rows make several tiles, groups straddle them, and one group
# is longer than a tile.
SMALL = kernels.GroupedConfig(gmm=Tiles(16, 16, 16, 4, 1), tgmm=Tiles(16, 16, 16, 4, 1))
# Group sizes over 70 rows: empty groups (first, middle, last), a group of 37 (over two tiles),
# groups of 1 and 3 inside a tile, and 70 - 63 = 7 padding rows past the groups.
SIZES = (0, 9, 37, 0, 1, 3, 13, 0)
M, K, N = 70, 24, 40
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _normal(rng, shape, dtype, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(scale), dtype)


def _close(got, want, dtype):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    tol = TOL[dtype]
    np.testing.assert_allclose(g, w, rtol=tol["rtol"], atol=tol["atol"] * float(np.abs(w).max()))


@pytest.mark.parametrize(
  "dtype,config",
  [(jnp.float32, SMALL), (jnp.bfloat16, None)],
  ids=["float32-16", "bfloat16-default"],
)
def test_kernels_match_their_references_and_ragged_dot(dtype, config):
  """gmm, gmm with the transposed rhs and tgmm against the references and against ragged_dot and
  its transposes (what the XLA path computes); padding rows and empty groups give zeros."""
  rng = np.random.default_rng(0)
  g = len(SIZES)
  sizes = jnp.asarray(SIZES, jnp.int32)
  lhs, ct = _normal(rng, (M, K), dtype), _normal(rng, (M, N), dtype)
  rhs = _normal(rng, (g, K, N), dtype, K**-0.5)
  hi = "highest"
  f32 = jnp.float32
  kw = dict(precision=hi, block_config=config, interpret=True, preferred_element_type=f32)

  @jax.jit
  def both(lhs, rhs, ct, sizes):
    got = (
      kernels.gmm(lhs, rhs, sizes, **kw),
      kernels.gmm(ct, rhs, sizes, transpose_rhs=True, **kw),
      kernels.tgmm(lhs, ct, sizes, **kw),
    )
    refs = (
      kernels.gmm_reference(lhs, rhs, sizes, preferred_element_type=f32),
      kernels.gmm_reference(ct, rhs, sizes, transpose_rhs=True, preferred_element_type=f32),
      kernels.tgmm_reference(lhs, ct, sizes, preferred_element_type=f32),
    )
    rd = lambda v, w: jax.lax.ragged_dot(v, w, sizes, hi, preferred_element_type=f32)
    xla = (
      rd(lhs, rhs),
      jax.linear_transpose(lambda v: rd(v, rhs), lhs)(ct.astype(f32))[0],
      jax.linear_transpose(lambda w: rd(lhs, w), rhs)(ct.astype(f32))[0],
    )
    return got, refs, xla

  got, refs, xla = both(lhs, rhs, ct, sizes)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, refs)
  _close(got, refs, dtype)
  _close(got, xla, dtype)
  used = sum(SIZES)
  assert not np.any(np.asarray(got[0])[used:]) and not np.any(np.asarray(got[1])[used:])
  empty = [i for i, s in enumerate(SIZES) if s == 0]
  assert not np.any(np.asarray(got[2])[empty])


@pytest.mark.exhaustive
@pytest.mark.parametrize("seed", range(6))
def test_kernels_over_random_group_sizes(seed):
  """Random sizes (many empty groups, every row used or not) against the references."""
  rng = np.random.default_rng(seed)
  g, m = int(rng.integers(1, 12)), int(rng.integers(1, 90))
  cuts = np.sort(rng.integers(0, m + 1, g))
  sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts])), jnp.int32)
  lhs, rhs = _normal(rng, (m, 20), jnp.float32), _normal(rng, (g, 20, 33), jnp.float32)
  ct = _normal(rng, (m, 33), jnp.float32)
  kw = dict(precision="highest", block_config=SMALL, interpret=True)
  got = (kernels.gmm(lhs, rhs, sizes, **kw), kernels.tgmm(lhs, ct, sizes, **kw))
  want = (kernels.gmm_reference(lhs, rhs, sizes), kernels.tgmm_reference(lhs, ct, sizes))
  _close(got, want, jnp.float32)


def test_kernels_refuse_mixed_and_unsupported_dtypes():
  x, w = jnp.ones((4, 3), jnp.float32), jnp.ones((2, 3, 5), jnp.float32)
  s = jnp.ones((2,), jnp.int32)
  with pytest.raises(TypeError, match=r"`lhs` and `rhs` must have one dtype"):
    kernels.gmm(x, w.astype(jnp.bfloat16), s, interpret=True)
  with pytest.raises(TypeError, match=r"`lhs` has dtype float64"):
    kernels.gmm(x.astype(jnp.float64), w, s, interpret=True)
  with pytest.raises(ValueError, match=r"`lhs` must be \(m, k\)"):
    kernels.gmm(jnp.ones((4, 5), jnp.float32), w, s, interpret=True)


# ------------------------------------------------------------------------ moe_mlp through them

T, D, F, E = 24, 16, 20, 6


def _operands(dtype, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(T, D), (D, E), (E, D, F), (E, D, F), (E, F, D)]
  scales = [1.0, 1.0, D**-0.5, D**-0.5, F**-0.5]
  return tuple(_normal(rng, s, dtype, c) for s, c in zip(shapes, scales, strict=True))


def _value_and_grads(implementation, args, **kw):
  """``(y, aux, grads of every argument)`` of a loss of y and both auxiliary losses."""

  def loss(*args):
    y, aux = jaxact.moe_mlp(*args, implementation=implementation, **kw)
    ct = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    total = jnp.sum(y.astype(jnp.float32) * ct)
    return total + 0.3 * aux["load_balancing_loss"] + 0.1 * aux["router_z_loss"], (y, aux)

  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, range(5), has_aux=True))(*args)
  return y, aux, grads


_MOE_CASES = {
  "float32-top2": (jnp.float32, dict(top_k=2)),
  "bfloat16-capacity": (jnp.bfloat16, dict(top_k=2, capacity_factor=0.5)),
  "float32-top1-gelu": (jnp.float32, dict(top_k=1, activation="gelu", normalize_top_k=False)),
}


@pytest.mark.parametrize("case", representatives(list(_MOE_CASES), {"bfloat16-capacity"}))
def test_pallas_matches_the_xla_path(case):
  """Values, both auxiliary losses and the gradients of x, the router and every expert weight;
  with a capacity the dropped rows sit past the groups (padding rows of the kernels)."""
  dtype, kw = _MOE_CASES[case]
  args = _operands(dtype)
  got = _value_and_grads("pallas", args, **kw)
  want = _value_and_grads("xla", args, **kw)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_tree_all_finite(got)
  _close(got, want, dtype)


def test_implementation_is_checked_and_pallas_declines_with_the_reason():
  args = _operands(jnp.float32)
  with pytest.raises(ValueError, match=r"`implementation` 'mosaic' is not known; choose one of"):
    jaxact.moe_mlp(*args, top_k=2, implementation="mosaic")
  wide = tuple(a.astype(jnp.float64) for a in args)
  with pytest.raises(NotImplementedError, match=r"'pallas' .* x dtype float64"):
    jaxact.moe_mlp(*wide, top_k=2, implementation="pallas")
  jax.eval_shape(lambda: jaxact.moe_mlp(*wide, top_k=2))  # None: XLA, silently
  plan = _plan(jnp.float32)
  x, w = jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((E, D, F), jnp.float32)
  assert rules.triton_unsupported(plan, x, w, w) is None
  empty = jax.ShapeDtypeStruct((E, D, 0), jnp.float32)
  assert rules.triton_unsupported(plan, x, empty, w) == "zero-size operands"


def _plan(dtype):
  from jaxact._src.activations.resolve import resolve_activation
  from jaxact._src.moe.plan import MoEPlan

  f32 = np.dtype(jnp.float32)
  act, _ = resolve_activation("t", "silu", jax.ShapeDtypeStruct((4, 4), f32), np.dtype(dtype))
  return MoEPlan(act, None, f32, np.dtype(dtype), T, E, 2)


def test_none_keeps_xla_on_every_target_and_pallas_forces_triton():
  plan = _plan(jnp.bfloat16)
  x = jax.ShapeDtypeStruct((T * 2, D), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16)
  for kind in ("H100", "A100"):
    with jax.sharding.use_abstract_mesh(cuda_mesh(kind)):
      auto = rules.decide("moe_mlp", None, plan, x, w, w)
      named = rules.decide("moe_mlp", "pallas", plan, x, w, w)
    assert (auto.forward, auto.backward, auto.forced) == ("xla", "xla", False)
    assert "unmeasured on a GPU (issue 43)" in auto.declined
    assert (named.forward, named.backward, named.forced) == ("triton", "triton", True)
  assert rules.decide("moe_mlp", "xla", plan, x, w, w) == dispatch.Decision()
  for rule in rules.MOE_AUTO_RULES:
    assert rule.where in docs.dispatch_table()


def _step(implementation, top_k=2):
  """``value_and_grad`` of a loss of moe_mlp's y, for every argument."""

  def loss(*args):
    y = jaxact.moe_mlp(*args, top_k=top_k, implementation=implementation)[0]
    return jnp.sum(y.astype(jnp.float32))

  return jax.value_and_grad(loss, range(5))


def _shapes(t, d, f, e, dtype=jnp.bfloat16):
  shapes = [(t, d), (d, e), (e, d, f), (e, d, f), (e, f, d)]
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def test_the_lowered_step_runs_nine_grouped_kernels_only_when_asked():
  """Three forward products, then the backward's three weight gradients (tgmm) and three products
  with a transposed weight (gmm): nine Triton calls; None lowers none."""
  args = _shapes(T, D, F, E)
  text = lowered_text(_step("pallas"), args, "cuda", "H100")
  assert text.count(f"@{TRITON}(") == 9
  # Under an Auto mesh axis: jax's Explicit sharding inference refuses XLA's ragged_dot.
  with jax.sharding.use_abstract_mesh(support.abstract_mesh(support.A100, auto=True)):
    plain = jax.jit(_step(None)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert TRITON not in plain and "ragged_dot" in plain


# ------------------------------------------------------------------- compiled for the GPUs


# 2048 tokens to their top 8 of 64 experts: 16384 routed rows, D 2048, hidden 1408 (DeepSeek-MoE /
# Qwen-MoE sized experts).
REAL = (2048, 2048, 1408, 64, 8)
# How MoE programs compile for a GPU here (benchmarks/moe.py's GPU_COMPILE): XLA's own sort (CUB's
# radix sort asks for a GPU at compile time) under an Auto mesh axis (jax's Explicit inference
# refuses ragged_dot).
SORT = {"xla_gpu_enable_cub_radix_sort": False}

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*[a-z0-9]+\[([0-9,]*)\]")


def _dims(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def _kernel_flops(name: str, operands: list[list[int]], out: list[int]) -> int:
  """What a grouped kernel computes at most: every (row tile, group) pair it visits, each over
  the whole contraction (the tiles of its default config; masked rows included)."""
  if name == "jaxact_tgmm":
    offsets, (m, k), (_, n) = operands
    step = kernels.default_block_config((m, k, n), jnp.bfloat16).tgmm.step
    return 2 * (math.ceil(m / step) + offsets[0] - 1) * step * k * n
  _, offsets, (m, depth), _ = operands
  rows = kernels.default_block_config((m, depth, out[1]), jnp.bfloat16).gmm.rows
  return 2 * (math.ceil(m / rows) + offsets[0] - 2) * rows * depth * out[1]


def compiled_flops(text: str) -> int:
  """The flops of a compiled GPU program's matmuls: XLA's dots (in its gemm fusions) from their
  shapes, and the grouped kernels' by :func:`_kernel_flops` (a custom call has no cost in XLA's
  analysis, which the deviceless compile does not give anyway)."""
  shapes = {m.group(1): _dims(m.group(2)) for m in map(_SHAPE.match, text.splitlines()) if m}
  total = 0
  for line in text.splitlines():
    found = _SHAPE.match(line)
    if found is None:
      continue
    out = _dims(found.group(2))
    if " dot(" in line:
      lhs = re.search(r" dot\(%([^,\s)]+)", line).group(1)
      contracted = _dims(re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line).group(1))
      total += 2 * math.prod(out) * math.prod(shapes[lhs][i] for i in contracted)
    elif 'custom_call_target="__gpu$xla.gpu.triton"' in line:
      name = re.search(r"(jaxact_[a-z_]+)/pallas_call", line).group(1)
      constraints = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", line).group(1)
      operands = [_dims(d) for d in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", constraints)]
      total += _kernel_flops(name, operands, out)
  return total


# Under `pytest -m exhaustive` (two H100 compiles of the whole step): the default suite checks the
# kernels' spills at this size (test_the_kernels_compile_without_spills_at_the_real_size) and the
# step's nine kernels (test_the_lowered_step_runs_nine_grouped_kernels_only_when_asked).
@needs_gpu_compiler
@pytest.mark.exhaustive
def test_the_real_size_step_compiles_without_spills_at_a_47th_of_ragged_dots_flops():
  """The training step (value and every gradient) at 16384 routed rows, D 2048, hidden 1408, 64
  experts, bf16, compiled for an H100: the kernels' with XLA's register-spill check; its matmul
  flops (the kernels' tile work, masked rows included) under 1/40 of the XLA step's, whose
  ragged_dot is a dense product over every expert (measured 1/64 of the flops for the useful rows;
  ~1/48 counting the kernels' straddled tiles)."""
  t, d, f, e, k = REAL
  flops = {}
  with jax.enable_x64(False):  # as a GPU user's program: 32-bit index arithmetic
    for impl, options in (("pallas", SORT | support.NO_SPILLS), ("xla", SORT)):
      compiled = support.compile_for(
        _step(impl, k), _shapes(t, d, f, e), support.H100, options, auto=True
      )
      flops[impl] = compiled_flops(compiled.as_text())
  routed = t * k
  useful = 9 * 2 * routed * d * f  # nine products of (routed, d) x (d, f)
  assert useful <= flops["pallas"] < 1.6 * useful, flops
  assert flops["xla"] > 0.95 * e * useful, flops
  assert flops["pallas"] < flops["xla"] / 40, flops


_COMPILED = [
  (gpu, dt) for gpu in ("A100", "H100") for dt in (jnp.bfloat16, jnp.float16, jnp.float32)
]


@needs_gpu_compiler
@pytest.mark.parametrize(
  "gpu,dtype",
  representatives(
    _COMPILED, {"A100-bfloat16"}, ids=[f"{g}-{jnp.dtype(d).name}" for g, d in _COMPILED]
  ),
)
def test_the_kernels_compile_without_spills_at_the_real_size(gpu, dtype):
  """gmm, its transposed variant and tgmm at 16384 rows, D 2048, hidden 1408, 64 groups."""
  t, d, f, e, k = REAL
  m = t * k

  def fn(x, w, ct, sizes):
    a = kernels.gmm(x, w, sizes)
    return a, kernels.gmm(ct, w, sizes, transpose_rhs=True), kernels.tgmm(x, ct, sizes)

  s = jax.ShapeDtypeStruct
  args = [s((m, d), dtype), s((e, d, f), dtype), s((m, f), dtype), s((e,), jnp.int32)]
  with jax.enable_x64(False):
    compiled = support.compile_for(fn, args, support.GPUS[gpu], support.NO_SPILLS)
  assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') == 3


@needs_gpu_compiler
@pytest.mark.exhaustive
def test_the_real_size_step_compiles_without_spills_for_an_a100():
  t, d, f, e, k = REAL
  with jax.enable_x64(False):
    options = SORT | support.NO_SPILLS
    support.compile_for(_step("pallas", k), _shapes(t, d, f, e), support.A100, options, auto=True)


# ------------------------------------------------------------------- expert parallelism

SCRIPT = Path(__file__)
EP_T, EP_K = 32, 2
# name: (mesh shape, axis names, specs of x, router, w_gate, w_up, w_down, options); every axis
# kind at once, and a capacity (each device's rows past its groups: the dropped and unreceived).
EP_CASES = {
  "ep_data_tensor": CASES["ep_data_tensor"],
  "ep_capacity": (*CASES["ep_data"][:3], {"capacity_factor": 1.0}),
}


def ep_case(name: str) -> None:
  """moe_mlp's pallas path against its XLA path under expert parallelism on 8 CPU devices,
  float32: the largest difference (relative to each array's largest entry), and whether the
  traced step holds the kernels."""
  shape, names, specs, options = EP_CASES[name]
  rng = np.random.default_rng(3)
  shapes = [(EP_T, D), (D, 8), (8, D, F), (8, D, F), (8, F, D)]
  scales = [1.0, 1.0, D**-0.5, D**-0.5, F**-0.5]
  arrays = [_normal(rng, s, jnp.float32, c) for s, c in zip(shapes, scales, strict=True)]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
  results = {}
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs, strict=True)]
    for impl in ("pallas", "xla"):
      results[impl] = _value_and_grads(impl, args, top_k=EP_K, **options)
    step = lambda *a: jaxact.moe_mlp(*a, top_k=EP_K, implementation="pallas", **options)[0]
    kernels_traced = "pallas_call" in str(jax.make_jaxpr(step)(*args))
  pairs = zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"]), strict=True)
  err = max(
    float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
    / max(1e-30, float(np.max(np.abs(np.asarray(w, np.float64)))))
    for g, w in pairs
  )
  out = dict(case=name, devices=jax.device_count(), err=err, kernels_traced=kernels_traced)
  print(json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def ep_results(request, tmp_path_factory):
  names = eight_devices.selected_cases(request, __name__, {})
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


# A subprocess of 8 devices costs seconds: under `pytest -m exhaustive`; the default suite lowers
# the expert-parallel step for CUDA (below).
@pytest.mark.exhaustive
@pytest.mark.parametrize("name", list(EP_CASES))
def test_expert_parallel_runs_the_kernels_per_device_as_xla(ep_results, name):
  r = eight_devices.get(ep_results, name, SCRIPT)
  assert r["kernels_traced"] and r["err"] < 2e-5, r


def test_expert_parallel_lowers_the_nine_kernels_inside_the_shard_maps():
  """On a 2x2x2 (data, expert, model) mesh of H100s: every grouped product a Triton call inside
  the experts' shard_map regions."""
  device = AbstractDevice(device_kind=support.H100, num_cores=None, platform="cuda")
  names = ("data", "expert", "model")
  mesh = AbstractMesh((2, 2, 2), names, (AxisType.Explicit,) * 3, abstract_device=device)
  specs = EP_CASES["ep_data_tensor"][2]
  shapes = [(EP_T, D), (D, 8), (8, D, F), (8, D, F), (8, F, D)]
  with jax.sharding.use_abstract_mesh(mesh):
    args = [
      jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
      for s, p in zip(shapes, specs, strict=True)
    ]
    text = jax.jit(_step("pallas")).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(f"@{TRITON}(") == 9
  regions = text.split("sdy.manual_computation")[1:]
  assert sum(r.count(f"@{TRITON}(") for r in regions) == 9


if __name__ == "__main__":
  cases = {n: (lambda n=n: ep_case(n)) for n in EP_CASES}
  eight_devices.run_cases(cases, sys.argv[1:])
