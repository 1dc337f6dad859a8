"""`python -m benchmarks tpu [--sections front,decoder-slice] [--chip v5p]`: the main job's
frontiers compiled for a TPU chip, and its decoder sharded over a v5p slice; step times estimated.

Compiled on this machine by libtpu's compiler (``support.tpu``; install it with ``python
tests/install_tpu_compiler.py``): the compiled temp (XLA's buffer assignment for the chip's HBM:
exact) and the step time ESTIMATED from XLA's cost analysis of the compiled program against the
chip's published bf16 and HBM peaks (:mod:`support.roofline`). No TPU is lent to this
project: nothing here is timed. Sections:

* ``front`` (the default): the points of :mod:`benchmarks.h100` (the same models, sizes and ways
  to train them, bfloat16), compiled for one chip (``--chip``);
* ``decoder-slice``: the main job's decoder scaled to about 1B parameters (:data:`DECODER_1B`),
  compiled for a v5p slice (:data:`SLICE`, 8 chips) under FSDP over ``data`` and tensor
  parallelism over ``model`` (:func:`slice_specs`, MaxText's placement): each point of the
  decoder's frontier at :data:`DECODER_1B`'s batch, per chip, and for Flax, Flax + remat and
  jaxact (``--fit``) the largest global batch whose step fits a v5p chip's HBM.

The rows (``tpu.rows.jsonl``) give ``benchmarks/results/tpu.md``'s blocks (``python -m benchmarks
render``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

import jax
from jax.sharding import PartitionSpec as P

from benchmarks import decoder, h100
from benchmarks.harness import chips, rows
from benchmarks.tables import tpu as page
from support import tpu

SECTIONS = ("front", "decoder-slice")
SLICE = "v5p:2x2x2"  # 8 chips (a v5p-16: v5p names count TensorCores)
SLICE_MESH = {"data": 4, "model": 2}  # FSDP x tensor parallel
# The main job's decoder (DECODER_GPU's shape) at about 1B parameters, Llama 3.2 1B's depth and
# width with a 32k vocabulary; one sequence a data shard.
DECODER_1B = decoder.Decoder(
  batch=4, seq=4096, dim=2048, hidden=5632, heads=16, vocab=32000, blocks=16, dtype="bfloat16"
)
FIT_POINTS = ("flax", "remat", "jaxact")


def slice_specs(data: str = "data", model: str = "model"):
  """``(params, tokens, labels)``'s ``PartitionSpec``s as MaxText places them: each weight's
  model dimension over `data` (FSDP) and its heads, hidden features or vocabulary over `model`
  (tensor parallel), norm scales replicated, the batch over `data`."""
  column, row = P(None, data, model), P(None, model, data)  # (blocks, in, out) weights
  blocks = {"attn_norm": P(), "mlp_norm": P(), "wo": row, "w_down": row}
  blocks |= {name: column for name in ("wq", "wk", "wv", "w_gate", "w_up")}
  params = {"embed": P(model, data), "blocks": blocks, "norm": P(), "head": P(data, model)}
  return params, P(data), P(data)


def _slice_step(c: decoder.Decoder, key: str):
  """``(step of flat leaves, the leaves' shapes, their specs)``: the decoder's training step for
  frontier point `key`, the residual stream's batch over ``data`` and the gradients placed as
  the parameters are (where a sharded optimizer reads them)."""
  body, head = decoder.FRONTIER[key]
  loss = decoder.decoder_loss(c, body, head, decoder.decoder_norm(body), activations=P("data"))
  specs = slice_specs()

  def step(params, tokens, labels):
    value, grads = jax.value_and_grad(loss)(params, tokens, labels)
    return value, jax.lax.with_sharding_constraint(grads, specs[0])

  leaves, tree = jax.tree.flatten(decoder.decoder_shapes(c))
  flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  return (lambda *leaves: step(*jax.tree.unflatten(tree, leaves))), leaves, flat_specs


def slice_figures(c: decoder.Decoder, key: str, cache=None) -> dict:
  step, shapes, specs = _slice_step(c, key)
  return chips.figures(step, shapes, SLICE, in_specs=specs, mesh_axes=SLICE_MESH, cache=cache)


def largest_batch(total, capacity: int, step: int) -> tuple[int, dict[int, int | None]]:
  """``(the largest multiple of `step` whose ``total(batch)`` fits `capacity` (0: none), every
  batch tried)``: doubling from `step` to the first batch that does not fit, then bisection
  between it and the last that did (``total`` None: the compiler refused it)."""
  tried: dict[int, int | None] = {}

  def fits(batch: int) -> bool:
    if batch not in tried:
      tried[batch] = total(batch)
    return tried[batch] is not None and tried[batch] <= capacity

  good, bad = 0, step
  while fits(bad):
    good, bad = bad, 2 * bad
  while bad - good > step:
    mid = (good + bad) // 2 // step * step
    good, bad = (mid, bad) if fits(mid) else (good, mid)
  return good, tried


def section_slice(c: decoder.Decoder, points, fit_points, cache=None) -> None:
  """The ``slice`` rows (a row a frontier point at `c`'s batch) and the ``slice-fit`` rows (a
  row a point of `fit_points`: its largest batch)."""
  shapes = decoder.decoder_shapes(c)[0]
  params = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
  where = {"config": str(c), "seq": c.seq, "parameters": params}
  where |= {"target": SLICE, "mesh": SLICE_MESH}
  chip = tpu.chip(SLICE)
  print("\n".join(page.SLICE.head()), flush=True)
  for key in points:
    found = slice_figures(c, key, cache)
    body, head = decoder.FRONTIER[key]
    figures = dict(point=key, body=body, head=head, batch=c.batch, **where, **found)
    rows.emit(page.SLICE, "slice", key, **figures)
  print("\n".join(page.FIT.head()), flush=True)
  step = SLICE_MESH["data"]  # one sequence more a data shard
  for key in fit_points:

    def total(batch, key=key):
      return slice_figures(dataclasses.replace(c, batch=batch), key, cache)["total_bytes"]

    batch, tried = largest_batch(total, chip.hbm_bytes, step)
    rows.emit(
      page.FIT,
      "slice-fit",
      key,
      point=key,
      batch=batch,
      total_bytes=tried.get(batch),
      capacity_bytes=chip.hbm_bytes,
      tried={str(b): t for b, t in sorted(tried.items())},
      **where,
    )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks tpu", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--sections", default="front", help=f"any of {','.join(SECTIONS)}")
  parser.add_argument("--chip", default="v5p", help=f"one of {', '.join(tpu.CHIPS)} (front)")
  parser.add_argument("--models", default=",".join(h100.MODELS), help="any of the h100 job's")
  parser.add_argument(
    "--points", default=",".join(decoder.FRONTIER), help="the decoder's points (decoder-slice)"
  )
  parser.add_argument("--fit", default=",".join(FIT_POINTS), help="points whose batch is fitted")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled figures' JSON")
  parser.add_argument("--out", default="bench-out", help="output folder (its rows)")
  args = parser.parse_args(argv)
  sections, keys = args.sections.split(","), args.models.split(",")
  points, fits = args.points.split(","), [k for k in args.fit.split(",") if k]
  if unknown := [s for s in sections if s not in SECTIONS]:
    parser.error(f"sections {unknown} are not known; choose from {', '.join(SECTIONS)}")
  if unknown := [k for k in keys if k not in h100.MODELS]:
    parser.error(f"models {unknown} are not known; choose from {', '.join(h100.MODELS)}")
  if unknown := [k for k in points + fits if k not in decoder.FRONTIER]:
    parser.error(f"points {unknown} are not known; choose from {', '.join(decoder.FRONTIER)}")
  if args.chip not in tpu.CHIPS:
    parser.error(f"chip {args.chip!r} is not known; choose from {', '.join(tpu.CHIPS)}")
  if why := chips.available(args.chip):  # before the first computation starts jax's backends
    print(f"benchmarks.tpu: {why}", file=sys.stderr)
    return 2
  if "front" in sections:
    chip = tpu.CHIPS[args.chip]
    cpu = jax.devices("cpu")[0].client
    rows.add("rates", chip.name, device=f"TPU {chip.name}", hbm_bytes=chip.hbm_bytes, **chip.rates)

    def compile_(step, shapes):
      return tpu.compile_for_tpu(step, shapes, chip.name)

    print("\n".join(page.POINT.head()), flush=True)
    for key in keys:
      start = time.perf_counter()
      h100.measure(key, cpu, compile_, chip.name, chip.rates)
      print(f"  ({key}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  if "decoder-slice" in sections:
    section_slice(DECODER_1B, points, fits, args.cache)
  print("\n".join(page.tables(rows.current().rows, None)), flush=True)
  return 0
