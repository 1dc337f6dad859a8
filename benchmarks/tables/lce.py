"""The lce job's tables from its rows (sections ``head``, ``head-h100``, ``head-tpu``,
``decoder``, ``decoder-h100``, ``decoder-tpu``, ``tied``, ``tied-h100``)."""

from __future__ import annotations

from benchmarks.harness import render
from benchmarks.tables import tpu

# The TPU sections are drawn in blocks of their own (results/tpu-families.md; benchmarks.render)
SEPARATE_SECTIONS = ("head-tpu", "decoder-tpu")

MiB, GiB = 2**20, 2**30
HEAD_CPU = (4096, 512)  # tokens, D
HEAD_GPU = (16384, 4096)
TIED = (2048, 512)  # tokens, D
HEAD_LABELS = {
  "plain": "x @ w, optax",
  "checkpoint": "jax.checkpoint(x @ w, optax)",
  "jaxact": "jaxact.linear_cross_entropy (blocked over V)",
  "jaxact_tokens": "jaxact's rule blocked over tokens",
  "tokamax": "tokamax.linear_softmax_cross_entropy_loss (chunked_xla)",
  "tokamax_tpu": "tokamax.linear_softmax_cross_entropy_loss (mosaic_tpu)",
}
BODY_LABELS = {  # benchmarks.decoder's bodies
  "flax": "Flax",
  "flax_remat": "Flax + block remat",
  "flax_dots": "Flax + remat, dots_saveable",
  "jaxact": "jaxact.gated_mlp",
  "jaxact_remat": "jaxact.gated_mlp + block remat",
  "jaxact_attn": "jaxact.gated_mlp + jaxact attention",
  "jaxact_attn_remat": "jaxact.gated_mlp + jaxact attention + block remat",
  "flax_names": "Flax + block remat saving the gate and up projections by name",
  "jaxact_attn_dots": "jaxact.gated_mlp + jaxact attention + remat, dots_saveable",
  "jaxact_attn_names": "jaxact.gated_mlp + jaxact attention + block remat saving what jaxact's "
  "ops keep by name",
  "jaxact_attn_gated_names": "jaxact.gated_mlp + jaxact attention + block remat saving a, b by "
  "name",
  "jaxact_attn_input": 'jaxact.gated_mlp(residuals="input") + jaxact attention',
}
HEADS = ("plain", "fused", "none")  # benchmarks.decoder's heads


def head(head_rows: list[dict], unit=MiB, gpu=False) -> list[str]:
  """The head's table from its rows (a row a (vocabulary, head): lce.HeadRow's fields)."""
  rows = [r["figures"] for r in head_rows]
  name = "GiB" if unit == GiB else "MiB"
  top = f"| V | head | compiled temp ({name}) | vs plain | largest array ({name}) |"
  sep = "|---|---|---|---|---|"
  if gpu:
    top, sep = top + " fits an 80 GB H100 (tokens) |", sep + "---|"
  else:
    top, sep = top + " loss vs plain (rel.) | step time vs plain |", sep + "---|---|"
  lines = [top, sep]
  plain = {r["vocab"]: r["temp"] for r in rows if r["peer"] == "plain"}
  for r in rows:
    cells = [
      str(r["vocab"]),
      HEAD_LABELS[r["peer"]],
      f"{r['temp'] / unit:.1f}",
      f"{r['temp'] / plain[r['vocab']]:.3f}",
      f"{r['largest'] / unit:.1f}" if r["largest"] else "—",
    ]
    if gpu:
      cells.append(r["fit"] or "—")
    else:
      cells.append("—" if r["error"] is None else f"{r['error']:.1e}")
      cells.append("—" if r["ratio"] is None else f"{r['ratio']:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def decoder(decoder_rows: list[dict], unit=MiB) -> list[str]:
  """The decoder's table from its rows (benchmarks.decoder.record_decoder)."""
  temps = {
    (r["figures"]["body"], r["figures"]["head"]): r["figures"]["temp_bytes"] for r in decoder_rows
  }
  name = "GiB" if unit == GiB else "MiB"
  lines = [
    f"| body | plain head ({name}) | fused head ({name}) | no head ({name}) | fused / plain "
    "| the plain head's share | fused / no head |",
    "|---|---|---|---|---|---|---|",
  ]
  for body in dict.fromkeys(b for b, _ in temps):
    p, f, n = (temps[body, h] for h in HEADS)
    lines.append(
      f"| {BODY_LABELS[body]} | {p / unit:.1f} | {f / unit:.1f} | {n / unit:.1f} | "
      f"{f / p:.2f} | {(p - n) / p:.0%} | {f / n:.3f} |"
    )
  return lines


def head_tpu(these: list[dict]) -> list[str]:
  """The heads compiled for each TPU chip: temp, against the plain head's, the estimate."""

  def draw(chip_rows: list[dict]) -> list[str]:
    plain = {r["figures"]["vocab"]: r["figures"] for r in chip_rows if r["case"].endswith("plain")}
    body = []
    for r in chip_rows:
      f, ref = r["figures"], plain[r["figures"]["vocab"]]
      temp = f"{f['temp'] / GiB:.2f}" + (" (over HBM)" if f["over_hbm"] else "")
      body.append(
        [str(f["vocab"]), HEAD_LABELS[f["peer"]], temp, f"{f['temp'] / ref['temp']:.3f}",
         tpu.estimate_ms(f)]
      )  # fmt: skip
    header = ["V", "head", "compiled temp (GiB)", "vs plain", "step ms, ESTIMATE"]
    return render.table(header, "lllrr", body)

  return tpu.per_chip(these, draw)


def decoder_tpu(these: list[dict]) -> list[str]:
  """The decoder's table a TPU chip, with each (body, head)'s estimated step time."""

  def draw(chip_rows: list[dict]) -> list[str]:
    ms = {(r["figures"]["body"], r["figures"]["head"]): r["figures"] for r in chip_rows}
    lines = decoder(chip_rows, GiB)
    lines[0] += " " + " | ".join(f"{h} head: step ms, ESTIMATE" for h in HEADS) + " |"
    lines[1] += "---:|" * len(HEADS)
    for i, body in enumerate(dict.fromkeys(b for b, _ in ms)):
      lines[2 + i] += " " + " | ".join(tpu.estimate_ms(ms[body, h]) for h in HEADS) + " |"
    return lines

  return tpu.per_chip(these, draw)


TIED_TABLE = render.Table(
  ("head", "compiled temp (MiB)"), lambda f: [f["case"], f"{f['temp_bytes'] / MiB:.1f}"]
)  # sections tied, tied-h100


def _config(rows: list[dict]) -> str:
  return rows[0]["figures"].get("config", "")


HEADINGS = {
  "head": lambda rows: f"### Head alone, CPU float32, {HEAD_CPU[0]} tokens, D = {HEAD_CPU[1]}",
  "head-h100": lambda rows: (
    f"### Head alone, compiled for an H100, bfloat16, {HEAD_GPU[0]} tokens, D = {HEAD_GPU[1]}"
  ),
  "decoder": lambda rows: f"### Decoder step, CPU float32, {_config(rows)}",
  "decoder-h100": lambda rows: f"### Decoder step, compiled for an H100, {_config(rows)}",
  "head-tpu": lambda rows: (
    f"### Head alone, compiled for TPU chips, bfloat16, {HEAD_GPU[0]} tokens, D = {HEAD_GPU[1]}"
  ),
  "decoder-tpu": lambda rows: f"### Decoder step, compiled for TPU chips, {_config(rows)}",
  "tied": lambda rows: f"### Tied head, {TIED[0]} tokens, D = {TIED[1]}: CPU float32, V = 32000",
  "tied-h100": lambda rows: "### Tied head, compiled for an H100, bfloat16, V = 32768",
}
DRAW = {
  "head": head,
  "head-h100": lambda rows: head(rows, GiB, gpu=True),
  "decoder": decoder,
  "decoder-h100": lambda rows: decoder(rows, GiB),
  "head-tpu": head_tpu,
  "decoder-tpu": decoder_tpu,
  "tied": TIED_TABLE.lines,
  "tied-h100": TIED_TABLE.lines,
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
