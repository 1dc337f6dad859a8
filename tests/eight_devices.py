"""Running test cases in a subprocess with 8 virtual CPU devices (shared by the sharding tests).

A case script (``sharding_cases.py``, ``pallas_sharding_cases.py``) runs its cases with
:func:`run_cases`, one JSON line each; the test module runs the script with :func:`run_script`
(JAX fixes its device count when the backend starts, which in the pytest process has happened
already) and reads one case's line with :func:`get`. Imports nothing from JAX.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest


def run_cases(cases: dict[str, Callable[[], None]], names: Iterable[str]) -> None:
  """Run the named cases (all when none is named); each prints its own JSON line, or an error."""
  for name in names or cases:
    try:
      cases[name]()
    except Exception as e:  # reported, so that the other cases still run
      print(json.dumps(dict(case=name, error=f"{type(e).__name__}: {e}"[:3000])), flush=True)


def run_script(script: Path, names: Iterable[str] = ()) -> dict[str, dict]:
  """The JSON result of every case `script` prints (the named ones, or all), by case name, run on
  8 CPU devices."""
  return run_command([str(script), *names], script.name)


def run_command(args: list[str], what: str) -> dict[str, dict]:
  """:func:`run_script` for any ``python`` command line (``["-m", "benchmarks.gemma", ...]``),
  run in the checkout's root."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
  env["JAX_PLATFORMS"] = "cpu"
  # The script's folder, not the working directory, starts its sys.path: put this checkout first,
  # so that it imports this jaxact, not another checkout's editable install.
  root = str(Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
    [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=root
  )
  out = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      result = json.loads(line)
      out[result["case"]] = result
  if proc.returncode != 0 or not out:
    pytest.fail(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  return out


def run_script_once(script: Path, tmp_path_factory, names: Iterable[str] = ()) -> dict[str, dict]:
  """:func:`run_script`, once per test session even under pytest-xdist: the first worker to ask
  runs it and leaves the results in the session's temporary folder for the others."""
  import fcntl

  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the session's folder, which every worker's lies in
  done, lock = root / f"{script.stem}.json", root / f"{script.stem}.lock"
  with open(lock, "w") as fh:
    fcntl.flock(fh, fcntl.LOCK_EX)
    if done.exists():
      return json.loads(done.read_text())
    results = run_script(script, names)
    done.write_text(json.dumps(results))
    return results


def get(results: dict[str, dict], name: str, script: Path) -> dict:
  """Case `name`'s result, which must exist, hold no error and come from 8 devices."""
  result = results.get(name)
  assert result is not None, f"{script.name} gave no result for {name}"
  assert "error" not in result, f"{name}: {result['error']}"
  assert result["devices"] == 8
  return result
