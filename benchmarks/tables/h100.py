"""The h100 job's tables from its rows (sections ``rates``, ``model``, ``point``): each
model's front over the compiled temp for an H100 (or the tpu job's chip) and the ESTIMATED step
time."""

from __future__ import annotations

from benchmarks.harness import frontier as fr
from benchmarks.harness import render

MiB = 2**20
POINT = render.Table(
  ("point", "temp MiB", "TFLOP", "GB", "step ms, estimate", "flops counted on"),
  lambda f: [
    f["case"],
    f"{f['temp_bytes'] / MiB:.0f}",
    f"{f['flops'] / 1e12:.1f}",
    f"{f['bytes'] / 1e9:.1f}",
    f"{f['estimate_s'] * 1e3:.1f}",
    f["flops_from"],
  ],
  "lrrrrl",
)


def _points(rows: list[dict], key: str) -> tuple[list[fr.Point], dict[str, float]]:
  """A model's points, temp to the MiB and the estimate relative to Flax's to 1% (closer points
  are level: the estimate is far coarser), and each point's estimate in ms."""
  found = [r["figures"] for r in rows if r["section"] == "point" and r["figures"]["model"] == key]
  flax = next(f["estimate_s"] for f in found if f["point"] == "flax")
  points = [
    fr.point(f["point"], round(f["temp_bytes"] / MiB), round(f["estimate_s"] / flax, 2))
    for f in found
  ]
  return points, {f["point"]: f["estimate_s"] * 1e3 for f in found}


def _at(p: fr.Point, ms: dict[str, float]) -> str:
  return f"{p.memory:.0f} MiB, {ms[p.key]:.1f} ms"


def summary(rows: list[dict]) -> list[str]:
  """Per model: Flax, Flax + remat's least temp, jaxact's least temp at Flax's estimated time or
  less, the front, and the Flax points on it."""
  measured = {r["figures"]["model"] for r in rows if r["section"] == "point"}
  body = []
  for r in (r for r in rows if r["section"] == "model" and r["case"] in measured):
    points, ms = _points(rows, r["case"])
    v = fr.verdict(points)
    smallest = "none" if v.smallest is None else f"{v.smallest.label}: {_at(v.smallest, ms)}"
    front = "; ".join(f"{p.label} {_at(p, ms)}" for p in fr.front(points))
    flax_front = "; ".join(fr.with_level(p, points, p.label) for p in v.flax_front) or "**none**"
    remat = f"{_at(v.remat, ms)} ({v.remat.label})"
    body.append([r["figures"]["name"], _at(v.flax, ms), remat, smallest, front, flax_front])
  header = [
    "model",
    "Flax: temp, estimated time",
    "Flax's least temp",
    "jaxact's least temp at Flax's estimated time or less",
    "the front (temp, estimated time)",
    "Flax points on the front",
  ]
  return render.table(header, "llllll", body)


def _sizes(rows: list[dict]) -> list[str]:
  rates = next((r["figures"] for r in rows if r["section"] == "rates"), {})
  models = "; ".join(
    f"{r['figures']['name']}: {r['figures']['title']}" for r in rows if r["section"] == "model"
  )
  device = str(rates.get("device"))
  tpu = device.startswith("TPU")
  target = f"a {device} chip" if tpu else f"an {device}"
  peaks = "the chip's published peaks" if tpu else "the H100 SXM's peaks"
  return render.wrap(
    f"Compiled for {target} on this machine, bfloat16. Step times are an ESTIMATE, "
    f"not a measurement: max(flops / {rates.get('flops_per_s', 0) / 1e12:.0f} TFLOP/s, bytes / "
    f"{rates.get('bytes_per_s', 0) / 1e12:.2f} TB/s), {peaks}, from XLA's cost "
    "analysis of the compiled program (loops counted their trip count of times; a program with "
    "Pallas kernels takes its flops from the same step compiled for the CPU); estimates within "
    "1% of each other count as level. Models: "
    f"{models}."
  )


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  if section == "point":
    return POINT.lines([r for r in rows if r["section"] == "point"])
  return [*_sizes(rows), "", *summary(rows)]
