"""The pages' blocks rendered from committed rows (``python -m benchmarks render``) are what the
rows give: the README's Measured table and the frontier page's latest section cannot drift from
``benchmarks/results/data/rows.jsonl``. Every job adds typed rows where it measures and prints the
tables they give: one small job is run for it, every job's module is read for it. Run as commands
(tests import nothing from benchmarks/, tests/repo/test_layout.py)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "benchmarks" / "results" / "data" / "rows.jsonl"


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
