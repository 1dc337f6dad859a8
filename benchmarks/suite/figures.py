"""The main job's PNG figures, drawn from its rows."""

from __future__ import annotations

import pathlib
import types

from benchmarks.harness import plots
from benchmarks.suite.report import DTYPES
from benchmarks.suite.run import Run

MLP_LAYERS = 8  # benchmarks.fused.MLP_LAYERS: the per-activation MLP's depth


def write_figures(run: Run, out: pathlib.Path) -> list[str]:
  """The PNG figures; returns their file names (relative to `out`)."""
  names = []
  for key, f in run.frontiers.items():
    plots.frontier(f.points, f"{f.name}: {f.title}", f.unit, out / f"frontier_{key}.png")
    names.append(f"frontier_{key}.png")
  series = {"jax.nn": None, "Flax": "flax", "Flax + remat": "remat", "jaxact": "jaxact"}
  fused = {r["case"]: r["figures"] for r in run.section("fused")}
  models: dict[str, dict[str, dict[str, float | None]]] = {}
  step_models: dict[str, dict[str, float]] = {}
  for f in run.frontiers.values():
    if f.unit != "buffers":  # the MLP and CNN: "MLP, relu", ...
      continue
    model, act = f.name.split(", ")
    comp = fused.get(f.name)
    models.setdefault(model, {})[act] = {
      label: (comp["temp_composition"] if comp else None) if k is None else f.get(k).memory
      for label, k in series.items()
    }
    step_models[f"{model}\n{act}"] = {
      "Flax + remat": f.get("remat").time,
      "jaxact": f.get("jaxact").time,
    }
  if models:
    plots.memory_models(models, out / "memory_models.png")
    names.append("memory_models.png")
  memory = [types.SimpleNamespace(name=r["case"], **r["figures"]) for r in run.section("memory")]
  plots.memory_activations(memory, MLP_LAYERS, out / "memory_activations.png")
  names.append("memory_activations.png")
  steps = {
    r["case"]: r["figures"]["jaxact_seconds"] / r["figures"]["jaxnn_seconds"]
    for r in run.section("step")
  }
  if step_models:  # its second panel: the models' steps
    plots.step_time(steps, step_models, out / "step_time.png")
    names.append("step_time.png")
  counts = {dtype: {"jax.nn": 0, "jaxact": 0} for dtype in DTYPES}
  for r in run.section("nan"):
    f = r["figures"]
    for lib, key in (("jax.nn", "jaxnn"), ("jaxact", "jaxact")):
      counts[f["dtype"]][lib] += (f[key] or (0, 0))[1]
  plots.nan_counts(counts, out / "nan_gradients.png")
  names.append("nan_gradients.png")
  return names
