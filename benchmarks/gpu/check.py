"""Check the Pallas kernels against the XLA path on a GPU, time both, and measure memory.

    python -m benchmarks gpu [--out DIR] [--sections env,check,time,memory,sweep] [--runs 30]
    python -m benchmarks gpu --truth [--budget 540] [--out DIR] [--only STEP,...] [--dry-run]

``--truth`` is the prepared run of a short GPU loan (:mod:`benchmarks.gpu.truth`): every kernel
no GPU has run, checked against XLA, then the timings, in priority order within a time budget,
each result written as it comes. The sections below are the longer runs, one at a time.

Sections (each prints a markdown table; ``--out`` also gets ``gpu_check.md`` and ``.json``):

* ``env``: device, jax version, and the two ceilings measured here: device-to-device copy bandwidth
  (a jitted copy of 1 GiB, bytes read + written) and the bfloat16 matmul rate of ``jnp.dot``
  (8192 x 8192 x 8192).
* ``check``: ``jaxact.dense_bias_act(..., implementation="pallas")`` and ``"xla"`` against a float32
  reference (upcast inputs, ``precision=HIGHEST``, JAX autodiff of the spec table's plain formula),
  for the value and dx, dw, db; ``‖got - ref‖ / ‖ref‖`` of each. Every elementwise activation in
  bfloat16 on a ragged shape; identity/relu/gelu in float32, bfloat16 and float16 on tiny,
  ragged, batched and large shapes. Fresh random inputs for every case (never zeros). Fails when the
  kernels' error exceeds ``max(2 x XLA's, 1e-5)`` plus the dtype's rounding tolerance, or is
  not finite.
* ``time``: forward and forward+backward (``jit`` of ``jax.vjp`` and its pullback) of the jax.nn
  composition, jaxact ``"xla"`` and jaxact ``"pallas"`` in bfloat16 for the issue's shapes; the
  median over ``--runs`` repetitions of 5 back-to-back calls (each repetition ended by
  ``block_until_ready``), cycling through 4 input sets so no call reads what the last left in L2.
* ``memory``: compiled ``memory_analysis()`` of the jitted training step (temp bytes; and temp +
  outputs) for the same three paths.
* ``sweep``: each kernel's candidate tilings timed alone, for tuning the Triton kernels' tiles.
* ``hopper``: the Mosaic GPU forward (``pallas_kernels.dense_mosaic``): its y and z against a
float32
  reference for every activation it accepts, its forward time against ``jnp.dot`` and the other
  paths, a tile sweep, and one layer's training step with each backward option.
* ``check-mosaic``: as ``check``, through ``jaxact.dense_bias_act(..., implementation="mosaic")``
  (values and dx, dw, db: the Mosaic GPU forward and backward kernels) for the shapes they take.
* ``hopper-bwd``: the Mosaic GPU backward kernels alone, for a few tilings, against XLA's
  backward (time and compiled temp memory).
* ``conv``, ``train``, ``eltwise``, ``suite``: the conv epilogue kernels, an 8-layer MLP step, lone
  activations, and the benchmark suite's GPU section.
* ``conv-bwd``: the conv epilogue's backward kernel alone, by row steps a program (db partial
  sums).
* ``codes``: few-bit derivative codes (``residual_bits=8|4|2``): the kernels' y, kept codes and
  gradients against XLA's; the conv epilogue kernels alone writing and reading each code (GB/s,
  of ``env``'s copy bandwidth); the Mosaic GPU forward writing each code (Hopper); one dense and
  one conv layer's training step, exact against each code, per implementation.

* ``lce``: the LM head's loss (``gpu_lce``): ``linear_cross_entropy``'s Hopper forward kernel
  against the XLA path, and fwd+bwd time of the plain composition, jaxact's paths and tokamax at
  16384 x 4096 x 128k / 256k.

The sections live by what they measure: ``common`` (env, timing, inputs), ``dense``,
``conv``, ``hopper``, ``codes`` and ``lce`` of this package; this module runs them and writes the
report.

Needs a CUDA GPU of compute capability >= 8.0; elsewhere it exits with status 2, saying so.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax

from benchmarks.gpu import codes as gpu_codes
from benchmarks.gpu import conv as gpu_conv
from benchmarks.gpu import dense as gpu_dense
from benchmarks.gpu import hopper as gpu_hopper
from benchmarks.gpu import lce as gpu_lce
from benchmarks.gpu import truth as gpu_truth
from benchmarks.gpu.common import gpu_device, section_env
from benchmarks.harness.sections import Sections
from support import is_hopper


def _copy_gbps(results):
  return results.get("env", {}).get("copy_GBps")


# name -> (data, lines) from (gpu, args, results so far); a "failed" list in data fails the run
SECTIONS = {
  "env": lambda gpu, args, res: section_env(gpu, args.runs),
  "check": lambda gpu, args, res: gpu_dense.section_check(gpu_dense.check_cases(args.quick_check)),
  "time": lambda gpu, args, res: gpu_dense.section_time(args.runs),
  "memory": lambda gpu, args, res: gpu_dense.section_memory(),
  "sweep": lambda gpu, args, res: gpu_dense.section_sweep(args.runs),
  "conv": lambda gpu, args, res: gpu_conv.section_conv(args.runs, _copy_gbps(res)),
  "conv-bwd": lambda gpu, args, res: gpu_conv.section_conv_bwd(args.runs, _copy_gbps(res)),
  "train": lambda gpu, args, res: gpu_dense.section_train(args.runs),
  "eltwise": lambda gpu, args, res: gpu_dense.section_eltwise(args.runs),
  "check-mosaic": lambda gpu, args, res: gpu_dense.section_check(
    gpu_hopper.mosaic_check_cases(args.quick_check), impl="mosaic"
  ),
  "hopper": lambda gpu, args, res: gpu_hopper.section_hopper(
    args.runs, res.get("env", {}).get("bf16_matmul_TFLOPs"), sweep=not args.quick_check
  ),
  "hopper-bwd": lambda gpu, args, res: gpu_hopper.section_hopper_bwd(args.runs),
  "suite": lambda gpu, args, res: gpu_dense.section_suite(args.runs),
  "lce": lambda gpu, args, res: gpu_lce.section_lce(args.runs, is_hopper(gpu.device_kind)),
  "codes": lambda gpu, args, res: gpu_codes.section_codes(
    args.runs, _copy_gbps(res), is_hopper(gpu.device_kind), getattr(gpu, "core_count", None)
  ),
}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--truth" in argv:  # the prepared GPU run of issue 34: its own options
    return gpu_truth.main([a for a in argv if a != "--truth"])
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=30)
  parser.add_argument(
    "--sections", default="env,check,time,memory", help=f"any of {','.join(SECTIONS)}"
  )
  parser.add_argument("--out", default=None)
  parser.add_argument("--quick-check", action="store_true", help="check large tiles only")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
  gpu = gpu_device()
  if gpu is None:
    print(
      "python -m benchmarks gpu needs a CUDA GPU; this machine has none (jax sees: "
      f"{', '.join(sorted({d.platform for d in jax.devices()}))}). On CPU the kernels are tested "
      "in interpret mode by tests/fused/test_dense_triton.py instead.",
      file=sys.stderr,
    )
    return 2
  cc = float(getattr(gpu, "compute_capability", "0"))
  if cc < 8.0:
    print(
      f"{gpu.device_kind} has compute capability {cc}; the kernels need >= 8.0", file=sys.stderr
    )
    return 2
  report = Sections(args.out, "gpu_check", level="###")
  results, ok = report.data, True

  for section in sections:
    t0 = time.perf_counter()
    try:
      data, lines = SECTIONS[section](gpu, args, results)
      if isinstance(data, dict):
        ok &= not data.get("failed") and not data.get("check_failed")
      report.emit(section, data, lines)
    except Exception:
      ok = False
      traceback.print_exc()
    print(f"[{section}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
  return 0 if ok else 1
