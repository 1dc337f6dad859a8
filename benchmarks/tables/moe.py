"""The moe job's tables from its rows (sections ``memory``, ``memory-h100``, ``time``, ``tpu``)."""

from __future__ import annotations

from benchmarks.harness import render

MiB = 2**20
LABELS = {
  "flax": "plain ragged",
  "remat": "plain + remat",
  "names": "plain + remat(names)",
  "jaxact": "jaxact.moe_mlp",
  "jaxact_remat": "jaxact + remat",
  "jaxact_names": "jaxact + remat(names)",
}


def _kept(f: dict) -> str:
  return f"{f['mlp_kept_bytes'] / MiB:.1f}" if "mlp_kept_bytes" in f else ""


MEMORY = render.Table(
  (
    "configuration",
    "way",
    "temp 2 / 8 blocks MiB",
    "growth a block MiB",
    "/ plain's",
    "MLP kept MiB",
  ),
  lambda f: [
    f["config"],
    LABELS[f["point"]],
    " / ".join(f"{b / MiB:.1f}" for b in f["temp_bytes"]),
    f"{f['growth_bytes'] / MiB:.2f}",
    f"{f['growth_vs_plain']:.3f}",
    _kept(f),
  ],
)
TIME = render.Table(
  ("configuration", "way", "temp MiB", "step time / plain's", "rounds"),
  lambda f: [
    f["config"],
    LABELS[f["point"]],
    f"{f['temp_bytes'] / MiB:.1f}",
    f"{f['ratio']:.2f}",
    f"{min(f['rounds']):.2f}-{max(f['rounds']):.2f}" if f.get("rounds") else "",
  ],
)


def memory(these: list[dict], section: str) -> list[str]:
  where = "compiled for an H100, bfloat16" if section.endswith("-h100") else "CPU, float32"
  return [
    f"{where}: `jit(value_and_grad)` of residual blocks `x + moe(rms_norm(x))` under `lax.scan`; "
    "growth a block = (temp at 8 blocks - temp at 2) / 6; MLP kept: one MoE MLP's pullback "
    "beyond its weights.",
    "",
    *MEMORY.lines(these),
  ]


def time(these: list[dict], section: str) -> list[str]:
  f = these[0]["figures"]
  return [
    f"CPU, float32, {f['blocks']} scanned blocks; step time against the plain composition's, "
    f"median of {f['runs']} alternated rounds (the range: rounds' ratios). On CPU `ragged_dot` is "
    "a dense product over every expert.",
    "",
    *TIME.lines(these),
  ]


def tpu(these: list[dict], section: str) -> list[str]:
  """Each configuration's steps compiled for a TPU chip: temp and ESTIMATED time, each against
  megablox's (the plain composition on megablox's kernels) of the same configuration."""
  f0 = these[0]["figures"]
  lines = [
    f"Compiled for a TPU {f0['chip']} chip, bfloat16, `jit(value_and_grad)` of {f0['blocks']} "
    "scanned blocks `x + moe(rms_norm(x))`; step time a roofline ESTIMATE, the grouped "
    "products' flops as the kernels' cost estimates give them (useful flops) and as their row "
    "tiles run them (tiles: XLA's `ragged_dot` 128 rows, megablox 512).",
    "",
    "| configuration | way | temp MiB | / megablox's | ms, estimate | / megablox's "
    "| ms, at row tiles | / megablox's | TFLOP | GB |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  by: dict[str, dict[str, dict]] = {}
  for f in (r["figures"] for r in these):
    by.setdefault(f["config"], {})[f["step"]] = f
  for config, steps in by.items():
    base = steps.get("megablox")
    for step, f in steps.items():
      ratio = lambda key: "" if base is None else f"{f[key] / base[key]:.2f}"  # noqa: B023
      lines.append(
        f"| {config} | {step} | {f['temp_bytes'] / MiB:.0f} | {ratio('temp_bytes')} | "
        f"{f['estimate_s'] * 1e3:.2f} | {ratio('estimate_s')} | "
        f"{f['tile_estimate_s'] * 1e3:.2f} | {ratio('tile_estimate_s')} | "
        f"{f['flops'] / 1e12:.2f} | {f['bytes'] / 1e9:.1f} |"
      )
  return lines


DRAW = {"memory": memory, "memory-h100": memory, "time": time, "tpu": tpu}
heading = render.section_heading


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows (:func:`benchmarks.harness.render.by_section`)."""
  return render.by_section(DRAW, rows, section)
