"""The memory-time frontier of one model: every way to train it a user could pick, and the best.

A point is one way to train the model (Flax; Flax + a remat policy; jaxact; jaxact with few-bit
codes or a remat policy) with the compiled temp memory of its training step and its step time
relative to Flax's, both measured on the same compiled program. A point is on the Pareto front
when no other point beats it: as small and as fast, and strictly better in one of the two.

The two numbers a reader wants of a model: at Flax + remat's memory or less, jaxact's best step
time; at Flax's step time or less, jaxact's least memory. Pure Python (no JAX), so that a test
loads this file alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

FLAX, JAXACT = "flax", "jaxact"
# Every point a model may have, by key: Flax, or jaxact, alone or under one remat policy applied to
# each layer or block (nothing saved; the matmul outputs saved; named arrays saved), or with
# few-bit derivative codes; the decoder's jaxact runs jaxact's attention, and jax.nn's in the
# `jaxact_nn_attn` points.
LABELS = {
  "flax": "Flax",
  "remat": "Flax + remat",
  "dots": "Flax + remat(dots)",
  "names": "Flax + remat(names)",
  "jaxact": "jaxact",
  "jaxact_remat": "jaxact + remat",
  "jaxact_dots": "jaxact + remat(dots)",
  "jaxact_names": "jaxact + remat(names)",
  "jaxact_gated_names": "jaxact + remat(a, b)",
  "jaxact_input": "jaxact, MLP keeps x",
  "jaxact_cna": "jaxact ConvNormAct",
  "jaxact_nn_attn": "jaxact, jax.nn attn",
  "jaxact_nn_attn_remat": "jaxact, jax.nn attn + remat",
  "jaxact_8": "jaxact 8 bits",
  "jaxact_4": "jaxact 4 bits",
  "jaxact_2": "jaxact 2 bits",
}


@dataclasses.dataclass(frozen=True)
class Point:
  key: str  # the variant measured ("flax", "remat", "jaxact_4", ...)
  label: str  # what the picture and the tables call it
  library: str  # FLAX or JAXACT
  memory: float  # compiled temp of the step, in the model's unit
  time: float  # step time relative to Flax's (the median over rounds)
  spread: tuple[float, float] | None = None  # the least and the most of the rounds' ratios


def point(key: str, memory: float, time: float, spread: tuple[float, float] | None = None) -> Point:
  """The point of :data:`LABELS` named `key`."""
  if key not in LABELS:
    raise ValueError(f"`key` {key!r} is not known; choose one of: {', '.join(LABELS)}")
  return Point(key, LABELS[key], JAXACT if key.startswith(JAXACT) else FLAX, memory, time, spread)


def beats(a: Point, b: Point) -> bool:
  """Whether `a` is as small and as fast as `b` and strictly better in one of the two."""
  return a.memory <= b.memory and a.time <= b.time and (a.memory < b.memory or a.time < b.time)


def front(points: Sequence[Point]) -> list[Point]:
  """The points no other point beats, from the least memory to the most."""
  return sorted(
    (p for p in points if not any(beats(q, p) for q in points)), key=lambda p: (p.memory, p.time)
  )


def level_with(p: Point, points: Sequence[Point]) -> Point | None:
  """The smallest jaxact point that a Flax point `p` of the front cannot be told from in time: as
  small as `p` or smaller, its rounds' ratios overlapping `p`'s (without rounds: the same time).
  Such a `p` is on the front by a difference the rounds do not resolve."""

  def overlaps(q: Point) -> bool:
    if p.spread is None or q.spread is None:
      return q.time == p.time
    return q.spread[0] <= p.spread[1] and p.spread[0] <= q.spread[1]

  level = [q for q in points if q.library == JAXACT and q.memory <= p.memory and overlaps(q)]
  return min(level, key=lambda q: (q.memory, q.time), default=None)


def with_level(p: Point, points: Sequence[Point], text: str) -> str:
  """`text` (a Flax point of the front) and the jaxact point level with it, if one is."""
  q = level_with(p, points)
  return text if q is None else f"{text} (level with {q.label})"


@dataclasses.dataclass(frozen=True)
class Verdict:
  flax: Point
  remat: Point  # Flax's least-memory remat point
  fastest: Point | None  # jaxact's fastest point at `remat`'s memory or less
  smallest: Point | None  # jaxact's least-memory point at `flax`'s step time or less
  flax_front: tuple[Point, ...]  # Flax's points on the front: no jaxact point beats them
  points: tuple[Point, ...] = ()  # every point of the model


def verdict(points: Sequence[Point], flax_key: str = "flax") -> Verdict:
  """The two numbers of a model's points; `flax_key` names the plain Flax point."""
  flax = [p for p in points if p.key == flax_key]
  if len(flax) != 1:
    raise ValueError(f"`points` must hold one point with key {flax_key!r}; got {len(flax)}")
  flax = flax[0]
  remats = [p for p in points if p.library == FLAX and p is not flax]
  if not remats:
    raise ValueError("`points` holds no Flax point under remat to compare jaxact's memory with")
  remat = min(remats, key=lambda p: (p.memory, p.time))
  ours = [p for p in points if p.library == JAXACT]
  fastest = min(
    (p for p in ours if p.memory <= remat.memory), key=lambda p: (p.time, p.memory), default=None
  )
  smallest = min(
    (p for p in ours if p.time <= flax.time), key=lambda p: (p.memory, p.time), default=None
  )
  flax_front = tuple(p for p in front(points) if p.library == FLAX)
  return Verdict(flax, remat, fastest, smallest, flax_front, tuple(points))


# ----------------------------------------------------------------------------------- rendering


def fmt_memory(value: float, unit: str) -> str:
  """`value` in `unit` ("buffers" or "MiB"), as the tables print it."""
  if unit == "buffers":
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"
  return f"{value:.0f}"


def fmt_time(value: float) -> str:
  return f"{value:.2f}x"


def _mem(p: Point, unit: str, named: bool = True) -> str:
  return fmt_memory(p.memory, unit) + (f" {unit}" if named else "")


def cells(v: Verdict, unit: str) -> tuple[str, str, str]:
  """The summary's three cells of a model (memory in `unit`, which the table names): jaxact's best
  step time at Flax + remat's memory or less, jaxact's least memory at Flax's step time or less,
  and the Flax points on the front."""
  fastest, smallest = "none", "none"
  if v.fastest is not None:
    fastest = f"**{fmt_time(v.fastest.time)}**: {v.fastest.label}, {_mem(v.fastest, unit, False)}"
  if v.smallest is not None:
    smallest = (
      f"**{_mem(v.smallest, unit, False)}**: {v.smallest.label}, {fmt_time(v.smallest.time)}"
    )
  on_front = "; ".join(
    with_level(p, v.points, f"{p.label} ({_mem(p, unit, False)}, {fmt_time(p.time)})")
    for p in v.flax_front
  )
  return fastest, smallest, on_front or "none"


def sentence(v: Verdict, unit: str) -> str:
  """The two numbers of a model in prose, and the Flax points no jaxact point beats."""
  out = f"At {v.remat.label}'s temp ({_mem(v.remat, unit)}) or less, jaxact's best step time: "
  if v.fastest is None:
    out += "none."
  else:
    out += (
      f"{fmt_time(v.fastest.time)} Flax's ({v.fastest.label}, {_mem(v.fastest, unit)}; "
      f"{v.remat.label} {fmt_time(v.remat.time)})."
    )
  out += " At Flax's step time or less, jaxact's least temp: "
  if v.smallest is None:
    out += "none."
  else:
    out += (
      f"{_mem(v.smallest, unit)} ({v.smallest.label}, {fmt_time(v.smallest.time)}; "
      f"Flax {_mem(v.flax, unit)})."
    )
  if v.flax_front:
    names = ", ".join(
      with_level(p, v.points, f"{p.label} ({_mem(p, unit)}, {fmt_time(p.time)})")
      for p in v.flax_front
    )
    out += f" On the front and beaten by no jaxact point: {names}."
  return out


def table(points: Sequence[Point], unit: str) -> list[str]:
  """A model's points as a markdown table, the front marked."""
  on_front = {p.key for p in front(points)}
  lines = [
    f"| point | temp ({unit}) | step time / Flax | rounds' least-most | on the front |",
    "|---|---:|---:|---:|---|",
  ]
  for p in sorted(points, key=lambda p: (p.library != FLAX, p.memory, p.time)):
    mark = "yes" if p.key in on_front else ""
    spread = "—" if p.spread is None else f"{p.spread[0]:.2f}-{p.spread[1]:.2f}"
    lines.append(f"| {p.label} | {fmt_memory(p.memory, unit)} | {p.time:.2f} | {spread} | {mark} |")
  return lines
