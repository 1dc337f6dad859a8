"""The GPU truth run's timing of the convolutional networks' training steps (issue 41): ResNet-50
and the U-Net block stack of ``benchmarks.cnn_models`` in bfloat16, each way against Flax's step in
this process (time and compiled temp): what the CPU cannot say about the ways that recompute a
convolution (block remat, ``ConvNormAct``) against those that do not (the drop-ins,
``NormActConv``), and Flax's own step under the one line (``jaxact.linen.intercept``, issue 56:
its step-time goal, 1.05x Flax's, is measured on CPU only)."""

from __future__ import annotations

import contextlib
import math
import traceback

import jax
import jax.numpy as jnp

from benchmarks.gpu.truth_timings import _ratio_verdict
from support import truth as th

# The ways timed: Flax's step first (the ratios' base), then what a user would pick instead.
WAYS = {
  "resnet": ("flax", "flax-remat", "jaxact-bn", "jaxact-cna", "one-line"),
  "unet": ("flax", "flax-remat", "jaxact-gn", "jaxact-nac", "jaxact-nac-remat", "one-line"),
}
ONE_LINE = "one-line"  # Flax's step ("flax") traced under jaxact.linen.intercept()


def time_cnn(ctx: th.Context):
  """ResNet-50 (batch 64, 224 x 224) and 4 U-Net blocks (32 x 64 x 64 x 256), bfloat16: one
  training step's ``jit(value_and_grad)`` each way, its time over Flax's and its compiled temp."""
  from benchmarks import cnn_models as models
  from benchmarks.cnn import concrete
  from benchmarks.gpu.common import median_seconds
  from jaxact import linen as jnn

  runs = 1 if ctx.small else min(ctx.runs, 5)
  steps = {
    "resnet": lambda v: models.resnet_step(
      v, ctx.pick((64, 224, 224, 3), (2, 32, 32, 3)), jnp.bfloat16, classes=ctx.pick(1000, 10)
    ),
    "unet": lambda v: models.unet_step(
      v, ctx.pick((32, 64, 64, 256), (2, 8, 8, 64)), 4, jnp.bfloat16
    ),
  }
  lines = ["| model | way | step ms | / Flax | temp MiB |", "|---|---|---|---|---|"]
  data = {}
  for model, ways in WAYS.items():
    base = math.nan
    for way in ways:
      name = f"time-cnn {model} {way}"
      try:
        step, shapes = steps[model]("flax" if way == ONE_LINE else way)
        args = concrete(shapes)
        with jnn.intercept() if way == ONE_LINE else contextlib.nullcontext():
          compiled = jax.jit(step).lower(*args).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        seconds = median_seconds(compiled, [args], runs)
      except Exception as e:
        ctx.log(f"{name}\n{traceback.format_exc()}")
        ctx.verdict(name, "ERROR", th.one_line(e))
        continue
      base = seconds if way == "flax" else base
      data[f"{model} {way}"] = [seconds, temp]
      lines.append(f"| {model} | {way} | {1e3 * seconds:.2f} | {seconds / base:.2f} | {temp:.0f} |")
      if way != "flax":
        _ratio_verdict(ctx, name, seconds, base, "Flax")
  return lines, data
