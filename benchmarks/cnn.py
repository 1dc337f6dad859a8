"""`python -m benchmarks cnn [--sections resnet,unet,time,unet-h100,resnet-h100] [--runs N]`.

Flax's ImageNet ResNet-50 and a stack of diffusion U-Net residual blocks
(:mod:`benchmarks.cnn_models`), each trained the Flax way, with ``nn.remat`` around each block,
with jaxact's norm + activation drop-in (``jaxact.linen.BatchNorm`` / ``GroupNorm`` with an
``activation``), and with ``jaxact.linen.ConvNormAct``:

* ``resnet`` / ``unet``: compiled temp of one training step (``jit(value_and_grad)``, the batch
  statistics updated) on CPU, float32, and its ratio to Flax's;
* ``resnet-h100`` / ``unet-h100``: the same compiled for an H100 on this machine
  (``support.compile_for``), bfloat16;
* ``time``: CPU step time of both models, median over alternated rounds of each way's time over
  Flax's in the same round.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import support
from benchmarks import cnn_models as models
from benchmarks.harness import rows, timing
from benchmarks.tables import cnn as page

SECTIONS = ("resnet", "unet", "time", "unet-h100", "resnet-h100")
# (batch, height, width, channels); the U-Net's stack depth
RESNET_CPU, RESNET_GPU = (8, 64, 64, 3), (32, 224, 224, 3)
UNET_CPU, UNET_GPU, UNET_BLOCKS = (8, 32, 32, 128), (32, 64, 64, 256), 4


def _step(model: str, variant: str, gpu: bool):
  dtype = jnp.bfloat16 if gpu else jnp.float32
  if model == "resnet":
    return models.resnet_step(variant, RESNET_GPU if gpu else RESNET_CPU, dtype)
  return models.unet_step(variant, UNET_GPU if gpu else UNET_CPU, UNET_BLOCKS, dtype)


def _temp(step, args, gpu: bool) -> int:
  leaves, tree = jax.tree.flatten(args)
  flat = lambda *leaves: step(*jax.tree.unflatten(tree, leaves))
  compile_ = support.compile_for if gpu else lambda f, a: jax.jit(f).lower(*a).compile()
  compiled = compile_(flat, leaves)
  return compiled.memory_analysis().temp_size_in_bytes


def memory_rows(model: str, gpu: bool) -> list[str]:
  section = f"{model}-h100" if gpu else model
  variants = models.RESNETS if model == "resnet" else models.UNETS
  temps = {}
  for variant in variants:
    step, args = _step(model, variant, gpu)
    temps[variant] = _temp(step, args, gpu)
    print(f"  {section} {variant}: compiled", flush=True)
  shape = (
    (RESNET_GPU if gpu else RESNET_CPU) if model == "resnet" else (UNET_GPU if gpu else UNET_CPU)
  )
  for variant, temp in temps.items():
    rows.add(
      section,
      variant,
      model=model,
      way=page.WAYS[variant],
      shape=list(shape),
      blocks=UNET_BLOCKS if model == "unet" else 16,
      dtype="bfloat16" if gpu else "float32",
      temp_bytes=temp,
      vs_flax=temp / temps["flax"],
    )
  return page.tables(rows.current().rows, section)


def _concrete(args):
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
  "jaxact": "jaxact-bn",
  "jaxact_cna": "jaxact-cna",
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
    calls.append(functools.partial(compiled, *jax.tree.leaves(_concrete(args))))
  return timing.frontier_points(temps, calls, runs, warmup)


def time_rows(runs: int) -> list[str]:
  for model in ("resnet", "unet"):
    variants = models.RESNETS if model == "resnet" else models.UNETS
    calls = []
    for variant in variants:
      step, args = _step(model, variant, False)
      compiled = jax.jit(step)
      calls.append(functools.partial(compiled, *_concrete(args)))
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
  a = parser.parse_args(argv)
  wanted = a.sections.split(",")
  unknown = [s for s in wanted if s not in SECTIONS]
  if unknown:
    parser.error(f"sections {unknown} are not known; choose from {', '.join(SECTIONS)}")
  gpu_compiler = support.use_gpu_compiler()  # before the first computation starts jax
  if any(s.endswith("-h100") for s in wanted) and not gpu_compiler:
    print("the H100 sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  out = {
    "resnet": lambda: memory_rows("resnet", False),
    "resnet-h100": lambda: memory_rows("resnet", True),
    "unet": lambda: memory_rows("unet", False),
    "unet-h100": lambda: memory_rows("unet", True),
    "time": lambda: time_rows(a.runs),
  }
  print(f"jax {jax.__version__}")
  for name in wanted:
    print(f"\n{page.heading(name)}\n")
    print("\n".join(out[name]()), flush=True)
  return 0
