"""The attention job's tables from its rows (sections ``decoder``, ``time``, ``decoder-h100``,
``fits-h100``, ``gemma-blocks-h100``, ``blocks-h100``, ``tpu``)."""

from __future__ import annotations

from benchmarks.harness import render

MiB, GiB = 2**20, 2**30
BASE = "jaxact, jax.nn attention"  # the step the goals compare jaxact's attention with


def decoder(decoder_rows: list[dict], unit=MiB) -> list[str]:
  """The decoder's table from its rows (a row a (B x T, step): its temp and that of the step
  without attention)."""
  by: dict[tuple[int, int], dict] = {}
  for f in (r["figures"] for r in decoder_rows):
    shape = f["batch"], f["seq"]
    by.setdefault(shape, {"rest": f["rest_bytes"], "temps": {}})["temps"][f["step"]] = f[
      "temp_bytes"
    ]
  name = "GiB" if unit == GiB else "MiB"
  lines = [
    f"| B x T | step | temp ({name}) | vs jax.nn attention | vs Flax | vs Flax + block remat "
    "| attention's share |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for (batch, seq), r in by.items():
    temps, rest = r["temps"], r["rest"]
    base, flax, remat = temps[BASE], temps["Flax"], temps["Flax + block remat"]
    for label, temp in temps.items():
      share = (
        (temp - rest) / temp if label.startswith("jaxact, jax") and "remat" not in label else None
      )
      lines.append(
        f"| {batch} x {seq} | {label} | {temp / unit:.2f} | {temp / base:.3f} | "
        f"{temp / flax:.3f} | {temp / remat:.3f} | {'' if share is None else f'{share:.0%}'} |"
      )
  return lines


def blocks(block_rows: list[dict]) -> list[str]:
  """The block sizes' table from their rows (a figure a block, ``temps`` keyed by its size as
  text, and ``default``)."""
  sizes = [k for k in block_rows[0]["figures"]["temps"] if k != "default"]
  head = " | ".join(f"{b} x {b}" for b in sizes)
  lines = [
    f"| H | dtype | T | {head} | default (its blocks) |",
    "|---|---|---|" + "---:|" * (len(sizes) + 1),
  ]
  for r in (r["figures"] for r in block_rows):
    cells = " | ".join(f"{r['temps'][b] / MiB:.1f}" for b in sizes)
    d = r["default"]
    lines.append(
      f"| {r['head_dim']} | {r['dtype']} | {r['seq']} | {cells} | "
      f"{r['temps']['default'] / MiB:.1f} ({d[0]} x {d[1]}) |"
    )
  return lines


def tpu(tpu_rows: list[dict]) -> list[str]:
  """The TPU steps' table: each (chip, T, cap) case's steps, temp and ESTIMATED time, each against
  splash attention's step (as a TPU user calls it) of the same case."""
  cases: dict[tuple, dict[str, dict]] = {}
  for f in (r["figures"] for r in tpu_rows):
    cases.setdefault((f["chip"], f["seq"], f["cap"]), {})[f["step"]] = f
  lines = [
    "| chip | T | soft cap | step | temp MiB | / splash's | step ms, estimate | / splash's "
    "| TFLOP | GB |",
    "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for (chip, seq, cap), steps in cases.items():
    base = steps.get("splash")
    for step, f in steps.items():
      head = f"| {chip} | {seq} | {cap or 'none'} | {step} |"
      if f["temp_bytes"] is None:  # XLA's TPU compiler refused it
        lines.append(f"{head} over HBM: needs {f['needs_bytes'] / GiB:.0f} GiB | | | | | |")
        continue
      temp = "" if base is None else f"{f['temp_bytes'] / base['temp_bytes']:.3f}"
      time = "" if base is None else f"{f['estimate_s'] / base['estimate_s']:.2f}"
      lines.append(
        f"{head} {f['temp_bytes'] / MiB:.0f} | {temp} | {f['estimate_s'] * 1e3:.2f} | {time} "
        f"| {f['flops'] / 1e12:.2f} | {f['bytes'] / 1e9:.1f} |"
      )
  return lines


GEMMA_BLOCKS = render.Table(
  ("attention", "temp (MiB)"), lambda f: [f["case"], f"{f['temp_bytes'] / MiB:.1f}"], "lr"
)
TIME = render.Table(
  ("step", "time / jax.nn attention's"),
  lambda f: [
    f["case"],
    f"{f['ratio']:.3f}" if f["seconds"] is None else f"1 ({f['seconds']:.3f} s)",
  ],
  "lr",
)
FITS = render.Table(
  ("step", "T", "GiB"), lambda f: [f["case"], str(f["seq"]), f"{f['total_bytes'] / GiB:.1f}"], "lrr"
)

HEADINGS = {
  "decoder": lambda rows: "### Decoder step, CPU float32, D = 512, 8 heads, V = 32000",
  "time": lambda rows: (
    f"### CPU step time, 4 x 512, against {BASE!r} (median of {rows[0]['figures']['runs']} rounds)"
  ),
  "decoder-h100": lambda rows: (
    "### Decoder step compiled for an H100, bf16, B = 4, D = 2048, 16 heads, V = 128256"
  ),
  "fits-h100": lambda rows: "### Longest sequence whose step fits an 80 GB H100 (B = 4)",
  "gemma-blocks-h100": lambda rows: (
    "### The Gemma port's step compiled for an H100, bf16, 4 x 512: temp by block"
  ),
  "blocks-h100": lambda rows: (
    "### Attention fwd+bwd compiled for an H100 (causal, B 4, 8 / 2 heads): temp, MiB"
  ),
  "tpu": lambda rows: (
    "### Attention step compiled for TPUs, bf16, 2 layers, B 4, 16 / 4 heads of 128 (time: "
    "ESTIMATE)"
  ),
}
DRAW = {
  "decoder": decoder,
  "time": TIME.lines,
  "decoder-h100": lambda rows: decoder(rows, GiB),
  "fits-h100": FITS.lines,
  "gemma-blocks-h100": GEMMA_BLOCKS.lines,
  "blocks-h100": blocks,
  "tpu": tpu,
}


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: each section it ran under its heading (`section` alone:
  its table without the heading)."""
  if section is not None:
    return DRAW[section]([r for r in rows if r["section"] == section])
  lines: list[str] = []
  for name in dict.fromkeys(r["section"] for r in rows):
    these = [r for r in rows if r["section"] == name]
    lines += ["", HEADINGS[name](these), "", *DRAW[name](these)]
  return lines
