"""`python -m benchmarks tpu [--chip v5p] [--models KEY,...]`: the main job's frontiers compiled
for a TPU chip, with an estimated step time.

The points of :mod:`benchmarks.h100` (the same models, sizes and ways to train them, bfloat16),
compiled for one TPU chip on this machine by libtpu's compiler (``support.tpu``; install it with
``python tests/install_tpu_compiler.py``): the compiled temp (XLA's buffer assignment for the
chip's HBM: exact) and the step time ESTIMATED from XLA's cost analysis of the compiled program
against the chip's published bf16 and HBM peaks (:mod:`benchmarks.harness.roofline`). No TPU is
lent to this project: nothing here is timed. The rows (``tpu.rows.jsonl``) give
``benchmarks/results/tpu.md``'s block (``python -m benchmarks render``).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from benchmarks import h100
from benchmarks.harness import rows
from benchmarks.tables import tpu as page
from support import tpu


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks tpu", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--chip", default="v5p", help=f"one of {', '.join(tpu.CHIPS)}")
  parser.add_argument("--models", default=",".join(h100.MODELS), help="any of the h100 job's")
  parser.add_argument("--out", default="bench-out", help="output folder (its rows)")
  args = parser.parse_args(argv)
  keys = args.models.split(",")
  if unknown := [k for k in keys if k not in h100.MODELS]:
    parser.error(f"models {unknown} are not known; choose from {', '.join(h100.MODELS)}")
  if args.chip not in tpu.CHIPS:
    parser.error(f"chip {args.chip!r} is not known; choose from {', '.join(tpu.CHIPS)}")
  try:  # before the first computation starts jax's backends
    tpu.topology(args.chip)
  except tpu.TpuUnavailable as e:
    print(f"benchmarks.tpu: {e}", file=sys.stderr)
    return 2
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
  print("\n".join(page.tables(rows.current().rows, None)), flush=True)
  return 0
