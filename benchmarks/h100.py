"""`python -m benchmarks h100 [--models KEY,...]`: the main job's frontiers compiled for an
H100, with an estimated step time.

Every point of every model of the main job's frontier (the same definitions: Flax, Flax under each
remat policy, jaxact, with codes, under remat), compiled for an H100 on this machine
(``support.compile_for``) in bfloat16 at a size a GPU trains (:func:`_models`): its compiled temp,
and its step time ESTIMATED from the compiled program's flops and bytes against the H100's peak
rates (:mod:`support.roofline`), until a GPU measures it. A point whose program calls a
Pallas kernel (whose flops XLA cannot see) takes its flops from the same step compiled for this
machine's CPU, where every op is XLA's: the same arithmetic. The front is drawn over temp and the
estimate; the rows (``h100.rows.jsonl``) give ``benchmarks/results/frontier.md``'s H100
block (``python -m benchmarks render``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import support
from benchmarks import cnn, cnn_models, decoder, fused_models, fused_scanned, gated, moe
from benchmarks.harness import rows
from benchmarks.harness.blocks import stack
from benchmarks.tables import h100 as page
from support import roofline

BF16 = jnp.bfloat16


def _flat(step, args):
  """``(step of flat leaves, the leaves)`` of ``step(*args)``."""
  leaves, tree = jax.tree.flatten(args)
  return (lambda *leaves: step(*jax.tree.unflatten(tree, leaves))), leaves


def _mlp_cnn(model: str, activation: str):
  _, _, x_shape = fused_scanned.LAYER_SIZES[model]
  for variant in fused_models.variants(activation):
    yield variant, fused_models.shaped(model, variant, activation, x_shape, BF16)


def _gated():
  for key, block in gated.frontier_peers().items():
    _, loss = stack(block, scan=True)
    yield key, _flat(jax.value_and_grad(loss), gated.shapes(gated.BLOCKS, gated.GPU_SIZE, BF16))


def _decoder():
  c = decoder.DECODER_GPU
  for key, (body, head) in decoder.FRONTIER.items():
    loss = decoder.decoder_loss(c, body, head, decoder.decoder_norm(body))
    yield key, _flat(jax.value_and_grad(loss), decoder.decoder_shapes(c))


def _resnet():
  for key, variant in cnn.FRONTIER.items():
    yield key, _flat(*cnn_models.resnet_step(variant, cnn.RESNET_GPU, BF16))


def _moe():
  c = moe.H100[0]
  for key in moe.POINTS:
    loss = moe.loss_of(key, c.top_k)
    yield key, _flat(jax.value_and_grad(loss), moe.shapes(c, moe.BLOCKS[-1], BF16))


class Model(NamedTuple):
  name: str
  sizes: str
  points: Callable  # yields (point, (step, argument shapes))
  compile_kw: Mapping[str, Any] = MappingProxyType({})  # support.compile_for's options


def _models() -> dict[str, Model]:
  """The models keyed as the main job keys them."""
  out = {}
  for model in ("MLP", "CNN"):
    layers, _, x = fused_scanned.LAYER_SIZES[model]
    if model == "MLP":
      sizes = f"{layers} layers, {x[0]} x {x[1]}"
    else:
      sizes = f"{layers} conv layers (3x3), NHWC {'x'.join(map(str, x))}"
    for act in ("relu", "gelu"):
      out[f"{model.lower()}_{act}"] = Model(f"{model}, {act}", sizes, partial(_mlp_cnn, model, act))
  t, d, f = gated.GPU_SIZE
  c = decoder.DECODER_GPU
  out["gated"] = Model(
    "gated MLP stack",
    f"{gated.BLOCKS} scanned blocks, {t} tokens, D {d}, F {f}",
    _gated,
  )
  out["decoder"] = Model(
    "LM decoder step",
    f"{c.blocks} scanned blocks, {c.batch} x {c.seq} tokens, "
    f"D {c.dim}, F {c.hidden}, {c.heads} heads, V {c.vocab}",
    _decoder,
  )
  out["resnet"] = Model("ResNet-50", "images " + " x ".join(map(str, cnn.RESNET_GPU)), _resnet)
  c = moe.H100[0]
  sizes = f"{moe.BLOCKS[-1]} scanned blocks, {c} (Flax: the plain ragged_dot composition)"
  out["moe"] = Model("MoE block stack", sizes, _moe, moe.GPU_COMPILE)
  return out


MODELS = tuple(_models())


def measure(
  key: str, cpu, compile_=None, target: str = "h100", rates=roofline.H100_SXM_RATES
) -> None:
  """A model's ``model`` row and a ``point`` row a way to train it, compiled for an H100
  (:func:`support.compile_for` with the model's options) or, with `compile_` (``(step, shapes)``
  to a compiled program), for `target` (a TPU chip: ``benchmarks.tpu``), its time estimated at
  `rates`."""
  model = _models()[key]
  rows.add("model", key, name=model.name, title=f"{model.sizes}, bfloat16", unit="MiB")
  for point, (step, shapes) in model.points():
    if compile_ is None:
      compiled = support.compile_for(step, shapes, **model.compile_kw)
    else:
      compiled = compile_(step, shapes)
    found = roofline.cost(compiled.as_text(), cpu)
    flops, flops_from = found.flops, target
    if found.kernels:  # the kernels' arithmetic, counted by XLA in the CPU's program
      flops_from = "cpu"
      flops = roofline.cost(jax.jit(step).lower(*shapes).compile().as_text(), cpu).flops
    rows.emit(
      page.POINT,
      "point",
      f"{key}: {point}",
      model=key,
      point=point,
      temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
      flops=flops,
      bytes=found.bytes,
      kernels=list(found.kernels),
      flops_from=flops_from,
      estimate_s=roofline.seconds(flops, found.bytes, rates),
    )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks h100", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--models", default=",".join(MODELS), help=f"any of {','.join(MODELS)}")
  parser.add_argument("--out", default="bench-out", help="output folder (its rows)")
  args = parser.parse_args(argv)
  keys = args.models.split(",")
  if unknown := [k for k in keys if k not in MODELS]:
    parser.error(f"models {unknown} are not known; choose from {', '.join(MODELS)}")
  try:  # before the first computation starts jax's backends
    support.device(support.H100)
  except support.Unavailable as e:
    print(f"benchmarks.h100: {e}", file=sys.stderr)
    return 2
  cpu = jax.devices("cpu")[0].client
  rows.add("rates", "h100", device=support.H100, **roofline.H100_SXM_RATES)
  print("\n".join(page.POINT.head()), flush=True)
  for key in keys:
    start = time.perf_counter()
    measure(key, cpu)
    print(f"  ({key}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  print("\n".join(page.tables(rows.current().rows, None)), flush=True)
  return 0
