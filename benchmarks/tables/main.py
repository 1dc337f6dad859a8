"""The main job's page from its rows: the suite's ``results.md``
(``benchmarks.suite.report``, pure Python), without its pictures."""

from __future__ import annotations

from benchmarks.suite.report import render
from benchmarks.suite.run import Run


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """The page the job writes beside its rows (`section`: ignored, the page is one piece)."""
  return render(Run(rows), [], "rows.jsonl").splitlines()
