"""The GPU truth run (issue 34): every kernel that has not met a GPU, checked against XLA at small
shapes, then the timings that ``implementation=None``'s rules wait for, in one command that stops
before its budget.

    PYTHONPATH=. python -m benchmarks gpu --truth [--budget 540] [--out DIR]
        [--only STEP[,STEP...]] [--runs 10] [--list] [--dry-run [--rehearse]]

The steps are :data:`STEPS`, the table below: name, priority, estimated
seconds on an H100 (compiles included), function. They run by priority (table order within
one), each skipped (``skipped: budget``) when its estimate would overrun the budget (seconds of
process age, ``--budget``), each writing its verdicts and tables under ``--out`` (default
``$OUT``) as it goes: ``truth.md``, ``truth.json``, tracebacks in ``truth-errors.log``
(:mod:`support.truth`). Priorities:

0. the device and its ceilings (``env``);
1. correctness in bfloat16 of the kernels no GPU has run, or that changed since the last GPU run
   (2026-11-22): the gated MLP's (Triton forward and backward, Mosaic GPU forward), the LM head's
   Hopper forward and backward with every option, the few-bit code kernels (8, 4, 2 bits: Triton
   dense and conv epilogues, Hopper forward and backward), the Triton dense and conv kernels and the
   Hopper dense kernels (one activation of each residual family: identity, relu, gelu), the
   attention kernels (and cuDNN's attention), the MoE grouped matmuls and the norm + activation
   epilogue (Triton); Triton's run on Hopper too;
2. the same in float16, then 3. in float32 (Triton only: Mosaic GPU takes 16-bit operands);
4. timings, each against XLA in the same process: the gated MLP forward and backward, the LM head
   at 16384 x 4096 x 128k against the plain composition (and tokamax where it imports), the code
   kernels, a decoder training step with and without jaxact's ops, one layer's step with each code,
   the ResNet-50 and U-Net steps each way.

Correctness is judged as ``benchmarks.gpu.check``'s ``check`` judges it: the kernel path and the
XLA path at the inputs' dtype, each against the XLA path on float32 inputs at HIGHEST precision;
the kernel may be twice as inexact as XLA plus one rounding of its dtype
(:mod:`support.gpu_compare`). The code kernels keep the same codes as XLA from
inputs whose pre-activation is exact (:mod:`support.gpu_codes`). Shapes are small,
but each Hopper check has more output tiles than an H100 has SMs, so that every persistent CTA
walks a second tile while the others run (the interpreter runs one CTA: it cannot show a race).

The steps' functions live in :mod:`benchmarks.gpu.truth_checks` and
:mod:`benchmarks.gpu.truth_timings`. Adding a kernel is one function there and one row of
:data:`STEPS` (the attention kernels' row is there already: ``implementation="pallas"`` and
``"mosaic"`` are recorded as unsupported until they land, then checked).

``--dry-run`` (on the CPU) lists the steps and proves the harness with stand-in steps: the budget,
the files under ``--out``, the verdict lines, an exception caught; ``tests/repo/test_gpu_truth.py``
runs it. ``--dry-run --rehearse`` runs the real steps at tiny shapes with the kernels in
interpret mode and one repetition per timing (minutes): what the GPU will run, traced before.
"""

from __future__ import annotations

import os

# Mosaic GPU's interpreter blocks XLA CPU threads at its barriers: with fewer threads than
# warpgroups a rehearsal hangs (tests/conftest.py sets the same). No effect on a GPU's work.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))

import argparse
import functools
import json
import math
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.gpu.truth_checks import (
  attention,
  codes,
  conv,
  dense,
  env,
  gated,
  judge,
  lce,
  moe,
  norm_act,
)
from benchmarks.gpu.truth_timings import (
  time_attention,
  time_codes_hopper,
  time_codes_kernels,
  time_codes_step,
  time_decoder,
  time_gated,
  time_lce,
  time_posttrain,
)
from benchmarks.gpu.truth_timings_cnn import time_cnn
from benchmarks.gpu.truth_timings_ops import time_moe, time_norm_act, time_norms
from benchmarks.harness import rows
from support import is_hopper
from support import truth as th

SG = ("silu", "gelu")  # the gated activations of the float16 and float32 rows
NA = ("batch relu", "group silu")  # the norm + activation cases of those rows


# ------------------------------------------------------------------------------- the table

P = functools.partial
Step = th.Step
H = True  # Hopper only

# One row a step: name (what --only takes), priority, estimated seconds on an H100 (compiles
# included), function, what it checks, and whether it needs a Hopper GPU. Adding a kernel is a row.
# fmt: off
STEPS: tuple[Step, ...] = (
  Step("env",                     0,   8, env,
       "the device, jax, copy bandwidth, bf16 matmul rate"),
  # 1: bfloat16 correctness of what no GPU has run, or what changed since the last GPU run
  Step("gated-triton-bf16",       1,  20, P(gated, dtype="bf16", impl="pallas"),
       "gated MLP: Triton forward and backward"),
  Step("gated-mosaic-bf16",       1,  24, P(gated, dtype="bf16", impl="mosaic"),
       "gated MLP: Hopper forward, Triton backward", H),
  Step("moe-triton-bf16",         1,  25, P(moe, dtype="bf16"),
       "MoE MLP: Triton grouped matmuls, forward and backward"),
  Step("lce-mosaic-bf16",         1,  48, P(lce, dtype="bf16"),
       "LM head: Hopper forward and backward, every option", H),
  Step("codes-triton-dense-bf16", 1,  18, P(codes, dtype="bf16", op="dense", impl="pallas"),
       "8/4/2-bit codes: Triton dense forward and backward"),
  Step("codes-triton-conv-bf16",  1,  15, P(codes, dtype="bf16", op="conv", impl="pallas"),
       "8/4/2-bit codes: conv epilogue kernels"),
  Step("codes-mosaic-bf16",       1,  24, P(codes, dtype="bf16", op="dense", impl="mosaic"),
       "8/4/2-bit codes: Hopper forward and backward", H),
  Step("dense-triton-bf16",       1,  15, P(dense, dtype="bf16", impl="pallas"),
       "Triton dense forward and backward: identity, relu, gelu"),
  Step("conv-triton-bf16",        1,  12, P(conv, dtype="bf16"),
       "conv epilogue kernels: identity, relu, gelu"),
  Step("dense-mosaic-bf16",       1,  21, P(dense, dtype="bf16", impl="mosaic"),
       "Hopper dense forward and backward: identity, relu, gelu", H),
  Step("attention-bf16",          1,  25, P(attention, dtype="bf16"),
       "attention: jaxact's Triton kernels and cuDNN's against jaxact's XLA path"),
  Step("norm-act-triton-bf16",    1,  16, P(norm_act, dtype="bf16"),
       "batch / group norm + activation: Triton epilogue forward and backward"),
  # 2: float16
  Step("gated-triton-f16",        2,  10, P(gated, dtype="f16", impl="pallas", activations=SG),
       "gated MLP: Triton"),
  Step("gated-mosaic-f16",        2,  12, P(gated, dtype="f16", impl="mosaic", activations=SG),
       "gated MLP: Hopper forward", H),
  Step("moe-triton-f16",          2,  15, P(moe, dtype="f16"),
       "MoE MLP: Triton grouped matmuls"),
  Step("lce-mosaic-f16",          2,  12, P(lce, dtype="f16", cases=("plain", "all, none")),
       "LM head: Hopper kernels", H),
  Step("codes-triton-dense-f16",  2,  15, P(codes, dtype="f16", op="dense", impl="pallas"),
       "codes: Triton dense"),
  Step("codes-triton-conv-f16",   2,  12, P(codes, dtype="f16", op="conv", impl="pallas"),
       "codes: conv epilogue"),
  Step("codes-mosaic-f16",        2,  21, P(codes, dtype="f16", op="dense", impl="mosaic"),
       "codes: Hopper kernels", H),
  Step("dense-triton-f16",        2,  15, P(dense, dtype="f16", impl="pallas"),
       "Triton dense"),
  Step("conv-triton-f16",         2,  12, P(conv, dtype="f16"),
       "conv epilogue"),
  Step("dense-mosaic-f16",        2,  21, P(dense, dtype="f16", impl="mosaic"),
       "Hopper dense", H),
  Step("norm-act-triton-f16",     2,   9, P(norm_act, dtype="f16", cases=NA),
       "norm + activation epilogue"),
  # 3: float32 (the Mosaic GPU kernels take 16-bit operands only)
  Step("gated-triton-f32",        3,  10, P(gated, dtype="f32", impl="pallas", activations=SG),
       "gated MLP: Triton"),
  Step("moe-triton-f32",          3,  15, P(moe, dtype="f32"),
       "MoE MLP: Triton grouped matmuls"),
  Step("codes-triton-dense-f32",  3,  15, P(codes, dtype="f32", op="dense", impl="pallas"),
       "codes: Triton dense"),
  Step("codes-triton-conv-f32",   3,  12, P(codes, dtype="f32", op="conv", impl="pallas"),
       "codes: conv epilogue"),
  Step("dense-triton-f32",        3,  15, P(dense, dtype="f32", impl="pallas"),
       "Triton dense"),
  Step("conv-triton-f32",         3,  12, P(conv, dtype="f32"),
       "conv epilogue"),
  Step("norm-act-triton-f32",     3,   9, P(norm_act, dtype="f32", cases=NA),
       "norm + activation epilogue"),
  # 4: timings, each against XLA in this process (attention first: is jaxact's near cuDNN's?)
  Step("time-attention",          4,  70, time_attention,
       "causal attention 4 x 2048, 1 x 8192, capped, GQA: jaxact xla / pallas, jax.nn xla / cudnn"),
  Step("time-gated",              4,  50, time_gated,
       "gated MLP fwd and fwd+bwd against XLA, 8192 x 4096 x 11008"),
  Step("time-lce",                4,  75, time_lce,
       "LM head 16384 x 4096 x 128k against the plain composition"),
  Step("time-codes-kernels",      4,  40, time_codes_kernels,
       "conv epilogue kernels, exact and coded, against XLA's fusions"),
  Step("time-codes-hopper",       4,  30, time_codes_hopper,
       "Hopper forward writing each code, against jnp.dot", H),
  Step("time-decoder",            4,  90, time_decoder,
       "decoder training step: Flax + optax against jaxact"),
  Step("time-codes-step",         4, 100, time_codes_step,
       "one layer's training step with each code, per implementation"),
  Step("time-posttrain",          4,  45, time_posttrain,
       "GRPO loss step 16 x 1024 x 4096 x 128k: the plain composition against jaxact"),
  Step("time-norm-act",           4,  50, time_norm_act,
       "batch norm + relu, group norm + SiLU, fwd+bwd: the plain composition against jaxact's XLA "
       "path and its Triton kernels"),
  Step("time-norms",              4,  30, time_norms,
       "rms_norm and layer_norm 16384 x 4096, fwd and fwd+bwd: Flax's formula against jaxact's "
       "(statistics scaled a row)"),
  Step("time-moe",                4,  40, time_moe,
       "MoE MLP 16384 x 2048, 64 experts top 8: the plain ragged composition against jaxact"),
  Step("time-cnn",                4, 140, time_cnn,
       "ResNet-50 and U-Net steps: Flax, block remat, the drop-ins, ConvNormAct, NormActConv, "
       "Flax's under the one line"),
)
# fmt: on


# ------------------------------------------------------------------------------ the command


def _standins() -> tuple[Step, ...]:
  """Steps that exercise the harness on the CPU in a second: what each verdict looks like."""
  from support.gpu_compare import compare_to_xla

  def build(impl, precision):  # a "kernel" that is the XLA path itself
    return lambda x, w: jnp.tanh(jnp.dot(x, w, precision=precision))

  def ok(ctx):
    keys = jax.random.split(jax.random.key(0))
    args = [
      jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, [(4, 8), (8, 16)], strict=True)
    ]
    judge(ctx, "standin-check f32 tanh", lambda: compare_to_xla(build, args, "xla"))
    return ["a table line"], {"x": 1}

  def fail(ctx):
    ctx.verdict("standin-fail", "FAIL", "y 1.0e-01 > 3.1e-02 allowed (xla 1.0e-03)")
    return [], None

  def error(ctx):
    raise RuntimeError("a stand-in kernel raised")

  def never(ctx):
    raise AssertionError("a step over the budget ran")

  return (
    Step("standin-ok", 0, 1, ok, "a check through compare_to_xla (XLA against itself)"),
    Step("standin-fail", 0, 1, fail, "a step whose check fails"),
    Step("standin-error", 0, 1, error, "a step that raises"),
    Step("standin-hopper", 0, 1, never, "a Hopper step on a machine without one", hopper=True),
    Step("standin-budget", 0, 1e6, never, "a step over the budget"),
  )


EXPECTED = {
  "standin-check f32 tanh": "ok",
  "standin-fail": "FAIL",
  "standin-error": "ERROR",
  "standin-hopper": "skipped",
  "standin-budget": "skipped",
}


def _prove_harness(out: str, budget: float) -> int:
  """Run the stand-ins under `out` and read the files back: 0 when every verdict, file and
  line is what the harness promises."""
  report = th.Report(out, th.header("cpu (dry run)", sys.orig_argv, budget))
  runner = th.Runner(_standins(), budget, report, rerun=_rerun_command)
  got = {v.kernel: v.status for v in runner.run(th.Context())}
  runner.summary()
  problems = [f"{k}: {got.get(k)} (expected {s})" for k, s in EXPECTED.items() if got.get(k) != s]
  with open(os.path.join(out, "truth.md")) as fh:
    md = fh.read()
  problems += [f"truth.md lacks {k!r}" for k in EXPECTED if f"VERDICT {k}: " not in md]
  with open(os.path.join(out, "truth-errors.log")) as fh:
    if "a stand-in kernel raised" not in fh.read():
      problems.append("truth-errors.log lacks the stand-in's traceback")
  if sorted(runner.redo) != ["standin-budget", "standin-error", "standin-fail"]:
    problems.append(f"rerun list {runner.redo}")
  for p in problems:
    print(f"harness: {p}", file=sys.stderr)
  print(f"harness: {'ok' if not problems else 'BROKEN'} (files under {out})")
  return 1 if problems else 0


def add_rows(path: pathlib.Path) -> None:
  """The run's results (``truth.json``) as rows: a ``verdict`` row a kernel checked, a ``step``
  row a step with what it measured (``benchmarks.harness.rows``)."""
  rec = rows.current()
  for step in json.loads(path.read_text())["steps"]:
    for v in step["verdicts"]:
      rec.add("verdict", v["kernel"], step=step["name"], status=v["status"], detail=v["detail"])
    rec.add("step", step["name"], state=step["state"], seconds=step["seconds"], data=step["data"])


def _rerun_command(names: list[str]) -> str:
  return (
    f"PYTHONPATH=. python -m benchmarks gpu --truth --only {','.join(names)} "
    "--out $OUT --budget <seconds left - 40>"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks gpu --truth", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--budget", type=float, default=None, help="seconds of process age (540)")
  parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for truth.md/.json")
  parser.add_argument("--only", default=None, help="steps to run: names or patterns, commas")
  parser.add_argument("--runs", type=int, default=10, help="timed repetitions")
  parser.add_argument("--list", action="store_true", help="list the steps and exit")
  parser.add_argument("--dry-run", action="store_true", help="on the CPU: plan, prove harness")
  parser.add_argument(
    "--rehearse", action="store_true", help="with --dry-run: the real steps at tiny shapes"
  )
  args = parser.parse_args(argv)
  try:
    steps = th.select(th.ordered(STEPS), args.only)
  except ValueError as e:
    parser.error(str(e))
  if args.rehearse and not args.dry_run:
    parser.error("--rehearse goes with --dry-run")
  budget = args.budget if args.budget is not None else (math.inf if args.rehearse else 540.0)

  if args.list or args.dry_run:
    print("\n".join(th.plan_lines(steps, budget, th.process_age())))
  if args.list:
    return 0
  if args.dry_run and not args.rehearse:
    out = args.out or tempfile.mkdtemp(prefix="gpu-truth-dry-")
    return _prove_harness(out, th.process_age() + 60.0)  # a minute from now, however slow

  from benchmarks.gpu.common import gpu_device

  gpu = gpu_device()
  if args.rehearse:
    kind, ctx = (
      "cpu (rehearsal: interpret mode, tiny shapes)",
      th.Context(hopper=True, num_sms=1, runs=1, small=True),
    )
  elif gpu is None:
    print(
      "the truth run needs a CUDA GPU; this machine has none (on the CPU: --dry-run, or "
      "--dry-run --rehearse)",
      file=sys.stderr,
    )
    return 2
  else:
    sms = getattr(gpu, "core_count", None) or 132
    cc = getattr(gpu, "compute_capability", "?")
    kind = f"{gpu.device_kind} (compute capability {cc}, {sms} SMs)"
    ctx = th.Context(hopper=is_hopper(gpu.device_kind), num_sms=sms, runs=args.runs)
  env_vars = {
    k: os.environ[k] for k in ("PYTHONPATH", "JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ
  }
  report = th.Report(args.out, th.header(kind, sys.orig_argv, budget, environment=env_vars))
  if not args.out:
    print("no --out and no $OUT: the results are printed only", file=sys.stderr)
  runner = th.Runner(steps, budget, report, rerun=_rerun_command)
  verdicts = runner.run(ctx)
  runner.summary()
  if args.out:
    add_rows(pathlib.Path(args.out) / "truth.json")
  return 1 if any(v.status in ("FAIL", "ERROR") for v in verdicts) else 0
