"""The fewbit job's tables from its rows (section ``parity``, a row a model and residual; the
runs' own rows, section ``run``, are not drawn)."""

from __future__ import annotations

from benchmarks.harness import render

NOISE = "exact, other batch order"
TARGET_8BIT_CURVE = 0.005
TARGET_4BIT_LOSS = 0.01
TARGET_4BIT_ACC_POINTS = 0.5


def _cells(f: dict) -> list[str]:
  cells = [f["model"], f["residual"], f"{f['train_loss']:.4f}", f"{f['test_loss']:.4f}"]
  cells.append(f"{100 * f['test_accuracy']:.2f}")
  if f["max_rel_logged"] is None:
    return cells + ["—"] * 5
  return [
    *cells,
    f"{f['max_rel_logged']:.2%}",
    f"{f['max_rel_minibatch']:.2%}",
    f"{f['train_loss_diff']:+.2%}",
    f"{f['test_loss_diff']:+.2%}",
    f"{f['accuracy_points_diff']:+.2f}",
  ]


HEADER = ("model", "residual", "train loss", "test loss", "test acc. %")
HEADER += ("max rel. diff, logged loss", "max rel. diff, minibatch loss", "train loss diff")
TABLE = render.Table((*HEADER, "test loss diff", "test acc. diff, points"), _cells, "ll" + "r" * 8)


def targets(parity: list[dict]) -> list[str]:
  """Issue 18's targets, met or not, per model (from the parity rows)."""
  lines = []
  for model in dict.fromkeys(r["figures"]["model"] for r in parity):
    cmp = {r["figures"]["residual"]: r["figures"] for r in parity if r["figures"]["model"] == model}
    c8, c4, noise = cmp["8 bits"], cmp["4 bits"], cmp[NOISE]
    ok8 = c8["max_rel_logged"] <= TARGET_8BIT_CURVE
    ok4 = (
      abs(c4["train_loss_diff"]) <= TARGET_4BIT_LOSS
      and abs(c4["test_loss_diff"]) <= TARGET_4BIT_LOSS
      and abs(c4["accuracy_points_diff"]) <= TARGET_4BIT_ACC_POINTS
    )
    lines.append(
      f"- {model}: 8 bits, logged loss within {TARGET_8BIT_CURVE:.1%} of exact at every "
      f"logged step: {'met' if ok8 else 'not met'} ({c8['max_rel_logged']:.2%}; the other batch "
      f"order: {noise['max_rel_logged']:.2%}). 4 bits, final train and test loss within "
      f"{TARGET_4BIT_LOSS:.0%} and test accuracy within {TARGET_4BIT_ACC_POINTS} points: "
      f"{'met' if ok4 else 'not met'} ({c4['train_loss_diff']:+.2%}, "
      f"{c4['test_loss_diff']:+.2%}, {c4['accuracy_points_diff']:+.2f} points)."
    )
  return lines


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: the parity table and the targets."""
  parity = [r for r in rows if r["section"] == "parity" and section in (None, "parity")]
  return [*TABLE.lines(parity), "", *targets(parity)] if parity else []
