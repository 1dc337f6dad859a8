"""`python -m benchmarks norms [--sections stack,stack-h100,stack-tpu,decoder,...]`.

jaxact's output-keeping RMS norm against the plain one (Flax's formula, differentiated by JAX):

* ``stack`` / ``stack-h100``: the gated stack of :mod:`benchmarks.gated` (``x = x +
  mlp(rms_norm(x))``, 1, 2 and 8 blocks, scanned and unrolled), CPU float32 (4096 tokens, D = 512,
  F = 1408) and compiled for an H100 (bfloat16, 8192 x 4096 x 11008): compiled temp, growth per
  block and its ratio to Flax's (Flax MLP, plain norm), for the Flax MLP, Flax + block remat and
  ``jaxact.gated_mlp``, each with the plain norm and with ``jaxact.rms_norm``;
* ``decoder`` / ``decoder-h100``: the Llama-style decoder step of :mod:`benchmarks.lce` (RMS norms
  before attention, before the MLP and before the head), without remat: jaxact's norms against
  the plain ones, with ``jaxact.gated_mlp`` and the fused head, and with Flax's MLP and head;
* ``stack-tpu`` / ``decoder-tpu``: the H100 sections compiled for TPU chips (``--chip``, v5p and
  v6e unless told; the stacks scanned): compiled temp a chip, and each step's time (the 8-block
  stack's) ESTIMATED from XLA's cost analysis against the chip's published peaks;
* ``time``: CPU step time of the scanned gated stack, jaxact's norm against the plain one;
* ``precision``: bfloat16, how far the normalized input recovered from ``y`` (``y / gamma``) and
  the input gradient are from float64, against the input-keeping formula.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
import support
from benchmarks import decoder, gated
from benchmarks.harness import blocks, chips, memory, rows, timing
from benchmarks.tables import norms as page

MiB = 2**20
SECTIONS = page.SECTIONS
# What a TPU row adds of its largest step's figures (harness.chips.figures)
TPU_FIGURES = ("total_bytes", "estimate_s", "unknown_loops", "over_hbm")


def _plain(x):
  return gated.rms_norm(x)


def _ours(x):
  return jaxact.rms_norm(x, epsilon=gated.EPS)


NORMS = {"plain norm": _plain, "jaxact.rms_norm": _ours}
MLPS = {
  "Flax MLP": (gated._flax_mlp, None),
  "Flax MLP + block remat": (gated._flax_mlp, jax.checkpoint_policies.nothing_saveable),
  "jaxact.gated_mlp": (gated._jaxact_mlp, None),
}


def _block(mlp, norm, policy):
  def block(x, p):
    return x + mlp(norm(x), *p)

  return block if policy is None else jax.checkpoint(block, policy=policy)


def stack_rows(gpu: bool, chip: str | None = None, cache=None) -> list[str]:
  """The stacks on CPU or compiled for an H100 (`gpu`), or with `chip` for that TPU chip at the
  H100's sizes (scanned, as a TPU user's stack is; each 8-block step's time ESTIMATED)."""
  gpu = gpu or chip is not None
  size, dtype = (gated.GPU_SIZE, jnp.bfloat16) if gpu else (gated.CPU_SIZE, jnp.float32)
  layouts = (True,) if chip else (True, False)
  temps, tpu = {}, {}
  for scan in layouts:
    for mlp_name, (mlp, policy) in MLPS.items():
      for norm_name, norm in NORMS.items():
        _, loss = blocks.stack(_block(mlp, norm, policy), scan)
        for n in (1, 2, gated.BLOCKS):
          args = gated.shapes(n, size, dtype)
          if chip is not None:
            tpu[scan, mlp_name, norm_name, n] = memory.tpu_memory(loss, *args, chip, cache)
            m = tpu[scan, mlp_name, norm_name, n]["temp_bytes"]
          else:
            m = memory.gpu_memory(loss, *args)[0] if gpu else memory.cpu_memory(loss, *args)
          temps[scan, mlp_name, norm_name, n] = m
  section = "stack-tpu" if chip else "stack-h100" if gpu else "stack"
  for scan in layouts:

    def growth(mlp_name, norm_name, scan=scan):
      return (
        temps[scan, mlp_name, norm_name, gated.BLOCKS] - temps[scan, mlp_name, norm_name, 2]
      ) / (gated.BLOCKS - 2)

    flax = growth("Flax MLP", "plain norm")
    for mlp_name in MLPS:
      for norm_name in NORMS:
        t = [temps[scan, mlp_name, norm_name, n] for n in (1, 2, gated.BLOCKS)]
        g, stack = growth(mlp_name, norm_name), "scan" if scan else "unrolled"
        case = f"{stack}, {mlp_name}, {norm_name}"
        if chip is not None:
          case = f"{chip}, {case}"
          last = tpu[scan, mlp_name, norm_name, gated.BLOCKS]
          extra = {"chip": chip, **{k: last.get(k) for k in TPU_FIGURES}}
        rows.add(
          section,
          case,
          size=list(size),
          stack=stack,
          mlp=mlp_name,
          norm=norm_name,
          blocks=[1, 2, gated.BLOCKS],
          temp_bytes=t,
          growth_bytes=g,
          growth_vs_flax=g / flax,
          **(extra if chip else {}),
        )
  return page.tables(rows.current().rows, section)


def decoder_rows(gpu: bool, chip: str | None = None, cache=None) -> list[str]:
  """The decoder on CPU or compiled for an H100 (`gpu`), or with `chip` for that TPU chip at
  the H100's sizes (each step's time ESTIMATED)."""
  c = decoder.DECODER_GPU if gpu or chip else decoder.DECODER_CPU
  section = "decoder-tpu" if chip else "decoder-h100" if gpu else "decoder"
  for body, head in (("jaxact", "fused"), ("flax", "plain"), ("flax_remat", "fused")):
    extra, case = {}, f"{decoder.BODY_LABELS[body]}, {head}"
    if chip is not None:
      found = [
        decoder.decoder_figures(c, body, head, chip, norm, cache)
        for norm in (decoder.rms_norm, decoder.jaxact_rms_norm)
      ]
      plain, ours = (f["temp_bytes"] for f in found)
      case, extra["chip"] = f"{chip}, {case}", chip
      for name, f in zip(("plain", "jaxact"), found, strict=True):
        extra |= {f"{name}_{k}": f.get(k) for k in TPU_FIGURES}
    else:
      plain = decoder.decoder_temp(c, body, head, gpu)
      ours = decoder.decoder_temp(c, body, head, gpu, norm=decoder.jaxact_rms_norm)
    rows.add(
      section,
      case,
      config=str(c),
      body=decoder.BODY_LABELS[body],
      head=head,
      plain_bytes=plain,
      jaxact_bytes=ours,
      ratio=ours / plain,
      **extra,
    )
  return page.tables(rows.current().rows, section)


def time_rows(runs: int) -> list[str]:
  params, x = gated.make(gated.BLOCKS, gated.CPU_SIZE, jnp.float32)
  calls = []
  for mlp_name in ("Flax MLP", "jaxact.gated_mlp"):
    mlp, policy = MLPS[mlp_name]
    for norm in NORMS.values():
      _, loss = blocks.stack(_block(mlp, norm, policy), True)
      step = jax.jit(jax.value_and_grad(loss))
      calls.append(functools.partial(step, params, x))
  base, ratios = timing.alternated_ratios(calls, runs)
  labels = [f"{m}, {n}" for m in ("Flax MLP", "jaxact.gated_mlp") for n in NORMS]
  for label, r in zip(labels, [1.0, *ratios], strict=True):
    size = list(gated.CPU_SIZE)
    rows.add("time", label, blocks=gated.BLOCKS, size=size, first_seconds=base, runs=runs, ratio=r)
  return page.tables(rows.current().rows, "time")


def precision_rows() -> list[str]:
  t, d = 4096, 1024
  k = jax.random.split(jax.random.key(0), 3)
  x = (jax.random.normal(k[0], (t, d), jnp.float32) * 3 + 1).astype(jnp.bfloat16)
  scale = jax.random.normal(k[1], (d,), jnp.float32)
  g = jax.random.normal(k[2], (t, d), jnp.float32).astype(jnp.bfloat16)
  x64 = np.asarray(x, np.float64)
  r = 1 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + gated.EPS)
  x_hat = x64 * r
  y = jaxact.rms_norm(x, scale, epsilon=gated.EPS)
  from_y = np.asarray(y, np.float64) / np.asarray(scale, np.float64)
  from_x = np.asarray(x, np.float32) * np.asarray(r, np.float32)

  def rel(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))

  def dx(f):
    return np.asarray(jax.vjp(f, x)[1](g)[0], np.float64)

  dx_ref = jax.vjp(
    lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + gated.EPS) * scale,
    jnp.asarray(x64),
  )[1](jnp.asarray(np.asarray(g, np.float64)))[0]
  dx_ref = np.asarray(dx_ref)
  ours = dx(lambda x: jaxact.rms_norm(x, scale, epsilon=gated.EPS))
  inputs = dx(lambda x: jaxact.rms_norm(x, scale, epsilon=gated.EPS, residual="input"))
  plain = dx(lambda x: (gated.rms_norm(x).astype(jnp.float32) * scale).astype(jnp.bfloat16))
  errors = {
    "x_hat recovered from the bfloat16 y (y / gamma)": rel(from_y, x_hat),
    "x_hat from the bfloat16 x (float32 arithmetic)": rel(from_x, x_hat),
    "dx, jaxact.rms_norm (keeps y)": rel(ours, dx_ref),
    "dx, jaxact.rms_norm(residual='input')": rel(inputs, dx_ref),
    "dx, JAX autodiff of the plain norm": rel(plain, dx_ref),
  }
  for q, e in errors.items():
    rows.add("precision", q, tokens=t, dim=d, relative_rms_error=e)
  return page.tables(rows.current().rows, "precision")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sections", default=",".join(s for s in SECTIONS if not s.endswith("-tpu")))
  parser.add_argument("--runs", type=int, default=7)
  parser.add_argument("--chip", default=",".join(chips.TPU_CHIPS), help="TPU chips (-tpu sections)")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled TPU figures' JSON (-tpu)")
  a = parser.parse_args(argv)
  wanted = a.sections.split(",")
  if unknown := [s for s in wanted if s not in SECTIONS]:
    parser.error(f"sections {unknown} are not known; choose from {', '.join(SECTIONS)}")
  if any(name.endswith("-h100") for name in wanted):
    support.use_gpu_compiler()  # before the first computation starts jax's backends
  if any(name.endswith("-tpu") for name in wanted) and (why := chips.available()):
    print(f"benchmarks.norms: {why}", file=sys.stderr)
    return 2
  tpus = chips.chips(a.chip)

  def on_tpus(section_rows, name: str):
    def run() -> list[str]:
      for chip in tpus:
        section_rows(False, chip, a.cache)
      return page.tables(rows.current().rows, name)

    return run

  out = {
    "stack": lambda: stack_rows(False),
    "stack-h100": lambda: stack_rows(True),
    "stack-tpu": on_tpus(stack_rows, "stack-tpu"),
    "decoder": lambda: decoder_rows(False),
    "decoder-h100": lambda: decoder_rows(True),
    "decoder-tpu": on_tpus(decoder_rows, "decoder-tpu"),
    "time": lambda: time_rows(a.runs),
    "precision": precision_rows,
  }
  print(f"jax {jax.__version__}")
  for name in wanted:
    print(f"\n{page.heading(name)}\n")
    print("\n".join(out[name]()), flush=True)
  return 0
