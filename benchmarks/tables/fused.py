"""The fused job's tables from its rows (sections ``MLP`` and ``CNN``, case the activation)."""

from __future__ import annotations

from benchmarks.harness import render


def _cells(f: dict) -> list[str]:
  timed = (
    ["-"] * 3
    if f["time_ratio"] is None
    else [
      f"{f['fused_seconds'] * 1e3:.1f}",
      f"{f['jaxnn_seconds'] * 1e3:.1f}",
      f"{f['time_ratio']:.2f}",
    ]
  )
  met = "yes" if f["met"] else "NO"
  return [
    f["case"],
    f"{f['fused_temp']:.2f}",
    f"{f['jaxnn_temp']:.2f}",
    f"<= {f['target']}",
    met,
    *timed,
  ]


HEADER = (
  "activation",
  "fused temp",
  "jax.nn temp",
  "target",
  "met",
  "fused ms",
  "jax.nn ms",
  "time ratio",
)
TABLE = render.Table(HEADER, _cells)  # a row: section MLP or CNN, case the activation


def heading(label: str, layers: int) -> str:
  return f"### {label}, L = {layers}: temp buffers of jit(grad) and step-time ratio"


def tables(job_rows: list[dict], section: str | None = None) -> list[str]:
  """The printed tables from the job's rows (`section`'s alone: ``MLP`` or ``CNN``)."""
  lines: list[str] = []
  for label in dict.fromkeys(r["section"] for r in job_rows):
    if section not in (None, label):
      continue
    these = [r for r in job_rows if r["section"] == label]
    layers = these[0]["figures"]["layers"]
    lines += ["", heading(label, layers), "", *TABLE.lines(these)]
  return lines
