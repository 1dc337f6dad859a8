"""The gemma job's tables from its rows (sections ``cpu``, ``h100``, ``mesh``; ``check``)."""

from __future__ import annotations

import json

from benchmarks.harness import render

MiB = 2**20


MEMORY = render.Table(
  ("model", "compiled temp MiB", "/ original", "/ original + block remat"),
  lambda f: [
    f["case"],
    f"{f['temp_bytes'] / MiB:.1f}",
    f"{f['vs_original']:.2f}",
    f"{f['vs_original_remat']:.2f}",
  ],
)  # sections cpu, h100
MESH = render.Table(
  ("model", "per-device temp MiB", "/ original", "collective MiB a device", "in loops"),
  lambda f: [
    f["case"],
    f"{f['temp_bytes'] / MiB:.1f}",
    f"{f['vs_original']:.2f}",
    f"{f['collective_bytes'] / MiB:.1f}",
    str(f["collective_bytes_in_loops"]),
  ],
)


TITLES = {
  "cpu": "CPU, float32",
  "h100": "compiled for an H100, bfloat16 activations",
  "mesh": "a 4 x 2 (fsdp, tensor) mesh, 8 CPU devices, float32",
}


def _check(these: list[dict]) -> list[str]:
  """``--check``'s results, one JSON line a case, as it prints them."""
  return [json.dumps({"case": r["case"], **r["figures"]}) for r in these]


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: each section it ran under its title (`section` alone: its
  table without the title)."""
  draw = {"mesh": MESH.lines, "check": _check}
  if section is not None:
    return draw.get(section, MEMORY.lines)([r for r in rows if r["section"] == section])
  lines: list[str] = []
  for name in dict.fromkeys(r["section"] for r in rows):
    these = [r for r in rows if r["section"] == name]
    table = draw.get(name, MEMORY.lines)(these)
    lines += [
      *([""] if lines else []),
      *(table if name == "check" else [f"### {TITLES[name]}", "", *table]),
    ]
  return lines
