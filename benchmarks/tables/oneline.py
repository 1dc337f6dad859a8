"""The oneline job's tables from its rows (sections ``lm1b``, ``lm1b-h100``, ``lm1b-nnx``,
``lm1b-nnx-h100``, ``resnet``, ``resnet-h100``, ``time``)."""

from __future__ import annotations

from benchmarks.harness import render


def _cells(f: dict) -> list[str]:
  return [f["way"], f"{f['temp_bytes'] / 2**20:.1f}", f"{f['ratio']:.2f}x"]


TABLE = render.Table(("way", "temp MiB", "/ the example as written"), _cells, "lrr")
WHERE = {"": "CPU, float32", "-h100": "compiled for an H100 on this machine, bfloat16"}


def _draw(rows: list[dict], section: str) -> list[str]:
  if not rows:
    return []
  f = rows[0]["figures"]
  where = WHERE["-h100" if section.endswith("-h100") else ""]
  return [f"{f['model']}, {f['size']}; {where}.", "", *TABLE.lines(rows)]


def _time(f: dict) -> list[str]:
  return [f["model"], f"{f['example_s']:.2f}", f"{f['ratio']:.3f}x"]


TIME = render.Table(
  ("model (CPU float32)", "example's step, s", "one line / example"), _time, "lrr"
)


def _draw_time(rows: list[dict], section: str) -> list[str]:
  return TIME.lines(rows) if rows else []


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  sections = ("lm1b", "lm1b-h100", "lm1b-nnx", "lm1b-nnx-h100", "resnet", "resnet-h100")
  draw = {s: _draw for s in sections} | {"time": _draw_time}
  return render.by_section(draw, rows, section)
