"""`python -m benchmarks cnn [--sections S,...] [--runs N]`: ResNet-50 and U-Net blocks each way.

Flax's ImageNet ResNet-50 and a stack of diffusion U-Net residual blocks
(:mod:`benchmarks.cnn_models`), each trained the Flax way, with ``nn.remat`` around each block
(no policy, ``dots_saveable``), with jaxact's norm + activation drop-in (``jaxact.linen.BatchNorm``
/ ``GroupNorm`` with an ``activation``; also under the two remats), and with
``jaxact.linen.ConvNormAct``:

* ``resnet`` / ``unet``: compiled temp of one training step (``jit(value_and_grad)``, the batch
  statistics updated) on CPU, float32, and its ratio to Flax's;
* ``resnet-h100`` / ``unet-h100``: the same compiled for an H100 on this machine
  (``support.compile_for``), bfloat16;
* ``unet-stem-h100``: the U-Net stack behind a 1x1 conv, so that no way's first norm keeps the
  step's argument (as in a whole U-Net);
* ``unet-scan`` / ``unet-scan-h100``: the U-Net blocks under ``nn.scan``, on CPU and for an H100;
* ``fit-h100``: the largest batch of each model and way whose step, compiled for an H100 in
  bfloat16, fits its memory less :data:`FIT_RESERVE` (temp, arguments and outputs:
  ``harness.memory.largest_fit_of``);
* ``resnet-tpu`` / ``unet-tpu``: the H100 sections compiled for TPU chips (``--chip``, v5p and v6e
  unless told): compiled temp a chip, and the step's time ESTIMATED from XLA's cost analysis
  against the chip's published peaks;
* ``time``: CPU step time of both models, median over alternated rounds of each way's time over
  Flax's in the same round.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import support
from benchmarks import cnn_models as models
from benchmarks.harness import chips, memory, rows, timing
from benchmarks.tables import cnn as page

SECTIONS = (
  "resnet",
  "unet",
  "time",
  "unet-h100",
  "resnet-h100",
  "unet-stem-h100",
  "unet-scan",
  "unet-scan-h100",
  "fit-h100",
)
TPU_SECTIONS = ("resnet-tpu", "unet-tpu")  # on request: they need libtpu
# (batch, height, width, channels); the U-Net's stack depth
RESNET_CPU, RESNET_GPU = (8, 64, 64, 3), (32, 224, 224, 3)
UNET_CPU, UNET_GPU, UNET_BLOCKS = (8, 32, 32, 128), (32, 64, 64, 256), 4
# What a fit leaves free of the H100's memory (XLA's target config: 79.1 GiB): the CUDA context,
# cuDNN's convolution workspaces (a compile without a GPU autotunes none) and the allocator's
# slack. A run that uses the rest sets XLA_PYTHON_CLIENT_MEM_FRACTION (jax takes 0.75 by default).
FIT_RESERVE = 4 * 2**30
FIT_STEP, FIT_START = 8, (512, 2048)  # batches between compiled candidates; the first two
# XLA's rematerialization pass off: above ~54 GiB it recomputes what it can to fit the memory it
# assumes, so each way's fit would partly be XLA's remat (at a cost in time no one measures
# here), and memory stops growing with the batch. Off, the fit is the program each way writes.
FIT_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}
# What a TPU row keeps of its step's figures (harness.chips.figures)
TPU_FIGURES = ("temp_bytes", "total_bytes", "estimate_s", "unknown_loops", "over_hbm")


def _step(model: str, variant: str, gpu: bool, batch: int | None = None):
  dtype = jnp.bfloat16 if gpu else jnp.float32
  if model == "resnet":
    shape = RESNET_GPU if gpu else RESNET_CPU
  else:
    shape = UNET_GPU if gpu else UNET_CPU
  if batch is not None:
    shape = (batch, *shape[1:])
  if model == "resnet":
    return models.resnet_step(variant, shape, dtype)
  return models.unet_step(
    variant, shape, UNET_BLOCKS, dtype, stem=model == "unet-stem", scan=model == "unet-scan"
  )


def _flat(step, args):
  leaves, tree = jax.tree.flatten(args)
  return (lambda *leaves: step(*jax.tree.unflatten(tree, leaves))), leaves


def _compiled(step, args, gpu: bool, options: dict | None = None):
  """The step's ``memory_analysis()``, compiled for an H100 (`gpu`, with XLA `options`) or this
  CPU."""
  flat, leaves = _flat(step, args)
  if gpu:
    return support.compile_for(flat, leaves, options=options).memory_analysis()
  return jax.jit(flat).lower(*leaves).compile().memory_analysis()


def _temp(step, args, gpu: bool) -> int:
  return _compiled(step, args, gpu).temp_size_in_bytes


def memory_rows(model: str, gpu: bool, chip: str | None = None, cache=None) -> list[str]:
  """Each way's step on CPU or compiled for an H100 (`gpu`), or with `chip` for that TPU chip at
  the H100's sizes (section ``<model>-tpu``: its figures, the step's time ESTIMATED)."""
  section = f"{model}-tpu" if chip else f"{model}-h100" if gpu else model
  gpu = gpu or chip is not None
  variants = models.RESNETS if model == "resnet" else models.UNETS
  temps, found = {}, {}
  for variant in variants:
    step, args = _step(model, variant, gpu)
    if chip is not None:
      found[variant] = chips.figures(*_flat(step, args), chip, cache=cache)
      found[variant] = {k: found[variant].get(k) for k in TPU_FIGURES} | {"chip": chip}
      temps[variant] = found[variant].pop("temp_bytes")
    else:
      temps[variant] = _temp(step, args, gpu)
    print(f"  {section} {variant}: compiled", flush=True)
  shape = (
    (RESNET_GPU if gpu else RESNET_CPU) if model == "resnet" else (UNET_GPU if gpu else UNET_CPU)
  )
  for variant, temp in temps.items():
    rows.add(
      section,
      f"{chip}, {variant}" if chip else variant,
      **found.get(variant, {}),
      model=model,
      way=page.WAYS[variant],
      shape=list(shape),
      blocks=16 if model == "resnet" else UNET_BLOCKS,
      dtype="bfloat16" if gpu else "float32",
      temp_bytes=temp,
      vs_flax=temp / temps["flax"],
    )
  return page.tables(rows.current().rows, section)


def _fit_total(model: str, variant: str, batch: int) -> int:
  return memory.footprint(_compiled(*_step(model, variant, True, batch), True, FIT_OPTIONS))


def fit_rows() -> list[str]:
  cap = memory.capacity() - FIT_RESERVE
  for model in ("resnet", "unet"):
    variants = models.RESNETS if model == "resnet" else models.UNETS
    batches = {}
    for variant in variants:
      total = functools.partial(_fit_total, model, variant)
      batch, used = memory.largest_fit_of(total, cap, step=FIT_STEP, start=FIT_START)
      batches[variant] = batch
      print(f"  fit-h100 {model} {variant}: batch {batch}", flush=True)
      rows.add(
        "fit-h100",
        f"{model}, {variant}",
        model=model,
        way=page.WAYS[variant],
        shape=list((RESNET_GPU if model == "resnet" else UNET_GPU)[1:]),
        blocks=16 if model == "resnet" else UNET_BLOCKS,
        dtype="bfloat16",
        batch=batch,
        total_bytes=used,
        capacity_bytes=cap + FIT_RESERVE,
        reserve_bytes=FIT_RESERVE,
        vs_flax=batch / batches["flax"],
      )
  return page.tables(rows.current().rows, "fit-h100")


def concrete(args):
  """Arrays for the shapes: parameters and inputs N(0, 1) (labels 0), statistics 0 / 1."""
  leaves, tree = jax.tree.flatten(args)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  made = [
    jnp.zeros(s.shape, s.dtype)
    if jnp.issubdtype(s.dtype, jnp.integer)
    else jax.random.normal(k, s.shape, s.dtype) * 0.1
    for k, s in zip(keys, leaves, strict=True)
  ]
  return jax.tree.unflatten(tree, made)


# The main job's ResNet frontier: each way to train it as a point of harness.frontier.
FRONTIER = {
  "flax": "flax",
  "remat": "flax-remat",
  "dots": "flax-dots",
  "jaxact": "jaxact-bn",
  "jaxact_cna": "jaxact-cna",
  "jaxact_remat": "jaxact-bn-remat",
  "jaxact_dots": "jaxact-bn-dots",
}


def frontier(runs: int, warmup: bool = True) -> tuple[float, dict[str, tuple]]:
  """``(Flax's step in seconds, {point: (temp bytes, step time / Flax's, its rounds' ratios)})``
  for the ResNet-50 on CPU (:data:`RESNET_CPU`, float32): each step compiled once, its memory
  analysis read and the compiled programs timed, alternated, the ratios taken within rounds."""
  temps, calls = {}, []
  for key, variant in FRONTIER.items():
    step, args = _step("resnet", variant, False)
    leaves, tree = jax.tree.flatten(args)
    flat = lambda *leaves, step=step, tree=tree: step(*jax.tree.unflatten(tree, leaves))
    compiled = jax.jit(flat).lower(*leaves).compile()
    temps[key] = compiled.memory_analysis().temp_size_in_bytes
    calls.append(functools.partial(compiled, *jax.tree.leaves(concrete(args))))
  return timing.frontier_points(temps, calls, runs, warmup)


def time_rows(runs: int) -> list[str]:
  for model in ("resnet", "unet"):
    variants = models.RESNETS if model == "resnet" else models.UNETS
    calls = []
    for variant in variants:
      step, args = _step(model, variant, False)
      compiled = jax.jit(step)
      calls.append(functools.partial(compiled, *concrete(args)))
    base, ratios = timing.alternated_ratios(
      [lambda c=c: jax.block_until_ready(c()) for c in calls], runs
    )
    shape = RESNET_CPU if model == "resnet" else UNET_CPU
    for variant, ratio in zip(variants, [1.0, *ratios], strict=True):
      rows.add(
        "time",
        f"{model}, {variant}",
        model=model,
        way=page.WAYS[variant],
        shape=list(shape),
        runs=runs,
        flax_seconds=base,
        ratio=float(np.asarray(ratio)),
      )
  return page.tables(rows.current().rows, "time")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sections", default=",".join(SECTIONS))
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--out", default="bench-out", help="the folder of cnn.rows.jsonl")
  parser.add_argument("--chip", default=",".join(chips.TPU_CHIPS), help="TPU chips (-tpu sections)")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled TPU figures' JSON (-tpu)")
  a = parser.parse_args(argv)
  wanted = a.sections.split(",")
  unknown = [s for s in wanted if s not in SECTIONS + TPU_SECTIONS]
  if unknown:
    parser.error(
      f"sections {unknown} are not known; choose from {', '.join(SECTIONS + TPU_SECTIONS)}"
    )
  gpu_compiler = support.use_gpu_compiler()  # before the first computation starts jax
  if any(s.endswith("-h100") for s in wanted) and not gpu_compiler:
    print("the H100 sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  if any(s.endswith("-tpu") for s in wanted) and (why := chips.available()):
    print(f"benchmarks.cnn: {why}", file=sys.stderr)
    return 1

  def on_tpus(model: str):
    def run() -> list[str]:
      for chip in chips.chips(a.chip):
        memory_rows(model, False, chip, a.cache)
      return page.tables(rows.current().rows, f"{model}-tpu")

    return run

  out = {
    "resnet": lambda: memory_rows("resnet", False),
    "resnet-h100": lambda: memory_rows("resnet", True),
    "unet": lambda: memory_rows("unet", False),
    "unet-h100": lambda: memory_rows("unet", True),
    "unet-stem-h100": lambda: memory_rows("unet-stem", True),
    "unet-scan": lambda: memory_rows("unet-scan", False),
    "unet-scan-h100": lambda: memory_rows("unet-scan", True),
    "time": lambda: time_rows(a.runs),
    "fit-h100": fit_rows,
    "resnet-tpu": on_tpus("resnet"),
    "unet-tpu": on_tpus("unet"),
  }
  print(f"jax {jax.__version__}")
  for name in wanted:
    print(f"\n{page.heading(name)}\n")
    print("\n".join(out[name]()), flush=True)
  return 0
