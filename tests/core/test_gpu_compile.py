"""The kernels compiled, not only lowered, for GPUs this machine does not have.

XLA's own GPU compiler runs here through jax's CUDA plugin (``support``): Triton
kernels are compiled to PTX for the target's shared memory and compute capability, so a tile
configuration that lowers but does not fit the GPU fails here; and XLA's buffer assignment for the
GPU gives a training step's memory as the GPU would allocate it, checked against jax.nn's step
compiled the same way.

The default suite compiles what caught a bug before and the largest tiles; ``pytest -m exhaustive``
adds the surveys over every tile configuration, activation and dtype (about 8 minutes more).

Needs the plugin (``python tests/install_gpu_compiler.py``, part of the README's test command;
Linux wheels only) and ``JAX_PLATFORMS=cpu`` (set by conftest). Without them these tests skip,
saying why, except under CI (``CI`` set), which installs the plugin itself: there they fail.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import support
from pallas_kernels import Epilogue, dense_triton, dense_triton_tiles

try:
  support.device(support.H100)
except support.Unavailable as e:  # pragma: no cover - depends on the environment
  if os.environ.get("CI"):
    raise RuntimeError(f"CI installs jax's CUDA compiler, yet: {e}") from e
  pytest.skip(f"cannot compile for a GPU here: {e}", allow_module_level=True)

import jaxact

from cases import EXH

GPUS = support.GPUS


@pytest.fixture(autouse=True)
def _float32_defaults():
  """Compile as a GPU user's program is compiled: without the suite's 64-bit mode, whose 64-bit
  index arithmetic changes the kernels' register use."""
  with jax.enable_x64(False):
    yield


TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "mosaic_gpu_v2"


shapes = support.layer_shapes


def kernel_calls(compiled, target) -> int:
  return compiled.as_text().count(f'custom_call_target="{target}"')


def test_compiling_catches_a_tile_that_lowers_but_does_not_fit():
  """What the lowering tests cannot see: 256 x 256 tiles over four 64-deep stages want 256 KiB of
  shared memory; the forward lowers for an A100 but does not compile for it (164 KiB)."""
  ep = Epilogue(fn=jax.nn.relu, derivative=None, residual="none")
  wide = dense_triton_tiles.default_block_config((4096, 4096, 4096), jnp.bfloat16, hopper=False)
  wide = dense_triton_tiles.BlockConfig(
    fwd=dense_triton_tiles.Tiles(256, 256, 64, 8, 4), dx=wide.dx, dw=wide.dw
  )

  def fwd(x, w, b):
    return dense_triton.dense_bias_act_fwd(x, w, b, epilogue=ep, block_config=wide)[0]

  args = shapes(1024, 1024, 1024)
  with jax.sharding.use_abstract_mesh(support.abstract_mesh(support.A100)):
    assert TRITON in jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  with pytest.raises(Exception, match=r"[Ss]hared memory"):
    support.compile_for(fwd, args, support.A100)


@pytest.mark.exhaustive
@pytest.mark.parametrize("gpu", list(GPUS))
def test_every_triton_block_config_compiles(gpu):
  """Forward, dx and dw(+db) of every configuration `default_block_config` returns for the GPU,
  through XLA's GPU compiler, with no residual (identity); the register-spill test below compiles
  every configuration with an output-residual (squareplus) and an input-residual (gelu) epilogue."""
  probes = support.triton_probes(gpu == "H100")
  assert len(probes) >= 20
  for (m, k, n), dt in probes.values():
    activation = "identity"
    compiled = support.compile_for(
      support.train_step(activation, "pallas"), shapes(m, k, n, dt), GPUS[gpu]
    )
    assert kernel_calls(compiled, TRITON) == 3, ((m, k, n), dt, activation)


@pytest.mark.exhaustive
@pytest.mark.parametrize("activation", ["relu", "gelu", "identity"])
def test_the_hopper_kernels_compile_for_an_h100(activation):
  compiled = support.compile_for(support.train_step(activation, "mosaic"), shapes(512, 512, 512))
  assert kernel_calls(compiled, MOSAIC) == 3  # forward, dx, dw(+db)


@pytest.mark.exhaustive
def test_every_hopper_backward_variant_compiles():
  """The tilings `benchmarks gpu --sections hopper-bwd` times (a GPU session picks the
  default from them), for an input-residual epilogue."""
  variants = support.hopper_bwd_variants((512, 512, 512))
  assert len(variants) >= 4
  for label, tiles in variants.items():
    compiled = support.compile_for(
      support.hopper_bwd(tiles), support.hopper_bwd_shapes((512, 512, 512))
    )
    assert kernel_calls(compiled, MOSAIC) == 2, label


M, K, N = 1024, 512, 512
ACTIVATION_MIB = M * N * 2 / 2**20  # one bf16 (M, N) array


def step_temp_mib(f, gpu):
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, K), (K, N), (N,), (M, N))]
  compiled = support.compile_for(support.layer_step(f), args, gpu)  # y and the pullback at g
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


# The Triton kernels' step is the same program for both GPUs: one activation on each by default.
@pytest.mark.sample(1, "H100-pallas-relu")
@pytest.mark.parametrize(
  "gpu,implementation,activation",
  [
    ("H100", "mosaic", "relu"),
    ("H100", "mosaic", "gelu"),
    ("H100", "pallas", "relu"),
    ("A100", "pallas", "gelu"),
    pytest.param("H100", "pallas", "gelu", marks=pytest.mark.exhaustive),
    pytest.param("A100", "pallas", "relu", marks=pytest.mark.exhaustive),
  ],
)
def test_the_fused_backward_keeps_no_dz_in_the_compiled_step(gpu, implementation, activation):
  """One layer's step (y, dx, dw, db from g) as XLA allocates it for the GPU: the fused kernels'
  temp is the residual alone (nothing for relu, whose residual is the output y; z for gelu), below
  jax.nn's, whose step materialises dz."""
  act = getattr(jax.nn, activation)
  reference = step_temp_mib(lambda x, w, b: act(x @ w + b), GPUS[gpu])
  fused = step_temp_mib(
    lambda x, w, b: jaxact.dense_bias_act(
      x, w, b, activation=activation, implementation=implementation
    ),
    GPUS[gpu],
  )
  kept = 0.0 if activation == "relu" else ACTIVATION_MIB
  assert reference >= ACTIVATION_MIB  # jax.nn's dz at least
  assert fused <= kept + 0.01 and fused < reference, (fused, reference)


# ----------------------------------------------------------------------- register spills

# Long derivatives of the spec table. mish's is not here: its backward spills on an H100 at the
# 128-row tiles of the large layers (found by python -m benchmarks aot, not yet timed on a GPU).
HEAVY = ("gelu", "squareplus")


def test_a_tile_that_spills_registers_is_caught():
  """The epilogue tile measured at 5% (forward) and 14% (backward) of the copy bandwidth on an H100
  (128 x 256 elements over 4 warps, gelu; benchmarks/gpu_runs/HISTORY.md) spills; the default
  does not."""
  from pallas_kernels import bias_act_triton

  epilogue = Epilogue(
    fn=jax.nn.gelu, derivative=jax.vmap(jax.vmap(jax.grad(jax.nn.gelu))), residual="input"
  )
  args = [jax.ShapeDtypeStruct((401408, 256), jnp.bfloat16)] * 2

  def backward(tiles):
    def f(g, z):
      return bias_act_triton.bias_act_bwd(
        g, z, epilogue=epilogue, has_bias=True, block_config=tiles
      )

    return f

  assert support.spills(backward(bias_act_triton.EltwiseTiles(128, 256, 4)), args)
  assert not support.spills(backward(None), args)


# The layers whose tiles spilled before the tile and warp choices of default_block_config were made
# (python -m benchmarks aot --sections spills; benchmarks/results/aot.md), and the largest tiles of
# each dtype: what the default suite compiles with the spill check. The exhaustive survey below
# covers every configuration.
SPILLED_BEFORE = (
  ((200, 200, 3), jnp.float32),  # A100: 4-warp 128 x 16 dw tiles (H100 here; A100 in float16)
  ((200, 200, 3), jnp.float16),
  ((200, 40, 3), jnp.float16),  # A100: 4-warp 128 x 64 dx tiles
  ((40, 40, 200), jnp.float16),  # A100: gelu's backward with a one-exp derivative
  ((200, 200, 200), jnp.float16),  # H100: ragged layers in Hopper's 128 x 256 tiles
  ((200, 200, 200), jnp.bfloat16),
  ((512, 512, 512), jnp.float16),  # H100: gelu's backward in 128 x 256 float16 tiles
  ((512, 512, 512), jnp.bfloat16),  # Hopper's 128 x 256 tiles (bfloat16 only)
  ((512, 512, 512), jnp.float32),
)


@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "activation",
  [pytest.param(a, marks=[] if a == "gelu" else [pytest.mark.exhaustive]) for a in HEAVY],
)
@pytest.mark.parametrize("gpu", list(GPUS))
def test_no_spill_where_triton_tiles_spilled_before(gpu, activation):
  """The Triton kernels at the layers whose tiles once spilled, and at each dtype's largest tiles,
  with the heaviest epilogues (gelu by default): no spill."""
  for (m, k, n), dt in SPILLED_BEFORE:
    if gpu == "A100" and dt == jnp.float32 and min(m, k, n) <= 16:
      continue  # gelu-like epilogues still spill there (results/aot.md): the survey's exception
    step = support.train_step(activation, "pallas")
    assert not support.spills(step, shapes(m, k, n, dt), GPUS[gpu]), ((m, k, n), dt, activation)


@pytest.mark.exhaustive
@pytest.mark.parametrize("activation", HEAVY)
@pytest.mark.parametrize("gpu", list(GPUS))
def test_no_triton_tile_spills_registers(gpu, activation):
  """Every tile configuration the Triton kernels use on the GPU, with the heaviest epilogues.

  Except, on an A100, float32 layers with a dimension of at most 16 (their 16-wide tiles spill for
  gelu, mish, silu, squareplus or sparse_plus there; benchmarks/results/aot.md)."""
  for (m, k, n), dt in support.triton_probes(gpu == "H100").values():
    if gpu == "A100" and dt == jnp.float32 and min(m, k, n) <= 16:
      continue
    step = support.train_step(activation, "pallas")
    assert not support.spills(step, shapes(m, k, n, dt), GPUS[gpu]), ((m, k, n), dt)


ELEMENTWISE_NAMES = [a for a in jaxact.ACTIVATIONS if jaxact.get_spec(a).elementwise]
# The default run compiles the activation whose backward spilled (hard_silu, A100 float32, 4
# warps) and the most expensive epilogues; -m exhaustive every elementwise activation.
_EPILOGUE_SURVEY = [
  pytest.param("A100", jnp.float32, ("hard_silu", "gelu", "mish", "squareplus"), id="A100-f32"),
  *(
    pytest.param(gpu, dtype, tuple(ELEMENTWISE_NAMES), id=f"{gpu}-{name}-all", marks=EXH)
    for gpu, dtype, name in (
      ("A100", jnp.float32, "f32"),
      ("A100", jnp.bfloat16, "bf16"),
      ("H100", jnp.float32, "f32"),
      ("H100", jnp.bfloat16, "bf16"),
    )
  ),
]


@pytest.mark.exhaustive
@pytest.mark.parametrize("gpu,dtype,names", _EPILOGUE_SURVEY)
def test_the_conv_epilogue_kernels_do_not_spill(gpu, dtype, names):
  """The epilogue and its backward at their default tiles (4096 elements over 4 warps at every
  channel count)."""
  conv = [jax.ShapeDtypeStruct(s, dtype) for s in ((4, 16, 16, 32), (3, 3, 32, 256), (256,))]
  spilling = [
    a for a in names if support.spills(support.train_step(a, "pallas", conv=True), conv, GPUS[gpu])
  ]
  assert spilling == []


# ------------------------------------------------------------------ linear_cross_entropy


def _lce_step(tied: bool | str):
  """The gradient step of an untied head (False), a table passed as ``emb.T`` (True) or as it is
  with ``w_layout="vd"`` ("vd")."""

  def loss(w, x, labels):
    if tied == "vd":
      return jaxact.linear_cross_entropy(x, w, labels, w_layout="vd")
    return jaxact.linear_cross_entropy(x, w.T if tied else w, labels)

  return jax.grad(loss, argnums=(0, 1))


def test_linear_cross_entropy_for_an_h100_keeps_no_logits_and_folds_a_tied_transpose():
  """Compiled for an H100 (bf16, 2048 tokens, D = 512, V = 32768): the step's temp is a small
  fraction of the plain composition's (which holds bf16 logits and their float32 softmax), and
  a tied embedding passed as ``emb.T`` costs the temp of an untied ``w`` within a few KiB (XLA
  gives the loop's operand the transposed layout: no copy of the table), as does the table read
  by rows (``w_layout="vd"``)."""
  import optax

  t, d, v = 2048, 512, 32768
  x = jax.ShapeDtypeStruct((t, d), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((t,), jnp.int32)
  w = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
  emb = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)

  def plain(w, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()

  def temp(step, *args):
    return support.compile_for(step, args).memory_analysis().temp_size_in_bytes

  untied = temp(_lce_step(False), w, x, labels)
  tied = temp(_lce_step(True), emb, x, labels)
  composition = temp(jax.grad(plain, argnums=(0, 1)), w, x, labels)
  assert untied <= 0.25 * composition, (untied, composition)
  assert abs(tied - untied) < 0.01 * d * v * 2, (tied, untied)  # a copy of the table: 32 MiB
  by_rows = temp(_lce_step("vd"), emb, x, labels)
  assert abs(by_rows - untied) < 0.01 * d * v * 2, (by_rows, untied)
