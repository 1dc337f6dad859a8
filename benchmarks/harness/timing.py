"""Alternated timing: every ratio the suite reports comes from runs interleaved in one process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def _rounds(
  calls: Sequence[Callable[[], Any]], runs: int, warmup: bool = True
) -> list[list[float]]:
  """Seconds of each call in each of `runs` rounds (rows: rounds), after one warm-up call each
  (`warmup`; a compiled program's first call of a second or more costs what the others do)."""
  if warmup:
    for call in calls:
      jax.block_until_ready(call())
  rounds = []
  for r in range(runs):
    row = [0.0] * len(calls)
    for j in range(len(calls)):
      i = (r + j) % len(calls)
      start = time.perf_counter()
      jax.block_until_ready(calls[i]())
      row[i] = time.perf_counter() - start
    rounds.append(row)
  return rounds


def alternated_ratios(calls: Sequence[Callable[[], Any]], runs: int) -> tuple[float, list[float]]:
  """``(median seconds of calls[0], [median over rounds of t_i / t_0 for every later call])``.

  Ratios taken within a round, then their median: a shared machine's load shifts from round to
  round, and a round's calls see nearly the same load, so the paired ratio varies less than the
  ratio of two medians.
  """
  seconds, by_round = alternated_round_ratios(calls, runs)
  return seconds, [statistics.median(ratios) for ratios in by_round]


def alternated_round_ratios(
  calls: Sequence[Callable[[], Any]], runs: int, warmup: bool = True
) -> tuple[float, list[list[float]]]:
  """``(median seconds of calls[0], [[t_i / t_0 in each round] for every later call])``: what
  :func:`alternated_ratios` takes the median of, for a caller that also shows their spread.
  `warmup=False` times the first calls too (compiled programs of long steps: ``--quick``)."""
  rounds = _rounds(calls, runs, warmup)
  ratios = [[row[i] / row[0] for row in rounds] for i in range(1, len(calls))]
  return statistics.median(row[0] for row in rounds), ratios


def with_ratios(values: dict, by_round: list[list[float]]) -> dict:
  """``{key: (value, median ratio, rounds' ratios)}`` for keys in the order the calls were timed:
  the first is the reference (ratio 1 in every round), each later key takes its row of
  `by_round` (:func:`alternated_round_ratios`)."""
  runs = len(by_round[0]) if by_round else 1
  rows = [[1.0] * runs, *by_round]
  return {
    k: (v, statistics.median(row), tuple(row))
    for (k, v), row in zip(values.items(), rows, strict=True)
  }


def frontier_points(
  values: dict, calls: Sequence[Callable[[], Any]], runs: int, warmup: bool = True
) -> tuple[float, dict]:
  """``(seconds of calls[0], {key: (value, median ratio, rounds' ratios)})``: a frontier's points,
  `values` (a memory figure each, keyed in the calls' order) with their calls timed alternated
  (:func:`alternated_round_ratios`, :func:`with_ratios`)."""
  seconds, by_round = alternated_round_ratios(calls, runs, warmup)
  return seconds, with_ratios(values, by_round)


def alternated_medians(calls: Sequence[Callable[[], Any]], runs: int) -> list[float]:
  """Median seconds of each of `calls` over `runs` rounds in which every call runs once.

  Each call is run once first (compilation, warm-up). Within a round the calls run in turn, and the
  one that starts a round rotates, so that drift in the machine's load (other processes on a
  shared host, thermal state) falls on all of them alike.
  """
  rounds = _rounds(calls, runs)
  return [statistics.median(row[i] for row in rounds) for i in range(len(calls))]
