"""The norms job's tables from its rows (sections ``stack``, ``stack-h100``, ``stack-tpu``,
``decoder``, ``decoder-h100``, ``decoder-tpu``, ``time``, ``precision``)."""

from __future__ import annotations

from benchmarks.harness import render
from benchmarks.tables import tpu

# The TPU sections are drawn in blocks of their own (results/tpu-families.md; benchmarks.render)
SEPARATE_SECTIONS = ("stack-tpu", "decoder-tpu")

MiB = 2**20
SECTIONS = (
  "stack", "stack-h100", "stack-tpu", "decoder", "decoder-h100", "decoder-tpu", "time", "precision"
)  # fmt: skip


def _stack_cells(f: dict) -> list[str]:
  t = " / ".join(f"{b / MiB:.0f}" for b in f["temp_bytes"])
  return [
    f["stack"],
    f["mlp"],
    f["norm"],
    t,
    f"{f['growth_bytes'] / MiB:.1f}",
    f"{f['growth_vs_flax']:.3f}",
  ]


HEADER = ("stack", "MLP", "norm", "temp 1 / 2 / 8 blocks MiB", "growth a block MiB", "/ Flax's")
STACK = render.Table(HEADER, _stack_cells)  # sections stack, stack-h100
DECODER = render.Table(
  ("body", "head", "plain norms MiB", "jaxact.rms_norm MiB", "ratio"),
  lambda f: [
    f["body"],
    f["head"],
    f"{f['plain_bytes'] / MiB:.1f}",
    f"{f['jaxact_bytes'] / MiB:.1f}",
    f"{f['ratio']:.3f}",
  ],
)  # sections decoder, decoder-h100
TIME = render.Table(
  ("model", "time / Flax MLP with the plain norm"), lambda f: [f["case"], f"{f['ratio']:.3f}"]
)
PRECISION = render.Table(
  ("quantity", "relative RMS error"), lambda f: [f["case"], f"{f['relative_rms_error']:.2e}"]
)


def _where(section: str) -> str:
  return "compiled for an H100, bfloat16" if section.endswith("-h100") else "CPU, float32"


def stack(these: list[dict], section: str) -> list[str]:
  size = tuple(these[0]["figures"]["size"])
  return [f"{_where(section)}, (tokens, D, F) = {size}.", "", *STACK.lines(these)]


def decoder(these: list[dict], section: str) -> list[str]:
  where = "compiled for an H100, bfloat16" if section.endswith("-h100") else "on CPU, float32"
  config = these[0]["figures"]["config"]
  return [f"Decoder step {where}: {config}.", "", *DECODER.lines(these)]


def time(these: list[dict], section: str) -> list[str]:
  f = these[0]["figures"]
  return [
    f"CPU step time, scanned stack of {f['blocks']} blocks, {tuple(f['size'])}, float32, median "
    f"of {f['runs']} rounds (first: {f['first_seconds'] * 1e3:.0f} ms).",
    "",
    *TIME.lines(these),
  ]


def precision(these: list[dict], section: str) -> list[str]:
  f = these[0]["figures"]
  return [
    f"bfloat16 x ({f['tokens']} x {f['dim']}, N(1, 3)), float32 scale N(0, 1); relative RMS "
    "error against float64.",
    "",
    *PRECISION.lines(these),
  ]


STACK_TPU = render.Table(
  (*HEADER, "8 blocks: step ms, ESTIMATE"), lambda f: [*_stack_cells(f), tpu.estimate_ms(f)]
)


def _estimate_of(f: dict, norm: str) -> str:
  """The estimate of a decoder-tpu row's `norm` ("plain", "jaxact") step."""
  return tpu.estimate_ms({k.removeprefix(f"{norm}_"): v for k, v in f.items()})


DECODER_TPU = render.Table(
  (*DECODER.header, "plain: step ms, ESTIMATE", "jaxact: step ms, ESTIMATE"),
  lambda f: [*DECODER.cells(f), _estimate_of(f, "plain"), _estimate_of(f, "jaxact")],
)


def stack_tpu(these: list[dict], section: str) -> list[str]:
  size = tuple(these[0]["figures"]["size"])
  return [f"(tokens, D, F) = {size}, bfloat16.", "", *tpu.per_chip(these, STACK_TPU.lines)]


def decoder_tpu(these: list[dict], section: str) -> list[str]:
  config = these[0]["figures"]["config"]
  return [f"Decoder step: {config}.", "", *tpu.per_chip(these, DECODER_TPU.lines)]


DRAW = {"stack": stack, "stack-h100": stack, "decoder": decoder, "decoder-h100": decoder}
DRAW |= {"stack-tpu": stack_tpu, "decoder-tpu": decoder_tpu}
DRAW |= {"time": time, "precision": precision}


heading = render.section_heading


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows (:func:`benchmarks.harness.render.by_section`)."""
  return render.by_section(DRAW, rows, section)
