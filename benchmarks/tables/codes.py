"""The codes job's tables from its rows (sections ``memory``, ``h100``, ``tpu``, ``activation
time``, ``model time``)."""

from __future__ import annotations

from benchmarks.harness import render
from benchmarks.tables import tpu

# The TPU sections are drawn in blocks of their own (results/tpu-families.md; benchmarks.render)
SEPARATE_SECTIONS = ("tpu",)

BITS = (None, 8, 4, 2)
KEYS = tuple("exact" if b is None else f"{b} bits" for b in BITS)  # the ratios' keys


def _ratios(ratios: dict) -> list[str]:
  return [f"{r:.2f}x" for r in ratios.values()]


MEMORY = render.Table(
  ("model", "residual", "temp", "kept per layer", "jax.nn temp"),
  lambda f: [
    f["model"],
    f["residual"],
    f"{f['temp_buffers']:.2f}",
    f"{f['kept_per_layer']:.3f}",
    f"{f['jaxnn_temp_buffers']:.2f}",
  ],
)  # section "memory", case "model, residual"
H100_TABLE = render.Table(("path", "temp MiB"), lambda f: [f["case"], f"{f['temp_mib']:.0f}"])
ACT_TIME = render.Table(
  ("activation", "jax.nn ms", *KEYS),
  lambda f: [f["case"], f"{f['jaxnn_seconds'] * 1e3:.1f}", *_ratios(f["ratios_vs_jaxnn"])],
)  # section "activation time", ratios against jax.nn's step
MODEL_TIME = render.Table(
  ("model", "exact ms", *KEYS[1:]),
  lambda f: [f["case"], f"{f['exact_seconds'] * 1e3:.1f}", *_ratios(f["ratios_vs_exact"])],
)  # section "model time", ratios against the exact residual's step


def memory(these: list[dict]) -> list[str]:
  name = these[0]["figures"]["activation"]
  return [
    f"{name}: compiled temp of jit(grad(loss)) and arrays the pullback keeps, in activation "
    "buffers; jax.nn composition in the same run.",
    "",
    *MEMORY.lines(these),
  ]


def h100(these: list[dict]) -> list[str]:
  f = these[0]["figures"]
  name, layers, m, d = f["activation"], f["layers"], f["m"], f["d"]
  return [
    f"{name}, {layers}-layer MLP ({m}, {d}) x ({d}, {d}) bfloat16, jit(value_and_grad), compiled "
    f"for an {f['device']} on the CPU machine: XLA's temp in MiB.",
    "",
    *H100_TABLE.lines(these),
  ]


TPU_TABLE = render.Table(
  ("path", "temp MiB", "step ms, ESTIMATE"),
  lambda f: [f["case"].split(", ", 1)[1], f"{f['temp_mib']:.0f}", tpu.estimate_ms(f)],
)


def tpu_section(these: list[dict]) -> list[str]:
  f = these[0]["figures"]
  name, layers, m, d = f["activation"], f["layers"], f["m"], f["d"]
  return [
    f"{name}, {layers}-layer MLP ({m}, {d}) x ({d}, {d}) bfloat16, jit(value_and_grad), compiled "
    "for TPU chips on the CPU machine: XLA's temp in MiB.",
    "",
    *tpu.per_chip(these, TPU_TABLE.lines),
  ]


def activation_time(these: list[dict]) -> list[str]:
  return [
    "Activation alone, jit(value_and_grad(sum(act(x)))), 2**22 float32: time against jax.nn's, "
    "the median over alternated rounds of the ratio within a round.",
    "",
    *ACT_TIME.lines(these),
  ]


def model_time(these: list[dict]) -> list[str]:
  return [
    "Fused gelu layers, training step: time against the exact residual's.",
    "",
    *MODEL_TIME.lines(these),
  ]


SECTIONS = {
  "memory": memory,
  "h100": h100,
  "tpu": tpu_section,
  "activation time": activation_time,
  "model time": model_time,
}


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows: each section it ran (or `section` alone), in order."""
  lines: list[str] = []
  for name, draw in SECTIONS.items():
    these = [r for r in rows if r["section"] == name]
    if these and section in (None, name):
      lines += [*([""] if lines else []), *draw(these)]
  return lines
