"""Markdown from rows: tables, number formats, and blocks of a page kept between markers.

Pure Python: ``python -m benchmarks render`` and its test never start jax.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence


def fmt(value, spec: str = "{:.1f}") -> str:
  return "—" if value is None else spec.format(value)


def geomean(values: Iterable[float]) -> float:
  values = list(values)
  return math.exp(sum(math.log(v) for v in values) / len(values))


def wrap(text: str, first: str = "", rest: str = "") -> list[str]:
  """`text` as lines of at most 100 characters, the first after `first`, the others after
  `rest` (a Markdown bullet: ``"- "`` and ``"  "``)."""
  return textwrap.wrap(
    text, 100, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
  )


def table(header: Sequence[str], align: str, body: Iterable[Sequence[str]]) -> list[str]:
  """A Markdown table; `align` has a letter a column: ``l`` (left) or ``r`` (right)."""
  rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
  return [f"| {' | '.join(header)} |", rule, *(f"| {' | '.join(cells)} |" for cells in body)]


def markers(name: str) -> tuple[str, str]:
  return f"<!-- rows:{name}:begin -->", f"<!-- rows:{name}:end -->"


def block(text: str, name: str) -> str:
  """What stands between `name`'s markers in `text` (ValueError where they are missing)."""
  begin, end = markers(name)
  found = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.S)
  if found is None:
    raise ValueError(f"no {begin} ... {end} block")
  return found.group(1)


def with_block(text: str, name: str, lines: Sequence[str]) -> str:
  """`text` with `name`'s block replaced by `lines`."""
  old = block(text, name)
  begin, end = markers(name)
  return text.replace(
    begin + "\n" + old + end, begin + "\n" + "".join(f"{x}\n" for x in lines) + end
  )


def cells_of(r: dict) -> dict:
  """A row's figures with its case, what a :class:`Table`'s cells are drawn from."""
  return {"case": r["case"], **r["figures"]}


@dataclasses.dataclass(frozen=True)
class Table:
  """A Markdown table drawn from rows: its header, and the cells of one row (a function of the
  row's figures with its ``case``, :func:`cells_of`), one a column."""

  header: Sequence[str]
  cells: Callable[[dict], Sequence[str]]
  align: str = ""  # a letter a column (:func:`table`); every column left where empty

  def head(self) -> list[str]:
    return table(self.header, self.align or "l" * len(self.header), [])

  def line(self, r: dict) -> str:
    return f"| {' | '.join(self.cells(cells_of(r)))} |"

  def lines(self, rows: Iterable[dict]) -> list[str]:
    return [*self.head(), *map(self.line, rows)]


def section_heading(section: str) -> str:
  return f"### {section}"


def by_section(
  draw: dict[str, Callable], rows: list[dict], section: str | None = None
) -> list[str]:
  """A job's tables from its rows: each section it ran, under its heading, drawn by
  ``draw[section](its rows, section)`` (`section` alone: its table without the heading)."""
  if section is not None:
    return draw[section]([r for r in rows if r["section"] == section], section)
  lines: list[str] = []
  for name in dict.fromkeys(r["section"] for r in rows):
    these = [r for r in rows if r["section"] == name]
    lines += ["", section_heading(name), "", *draw[name](these, name)]
  return lines
