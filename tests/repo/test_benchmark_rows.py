"""The pages' blocks rendered from committed rows (``python -m benchmarks render``) are what the
rows give: the README's Measured table and the frontier page's latest section cannot drift from
``benchmarks/results/data/rows.jsonl``. Run as a command (tests import nothing from benchmarks/,
tests/repo/test_layout.py); it never starts jax."""

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
