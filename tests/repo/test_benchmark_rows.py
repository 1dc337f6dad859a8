"""The pages' blocks rendered from committed rows (``python -m benchmarks render``) are what the
rows give: the README's Measured table and the frontier page's latest section cannot drift from
``benchmarks/results/data/rows.jsonl``, nor a results page's ``<!-- rows:<job>[:<section>]:begin
-->`` block from ``benchmarks/results/data/<job>.rows.jsonl``. Every job adds typed rows where it
measures and prints the tables they give: one small job is run for it, every job's module is read
for it. Run as commands (tests import nothing from benchmarks/, tests/repo/test_layout.py)."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ROWS = RESULTS / "data" / "rows.jsonl"
BLOCK = re.compile(r"<!-- rows:([a-z0-9_-]+)(?::([a-z0-9_-]+))?:begin -->")


def _render(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run(
    [sys.executable, "-m", "benchmarks", "render", "--check", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_the_rendered_blocks_are_what_the_committed_rows_give():
  done = _render()
  assert done.returncode == 0, done.stdout + done.stderr
  assert "drifted: nothing" in done.stdout


def test_a_changed_figure_is_drift(tmp_path):
  rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
  point = next(r for r in rows if r["section"] == "point" and r["figures"]["point"] == "flax")
  point["figures"]["memory"] += 1
  changed = tmp_path / "rows.jsonl"
  changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
  done = _render("--rows", str(changed))
  assert done.returncode == 1 and "README.md" in done.stderr, done.stdout + done.stderr


def _job_blocks() -> dict[str, list[str]]:
  """``{job: [the results pages with a block of it]}``, the main job's excepted."""
  found: dict[str, list[str]] = {}
  for page in sorted(RESULTS.glob("*.md")):
    for m in BLOCK.finditer(page.read_text()):
      if m[1] not in ("main", "frontier"):
        found.setdefault(m[1], []).append(page.name)
  return found


def test_every_job_block_has_its_committed_rows_and_every_rows_file_a_page():
  blocks = _job_blocks()
  files = {p.name.removesuffix(".rows.jsonl") for p in (RESULTS / "data").glob("*.rows.jsonl")}
  assert set(blocks) == files, f"blocks of {sorted(blocks)}, rows of {sorted(files)}"
  for job in files:
    lines = (RESULTS / "data" / f"{job}.rows.jsonl").read_text().splitlines()
    for r in map(json.loads, lines):
      assert r["job"] == job and r["meta"]["command"].startswith(f"python -m benchmarks {job}")
      assert {"date", "host", "cores", "python", "jax", "jaxlib", "jaxact"} <= set(r["meta"])


def _more(v):
  """`v` with every number it holds one more."""
  if isinstance(v, list | dict):
    return [*map(_more, v)] if isinstance(v, list) else {k: _more(x) for k, x in v.items()}
  return v + 1 if isinstance(v, int | float) and not isinstance(v, bool) else v


def test_a_changed_figure_in_a_jobs_rows_is_drift_on_its_page(tmp_path):
  for job, pages in sorted(_job_blocks().items()):  # one job's rows changed at a time
    data = tmp_path / job
    shutil.copytree(RESULTS / "data", data)
    rows_file = data / f"{job}.rows.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    for r in rows:
      r["figures"] = _more(r["figures"])
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _render("--data", str(data))
    assert done.returncode == 1, f"{job}: " + done.stdout + done.stderr
    assert all(page in done.stderr for page in pages), f"{job}: " + done.stderr


def test_render_never_starts_jax():
  code = (
    "import sys\nfrom benchmarks import render\nrender.main(['--check'])\n"
    "assert 'jax' not in sys.modules, 'render imported jax'"
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stdout + done.stderr


# What records a row: harness.rows' add and emit (the jobs' own record_* helpers call them),
# Sections.emit (aot, gpu), a Recorder's add (the main job, the GPU run).
RECORDS = {"add", "emit", "add_row"}
NO_ROWS = {"hlo": "writes HLO files", "render": "renders committed rows"}


def _jobs() -> dict[str, str]:
  """``{job: its module under benchmarks/}``, read from the JOBS table of benchmarks/__main__.py."""
  tree = ast.parse((ROOT / "benchmarks" / "__main__.py").read_text())
  table = next(
    n.value
    for n in ast.walk(tree)
    if isinstance(n, ast.AnnAssign | ast.Assign)
    and getattr(getattr(n, "target", None) or n.targets[0], "id", "") == "JOBS"
  )
  return {k.value: v.args[0].value for k, v in zip(table.keys, table.values, strict=True)}


def _records(path: Path) -> bool:
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call):
      f = node.func
      name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
      if name in RECORDS or name.startswith("record_"):
        return True
  return False


def test_every_job_adds_rows_where_it_measures():
  jobs = _jobs()
  assert {"main", "gated", "lm", "fewbit", "gemma"} <= set(jobs)
  silent = []
  for job, module in jobs.items():
    base = ROOT / "benchmarks" / Path(*module.split("."))
    files = sorted(base.glob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    if job not in NO_ROWS and not any(map(_records, files)):
      silent.append(job)
  assert silent == [], "these jobs add no rows (benchmarks.harness.rows.add / emit)"


# Jobs whose printed output is not drawn from their rows by a benchmarks/tables module yet.
NO_TABLES = NO_ROWS | {"gpu": "the GPU harness's report (benchmarks/gpu), not yet from its rows"}


def test_every_job_draws_its_tables_from_its_rows_without_jax():
  jobs = [job for job in _jobs() if job not in NO_TABLES]
  missing = [job for job in jobs if not (ROOT / "benchmarks" / "tables" / f"{job}.py").exists()]
  assert missing == [], "these jobs have no benchmarks/tables/<job>.py with tables(rows, section)"
  code = (
    "import importlib, sys\n"
    f"for job in {jobs!r}:\n"
    "  assert callable(importlib.import_module(f'benchmarks.tables.{job}').tables), job\n"
    "assert 'jax' not in sys.modules, 'a tables module imports jax'"
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stdout + done.stderr


def test_no_rows_are_parsed_from_printed_tables():
  source = (ROOT / "benchmarks" / "harness" / "rows.py").read_text()
  assert "printed_rows" not in source and "stdout" not in source


SMALL_JOB = """
import contextlib, io, json, pathlib
from benchmarks.__main__ import main
from benchmarks import sweep
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
  main(["sweep", "--only", "relu,elu", "--dtypes", "bfloat16"])
rows = [json.loads(line) for line in pathlib.Path("bench-out/sweep.rows.jsonl").open()]
print(json.dumps({"printed": printed.getvalue(), "rows": rows,
                  "table": sweep.table(rows, ["bfloat16"])}))
"""


def test_a_job_writes_typed_rows_and_prints_the_table_they_give(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  done = subprocess.run(
    [sys.executable, "-c", SMALL_JOB],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr
  got = json.loads(done.stdout.splitlines()[-1])
  rows = got["rows"]
  assert [r["case"] for r in rows] == ["relu", "elu", "elu alpha=-0.5"]
  for r in rows:
    assert r["job"] == "sweep" and r["section"] == "sweep"
    meta = r["meta"]
    assert meta["command"] == "python -m benchmarks sweep --only relu,elu --dtypes bfloat16"
    assert {"date", "host", "device", "platform", "python", "jax", "jaxlib", "jaxact"} <= set(meta)
    f = r["figures"]
    assert f["dtype"] == "bfloat16" and f["inputs"] == 65280
    assert isinstance(f["nan"], int) and isinstance(f["value_ulps"], float)
  assert got["table"] in got["printed"]
