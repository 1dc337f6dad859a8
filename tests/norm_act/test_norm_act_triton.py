"""The normalize-and-activate Triton kernels (``pallas_kernels.norm_act_triton``) behind
``batch_norm_act`` / ``group_norm_act``.

On CPU the kernels run in Pallas interpret mode: ``implementation="pallas"`` against the XLA path
(values and the gradients of x, scale, bias and, by given statistics, mean and var; the batch
statistics' own cotangents included), ragged sizes and zero scales; the kernels against their
pure-jnp references over several tiles; the calls the kernels decline. For CUDA: the dispatch under
abstract H100 and A100 meshes, the lowered step's Triton calls, and the kernels compiled for both
GPUs through XLA's GPU compiler with its register-spill check at a ResNet and a U-Net layer.
"""

from __future__ import annotations

import dataclasses
import functools

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
from jaxact._src.norm_act import api, rules
from jaxact._src.norm_act import reference as R
from kernel_cases import TRITON, cuda_mesh, lowered_text, needs_gpu_compiler
from pallas_kernels import norm_act_triton as kernels

from cases import assert_trees_close, representatives, value_and_grads_or_skip

# Summation order only (the kernels sum a tile's rows, then the tiles); in bfloat16 the outputs
# are rounded from the same float32 values, so an ulp where those differ.
TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (2e-2, 1e-2)}  # rtol, atol / max |want|

ACTIVATIONS = {
  "relu": "relu",  # an output-residual activation: its derivative from the pre-activation
  "silu": "silu",
  "gelu": "gelu",
  "leaky_relu": functools.partial(jaxact.leaky_relu, negative_slope=0.2),  # a parameter
}


def assert_close(got, want, dtype):
  rtol, scale = TOL[dtype]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, w, rtol=rtol, atol=scale * float(np.max(np.abs(w))))


def operands(shape, dtype, seed=0):
  """x (channels last, mean 0.5, deviation 2), scale with every fourth channel 0, bias."""
  rng = np.random.default_rng(seed)
  c = shape[-1]
  x = rng.standard_normal(shape) * 2 + 0.5
  scale = rng.standard_normal(c)
  scale[::4] = 0.0
  return tuple(jnp.asarray(v, dtype) for v in (x, scale, rng.standard_normal(c)))


def _op(kind, activation, implementation):
  """``kind``'s op as a function of (x, scale, bias[, mean, var]) returning every output."""
  if kind == "group":
    return lambda x, s, b: jaxact.group_norm_act(
      x, s, b, activation=activation, num_groups=3, implementation=implementation
    )
  if kind == "infer":
    return lambda x, s, b, m, v: jaxact.batch_norm_act(
      x, s, b, activation=activation, mean=m, var=v, implementation=implementation
    )[0]
  return lambda x, s, b: jaxact.batch_norm_act(
    x, s, b, activation=activation, implementation=implementation
  )


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def value_and_grads(kind, name, implementation, *args):
  """The outputs and the gradients of every argument for fixed cotangents (the batch statistics'
  nonzero too)."""
  y, pull = jax.vjp(_op(kind, ACTIVATIONS[name], implementation), *args)
  cts = jax.tree.map(
    lambda a: jnp.sin(jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape) + 1).astype(a.dtype),
    y,
  )
  return y, pull(cts)


def _args(kind, dtype):
  # Ragged everywhere: 105 rows of 21 channels (batch norm), 3 examples of 35 rows of 24
  # channels in 3 groups (group norm); no tile divides either.
  shape = (3, 5, 7, 24) if kind == "group" else (3, 5, 7, 21)
  x, scale, bias = operands(shape, dtype, seed=1)
  if kind != "infer":
    return x, scale, bias
  c = shape[-1]
  return x, scale, bias, jnp.linspace(-0.5, 0.5, c), jnp.linspace(0.5, 3.0, c)


_CASES = [
  (kind, name, dt)
  for kind in ("batch", "infer", "group")
  for name in ACTIVATIONS
  for dt in (jnp.float32, jnp.bfloat16)
]


@pytest.mark.parametrize(
  "kind,name,dtype",
  representatives(
    _CASES,
    {
      "batch-relu-bfloat16",
      "infer-leaky_relu-float32",
      "group-silu-bfloat16",
    },
    ids=[f"{k}-{n}-{jnp.dtype(d).name}" for k, n, d in _CASES],
  ),
)
def test_pallas_matches_xla(kind, name, dtype):
  args = _args(kind, dtype)
  got = value_and_grads(kind, name, "pallas", *args)
  want = value_and_grads(kind, name, "xla", *args)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  assert_close(got, want, dtype)


_BACKENDS = [(i, k) for i in (None, *rules.FAMILY.implementations) for k in ("batch", "group")]


# XLA's path meets the composition in test_norm_act.py already: the kernels by default, and the
# kernel the family lacks (a skip with its reason).
@pytest.mark.parametrize(
  "implementation,kind",
  representatives(
    _BACKENDS, {"pallas-group", "mosaic-batch"}, ids=[f"{i or 'none'}-{k}" for i, k in _BACKENDS]
  ),
)
def test_every_backend_equals_autodiff_of_the_composition(implementation, kind):
  """Every implementation the family declares (a missing kernel skips with its reason) against
  autodiff of the plain composition (``jaxact/_src/norm_act/reference.py``), float32, silu."""
  x, scale, bias = operands((2, 3, 5, 12), jnp.float32, seed=3)
  if kind == "group":
    ours = lambda x, s, b: jaxact.group_norm_act(
      x, s, b, activation="silu", num_groups=3, implementation=implementation
    )
    plain = lambda x, s, b: R.group_norm_act(x, s, b, jax.nn.silu, num_groups=3)
  else:
    ours = lambda x, s, b: jaxact.batch_norm_act(
      x, s, b, activation="silu", implementation=implementation
    )[0]
    plain = lambda x, s, b: R.batch_norm_act(x, s, b, jax.nn.silu)[0]
  got = value_and_grads_or_skip(jax.jit(ours), x, scale, bias)
  assert_trees_close(got, value_and_grads_or_skip(jax.jit(plain), x, scale, bias), 2e-5)


# ------------------------------------------------------------------- the kernels themselves


def _epilogue(name):
  """The kernels' epilogue as the rules build it: the derivative from the pre-activation."""
  ep = support.epilogue(name)
  if ep.residual != "output":
    return ep
  spec = jaxact.get_spec(name)
  return dataclasses.replace(ep, derivative=spec.derivative_from_input, residual="input")


@pytest.mark.parametrize("name", representatives(["silu", "relu", "identity"], {"silu"}))
def test_kernels_against_their_references_over_several_tiles(name):
  """Tiles of 8 x 16 over 3 samples of 37 rows of 40 channels: ragged tiles in both directions,
  two row tiles a program in the sums pass (the last past the sample), float32 and a rounded
  bfloat16 dz, x's and dx's power-of-two scales."""
  ep = _epilogue(name)
  tiles = kernels.NormActTiles(rows=8, cols=16, num_warps=4, steps=2)
  rng = np.random.default_rng(2)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  x, g = normal(3, 37, 40), normal(3, 37, 40)
  mean, r = normal(3, 40), jnp.abs(normal(3, 40)) + 0.5
  scale, bias = normal(40).at[::4].set(0.0), normal(40)
  coefficients = (normal(3, 40), normal(3, 40), normal(3, 40))
  powers = jnp.asarray(2.0 ** rng.integers(-20, 21, (3, 40)), jnp.float32)

  @jax.jit
  def run(x, g, mean, r, scale, bias, coefficients):
    fwd = kernels.norm_act_fwd(
      x, mean, r, scale, bias, epilogue=ep, x_scale=powers, block_config=tiles, interpret=True
    )
    x_hat = fwd[1]
    bwd = lambda **kw: kernels.norm_act_bwd(
      x_hat, g, scale, bias, epilogue=ep, block_config=tiles, interpret=True, **kw
    )
    ref = lambda **kw: kernels.norm_act_bwd_reference(x_hat, g, scale, bias, epilogue=ep, **kw)
    got = (fwd, bwd(), bwd(sums=False, dx=coefficients, dx_scale=powers))
    got += (bwd(dz_dtype=jnp.bfloat16),)
    want = (
      kernels.norm_act_reference(x, mean, r, scale, bias, epilogue=ep, x_scale=powers),
      ref(),
      ref(dx=coefficients, dx_scale=powers),
      ref(dz_dtype=jnp.bfloat16),
    )
    return got, want

  got, want = run(x, g, mean, r, scale, bias, coefficients)
  assert got[2][1] is None  # no sums asked for
  want = (want[0], want[1][1], want[2][0], want[3][1])
  got = (got[0], got[1][1], got[2][0], got[3][1])
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_block_config_keeps_programs_and_walks_rows_in_the_sums_pass():
  resnet = kernels.default_tiles((1, 32 * 56 * 56, 256), jnp.bfloat16)
  unet = kernels.default_tiles((32, 64 * 64, 256), jnp.bfloat16)
  assert (resnet.rows, resnet.cols, resnet.num_warps) == (16, 256, 4)
  assert resnet.steps > 1 and unet.steps > 1
  for (samples, rows, _), t in (((1, 32 * 56 * 56, 256), resnet), ((32, 64 * 64, 256), unet)):
    assert samples * -(-rows // (t.rows * t.steps)) >= 1024
  small = kernels.default_tiles((2, 3, 5), jnp.float32)
  assert (small.rows, small.cols, small.num_warps, small.steps) == (4, 8, 8, 1)


# -------------------------------------------------------------------------- the dispatch


def test_what_pallas_declines_raises_with_the_reason():
  x, scale, bias = operands((4, 3, 8), jnp.float32)
  bn = functools.partial(jaxact.batch_norm_act, x, scale, bias, implementation="pallas")
  with pytest.raises(NotImplementedError, match=r"'pallas' .* a plain callable"):
    bn(activation=lambda z: z * jax.nn.sigmoid(z))
  slopes = jnp.full((8,), 0.1, jnp.float32)
  with pytest.raises(NotImplementedError, match=r"parameters given as arrays \(negative_slope\)"):
    bn(activation=functools.partial(jaxact.leaky_relu, negative_slope=slopes))
  exact = functools.partial(jaxact.gelu, approximate=False)
  with pytest.raises(NotImplementedError, match=r"gelu computes erfc, which Pallas Triton"):
    bn(activation=exact)
  with pytest.raises(NotImplementedError, match=r"axes \(1,\) of a rank-3 x; .* channels-last"):
    jaxact.batch_norm_act(x, activation="relu", axis=1, implementation="pallas")
  with pytest.raises(NotImplementedError, match=r"axis_name='batch': statistics averaged"):
    bn(activation="relu", axis_name="batch")
  with pytest.raises(NotImplementedError, match=r"`reduction_axes`\); the kernels take a stat"):
    jaxact.group_norm_act(
      x, activation="relu", num_groups=2, reduction_axes=(2,), implementation="pallas"
    )
  with pytest.raises(NotImplementedError, match=r"'mosaic' has no kernel: .* use implementation"):
    bn(activation="relu", implementation="mosaic")
  with pytest.raises(ValueError, match=r"`implementation` 'triton' is not known; choose one of"):
    bn(activation="relu", implementation="triton")
  with jax.enable_x64(True):
    x64 = jnp.asarray(np.asarray(x), jnp.float64)
    with pytest.raises(NotImplementedError, match=r"x dtype float64"):
      jaxact.group_norm_act(x64, activation="relu", num_groups=2, implementation="pallas")
  # None falls back to XLA, silently, for the same calls.
  jax.eval_shape(lambda: jaxact.batch_norm_act(x, activation=exact))
  jax.eval_shape(lambda: jaxact.batch_norm_act(x, activation="relu", axis=1))


def test_none_keeps_xla_on_every_target_until_a_gpu_measures_the_kernels():
  x, scale, bias = operands((8, 4, 4, 64), jnp.bfloat16)
  for kind in ("H100", "A100"):
    with jax.sharding.use_abstract_mesh(cuda_mesh(kind)):
      plan = _plan_of(x, scale, bias)
      auto = rules.decide("batch_norm_act", None, plan, x, scale, bias)
      named = rules.decide("batch_norm_act", "pallas", plan, x, scale, bias)
    assert (auto.forward, auto.backward, auto.forced) == ("xla", "xla", False)
    assert "unmeasured on a GPU (issue 43)" in auto.declined
    assert (named.forward, named.backward, named.forced) == ("triton", "triton", True)
  for rule in rules.NORM_ACT_AUTO_RULES:
    assert rule.where in docs.dispatch_table()


def _plan_of(x, scale, bias):
  """The plan batch_norm_act builds for x (channels last), before its decision."""
  last = x.ndim - 1
  fields = {"epsilon": 1e-5, "axis_name": None, "axis_index_groups": None}
  axes = {"groups": 0, "axes": tuple(range(last)), "feature_axes": (last,)}
  return api._plan("batch_norm_act", x, "silu", None, **axes, **fields)[0]


def _step(kind, implementation, activation):
  def loss(x, scale, bias):
    if kind == "group":
      y = jaxact.group_norm_act(
        x, scale, bias, activation=activation, num_groups=32, implementation=implementation
      )
    else:
      y = jaxact.batch_norm_act(
        x, scale, bias, activation=activation, implementation=implementation
      )[0]
    return jnp.sum(y.astype(jnp.float32))

  return jax.value_and_grad(loss, (0, 1, 2))


def _shapes(shape, dtype=jnp.bfloat16):
  c = shape[-1]
  return [jax.ShapeDtypeStruct(shape, dtype), *(jax.ShapeDtypeStruct((c,), jnp.float32),) * 2]


def test_the_lowered_step_runs_the_three_kernels_only_when_asked():
  args = _shapes((4, 6, 6, 64))
  text = lowered_text(_step("group", "pallas", "silu"), args, "cuda", "H100")
  # The forward (y and x_hat), the sums pass, the dx pass.
  assert text.count(f"custom_call @{TRITON}(") == 3
  assert TRITON not in lowered_text(_step("batch", None, "relu"), args, "cuda", "A100")


def test_sharded_inputs_are_declined_and_none_stays_on_xla():
  device = AbstractDevice(device_kind=support.A100, num_cores=None, platform="cuda")
  mesh = AbstractMesh((2,), ("data",), (AxisType.Explicit,), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    x = jax.ShapeDtypeStruct((8, 4, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    p = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P()))
    with pytest.raises(NotImplementedError, match=r"inputs sharded over a mesh"):
      jax.jit(_step("batch", "pallas", "relu")).trace(x, p, p)
    text = jax.jit(_step("batch", None, "relu")).trace(x, p, p).lower(lowering_platforms=("cuda",))
  assert TRITON not in text.as_text()


# ------------------------------------------------------------------- compiled for the GPUs


# ResNet-50's widest 56 x 56 batch norm (batch 32), and a Stable Diffusion U-Net block's group norm
# (32 groups) at 64 x 64.
LAYERS = {
  "resnet": ("batch", (32, 56, 56, 256), "relu"),
  "unet": ("group", (32, 64, 64, 256), "silu"),
}
_COMPILED = [
  (gpu, layer, dt)
  for gpu in ("A100", "H100")
  for layer in LAYERS
  for dt in (jnp.bfloat16, jnp.float16, jnp.float32)
]


@needs_gpu_compiler
@pytest.mark.parametrize(
  "gpu,layer,dtype",
  representatives(
    _COMPILED,
    {"A100-resnet-bfloat16", "H100-unet-bfloat16"},
    ids=[f"{g}-{n}-{jnp.dtype(d).name}" for g, n, d in _COMPILED],
  ),
)
def test_the_training_step_compiles_without_spills(gpu, layer, dtype):
  kind, shape, activation = LAYERS[layer]
  with jax.enable_x64(False):  # as a GPU user's program: 32-bit index arithmetic
    fn, args = _step(kind, "pallas", activation), _shapes(shape, dtype)
    # NO_SPILLS: XLA fails the compilation of a kernel ptxas spilled registers for.
    compiled = support.compile_for(fn, args, support.GPUS[gpu], support.NO_SPILLS)
  assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') == 3
