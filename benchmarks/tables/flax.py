"""The flax job's table from its rows (section ``temp``, case "API, model, activation")."""

from __future__ import annotations

from benchmarks.harness import render


def _cells(f: dict) -> list[str]:
  mib, buffer = 2**20, f["buffer_bytes"]
  theirs, ours = f["flax_bytes"], f["jaxact_bytes"]
  return [
    f["api"],
    f["model"],
    f["activation"],
    f"{theirs / mib:.0f} MiB ({theirs / buffer:.1f})",
    f"{ours / mib:.0f} MiB ({ours / buffer:.1f})",
    f"{f['ratio']:.2f}",
  ]


# a row: section "temp", case "API, model, activation"
TABLE = render.Table(
  ("API", "model", "activation", "flax + jax.nn", "jaxact layers", "ratio"), _cells
)


def intro(buffer_bytes: int) -> str:
  return (
    "Compiled temp memory of jit(grad(loss)); one buffer = one layer's output "
    f"({buffer_bytes / 2**20:.0f} MiB)."
  )


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: the sentence on units, then the table."""
  these = [r for r in rows if r["section"] == "temp" and section in (None, "temp")]
  if not these:
    return []
  return [intro(these[0]["figures"]["buffer_bytes"]), "", *TABLE.lines(these)]
