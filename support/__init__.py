"""Support shared by jaxact's tests and benchmarks, in the repository, not installed with the wheel.

The library never imports this package; ``tests/`` and ``benchmarks/`` both do (run from the
repository's root, as ``python -m pytest`` and ``python -m benchmarks`` are). It holds

* deviceless compilation for an NVIDIA GPU: XLA's own GPU compiler through jax's CUDA plugin
  (the compiler, no CUDA libraries; ``tests/install_gpu_compiler.py`` installs it beside the
  environment, :func:`use_gpu_compiler` loads it), for a GPU described by a
  target config (XLA's ``gpu_specs``). On a CPU machine that gives the program as the GPU would run
  it (XLA's fusions and gemms, the Pallas kernels compiled, Triton's to PTX, so a kernel asking for
  more shared memory or registers than the GPU has fails here) and XLA's buffer assignment for the
  GPU (``memory_analysis()``). Not autotuning, nor timings: those need the GPU. The process must not
  initialise CUDA: set ``JAX_PLATFORMS=cpu`` before jax starts;
* one layer's step as tests and benchmarks build it (:func:`train_step`, :func:`layer_step`,
  :func:`layer_paths`, :func:`layer_shapes`);
* the kernels' tilings to probe or time (:func:`triton_probes`, :func:`hopper_bwd_variants`) and an
  epilogue from the spec table (:func:`epilogue`).

"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxact
from jaxact._src.activations import api as activations
from jaxact._src.activations import resolve
from jaxact._src.core import dispatch
from pallas_kernels import Epilogue, default_block_config

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GPUS = {"A100": A100, "H100": H100}

_SPEC_MARK = b"# proto-message: stream_executor.GpuTargetConfigProto"

# ------------------------------------------------------------------ compiling for a GPU


class Unavailable(RuntimeError):
  """This machine cannot compile for the GPU (no CUDA plugin, or CUDA already initialised)."""


# Where tests/install_gpu_compiler.py puts jax's CUDA plugin: outside site-packages, so that no
# other program of the environment loads it (on a machine without CUDA it would print a cuDNN
# traceback at every start).
GPU_COMPILER = pathlib.Path(sys.prefix) / "gpu-compiler"


def use_gpu_compiler() -> bool:
  """Put jax's CUDA plugin, when installed in :data:`GPU_COMPILER`, on ``sys.path``. Call it before
  jax's backends start (the first computation): they register the plugins they find then."""
  if GPU_COMPILER.is_dir() and str(GPU_COMPILER) not in sys.path:
    sys.path.append(str(GPU_COMPILER))
  return GPU_COMPILER.is_dir()


def _plugin():
  use_gpu_compiler()
  try:
    import jax_plugins.xla_cuda12 as plugin
  except ImportError as e:
    raise Unavailable(
      "compiling for a GPU without one needs jax's CUDA plugin: run "
      "`python tests/install_gpu_compiler.py` (it installs it into "
      f"{GPU_COMPILER})"
    ) from e
  return plugin


@functools.cache
def target_config(device_kind: str) -> str:
  """XLA's target config (a ``GpuTargetConfigProto`` in text form) for `device_kind`, as the
  installed CUDA plugin carries it."""
  path = _plugin()._get_library_path()
  if path is None:
    raise Unavailable("jax's CUDA plugin is installed without its library")
  with open(path, "rb") as fh:
    data = fh.read()
  kinds = []
  for mark in re.finditer(re.escape(_SPEC_MARK), data):
    start = data.rfind(b"\0", 0, mark.start()) + 1
    text = data[start : data.find(b"\0", mark.start())].decode(errors="replace")
    found = re.search(r'device_description_str:\s*"([^"]*)"', text)
    if found is None:
      continue
    if found.group(1) == device_kind:
      return text
    kinds.append(found.group(1))
  if not kinds:  # jax 0.11's plugin carries none
    raise Unavailable(f"jax {jax.__version__}'s CUDA plugin carries no GPU target configs")
  raise ValueError(
    f"no target config for {device_kind!r} in jax's CUDA plugin; it has: "
    f"{', '.join(sorted(set(kinds)))}"
  )


@functools.cache
def device(device_kind: str = H100):
  """A compile-only device of `device_kind` (a one-GPU topology)."""
  from jax.experimental import topologies

  _plugin()
  if "cpu" not in (jax.config.jax_platforms or "") and not os.environ.get("JAX_PLATFORMS"):
    raise Unavailable(
      "compiling for a GPU without one needs JAX_PLATFORMS=cpu in the environment before jax "
      "starts (otherwise the CUDA plugin looks for a driver and does not register its compiler)"
    )
  config = target_config(device_kind)
  try:
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
  except (NotImplementedError, RuntimeError) as e:
    raise Unavailable(f"jax cannot build a CUDA topology here: {e}") from e
  return topo.devices[0]


def abstract_mesh(device_kind: str, auto: bool = False) -> jax.sharding.AbstractMesh:
  """The abstract mesh jaxact's dispatch reads the target GPU from while tracing; `auto`: its
  axis Auto (jax's Explicit sharding inference refuses some primitives outright, ragged_dot's
  "not currently implemented"), else Explicit as jax makes it (what every other program here
  compiles under). jaxact's rules read that 1-device Explicit mesh as sharded (the gated backward
  takes no blocks under it), so a program's temp may differ between the two."""
  dev = jax.sharding.AbstractDevice(platform="cuda", device_kind=device_kind, num_cores=None)
  types = {"axis_types": (jax.sharding.AxisType.Auto,)} if auto else {}
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev, **types)


def compile_for(
  fn: Callable[..., Any],
  shapes: Sequence[jax.ShapeDtypeStruct],
  device_kind: str = H100,
  options: dict[str, Any] | None = None,
  auto: bool = False,
):
  """``jax.jit(fn)`` lowered and compiled for `device_kind`'s GPU (`shapes` placed on it; `auto`:
  see :func:`abstract_mesh`)."""
  dev = device(device_kind)
  sharding = jax.sharding.SingleDeviceSharding(dev)
  args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
  with jax.default_device(dev):
    with jax.sharding.use_abstract_mesh(abstract_mesh(device_kind, auto)):
      lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options={**FULL_OPTIMIZATION, **(options or {})})


# What XLA compiles by default, whatever `jax_disable_most_optimizations` says (the test suite sets
# it for its CPU programs): a GPU compile here checks what a user's compile builds.
FULL_OPTIMIZATION = {
  "xla_backend_optimization_level": 3,
  "xla_llvm_disable_expensive_passes": False,
}


# With this option XLA discards a kernel ptxas had to spill registers for, and says so: a check that
# a Triton tile configuration fits the GPU's register file (a spilling kernel runs several times
# slower than its neighbours: benchmarks/gpu_runs/HISTORY.md, the epilogue tile sweep).
NO_SPILLS = {"xla_gpu_fail_ptx_compilation_on_register_spilling": True}


def spills(fn: Callable[..., Any], shapes, device_kind: str = H100) -> bool:
  """Whether a kernel of ``jax.jit(fn)`` spills registers when compiled for `device_kind` (other
  compile errors propagate)."""
  try:
    compile_for(fn, shapes, device_kind, NO_SPILLS)
  except Exception as e:
    if "register spilling" in str(e):
      return True
    raise
  return False


def custom_calls(compiled) -> set[str]:
  """The custom-call targets of a compiled program (cuBLAS, Triton, Mosaic GPU kernels)."""
  return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


# ------------------------------------------------------------------------ one layer's step


def layer_shapes(m: int, k: int, n: int, dtype=jnp.bfloat16) -> list[jax.ShapeDtypeStruct]:
  """x, w and b of an ``(M, K, N)`` dense layer."""
  return [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (n,))]


def train_step(activation, implementation, conv: bool = False):
  """``value_and_grad`` of one fused layer (dense, or a 3x3 convolution with `conv`): with respect
  to the inputs, so that an epilogue without residual (identity) keeps its forward alive."""
  op = jaxact.conv_bias_act if conv else jaxact.dense_bias_act

  def loss(x, w, b):
    y = op(x, w, b, activation=activation, implementation=implementation)
    return jnp.sum(y.astype(jnp.float32))

  return jax.value_and_grad(loss, (0, 1, 2))


def layer_step(f: Callable[..., Any]):
  """``jit`` of one layer's step from a cotangent: ``(x, w, b, g) -> (y, dx, dw, db)``."""

  def step(x, w, b, g):
    y, pull = jax.vjp(f, x, w, b)
    return (y, *pull(g))

  return jax.jit(step)


def fused_dense(name: str, implementation, precision=None):
  """``(x, w, b) -> jaxact.dense_bias_act(...)`` with `name`'s activation."""

  def f(x, w, b):
    return jaxact.dense_bias_act(
      x, w, b, activation=name, implementation=implementation, precision=precision
    )

  return f


def layer_paths(name: str, implementations=("xla", "pallas", None)) -> dict[str, Callable]:
  """The jax.nn composition and jaxact's `implementations` of one dense layer, by label."""
  act = getattr(jax.nn, name)

  def composition(x, w, b):
    return act(jnp.dot(x, w) + b)

  return {"jax.nn": composition} | {f"jaxact {i}": fused_dense(name, i) for i in implementations}


# ------------------------------------------------------------------------------ epilogues


def param_defaults(spec) -> dict[str, Any]:
  return {p.name: p.default for p in spec.params}


def epilogue(name: str, **params) -> Epilogue:
  """The kernels' epilogue for the spec table's activation `name` with Python-number `params`
  (defaults for the rest), built as the fused ops build it (:func:`resolve.epilogue`)."""
  spec = jaxact.get_spec(name)
  z = jax.ShapeDtypeStruct((), jnp.float32)
  rule, dynamic = activations._split_params(spec, z, param_defaults(spec) | params)
  if dynamic:
    raise ValueError(f"epilogue({name!r}): parameters must be Python numbers; got {params}")
  return resolve.epilogue(rule)


# ----------------------------------------------------------------------- the kernels' tiles


def is_hopper(device_kind: str | None) -> bool:
  """Whether `device_kind` names a Hopper GPU (H100, H200), as the dispatch decides it."""
  return dispatch.Target(device_kind=device_kind).hopper


def triton_probes(hopper: bool) -> dict:
  """One probe shape and dtype per tile configuration the Triton kernels' block config returns
  (every size class of every dimension: <= 16, <= 64, > 64, > 128 and ragged, and a layer Hopper's
  wide tiles divide; every dtype)."""
  probes = [
    ((m, k, n), dt)
    for m, k, n in [*itertools.product((3, 40, 200), repeat=3), (512, 512, 512)]
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
  ]
  return {default_block_config(s, dt, hopper=hopper): (s, dt) for s, dt in probes}


def hopper_bwd_variants(shape: tuple[int, int, int], residual: bool = True) -> dict[str, Any]:
  """Tilings of the Hopper backward to time against each other on a GPU (``benchmarks.gpu.check``'s
  ``hopper-bwd`` section), each with its deepest pipeline: ``hopper_bwd_tiles``' choice; the same
  with each warpgroup's wgmma left running into the next step (``delay=1``); one compute warpgroup
  a CTA, overlapping its own dz arithmetic and wgmma that way (deeper pipelines); dw at 64 columns a
  warpgroup (a smaller ring stage, 3 stages with a residual instead of 2); dx at 128 columns (4
  stages instead of 3, dz recomputed twice as often). Only those the shape divides."""
  from pallas_kernels import dense_mosaic_bwd

  base = dense_mosaic_bwd.hopper_bwd_tiles(shape, residual)
  deepest = functools.partial(dense_mosaic_bwd.deepest_pipeline, residual=residual)
  variants = {
    "default": base,
    "overlapped wgmma": dataclasses.replace(base, delay=1),
    "one warpgroup": deepest(dataclasses.replace(base, wgs=1, delay=1)),
    "dw 64 columns": deepest(dataclasses.replace(base, dw_n=64)),
    "dx 128 columns": deepest(dataclasses.replace(base, dx_k=min(base.dx_k, 128))),
  }
  ep = Epilogue(fn=None, derivative=None, residual="none")
  return {
    name: t
    for name, t in variants.items()
    if dense_mosaic_bwd.hopper_bwd_unsupported(shape, jnp.bfloat16, ep, t) is None
  }


def hopper_bwd_shapes(shape: tuple[int, int, int]) -> list[jax.ShapeDtypeStruct]:
  """x, w, the residual and g of the Hopper backward of a bfloat16 ``(M, K, N)`` layer."""
  m, k, n = shape
  return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n), (m, n))]


def hopper_bwd(tiles):
  """The Hopper backward kernels at `tiles` for tanh as an input-residual epilogue (dz formed from
  g and z): ``(x, w, z, g) -> (dx, dw, db)``."""
  from pallas_kernels import dense_mosaic_bwd

  def tanh_derivative(z):
    t = jnp.tanh(z)
    return 1 - t * t

  ep = Epilogue(fn=jnp.tanh, derivative=tanh_derivative, residual="input")

  def bwd(x, w, z, g):
    return dense_mosaic_bwd.hopper_dense_bias_act_bwd(
      x, w, z, g, epilogue=ep, has_bias=True, tiles=tiles
    )

  return bwd
