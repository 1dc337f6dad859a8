"""`python -m benchmarks [JOB] [options]`: every measurement of jaxact, one command line.

Without a job it runs the main job (`benchmarks.suite`): `python -m benchmarks [--quick] [--out
DIR]`. A job's options follow its name (`python -m benchmarks gated --help`). Each job adds its
measurements as rows of data (`benchmarks.harness.rows`), written to its output folder, and draws
the tables it prints from them.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys


@dataclasses.dataclass(frozen=True)
class Job:
  module: str  # a module of `benchmarks` with `main(argv)`
  summary: str  # one line for `--help`
  cpu: bool = False  # compiles for a GPU on this machine: jax must never look for one


JOBS = {
  "main": Job("suite", "the main job: every way to train each model, its memory-time frontier"),
  "activations": Job("suite", "the main job's activation sections alone (memory, time, NaN)"),
  "sweep": Job("sweep", "every float32/bfloat16/float16 bit pattern through each activation"),
  "fused": Job("fused", "dense_bias_act / conv_bias_act against the jax.nn composition"),
  "flax": Job("fused_flax", "Flax linen and nnx models against jaxact's layers: memory"),
  "gated": Job("gated", "gated MLP stacks against Flax, Flax + remat and tokamax", cpu=True),
  "norms": Job("norms", "rms_norm / layer_norm in the gated stack and the decoder", cpu=True),
  "cnn": Job("cnn", "ResNet-50 and U-Net blocks: BatchNorm/GroupNorm + act, ConvNormAct", cpu=True),
  "moe": Job(
    "moe", "MoE block stacks: jaxact.moe_mlp against the plain ragged composition", cpu=True
  ),
  "lce": Job("lce", "the LM head and its loss against the plain composition", cpu=True),
  "posttrain": Job(
    "posttrain", "GRPO and distillation steps' LM head: memory, fits, time", cpu=True
  ),
  "attention": Job("attention", "dot_product_attention in a decoder step", cpu=True),
  "codes": Job("codes", "few-bit derivative codes: memory and step time", cpu=True),
  "fewbit": Job("codes_training", "few-bit codes: training parity with exact derivatives"),
  "lm": Job("lm", "a byte-level LM trained with Flax and with jaxact: the losses"),
  "dropin": Job("dropin", "jaxact swapped into a Flax example's MLP block"),
  "gemma": Job("gemma", "Flax's Gemma example ported to jaxact"),
  "oneline": Job(
    "oneline", "Flax's lm1b (linen, nnx) and ResNet-50 unchanged under the one line", cpu=True
  ),
  "h100": Job(
    "h100", "the main job's frontiers compiled for an H100, step time estimated", cpu=True
  ),
  "tpu": Job(
    "tpu", "the main job's frontiers compiled for a TPU chip, step time estimated", cpu=True
  ),
  "aot": Job("aot", "compiled for an H100 and an A100 on this machine: memory, spills", cpu=True),
  "gpu": Job("gpu.check", "on a GPU: kernels against XLA, timings (--truth: the prepared run)"),
  "hlo": Job("gpu.hlo_dump", "one bf16 layer's optimized HLO per path, to a folder"),
  "render": Job("render", "the README's Measured block and results pages from committed rows"),
}


def usage() -> str:
  width = max(map(len, JOBS))
  lines = [f"  {name:<{width}}  {job.summary}" for name, job in JOBS.items()]
  return "jobs (python -m benchmarks JOB --help for a job's options):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  name = argv[0] if argv and not argv[0].startswith("-") else "main"
  rest = argv[1:] if argv and argv[0] == name else argv
  job = JOBS.get(name)
  if job is None:
    print(f"python -m benchmarks: job {name!r} is not known\n{usage()}", file=sys.stderr)
    return 2
  if job.cpu:  # before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.argv = [f"python -m benchmarks {name}" if name != "main" else "python -m benchmarks", *rest]
  module = importlib.import_module(f"benchmarks.{job.module}")
  from benchmarks.harness import rows

  with rows.recording(name, rest) as recorder:
    try:
      code = module.main(rest) if job.module != "suite" else module.main(rest, job=name)
    finally:  # what a stopped or failed run measured is kept
      recorder.write()
  return code if isinstance(code, int) else 0


if __name__ == "__main__":
  raise SystemExit(main())
