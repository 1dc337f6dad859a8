"""The sweep job's table from its rows (section ``sweep``, a row a case and dtype)."""

from __future__ import annotations

from benchmarks.harness import render


def table(job_rows: list[dict], dtypes: list[str]) -> str:
  """Markdown from the job's rows: one line per case, `NaN/non-finite · value ulps · gradient
  ulps` per dtype."""
  by = {(r["case"], r["figures"]["dtype"]): r["figures"] for r in job_rows}
  cases = list(dict.fromkeys(r["case"] for r in job_rows))

  def cell(f: dict | None) -> str:
    if f is None:
      return "—"
    return f"{f['nan']}/{f['nonfinite_grad']} · {f['value_ulps']:.2g} · {f['grad_ulps']:.2g}"

  body = ([c, *(cell(by.get((c, d))) for d in dtypes)] for c in cases)
  return "\n".join(render.table(["activation", *dtypes], "l" * (1 + len(dtypes)), body))


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """The job's table from its rows, after a line saying what was swept."""
  these = [r for r in rows if r["section"] == "sweep" and section in (None, "sweep")]
  if not these:
    return []
  dtypes = list(dict.fromkeys(r["figures"]["dtype"] for r in these))
  f32 = [r["figures"] for r in these if r["figures"]["dtype"] == "float32"]
  stride = ""
  if f32:
    n = f32[0]["stride"]
    every = "every" if n == 1 else f"every {n}th"
    stride = f"{every} float32 bit pattern ({f32[0]['inputs']:,} finite inputs a case)"
  others = [d for d in dtypes if d != "float32"]
  swept = " and ".join(
    filter(None, [stride, f"every finite {' and '.join(others)} value" if others else ""])
  )
  cells = "`NaN / non-finite gradients`" + (
    ""
    if these[0]["figures"]["finite_only"]
    else " · worst value error · worst gradient error (ulps)"
  )
  return [
    *render.wrap(f"{len(dict.fromkeys(r['case'] for r in these))} cases, {swept}. Cells: {cells}."),
    "",
    table(these, dtypes),
  ]
