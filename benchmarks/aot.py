"""Compile for an NVIDIA GPU on a machine without one: XLA's own GPU compiler, deviceless.

jax's CUDA plugin (``pip install "jax[cuda12-local]"``: the compiler, no CUDA libraries) compiles a
program for a GPU described by a target config, XLA's ``gpu_specs`` (shared memory, SM count,
compute capability; the plugin carries them for the common GPUs). What that gives, on a CPU
machine:

* the program as that GPU would run it: XLA's fusions, its gemms (cuBLAS or Triton), and the
  Pallas kernels compiled, Triton's to PTX, so that what lowering cannot see fails here (a kernel
  asking for more shared memory than the GPU has fails to compile, where it lowers fine);
* XLA's buffer assignment for that GPU: ``memory_analysis()``, the figure the GPU benchmarks
  report (``benchmarks.gpu_check``'s memory section), for any shape, without lending a GPU.

What it does not give: autotuning, which needs the GPU. XLA takes its default choice for each gemm
(a Triton gemm fusion rather than cuBLAS, whose workspace, up to 32 MiB on Hopper, then does not
count) and the Pallas kernels' tiles are jaxact's own. Timings need a GPU.

The process must not initialise CUDA: with ``JAX_PLATFORMS=cpu`` (set by :func:`main` and by the
tests' conftest when unset) the plugin registers its compiler without looking for a driver.

    python -m benchmarks.aot [--sections memory,compile] [--out DIR]
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported: compile for the GPU, never look for one
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import datetime
import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"

_SPEC_MARK = b"# proto-message: stream_executor.GpuTargetConfigProto"


class Unavailable(RuntimeError):
  """This machine cannot compile for the GPU (no CUDA plugin, or CUDA already initialised)."""


def _plugin():
  try:
    import jax_plugins.xla_cuda12 as plugin
  except ImportError as e:
    raise Unavailable(
      'compiling for a GPU without one needs jax\'s CUDA plugin: pip install "jax[cuda12-local]"'
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
    f"benchmarks.aot: no target config for {device_kind!r} in jax's CUDA plugin; it has: "
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


def abstract_mesh(device_kind: str) -> jax.sharding.AbstractMesh:
  """The abstract mesh jaxact's dispatch reads the target GPU from while tracing."""
  dev = jax.sharding.AbstractDevice(platform="cuda", device_kind=device_kind, num_cores=None)
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


def compile_for(
  fn: Callable[..., Any],
  shapes: Sequence[jax.ShapeDtypeStruct],
  device_kind: str = H100,
  options: dict[str, Any] | None = None,
):
  """``jax.jit(fn)`` lowered and compiled for `device_kind`'s GPU (`shapes` placed on it)."""
  dev = device(device_kind)
  sharding = jax.sharding.SingleDeviceSharding(dev)
  args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
  with jax.default_device(dev):
    with jax.sharding.use_abstract_mesh(abstract_mesh(device_kind)):
      lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options=options or {})


# With this option XLA discards a kernel ptxas had to spill registers for, and says so: a check that
# a Triton tile configuration fits the GPU's register file (a spilling kernel measured 5-14% of the
# copy bandwidth where its neighbours reach 80%: benchmarks/RESULTS.md, the epilogue tile sweep).
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


# ------------------------------------------------------------------------------- sections


def paths(name: str) -> dict[str, Callable]:
  """The jax.nn composition and every jaxact implementation of one dense layer."""
  from benchmarks.gpu_check import _paths

  return _paths(name, ("xla", "pallas", "mosaic", None))


def layer_shapes(m: int, k: int, n: int, dtype=jnp.bfloat16) -> list[jax.ShapeDtypeStruct]:
  """x, w and b of an ``(M, K, N)`` dense layer."""
  return [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (n,))]


SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096))


def section_memory(shapes=SHAPES, activations=("relu", "gelu"), device_kind=H100):
  from benchmarks.gpu_check import _step  # one layer's step as the GPU benchmarks time it

  lines = [
    f"One bf16 layer's step (y, dx, dw, db) compiled for an {device_kind}: XLA's temp, MiB "
    "(its default gemms / cuBLAS's).",
    "",
    "| M, K, N | activation | path | temp | temp, cuBLAS gemms | kernels |",
    "|---|---|---|---|---|---|",
  ]
  rows = []
  for m, k, n in shapes:
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,), (m, n))]
    for name in activations:
      for path, f in paths(name).items():
        temps = []
        for options in ({}, {"xla_gpu_enable_triton_gemm": False}):
          compiled = compile_for(_step(f), args, device_kind, options)
          temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
        calls = sorted(c for c in custom_calls(compiled) if "cublas" not in c)
        rows.append({"shape": [m, k, n], "activation": name, "path": path, "temp_MiB": temps})
        lines.append(
          f"| {m}, {k}, {n} | {name} | {path} | {temps[0]:.0f} | {temps[1]:.0f} | "
          f"{', '.join(calls) or '-'} |"
        )
  return rows, lines


def section_mlp(activations=("relu", "gelu"), layers=8, m=8192, d=4096, device_kind=H100):
  lines = [
    f"MLP {layers} x ({m}, {d}) x ({d}, {d}) bf16, jit(value_and_grad), compiled for an "
    f"{device_kind}: XLA's temp, MiB.",
    "",
    "| activation | path | temp | temp, cuBLAS gemms |",
    "|---|---|---|---|",
  ]
  rows = []
  shapes = [jax.ShapeDtypeStruct((m, d), jnp.bfloat16)]
  shapes += [jax.ShapeDtypeStruct(s, jnp.bfloat16) for _ in range(layers) for s in ((d, d), (d,))]
  for name in activations:
    for path, f in paths(name).items():

      def loss(x, *params, f=f):
        for w, b in zip(params[::2], params[1::2], strict=True):
          x = f(x, w, b)
        return jnp.mean(x.astype(jnp.float32))

      grad = jax.value_and_grad(loss, argnums=tuple(range(1, 2 * layers + 1)))
      temps = [
        compile_for(grad, shapes, device_kind, o).memory_analysis().temp_size_in_bytes / 2**20
        for o in ({}, {"xla_gpu_enable_triton_gemm": False})
      ]
      rows.append({"activation": name, "path": path, "temp_MiB": temps})
      lines.append(f"| {name} | {path} | {temps[0]:.0f} | {temps[1]:.0f} |")
  return rows, lines


@dataclasses.dataclass
class _Check:
  what: str
  gpu: str
  ok: bool
  detail: str


def compile_checks(device_kinds=(A100, H100)) -> list[_Check]:
  """Every tile configuration of the Triton kernels (for A100 and H100) and of the Hopper kernels
  (for H100), compiled through XLA's GPU compiler, forward and backward."""
  from pallas_kernels import dense, hopper

  checks = []

  def attempt(what, gpu, fn, shapes):
    try:
      compiled = compile_for(fn, shapes, gpu)
      checks.append(_Check(what, gpu, True, ", ".join(sorted(custom_calls(compiled)))))
    except Exception as e:  # reported: one row per configuration
      checks.append(_Check(what, gpu, False, f"{type(e).__name__}: {str(e).splitlines()[0]}"))

  for gpu in device_kinds:
    hopper_gpu = dense.is_hopper(gpu)
    for i, ((m, k, n), dt) in enumerate(triton_probes(hopper_gpu).values()):
      act = ("tanh", "gelu", "identity")[i % 3]
      attempt(
        f"triton {act} {(m, k, n)} {jnp.dtype(dt).name}",
        gpu,
        train_step(act, "pallas"),
        layer_shapes(m, k, n, dt),
      )
  if any(dense.is_hopper(g) for g in device_kinds):
    gpu = next(g for g in device_kinds if dense.is_hopper(g))
    for shape in ((512, 512, 512), (8192, 4096, 4096)):
      for act in ("relu", "gelu", "identity"):
        attempt(f"mosaic {act} {shape}", gpu, train_step(act, "mosaic"), layer_shapes(*shape))
      for label, t in hopper.hopper_bwd_variants(shape).items():
        attempt(f"mosaic bwd {label} {shape}", gpu, _hopper_bwd(t), _bwd_shapes(shape))
  return checks


def triton_probes(hopper: bool) -> dict:
  """One probe shape and dtype per tile configuration the Triton kernels' `_block_config` returns
  (every size class of every dimension: <= 16, <= 64, > 64, > 128 and ragged, and a layer Hopper's
  wide tiles divide; every dtype)."""
  import itertools

  from pallas_kernels import dense

  probes = [
    ((m, k, n), dt)
    for m, k, n in [*itertools.product((3, 40, 200), repeat=3), (512, 512, 512)]
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
  ]
  return {dense._block_config(s, dt, hopper=hopper): (s, dt) for s, dt in probes}


def _bwd_shapes(shape):
  m, k, n = shape
  return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n), (m, n))]


def _hopper_bwd(tiles):
  from pallas_kernels import Epilogue, hopper

  def tanh_derivative(z):  # an input-residual epilogue: dz formed from g and z
    t = jnp.tanh(z)
    return 1 - t * t

  epilogue = Epilogue(fn=jnp.tanh, derivative=tanh_derivative, residual="input")

  def bwd(x, w, z, g):
    return hopper.hopper_dense_bias_act_bwd(
      x, w, z, g, epilogue=epilogue, has_bias=True, tiles=tiles
    )

  return bwd


def section_compile(device_kinds=(A100, H100)):
  checks = compile_checks(device_kinds)
  lines = [
    "| kernel, activation, shape | GPU | compiles | custom calls / error |",
    "|---|---|---|---|",
  ]
  for c in checks:
    lines.append(f"| {c.what} | {c.gpu} | {'yes' if c.ok else 'NO'} | {c.detail} |")
  return [dataclasses.asdict(c) for c in checks], lines


def train_step(activation, implementation, conv: bool = False):
  """``value_and_grad`` of one fused layer (dense, or a 3x3 convolution with `conv`): with respect
  to the inputs, so that an epilogue without residual (identity) keeps its forward alive."""
  import jaxact

  op = jaxact.conv_bias_act if conv else jaxact.dense_bias_act

  def loss(x, w, b):
    y = op(x, w, b, activation=activation, implementation=implementation)
    return jnp.sum(y.astype(jnp.float32))

  return jax.value_and_grad(loss, (0, 1, 2))


def spill_survey(device_kinds=(A100, H100)) -> list[dict]:
  """Every elementwise activation of the spec table through every tile configuration of the
  Triton kernels, as a training step (forward, dx, dw + db; for convolutions the epilogue and
  its backward, at 3, 64, 256 and 320 channels) compiled with :data:`NO_SPILLS`."""
  import jaxact
  from pallas_kernels import dense

  names = [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise]
  rows = []
  for gpu in device_kinds:
    for (m, k, n), dt in triton_probes(dense.is_hopper(gpu)).values():
      shapes = layer_shapes(m, k, n, dt)
      bad = [a for a in names if spills(train_step(a, "pallas"), shapes, gpu)]
      rows.append(
        {
          "gpu": gpu,
          "kernel": "dense",
          "shape": [m, k, n],
          "dtype": jnp.dtype(dt).name,
          "spilling": bad,
        }
      )
    for c in (3, 64, 256, 320):
      for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        shapes = [jax.ShapeDtypeStruct(s, dt) for s in ((4, 16, 16, 32), (3, 3, 32, c), (c,))]
        bad = [a for a in names if spills(train_step(a, "pallas", conv=True), shapes, gpu)]
        rows.append(
          {
            "gpu": gpu,
            "kernel": "conv epilogue",
            "shape": [c],
            "dtype": jnp.dtype(dt).name,
            "spilling": bad,
          }
        )
  return rows


def section_spills(device_kinds=(A100, H100)):
  rows = spill_survey(device_kinds)
  total = sum(len(r["spilling"]) for r in rows)
  lines = [
    f"{len(rows)} tile configurations x every elementwise activation; {total} (configuration, "
    "activation) pairs spill registers:",
    "",
    "| GPU | kernel | (M, K, N) or channels | dtype | tiles | spilling activations |",
    "|---|---|---|---|---|---|",
  ]
  from pallas_kernels import bias_act, dense

  for r in rows:
    if not r["spilling"]:
      continue
    if r["kernel"] == "dense":
      tiles = dense._block_config(tuple(r["shape"]), r["dtype"], hopper=dense.is_hopper(r["gpu"]))
    else:
      tiles = bias_act._block_config((4 * 16 * 16, r["shape"][0]), r["dtype"])
    lines.append(
      f"| {r['gpu']} | {r['kernel']} | {tuple(r['shape'])} | {r['dtype']} | {tiles} | "
      f"{', '.join(r['spilling'])} |"
    )
  return rows, lines


SECTIONS = {
  "memory": section_memory,
  "mlp": section_mlp,
  "compile": section_compile,
  "spills": section_spills,
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--sections", default="memory,mlp,compile", help=f"any of {','.join(SECTIONS)} (spills: 1 h)"
  )
  parser.add_argument("--out", default=None, help="also write aot.md and aot.json here")
  args = parser.parse_args(argv)
  try:
    device(H100)
  except Unavailable as e:
    print(f"benchmarks.aot: {e}", file=sys.stderr)
    return 2
  today = datetime.date.today().isoformat()
  report = [
    f"# Compiled for GPUs on a machine without one ({today}, jax {jax.__version__}, "
    f"{sys.platform})",
    "",
  ]
  data = {}
  for name in args.sections.split(","):
    rows, lines = SECTIONS[name]()
    data[name] = rows
    report += [f"## {name}", "", *lines, ""]
    print("\n".join([f"## {name}", "", *lines, ""]), flush=True)
  if args.out:
    import json

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "aot.md"), "w") as fh:
      fh.write("\n".join(report))
    with open(os.path.join(args.out, "aot.json"), "w") as fh:
      json.dump(data, fh, indent=1)
  failed = [r for r in data.get("compile", []) if not r["ok"]]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
