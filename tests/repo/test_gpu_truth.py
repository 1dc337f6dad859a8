"""The GPU truth run's harness (``python -m benchmarks gpu --truth``, issue 34) before a GPU
meets it: steps in priority order under a budget, skipped when their estimate would overrun it,
exceptions caught, verdicts and tables on disk as they are made, a hung step recorded before the
process ends; the check that judges kernels against XLA failing what it should; and the command's
``--dry-run`` on the CPU (the step list, the harness proved with stand-ins).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from support import truth as th
from support.gpu_compare import TOL, compare_to_xla, within

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Clock:
  """Process age under the test's control: each step advances it by what it 'costs'."""

  def __init__(self, now: float = 0.0):
    self.now = now

  def __call__(self) -> float:
    return self.now


def _step(name, priority, seconds, clock, *, cost=None, status="ok", raises=None, hopper=False):
  def run(ctx):
    clock.now += seconds if cost is None else cost
    if raises is not None:
      raise raises
    ctx.verdict(f"{name} k", status, "detail")
    return [f"table of {name}"], {"name": name}

  return th.Step(name, priority, seconds, run, f"what {name} does", hopper)


def _runner(steps, budget, tmp_path, clock, **kw):
  report = th.Report(
    str(tmp_path), th.header("test device", ["cmd", "--truth"], budget), kw.pop("stream", None)
  )
  return th.Runner(th.ordered(steps), budget, report, clock=clock, **kw)


def test_steps_run_by_priority_within_the_budget_and_write_as_they_go(tmp_path, capsys):
  clock = Clock(5.0)  # the process's start-up counts
  steps = [
    _step("late", 2, 10, clock),
    _step("raises", 1, 10, clock, raises=ValueError("bad shape\nmore lines")),
    _step("first", 0, 20, clock),
    _step("too-long", 1, 100, clock),  # 35 s spent, 65 left: skipped ...
    _step("wrong", 1, 10, clock, status="FAIL"),  # ... and the cheaper steps after it still run
    _step("hopper-only", 1, 1, clock, hopper=True),
  ]
  runner = _runner(steps, 100, tmp_path, clock)
  verdicts = runner.run(th.Context(hopper=False))
  assert [v.line() for v in verdicts] == [
    "VERDICT first k: ok (detail)",
    "VERDICT raises: ERROR ValueError: bad shape",
    "VERDICT too-long: skipped: budget (needs ~100 s, 65 s left)",
    "VERDICT wrong k: FAIL (detail)",
    "VERDICT hopper-only: skipped: not a Hopper GPU",
    "VERDICT late k: ok (detail)",
  ]
  assert runner.redo == ["raises", "too-long", "wrong"]
  printed = capsys.readouterr().out
  assert all(v.line() in printed for v in verdicts)

  md = (tmp_path / "truth.md").read_text()
  assert "- device: test device" in md and "- command: cmd --truth" in md and "- jax: " in md
  assert md.index("## first") < md.index("table of first") < md.index("## raises")
  assert "[raises: error, 10 s]" in md
  assert "ValueError: bad shape" in (tmp_path / "truth-errors.log").read_text()
  doc = json.loads((tmp_path / "truth.json").read_text())
  assert doc["header"]["budget_s"] == 100 and "date" in doc["header"]
  states = {s["name"]: (s["state"], s.get("seconds")) for s in doc["steps"]}
  assert states["first"] == ("done", 20.0) and states["too-long"] == ("skipped", 0.0)
  assert doc["steps"][0]["data"] == {"name": "first"}


def test_every_verdict_is_on_disk_before_the_step_ends(tmp_path):
  clock = Clock()
  seen = []

  def run(ctx):
    ctx.verdict("one", "ok", "first of two")
    seen.append((tmp_path / "truth.md").read_text())
    seen.append(json.loads((tmp_path / "truth.json").read_text()))
    ctx.verdict("two", "FAIL", "second")
    return [], None

  runner = _runner([th.Step("s", 0, 1, run)], 10, tmp_path, clock)
  runner.run(th.Context())
  assert "VERDICT one: ok (first of two)" in seen[0]
  assert seen[1]["steps"][0]["state"] == "running"
  assert seen[1]["steps"][0]["verdicts"] == [
    {"kernel": "one", "status": "ok", "detail": "first of two"}
  ]


def test_estimates_scale_by_what_the_finished_steps_took(tmp_path):
  clock = Clock()
  steps = [
    _step("a", 0, 20, clock, cost=40),
    _step("b", 0, 20, clock, cost=40),  # 80 s spent for 40 estimated: estimates x 2
    _step("c", 0, 30, clock),  # needs ~60 s, 40 left
    _step("d", 0, 15, clock),  # needs ~30 s
  ]
  runner = _runner(steps, 120, tmp_path, clock)
  got = [v.line() for v in runner.run(th.Context())]
  assert got[2] == "VERDICT c: skipped: budget (needs ~60 s, 40 s left)"
  assert got[3] == "VERDICT d k: ok (detail)"
  assert runner.scale == pytest.approx(95 / 55)  # d took its estimate


def test_a_step_past_the_budget_is_recorded_as_hung_and_the_process_ends(tmp_path):
  clock = Clock()
  release, exits = threading.Event(), []

  def hangs(ctx):
    ctx.verdict("before the hang", "ok")
    clock.now = 61.0  # a kernel that never returns, past the budget
    release.wait(10)
    return [], None

  def exit(code):
    exits.append(code)
    release.set()

  steps = [th.Step("hangs", 0, 10, hangs), _step("after", 1, 1, clock)]
  runner = _runner(
    steps, 60, tmp_path, clock, exit=exit, poll=0.01, rerun=lambda n: f"rerun {n[0]}"
  )
  runner.run(th.Context())
  assert exits == [3]
  doc = json.loads((tmp_path / "truth.json").read_text())
  hung = doc["steps"][0]
  assert hung["state"] == "hung"
  assert [v["status"] for v in hung["verdicts"]] == ["ok", "ERROR"]
  assert "no result after 61 s (the budget ran out" in hung["verdicts"][1]["detail"]
  assert doc["rerun"] == "rerun hangs"  # the summary, written by the watchdog before the exit
  assert "VERDICT hangs: ERROR no result after" in (tmp_path / "truth.md").read_text()


def test_the_hang_limit_gives_slow_steps_room():
  assert th.hang_limit(10) == 130 and th.hang_limit(100) == 400


def test_only_selects_by_name_and_pattern_and_refuses_unknown_names():
  steps = [th.Step(n, 0, 1, None) for n in ("gated-triton-bf16", "gated-mosaic-bf16", "time-lce")]
  assert [s.name for s in th.select(steps, "time-lce,gated-m*")] == [
    "gated-mosaic-bf16",
    "time-lce",
  ]
  assert th.select(steps, None) == steps
  with pytest.raises(ValueError, match=r"--only 'lce' names no step; the steps: gated-triton"):
    th.select(steps, "time-lce,lce")
  with pytest.raises(ValueError, match="step names repeat"):
    th.ordered([*steps, steps[0]])


def test_verdict_lines():
  assert th.Verdict("k", "ok", "max rel err 1e-3").line() == "VERDICT k: ok (max rel err 1e-3)"
  assert th.Verdict("k", "ERROR", "E: x").line() == "VERDICT k: ERROR E: x"
  assert th.Verdict("k", "skipped", "budget").line() == "VERDICT k: skipped: budget"
  with pytest.raises(ValueError, match="Verdict status 'fine'; accepted: ok, FAIL"):
    th.Verdict("k", "fine")
  assert th.one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"


def test_process_age_counts_from_the_process_start():
  age = th.process_age()
  time.sleep(0.05)
  assert 0 < age < th.process_age() < 24 * 3600


# ------------------------------------------------------------------------------ the check


def _build(scale=1.0, nan=False):
  """``tanh(x @ w)``: the "kernel" path (any implementation but xla) off by `scale`."""

  def build(impl, precision):
    def f(x, w):
      y = jnp.tanh(jnp.dot(x, w, precision=precision))
      if impl != "xla":
        y = y * scale
        if nan:
          y = y.at[0, 0].set(jnp.nan)
      return y

    return f

  return build


def _args(dtype):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), dtype)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)) / 4, dtype)
  return x, w


def test_the_check_passes_the_xla_path_and_fails_a_wrong_kernel():
  ok = compare_to_xla(_build(), _args(jnp.bfloat16), "pallas", names=("y", "dx", "dw"))
  assert ok.ok and ok.summary().startswith("max rel err ")
  assert ok.dtypes == ("bfloat16",) * 3
  # 5% off in y (and in the gradients through it): beyond bfloat16's allowance of 3%
  bad = compare_to_xla(_build(1.05), _args(jnp.bfloat16), "pallas", names=("y", "dx", "dw"))
  assert not bad.ok
  assert re.match(r"y \d\.\de-02 > 3\.\de-02 allowed \(xla \d\.\de-0\d\)", bad.summary())
  # float32 allows far less: 0.5% off fails there
  assert TOL["float32"] < 0.005 < TOL["bfloat16"]
  assert not within([0.005], [1e-7], "float32") and within([0.005], [1e-7], "bfloat16")
  # each output: up to twice XLA's error (at least 1e-5) plus its dtype's rounding
  assert within([0.0039, 0.001], [0.0015, 1e-7], ["float32", "float32"])
  assert not within([0.0041, 0.001], [0.0015, 1e-7], ["float32", "float32"])
  assert not within([0.0011], [1e-7], ["float32"]) and within([0.0011], [1e-7], ["float16"])
  nan = compare_to_xla(_build(nan=True), _args(jnp.float32), "pallas")
  assert not nan.ok and "y inf > " in nan.summary()


# ---------------------------------------------------------------------------- the command


def _command(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("OUT", None)
  return subprocess.run(
    [sys.executable, "-m", "benchmarks", "gpu", "--truth", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_the_dry_run_lists_the_steps_and_proves_the_harness(tmp_path):
  done = _command("--dry-run", "--out", str(tmp_path))
  assert done.returncode == 0, done.stdout + done.stderr
  out = done.stdout
  plan = re.findall(r"^\s+\d+  (\S+)\s+(\d+)\s+(\d+)\s+(\d+)  ", out, re.M)
  names = [p[0] for p in plan]
  assert names[0] == "env" and "gated-triton-bf16" in names and "time-decoder" in names
  assert {"lce-mosaic-bf16", "codes-mosaic-bf16", "attention-bf16", "time-lce"} <= set(names)
  priorities = [int(p[1]) for p in plan]
  assert priorities == sorted(priorities)  # in the order they run
  assert "against a budget of 540 s" in out
  assert "harness: ok" in out
  for status in ("ok (", "FAIL (", "ERROR RuntimeError", "skipped: budget", "skipped: not a Hop"):
    assert f": {status}" in out
  assert (tmp_path / "truth.json").exists() and "## Summary" in (tmp_path / "truth.md").read_text()


@pytest.mark.exhaustive
def test_the_command_refuses_unknown_steps_and_a_missing_gpu():
  bad = _command("--only", "no-such-step", "--list")
  assert bad.returncode == 2 and "--only 'no-such-step' names no step" in bad.stderr
  none = _command("--only", "env")
  assert none.returncode == 2 and "needs a CUDA GPU" in none.stderr


@pytest.mark.exhaustive
def test_the_rehearsal_runs_every_step_at_tiny_shapes(tmp_path):
  """Every real step on the CPU, kernels in interpret mode (several minutes)."""
  done = _command("--dry-run", "--rehearse", "--out", str(tmp_path), timeout=3600)
  doc = json.loads((tmp_path / "truth.json").read_text())
  bad = [v for s in doc["steps"] for v in s["verdicts"] if v["status"] in ("FAIL", "ERROR")]
  assert done.returncode == 0 and not bad, (bad, done.stderr[-3000:])
