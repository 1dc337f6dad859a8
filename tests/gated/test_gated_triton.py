"""The gated Triton kernels (``pallas_kernels.gated_triton``) behind ``gated_dense`` /
``gated_mlp``.

On CPU the kernels run in Pallas interpret mode: ``implementation="pallas"`` against the XLA path
(values and the gradients of every argument), the kernels against their pure-jnp references, the
zero-times-infinity guard, and the calls the kernels decline. For CUDA: the dispatch under abstract
H100 and A100 meshes, the lowered step's Triton calls, and the kernels compiled for both GPUs
through XLA's GPU compiler with its register-spill check (the issue's layer, bf16 (8192, 4096,
11008), by default; every activation family and dtype under ``-m exhaustive``).
"""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxact
import support
from jaxact._src import docs
from jaxact._src.activations import api as activations
from jaxact._src.activations.resolve import Act
from jaxact._src.core import dispatch, pallas_sharding
from jaxact._src.gated import rules
from jaxact._src.gated.plan import GatedPlan
from jaxact._src.gated.vjp import gate_cotangents, hidden
from kernel_cases import MOSAIC, TRITON, cuda_mesh, lowered_text, needs_gpu_compiler
from pallas_kernels import gated_triton as kernels

from cases import representatives

# As tests/fused/test_dense_triton.py: summation order, and in bfloat16 the bias added before a and
# b are rounded (XLA rounds the matmul first), which moves a by an ulp, and da, db are rounded
# before the
# backward's matmuls. The weight gradients sum such differences over the rows, so the absolute
# part of the tolerance is a fraction of each array's largest entry.
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (3e-2, 1e-2)}  # rtol, atol / max |want|


def assert_close(got, want, dtype):
  rtol, scale = TOL[dtype]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=rtol, atol=scale * float(np.max(np.abs(w))))


ACTIVATIONS = {
  "silu": "silu",  # input residual: act'(a) from a
  "gelu": "gelu",  # tanh form
  "gelu_exact": functools.partial(jaxact.gelu, approximate=False),  # erfc: not for Triton
  "relu": "relu",  # output residual: act'(a) from act(a), kinked
  "identity": "identity",  # no derivative function: the bilinear unit
}


def operands(shape, dtype, seed=0, bias=True):
  """x (batch..., K), w_gate and w_up (K, F), w_down (F, D), b_gate, b_up (F,), b_down (D,):
  scaled so that a, b and y are of unit size. Drawn by numpy: no computation to compile."""
  *batch, k, f, d = shape
  rng = np.random.default_rng(seed)
  normal = lambda s, scale=1.0: rng.standard_normal(s, np.float32) * np.float32(scale)
  vals = [
    normal((*batch, k)),
    normal((k, f), k**-0.5),
    normal((k, f), k**-0.5),
    normal((f, d), f**-0.5),
    *((normal((f,)), normal((f,)), normal((d,))) if bias else (None,) * 3),
  ]
  return tuple(None if v is None else jnp.asarray(v, dtype) for v in vals)


def value_and_grads(op, impl, activation, args):
  """The op's value and the gradients of every array argument for a fixed random cotangent."""
  present = [i for i, v in enumerate(args) if v is not None]

  @jax.jit
  def f(*arrays):
    def call(*arrays):
      full = list(args)
      for i, v in zip(present, arrays, strict=True):
        full[i] = v
      x, wg, wu, wd, bg, bu, bd = full
      if op == "gated_dense":
        return jaxact.gated_dense(x, wg, wu, bg, bu, activation=activation, implementation=impl)
      return jaxact.gated_mlp(x, wg, wu, wd, bg, bu, bd, activation=activation, implementation=impl)

    y, pull = jax.vjp(call, *arrays)
    g = jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)).astype(y.dtype)
    return y, pull(g)

  return f(*(args[i] for i in present))


# ------------------------------------------------------------------- interpret mode, values

_CASES = [
  (op, name, dt)
  for op in ("gated_mlp", "gated_dense")
  for name in ("silu", "gelu", "relu", "identity")
  for dt in (jnp.float32, jnp.bfloat16)
]


@pytest.mark.parametrize(
  "op,name,dtype",
  representatives(
    _CASES,
    {"gated_mlp-silu-float32", "gated_dense-gelu-bfloat16"},
    ids=[f"{op}-{n}-{jnp.dtype(d).name}" for op, n, d in _CASES],
  ),
)
def test_pallas_matches_xla(op, name, dtype):
  # Ragged in every dimension (no tile divides 37, 19, 23 or 11), with batch dimensions for the
  # bfloat16 cases.
  shape = (37, 19, 23, 11) if dtype == jnp.float32 else (3, 13, 19, 23, 11)
  args = operands(shape, dtype, seed=1)
  got = value_and_grads(op, "pallas", ACTIVATIONS[name], args)
  want = value_and_grads(op, "xla", ACTIVATIONS[name], args)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_tree_all_finite(got)
  assert_close(got, want, dtype)


@pytest.mark.exhaustive
@pytest.mark.parametrize("op", ["gated_mlp", "gated_dense"])
def test_pallas_matches_xla_without_biases_over_tiles(op):
  args = operands((130, 70, 140, 9), jnp.float32, seed=2, bias=False)  # several tiles each way
  got = value_and_grads(op, "pallas", "silu", args)
  want = value_and_grads(op, "xla", "silu", args)
  assert_close(got, want, jnp.float32)


# ------------------------------------------------------------------- the kernels themselves


def _epilogue(name):
  if name == "gelu_exact":
    return support.epilogue("gelu", approximate=False)
  return support.epilogue(name)


def _plan(name) -> GatedPlan:
  """The XLA path's plan for a spec activation with Python-number parameters."""
  spec = jaxact.get_spec("gelu" if name == "gelu_exact" else name)
  params = {p.name: p.default for p in spec.params} | (
    {"approximate": False} if name == "gelu_exact" else {}
  )
  z = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  rule, dynamic = activations._split_params(spec, z, params)
  assert not dynamic
  f32 = np.dtype(jnp.float32)
  return GatedPlan(Act(rule=rule), None, f32, f32, True, True, True)


@pytest.mark.parametrize(
  "name", representatives(["gelu_exact", "silu", "relu", "identity"], {"gelu_exact"})
)
def test_kernels_against_references_and_the_xla_formulas(name):
  """The forward against gated_dense_reference, the backward pass against autodiff of fn(a) * b
  (gated_bwd_reference) and against the XLA path's own formulas, in float32: exact gelu too,
  which the kernels compute in interpret mode though Pallas Triton cannot lower it for a GPU."""
  ep = _epilogue(name)
  plan = _plan(name)

  @jax.jit
  def run(x, wg, wu, bg, bu, gh):
    h, a, b = kernels.gated_fwd(x, wg, wu, bg, bu, epilogue=ep, precision="highest", interpret=True)
    ref = kernels.gated_dense_reference(x, wg, wu, bg, bu, epilogue=ep, precision="highest")
    got = kernels.gated_bwd(gh, a, b, epilogue=ep, with_h=True, interpret=True)
    da, db, _ = gate_cotangents(plan, a, b, gh, ())
    xla = (da, db, hidden(plan, a, b, ()))
    return (h, ref), (got, kernels.gated_bwd_reference(gh, a, b, epilogue=ep), xla)

  x, wg, wu, _, bg, bu, _ = operands((21, 33, 40, 1), jnp.float32, seed=3)
  gh = jnp.asarray(np.random.default_rng(4).standard_normal((21, 40), np.float32))
  (h, ref), (got, autodiff, xla) = run(x, wg, wu, bg, bu, gh)
  chex.assert_trees_all_close(h, ref, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(got, autodiff, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(got, xla, atol=1e-6, rtol=1e-6)


@pytest.mark.exhaustive
def test_standalone_custom_vjp_against_autodiff_of_the_reference():
  ep = _epilogue("silu")
  x, wg, wu, _, bg, bu, _ = operands((2, 9, 33, 17, 1), jnp.float32, seed=5)
  run = functools.partial(kernels.gated_dense, epilogue=ep, precision="highest", interpret=True)
  ref = functools.partial(kernels.gated_dense_reference, epilogue=ep, precision="highest")
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  chex.assert_trees_all_close(run(x, wg, wu, bg, bu), ref(x, wg, wu, bg, bu), rtol=1e-5)
  chex.assert_trees_all_close(
    jax.grad(loss(run), range(5))(x, wg, wu, bg, bu),
    jax.grad(loss(ref), range(5))(x, wg, wu, bg, bu),
    atol=1e-5,
    rtol=1e-5,
  )


def test_zero_times_infinity_is_zero_and_nan_stays_nan():
  """relu(a) = 0 beside an overflowed b = inf: h, da and db are 0 (the XLA path's safe products),
  while a NaN cotangent still gives NaN."""
  ep = _epilogue("relu")
  a = jnp.array([[-1.0, -2.0, 3.0, 1.0]], jnp.float32)
  b = jnp.array([[jnp.inf, -jnp.inf, 2.0, 0.0]], jnp.float32)
  gh = jnp.array([[1.0, 0.0, jnp.nan, jnp.inf]], jnp.float32)
  da, db, h = kernels.gated_bwd(gh, a, b, epilogue=ep, with_h=True, interpret=True)
  np.testing.assert_array_equal(h, [[0.0, 0.0, 6.0, 0.0]])
  np.testing.assert_array_equal(da, [[0.0, 0.0, np.nan, 0.0]])
  np.testing.assert_array_equal(db, [[0.0, 0.0, np.nan, np.inf]])
  plan = _plan("relu")
  xla_da, xla_db, _ = gate_cotangents(plan, a, b, gh, ())
  chex.assert_trees_all_equal((da, db, h), (xla_da, xla_db, hidden(plan, a, b, ())))


# -------------------------------------------------------------------------- the dispatch


def test_what_pallas_declines_raises_with_the_reason():
  x, wg, wu, wd, *_ = operands((4, 3, 5, 2), jnp.float32)
  gated = functools.partial(jaxact.gated_dense, x, wg, wu, implementation="pallas")
  with pytest.raises(NotImplementedError, match=r"'pallas' .* a plain callable"):
    gated(activation=lambda z: z * jax.nn.sigmoid(z))
  slopes = jnp.full((5,), 0.1, jnp.float32)
  leaky = functools.partial(jaxact.leaky_relu, negative_slope=slopes)
  with pytest.raises(NotImplementedError, match=r"parameters given as arrays \(negative_slope\)"):
    gated(activation=leaky)
  with pytest.raises(NotImplementedError, match=r"gelu computes erfc, which Pallas Triton"):
    gated(activation=ACTIVATIONS["gelu_exact"])
  with pytest.raises(NotImplementedError, match=r"x dtype float64"):
    jaxact.gated_mlp(
      *(v.astype(jnp.float64) for v in (x, wg, wu, wd)), activation="relu", implementation="pallas"
    )
  with pytest.raises(NotImplementedError, match=r"'mosaic' .* operand dtype float32"):
    jaxact.gated_dense(x, wg, wu, implementation="mosaic")
  xb, wgb, wub = (v.astype(jnp.bfloat16) for v in (x, wg, wu))
  with pytest.raises(NotImplementedError, match=r"'mosaic' .* M=4 is not a multiple of 128"):
    jaxact.gated_dense(xb, wgb, wub, implementation="mosaic")
  # None falls back to XLA, silently, for the same calls.
  jax.eval_shape(lambda: jaxact.gated_dense(x, wg, wu, activation=leaky))
  jax.eval_shape(lambda: jaxact.gated_dense(x, wg, wu, activation=ACTIVATIONS["gelu_exact"]))


def test_none_keeps_xla_on_every_target_until_a_gpu_measurement_says_otherwise():
  plan = _plan("silu")
  x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
  for kind in ("H100", "A100"):
    with jax.sharding.use_abstract_mesh(cuda_mesh(kind)):
      auto = rules.decide("gated_mlp", None, plan, x, w, w)
      named = rules.decide("gated_mlp", "pallas", plan, x, w, w)
    assert (auto.forward, auto.backward, auto.forced) == ("xla", "xla", False)
    assert "no GPU measurement" in auto.declined
    assert (named.forward, named.backward, named.forced) == ("triton", "triton", True)
  assert rules.decide("gated_mlp", "xla", plan, x, w, w) == dispatch.Decision()
  for rule in rules.GATED_AUTO_RULES:
    assert rule.where in docs.dispatch_table()


def _mlp_step(implementation, activation="gelu"):
  def loss(*args):
    y = jaxact.gated_mlp(*args, activation=activation, implementation=implementation)
    return jnp.sum(y.astype(jnp.float32))

  return jax.value_and_grad(loss, range(7))


def _mlp_shapes(m, k, f, dtype=jnp.bfloat16):
  shapes = ((m, k), (k, f), (k, f), (f, k), (f,), (f,), (k,))
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def _triton_results(text: str) -> list[str]:
  """What each Triton call of a lowered module returns."""
  return [line.rsplit(") -> ", 1)[1] for line in text.splitlines() if f"@{TRITON}(" in line]


def test_the_lowered_step_runs_the_two_kernels_only_when_asked():
  args = _mlp_shapes(64, 32, 48)
  text = lowered_text(_mlp_step("pallas"), args, "cuda", "H100")
  hidden = "tensor<64x48xbf16>"
  # The projection writes h, a and b; the backward pass da, db and h.
  assert _triton_results(text) == [f"({hidden}, {hidden}, {hidden})"] * 2
  # Without a gradient to come, the projection writes h alone.
  infer = lambda *a: jaxact.gated_mlp(*a, implementation="pallas")
  assert _triton_results(lowered_text(infer, args[:4], "cuda", "A100")) == [hidden]
  assert TRITON not in lowered_text(_mlp_step(None), args, "cuda", "A100")


def test_per_shard_kernels_lower_for_cuda_without_collectives():
  """The gated kernel calls' wrappers on a 2x4 ("data", "model") mesh of A100s: x's rows and the
  weights' columns split (the forward), any split of gh, a and b (the backward pass); each kernel
  runs once in a shard_map region on its block, and nothing is gathered or summed."""
  device = AbstractDevice(device_kind=support.A100, num_cores=None, platform="cuda")
  mesh = AbstractMesh((2, 4), ("data", "model"), (AxisType.Explicit,) * 2, abstract_device=device)
  ep = _epilogue("silu")

  def f(x, wg, wu, bg, bu, gh):
    pattern = pallas_sharding.gated_pattern(x, wg, wu)
    h, a, b = pallas_sharding.gated_forward(kernels.gated_fwd, pattern)(
      x, wg, wu, bg, bu, epilogue=ep
    )
    return h, pallas_sharding.pointwise(kernels.gated_bwd)(gh, a, b, epilogue=ep, with_h=True)

  specs = [P("data", None), P(None, "model"), P(None, "model"), P("model"), P(), P("data", "model")]
  shapes = [(64, 32), (32, 48), (32, 48), (48,), (48,), (64, 48)]
  with jax.sharding.use_abstract_mesh(mesh):
    args = [
      jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
      for s, p in zip(shapes, specs, strict=True)
    ]
    traced = jax.jit(f).trace(*args)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert all(o.sharding.spec == P("data", "model") for o in jax.tree.leaves(traced.out_info))
  assert text.count("sdy.manual_computation") == 2
  assert text.count(f"custom_call @{TRITON}(") == 2
  assert "tensor<32x12xbf16>" in text  # each device's block of h, a, b
  assert "all_gather" not in text and "all_reduce" not in text


# ------------------------------------------------------------------- compiled for the GPUs


ISSUE = (8192, 4096, 11008)  # tokens, model width, hidden width (Llama-7B's MLP)


def _kernels(name):
  """The forward kernel and the backward pass (with h, as gated_mlp runs it) in one program."""
  ep = _epilogue(name)

  def f(x, wg, wu, bg, bu, gh):
    h, a, b = kernels.gated_fwd(x, wg, wu, bg, bu, epilogue=ep)
    return h, kernels.gated_bwd(gh, a, b, epilogue=ep, with_h=True)

  return f


def _kernel_shapes(m, k, f, dtype):
  shapes = ((m, k), (k, f), (k, f), (f,), (f,), (m, f))
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


_COMPILED = [
  (gpu, name, dt)
  for gpu in ("A100", "H100")
  for name in ("gelu", "silu", "relu", "squareplus", "mish", "selu")
  for dt in (jnp.bfloat16, jnp.float16, jnp.float32)
]


@needs_gpu_compiler
@pytest.mark.parametrize(
  "gpu,name,dtype",
  representatives(
    _COMPILED,
    {"A100-gelu-bfloat16"},  # the A100 holds fewer registers a thread for the two accumulators
    ids=[f"{g}-{n}-{jnp.dtype(d).name}" for g, n, d in _COMPILED],
  ),
)
def test_the_kernels_compile_without_spills_at_the_issue_layer(gpu, name, dtype):
  with jax.enable_x64(False):  # as a GPU user's program: 32-bit index arithmetic
    fn, args = _kernels(name), _kernel_shapes(*ISSUE, dtype)
    # NO_SPILLS: XLA fails the compilation of a kernel ptxas spilled registers for.
    compiled = support.compile_for(fn, args, support.GPUS[gpu], support.NO_SPILLS)
  assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') == 2


_STEPS = [(gpu, shape) for gpu in ("A100", "H100") for shape in ((200, 40, 300), ISSUE)]


@needs_gpu_compiler
@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "gpu,shape", _STEPS, ids=[f"{g}-{'x'.join(map(str, s))}" for g, s in _STEPS]
)
def test_the_gated_mlp_step_compiles_without_spills(gpu, shape):
  """The whole training step of gated_mlp (XLA's matmuls around the kernels), ragged and at the
  issue's layer, bfloat16 and (ragged) float32."""
  with jax.enable_x64(False):
    for dt in (jnp.bfloat16, jnp.float32) if shape != ISSUE else (jnp.bfloat16,):
      assert not support.spills(_mlp_step("pallas"), _mlp_shapes(*shape, dt), support.GPUS[gpu])


def _probes() -> dict:
  """One (shape, dtype) per configuration the block config returns: every size class of every
  dimension (<= 16, <= 64, > 64 and ragged), every dtype."""
  probes = [
    (shape, dt)
    for shape in itertools.product((3, 40, 200), repeat=3)
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
  ]
  return {kernels.default_block_config(s, dt): (s, dt) for s, dt in probes}


@needs_gpu_compiler
@pytest.mark.exhaustive
@pytest.mark.parametrize("gpu", ["A100", "H100"])
def test_every_block_config_compiles_without_spills(gpu):
  """The forward and the backward pass at every tiling, with gelu's epilogue."""
  probes = _probes()
  assert len(probes) >= 20
  with jax.enable_x64(False):
    for (m, k, f), dt in probes.values():
      args = _kernel_shapes(m, k, f, dt)
      assert not support.spills(_kernels("gelu"), args, support.GPUS[gpu]), ((m, k, f), dt)


@needs_gpu_compiler
@pytest.mark.exhaustive
@pytest.mark.parametrize("op", ["gated_mlp", "gated_dense"])
def test_the_kernels_keep_the_xla_paths_memory_in_the_compiled_step(op):
  """One layer's step from a cotangent at the issue's layer, as XLA allocates it for an H100: the
  kernels' temp is the XLA path's (a and b kept, the backward pass's outputs over its inputs), up to
  a few bytes of scratch."""
  m, k, f = ISSUE

  def temp(implementation):
    def step(x, wg, wu, wd, g):
      if op == "gated_mlp":
        call = lambda *p: jaxact.gated_mlp(*p, implementation=implementation)
        y, pull = jax.vjp(call, x, wg, wu, wd)
      else:
        call = lambda *p: jaxact.gated_dense(*p, implementation=implementation)
        y, pull = jax.vjp(call, x, wg, wu)
      return (y, *pull(g))

    out = (m, k) if op == "gated_mlp" else (m, f)
    shapes = [(m, k), (k, f), (k, f), (f, k), out]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    with jax.enable_x64(False):
      compiled = support.compile_for(step, args, support.H100)
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp("pallas") <= temp("xla") + 2**20  # beside 3 hidden-sized arrays (516 MiB)


# ------------------------------------------------------------------- the Mosaic GPU forward


def _mosaic_step(name):
  def step(x, wg, wu, wd):
    loss = lambda *a: jnp.sum(
      jaxact.gated_mlp(*a, activation=name, implementation="mosaic").astype(jnp.float32) ** 2
    )
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)

  return step


def test_mosaic_forward_and_triton_backward_are_what_a_hopper_step_lowers_to():
  shapes = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (128, 256), (128, 256), (256, 128))
  ]
  text = lowered_text(_mosaic_step("silu"), shapes, "cuda", "H100")
  # The gated forward (a, b and h in one kernel), then the one-pass (da, db, h) backward.
  assert text.count(f"custom_call @{MOSAIC}(") == 1
  assert text.count(f"custom_call @{TRITON}(") == 1


@pytest.mark.exhaustive
def test_mosaic_forward_matches_the_xla_path_in_the_interpreter():
  x, wg, wu, wd, *_ = operands((128, 64, 128, 64), jnp.bfloat16)
  got = jax.jit(_mosaic_step("gelu"))(x, wg, wu, wd)

  def xla(x, wg, wu, wd):
    loss = lambda *a: jnp.sum(
      jaxact.gated_mlp(*a, activation="gelu", implementation="xla").astype(jnp.float32) ** 2
    )
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)

  want = jax.jit(xla)(x, wg, wu, wd)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert_close(g, w, jnp.bfloat16)
