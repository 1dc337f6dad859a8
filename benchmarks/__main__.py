"""`python -m benchmarks [--quick] [--out DIR]`: jaxact vs jax.nn, measured in one run.

Prints the summary tables and writes them to DIR/results.md. `--quick` keeps the same model sizes
(memory figures come from XLA's compiled buffer assignment and do not need long runs) but times
fewer repetitions and a subset of activations.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pathlib
import platform
import sys
import time

import jax

# float64 is one of the dtypes measured; every other array here is created with an explicit dtype.
jax.config.update("jax_enable_x64", True)

import jaxact  # noqa: E402
from benchmarks import activations as bench  # noqa: E402
from benchmarks import fused_memory as fused  # noqa: E402

QUICK_TIMED = ("sigmoid", "tanh", "relu", "elu", "softplus", "gelu", "silu", "softmax")


def _fmt(v, spec="{:.1f}") -> str:
  return "—" if v is None else spec.format(v)


def _machine() -> str:
  dev = jax.devices()[0]
  return (
    f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores, "
    f"{jax.device_count()} x {dev.device_kind} ({dev.platform}); "
    f"Python {platform.python_version()}, "
    f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, jaxact {jaxact.__version__}"
  )


def run(quick: bool, out: pathlib.Path) -> str:
  started = time.perf_counter()
  names = list(jaxact.ACTIVATIONS)
  elementwise = [n for n in names if n != "glu"]
  lines = [
    "# jaxact benchmark results",
    "",
    f"- date: {datetime.date.today().isoformat()}",
    f"- machine: {_machine()}",
    f"- command: `python -m benchmarks{' --quick' if quick else ''}`",
    "",
    "## Training memory: 8-layer MLP, 8192 x 512 float32 activations, `jit(grad(loss))`",
    "",
    "`temp` is XLA's compiled `temp_size_in_bytes` in activation buffers (16 MiB each); `kept` is",
    "activation-sized arrays held by `jax.vjp`'s pullback per layer (parameters and input",
    "excluded). Targets: temp <= 9 (L+1) for output-residual activations, <= 17 (2L+1) for",
    "input-residual ones, never above jax.nn; kept = 1 per layer (output residual) or 2 (input",
    "residual).",
    "",
    "| activation | residual | temp jax.nn | temp jaxact | ratio | kept jax.nn | kept jaxact |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  print(f"measuring MLP memory for {len(elementwise)} activations ...", file=sys.stderr)
  for i, name in enumerate(elementwise, 1):
    row = bench.mlp_memory(name)
    ratio = None if row.temp_jaxnn is None else row.temp_jaxact / row.temp_jaxnn
    lines.append(
      f"| {name} | {row.residual} | {_fmt(row.temp_jaxnn)} | {_fmt(row.temp_jaxact)} | "
      f"{_fmt(ratio, '{:.2f}')} | {_fmt(row.kept_jaxnn, '{:.2f}')} | "
      f"{_fmt(row.kept_jaxact, '{:.2f}')} |"
    )
    print(f"  [{i}/{len(elementwise)}] {name}", file=sys.stderr)

  timed = [n for n in (QUICK_TIMED if quick else names) if bench.reference(n) is not None]
  reps = 10 if quick else 40
  lines += [
    "",
    f"## Step time: `jit(value_and_grad(sum(act(x))))`, 2**22 float32 elements, median of {reps}",
    "",
    "Runs of the two libraries alternate; the ratio is jaxact / jax.nn (below 1 is faster).",
    "",
    "| activation | jax.nn ms | jaxact ms | ratio |",
    "|---|---:|---:|---:|",
  ]
  print(f"timing {len(timed)} activations ...", file=sys.stderr)
  logs = []
  for i, name in enumerate(timed, 1):
    t_ref, t_ours = bench.step_time(name, reps=reps)
    logs.append(math.log(t_ours / t_ref))
    lines.append(f"| {name} | {t_ref * 1e3:.2f} | {t_ours * 1e3:.2f} | {t_ours / t_ref:.2f} |")
    print(f"  [{i}/{len(timed)}] {name}", file=sys.stderr)
  lines.append(f"| **geometric mean** | | | **{math.exp(sum(logs) / len(logs)):.2f}** |")

  fused_runs = 5 if quick else 15
  lines += [
    "",
    "## Fused layers: `dense_bias_act` / `conv_bias_act` against `act(x @ w + b)` / "
    "`act(lax.conv(x, w) + b)` with jax.nn",
    "",
    "8-layer MLP (8192 x 512 float32, 512 x 512 kernels) and 6-layer CNN (NHWC 32x32x32x64,",
    "3x3x64x64 kernels, SAME), `jit(grad)`: compiled temp in activation buffers, and the median",
    f"step time of `jit(value_and_grad)` over {fused_runs} alternated runs (ratio fused /",
    "composition). Targets: L+1 buffers for output-residual activations, 2L+1 for gelu;",
    "ratio <= 1.",
    "",
    "| model | activation | temp jax.nn | temp fused | target | jax.nn ms | fused ms | ratio |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  print("measuring fused layers ...", file=sys.stderr)
  for label, model, layers in (("MLP", fused._mlp, 8), ("CNN", fused._cnn, 6)):
    for activation in fused.ACTIVATIONS:
      temp_f = fused.temp_buffers(model, activation, True)
      temp_c = fused.temp_buffers(model, activation, False)
      target = layers + 1 if activation in fused.OUTPUT_RESIDUAL else 2 * layers + 1
      t_f, t_c, ratio = fused.time_ratio(model, activation, fused_runs)
      lines.append(
        f"| {label} | {activation} | {temp_c:.1f} | {temp_f:.1f} | {target} | {t_c * 1e3:.1f} | "
        f"{t_f * 1e3:.1f} | {ratio:.2f} |"
      )
      print(f"  {label} {activation}", file=sys.stderr)

  lines += [
    "",
    "## Numerics: NaN values / non-finite gradients on the finite extreme-input grid",
    "",
    "Grid: ±1e30, ±finfo.max, ±548, ±300, ±88.8, ±17, ±1, ±tiny, ±smallest subnormal, 0 (values",
    "the dtype cannot hold are dropped). Each cell is `NaN values / non-finite gradients`,",
    "jax.nn then jaxact.",
    "",
    "| activation | " + " | ".join(bench.DTYPES) + " |",
    "|---|" + "---|" * len(bench.DTYPES),
  ]
  print("counting NaNs on the extreme grid ...", file=sys.stderr)
  totals = {"jax.nn": [0, 0], "jaxact": [0, 0]}
  for name in names:
    cells = []
    for dtype in bench.DTYPES:
      counts = bench.nan_counts(name, dtype)
      for lib, c in counts.items():
        if c is not None:
          totals[lib][0] += c[0]
          totals[lib][1] += c[1]
      ref = counts["jax.nn"]
      ours = counts["jaxact"]
      ref_s = "—" if ref is None else f"{ref[0]}/{ref[1]}"
      cells.append(f"{ref_s} → {ours[0]}/{ours[1]}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += [
    "",
    f"Totals: jax.nn {totals['jax.nn'][0]} NaN values, {totals['jax.nn'][1]} non-finite gradients;"
    f" jaxact {totals['jaxact'][0]} NaN values, {totals['jaxact'][1]} non-finite gradients.",
    "",
    f"_Run time: {time.perf_counter() - started:.0f} s._",
    "",
  ]
  text = "\n".join(lines)
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.md").write_text(text)
  return text


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="fewer timing repetitions (~2 min on 2 cores)"
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("bench-out"), help="output folder"
  )
  args = parser.parse_args(argv)
  print(run(args.quick, args.out))
  print(f"wrote {args.out / 'results.md'}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
