"""The tpu job's tables from its rows: the h100 job's (sections ``rates``, ``model``, ``point``)
for the TPU chip its ``rates`` row names, and the decoder on a v5p slice (``slice``,
``slice-fit``)."""

from __future__ import annotations

from benchmarks.harness import frontier, render
from benchmarks.tables import h100
from benchmarks.tables.h100 import POINT as POINT

GiB = 2**30
SLICE_SECTIONS = ("slice", "slice-fit")
SEPARATE_SECTIONS = SLICE_SECTIONS  # drawn in blocks of their own (benchmarks.render)


def _gib(b) -> str:
  return "—" if b is None else f"{b / GiB:.2f}"


def _temp(f: dict) -> str:
  return f"> HBM ({_gib(f['temp_bytes'])} asked)" if f["over_hbm"] else _gib(f["temp_bytes"])


def _ms(f: dict) -> str:
  return estimate_ms(f).removesuffix(".0")  # a whole ms at this size


SLICE = render.Table(
  ("point", "temp GiB a chip", "temp + args + outputs GiB", "TFLOP a chip", "step ms, ESTIMATE"),
  lambda f: [
    frontier.LABELS[f["point"]],
    _temp(f),
    _gib(f["total_bytes"]),
    "—" if f["over_hbm"] else f"{f['flops'] / 1e12:.0f}",
    _ms(f),
  ],
  "lrrrr",
)
FIT = render.Table(
  ("point", "largest global batch", "a data shard", "GiB a chip at it", "batches compiled"),
  lambda f: [
    frontier.LABELS[f["point"]],
    str(f["batch"]),
    f"{f['batch'] / f['mesh']['data']:g}",
    _gib(f["total_bytes"]),
    ", ".join(f["tried"]),
  ],
  "lrrrl",
)


def estimate_ms(f: dict) -> str:
  """A TPU row's ESTIMATED step ms ("≥" where a loop was counted once), "over HBM" where the
  chip's compiler refused the program."""
  if f.get("over_hbm"):
    return "over HBM"
  if f.get("estimate_s") is None:
    return "—"
  return f"{'≥ ' if f.get('unknown_loops') else ''}{f['estimate_s'] * 1e3:.1f}"


def per_chip(these: list[dict], draw) -> list[str]:
  """A TPU section's rows as a table a chip (their ``chip`` figure), each drawn by `draw`."""
  lines: list[str] = []
  for chip in dict.fromkeys(r["figures"]["chip"] for r in these):
    lines += [
      "",
      f"TPU {chip}, one chip, compiled here; memory exact, step ms an ESTIMATE (the roofline at "
      "the chip's published peaks):",
      "",
      *draw([r for r in these if r["figures"]["chip"] == chip]),
    ]
  return lines[1:]


def _where(f: dict) -> list[str]:
  mesh = " x ".join(f"{k} {v}" for k, v in f["mesh"].items())
  return render.wrap(
    f"The main job's decoder ({f['config']}: {f['parameters'] / 1e9:.2f}B parameters) compiled "
    f"for a TPU {f['target']} slice ({f['mesh']['data'] * f['mesh']['model']} chips, mesh "
    f"{mesh}: FSDP over data, tensor parallel over model, the batch over data), bfloat16. Memory "
    "per chip, exact (XLA's buffer assignment); step times an ESTIMATE, not a measurement: max("
    "flops / 459 TFLOP/s, bytes / 2.77 TB/s), a v5p chip's published peaks, from XLA's cost "
    "analysis of each chip's program (its collectives' time over the chips' links left out)."
  )


def slice_table(these: list[dict]) -> list[str]:
  """Each point's temp and estimate, and both as fractions of Flax's and Flax + remat's."""
  found = {r["figures"]["point"]: r["figures"] for r in these}
  flax, remat = found.get("flax"), found.get("remat")

  def ratio(f, ref, key) -> str:
    if ref is None or f["over_hbm"] or ref["over_hbm"]:
      return "—"
    return f"{f[key] / ref[key]:.3f}"

  header = [*SLICE.header[:2], "/ Flax", "/ Flax + remat", *SLICE.header[2:], "/ Flax"]
  body = []
  for f in found.values():
    cells = SLICE.cells(f)
    ratios = [ratio(f, flax, "temp_bytes"), ratio(f, remat, "temp_bytes")]
    body.append([*cells[:2], *ratios, *cells[2:], ratio(f, flax, "estimate_s")])
  return render.table(header, "lrrrrrrr", body)


def fit_table(these: list[dict]) -> list[str]:
  f = these[0]["figures"]
  text = (
    f"The largest global batch (sequences of {f['seq']} tokens, a multiple of the data axis) "
    f"whose step's temp, arguments and outputs fit a v5p chip's {f['capacity_bytes'] / GiB:.0f} "
    "GiB, found by compiling: doubling, then bisection."
  )
  return [*render.wrap(text), "", *FIT.lines(these)]


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  if section == "slice":
    these = [r for r in rows if r["section"] == "slice"]
    return [*_where(these[0]["figures"]), "", *slice_table(these)]
  if section == "slice-fit":
    return fit_table([r for r in rows if r["section"] == "slice-fit"])
  lines = []
  front = [r for r in rows if r["section"] not in SLICE_SECTIONS]
  if section is not None or any(r["section"] == "point" for r in front):
    lines += h100.tables(front, section)
  for name in SLICE_SECTIONS if not front else ():  # a run of the slice alone: its own tables
    if any(r["section"] == name for r in rows):
      lines += ["", render.section_heading(name), "", *tables(rows, name)]
  return lines
