"""A job of sections: each section printed as Markdown, its data added as rows
(`benchmarks.harness.rows`), and the report and data so far saved to ``--out`` after each one
(``<stem>.md``, ``<stem>.json``), so that what a run measured survives it being stopped."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks.harness import rows


def _case(row: dict) -> str:
  if "name" in row:
    return str(row["name"])

  def named(v) -> bool:  # a label or a shape, not a figure
    return isinstance(v, str) or (
      isinstance(v, list | tuple) and all(isinstance(i, int) for i in v)
    )

  return ", ".join(str(v) for v in row.values() if named(v))


class Sections:
  def __init__(self, out: str | None, stem: str, head: list[str] = (), level: str = "##"):
    self.out, self.stem, self.level = out, stem, level
    self.report, self.data = list(head), {}

  def emit(self, name: str, data: Any, lines: list[str]) -> None:
    block = [f"{self.level} {name}", "", *lines, ""]
    print("\n".join(block), flush=True)
    self.report += block
    self.data[name] = data
    rec = rows.current()
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
      for r in data:
        rec.add(name, _case(r), **r)
    elif data is not None:
      rec.add(name, name, data=data)
    if self.out:
      out = pathlib.Path(self.out)
      out.mkdir(parents=True, exist_ok=True)
      (out / f"{self.stem}.md").write_text("\n".join(self.report))
      (out / f"{self.stem}.json").write_text(json.dumps(self.data, indent=1, default=str))
