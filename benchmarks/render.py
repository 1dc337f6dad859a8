"""`python -m benchmarks render [--check]`: the pages' blocks rendered from committed rows.

Every page of ``benchmarks/results/`` with a block ``<!-- rows:<job>[:<section>]:begin -->`` ...
``<!-- rows:<job>[:<section>]:end -->`` has it drawn from the committed rows of that job's run,
``benchmarks/results/data/<job>.rows.jsonl`` (copied there from the run's ``<job>.rows.jsonl``):
the run's date, command, machine and versions from the rows' meta, then the tables the job printed
(``benchmarks.tables.<job>``'s ``tables(rows, section)``: the whole run, or its one section). The
main job's rows of its latest committed run (``benchmarks/results/data/rows.jsonl``, copied
there from ``python -m benchmarks --quick --out DIR``'s ``DIR/rows.jsonl``) give the README's
Measured block (``<!-- rows:main:begin -->`` ... ``end``) and the latest table of
``benchmarks/results/frontier.md`` (``<!-- rows:frontier:begin -->`` ... ``end``). ``--check``
writes nothing and fails where a page's block is not what its rows give
(tests/repo/test_benchmark_rows.py runs it). A page's text outside its blocks is kept by hand.
Pure Python: never starts jax.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import sys

from benchmarks.harness import frontier as fr
from benchmarks.harness import render, rows
from benchmarks.suite.report import frontier_summary, run_time
from benchmarks.suite.run import Frontier, Run

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = RESULTS / "data" / "rows.jsonl"
JOB_BLOCK = re.compile(r"<!-- rows:([a-z0-9_-]+)(?::([a-z0-9_-]+))?:begin -->")
# README names of the models, the second activation of a model by its activation alone.
README_MODELS = {
  "mlp_relu": "8-layer MLP, relu (buffers)",
  "mlp_gelu": "gelu",
  "cnn_relu": "6-layer CNN, relu",
  "cnn_gelu": "gelu",
  "gated": "8 gated MLP blocks (MiB)",
  "decoder": "LM decoder step (MiB)",
  "resnet": "ResNet-50 (MiB)",
  "moe": "MoE block stack (MiB)",
}


def _short(p: fr.Point) -> str:
  """A point's label in the README: ``jaxact 2 bits`` is ``2-bit codes``."""
  return (
    p.label.replace("jaxact ", "").replace(" bits", "-bit codes") if " bits" in p.label else p.label
  )


def _readme_row(f: Frontier) -> list[str]:
  v = fr.verdict(f.points)
  mem = lambda p: fr.fmt_memory(p.memory, f.unit)
  remat = f"{mem(v.remat)}, {fr.fmt_time(v.remat.time)}"
  fastest = (
    "none"
    if v.fastest is None
    else f"{fr.fmt_time(v.fastest.time)}: {_short(v.fastest)}, {mem(v.fastest)}"
  )
  smallest = "none" if v.smallest is None else f"{mem(v.smallest)}: {_short(v.smallest)}"
  front = "; ".join(
    fr.with_level(
      p, v.points, f"{p.label.removeprefix('Flax + ')}: {mem(p)}, {fr.fmt_time(p.time)}"
    )
    for p in v.flax_front
  )
  return [
    README_MODELS.get(f.key, f"{f.name} ({f.unit})"),
    mem(v.flax),
    remat,
    fastest,
    smallest,
    front or "none",
  ]


def _range(values: list[float]) -> str:
  lo, hi = min(values), max(values)
  return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


KEPT = {"output": "the output kept", "input": "the input kept", "none": "nothing kept"}


def readme_block(run: Run) -> list[str]:
  m = run.meta
  header = [
    "model (temp in)",
    "Flax",
    "Flax + remat",
    "at its temp or less, jaxact's best time",
    "at Flax's time or less, jaxact's least temp",
    "Flax's points on the front",
  ]
  intro = (
    f"The main job's frontier (`{m['command']}`, {m['date'][:10]}, {m['cores']} cores "
    f"{m['processor']}, jax {m.get('jax')}, {run.time['seconds']:.0f} s; memory exact, step "
    "times relative to Flax's; rendered by `python -m benchmarks render` from "
    "its rows (`benchmarks/results/data/rows.jsonl`)):"
  )
  lines = [
    *render.wrap(intro),
    "",
    *render.table(header, "llllll", (_readme_row(f) for f in run.frontiers.values())),
    "",
    "The same run, against jax.nn:",
    "",
  ]
  by_residual: dict[str, list[dict]] = {}
  for r in run.section("memory"):
    by_residual.setdefault(r["figures"]["residual"], []).append(r["figures"] | {"name": r["case"]})
  parts, above = [], []
  for residual, group in by_residual.items():
    ours = [g["temp_jaxact"] for g in group]
    theirs = [g["temp_jaxnn"] for g in group if g["temp_jaxnn"] is not None]
    above += [
      g["name"] for g in group if g["temp_jaxnn"] is not None and g["temp_jaxact"] > g["temp_jaxnn"]
    ]
    kept = KEPT.get(residual, residual)
    n = f"{len(group)} activation" + ("s" if len(group) > 1 else "")
    parts.append(f"{kept} ({n}): {_range(ours)} against {_range(theirs)}")
  verdict = "Never above jax.nn." if not above else f"Above jax.nn: {', '.join(above)}."
  totals = run.nan_totals()
  lines += [
    *render.wrap(
      f"Per activation, the 8-layer MLP's temp in buffers, jaxact against jax.nn: "
      f"{'; '.join(parts)}. {verdict}",
      "- ",
      "  ",
    ),
    *render.wrap(
      f"NaN: on a grid of finite extreme inputs in four dtypes, jaxact {totals['jaxact'][1]} "
      f"non-finite gradients, jax.nn {totals['jax.nn'][1]}.",
      "- ",
      "  ",
    ),
  ]
  return lines


def frontier_block(run: Run) -> list[str]:
  m = run.meta
  machine = (
    f"{m['cores']} cores {m['processor']}, {m.get('device')}; Python {m['python']}, "
    f"jax {m.get('jax')}, jaxlib {m.get('jaxlib')}, flax {m.get('flax')}, jaxact {m.get('jaxact')}"
  )
  return [
    f"## {m['date'][:10]}: `{m['command']}`",
    "",
    "Rendered from its rows (`data/rows.jsonl`) by `python -m benchmarks render`.",
    "",
    *render.wrap(f"machine: {machine}", "- ", "  "),
    *render.wrap(f"run time: {run_time(run)}", "- ", "  "),
    "",
    *frontier_summary(run),
  ]


PAGES = {  # page: {block: its lines from the rows}
  "README.md": {"main": readme_block},
  "benchmarks/results/frontier.md": {"frontier": frontier_block},
}


def provenance(job: str, job_rows: list[dict]) -> list[str]:
  """Where a block's figures come from: each run's command, date, machine, versions (a rows file
  may hold several runs, each of some sections: then each run names its sections)."""
  runs: dict[tuple[str, str], list[dict]] = {}
  for r in job_rows:
    runs.setdefault((r["meta"]["date"], r["meta"]["command"]), []).append(r)
  sentences = []
  for these in runs.values():
    m = these[0]["meta"]
    took = f", {m['seconds']} s" if "seconds" in m else ""
    sections = list(dict.fromkeys(r["section"] for r in these))
    which = f" (section{'s' if len(sections) > 1 else ''} {', '.join(sections)})" * (len(runs) > 1)
    sentences.append(
      f"Measured {m['date'][:10]} by `{m['command']}`{took}{which}; {rows.describe(m)}; load "
      f"average {m.get('load')} at its first figure."
    )
  return render.wrap(
    " ".join(sentences)
    + f" Rendered from `data/{job}.rows.jsonl` by `python -m benchmarks render`."
  )


def job_block(job: str, section: str | None, job_rows: list[dict]) -> list[str]:
  """A page's block of `job` (its `section` alone, else the whole run) from the job's rows."""
  module = importlib.import_module(f"benchmarks.tables.{job}")
  if section is not None and not any(r["section"] == section for r in job_rows):
    raise ValueError(f"data/{job}.rows.jsonl has no section {section!r}")
  # a block draws and names the runs that measured it (a rows file may hold several runs); a
  # whole-job block leaves out the sections its module draws only in blocks of their own
  alone = getattr(module, "SEPARATE_SECTIONS", ())
  these = [
    r
    for r in job_rows
    if r["section"] == section or (section is None and r["section"] not in alone)
  ]
  lines = list(module.tables(job_rows if section is not None else these, section))
  while lines and not lines[0]:
    lines.pop(0)
  return [*provenance(job, these), "", *lines]


def job_blocks(text: str) -> list[tuple[str, str | None]]:
  """The ``(job, section)`` of every job block in a page's text, the main job's excepted."""
  found = [(m[1], m[2]) for m in JOB_BLOCK.finditer(text)]
  return [(job, section) for job, section in found if job not in ("main", "frontier")]


def render_page(path: pathlib.Path, data: pathlib.Path) -> str:
  """`path`'s text with every job block redrawn from `data`/<job>.rows.jsonl."""
  text = new = path.read_text()
  for job, section in job_blocks(text):
    rows_file = data / f"{job}.rows.jsonl"
    if not rows_file.exists():
      raise FileNotFoundError(f"{path.name} has a rows:{job} block but no {rows_file}")
    name = job if section is None else f"{job}:{section}"
    new = render.with_block(new, name, job_block(job, section, rows.read(rows_file)))
  return new


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks render", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--rows", type=pathlib.Path, default=DATA, help="the main job's rows")
  parser.add_argument(
    "--data", type=pathlib.Path, default=DATA.parent, help="the other jobs' <job>.rows.jsonl"
  )
  parser.add_argument("--check", action="store_true", help="fail where a page has drifted")
  args = parser.parse_args(argv)
  run = Run(rows.read(args.rows))
  drifted = []
  pages = [*PAGES, *sorted(str(p.relative_to(ROOT)) for p in RESULTS.glob("*.md"))]
  for page in dict.fromkeys(pages):
    path = ROOT / page
    text = path.read_text()
    new = render_page(path, args.data) if path.parent == RESULTS else text
    for name, make in PAGES.get(page, {}).items():
      new = render.with_block(new, name, make(run))
    if new != text:
      drifted.append(page)
      if not args.check:
        path.write_text(new)
  if args.check and drifted:
    print(
      f"not what the rows give: {', '.join(drifted)}; run python -m benchmarks render",
      file=sys.stderr,
    )
    return 1
  print(f"{'drifted' if args.check else 'rendered'}: {', '.join(drifted) or 'nothing'}")
  return 0
