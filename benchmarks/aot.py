"""Compile for an NVIDIA GPU on a machine without one: XLA's own GPU compiler, deviceless.

jax's CUDA plugin (``pip install "jax[cuda12-local]"``: the compiler, no CUDA libraries) compiles a
program for a GPU described by a target config, XLA's ``gpu_specs`` (shared memory, SM count,
compute capability; the plugin carries them for the common GPUs). What that gives, on a CPU
machine:

* the program as that GPU would run it: XLA's fusions, its gemms (cuBLAS or Triton), and the
  Pallas kernels compiled, Triton's to PTX, so that what lowering cannot see fails here (a kernel
  asking for more shared memory than the GPU has fails to compile, where it lowers fine);
* XLA's buffer assignment for that GPU: ``memory_analysis()``, the figure the GPU benchmarks
  report (``benchmarks.gpu.check``'s memory section), for any shape, without lending a GPU.

What it does not give: autotuning, which needs the GPU. XLA takes its default choice for each gemm
(a Triton gemm fusion rather than cuBLAS, whose workspace, up to 32 MiB on Hopper, then does not
count) and the Pallas kernels' tiles are jaxact's own. Timings need a GPU.

The process must not initialise CUDA: with ``JAX_PLATFORMS=cpu`` (set by :func:`main` and by the
tests' conftest when unset) the plugin registers its compiler without looking for a driver.

The compiling itself (``compile_for``, ``spills``, ``custom_calls``) and the layer steps are
``support``'s, shared with the tests (tests/core/test_gpu_compile.py). With jax's own AOT
API (docs/porting-flax.md, "Compiling for an H100 on a machine without one") the one piece jax
does not provide is the GPU's description: ``target_config(H100)`` here returns XLA's
``h100_sxm.txtpb`` as the installed plugin carries it (``Unavailable`` without the plugin).

    python -m benchmarks aot [--sections memory,compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.harness.sections import Sections
from benchmarks.tables import aot as page
from pallas_kernels import default_block_config, default_tiles
from support import (
  A100,
  H100,
  Unavailable,
  compile_for,
  custom_calls,
  device,
  hopper_bwd,
  hopper_bwd_shapes,
  hopper_bwd_variants,
  is_hopper,
  layer_paths,
  layer_shapes,
  layer_step,
  spills,
  train_step,
  triton_probes,
)
from support import target_config as target_config  # for jax's AOT API (docstring)

# ------------------------------------------------------------------------------- sections


def paths(name: str) -> dict[str, Callable]:
  """The jax.nn composition and every jaxact implementation of one dense layer."""
  return layer_paths(name, ("xla", "pallas", "mosaic", None))


SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096))


def section_memory(shapes=SHAPES, activations=("relu", "gelu"), device_kind=H100):
  rows = []
  for m, k, n in shapes:
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,), (m, n))]
    for name in activations:
      for path, f in paths(name).items():
        temps = []
        for options in ({}, {"xla_gpu_enable_triton_gemm": False}):
          compiled = compile_for(layer_step(f), args, device_kind, options)
          temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
        calls = sorted(c for c in custom_calls(compiled) if "cublas" not in c)
        rows.append(
          {
            "device": str(device_kind),
            "shape": [m, k, n],
            "activation": name,
            "path": path,
            "temp_MiB": temps,
            "kernels": calls,
          }
        )
  return rows, page.memory(rows)


def section_mlp(activations=("relu", "gelu"), layers=8, m=8192, d=4096, device_kind=H100):
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
      sizes = dict(layers=layers, m=m, d=d, device=str(device_kind))
      rows.append({**sizes, "activation": name, "path": path, "temp_MiB": temps})
  return rows, page.mlp(rows)


@dataclasses.dataclass
class _Check:
  what: str
  gpu: str
  ok: bool
  detail: str


def compile_checks(device_kinds=(A100, H100)) -> list[_Check]:
  """Every tile configuration of the Triton kernels (for A100 and H100) and of the Hopper kernels
  (for H100), compiled through XLA's GPU compiler, forward and backward."""
  checks = []

  def attempt(what, gpu, fn, shapes):
    try:
      compiled = compile_for(fn, shapes, gpu)
      checks.append(_Check(what, gpu, True, ", ".join(sorted(custom_calls(compiled)))))
    except Exception as e:  # reported: one row per configuration
      checks.append(_Check(what, gpu, False, f"{type(e).__name__}: {str(e).splitlines()[0]}"))

  for gpu in device_kinds:
    hopper_gpu = is_hopper(gpu)
    for i, ((m, k, n), dt) in enumerate(triton_probes(hopper_gpu).values()):
      act = ("tanh", "gelu", "identity")[i % 3]
      attempt(
        f"triton {act} {(m, k, n)} {jnp.dtype(dt).name}",
        gpu,
        train_step(act, "pallas"),
        layer_shapes(m, k, n, dt),
      )
  if any(is_hopper(g) for g in device_kinds):
    gpu = next(g for g in device_kinds if is_hopper(g))
    for shape in ((512, 512, 512), (8192, 4096, 4096)):
      for act in ("relu", "gelu", "identity"):
        attempt(f"mosaic {act} {shape}", gpu, train_step(act, "mosaic"), layer_shapes(*shape))
      for label, t in hopper_bwd_variants(shape).items():
        attempt(f"mosaic bwd {label} {shape}", gpu, hopper_bwd(t), hopper_bwd_shapes(shape))
  return checks


def section_compile(device_kinds=(A100, H100)):
  checks = [dataclasses.asdict(c) for c in compile_checks(device_kinds)]
  return checks, page.compile_(checks)


def spill_survey(device_kinds=(A100, H100)) -> list[dict]:
  """Every elementwise activation of the spec table through every tile configuration of the
  Triton kernels, as a training step (forward, dx, dw + db; for convolutions the epilogue and
  its backward, at 3, 64, 256 and 320 channels) compiled with :data:`NO_SPILLS`."""
  import jaxact

  names = [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise]
  rows = []
  for gpu in device_kinds:
    for (m, k, n), dt in triton_probes(is_hopper(gpu)).values():
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
  for r in rows:
    if r["kernel"] == "dense":
      tiles = default_block_config(tuple(r["shape"]), r["dtype"], hopper=is_hopper(r["gpu"]))
    else:
      tiles = default_tiles((4 * 16 * 16, r["shape"][0]), r["dtype"])
    r["tiles"] = str(tiles)
  return rows, page.spills(rows)


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
  title = f"# Compiled for GPUs on a machine without one ({today}, jax {jax.__version__}, "
  sections = Sections(args.out, "aot", [f"{title}{sys.platform})", ""])
  for name in args.sections.split(","):
    sections.emit(name, *SECTIONS[name]())
  data = sections.data
  failed = [r for r in data.get("compile", []) if not r["ok"]]
  return 1 if failed else 0
