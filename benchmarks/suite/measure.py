"""The main job's measurements, each added as a row (`benchmarks.harness.rows`) as it is taken.

Sections, with the row section each writes: the 8-layer MLP's temp per activation (``memory``),
step time per activation (``step``), the fused layers (``fused``), the MLP and CNN frontiers
(``frontier`` a model, ``point`` a way to train it, ``kept`` the arrays jax.vjp keeps per layer),
the gated MLP stack (``gated``, ``frontier``, ``point``), the LM decoder step, the ResNet-50, the
MoE block stack, the NaN counts
(``nan``), on a GPU the fused layers and activations against the device's peaks (``gpu-layer``,
``gpu-eltwise``); first the run's settings (``run``: ``settings``), last its seconds (``run``:
``time``).

`quick` keeps the model sizes and every memory figure the README quotes (they come from XLA's
compiled buffer assignment and need no long runs) but times fewer rounds (the frontiers two,
without a warm-up call) and fewer activations, measures the fused layers' memory for relu and
gelu only, untimed (the frontier times the same ops as `jaxact.linen` layers), and leaves out the
gated stack's table at 1, 2 and 8 blocks.
"""

from __future__ import annotations

import dataclasses
import time

import jax

# float64 is one of the dtypes measured; every other array here is created with an explicit dtype.
jax.config.update("jax_enable_x64", True)

import jaxact  # noqa: E402
from benchmarks import activations as bench  # noqa: E402
from benchmarks import cnn, decoder, fused, fused_models, gated, moe  # noqa: E402
from benchmarks.gpu import suite as gpu  # noqa: E402
from benchmarks.harness.progress import Progress  # noqa: E402
from benchmarks.harness.rows import Recorder  # noqa: E402

QUICK_TIMED = ("sigmoid", "tanh", "relu", "elu", "softplus", "gelu", "silu", "softmax")
# The activations of the MLP and CNN frontiers (and of --quick's fused layers): one output-residual
# and one input-residual activation, the two the README quotes.
MODEL_ACTIVATIONS = ("relu", "gelu")
MODELS = (("MLP", fused._mlp, fused.MLP_LAYERS), ("CNN", fused._cnn, fused.CNN_LAYERS))
MiB = 2**20


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
  stacks: bool  # the gated stack's and the decoder's frontiers
  nans: list[str]
  gpu: bool

  @classmethod
  def make(cls, quick: bool, activations_only: bool = False) -> Plan:
    names = list(jaxact.ACTIVATIONS)
    fused_acts = MODEL_ACTIVATIONS if quick else fused.ACTIVATIONS
    models = not activations_only
    return cls(
      memory=[n for n in names if n != "glu"],
      timed=bench.step_cases(n for n in (QUICK_TIMED if quick else names) if bench.reference(n)),
      fused=[(m, a) for m, _, _ in MODELS for a in fused_acts] if models else [],
      # --quick times the layers once, in the frontier (jaxact.linen's layers are these ops).
      fused_timed=set()
      if quick or not models
      else {(m, a) for m, _, _ in MODELS for a in fused.ACTIVATIONS},
      flax=[(m, a) for m in fused_models.MODELS for a in MODEL_ACTIVATIONS] if models else [],
      kept=models and not quick,
      gated_table=models and not quick,
      stacks=models,
      nans=names,
      gpu=models and jax.default_backend() == "gpu",
    )

  @property
  def total(self) -> int:
    n = len(self.memory) + len(self.timed) + len(self.fused) + len(self.fused_timed)
    n += len(self.flax) + len(self.nans) + 4 * self.stacks + int(self.gated_table)
    return n + (2 if self.gpu else 0)


def _model_key(model: str, activation: str) -> str:
  return f"{model.lower()}_{activation}"


def _frontier(
  rec: Recorder,
  key: str,
  name: str,
  title: str,
  unit: str,
  runs: int,
  found: dict,
  seconds: float,
  scale: float = 1.0,
) -> None:
  """A model's `frontier` row and a `point` row for each of ``found``'s ``{point: (temp, median
  ratio, rounds' ratios)}``, the temp divided by `scale`."""
  rec.add("frontier", key, name=name, title=title, unit=unit, flax_seconds=seconds, runs=runs)
  for k, (temp, ratio, rounds) in found.items():
    rec.add(
      "point",
      f"{key}: {k}",
      model=key,
      point=k,
      memory=temp / scale,
      time=ratio,
      spread=[min(rounds), max(rounds)],
    )


def _flax_frontier(rec: Recorder, model: str, act: str, runs: int, warmup: bool) -> None:
  seconds, found = fused_models.frontier(model, act, runs, warmup)
  if model == "MLP":
    title = f"{fused.MLP_LAYERS} layers, {fused.MLP_BATCH} x {fused.MLP_WIDTH} float32"
  else:
    shape = "x".join(map(str, fused.CNN_SHAPE))
    title = f"{fused.CNN_LAYERS} conv layers (3x3), NHWC {shape} float32"
  _frontier(rec, _model_key(model, act), f"{model}, {act}", title, "buffers", runs, found, seconds)


def _gated_frontier(rec: Recorder, rows: list[gated.MemoryRow], runs: int, warmup: bool) -> None:
  known = {r.peer: r.temp8 for r in rows if r.layout == "scan"}  # the full run's table
  seconds, found = gated.frontier(runs, known=known, warmup=warmup)
  t, d, f = gated.CPU_SIZE
  title = f"{gated.BLOCKS} scanned residual blocks, {t} tokens, D = {d}, F = {f}, float32"
  _frontier(rec, "gated", "gated MLP stack", title, "MiB", runs, found, seconds)


def _decoder_frontier(rec: Recorder, runs: int, warmup: bool) -> None:
  c = decoder.DECODER_MAIN
  seconds, found = decoder.decoder_frontier(c, runs, warmup)
  title = (
    f"{c.blocks} scanned blocks, {c.batch} x {c.seq} tokens, D = {c.dim}, F = {c.hidden}, "
    f"{c.heads} heads, V = {c.vocab}, float32"
  )
  _frontier(rec, "decoder", "LM decoder step", title, "MiB", runs, found, seconds, MiB)


def _resnet_frontier(rec: Recorder, runs: int, warmup: bool) -> None:
  seconds, found = cnn.frontier(runs, warmup)
  shape = " x ".join(map(str, cnn.RESNET_CPU))
  title = f"Flax's ImageNet ResNet-50, images {shape}, float32"
  _frontier(rec, "resnet", "ResNet-50", title, "MiB", runs, found, seconds, MiB)


def _moe_frontier(rec: Recorder, runs: int, warmup: bool) -> None:
  seconds, found = moe.frontier(runs, warmup)
  title = f"{moe.MAIN_BLOCKS} scanned blocks, {moe.MAIN}, float32; Flax: the plain ragged_dot MoE"
  _frontier(rec, "moe", "MoE block stack", title, "MiB", runs, found, seconds, MiB)


def measure(rec: Recorder, quick: bool, activations_only: bool = False) -> None:
  """Every measurement of the main job (or its activation sections), added to `rec` as rows."""
  started, cpu_started = time.perf_counter(), time.process_time()
  plan = Plan.make(quick, activations_only)
  reps, fused_runs = 10 if quick else 40, 15
  flax_runs, stack_runs, warmup = (2, 2, False) if quick else (11, 7, True)
  rec.add(
    "run",
    "settings",
    quick=quick,
    reps=reps,
    fused_runs=fused_runs,
    flax_runs=flax_runs,
    stack_runs=stack_runs,
    warmup=warmup,
    gated_blocks=gated.BLOCKS,
    gated_size=list(gated.CPU_SIZE),
  )
  progress = Progress(plan.total)
  progress.section("MLP memory per activation")
  for name in plan.memory:
    row = dataclasses.asdict(bench.mlp_memory(name))
    rec.add("memory", row.pop("name"), **row)
    progress.step(name)

  progress.section("step time per activation")
  for case in plan.timed:
    t = bench.step_time(case, reps=reps)
    rec.add("step", case, jaxnn_seconds=t[0], jaxact_seconds=t[1])
    progress.step(case)

  progress.section("fused layers")
  for label, model, layers in MODELS:
    for act in fused.ACTIVATIONS:
      if (label, act) not in plan.fused:
        continue
      target = layers + 1 if act in fused.OUTPUT_RESIDUAL else 2 * layers + 1
      temps = [fused.temp_buffers(model, act, f) for f in (False, True)]
      progress.step(f"{label} {act} memory")
      t_f = t_c = None
      if (label, act) in plan.fused_timed:
        t_f, t_c, _ = fused.time_ratio(model, act, fused_runs)
        progress.step(f"{label} {act} time")
      rec.add(
        "fused",
        f"{label}, {act}",
        model=label,
        activation=act,
        temp_composition=temps[0],
        temp_fused=temps[1],
        target=target,
        fused_seconds=t_f,
        composition_seconds=t_c,
      )

  progress.section("frontier: MLP and CNN")
  for label, act in plan.flax:
    _flax_frontier(rec, label, act, flax_runs, warmup)
    if plan.kept:
      kept = {v: fused_models.kept(label, v, act) for v in ("flax", "remat", "dots", "jaxact")}
      rec.add("kept", f"{label}, {act}", model=label, activation=act, **kept)
    progress.step(f"{label} {act}")

  if plan.stacks:
    progress.section("frontier: gated MLP stack")
    table = []
    if plan.gated_table:
      table = gated.section_cpu()
      for r in table:
        rec.add("gated", f"{r.peer}, {r.layout}", **dataclasses.asdict(r))
      progress.step("memory")
    _gated_frontier(rec, table, stack_runs, warmup)
    progress.step("points")

    progress.section("frontier: LM decoder step")
    _decoder_frontier(rec, stack_runs, warmup)
    progress.step("points")

    progress.section("frontier: ResNet-50")
    _resnet_frontier(rec, stack_runs, warmup)
    progress.step("points")

    progress.section("frontier: MoE block stack")
    _moe_frontier(rec, stack_runs, warmup)
    progress.step("points")

  progress.section("NaN counts")
  for name in plan.nans:
    for dtype in bench.DTYPES:
      counts = bench.nan_counts(name, dtype)
      ref, ours = counts["jax.nn"], counts["jaxact"]
      rec.add(
        "nan",
        f"{name}, {dtype}",
        activation=name,
        dtype=dtype,
        jaxnn=None if ref is None else list(ref),
        jaxact=list(ours),
      )
    progress.step(name)

  if plan.gpu:
    progress.section("GPU")
    for r in gpu.layers(runs=10 if quick else 30):
      rec.add("gpu-layer", f"{r.op}, {r.activation}", **dataclasses.asdict(r))
    progress.step("fused layers")
    for r in gpu.elementwise(runs=10 if quick else 30):
      rec.add("gpu-eltwise", r.activation, **dataclasses.asdict(r))
    progress.step("elementwise")
  sections = progress.close()
  rec.add(
    "run",
    "time",
    seconds=time.perf_counter() - started,
    cpu_seconds=time.process_time() - cpu_started,
    sections={k: list(v) for k, v in sections.items()},
  )
