"""The posttrain job's tables from its rows (sections ``memory``, ``memory-h100``, ``memory-tpu``,
``fit-h100``, ``time``, ``precision``; the headline drawn from them all)."""

from __future__ import annotations

from benchmarks.harness import render
from benchmarks.tables import tpu

GiB = 2**30
SEQUENCES, DIM = 8, 4096  # a GRPO group; Llama 3 8B's width
TIME_SHAPE = (4, 256, 512, 32768)  # sequences, T, D, V of the CPU timing
PRECISION_SHAPE = (8, 1024, 256, 8192)  # sequences, T, D, V of the gradients' precision
TITLES = {
  "memory": "compiled temp (GiB) of jit(grad) in (x, w), CPU float32",
  "memory-h100": "compiled temp (GiB) of jit(grad) in (x, w), for an H100, bfloat16",
}


def _gib(b: float) -> str:
  return f"{b / GiB:.2f}" if b < 10 * GiB else f"{b / GiB:.1f}"


def _temp(f: dict) -> str:
  ratio = "" if f["method"] == "plain" else f" ({f['vs_plain']:.3f}x)"
  return _gib(f["temp_bytes"]) + ratio


def memory_table(rows: list[dict], task: str, cell=_temp) -> list[str]:
  """GiB of compiled temp, a line a (T, V), a column a method, each with its share of plain's
  (`cell`: what else a cell shows of a row's figures)."""
  found = [r["figures"] for r in rows if r["figures"]["task"] == task]
  methods = list(dict.fromkeys(f["method"] for f in found))
  cells: dict[tuple, list[str]] = {}
  for f in found:
    cells.setdefault((f["length"], f["vocab"]), []).append(cell(f))
  body = ([str(t), str(v), *c] for (t, v), c in cells.items())
  return render.table(("T", "V", *methods), "rr" + "r" * len(methods), body)


def _tpu_cell(f: dict) -> str:
  """A TPU row's temp (its share of plain's) and estimated ms; "over HBM": the chip's compiler
  refused it, the temp its count of what it asked."""
  return f"{_temp(f)}, {tpu.estimate_ms(f)}" + (" ms" if not f["over_hbm"] else "")


def fit_table(rows: list[dict]) -> list[str]:
  """The longest completion (tokens, the group of 8) that fits, a line a method, a column a V."""
  found = [r["figures"] for r in rows]
  vocabs = list(dict.fromkeys(f["vocab"] for f in found))
  cells: dict[tuple, dict] = {}
  for f in found:
    cells.setdefault((f["task"], f["method"]), {})[f["vocab"]] = (
      f"{f['length']:,} ({f['total_bytes'] / GiB:.1f} GiB)"
    )
  body = ([t, m, *(c.get(v, "—") for v in vocabs)] for (t, m), c in cells.items())
  return render.table(
    ("step", "method", *(f"V {v}" for v in vocabs)), "ll" + "r" * len(vocabs), body
  )


TIME_TABLE = render.Table(
  ("step", "method", "seconds", "vs plain", "rounds' range", "loss vs plain (rel.)"),
  lambda f: [
    f["task"],
    f["method"],
    f"{f['seconds']:.2f}",
    f"{f['vs_plain']:.2f}",
    f"{f['low']:.2f}-{f['high']:.2f}",
    f"{f['loss_error']:.1e}",
  ],
  "llrrrr",
)


def precision_table(rows: list[dict]) -> list[str]:
  """Each method's gradients' relative error, and its dw error over the exact gradient's rounding
  to bfloat16 (the least any bfloat16 gradient can have)."""
  exact = next((r["figures"]["dw_error"] for r in rows if r["figures"]["method"] == "exact"), None)
  return render.Table(
    ("method", "chunks", "dx error", "dw error", "dw error / exact's"),
    lambda f: [
      "exact, rounded to bfloat16" if f["method"] == "exact" else f["method"],
      str(f["chunks"] or "—"),
      f"{f['dx_error']:.2e}",
      f"{f['dw_error']:.2e}",
      "—" if exact is None else f"{f['dw_error'] / exact:.2f}",
    ],
    "lrrrr",
  ).lines(rows)


def headline(rows: list[dict], vocab: int = 128256) -> list[str]:
  """The issue's goals against the figures: temp shares at `vocab`, CPU time, fits."""
  lines = []
  for section in ("memory", "memory-h100"):
    found = [
      r["figures"] for r in rows if r["section"] == section and r["figures"]["vocab"] == vocab
    ]
    for task in ("grpo", "distill"):
      mine = [f for f in found if f["task"] == task]
      if not mine:
        continue
      length = max(f["length"] for f in mine)
      by = {f["method"]: f["temp_bytes"] for f in mine if f["length"] == length}
      parts = [f"jaxact {by['jaxact'] / by['plain']:.3f}x plain"]
      if "plain-lp" in by:
        parts.append(f"{by['jaxact'] / by['plain-lp']:.3f}x plain log-probs")
      parts.append(f"{by['jaxact'] / by['chunk+remat']:.2f}x chunk+remat")
      where = "CPU f32" if section == "memory" else "H100 bf16"
      lines.append(f"- {task}, {where}, T {length}, V {vocab}: temp " + ", ".join(parts))
  for f in (
    r["figures"] for r in rows if r["section"] == "time" and r["figures"]["method"] != "plain"
  ):
    lines.append(f"- {f['task']} CPU time, {f['method']}: {f['vs_plain']:.2f}x plain")
  errors = {
    (f["method"], f["chunks"]): f["dw_error"]
    for f in (r["figures"] for r in rows if r["section"] == "precision")
  }
  if ("jaxact", 0) in errors and ("chunk+remat", 64) in errors:
    lines.append(
      f"- grpo dw from bfloat16, relative error: jaxact {errors['jaxact', 0]:.1e}, chunk+remat "
      f"(64 chunks) {errors['chunk+remat', 64]:.1e}"
    )
  return lines


def _draw(name: str, these: list[dict]) -> list[str]:
  if name in TITLES:
    lines = []
    for task in dict.fromkeys(r["figures"]["task"] for r in these):
      title = f"### {task}: {TITLES[name]}, {SEQUENCES} sequences of T tokens, D = {DIM}"
      lines += ["", title, "", *memory_table(these, task)]
    return lines
  if name == "memory-tpu":
    lines = []
    for task in dict.fromkeys(r["figures"]["task"] for r in these):
      title = (
        f"### {task}: compiled temp (GiB) of jit(grad) in (x, w) for TPU chips, bfloat16, "
        f"{SEQUENCES} sequences of T tokens, D = {DIM}; step ms an ESTIMATE"
      )
      draw = lambda chip_rows, task=task: memory_table(chip_rows, task, _tpu_cell)
      lines += [
        "",
        title,
        "",
        *tpu.per_chip([r for r in these if r["figures"]["task"] == task], draw),
      ]
    return lines
  if name == "fit-h100":
    title = (
      f"### The longest completion that fits an 80 GB H100 (T, {SEQUENCES} sequences, D = {DIM})"
    )
    return ["", title, "", *fit_table(these)]
  if name == "precision":
    s, t, d, v = PRECISION_SHAPE
    title = (
      f"### grpo: gradients from bfloat16 (x, w), relative error against float64, {s} x {t} "
      f"tokens, D = {d}, V = {v}"
    )
    return ["", title, "", *precision_table(these)]
  s, t, d, v = TIME_SHAPE
  title = f"### CPU step time, float32, {s} x {t} tokens, D = {d}, V = {v}"
  return ["", title, "", *TIME_TABLE.lines(these)]


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: each section under its heading, then the headline
  (`section`: that one alone)."""
  lines: list[str] = []
  for name in dict.fromkeys(r["section"] for r in rows):
    if section in (None, name):
      lines += _draw(name, [r for r in rows if r["section"] == name])
  if section is None and rows:
    lines += ["", "### Headline", "", *headline(rows)]
  return lines
