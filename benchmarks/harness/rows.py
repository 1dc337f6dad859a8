"""Every job's measurements as rows of data, one JSON object a line.

A row is ``{"job", "section", "case", "figures": {name: number or text}, "meta": {...}}``; `meta`
is the run's: date, the command line, the device (kind, platform, count), the host and its load
average, the versions of Python, jax, jaxlib, flax and jaxact, and (once written) the run's wall
time in seconds. Every job adds its rows where it
measures, its figures named (:func:`add`; :func:`emit` also prints the row's line of a
`benchmarks.harness.render.Table`), and draws the tables it prints from them: the main job's in
``DIR/rows.jsonl`` (from which its ``results.md`` is rendered), every other job's in
``DIR/<job>.rows.jsonl``, ``DIR`` its ``--out`` (else ``bench-out``). Pure Python until a row is
written (``python -m benchmarks render`` never starts jax).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def metadata(command: str) -> dict[str, Any]:
  """The run's machine, versions, date and command line."""
  meta: dict[str, Any] = {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "command": command,
    "host": platform.node() or "host",
    "processor": platform.processor() or platform.machine(),
    "cores": os.cpu_count(),
    "load": round(os.getloadavg()[0], 2),  # other processes' share of a shared machine
    "python": platform.python_version(),
  }
  if "jax" in sys.modules:
    import jax

    dev = jax.devices()[0]
    meta |= {
      "device": dev.device_kind,
      "platform": dev.platform,
      "devices": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": jax.lib.__version__,
    }
  for name in ("flax", "jaxact"):
    if name in sys.modules:
      meta[name] = sys.modules[name].__version__
  return meta


def describe(meta: dict) -> str:
  """The machine and versions of :func:`metadata`, as one line of a page (a package the run did
  not import left out)."""
  versions = ", ".join(
    f"{name} {meta[key]}"
    for name, key in (("jax", "jax"), ("jaxlib", "jaxlib"), ("flax", "flax"), ("jaxact", "jaxact"))
    if meta.get(key) is not None
  )
  return (
    f"{meta.get('host')}: {meta.get('processor')}, {meta.get('cores')} cores, "
    f"{meta.get('devices')} x {meta.get('device')} ({meta.get('platform')}); "
    f"Python {meta.get('python')}, {versions}"
  )


def row(job: str, section: str, case: str, figures: dict[str, Any], meta: dict) -> dict:
  return {"job": job, "section": section, "case": case, "figures": figures, "meta": meta}


def _plain(value: Any) -> Any:
  """A NumPy or JAX scalar as its Python number; anything else JSON cannot hold as its text."""
  return value.item() if hasattr(value, "item") else str(value)


def write(path: pathlib.Path, rows: Iterable[dict]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r, default=_plain) + "\n" for r in rows))


def read(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Recorder:
  """One job's rows, added where it measures (:func:`add`, :func:`emit`)."""

  def __init__(self, job: str, argv: list[str]):
    self.job, self.argv = job, list(argv)
    self.command = " ".join(["python -m benchmarks", *([job] if job != "main" else []), *argv])
    self.rows: list[dict] = []
    self.path = _out(argv) / ("rows.jsonl" if job == "main" else f"{job}.rows.jsonl")
    self.written = False
    self._meta: dict | None = None
    self._start = time.monotonic()

  @property
  def meta(self) -> dict:
    if self._meta is None:
      self._meta = metadata(self.command)
    return self._meta

  def add(self, section: str, case: str, **figures: Any) -> dict:
    r = row(self.job, section, case, figures, self.meta)
    self.rows.append(r)
    return r

  def section(self, name: str) -> list[dict]:
    """The rows added to section `name`, in their order."""
    return [r for r in self.rows if r["section"] == name]

  def write(self) -> pathlib.Path | None:
    """Writes the rows once (none: nothing written); returns the file."""
    if self.written:
      return self.path
    if not self.rows:
      return None
    self.meta["seconds"] = round(time.monotonic() - self._start)  # every row's meta: the run's
    write(self.path, self.rows)
    self.written = True
    print(f"rows: {self.path}", file=sys.stderr)
    return self.path


def _out(argv: list[str]) -> pathlib.Path:
  for i, a in enumerate(argv):
    if a.startswith("--out=") or (a == "--out" and i + 1 < len(argv)):
      path = pathlib.Path(a.split("=", 1)[1] if "=" in a else argv[i + 1])
      return path.parent if path.suffix in (".md", ".txt") else path  # gemma's --out: a page
  return (
    pathlib.Path(os.environ.get("OUT") or "bench-out")
    if "--truth" in argv
    else pathlib.Path("bench-out")
  )


_current = Recorder("unknown", [])


def current() -> Recorder:
  """The running job's recorder (outside `python -m benchmarks`, one that is never written)."""
  return _current


def add(section: str, case: str, **figures: Any) -> dict:
  """Adds a row to the running job's rows (:func:`current`) and returns it."""
  return current().add(section, case, **figures)


def emit(table, section: str, case: str, **figures: Any) -> dict:
  """Adds a row to the running job's rows and prints its line of `table` (a
  `benchmarks.harness.render.Table`, whose head the job printed), at once."""
  r = add(section, case, **figures)
  print(table.line(r), flush=True)
  return r


@contextlib.contextmanager
def recording(job: str, argv: list[str]) -> Iterator[Recorder]:
  """The recorder of `job`'s rows while it runs (:func:`current`)."""
  global _current
  previous, _current = _current, Recorder(job, argv)
  try:
    yield _current
  finally:
    _current = previous
