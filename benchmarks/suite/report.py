"""The main job's ``results.md``, rendered from its rows: `template.md` with each ``{{name}}``
replaced by its block (tables from the rows, and the few numbers the text quotes)."""

from __future__ import annotations

import pathlib
import re

from benchmarks.harness import frontier as fr
from benchmarks.harness.render import fmt, table
from benchmarks.harness.rows import describe
from benchmarks.suite.run import Frontier, Run
from benchmarks.tables import gated as gated_tables

TEMPLATE = pathlib.Path(__file__).with_name("template.md")
DTYPES = ("float32", "bfloat16", "float16", "float64")  # benchmarks.activations.DTYPES


def _cell(p: fr.Point | None, unit: str, seconds: float | None = None) -> str:
  if p is None:
    return "—"
  time_s = f"{seconds * 1e3:.0f} ms" if seconds is not None else fr.fmt_time(p.time)
  return f"{fr.fmt_memory(p.memory, unit)}, {time_s}"


def frontier_summary(run: Run) -> list[str]:
  """Per model, Flax, Flax + remat and jaxact (temp, step time), and the two numbers of its
  frontier."""
  body = []
  for f in run.frontiers.values():
    v = fr.verdict(f.points)
    remat = _cell(v.remat, f.unit) + ("" if v.remat.key == "remat" else f" ({v.remat.label})")
    fastest, smallest, flax_front = fr.cells(v, f.unit)
    flax = _cell(v.flax, f.unit, f.flax_seconds)
    body.append(
      [
        f"{f.name} ({f.unit})",
        flax,
        remat,
        _cell(f.get("jaxact"), f.unit),
        fastest,
        smallest,
        flax_front,
      ]
    )
  header = [
    "model (temp in)",
    "Flax: temp, step",
    "Flax + remat",
    "jaxact",
    "jaxact's best step time at Flax + remat's temp or less",
    "jaxact's least temp at Flax's step time or less",
    "Flax's points on the front (no jaxact point beats them)",
  ]
  return table(header, "lllllll", body)


def activation_summary(run: Run) -> list[str]:
  """Each activation alone: memory, step time and NaN counts against jax.nn."""
  body = []
  if (memory := run.memory_ratio()) is not None:
    body.append(
      [
        f"8-layer MLP temp ({memory[0]} activations), geometric mean relative to jax.nn",
        "1",
        f"{memory[1]:.2f}",
      ]
    )
  if (step := run.step_ratio()) is not None:
    body.append(
      [
        f"step time ({step[0]} activations), geometric mean relative to jax.nn",
        "1",
        f"{step[1]:.2f}",
      ]
    )
  totals = run.nan_totals()
  body.append(
    [
      "non-finite gradients, extreme-input grid, 4 dtypes (Flax uses jax.nn's activations)",
      str(totals["jax.nn"][1]),
      str(totals["jaxact"][1]),
    ]
  )
  return table(["each activation alone", "jax.nn", "jaxact"], "lrr", body)


def summary(run: Run) -> str:
  return "\n".join([*frontier_summary(run), "", *activation_summary(run)])


def _frontier(run: Run, f: Frontier) -> list[str]:
  v = fr.verdict(f.points)
  warm = "." if run.settings.get("warmup") else " (no warm-up call)."
  return [
    "", f"### {f.name}", "",
    f"{f.title}; Flax's step {f.flax_seconds * 1e3:.0f} ms; {f.runs} alternated rounds{warm}", "",
    f"**{fr.sentence(v, f.unit)}**", "", *fr.table(f.points, f.unit), "",
    f"![frontier_{f.key}.png](frontier_{f.key}.png)",
  ]  # fmt: skip


def _kept(run: Run) -> list[str]:
  rows = run.section("kept")
  if not rows:
    return []
  variants = ("flax", "remat", "dots", "jaxact")
  body = [[r["figures"]["model"], r["figures"]["activation"],
           *(f"{r['figures'][v]:.2f}" for v in variants)] for r in rows]  # fmt: skip
  return [
    "", "Activation-sized arrays held by `jax.vjp`'s pullback per layer (eager, parameters and",
    "input excluded; outside jit, Flax's `promote_dtype` copies each layer's input and the",
    "pullback holds the copy: one more array a layer on both sides of the Flax rows).", "",
    *table(["model", "activation", "Flax", "Flax + remat", "Flax + remat(dots)", "jaxact"],
           "llrrrr", body), "",
  ]  # fmt: skip


def _memory(run: Run) -> list[str]:
  body = []
  for r in run.section("memory"):
    f = r["figures"]
    ratio = None if f["temp_jaxnn"] is None else f["temp_jaxact"] / f["temp_jaxnn"]
    body.append(
      [
        r["case"],
        f["residual"],
        fmt(f["temp_jaxnn"]),
        fmt(f["temp_jaxact"]),
        fmt(ratio, "{:.2f}"),
        fmt(f["kept_jaxnn"], "{:.2f}"),
        fmt(f["kept_jaxact"], "{:.2f}"),
      ]
    )
  header = [
    "activation",
    "residual",
    "temp jax.nn",
    "temp jaxact",
    "ratio",
    "kept jax.nn",
    "kept jaxact",
  ]
  return table(header, "llrrrrr", body)


def _step(run: Run) -> list[str]:
  body = []
  for r in run.section("step"):
    ref, ours = r["figures"]["jaxnn_seconds"], r["figures"]["jaxact_seconds"]
    body.append([r["case"], f"{ref * 1e3:.2f}", f"{ours * 1e3:.2f}", f"{ours / ref:.2f}"])
  if (step := run.step_ratio()) is not None:
    body.append(["**geometric mean**", "", "", f"**{step[1]:.2f}**"])
  return table(["activation", "jax.nn ms", "jaxact ms", "ratio"], "lrrr", body)


def _fused(run: Run) -> list[str]:
  body = []
  for r in run.section("fused"):
    f = r["figures"]
    t_f, t_c = f["fused_seconds"], f["composition_seconds"]
    timing = (
      ["—"] * 3 if t_f is None else [f"{t_c * 1e3:.1f}", f"{t_f * 1e3:.1f}", f"{t_f / t_c:.2f}"]
    )
    body.append(
      [
        f["model"],
        f["activation"],
        f"{f['temp_composition']:.1f}",
        f"{f['temp_fused']:.1f}",
        str(f["target"]),
        *timing,
      ]
    )
  header = [
    "model",
    "activation",
    "temp jax.nn",
    "temp fused",
    "target",
    "jax.nn ms",
    "fused ms",
    "ratio",
  ]
  return table(header, "llrrrrrr", body)


def _gated(run: Run) -> list[str]:
  rows = run.section("gated")
  if not rows:
    return [
      "`--quick` measures the stack's frontier only (above); the full run adds its temp at 1, 2"
      " and 8 blocks, scanned and unrolled, and the arrays each block keeps."
    ]
  return [
    "Flax: three `nn.Dense(use_bias=False)` and `jax.nn.silu`; Flax + remat: each block under",
    "`jax.checkpoint(policy=nothing_saveable)`; jaxact: `jaxact.gated_mlp`. Compiled temp of",
    "`jit(value_and_grad(loss))` in MiB, unrolled and as `lax.scan` over stacked parameters;",
    "ratios against Flax (`python -m benchmarks gated` for the H100 figures and tokamax; the",
    "stack's frontier, with every remat policy, is above).",
    "",
    *gated_tables.memory([r["figures"] for r in rows], "kept"),
  ]


def _nans(run: Run) -> list[str]:
  cells: dict[str, list[str]] = {}
  for r in run.section("nan"):
    f = r["figures"]
    ref = "—" if f["jaxnn"] is None else f"{f['jaxnn'][0]}/{f['jaxnn'][1]}"
    cells.setdefault(f["activation"], []).append(f"{ref} → {f['jaxact'][0]}/{f['jaxact'][1]}")
  t = run.nan_totals()
  return [
    *table(["activation", *DTYPES], "l" * (len(DTYPES) + 1), ([k, *v] for k, v in cells.items())),
    "",
    f"Totals: jax.nn {t['jax.nn'][0]} NaN values, {t['jax.nn'][1]} non-finite gradients;"
    f" jaxact {t['jaxact'][0]} NaN values, {t['jaxact'][1]} non-finite gradients.",
  ]


def _gpu(run: Run) -> list[str]:
  layers, eltwise = run.section("gpu-layer"), run.section("gpu-eltwise")
  if not layers:
    return [
      f"Not measured: this run's backend is {run.meta.get('platform', '?')}. On a GPU",
      '(`jax.default_backend() == "gpu"`) the suite times, in bfloat16, one dense and one 3x3',
      "convolution layer (the jax.nn composition, jaxact's XLA path, and jaxact's default, which",
      "picks the Pallas kernels where they support the call) and the elementwise activations",
      "(forward and backward as separate jitted calls), with TFLOP/s and GB/s as fractions of the",
      "device's data-sheet peaks.",
    ]
  from benchmarks.gpu import suite as gpu

  dev = run.meta.get("device", "?")
  peak = gpu.peaks(dev)
  peak_s = "not in the peak table" if peak is None else f"{peak[0]} TB/s, {peak[1]:.0f} TFLOP/s"
  ms = "{:.3f}"
  layer_body = [
    [f["op"], f["shape"], f["activation"],
     *(ms.format(f[k] * 1e3) for k in ("composition", "xla", "default")),
     *(f"{f[k] / f['composition']:.2f}" for k in ("xla", "default")),
     f"{f['tflops']:.0f}", fmt(f["peak_fraction"], "{:.0%}")]
    for f in (r["figures"] for r in layers)
  ]  # fmt: skip
  elt_body = [
    [f["activation"], str(f["size"]), ms.format(f["jaxnn"] * 1e3), ms.format(f["jaxact"] * 1e3),
     f"{f['jaxact'] / f['jaxnn']:.2f}", f"{f['gbps']:.0f}", fmt(f["peak_fraction"], "{:.0%}")]
    for f in (r["figures"] for r in eltwise)
  ]  # fmt: skip
  return [
    f"Device: {dev} (data-sheet peaks: {peak_s}). bfloat16. `jit(value_and_grad)` of",
    "`sum(act(layer(x, w) + b))` with respect to x, w and b; TFLOP/s counts the forward and two",
    "backward products of jaxact's default implementation. Ratios against the composition.",
    "",
    *table(["layer", "shapes", "activation", "jax.nn ms", "jaxact xla ms", "jaxact default ms",
            "xla ratio", "default ratio", "TFLOP/s", "of peak"], "lllrrrrrrr", layer_body),
    "",
    "Elementwise activations: forward (`jax.vjp`) and backward (the pullback), two jitted calls.",
    "GB/s counts five arrays (read x, write y; read the residual and dy, write dx).",
    "",
    *table(["activation", "elements", "jax.nn ms", "jaxact ms", "ratio", "jaxact GB/s", "of peak"],
           "lrrrrrr", elt_body),
  ]  # fmt: skip


def run_time(run: Run) -> str:
  t = run.time
  sections = ", ".join(f"{k} {w:.0f} s ({c:.0f} s CPU)" for k, (w, c) in t["sections"].items())
  return f"{t['seconds']:.0f} s, {t['cpu_seconds']:.0f} s of CPU ({sections})"


def render(run: Run, figures: list[str], rows: str = "rows.jsonl") -> str:
  s = run.settings
  t, d, f = s.get("gated_size", (0, 0, 0))
  quick = (
    " `--quick` measures relu and gelu and does not time them here: the frontier times the"
    " same ops as `jaxact.linen` layers."
  )
  blocks = {
    "rows": rows,
    "date": run.meta["date"][:10],
    "machine": describe(run.meta),
    "command": run.meta["command"],
    "run_time": run_time(run),
    "frontier_summary": frontier_summary(run),
    "activation_summary": activation_summary(run),
    "figures": [f"![{f}]({f})" for f in figures if not f.startswith("frontier_")],
    "gated_blocks": str(s.get("gated_blocks")),
    "frontiers": [line for f in run.frontiers.values() for line in _frontier(run, f)],
    "kept": _kept(run),
    "memory": _memory(run),
    "reps": str(s["reps"]),
    "step": _step(run),
    "fused_runs": str(s["fused_runs"]),
    "fused_quick": quick if run.quick else "",
    "fused": _fused(run),
    "gated_title": (
      f"{s.get('gated_blocks')} residual blocks `x + mlp(rms_norm(x))`, {t} tokens, "
      f"D = {d}, F = {f}, float32"
    ),
    "gated": _gated(run),
    "nans": _nans(run),
    "gpu": _gpu(run),
  }

  def fill(m: re.Match) -> str:
    value = blocks[m.group(1)]
    return value if isinstance(value, str) else "\n".join(value)

  return re.sub(r"\{\{(\w+)\}\}", fill, TEMPLATE.read_text())
