"""`python -m benchmarks [--quick] [--out DIR]`: jaxact against jax.nn, Flax and Flax + remat.

Measures everything in one run on this machine, with a progress bar on stderr; writes
DIR/results.md (markdown tables, machine and versions) and PNG figures to DIR, and prints the
summary table. Its centre is the memory-time frontier of each model (MLP and CNN, relu and gelu;
a scanned gated MLP stack; an LM decoder step): every way a user could train it (Flax, Flax under
each remat policy, jaxact, jaxact with few-bit codes, jaxact under the same remat policies), each
point's compiled temp memory and step time measured in the same run, one picture per model
(DIR/frontier_<model>.png) and, per model, jaxact's best step time at Flax + remat's memory or
less and jaxact's least memory at Flax's step time or less.

`--quick` keeps the model sizes and every memory figure the README quotes (they come from XLA's
compiled buffer assignment and need no long runs) but times fewer rounds (the frontiers two,
without a warm-up call) and fewer activations, measures the fused layers' memory for relu and
gelu only, untimed (the frontier times the same ops as `jaxact.linen` layers), and leaves out the
gated stack's table at 1, 2 and 8 blocks. On a
GPU the suite also times the fused layers and the activations against their peak bandwidth and
throughput (benchmarks/gpu.py).
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
from benchmarks import frontier as fr  # noqa: E402
from benchmarks import fused_memory as fused  # noqa: E402

QUICK_TIMED = ("sigmoid", "tanh", "relu", "elu", "softplus", "gelu", "silu", "softmax")
# The activations of the MLP and CNN frontiers (and of --quick's fused layers): one output-residual
# and one input-residual activation, the two the README quotes.
MODEL_ACTIVATIONS = ("relu", "gelu")
MODELS = (("MLP", fused._mlp, fused.MLP_LAYERS), ("CNN", fused._cnn, fused.CNN_LAYERS))
MiB = 2**20


@dataclasses.dataclass
class FusedRow:
  model: str
  activation: str
  temp_composition: float
  temp_fused: float
  target: int
  times: tuple[float, float] | None  # seconds (fused, composition); None when not timed


@dataclasses.dataclass
class Frontier:
  """One model's points (benchmarks.frontier) and how they were measured."""

  name: str  # "MLP, relu", ...
  title: str  # the model's sizes
  unit: str  # "buffers" or "MiB"
  points: list[fr.Point]
  flax_seconds: float  # Flax's step, as timed
  runs: int  # alternated rounds

  def get(self, key: str) -> fr.Point | None:
    return next((p for p in self.points if p.key == key), None)


@dataclasses.dataclass
class Results:
  quick: bool
  reps: int
  fused_runs: int
  flax_runs: int  # alternated rounds of the MLP and CNN frontiers
  stack_runs: int  # alternated rounds of the gated stack's and the decoder's frontiers
  warmup: bool  # a warm-up call of each frontier point before its timed rounds
  memory: list[bench.MemoryRow] = dataclasses.field(default_factory=list)
  step: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
  fused: list[FusedRow] = dataclasses.field(default_factory=list)
  # model key ("mlp_relu", ..., "gated", "decoder"): its frontier
  frontiers: dict[str, Frontier] = dataclasses.field(default_factory=dict)
  # (model, activation): {variant: arrays kept by jax.vjp per layer}; the full run only
  kept: dict[tuple[str, str], dict[str, float]] = dataclasses.field(default_factory=dict)
  # activation: {dtype: {library: (NaN values, non-finite gradients) or None}}
  nans: dict[str, dict[str, dict[str, tuple[int, int] | None]]] = dataclasses.field(
    default_factory=dict
  )
  gated: list[gated.MemoryRow] = dataclasses.field(default_factory=list)
  gpu_layers: list[gpu.LayerRow] | None = None
  gpu_elementwise: list[gpu.ElementwiseRow] | None = None
  seconds: float = 0.0
  cpu_seconds: float = 0.0
  section_seconds: dict[str, tuple[float, float]] = dataclasses.field(
    default_factory=dict
  )  # wall, CPU


@dataclasses.dataclass
class Plan:
  """What one run measures; its lengths are the progress bar's total."""

  memory: list[str]
  timed: list[str]
  fused: list[tuple[str, str]]  # (model, activation): memory
  fused_timed: set[tuple[str, str]]
  flax: list[tuple[str, str]]  # (model, activation): the frontier
  kept: bool  # the arrays jax.vjp keeps per layer, for the Flax models
  gated_table: bool  # the gated stack's memory at 1, 2 and 8 blocks, scanned and unrolled
  nans: list[str]
  gpu: bool

  @classmethod
  def make(cls, quick: bool) -> Plan:
    names = list(jaxact.ACTIVATIONS)
    fused_acts = MODEL_ACTIVATIONS if quick else fused.ACTIVATIONS
    return cls(
      memory=[n for n in names if n != "glu"],
      timed=[n for n in (QUICK_TIMED if quick else names) if bench.reference(n) is not None],
      fused=[(m, a) for m, _, _ in MODELS for a in fused_acts],
      # --quick times the layers once, in the frontier (jaxact.linen's layers are these ops).
      fused_timed=set() if quick else {(m, a) for m, _, _ in MODELS for a in fused.ACTIVATIONS},
      flax=[(m, a) for m in flax_models.MODELS for a in MODEL_ACTIVATIONS],
      kept=not quick,
      gated_table=not quick,
      nans=names,
      gpu=jax.default_backend() == "gpu",
    )

  @property
  def total(self) -> int:
    n = len(self.memory) + len(self.timed) + len(self.fused) + len(self.fused_timed)
    n += len(self.flax) + len(self.nans) + 2 + int(self.gated_table)  # gated stack, decoder
    return n + (2 if self.gpu else 0)


class _Progress:
  """One tqdm bar (stderr) over every measurement, and the seconds each section took: wall and
  process CPU (all of XLA's threads; on a shared machine the steadier of the two)."""

  def __init__(self, total: int):
    self.bar = tqdm(total=total, file=sys.stderr, unit="measurement", dynamic_ncols=True)
    self.seconds: dict[str, tuple[float, float]] = {}
    self.current: str | None = None
    self.start = (time.perf_counter(), time.process_time())

  def section(self, name: str | None) -> None:
    now = (time.perf_counter(), time.process_time())
    if self.current is not None:
      self.seconds[self.current] = (now[0] - self.start[0], now[1] - self.start[1])
    self.current, self.start = name, now
    if name is not None:
      self.bar.set_description(name)

  def step(self, label: str) -> None:
    self.bar.set_postfix_str(label, refresh=False)
    self.bar.update()

  def close(self) -> dict[str, tuple[float, float]]:
    self.section(None)
    self.bar.close()
    return self.seconds


def _model_key(model: str, activation: str) -> str:
  return f"{model.lower()}_{activation}"


def _points(found: dict[str, tuple], unit: float = 1.0) -> list[fr.Point]:
  """benchmarks.frontier's points of ``{key: (temp, median ratio, rounds' ratios)}``, the temp
  divided by `unit`."""
  return [
    fr.point(k, temp / unit, ratio, (min(rounds), max(rounds)))
    for k, (temp, ratio, rounds) in found.items()
  ]


def _flax_frontier(model: str, act: str, runs: int, warmup: bool) -> Frontier:
  seconds, found = flax_models.frontier(model, act, runs, warmup)
  if model == "MLP":
    title = f"{fused.MLP_LAYERS} layers, {fused.MLP_BATCH} x {fused.MLP_WIDTH} float32"
  else:
    shape = "x".join(map(str, fused.CNN_SHAPE))
    title = f"{fused.CNN_LAYERS} conv layers (3x3), NHWC {shape} float32"
  return Frontier(f"{model}, {act}", title, "buffers", _points(found), seconds, runs)


def _gated_frontier(rows: list[gated.MemoryRow], runs: int, warmup: bool) -> Frontier:
  known = {r.peer: r.temp8 for r in rows if r.layout == "scan"}  # the full run's table
  seconds, found = gated.frontier(runs, known=known, warmup=warmup)
  t, d, f = gated.CPU_SIZE
  title = f"{gated.BLOCKS} scanned residual blocks, {t} tokens, D = {d}, F = {f}, float32"
  return Frontier("gated MLP stack", title, "MiB", _points(found), seconds, runs)


def _decoder_frontier(runs: int, warmup: bool) -> Frontier:
  c = lce.DECODER_MAIN
  seconds, found = lce.decoder_frontier(c, runs, warmup)
  title = (
    f"{c.blocks} scanned blocks, {c.batch} x {c.seq} tokens, D = {c.dim}, F = {c.hidden}, "
    f"{c.heads} heads, V = {c.vocab}, float32"
  )
  return Frontier("LM decoder step", title, "MiB", _points(found, MiB), seconds, runs)


def measure(quick: bool) -> Results:
  started, cpu_started = time.perf_counter(), time.process_time()
  plan = Plan.make(quick)
  res = Results(
    quick,
    reps=10 if quick else 40,
    fused_runs=15,
    flax_runs=2 if quick else 11,
    stack_runs=2 if quick else 7,
    warmup=not quick,
  )
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

  progress.section("frontier: MLP and CNN")
  for label, act in plan.flax:
    res.frontiers[_model_key(label, act)] = _flax_frontier(label, act, res.flax_runs, res.warmup)
    if plan.kept:
      res.kept[label, act] = {
        v: flax_models.kept(label, v, act) for v in ("flax", "remat", "dots", "jaxact")
      }
    progress.step(f"{label} {act}")

  progress.section("frontier: gated MLP stack")
  if plan.gated_table:
    res.gated = gated.section_cpu()
    progress.step("memory")
  res.frontiers["gated"] = _gated_frontier(res.gated, res.stack_runs, res.warmup)
  progress.step("points")

  progress.section("frontier: LM decoder step")
  res.frontiers["decoder"] = _decoder_frontier(res.stack_runs, res.warmup)
  progress.step("points")

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
  res.cpu_seconds = time.process_time() - cpu_started
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


def _cell(p: fr.Point | None, unit: str, seconds: float | None = None) -> str:
  if p is None:
    return "—"
  time_s = f"{seconds * 1e3:.0f} ms" if seconds is not None else fr.fmt_time(p.time)
  return f"{fr.fmt_memory(p.memory, unit)}, {time_s}"


def frontier_summary(res: Results) -> list[str]:
  """The headline table: per model, Flax, Flax + remat and jaxact (temp, step time), and the two
  numbers of its frontier."""
  lines = [
    "| model (temp in) | Flax: temp, step | Flax + remat | jaxact | jaxact's best step time at "
    "Flax + remat's temp or less | jaxact's least temp at Flax's step time or less | Flax's "
    "points on the front (no jaxact point beats them) |",
    "|---|---|---|---|---|---|---|",
  ]
  for f in res.frontiers.values():
    v = fr.verdict(f.points)
    remat = _cell(v.remat, f.unit)
    if v.remat.key != "remat":
      remat += f" ({v.remat.label})"
    fastest, smallest, flax_front = fr.cells(v, f.unit)
    lines.append(
      f"| {f.name} ({f.unit}) | {_cell(v.flax, f.unit, f.flax_seconds)} "
      f"| {remat} | {_cell(f.get('jaxact'), f.unit)} | {fastest} | {smallest} | {flax_front} |"
    )
  return lines


def activation_summary(res: Results) -> list[str]:
  """Each activation alone: memory, step time and NaN counts against jax.nn."""
  ratios = [r.temp_jaxact / r.temp_jaxnn for r in res.memory if r.temp_jaxnn]
  lines = [
    "| each activation alone | jax.nn | jaxact |",
    "|---|---:|---:|",
    f"| 8-layer MLP temp ({len(ratios)} activations), geometric mean relative to jax.nn | 1 | "
    f"{_geomean(ratios):.2f} |",
  ]
  if res.step:
    step = _geomean(ours / ref for ref, ours in res.step.values())
    lines.append(
      f"| step time ({len(res.step)} activations), geometric mean relative to jax.nn | 1 | "
      f"{step:.2f} |"
    )
  totals = _nan_totals(res)
  lines.append(
    "| non-finite gradients, extreme-input grid, 4 dtypes (Flax uses jax.nn's activations) | "
    f"{totals['jax.nn'][1]} | {totals['jaxact'][1]} |"
  )
  return lines


def summary(res: Results) -> str:
  return "\n".join([*frontier_summary(res), "", *activation_summary(res)])


POINTS_TEXT = [
  "Each point is one way to train the model. Flax: `nn.Dense` / `nn.Conv` then the jax.nn",
  "activation; the gated MLP as three `nn.Dense` and `jax.nn.silu`; the decoder's blocks as",
  "`jnp.dot`s, `jax.nn.dot_product_attention`, Flax's RMS norm and optax's loss over the logits.",
  "jaxact: `jaxact.linen.DenseAct` / `ConvAct` (Flax's parameters); `jaxact.gated_mlp`; the",
  "decoder with `jaxact.rms_norm`, `gated_mlp`, `dot_product_attention` and",
  "`linear_cross_entropy` (`jax.nn attn`: the same with `jax.nn.dot_product_attention`).",
  "`+ remat`: every layer or block under `nn.remat` / `jax.checkpoint` with `nothing_saveable`",
  "(it keeps its input only); `remat(dots)`: `dots_saveable`, which also keeps the matmul and",
  "convolution outputs (`dots_with_no_batch_dims_saveable` in the decoder, so that attention's",
  "logits are not kept); `remat(names)`: `save_only_these_names` of the gated MLP's two",
  "projections (`jaxact.GATED_CHECKPOINT_NAMES`; in Flax the same two arrays named with",
  "`checkpoint_name`). `8 / 4 / 2 bits`: `residual_bits`, the derivative of gelu kept in that",
  "many bits (relu keeps its output: no code applies; the gated MLP refuses codes, which would",
  "save nothing there).",
  "",
  "Memory: XLA's compiled temp of the training step. Step time: the same compiled programs,",
  "relative to Flax's, the median of the ratios within rounds of alternated runs (MLP, CNN:",
  "`jit(grad(loss))`; decoder: `jit(value_and_grad(loss))`; gated stack: the temp of the",
  f"{gated.BLOCKS}-block stack, the step time of a 2-block scan of the same blocks, its per-block",
  "work at a quarter of the time). A point is on the Pareto front when no other point is as",
  "small and as fast and strictly better in one of the two. On a shared 2-core machine step",
  "times move by a few percent from run to run: points a few percent apart in time are level.",
]


def _frontier_section(res: Results) -> list[str]:
  lines = ["## The memory-time frontier: every way to train each model", "", *POINTS_TEXT]
  for key, f in res.frontiers.items():
    v = fr.verdict(f.points)
    lines += [
      "",
      f"### {f.name}",
      "",
      f"{f.title}; Flax's step {f.flax_seconds * 1e3:.0f} ms; {f.runs} alternated rounds"
      + ("." if res.warmup else " (no warm-up call)."),
      "",
      f"**{fr.sentence(v, f.unit)}**",
      "",
      *fr.table(f.points, f.unit),
      "",
      f"![frontier_{key}.png](frontier_{key}.png)",
    ]
  if res.kept:
    lines += [
      "",
      "Activation-sized arrays held by `jax.vjp`'s pullback per layer (eager, parameters and",
      "input excluded; outside jit, Flax's `promote_dtype` copies each layer's input and the",
      "pullback holds the copy: one more array a layer on both sides of the Flax rows).",
      "",
      "| model | activation | Flax | Flax + remat | Flax + remat(dots) | jaxact |",
      "|---|---|---:|---:|---:|---:|",
    ]
    for (model, act), kept in res.kept.items():
      cells = " | ".join(f"{kept[v]:.2f}" for v in ("flax", "remat", "dots", "jaxact"))
      lines.append(f"| {model} | {act} | {cells} |")
  return lines


def render(res: Results, figures: list[str]) -> str:
  sections = ", ".join(
    f"{k} {w:.0f} s ({c:.0f} s CPU)" for k, (w, c) in res.section_seconds.items()
  )
  lines = [
    "# jaxact benchmark results",
    "",
    f"- date: {datetime.date.today().isoformat()}",
    f"- machine: {_machine()}",
    f"- command: `python -m benchmarks{' --quick' if res.quick else ''}`",
    f"- run time: {res.seconds:.0f} s, {res.cpu_seconds:.0f} s of CPU ({sections})",
    "",
    "## Summary",
    "",
    "Per model, the compiled temp of its training step (activation-sized buffers for the MLP and",
    "CNN, MiB for the gated stack and the decoder) and its step time, Flax's in milliseconds and",
    "the others relative to it; then the two numbers of the model's frontier (below, with its",
    "picture and every point): among jaxact's points with no more temp than Flax + remat, the",
    "fastest; among jaxact's points no slower than Flax, the one with least temp. Last, the",
    "Flax points on the Pareto front: those no jaxact point beats.",
    "",
    *frontier_summary(res),
    "",
    *activation_summary(res),
    "",
    *(f"![{f}]({f})" for f in figures if not f.startswith("frontier_")),
    "",
    *_frontier_section(res),
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
      " `--quick` measures relu and gelu and does not time them here: the frontier times the"
      " same ops as `jaxact.linen` layers."
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

  t, d, f = gated.CPU_SIZE
  lines += [
    "",
    f"## Gated MLP stack: {gated.BLOCKS} residual blocks `x + mlp(rms_norm(x))`, {t} tokens, "
    f"D = {d}, F = {f}, float32",
    "",
  ]
  if res.gated:
    lines += [
      "Flax: three `nn.Dense(use_bias=False)` and `jax.nn.silu`; Flax + remat: each block under",
      "`jax.checkpoint(policy=nothing_saveable)`; jaxact: `jaxact.gated_mlp`. Compiled temp of",
      "`jit(value_and_grad(loss))` in MiB, unrolled and as `lax.scan` over stacked parameters;",
      "ratios against Flax (`python -m benchmarks.gated` for the H100 figures and tokamax; the",
      "stack's frontier, with every remat policy, is above).",
      "",
      *gated.render_memory(res.gated, "kept"),
    ]
  else:
    lines.append(
      "`--quick` measures the stack's frontier only (above); the full run adds its temp at 1, 2"
      " and 8 blocks, scanned and unrolled, and the arrays each block keeps."
    )
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
  names = []
  for key, f in res.frontiers.items():
    plots.frontier(f.points, f"{f.name}: {f.title}", f.unit, out / f"frontier_{key}.png")
    names.append(f"frontier_{key}.png")
  series = {"jax.nn": None, "Flax": "flax", "Flax + remat": "remat", "jaxact": "jaxact"}
  models: dict[str, dict[str, dict[str, float | None]]] = {}
  step_models: dict[str, dict[str, float]] = {}
  for model, _, _ in MODELS:
    for act in MODEL_ACTIVATIONS:
      f = res.frontiers.get(_model_key(model, act))
      if f is None:
        continue
      comp = _fused(res, model, act)
      models.setdefault(model, {})[act] = {
        label: (comp.temp_composition if comp else None) if k is None else f.get(k).memory
        for label, k in series.items()
      }
      step_models[f"{model}\n{act}"] = {
        "Flax + remat": f.get("remat").time,
        "jaxact": f.get("jaxact").time,
      }
  if models:
    plots.memory_models(models, out / "memory_models.png")
    names.append("memory_models.png")
  plots.memory_activations(res.memory, fused.MLP_LAYERS, out / "memory_activations.png")
  names.append("memory_activations.png")
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
    help="fewer timing rounds and activations, same memory figures (about 3 min on 2 cores)",
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("bench-out"), help="output folder"
  )
  args = parser.parse_args(argv)
  res = run(args.quick, args.out)
  print(summary(res))
  print(
    f"\nfull tables in {args.out / 'results.md'}, figures in {args.out}/*.png "
    f"({res.seconds:.0f} s, {res.cpu_seconds:.0f} s of CPU)",
    file=sys.stderr,
  )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
