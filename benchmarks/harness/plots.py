"""PNG figures of a benchmark run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import itertools
import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text

COLORS = {
  "jax.nn": "#9e9e9e",
  "Flax": "#5b8bd0",
  "Flax + remat": "#8e6cc2",
  "jaxact": "#e4572e",
}


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], fmt="{:.0f}"):
  """Grouped vertical bars, one group per label, one bar per series; None leaves a gap."""
  width = 0.8 / len(series)
  x = np.arange(len(groups))
  for i, (label, values) in enumerate(series.items()):
    heights = [np.nan if v is None else v for v in values]
    pos = x + (i - (len(series) - 1) / 2) * width
    bars = ax.bar(pos, heights, width, label=label, color=COLORS.get(label))
    ax.bar_label(bars, [("" if v is None else fmt.format(v)) for v in values], fontsize=7)
  ax.set_xticks(x, groups)


def memory_models(rows: dict[str, dict[str, dict[str, float | None]]], path: pathlib.Path) -> None:
  """(a) Compiled temp memory of the MLP and CNN training steps, per implementation.

  rows: {model: {activation: {series label: buffers}}}.
  """
  fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
  for ax, (model, by_act) in zip(axes[0], rows.items(), strict=True):
    acts = list(by_act)
    labels = list(next(iter(by_act.values())))
    _bars(ax, acts, {label: [by_act[a][label] for a in acts] for label in labels})
    ax.set_title(f"{model}: compiled temp memory of jit(grad(loss))")
    ax.set_ylabel("activation-sized buffers")
    ax.margins(y=0.1)
    ax.legend(fontsize=8, loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def memory_activations(rows, layers: int, path: pathlib.Path) -> None:
  """(b) Per-activation MLP temp memory, jaxact against jax.nn. rows: benchmarks MemoryRow list."""
  names = [r.name for r in rows]
  fig, ax = plt.subplots(figsize=(12, 4))
  _bars(
    ax,
    names,
    {"jax.nn": [r.temp_jaxnn for r in rows], "jaxact": [r.temp_jaxact for r in rows]},
  )
  ax.axhline(layers + 1, color="k", lw=0.8, ls="--", label=f"L+1 = {layers + 1}")
  ax.axhline(2 * layers + 1, color="k", lw=0.8, ls=":", label=f"2L+1 = {2 * layers + 1}")
  ax.set_xticks(range(len(names)), names, rotation=60, ha="right")
  ax.set_ylabel("activation-sized buffers")
  ax.set_title(f"{layers}-layer MLP, compiled temp memory of jit(grad(loss)) per activation")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def step_time(
  activations: dict[str, float],
  models: dict[str, dict[str, float]],
  path: pathlib.Path,
) -> None:
  """(c) Step-time ratios: per activation (jaxact / jax.nn), per model (against Flax).

  activations: {name: ratio}; models: {"MLP relu": {series label: ratio against Flax}}.
  """
  fig, axes = plt.subplots(2, 1, figsize=(12, 7.5))
  ax = axes[0]
  names = list(activations)
  ratios = [activations[n] for n in names]
  slower = "#f2a65a"
  bars = ax.bar(names, ratios, color=[COLORS["jaxact"] if r <= 1 else slower for r in ratios])
  ax.bar_label(bars, [f"{r:.2f}" for r in ratios], fontsize=7)
  ax.axhline(1, color="k", lw=0.8)
  # The bar colours are the two series: say which is which.
  ax.legend(
    handles=[
      Patch(color=COLORS["jaxact"], label="jaxact as fast or faster (ratio <= 1)"),
      Patch(color=slower, label="jaxact slower (ratio > 1)"),
    ],
    fontsize=8,
    loc="upper left",
  )
  ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
  ax.set_ylabel("jaxact / jax.nn")
  ax.set_title(
    "step time of jit(value_and_grad(sum(act(x) * c))), 2048 x 2048 float32 (below 1: faster)"
  )
  ax = axes[1]
  groups = list(models)
  labels = list(next(iter(models.values()))) if models else []
  _bars(ax, groups, {label: [models[g].get(label) for g in groups] for label in labels}, "{:.2f}")
  ax.axhline(1, color="k", lw=0.8)
  ax.set_ylabel("step time / Flax")
  ax.set_title("MLP and CNN training step, jit(value_and_grad(loss)), against Flax + jax.nn")
  ax.margins(y=0.15)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _place_labels(ax, points, labels, avoid=(), fontsize=7) -> None:
  """Each point's label beside it, moved to the first of a few nearby places where it overlaps no
  label already placed, no point, no point of `avoid` (data coordinates: lines sampled) and no
  text already on the axes, inside the axes; where every place overlaps something, the place that
  overlaps least (labels count most, then the frame, points, `avoid`). Greedy, in display
  coordinates."""
  renderer = ax.figure.canvas.get_renderer()
  own = [ax.transData.transform(xy) for xy in points]
  lines = [ax.transData.transform(xy) for xy in avoid]
  taken = [t.get_window_extent(renderer) for t in ax.texts]
  frame = ax.get_window_extent(renderer)
  offsets = [(6, -3), (8, 7), (8, -13), (-6, -3), (-8, 7), (-8, -13), (10, 16), (10, -22)]
  offsets += [(-10, 16), (-10, -22), (12, 26), (12, -32), (-12, 26), (-12, -32)]
  offsets += [(30, 8), (30, -16), (-30, 8), (-30, -16), (16, 38), (16, -44), (-16, 38), (-16, -44)]
  order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))

  def extent(text):
    # The label's own box: an annotation's extent (positioned by this call) spans its leader too.
    text.get_window_extent(renderer)
    return Text.get_window_extent(text).expanded(1.04, 1.1)

  def place(i, dx, dy):
    return ax.annotate(
      labels[i],
      points[i],
      xytext=(dx, dy),
      textcoords="offset points",
      fontsize=fontsize,
      ha="left" if dx > 0 else "right",
      va="bottom",
      # A leader line, so that a label moved off its point still shows whose it is.
      arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.45", "shrinkA": 0, "shrinkB": 3},
    )

  for i in order:
    best = None  # (overlap score, offset)
    for dx, dy in offsets:
      text = place(i, dx, dy)
      box = extent(text)
      text.remove()
      outside = box.x0 < frame.x0 or box.x1 > frame.x1 or box.y0 < frame.y0 or box.y1 > frame.y1
      score = (
        100 * sum(box.overlaps(t) for t in taken)
        + 50 * outside
        + 10 * sum(box.contains(*m) for j, m in enumerate(own) if j != i)
        + sum(box.contains(*m) for m in lines)
      )
      if best is None or score < best[0]:
        best = (score, (dx, dy))
      if score == 0:
        break
    text = place(i, *best[1])
    taken.append(extent(text))


def _staircase(points) -> list[tuple[float, float]]:
  """The front's step line as points: each point, then the corner before the next."""
  out = []
  for a, b in itertools.pairwise(points):
    out += [(a.memory, a.time), (b.memory, a.time)]
  return out + [(p.memory, p.time) for p in points[-1:]]


def _sampled(line, n=24) -> list[tuple[float, float]]:
  """Points along a polyline (n per segment), for labels to keep off it."""
  out = []
  for (x0, y0), (x1, y1) in itertools.pairwise(line):
    out += [(x0 + (x1 - x0) * k / n, y0 + (y1 - y0) * k / n) for k in range(n + 1)]
  return out


def frontier(points, title: str, unit: str, path: pathlib.Path) -> None:
  """A model's memory-time trade-off: compiled temp (x) against step time relative to Flax (y),
  every point labelled, Flax's and jaxact's in their colours, each with a bar over its timed
  rounds' ratios, the Pareto front as a staircase, and the two reference lines of the summary
  (Flax + remat's memory, Flax's step time).

  points: benchmarks.harness.frontier.Point list."""
  from benchmarks.harness import frontier as fr

  v = fr.verdict(points)
  on_front = fr.front(points)
  line = _staircase(on_front)
  fig, ax = plt.subplots(figsize=(7.5, 4.6))
  ax.plot(*zip(*line, strict=True), color="k", lw=1, ls="--", alpha=0.6)
  bars = []  # each point's spread over the timed rounds, as a vertical bar
  for p in points:
    if p.spread is not None:
      color = COLORS["jaxact" if p.library == fr.JAXACT else "Flax"]
      ax.plot([p.memory, p.memory], p.spread, color=color, lw=1.2, alpha=0.45, zorder=2)
      bars += _sampled([(p.memory, p.spread[0]), (p.memory, p.spread[1])], 8)
  for library, label in ((fr.FLAX, "Flax"), (fr.JAXACT, "jaxact")):
    mine = [p for p in points if p.library == library]
    ax.scatter(
      [p.memory for p in mine],
      [p.time for p in mine],
      s=[46 if p in on_front else 26 for p in mine],
      color=COLORS[label],
      edgecolors=["k" if p in on_front else "none" for p in mine],
      linewidths=0.8,
      zorder=3,
    )
  right = max(p.memory for p in points) * 1.25
  times = [t for p in points for t in (p.time, *(p.spread or ()))]
  pad = max(0.05, 0.12 * (max(times) - min(times)))
  ax.set_xlim(0, right)
  ax.set_ylim(min(times) - pad, max(times) + pad)
  ax.axhline(v.flax.time, color=COLORS["Flax"], lw=0.7, ls=":", zorder=0)
  ax.axvline(v.remat.memory, color=COLORS["Flax + remat"], lw=0.7, ls=":", zorder=0)
  ax.text(right, v.flax.time, "Flax's step time ", fontsize=6, ha="right", va="bottom")
  ax.text(
    v.remat.memory,
    min(times) - pad,
    f" {v.remat.label}'s temp",
    fontsize=6,
    rotation=90,
    ha="left",
    va="bottom",
  )
  ax.set_xlabel(f"compiled temp of the training step ({unit})")
  ax.set_ylabel("step time / Flax's")
  name, _, sizes = title.partition(": ")
  ax.set_title(f"{name} (black edge: on the Pareto front)\n{sizes}", fontsize=9)
  dot = {"marker": "o", "ls": "none", "ms": 5}
  handles = [
    Line2D([], [], color="k", lw=1, ls="--", alpha=0.6, label="Pareto front"),
    Line2D([], [], color=COLORS["Flax"], label="Flax", **dot),
    Line2D([], [], color=COLORS["jaxact"], label="jaxact", **dot),
  ]
  if bars:
    handles.append(Line2D([], [], color="0.5", lw=1.2, alpha=0.45, label="rounds' least-most"))
  ax.legend(handles=handles, fontsize=7, loc="best")
  fig.tight_layout()
  xy = [(p.memory, p.time) for p in points]
  _place_labels(ax, xy, [p.label for p in points], _sampled(line) + bars)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def nan_counts(counts: dict[str, dict[str, int]], path: pathlib.Path) -> None:
  """(d) Non-finite gradients on the extreme-input grid. counts: {dtype: {library: count}}."""
  fig, ax = plt.subplots(figsize=(6, 3.5))
  dtypes = list(counts)
  libs = list(next(iter(counts.values())))
  _bars(ax, dtypes, {lib: [counts[d][lib] for d in dtypes] for lib in libs})
  ax.set_ylabel("non-finite gradients")
  ax.set_title("all activations, finite extreme inputs")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def lm_loss(losses: dict[str, np.ndarray], path: pathlib.Path) -> None:
  """Training-loss curves of the language-model check and each run's difference from the first.

  losses: {run: loss per step}; the first run is the reference.
  """
  names = list(losses)
  base = losses[names[0]]
  steps = np.arange(len(base))
  fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
  ax = axes[0]
  for i, (name, loss) in enumerate(losses.items()):
    ax.plot(steps, loss, f"C{i}", lw=1.6 if i == 0 else 0.9, ls="-" if i == 0 else "--", label=name)
  ax.set_ylabel("training loss (nats / byte)")
  ax.set_title("Llama-style byte LM on pydoc_data.topics, one init, one batch sequence")
  ax.legend(fontsize=8)
  ax = axes[1]
  for i, name in enumerate(names[1:], start=1):
    diff = np.abs(losses[name] - base)
    # A log axis cannot show equal losses: those steps are left out of the line.
    ax.plot(steps, np.where(diff > 0, diff, np.nan), f"C{i}", lw=0.9, marker=".", ms=3, label=name)
  ulp = np.spacing(base.astype(np.float32))
  ax.plot(steps, ulp, color="k", lw=0.8, ls=":", label="one float32 ulp of the loss")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel(f"|loss - {names[0]} loss|")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


FEWBIT_COLORS = {
  "exact": "#000000",
  "exact, other batch order": "#9e9e9e",
  "8 bits": "#5b8bd0",
  "4 bits": "#e4572e",
  "2 bits": "#8e6cc2",
}


def fewbit_training(
  curves: dict[str, dict[str, tuple[list[int], list[float]]]],
  reference: str,
  band: float,
  path: pathlib.Path,
) -> None:
  """Loss curves of each model per residual (top) and their difference relative to one (bottom).

  curves: {model: {residual label: (steps, logged losses)}}; reference: the label the bottom row
  is relative to; band: the +-fraction shaded there (the 8-bit target).
  """
  fig, axes = plt.subplots(2, len(curves), figsize=(5 * len(curves), 6.5), squeeze=False)
  for col, (model, by_label) in enumerate(curves.items()):
    ref = np.asarray(by_label[reference][1])
    top, bottom = axes[0, col], axes[1, col]
    for label, (steps, losses) in by_label.items():
      style = {"color": FEWBIT_COLORS.get(label), "lw": 1.2, "label": label}
      if label == "exact, other batch order":
        style["ls"] = "--"
      top.plot(steps, losses, **style)
      if label != reference:
        bottom.plot(steps, 100 * (np.asarray(losses) / ref - 1), **style)
    top.set_yscale("log")
    top.set_title(model)
    top.set_ylabel("loss on fixed training examples")
    top.legend(fontsize=8)
    bottom.axhspan(-100 * band, 100 * band, color="#5b8bd0", alpha=0.15, lw=0)
    bottom.axhline(0, color="k", lw=0.8)
    # Linear within +-1%, logarithmic beyond: the codes' small differences and the other batch
    # order's large ones on one axis.
    bottom.set_yscale("symlog", linthresh=1)
    bottom.set_title(f"relative to {reference} (shaded: +-{band:.1%})")
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss difference, %")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
