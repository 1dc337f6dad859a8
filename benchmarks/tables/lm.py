"""The lm job's table from its rows (section ``runs``, a row a training run)."""

from __future__ import annotations

from benchmarks.harness import render

TABLE = render.Table(
  ("run", "max abs loss diff", "max rel", "step-0 grad diff", "final loss", "held-out", "s"),
  lambda f: [
    f["case"],
    f"{f['max_abs_loss_diff']:.3e}",
    f"{f['max_rel_loss_diff']:.3e}",
    f"{f['step0_grad_diff']:.3e}",
    f"{f['final_loss']:.5f}",
    f"{f['heldout_loss']:.5f}",
    f"{f['seconds']:.0f}",
  ],
  "lrrrrrr",
)


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """The runs' table: each run's loss against the first's (the reference), its final and
  held-out loss and its time."""
  runs = [r for r in rows if r["section"] == "runs" and section in (None, "runs")]
  return TABLE.lines(runs) if runs else []
