"""The gated job's tables from its rows (sections ``cpu``, ``h100``, ``tpu``, ``time``,
``layers``, ``layers-h100``)."""

from __future__ import annotations

from benchmarks.tables import tpu

# The TPU sections are drawn in blocks of their own (results/tpu-families.md; benchmarks.render)
SEPARATE_SECTIONS = ("tpu",)

BLOCKS = 8  # the stack's blocks
LABELS = {
  "flax": "Flax",
  "remat": "Flax + remat",
  "flax_dots": "Flax + remat(dots)",
  "flax_names": "Flax + remat(names)",
  "jaxact": "jaxact.gated_mlp",
  "jaxact_remat": "jaxact + remat",
  "jaxact_dots": "jaxact + remat(dots)",
  "jaxact_saved": "jaxact.gated_mlp, block remat saving a, b",
  "jaxact_input": 'jaxact.gated_mlp(residuals="input")',
  "tokamax": "tokamax GLU + Dense",
}
LAYER_LABELS = {"flax": "Flax", "remat": "Flax + remat", "jaxact": "jaxact layers"}


def ratio(v, ref) -> str:
  return f"{v / ref:.2f}" if ref else "—"


def _growth(f: dict) -> float:
  return (f["temp8"] - f["temp1"]) / (BLOCKS - 1)


def _growth2(f: dict) -> float:
  """Without the first block: XLA turns a scan of length 1 into straight-line code."""
  return (f["temp8"] - f["temp2"]) / (BLOCKS - 2)


def memory(figures: list[dict], extra: str | None = None) -> list[str]:
  """The stack's memory table from its rows' figures (benchmarks.gated.MemoryRow's fields);
  `extra`: "kept" or "fit", the last column."""
  ref = {f["layout"]: f for f in figures if f["peer"] == "flax"}
  header = {"kept": "kept by jax.vjp per block", "fit": "largest tokens that fit"}
  header["estimate"] = f"L={BLOCKS} step ms, ESTIMATE"
  lines = [
    f"| layout | peer | temp L=1 | L=2 | L={BLOCKS} | growth/block (L{BLOCKS}-L1)/{BLOCKS - 1} "
    f"| ratio | growth/block (L{BLOCKS}-L2)/{BLOCKS - 2} | ratio | L={BLOCKS} ratio "
    + (f"| {header[extra]} |" if extra else "|"),
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if extra else ""),
  ]
  for r in figures:
    f = ref[r["layout"]]
    g, g2 = _growth(r), _growth2(r)
    lines.append(
      f"| {r['layout']} | {LABELS[r['peer']]} | {r['temp1']:.1f} | {r['temp2']:.1f} | "
      f"{r['temp8']:.1f} | {g:.1f} | {ratio(g, _growth(f))} | {g2:.1f} | "
      f"{ratio(g2, _growth2(f))} | {ratio(r['temp8'], f['temp8'])} |"
      + (f" {r[extra] or '—'} |" if extra else "")
    )
  return lines


def times(time_rows: list[dict]) -> list[str]:
  """The times' table from their rows (section time: ``wall_s``, ``cpu_s`` a program and peer)."""
  figures = [r["figures"] for r in time_rows]
  found = {(f["peer"], f["program"]): (f["wall_s"], f["cpu_s"]) for f in figures}
  lines = [
    "| program | peer | wall ms | / Flax | / Flax + remat | CPU ms | / Flax | / Flax + remat |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for (peer, layout), t in found.items():
    f, r = found["flax", layout], found["remat", layout]
    cells = [f"{t[i] * 1e3:.1f} | {t[i] / f[i]:.2f} | {t[i] / r[i]:.2f}" for i in (0, 1)]
    lines.append(f"| {layout} | {LABELS[peer]} | {cells[0]} | {cells[1]} |")
  return lines


def layers(figures: list[dict]) -> list[str]:
  """The scanned and unrolled layers' table (benchmarks.fused_scanned's rows' figures)."""
  lines = [
    "| model | activation | peer | unrolled temp, buffers | scan temp, buffers | "
    "unrolled / Flax | scan / Flax |",
    "|---|---|---|---:|---:|---:|---:|",
  ]
  for r in figures:
    ref = next(
      f
      for f in figures
      if f["peer"] == "flax" and f["model"] == r["model"] and f["activation"] == r["activation"]
    )
    lines.append(
      f"| {r['model']} | {r['activation']} | {LAYER_LABELS[r['peer']]} | {r['unrolled']:.1f} | "
      f"{r['scan']:.1f} | {ratio(r['unrolled'], ref['unrolled'])} | "
      f"{ratio(r['scan'], ref['scan'])} |"
    )
  return lines


def _h100(these: list[dict]) -> list[str]:
  figures = [r["figures"] for r in these]
  totals = [
    f"{f['layout']} {f['peer']}: L={BLOCKS} total {f['total8'] / 2**30:.2f} GiB" for f in figures
  ]
  return [*memory(figures, "fit"), "", *totals]


def _tpu(these: list[dict]) -> list[str]:
  """A table a chip: the scanned stacks' temp and their L=BLOCKS step's estimated time."""

  def draw(chip_rows: list[dict]) -> list[str]:
    figures = [r["figures"] | {"estimate": tpu.estimate_ms(r["figures"])} for r in chip_rows]
    return memory(figures, "estimate")

  return tpu.per_chip(these, draw)


DRAW = {
  "cpu": lambda these: memory([r["figures"] for r in these], "kept"),
  "h100": _h100,
  "tpu": _tpu,
  "time": times,
  "layers": lambda these: layers([r["figures"] for r in these]),
  "layers-h100": lambda these: layers([r["figures"] for r in these]),
}


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: each section it ran under its heading (`section` alone:
  its table without the heading)."""
  if section is not None:
    return DRAW[section]([r for r in rows if r["section"] == section])
  lines: list[str] = []
  for name in dict.fromkeys(r["section"] for r in rows):
    these = [r for r in rows if r["section"] == name]
    lines += ["", f"### {name}", "", *DRAW[name](these)]
  return lines
