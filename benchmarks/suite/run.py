"""The main job's rows read back: what its pages are rendered from (pure Python, no jax)."""

from __future__ import annotations

import dataclasses

from benchmarks.harness import frontier as fr
from benchmarks.harness.render import geomean


@dataclasses.dataclass
class Frontier:
  """One model's points and how they were measured (rows ``frontier`` and ``point``)."""

  key: str  # "mlp_relu", ..., "gated", "decoder"
  name: str  # "MLP, relu", ...
  title: str  # the model's sizes
  unit: str  # "buffers" or "MiB"
  flax_seconds: float  # Flax's step, as timed
  runs: int  # alternated rounds
  points: list[fr.Point] = dataclasses.field(default_factory=list)

  def get(self, key: str) -> fr.Point | None:
    return next((p for p in self.points if p.key == key), None)


class Run:
  """The rows of one run of the main job, by section."""

  def __init__(self, rows: list[dict]):
    self.rows = rows
    self.meta = rows[0]["meta"] if rows else {}
    by = {}
    for r in rows:
      by.setdefault(r["section"], []).append(r)
    self.by_section = by
    self.settings = self.one("run", "settings")
    self.time = self.one("run", "time")
    self.frontiers: dict[str, Frontier] = {
      r["case"]: Frontier(r["case"], **r["figures"]) for r in self.section("frontier")
    }
    for r in self.section("point"):
      f = r["figures"]
      spread = tuple(f["spread"]) if f["spread"] is not None else None
      self.frontiers[f["model"]].points.append(fr.point(f["point"], f["memory"], f["time"], spread))

  def section(self, name: str) -> list[dict]:
    return self.by_section.get(name, [])

  def one(self, section: str, case: str) -> dict:
    return next((r["figures"] for r in self.section(section) if r["case"] == case), {})

  @property
  def quick(self) -> bool:
    return bool(self.settings.get("quick"))

  def memory_ratio(self) -> tuple[int, float] | None:
    """How many activations, and the geometric mean of jaxact's 8-layer MLP temp over jax.nn's."""
    ratios = [
      r["figures"]["temp_jaxact"] / r["figures"]["temp_jaxnn"]
      for r in self.section("memory")
      if r["figures"]["temp_jaxnn"]
    ]
    return (len(ratios), geomean(ratios)) if ratios else None

  def step_ratio(self) -> tuple[int, float] | None:
    rows = [r["figures"] for r in self.section("step")]
    if not rows:
      return None
    return len(rows), geomean(f["jaxact_seconds"] / f["jaxnn_seconds"] for f in rows)

  def nan_totals(self) -> dict[str, list[int]]:
    """``{"jax.nn": [NaN values, non-finite gradients], "jaxact": [...]}`` over every row."""
    totals = {"jax.nn": [0, 0], "jaxact": [0, 0]}
    for r in self.section("nan"):
      for lib, key in (("jax.nn", "jaxnn"), ("jaxact", "jaxact")):
        counts = r["figures"][key]
        if counts is not None:
          totals[lib][0] += counts[0]
          totals[lib][1] += counts[1]
    return totals
