"""`python -m benchmarks [--quick] [--out DIR]`: jaxact against jax.nn, Flax and Flax + remat.

Measures everything in one run on this machine, with a progress bar on stderr; writes
DIR/results.md (markdown tables, machine and versions) and PNG figures to DIR, and prints the
summary table. `--quick` keeps the model sizes and every memory figure the README quotes (they
come from XLA's compiled buffer assignment and need no long runs) but times fewer repetitions and
fewer activations, measures the Flax models for relu and gelu only, times the fused layers only
there (as `jaxact.linen` layers against Flax), and skips the gated MLP stack's step times (its
memory, from compiles, stays). On a GPU the suite also times the fused layers and
the activations against their peak bandwidth and throughput (benchmarks/gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import pathlib
import platform
import sys
import time

import jax

# float64 is one of the dtypes measured; every other array here is created with an explicit dtype.
jax.config.update("jax_enable_x64", True)

import flax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxact  # noqa: E402
from benchmarks import activations as bench  # noqa: E402
from benchmarks import flax_models, gated, gpu, lce, plots  # noqa: E402
from benchmarks import fused_memory as fused  # noqa: E402

QUICK_TIMED = ("sigmoid", "tanh", "relu", "elu", "softplus", "gelu", "silu", "softmax")
# The activations --quick measures the Flax models with: one output-residual and one input-residual
# activation, the two the README quotes.
QUICK_MODEL_ACTIVATIONS = ("relu", "gelu")
MODELS = (("MLP", fused._mlp, fused.MLP_LAYERS), ("CNN", fused._cnn, fused.CNN_LAYERS))
# The decoder steps the summary compares: (body, head) of benchmarks.lce; jaxact's bodies use
# jaxact's norms as well.
DECODER_STEPS = (
  ("flax", "plain"),
  ("flax_remat", "plain"),
  ("jaxact", "fused"),
  ("jaxact_remat", "fused"),
  ("jaxact_attn", "fused"),
  ("jaxact_attn_remat", "fused"),
)


def _decoder_norm(body: str):
  return lce.jaxact_rms_norm if body.startswith("jaxact") else lce.rms_norm


@dataclasses.dataclass
class FusedRow:
  model: str
  activation: str
  temp_composition: float
  temp_fused: float
  target: int
  times: tuple[float, float] | None  # seconds (fused, composition); None when not timed


@dataclasses.dataclass
class FlaxRow:
  model: str
  activation: str
  memory: dict[str, tuple[float, float]]  # variant: (temp buffers, arrays kept per layer)
  times: dict[str, float] | None  # variant: seconds; None when not timed


@dataclasses.dataclass
class Results:
  quick: bool
  reps: int
  fused_runs: int
  flax_runs: int
  memory: list[bench.MemoryRow] = dataclasses.field(default_factory=list)
  step: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
  fused: list[FusedRow] = dataclasses.field(default_factory=list)
  flax: list[FlaxRow] = dataclasses.field(default_factory=list)
  # activation: {dtype: {library: (NaN values, non-finite gradients) or None}}
  nans: dict[str, dict[str, dict[str, tuple[int, int] | None]]] = dataclasses.field(
    default_factory=dict
  )
  gated: list[gated.MemoryRow] = dataclasses.field(default_factory=list)
  # (peer, program): (wall, CPU) seconds
  gated_times: dict[tuple[str, str], tuple[float, float]] | None = None
  decoder: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # bytes
  gpu_layers: list[gpu.LayerRow] | None = None
  gpu_elementwise: list[gpu.ElementwiseRow] | None = None
  seconds: float = 0.0
  section_seconds: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Plan:
  """What one run measures; its lengths are the progress bar's total."""

  memory: list[str]
  timed: list[str]
  fused: list[tuple[str, str]]  # (model, activation): memory
  fused_timed: set[tuple[str, str]]
  flax: list[tuple[str, str]]  # (model, activation): memory and time
  nans: list[str]
  gated_timed: bool
  gpu: bool

  @classmethod
  def make(cls, quick: bool) -> Plan:
    names = list(jaxact.ACTIVATIONS)
    model_acts = QUICK_MODEL_ACTIVATIONS if quick else fused.ACTIVATIONS
    return cls(
      memory=[n for n in names if n != "glu"],
      timed=[n for n in (QUICK_TIMED if quick else names) if bench.reference(n) is not None],
      fused=[(m, a) for m, _, _ in MODELS for a in fused.ACTIVATIONS],
      # --quick times the layers once, in the Flax section (jaxact.linen's layers are these ops).
      fused_timed=set() if quick else {(m, a) for m, _, _ in MODELS for a in fused.ACTIVATIONS},
      flax=[(m, a) for m in flax_models.MODELS for a in model_acts],
      nans=names,
      gated_timed=not quick,
      gpu=jax.default_backend() == "gpu",
    )

  @property
  def total(self) -> int:
    n = len(self.memory) + len(self.timed) + len(self.fused) + len(self.fused_timed)
    n += len(self.flax) + len(self.nans) + 2 + int(self.gated_timed)
    return n + (2 if self.gpu else 0)


class _Progress:
  """One tqdm bar (stderr) over every measurement, and the seconds each section took."""

  def __init__(self, total: int):
    self.bar = tqdm(total=total, file=sys.stderr, unit="measurement", dynamic_ncols=True)
    self.seconds: dict[str, float] = {}
    self.current: str | None = None
    self.start = time.perf_counter()

  def section(self, name: str | None) -> None:
    now = time.perf_counter()
    if self.current is not None:
      self.seconds[self.current] = now - self.start
    self.current, self.start = name, now
    if name is not None:
      self.bar.set_description(name)

  def step(self, label: str) -> None:
    self.bar.set_postfix_str(label, refresh=False)
    self.bar.update()

  def close(self) -> dict[str, float]:
    self.section(None)
    self.bar.close()
    return self.seconds


def measure(quick: bool) -> Results:
  started = time.perf_counter()
  plan = Plan.make(quick)
  res = Results(quick, reps=10 if quick else 40, fused_runs=15, flax_runs=3 if quick else 11)
  progress = _Progress(plan.total)
  progress.section("MLP memory per activation")
  for name in plan.memory:
    res.memory.append(bench.mlp_memory(name))
    progress.step(name)

  progress.section("step time per activation")
  for name in plan.timed:
    res.step[name] = bench.step_time(name, reps=res.reps)
    progress.step(name)

  progress.section("fused layers")
  for label, model, layers in MODELS:
    for act in fused.ACTIVATIONS:
      if (label, act) not in plan.fused:
        continue
      target = layers + 1 if act in fused.OUTPUT_RESIDUAL else 2 * layers + 1
      row = FusedRow(
        label,
        act,
        fused.temp_buffers(model, act, False),
        fused.temp_buffers(model, act, True),
        target,
        None,
      )
      res.fused.append(row)
      progress.step(f"{label} {act} memory")
      if (label, act) in plan.fused_timed:
        t_f, t_c, _ = fused.time_ratio(model, act, res.fused_runs)
        row.times = (t_f, t_c)
        progress.step(f"{label} {act} time")

  progress.section("Flax models")
  for label, act in plan.flax:
    memory = {v: flax_models.memory(label, v, act) for v in flax_models.VARIANTS}
    times = flax_models.step_times(label, act, res.flax_runs)
    res.flax.append(FlaxRow(label, act, memory, times))
    progress.step(f"{label} {act}")

  progress.section("gated MLP stack")
  res.gated = gated.section_cpu(with_kept=not quick)
  progress.step("memory")
  if plan.gated_timed:
    res.gated_times = gated.step_times(repeats=3, unrolled=False)
    progress.step("step time")

  progress.section("LM decoder step")
  res.decoder = {
    k: lce.decoder_temp(lce.DECODER_CPU, *k, gpu=False, norm=_decoder_norm(k[0]))
    for k in DECODER_STEPS
  }
  progress.step("memory")

  progress.section("NaN counts")
  for name in plan.nans:
    res.nans[name] = {dtype: bench.nan_counts(name, dtype) for dtype in bench.DTYPES}
    progress.step(name)

  if plan.gpu:
    progress.section("GPU")
    res.gpu_layers = gpu.layers(runs=10 if quick else 30)
    progress.step("fused layers")
    res.gpu_elementwise = gpu.elementwise(runs=10 if quick else 30)
    progress.step("elementwise")
  res.section_seconds = progress.close()
  res.seconds = time.perf_counter() - started
  return res


# ----------------------------------------------------------------------------------- rendering


def _fmt(v, spec="{:.1f}") -> str:
  return "—" if v is None else spec.format(v)


def _geomean(values) -> float:
  values = list(values)
  return math.exp(sum(math.log(v) for v in values) / len(values))


def _machine() -> str:
  dev = jax.devices()[0]
  return (
    f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores, "
    f"{jax.device_count()} x {dev.device_kind} ({dev.platform}); "
    f"Python {platform.python_version()}, "
    f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, flax {flax.__version__}, "
    f"jaxact {jaxact.__version__}"
  )


def _flax(res: Results, model: str, act: str) -> FlaxRow | None:
  return next((r for r in res.flax if r.model == model and r.activation == act), None)


def _fused(res: Results, model: str, act: str) -> FusedRow | None:
  return next((r for r in res.fused if r.model == model and r.activation == act), None)


def _nan_totals(res: Results) -> dict[str, list[int]]:
  totals = {"jax.nn": [0, 0], "jaxact": [0, 0]}
  for by_dtype in res.nans.values():
    for counts in by_dtype.values():
      for lib, c in counts.items():
        if c is not None:
          totals[lib][0] += c[0]
          totals[lib][1] += c[1]
  return totals


def summary(res: Results) -> str:
  """The headline table: each model figure for relu / gelu."""
  acts = QUICK_MODEL_ACTIVATIONS

  def cells(model: str, get) -> list[str]:
    out = []
    for column in ("jax.nn", "flax", "remat", "jaxact"):
      values = [get(model, a, column) for a in acts]
      out.append("—" if all(v is None for v in values) else " / ".join(map(_fmt_cell, values)))
    return out

  def temp(model, act, column):
    if column == "jax.nn":
      row = _fused(res, model, act)
      return None if row is None else row.temp_composition
    row = _flax(res, model, act)
    return None if row is None else row.memory[column][0]

  def kept(model, act, column):
    row = _flax(res, model, act)
    return None if row is None or column == "jax.nn" else row.memory[column][1]

  def speed(model, act, column):
    row = _flax(res, model, act)
    if row is None or row.times is None or column == "jax.nn":
      return None
    return row.times[column] / row.times["flax"]

  lines = [
    f"| {' / '.join(acts)} | jax.nn | Flax | Flax + remat | jaxact |",
    "|---|---:|---:|---:|---:|",
  ]
  for model, layers in (("MLP", fused.MLP_LAYERS), ("CNN", fused.CNN_LAYERS)):
    lines.append(
      f"| {model} ({layers} layers) training temp memory, buffers | "
      + " | ".join(cells(model, temp))
      + " |"
    )
    lines.append(
      f"| {model} arrays kept by `jax.vjp` per layer | " + " | ".join(cells(model, kept)) + " |"
    )
    lines.append(
      f"| {model} step time relative to Flax | " + " | ".join(cells(model, speed)) + " |"
    )
  stack = {r.peer: r for r in res.gated if r.layout == "scan"}
  if stack:
    ref = stack["flax"].temp8
    lines.append(
      f"| gated MLP, {gated.BLOCKS} scanned blocks: training temp relative to Flax | — | 1 | "
      f"{stack['remat'].temp8 / ref:.2f} | {stack['jaxact'].temp8 / ref:.2f} |"
    )
  if res.decoder:
    dec, c = res.decoder, lce.DECODER_CPU
    lines.append(
      f"| LM decoder step ({c.blocks} scanned blocks, V = {c.vocab}; jaxact: `rms_norm`, "
      "`gated_mlp`, `linear_cross_entropy`, `dot_product_attention`), training temp relative to "
      f"Flax | — | 1 | {dec['flax_remat', 'plain'] / dec['flax', 'plain']:.2f} | "
      f"{dec['jaxact_attn', 'fused'] / dec['flax', 'plain']:.2f} |"
    )
    lines.append(
      "| the same, every block under remat: relative to Flax + remat | — | — | 1 | "
      f"{dec['jaxact_attn_remat', 'fused'] / dec['flax_remat', 'plain']:.2f} |"
    )
  ratios = [r.temp_jaxact / r.temp_jaxnn for r in res.memory if r.temp_jaxnn]
  lines.append(
    f"| MLP temp per activation ({len(ratios)} activations), geometric mean relative to jax.nn | "
    f"1 | — | — | {_geomean(ratios):.2f} |"
  )
  if res.step:
    step = _geomean(ours / ref for ref, ours in res.step.values())
    lines.append(
      f"| activation step time ({len(res.step)} activations), geometric mean relative to jax.nn "
      f"| 1 | — | — | {step:.2f} |"
    )
  totals = _nan_totals(res)
  lines.append(
    "| non-finite gradients, extreme-input grid, 4 dtypes (Flax uses jax.nn's activations) | "
    f"{totals['jax.nn'][1]} | — | — | {totals['jaxact'][1]} |"
  )
  return "\n".join(lines)


def _fmt_cell(v) -> str:
  if v is None:
    return "—"
  return f"{v:.0f}" if float(v).is_integer() else f"{v:.2f}"


def render(res: Results, figures: list[str]) -> str:
  lines = [
    "# jaxact benchmark results",
    "",
    f"- date: {datetime.date.today().isoformat()}",
    f"- machine: {_machine()}",
    f"- command: `python -m benchmarks{' --quick' if res.quick else ''}`",
    f"- run time: {res.seconds:.0f} s ("
    + ", ".join(f"{k} {v:.0f} s" for k, v in res.section_seconds.items())
    + ")",
    "",
    "## Summary",
    "",
    "Relu / gelu in each cell. jax.nn: `act(x @ w + b)` / `act(lax.conv(x, w) + b)`; Flax:",
    "`nn.Dense` / `nn.Conv` then the jax.nn activation; Flax + remat: the same, each layer under",
    "`nn.remat(policy=jax.checkpoint_policies.nothing_saveable)`; jaxact: `jaxact.linen.DenseAct`",
    "/ `ConvAct` (Flax's parameters, computed as `jaxact.dense_bias_act` / `conv_bias_act`).",
    "Memory is XLA's compiled temp of `jit(grad(loss))` in activation-sized buffers.",
    "",
    summary(res),
    "",
    *(f"![{f}]({f})" for f in figures),
    "",
    "## Training memory: 8-layer MLP, 8192 x 512 float32 activations, `jit(grad(loss))`",
    "",
    "`temp` is XLA's compiled `temp_size_in_bytes` in activation buffers (16 MiB each); `kept` is",
    "activation-sized arrays held by `jax.vjp`'s pullback per layer (parameters and input",
    "excluded). Targets: temp <= 9 (L+1) for output-residual activations, <= 17 (2L+1) for",
    "input-residual ones, never above jax.nn; kept = 1 per layer (output residual) or 2 (input",
    "residual).",
    "",
    "| activation | residual | temp jax.nn | temp jaxact | ratio | kept jax.nn | kept jaxact |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for row in res.memory:
    ratio = None if row.temp_jaxnn is None else row.temp_jaxact / row.temp_jaxnn
    lines.append(
      f"| {row.name} | {row.residual} | {_fmt(row.temp_jaxnn)} | {_fmt(row.temp_jaxact)} | "
      f"{_fmt(ratio, '{:.2f}')} | {_fmt(row.kept_jaxnn, '{:.2f}')} | "
      f"{_fmt(row.kept_jaxact, '{:.2f}')} |"
    )

  lines += [
    "",
    f"## Step time: `jit(value_and_grad(sum(act(x))))`, 2**22 float32 elements, median of "
    f"{res.reps}",
    "",
    "Runs of the two libraries alternate; the ratio is jaxact / jax.nn (below 1 is faster).",
    "",
    "| activation | jax.nn ms | jaxact ms | ratio |",
    "|---|---:|---:|---:|",
  ]
  for name, (t_ref, t_ours) in res.step.items():
    lines.append(f"| {name} | {t_ref * 1e3:.2f} | {t_ours * 1e3:.2f} | {t_ours / t_ref:.2f} |")
  if res.step:
    gm = _geomean(ours / ref for ref, ours in res.step.values())
    lines.append(f"| **geometric mean** | | | **{gm:.2f}** |")

  lines += [
    "",
    "## Fused layers: `dense_bias_act` / `conv_bias_act` against `act(x @ w + b)` / "
    "`act(lax.conv(x, w) + b)` with jax.nn",
    "",
    "8-layer MLP (8192 x 512 float32, 512 x 512 kernels) and 6-layer CNN (NHWC 32x32x32x64,",
    "3x3x64x64 kernels, SAME), `jit(grad)`: compiled temp in activation buffers, and the median",
    f"step time of `jit(value_and_grad)` over {res.fused_runs} alternated runs (ratio fused /",
    "composition). Targets: L+1 buffers for output-residual activations, 2L+1 for gelu;",
    "ratio <= 1."
    + (
      " `--quick` does not time them here: the Flax section times the same ops as"
      " `jaxact.linen` layers."
      if res.quick
      else ""
    ),
    "",
    "| model | activation | temp jax.nn | temp fused | target | jax.nn ms | fused ms | ratio |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in res.fused:
    if r.times is None:
      timing = "— | — | —"
    else:
      t_f, t_c = r.times
      timing = f"{t_c * 1e3:.1f} | {t_f * 1e3:.1f} | {t_f / t_c:.2f}"
    lines.append(
      f"| {r.model} | {r.activation} | {r.temp_composition:.1f} | {r.temp_fused:.1f} | "
      f"{r.target} | {timing} |"
    )

  names = flax_models.VARIANTS
  lines += [
    "",
    "## Against Flax and Flax + remat: the same MLP and CNN as Flax modules",
    "",
    f"{names['flax']}: `nn.Dense` / `nn.Conv` (3x3, SAME), then the jax.nn activation.",
    f"{names['remat']}: each layer under `nn.remat(policy=jax.checkpoint_policies."
    "nothing_saveable)`, the",
    "memory-saving alternative Flax users have: a layer keeps only its input and recomputes its",
    "matmul/convolution, bias and activation in the backward pass. The policies that save the",
    "matmul/conv outputs keep that output next to the input and save nothing here",
    f"({names['remat_dots']}, memory only); one `jax.checkpoint` around the whole loss saves",
    "nothing either (the backward recomputes the whole forward, then needs all of it).",
    f"{names['jaxact']}: `jaxact.linen.DenseAct` / `ConvAct`, the same parameters.",
    "",
    "Memory: compiled temp of `jit(grad(loss))` in activation buffers, and activation-sized",
    "arrays held by `jax.vjp`'s pullback per layer (eager, parameters and input excluded).",
    "",
    "| model | activation | "
    + " | ".join(f"temp {v}" for v in names.values())
    + " | "
    + " | ".join(f"kept {v}" for v in names.values())
    + " |",
    "|---|---|" + "---:|" * (2 * len(names)),
  ]
  for r in res.flax:
    temps = " | ".join(f"{r.memory[v][0]:.1f}" for v in names)
    kept = " | ".join(f"{r.memory[v][1]:.2f}" for v in names)
    lines.append(f"| {r.model} | {r.activation} | {temps} | {kept} |")
  timed = flax_models.TIMED
  lines += [
    "",
    f"Step time of `jit(value_and_grad(loss))` (gradients of the parameters), median of "
    f"{res.flax_runs} runs, the three alternated; ratios against Flax (below 1 is faster).",
    "",
    "| model | activation | "
    + " | ".join(f"{names[v]} ms" for v in timed)
    + " | "
    + " | ".join(f"{names[v]} / Flax" for v in timed if v != "flax")
    + " |",
    "|---|---|" + "---:|" * (2 * len(timed) - 1),
  ]
  for r in res.flax:
    if r.times is None:
      continue
    ms = " | ".join(f"{r.times[v] * 1e3:.1f}" for v in timed)
    ratio = " | ".join(f"{r.times[v] / r.times['flax']:.2f}" for v in timed if v != "flax")
    lines.append(f"| {r.model} | {r.activation} | {ms} | {ratio} |")

  t, d, f = gated.CPU_SIZE
  lines += [
    "",
    f"## Gated MLP stack: {gated.BLOCKS} residual blocks `x + mlp(rms_norm(x))`, {t} tokens, "
    f"D = {d}, F = {f}, float32",
    "",
    "Flax: three `nn.Dense(use_bias=False)` and `jax.nn.silu`; Flax + remat: each block under",
    "`jax.checkpoint(policy=nothing_saveable)`; jaxact: `jaxact.gated_mlp`. Compiled temp of",
    "`jit(value_and_grad(loss))` in MiB, unrolled and as `lax.scan` over stacked parameters;",
    "ratios against Flax (`python -m benchmarks.gated` for the H100 figures and tokamax).",
    "",
    *gated.render_memory(res.gated, None if res.quick else "kept"),
  ]
  if res.gated_times is not None:
    lines += ["", "CPU step time (wall, process CPU), the minimum of 3 interleaved runs:", ""]
    lines += gated.render_times(res.gated_times)
  if res.decoder:
    c = lce.DECODER_CPU
    lines += [
      "",
      f"## LM decoder step: {c.blocks} scanned blocks, {c.batch} x {c.seq} tokens, D = {c.dim}, "
      f"F = {c.hidden}, V = {c.vocab}, float32",
      "",
      "Embedding, blocks of RMS norm, causal attention (`jax.nn.dot_product_attention`, or",
      "`jaxact.dot_product_attention` where named) and a gated MLP, final norm, head and loss.",
      "Plain head: `h @ w` and optax's cross-entropy; fused: `jaxact.linear_cross_entropy`;",
      "jaxact's bodies with `jaxact.rms_norm`. Compiled temp of `jit(value_and_grad(loss))`",
      "(`python -m benchmarks.lce` for every body and head, the H100 and tokamax;",
      "`python -m benchmarks.attention` for attention at longer sequences).",
      "",
      "| body | head | temp (MiB) | relative to Flax |",
      "|---|---|---:|---:|",
    ]
    for (body, head), temp in res.decoder.items():
      ratio = temp / res.decoder["flax", "plain"]
      lines.append(f"| {lce.BODY_LABELS[body]} | {head} | {temp / 2**20:.1f} | {ratio:.2f} |")
  lines += [
    "",
    "## Numerics: NaN values / non-finite gradients on the finite extreme-input grid",
    "",
    "Grid: ±1e30, ±finfo.max, ±548, ±300, ±88.8, ±17, ±1, ±tiny, ±smallest subnormal, 0 (values",
    "the dtype cannot hold are dropped). Each cell is `NaN values / non-finite gradients`,",
    "jax.nn then jaxact.",
    "",
    "| activation | " + " | ".join(bench.DTYPES) + " |",
    "|---|" + "---|" * len(bench.DTYPES),
  ]
  for name, by_dtype in res.nans.items():
    cells = []
    for dtype in bench.DTYPES:
      ref, ours = by_dtype[dtype]["jax.nn"], by_dtype[dtype]["jaxact"]
      ref_s = "—" if ref is None else f"{ref[0]}/{ref[1]}"
      cells.append(f"{ref_s} → {ours[0]}/{ours[1]}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  totals = _nan_totals(res)
  lines += [
    "",
    f"Totals: jax.nn {totals['jax.nn'][0]} NaN values, {totals['jax.nn'][1]} non-finite gradients;"
    f" jaxact {totals['jaxact'][0]} NaN values, {totals['jaxact'][1]} non-finite gradients.",
    "",
    "## GPU: fused layers and elementwise activations",
    "",
  ]
  lines += _render_gpu(res)
  return "\n".join(lines) + "\n"


def _render_gpu(res: Results) -> list[str]:
  if res.gpu_layers is None:
    return [
      f"Not measured: this run's backend is {jax.default_backend()}. On a GPU",
      '(`jax.default_backend() == "gpu"`) the suite times, in bfloat16, one dense and one 3x3',
      "convolution layer (the jax.nn composition, jaxact's XLA path, and jaxact's default, which",
      "picks the Pallas kernels where they support the call) and the elementwise activations",
      "(forward and backward as separate jitted calls), with TFLOP/s and GB/s as fractions of the",
      "device's data-sheet peaks.",
    ]
  dev = jax.devices()[0].device_kind
  peak = gpu.peaks(dev)
  peak_s = "not in the peak table" if peak is None else f"{peak[0]} TB/s, {peak[1]:.0f} TFLOP/s"
  lines = [
    f"Device: {dev} (data-sheet peaks: {peak_s}). bfloat16. `jit(value_and_grad)` of",
    "`sum(act(layer(x, w) + b))` with respect to x, w and b; TFLOP/s counts the forward and two",
    "backward products of jaxact's default implementation. Ratios against the composition.",
    "",
    "| layer | shapes | activation | jax.nn ms | jaxact xla ms | jaxact default ms | "
    "xla ratio | default ratio | TFLOP/s | of peak |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in res.gpu_layers:
    lines.append(
      f"| {r.op} | {r.shape} | {r.activation} | {r.composition * 1e3:.3f} | {r.xla * 1e3:.3f} | "
      f"{r.default * 1e3:.3f} | {r.xla / r.composition:.2f} | {r.default / r.composition:.2f} | "
      f"{r.tflops:.0f} | {_fmt(r.peak_fraction, '{:.0%}')} |"
    )
  lines += [
    "",
    "Elementwise activations: forward (`jax.vjp`) and backward (the pullback), two jitted calls.",
    "GB/s counts five arrays (read x, write y; read the residual and dy, write dx).",
    "",
    "| activation | elements | jax.nn ms | jaxact ms | ratio | jaxact GB/s | of peak |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in res.gpu_elementwise or []:
    lines.append(
      f"| {r.activation} | {r.size} | {r.jaxnn * 1e3:.3f} | {r.jaxact * 1e3:.3f} | "
      f"{r.jaxact / r.jaxnn:.2f} | {r.gbps:.0f} | {_fmt(r.peak_fraction, '{:.0%}')} |"
    )
  return lines


def write_figures(res: Results, out: pathlib.Path) -> list[str]:
  """The PNG figures; returns their file names (relative to `out`)."""
  series = {"jax.nn": None, "Flax": "flax", "Flax + remat": "remat", "jaxact": "jaxact"}
  models: dict[str, dict[str, dict[str, float | None]]] = {}
  for r in res.flax:
    comp = _fused(res, r.model, r.activation)
    models.setdefault(r.model, {})[r.activation] = {
      label: (comp.temp_composition if comp else None) if v is None else r.memory[v][0]
      for label, v in series.items()
    }
  names = []
  if models:
    plots.memory_models(models, out / "memory_models.png")
    names.append("memory_models.png")
  plots.memory_activations(res.memory, fused.MLP_LAYERS, out / "memory_activations.png")
  names.append("memory_activations.png")
  step_models: dict[str, dict[str, float]] = {}
  for r in res.flax:
    if r.times is not None:
      step_models[f"{r.model}\n{r.activation}"] = {
        "Flax + remat": r.times["remat"] / r.times["flax"],
        "jaxact": r.times["jaxact"] / r.times["flax"],
      }
  plots.step_time(
    {name: ours / ref for name, (ref, ours) in res.step.items()},
    step_models,
    out / "step_time.png",
  )
  names.append("step_time.png")
  counts = {
    dtype: {
      lib: sum((by[dtype][lib] or (0, 0))[1] for by in res.nans.values())
      for lib in ("jax.nn", "jaxact")
    }
    for dtype in bench.DTYPES
  }
  plots.nan_counts(counts, out / "nan_gradients.png")
  names.append("nan_gradients.png")
  return names


def run(quick: bool, out: pathlib.Path) -> Results:
  res = measure(quick)
  out.mkdir(parents=True, exist_ok=True)
  figures = write_figures(res, out)
  (out / "results.md").write_text(render(res, figures))
  return res


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick",
    action="store_true",
    help="fewer timing repetitions and activations, same memory figures (under 3 min on 2 cores)",
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("bench-out"), help="output folder"
  )
  args = parser.parse_args(argv)
  res = run(args.quick, args.out)
  print(summary(res))
  print(
    f"\nfull tables in {args.out / 'results.md'}, figures in {args.out}/*.png "
    f"({res.seconds:.0f} s)",
    file=sys.stderr,
  )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
