"""The harness of the GPU truth run (``python -m benchmarks gpu --truth``, issue 34).

A GPU is lent now and then for minutes, so one command must spend them well: the steps of a table
(:class:`Step`: name, priority, estimated seconds, function) run in priority order under a
wall-clock budget counted from the process's start, and each is skipped with a ``skipped: budget``
verdict when its estimate would overrun what is left. Every verdict is printed as one line
(``VERDICT gated-triton bf16 silu: ok (max rel err 2.1e-03 (dw) vs xla 2.0e-03)``) and written
under the output folder as it is made: a markdown log appended and flushed, a JSON document
replaced whole (never half written), tracebacks in their own file. A step that raises ends as an
``ERROR`` verdict and the next step runs. A step still running at its hang limit or at the budget
(a kernel that deadlocks cannot be interrupted) is recorded as hung and the process exits, with
everything before it on disk.

The steps themselves (what runs on the GPU) are ``benchmarks/gpu/truth.py``'s; this module knows
nothing of kernels, so that tests exercise it with stand-ins.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

_IMPORTED = time.monotonic()

STATUSES = ("ok", "FAIL", "ERROR", "skipped")


def process_age() -> float:
  """Seconds since this process started (from ``/proc``; elsewhere since this module's import)."""
  try:
    with open("/proc/self/stat") as fh:
      fields = fh.read().rsplit(")", 1)[1].split()
    with open("/proc/uptime") as fh:
      uptime = float(fh.read().split()[0])
    return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
  except (OSError, ValueError, IndexError):
    return time.monotonic() - _IMPORTED


# ------------------------------------------------------------------------------ the table


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What one kernel (or one timed comparison) came to.

  Attributes:
    kernel: what was checked, e.g. ``"gated-triton bf16 silu"``.
    status: ``"ok"``, ``"FAIL"`` (ran, disagrees), ``"ERROR"`` (raised) or ``"skipped"``.
    detail: the errors against XLA's, the exception in one line, or why it was skipped.
  """

  kernel: str
  status: str
  detail: str = ""

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"Verdict status {self.status!r}; accepted: {', '.join(STATUSES)}")

  def line(self) -> str:
    if self.status == "skipped":
      return f"VERDICT {self.kernel}: skipped: {self.detail}"
    if self.status == "ERROR":
      return f"VERDICT {self.kernel}: ERROR {self.detail}".rstrip()
    return f"VERDICT {self.kernel}: {self.status}" + (f" ({self.detail})" if self.detail else "")


@dataclasses.dataclass
class Context:
  """What a step's function is given.

  Attributes:
    hopper: the GPU is a Hopper (the Mosaic GPU kernels run); num_sms: its SMs.
    runs: timed repetitions a timing takes.
    small: a rehearsal on the CPU: tiny shapes, kernels in interpret mode, one repetition.
    results: what earlier steps left for later ones (e.g. the copy bandwidth), by key.
    verdict: records one :class:`Verdict` (set by the :class:`Runner`).
    log: keeps a traceback (the :class:`Runner` sends it to ``truth-errors.log``).
  """

  hopper: bool = False
  num_sms: int = 132
  runs: int = 10
  small: bool = False
  results: dict[str, Any] = dataclasses.field(default_factory=dict)
  verdict: Callable[..., Verdict] = dataclasses.field(default=lambda *a, **k: Verdict(*a, **k))
  log: Callable[[str], None] = dataclasses.field(default=lambda text: print(text, file=sys.stderr))

  def pick(self, gpu, small):
    """`small` in a rehearsal, else `gpu` (a step's shapes)."""
    return small if self.small else gpu


@dataclasses.dataclass(frozen=True)
class Step:
  """One entry of the truth table.

  Attributes:
    name: what ``--only`` names, e.g. ``"gated-triton-bf16"``.
    priority: lower runs first; ties keep the table's order.
    seconds: the estimated cost on an H100 (compiles included); the budget reads it.
    run: ``run(ctx) -> (markdown lines, JSON-able data)``; it records its verdicts with
      ``ctx.verdict(kernel, status, detail)`` as each is made (a step that records none and
      returns gets one ``ok`` verdict under its name).
    doc: one line: what it checks or times.
    hopper: it needs a Hopper GPU (skipped elsewhere).
  """

  name: str
  priority: int
  seconds: float
  run: Callable[[Context], tuple[list[str], Any]]
  doc: str = ""
  hopper: bool = False


def ordered(steps: Sequence[Step]) -> list[Step]:
  """`steps` by priority, the table's order within one priority."""
  names = [s.name for s in steps]
  if len(set(names)) != len(names):
    raise ValueError(f"step names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
  return sorted(steps, key=lambda s: s.priority)  # sorted is stable


def select(steps: Sequence[Step], only: str | None) -> list[Step]:
  """The steps `only` names (comma-separated names or shell patterns, ``gated-*``), all for
  None. A pattern that names no step is an error."""
  if not only:
    return list(steps)
  patterns = [p.strip() for p in only.split(",") if p.strip()]
  unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(s.name, p) for s in steps)]
  if unknown:
    raise ValueError(
      f"--only {unknown[0]!r} names no step; the steps: {', '.join(s.name for s in steps)}"
    )
  return [s for s in steps if any(fnmatch.fnmatchcase(s.name, p) for p in patterns)]


def plan_lines(steps: Sequence[Step], budget: float, start: float = 0.0) -> list[str]:
  """The steps in order with their estimates and where the estimates say the budget ends."""
  lines = [
    f"{'#':>3}  {'step':<26}{'prio':>4}{'est s':>7}{'cum s':>7}  what",
  ]
  total = start
  for i, s in enumerate(steps, 1):
    total += s.seconds
    over = "  [over budget by the estimates]" if total > budget else ""
    hopper = " (Hopper)" if s.hopper else ""
    lines.append(
      f"{i:>3}  {s.name:<26}{s.priority:>4}{s.seconds:>7.0f}{total:>7.0f}  {s.doc}{hopper}{over}"
    )
  lines.append(f"estimated total {total:.0f} s against a budget of {budget:.0f} s")
  return lines


# ------------------------------------------------------------------------------ the report


class Report:
  """``truth.md`` (appended, flushed), ``truth.json`` (replaced whole) and ``truth-errors.log``
  under `out` (nothing written when `out` is None); verdict lines also to `stream`."""

  def __init__(self, out: str | None, header: dict[str, Any], stream: TextIO | None = None):
    self.out, self.stream = out, stream or sys.stdout
    self.doc: dict[str, Any] = {"header": header, "steps": []}
    self._lock = threading.RLock()
    if out:
      os.makedirs(out, exist_ok=True)
      for name in ("truth.md", "truth-errors.log"):
        open(os.path.join(out, name), "w").close()
    lines = ["# GPU truth run", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    self.markdown(lines)
    self.say("\n".join(lines))
    self._save()

  def say(self, text: str) -> None:
    print(text, file=self.stream, flush=True)

  def markdown(self, lines: Sequence[str]) -> None:
    self._append("truth.md", "\n".join(lines) + "\n")

  def error_log(self, text: str) -> None:
    self._append("truth-errors.log", text.rstrip() + "\n\n")

  def _append(self, name: str, text: str) -> None:
    if not self.out:
      return
    with self._lock, open(os.path.join(self.out, name), "a") as fh:
      fh.write(text)
      fh.flush()
      os.fsync(fh.fileno())

  def _save(self) -> None:
    if not self.out:
      return
    with self._lock:
      path = os.path.join(self.out, "truth.json")
      with open(path + ".tmp", "w") as fh:
        json.dump(self.doc, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
      os.replace(path + ".tmp", path)

  def begin(self, step: Step) -> dict[str, Any]:
    entry = {
      "name": step.name,
      "priority": step.priority,
      "estimate_s": step.seconds,
      "verdicts": [],
      "state": "running",
    }
    with self._lock:
      self.doc["steps"].append(entry)
      self.markdown([f"## {step.name}", "", f"{step.doc} (estimated {step.seconds:.0f} s)", ""])
      self._save()
    return entry

  def verdict(self, entry: dict[str, Any], v: Verdict) -> None:
    with self._lock:
      entry["verdicts"].append(dataclasses.asdict(v))
      self.markdown([f"    {v.line()}"])
      self.say(v.line())
      self._save()

  def end(self, entry, state: str, seconds: float, lines=(), data=None) -> None:
    with self._lock:
      entry.update(state=state, seconds=round(seconds, 1), data=data)
      self.markdown(["", *lines, "", f"[{entry['name']}: {state}, {seconds:.0f} s]", ""])
      self.say(f"[{entry['name']}: {state}, {seconds:.0f} s]")
      self._save()

  def verdicts(self) -> list[Verdict]:
    return [Verdict(**v) for s in self.doc["steps"] for v in s["verdicts"]]

  def summary(self, rerun: str | None) -> list[str]:
    """One line a step (its verdicts counted), every verdict that is not ok, the totals and
    `rerun`: short enough to stay in the tail of a long output."""

    def counted(vs) -> str:
      return ", ".join(f"{n} {s}" for s in STATUSES if (n := sum(v["status"] == s for v in vs)))

    lines = ["## Summary", ""]
    for entry in self.doc["steps"]:
      seconds = f", {entry['seconds']:.0f} s" if entry.get("seconds") else ""
      lines.append(f"    {entry['name']}: {entry['state']}{seconds}: {counted(entry['verdicts'])}")
    vs = self.verdicts()
    counts = {s: sum(v.status == s for v in vs) for s in STATUSES}
    lines += ["", "not ok:"] + [f"    {v.line()}" for v in vs if v.status != "ok"]
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items())]
    if rerun:
      lines += ["", f"rerun what failed or was skipped: {rerun}"]
    with self._lock:
      self.doc["summary"] = counts
      self.doc["rerun"] = rerun
      self.markdown(["", *lines, ""])
      self.say("\n".join(lines))
      self._save()
    return lines


# ------------------------------------------------------------------------------ the runner


def hang_limit(estimate: float) -> float:
  """How long a step may run before it counts as hung: 4x its estimate, and 2 minutes at least
  beyond it (the budget ends every step anyway)."""
  return max(4.0 * estimate, estimate + 120.0)


class Runner:
  """Runs steps in order under `budget` seconds of process age.

  `scale` multiplies the estimates once the finished steps say how far off they are: the
  ratio of their time to their estimates, between 0.5 and 3, once 30 estimated seconds have run.
  `clock` (process age), `exit` (``os._exit``) and `poll` (the watchdog's period) are parameters
  so that tests can drive the budget and the watchdog; `rerun` turns the names of the steps that
  failed, raised, hung or did not fit into the summary's command line for a second run.
  """

  def __init__(
    self,
    steps: Sequence[Step],
    budget: float,
    report: Report,
    *,
    clock: Callable[[], float] = process_age,
    exit: Callable[[int], Any] = os._exit,
    poll: float = 1.0,
    rerun: Callable[[list[str]], str | None] = lambda names: None,
  ):
    self.steps, self.budget, self.report = list(steps), float(budget), report
    self.rerun = rerun
    self.clock, self.exit, self.poll = clock, exit, poll
    self.spent = self.estimated = 0.0
    self.redo: list[str] = []  # steps that failed, raised or were skipped for the budget
    self._current: tuple[Step, dict, float, float] | None = None
    self._lock = threading.Lock()
    self._done = threading.Event()

  @property
  def scale(self) -> float:
    if self.estimated < 30.0:
      return 1.0
    return min(3.0, max(0.5, self.spent / self.estimated))

  def run(self, ctx: Context) -> list[Verdict]:
    watchdog = threading.Thread(target=self._watch, daemon=True, name="truth-watchdog")
    watchdog.start()
    try:
      for step in self.steps:
        self._run_step(step, ctx)
    finally:
      self._done.set()
    return self.report.verdicts()

  def summary(self) -> list[str]:
    """The report's summary, with the command that reruns the steps in ``redo``."""
    return self.report.summary(self.rerun(self.redo) if self.redo else None)

  def _run_step(self, step: Step, ctx: Context) -> None:
    need = step.seconds * self.scale
    left = self.budget - self.clock()
    entry = self.report.begin(step)
    if step.hopper and not ctx.hopper:
      self.report.verdict(entry, Verdict(step.name, "skipped", "not a Hopper GPU"))
      self.report.end(entry, "skipped", 0.0)
      return
    if need > left:
      why = f"budget (needs ~{need:.0f} s, {max(left, 0):.0f} s left)"
      self.report.verdict(entry, Verdict(step.name, "skipped", why))
      self.report.end(entry, "skipped", 0.0)
      self.redo.append(step.name)
      return

    def record(kernel: str, status: str, detail: str = "") -> Verdict:
      v = Verdict(kernel, status, detail)
      self.report.verdict(entry, v)
      return v

    ctx.verdict, ctx.log = record, self.report.error_log
    t0 = self.clock()
    with self._lock:
      self._current = (step, entry, t0, t0 + hang_limit(need))
    try:
      lines, data = step.run(ctx)
      state = "done"
      if entry["state"] == "hung":  # the watchdog has ended it (tests: an exit that returns)
        return
      if not entry["verdicts"]:
        record(step.name, "ok", "ran")
    except Exception as e:  # one failing step must not stop the others
      self.report.error_log(f"## {step.name}\n{traceback.format_exc()}")
      record(step.name, "ERROR", one_line(e))
      lines, data, state = [f"failed: {one_line(e)}"], None, "error"
    with self._lock:
      self._current = None
    seconds = self.clock() - t0
    self.spent += seconds
    self.estimated += step.seconds
    if any(v["status"] in ("FAIL", "ERROR") for v in entry["verdicts"]):
      self.redo.append(step.name)
    self.report.end(entry, state, seconds, lines, data)

  def _watch(self) -> None:
    while not self._done.wait(self.poll):
      with self._lock:
        current = self._current
      if current is None:
        continue
      step, entry, t0, limit = current
      now = self.clock()
      if now < min(limit, self.budget):
        continue
      why = "the budget ran out" if now >= self.budget else "past its hang limit"
      with self._lock:  # the step may have ended meanwhile
        if self._current is not current:
          continue
        self.report.verdict(
          entry,
          Verdict(
            step.name,
            "ERROR",
            f"no result after {now - t0:.0f} s ({why}; estimated {step.seconds:.0f} s); "
            "the process ends here",
          ),
        )
        self.report.end(entry, "hung", now - t0)
        self.redo.append(step.name)
        self.summary()
        self._current = None
      self.exit(3)
      return


def one_line(e: BaseException | str, n: int = 300) -> str:
  """An exception as ``Type: first line of its message``, at most `n` characters."""
  text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
  first = text.strip().splitlines()[0] if text.strip() else "?"
  return first[:n]


def header(device: str, command: Sequence[str], budget: float, **more) -> dict[str, Any]:
  """The report's first lines: device, jax and jaxlib versions, date, command, budget."""
  import jax
  import jaxlib

  return {
    "device": device,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "python": platform.python_version(),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    "command": " ".join(command),
    "budget_s": round(budget, 1),
    **more,
  }
