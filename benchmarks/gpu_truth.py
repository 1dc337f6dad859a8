"""The GPU truth run (issue 34): every kernel that has not met a GPU, checked against XLA at small
shapes, then the timings that ``implementation=None``'s rules wait for, in one command that stops
before its budget.

    PYTHONPATH=. python -m benchmarks.gpu_check --truth [--budget 540] [--out DIR]
        [--only STEP[,STEP...]] [--runs 10] [--list] [--dry-run [--rehearse]]

The steps are :data:`STEPS`, the table at the end of this module: name, priority, estimated
seconds on an H100 (compiles included), function. They run by priority (table order within
one), each skipped (``skipped: budget``) when its estimate would overrun the budget (seconds of
process age, ``--budget``), each writing its verdicts and tables under ``--out`` (default
``$OUT``) as it goes: ``truth.md``, ``truth.json``, tracebacks in ``truth-errors.log``
(:mod:`jaxact._src.test_util.truth`). Priorities:

0. the device and its ceilings (``env``);
1. correctness in bfloat16 of the kernels no GPU has run, or that changed since the last GPU run
   (2026-11-22): the gated MLP's (Triton forward and backward, Mosaic GPU forward), the LM head's
   Hopper forward and backward with every option, the few-bit code kernels (8, 4, 2 bits: Triton
   dense and conv epilogues, Hopper forward and backward), the Triton dense and conv kernels and the
   Hopper dense kernels (one activation of each residual family: identity, relu, gelu), and the
   attention kernel once it exists; Triton's run on Hopper too;
2. the same in float16, then 3. in float32 (Triton only: Mosaic GPU takes 16-bit operands);
4. timings, each against XLA in the same process: the gated MLP forward and backward, the LM head
   at 16384 x 4096 x 128k against the plain composition (and tokamax where it imports), the code
   kernels, a decoder training step with and without jaxact's ops, one layer's step with each code.

Correctness is judged as ``benchmarks.gpu_check``'s ``check`` judges it: the kernel path and the
XLA path at the inputs' dtype, each against the XLA path on float32 inputs at HIGHEST precision;
the kernel may be twice as inexact as XLA plus one rounding of its dtype
(:mod:`jaxact._src.test_util.gpu_compare`). The code kernels keep the same codes as XLA from
inputs whose pre-activation is exact (:mod:`jaxact._src.test_util.gpu_codes`). Shapes are small,
but each Hopper check has more output tiles than an H100 has SMs, so that the persistent kernels
walk a second tile (where run 8's race was).

Adding a kernel is one function and one row of :data:`STEPS` (the attention kernel's row is there
already: it runs once ``jaxact.dot_product_attention`` exists).

``--dry-run`` (on the CPU) lists the steps and proves the harness with stand-in steps: the budget,
the files under ``--out``, the verdict lines, an exception caught; ``tests/test_gpu_truth.py``
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
import math
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp

from jaxact._src.test_util import gpu_codes as gc
from jaxact._src.test_util import gpu_gated, gpu_lce, is_hopper
from jaxact._src.test_util import truth as th
from jaxact._src.test_util.gpu_compare import Comparison

DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
FAMILIES = ("identity", "relu", "gelu")  # one activation a residual: none, output, input
SG = ("silu", "gelu")  # the gated activations of the float16 and float32 rows


def _size(ctx: th.Context, gpu, small):
  return small if ctx.small else gpu


def _judge(ctx: th.Context, kernel: str, check) -> None:
  """Run `check` (``() -> Comparison``) and record its verdict: ok / FAIL with the errors,
  ``skipped: unsupported`` when the kernels refuse the call, ERROR when anything raises."""
  try:
    c = check()
  except NotImplementedError as e:
    ctx.verdict(kernel, "skipped", f"unsupported: {th.one_line(e)}")
    return
  except Exception as e:
    ctx.log(f"{kernel}\n{traceback.format_exc()}")
    ctx.verdict(kernel, "ERROR", th.one_line(e))
    return
  ctx.verdict(kernel, "ok" if c.ok else "FAIL", c.summary())


# ---------------------------------------------------------------------------- correctness


def env(ctx: th.Context):
  """The device and its ceilings (copy bandwidth, bf16 matmul rate)."""
  from benchmarks.gpu_common import gpu_device, section_env

  gpu = gpu_device()
  if gpu is None or ctx.small:
    ctx.verdict("env", "ok", f"no GPU: {jax.devices()[0].device_kind}")
    return [], {}
  info, lines = section_env(gpu, ctx.runs)
  ctx.results["copy_GBps"] = info["copy_GBps"]
  rates = f"copy {info['copy_GBps']:.0f} GB/s, bf16 dot {info['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
  ctx.verdict("env", "ok", rates)
  return lines, info


def dense(ctx: th.Context, dtype: str, impl: str):
  """``dense_bias_act`` through the Triton (``pallas``) or Hopper (``mosaic``) kernels:
  y, dx, dw, db (``benchmarks.gpu_dense.check_case``)."""
  from benchmarks import gpu_dense

  if impl == "pallas":
    shape = _size(ctx, (2, 300, 257, 513), (2, 9, 19, 23))  # ragged in every dimension
  else:
    shape = _size(ctx, (2, 2048, 256, 2048), (128, 64, 256))  # 256 tiles of 128 x 256
  kind = "triton" if impl == "pallas" else "mosaic"
  for i, name in enumerate(FAMILIES):
    kernel = f"dense-{kind} {dtype} {name}"

    def check(name=name, i=i):
      errs, xla, _, error = gpu_dense.check_case(name, DTYPES[dtype], shape, 10 + i, impl)
      if error is not None:
        raise RuntimeError(error)
      return Comparison(("y", "dx", "dw", "db"), tuple(errs), tuple(xla), (DTYPES[dtype],) * 4)

    _judge(ctx, kernel, check)
  return [f"shape (..., K, N) = {shape}"], {"shape": shape}


def conv(ctx: th.Context, dtype: str):
  """``conv_bias_act`` (3x3 SAME) through the Triton epilogue kernels
  (``benchmarks.gpu_conv.check_case``)."""
  from benchmarks import gpu_conv

  xs, ws = _size(ctx, ((4, 28, 28, 24), (3, 3, 24, 100)), ((1, 5, 5, 3), (3, 3, 3, 8)))
  for i, name in enumerate(FAMILIES):

    def check(name=name, i=i):
      errs, xla, _ = gpu_conv.check_case(name, DTYPES[dtype], xs, ws, 20 + i)
      return Comparison(("y", "dx", "dw", "db"), tuple(errs), tuple(xla), (DTYPES[dtype],) * 4)

    _judge(ctx, f"conv-triton {dtype} {name}", check)
  return [f"x {xs}, w {ws}"], {"x": xs, "w": ws}


def codes(
  ctx: th.Context, dtype: str, op: str, impl: str, cases=(("gelu", 8), ("gelu", 4), ("gelu", 2))
):
  """Few-bit derivative codes through the kernels against XLA's: y, the kept codes, dx, dw, db
  (``test_util.gpu_codes.check``, exact pre-activations)."""
  from benchmarks import gpu_codes

  if op == "dense":
    shape = _size(ctx, gpu_codes.CHECK_DENSE, (128, 64, 256))
    args = gc.exact_dense(shape, jnp.dtype(DTYPES[dtype]), 30)
  else:
    shape = _size(ctx, gpu_codes.CHECK_CONV, ((2, 6, 6, 3), (3, 3, 3, 16)))
    args = gc.exact_conv(*shape, jnp.dtype(DTYPES[dtype]), 31)
  kind = {"pallas": "triton", "mosaic": "mosaic"}[impl]
  for name, bits in cases:
    kernel = f"codes-{kind}-{op} {dtype} {name} {bits}-bit"
    try:
      c = gc.check(op, impl, name, bits, args)
    except Exception as e:
      ctx.log(f"{kernel}\n{traceback.format_exc()}")
      ctx.verdict(kernel, "ERROR", th.one_line(e))
      continue
    if c.error is not None:
      status = "skipped" if c.error.startswith("NotImplementedError") else "ERROR"
      ctx.verdict(kernel, status, ("unsupported: " if status == "skipped" else "") + c.error[:300])
      continue
    detail = (
      f"y {c.y_ulps:.1f} eps off, codes {c.code_diff} of {c.code_count} differ (max step "
      f"{c.code_step}), grads vs xla {max(c.errs):.1e}"
    )
    ctx.verdict(kernel, "ok" if c.ok else "FAIL", detail)
  return [f"shape {shape}"], {"shape": shape}


def gated(ctx: th.Context, dtype: str, impl: str, activations=gpu_gated.ACTIVATIONS):
  """``gated_mlp`` with every bias through the Triton kernels (``pallas``) or the Hopper forward
  (``mosaic``) against XLA's: y and the gradients of x, the kernels and the biases."""
  if impl == "pallas":
    shape = _size(ctx, (2, 300, 257, 1000, 200), (2, 10, 24, 40, 16))  # (..., D, F, O), ragged
  else:
    shape = _size(ctx, (4096, 256, 1024, 256), (128, 64, 128, 64))  # 256 CTA tiles of 128 x 128
  kind = "triton" if impl == "pallas" else "mosaic"
  for name in activations:
    _judge(
      ctx,
      f"gated-{kind} {dtype} {name}",
      functools.partial(gpu_gated.check, name, impl, shape, jnp.dtype(DTYPES[dtype])),
    )
  return [f"shape (..., D, F, O) = {shape}"], {"shape": shape}


def lce(ctx: th.Context, dtype: str, cases=tuple(gpu_lce.OPTION_CASES)):
  """``linear_cross_entropy(..., implementation="mosaic")`` (the Hopper forward and backward
  kernels) against XLA's, for each option: the loss and the gradients of x, w and the bias."""
  shape = _size(ctx, (1024, 256, 8192), (128, 64, 512))  # (tokens, D, V): 256 CTA tiles
  for case in cases:
    _judge(
      ctx,
      f"lce-mosaic {dtype} {case}",
      functools.partial(gpu_lce.check, case, "mosaic", shape, jnp.dtype(DTYPES[dtype])),
    )
  return [f"(tokens, D, V) = {shape}"], {"shape": shape}


def attention(ctx: th.Context, dtype: str):
  """``jaxact.dot_product_attention`` through its kernels against XLA's, causal and not, with a
  logit soft cap; recorded as skipped until the attention op exists."""
  import jaxact

  fn = getattr(jaxact, "dot_product_attention", None)
  if fn is None:
    ctx.verdict("attention", "skipped", "no jaxact.dot_product_attention yet (issue 32)")
    return [], {}
  from jaxact._src.test_util.gpu_compare import compare_to_xla

  b, t, n, h = _size(ctx, (2, 1024, 4, 128), (1, 16, 2, 16))
  keys = jax.random.split(jax.random.key(40), 3)
  qkv = [jax.random.normal(k, (b, t, n, h), jnp.float32).astype(DTYPES[dtype]) for k in keys]
  for options in ({"is_causal": False}, {"is_causal": True}, {"logits_soft_cap": 30.0}):

    def build(impl, precision, options=options):
      def f(q, k, v):
        with jax.default_matmul_precision("highest" if precision else None):
          return fn(q, k, v, implementation=impl, **options)

      return f

    for impl in ("pallas", "mosaic"):
      label = ",".join(f"{key}={val}" for key, val in options.items())
      _judge(
        ctx,
        f"attention-{impl} {dtype} {label}",
        lambda build=build, impl=impl: compare_to_xla(
          build, qkv, impl, names=("y", "dq", "dk", "dv")
        ),
      )
  return [f"(B, T, N, H) = {(b, t, n, h)}"], {}


# ---------------------------------------------------------------------------------- timings


def _ratio_verdict(ctx, kernel: str, t: float, base: float, label: str = "xla") -> None:
  if math.isfinite(t) and math.isfinite(base):
    ctx.verdict(kernel, "ok", f"{1e3 * t:.3f} ms, {t / base:.2f}x {label}")
  else:
    ctx.verdict(kernel, "ERROR", "not timed")


def time_gated(ctx: th.Context):
  """gated_mlp (SwiGLU) in bfloat16, forward and forward + backward: the jax.nn composition,
  jaxact's XLA path, the Triton kernels, the Hopper forward, and None."""
  from benchmarks import gated as gated_bench
  from benchmarks.gpu_common import median_seconds

  tokens, d, f = _size(ctx, gated_bench.GPU_SIZE, (128, 64, 128))
  runs = 1 if ctx.small else ctx.runs
  sets = []
  for s in range(2):
    x, wg, wu, wd, *_ = gpu_gated.operands((tokens, d, f, d), jnp.bfloat16, 50 + s)
    g = jax.random.normal(jax.random.key(60 + s), (tokens, d), jnp.float32).astype(jnp.bfloat16)
    sets.append((x, wg, wu, wd, g))

  def composition(x, wg, wu, wd):
    return jnp.dot(jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)

  paths = {"jaxact xla": functools.partial(_gated_mlp, implementation="xla"), "jax.nn": composition}
  for impl in ("pallas", "mosaic", None):
    if impl == "mosaic" and not ctx.hopper:
      continue
    paths[f"jaxact {impl}"] = functools.partial(_gated_mlp, implementation=impl)
  lines = [
    f"gated MLP (SwiGLU), (tokens, D, F) = {(tokens, d, f)}, bfloat16",
    "",
    "| path | fwd ms | / xla | fwd+bwd ms | / xla |",
    "|---|---|---|---|---|",
  ]
  times = {}
  for label, fn in paths.items():

    def step(x, wg, wu, wd, g, fn=fn):
      y, pull = jax.vjp(fn, x, wg, wu, wd)
      return y, *pull(g)

    try:
      t_f = median_seconds(jax.jit(fn), [s[:4] for s in sets], runs)
      t_s = median_seconds(jax.jit(step), sets, runs)
    except Exception as e:
      ctx.log(f"time-gated {label}\n{traceback.format_exc()}")
      ctx.verdict(f"time-gated {label}", "ERROR", th.one_line(e))
      continue
    times[label] = (t_f, t_s)
    base = times.get("jaxact xla", (math.nan, math.nan))
    lines.append(
      f"| {label} | {1e3 * t_f:.3f} | {t_f / base[0]:.2f} | {1e3 * t_s:.3f} | {t_s / base[1]:.2f} |"
    )
    ctx.verdict(
      f"time-gated {label}",
      "ok",
      f"fwd {1e3 * t_f:.3f} ms {t_f / base[0]:.2f}x xla, fwd+bwd {1e3 * t_s:.3f} ms "
      f"{t_s / base[1]:.2f}x xla",
    )
  return lines, {k: list(v) for k, v in times.items()}


def _gated_mlp(x, wg, wu, wd, implementation):
  import jaxact

  return jaxact.gated_mlp(x, wg, wu, wd, implementation=implementation)


def time_lce(ctx: th.Context):
  """The LM head's loss at 16384 x 4096 x 128k, bfloat16, fwd+bwd and loss alone: the plain
  composition, jaxact's XLA path, the Hopper kernels, the forward kernel alone, tokamax where it
  imports (``benchmarks.gpu_lce.time_table``)."""
  from benchmarks import gpu_lce as lce_bench

  size = _size(ctx, lce_bench.SIZES[0], (128, 64, 512))
  runs = 1 if ctx.small else min(ctx.runs, 5)
  data, lines = lce_bench.time_table(runs, ctx.hopper, sizes=(size,))
  for failure in data.pop("failed"):
    ctx.verdict(f"time-lce {failure.split(': ')[0]}", "ERROR", failure.split(": ", 1)[1])
  base = data.get(f"{size} plain")
  for key, (t_step, t_fwd) in data.items():
    label = key.split(") ", 1)[1]
    if base:
      ctx.verdict(
        f"time-lce {label}",
        "ok",
        f"fwd+bwd {1e3 * t_step:.1f} ms {t_step / base[0]:.2f}x plain, loss "
        f"{1e3 * t_fwd:.1f} ms {t_fwd / base[1]:.2f}x plain",
      )
  return lines, {k: list(v) for k, v in data.items()}


def time_codes_kernels(ctx: th.Context):
  """The conv epilogue kernels alone, exact and with each code, against XLA's fusion
  (``benchmarks.gpu_codes.kernel_table``)."""
  from benchmarks import gpu_codes
  from benchmarks.gpu_conv import CONV_W, CONV_X

  rows, c = _size(ctx, (math.prod(CONV_X[:-1]), CONV_W[-1]), (200, 32))
  copy = ctx.results.get("copy_GBps")
  out, lines = gpu_codes.kernel_table(
    1 if ctx.small else ctx.runs, copy, rows, c, interpret=ctx.small
  )
  for r in out:
    _ratio_verdict(ctx, f"time-codes-kernels {r['pass']}", r["s"], r["xla_s"])
  return lines, out


def time_codes_hopper(ctx: th.Context):
  """The Hopper forward alone writing y and z or y and each code, against ``jnp.dot``
  (``benchmarks.gpu_codes.hopper_table``)."""
  from benchmarks import gpu_codes

  shape = _size(ctx, gpu_codes.DENSE, (128, 64, 256))
  out, lines = gpu_codes.hopper_table(
    1 if ctx.small else ctx.runs, ctx.num_sms, shape=shape, interpret=ctx.small
  )
  base = out[0]["s"]
  for r in out[1:]:
    _ratio_verdict(ctx, f"time-codes-hopper {r['path']}", r["s"], base, "jnp.dot")
  return lines, out


def time_codes_step(ctx: th.Context):
  """One dense and one conv layer's training step, exact and with each code, per implementation
  (``benchmarks.gpu_codes.step_table``)."""
  from benchmarks import gpu_codes
  from benchmarks.gpu_conv import CONV_W, CONV_X

  dense_shape = _size(ctx, gpu_codes.DENSE, (128, 64, 256))
  conv_shape = _size(ctx, (CONV_X, CONV_W), ((2, 6, 6, 3), (3, 3, 3, 16)))
  out, lines = gpu_codes.step_table(
    1 if ctx.small else ctx.runs, ctx.hopper, dense=dense_shape, conv=conv_shape
  )
  exact = {(r["op"], r["impl"]): r["s"] for r in out if r["bits"] is None}
  for r in out:
    base = exact.get((r["op"], r["impl"]), math.nan)
    _ratio_verdict(
      ctx, f"time-codes-step {r['op']} {r['impl']} {gc.label(r['bits'])}", r["s"], base, "exact"
    )
  return lines, out


def time_decoder(ctx: th.Context):
  """A Llama-style decoder's training step (``benchmarks.lce``'s: 2 scanned blocks of RMS norm,
  causal attention, a SwiGLU MLP; final norm and head), bfloat16, 16 x 1024 tokens, D 4096,
  F 14336, V 128256: Flax's composition and optax's loss, against jaxact's rms_norm, gated_mlp and
  linear_cross_entropy with ``implementation=None`` and with the kernels asked for."""
  import dataclasses

  import optax
  from jax import lax

  import jaxact
  from benchmarks import lce as lce_bench
  from benchmarks.gpu_common import median_seconds

  c = dataclasses.replace(lce_bench.DECODER_GPU, blocks=2)
  if ctx.small:
    c = dataclasses.replace(c, batch=1, seq=128, dim=64, hidden=128, heads=2, vocab=512, blocks=1)
  kernels = "mosaic" if ctx.hopper else "pallas"

  def loss_of(norm, mlp, head):
    block = lce_bench.make_block(mlp, c.heads, norm)

    def loss(params, tokens, labels):
      x = params["embed"][tokens]
      x, _ = lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
      h = norm(x, params["norm"])
      return head(h, params["head"], labels)

    return loss

  def plain_head(h, w, labels):
    logits = jnp.dot(h, w)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def jaxact_mlp(impl):
    return lambda h, p: jaxact.gated_mlp(
      h, p["w_gate"], p["w_up"], p["w_down"], implementation=impl
    )

  def jaxact_head(impl):
    return lambda h, w, labels: jaxact.linear_cross_entropy(h, w, labels, implementation=impl)

  paths = {
    "Flax + optax": loss_of(lce_bench.rms_norm, lce_bench._flax_mlp, plain_head),
    "jaxact None": loss_of(lce_bench.jaxact_rms_norm, jaxact_mlp(None), jaxact_head(None)),
    f"jaxact {kernels}": loss_of(
      lce_bench.jaxact_rms_norm,
      jaxact_mlp(kernels),
      jaxact_head("mosaic" if ctx.hopper else None),
    ),
  }
  shapes = lce_bench.decoder_shapes(c)
  leaves, tree = jax.tree.flatten(shapes[0])
  keys = jax.random.split(jax.random.key(70), len(leaves) + 1)
  params = jax.tree.unflatten(
    tree,
    [
      (jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype)
      for k, s in zip(keys, leaves, strict=False)
    ],
  )
  tokens = jax.random.randint(keys[-1], (c.batch, c.seq), 0, c.vocab, jnp.int32)
  labels = jnp.roll(tokens, -1, axis=1)
  runs = 1 if ctx.small else min(ctx.runs, 3)
  lines = [
    f"decoder {c}",
    "",
    "| path | step ms | / Flax + optax |",
    "|---|---|---|",
  ]
  times = {}
  for label, loss in paths.items():
    try:
      step = jax.jit(jax.value_and_grad(loss))
      times[label] = median_seconds(step, [(params, tokens, labels)], runs)
    except Exception as e:
      ctx.log(f"time-decoder {label}\n{traceback.format_exc()}")
      ctx.verdict(f"time-decoder {label}", "ERROR", th.one_line(e))
      continue
    base = times.get("Flax + optax", math.nan)
    lines.append(f"| {label} | {1e3 * times[label]:.1f} | {times[label] / base:.2f} |")
    _ratio_verdict(ctx, f"time-decoder {label}", times[label], base, "Flax + optax")
  return lines, times


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
  Step("attention-bf16",          1,  20, P(attention, dtype="bf16"),
       "attention kernels (once jaxact.dot_product_attention exists)"),
  # 2: float16
  Step("gated-triton-f16",        2,  10, P(gated, dtype="f16", impl="pallas", activations=SG),
       "gated MLP: Triton"),
  Step("gated-mosaic-f16",        2,  12, P(gated, dtype="f16", impl="mosaic", activations=SG),
       "gated MLP: Hopper forward", H),
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
  # 3: float32 (the Mosaic GPU kernels take 16-bit operands only)
  Step("gated-triton-f32",        3,  10, P(gated, dtype="f32", impl="pallas", activations=SG),
       "gated MLP: Triton"),
  Step("codes-triton-dense-f32",  3,  15, P(codes, dtype="f32", op="dense", impl="pallas"),
       "codes: Triton dense"),
  Step("codes-triton-conv-f32",   3,  12, P(codes, dtype="f32", op="conv", impl="pallas"),
       "codes: conv epilogue"),
  Step("dense-triton-f32",        3,  15, P(dense, dtype="f32", impl="pallas"),
       "Triton dense"),
  Step("conv-triton-f32",         3,  12, P(conv, dtype="f32"),
       "conv epilogue"),
  # 4: timings, each against XLA in this process
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
)
# fmt: on


# ------------------------------------------------------------------------------ the command


def _standins() -> tuple[Step, ...]:
  """Steps that exercise the harness on the CPU in a second: what each verdict looks like."""
  import jaxact
  from jaxact._src.test_util.gpu_compare import compare_to_xla

  def build(impl, precision):
    return lambda x, w, b: jaxact.dense_bias_act(
      x, w, b, activation="gelu", precision=precision, implementation=impl
    )

  def ok(ctx):
    shapes = ((4, 8), (8, 16), (16,))
    keys = jax.random.split(jax.random.key(0), len(shapes))
    args = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]
    _judge(ctx, "standin-check f32 gelu", lambda: compare_to_xla(build, args, "xla"))
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
  "standin-check f32 gelu": "ok",
  "standin-fail": "FAIL",
  "standin-error": "ERROR",
  "standin-hopper": "skipped",
  "standin-budget": "skipped",
}


def _prove_harness(out: str, budget: float) -> int:
  """Run the stand-ins under `out` and read the files back: 0 when every verdict, file and
  line is what the harness promises."""
  report = th.Report(out, th.header("cpu (dry run)", sys.orig_argv, budget))
  runner = th.Runner(_standins(), budget, report)
  got = {v.kernel: v.status for v in runner.run(th.Context())}
  report.summary(_rerun_command(runner.redo, budget))
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


def _rerun_command(names, budget) -> str | None:
  if not names:
    return None
  return (
    f"PYTHONPATH=. python -m benchmarks.gpu_check --truth --only {','.join(names)} "
    "--out $OUT --budget <seconds left - 40>"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.gpu_check --truth", description=__doc__.splitlines()[0]
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
    return _prove_harness(out, 60.0)

  from benchmarks.gpu_common import gpu_device

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
  runner = th.Runner(steps, budget, report)
  verdicts = runner.run(ctx)
  report.summary(_rerun_command(runner.redo, budget))
  return 1 if any(v.status in ("FAIL", "ERROR") for v in verdicts) else 0


if __name__ == "__main__":
  sys.exit(main())
