"""The cnn job's tables from its rows (sections ``resnet``, ``resnet-h100``, ``unet``,
``unet-h100``, ``unet-stem-h100``, ``fit-h100``, ``time``, ``resnet-tpu``, ``unet-tpu``)."""

from __future__ import annotations

from benchmarks.harness import render
from benchmarks.tables import tpu

# The TPU sections are drawn in blocks of their own (results/tpu-families.md; benchmarks.render)
SEPARATE_SECTIONS = ("resnet-tpu", "unet-tpu")

MiB, GiB = 2**20, 2**30
SECTIONS = (
  "resnet",
  "resnet-h100",
  "unet",
  "unet-h100",
  "unet-stem-h100",
  "unet-scan",
  "unet-scan-h100",
  "fit-h100",
  "time",
  "resnet-tpu",
  "unet-tpu",
)
WAYS = {
  "flax": "Flax (conv, norm, activation)",
  "flax-remat": "Flax + nn.remat a block",
  "flax-dots": "Flax + nn.remat a block, dots_saveable",
  "jaxact-bn": "jaxact.linen.BatchNorm(activation='relu')",
  "jaxact-gn": "jaxact.linen.GroupNorm(activation='silu')",
  "jaxact-cna": "jaxact.linen.ConvNormAct",
  "jaxact-bn-remat": "BatchNorm(activation='relu') + nn.remat a block",
  "jaxact-bn-dots": "BatchNorm(activation='relu') + nn.remat a block, dots_saveable",
  "jaxact-gn-remat": "GroupNorm(activation='silu') + nn.remat a block",
  "jaxact-gn-dots": "GroupNorm(activation='silu') + nn.remat a block, dots_saveable",
  "jaxact-nac": "jaxact.linen.NormActConv",
  "jaxact-nac-remat": "NormActConv + nn.remat a block",
}

MEMORY = render.Table(
  ("way", "temp MiB", "/ Flax's"),
  lambda f: [f["way"], f"{f['temp_bytes'] / MiB:.1f}", f"{f['vs_flax']:.3f}"],
)
FIT = render.Table(
  ("model", "way", "largest batch", "/ Flax's", "temp + arguments + outputs GiB"),
  lambda f: [
    f["model"],
    f["way"],
    str(f["batch"]),
    f"{f['vs_flax']:.2f}",
    f"{f['total_bytes'] / GiB:.1f}",
  ],
)
TIME = render.Table(
  ("model", "way", "time / Flax's"), lambda f: [f["model"], f["way"], f"{f['ratio']:.3f}"]
)


def _what(f: dict) -> str:
  if f["model"] == "resnet":
    return f"ResNet-50 (Flax's ImageNet example), images {tuple(f['shape'])}"
  unet = f"{f['blocks']} U-Net residual blocks (GroupNorm(32), SiLU, 3x3 conv, twice)"
  if f["model"] == "unet-stem":
    unet = f"a 1x1 conv, then {unet}"
  if f["model"] == "unet-scan":
    unet = f"{unet} under nn.scan"
  return f"{unet}, x {tuple(f['shape'])}"


def memory(these: list[dict], section: str) -> list[str]:
  f = these[0]["figures"]
  where = "compiled for an H100" if section.endswith("-h100") else "CPU"
  return [
    f"{_what(f)}, {f['dtype']}, {where}: compiled temp of one training step's "
    "`jit(value_and_grad)`.",
    "",
    *MEMORY.lines(these),
  ]


def fit(these: list[dict], section: str) -> list[str]:
  f = these[0]["figures"]
  sizes = "; ".join(
    dict.fromkeys(f"{r['figures']['model']} x {tuple(r['figures']['shape'])}" for r in these)
  )
  return [
    f"The largest batch (a multiple of 8) whose training step, {f['dtype']} ({sizes}), "
    f"compiled for an H100 fits {f['capacity_bytes'] / GiB:.1f} GiB less a reserve of "
    f"{f['reserve_bytes'] / GiB:.0f} GiB: compiled temp, arguments and outputs.",
    "",
    *FIT.lines(these),
  ]


def time(these: list[dict], section: str) -> list[str]:
  shapes = "; ".join(
    dict.fromkeys(f"{r['figures']['model']} {tuple(r['figures']['shape'])}" for r in these)
  )
  f = these[0]["figures"]
  return [
    f"CPU step time, float32 ({shapes}), median over {f['runs']} alternated rounds of each way's "
    "time over Flax's in the same round.",
    "",
    *TIME.lines(these),
  ]


MEMORY_TPU = render.Table(
  (*MEMORY.header, "step ms, ESTIMATE"), lambda f: [*MEMORY.cells(f), tpu.estimate_ms(f)]
)


def memory_tpu(these: list[dict], section: str) -> list[str]:
  f = these[0]["figures"]
  return [
    f"{_what(f)}, {f['dtype']}: compiled temp of one training step's `jit(value_and_grad)`.",
    "",
    *tpu.per_chip(these, MEMORY_TPU.lines),
  ]


DRAW = {s: memory for s in SECTIONS if s not in ("time", "fit-h100")}
DRAW |= {"time": time, "fit-h100": fit, "resnet-tpu": memory_tpu, "unet-tpu": memory_tpu}


heading = render.section_heading


def tables(rows: list[dict], section: str | None = None) -> list[str]:
  """What the job prints from its rows (:func:`benchmarks.harness.render.by_section`)."""
  return render.by_section(DRAW, rows, section)
