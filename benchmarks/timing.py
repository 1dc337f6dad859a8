"""Alternated timing: every ratio the suite reports comes from runs interleaved in one process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def alternated_medians(calls: Sequence[Callable[[], Any]], runs: int) -> list[float]:
  """Median seconds of each of `calls` over `runs` rounds in which every call runs once.

  Each call is run once first (compilation, warm-up). Within a round the calls run in turn, and the
  one that starts a round rotates, so that drift in the machine's load (other processes on a
  shared host, thermal state) falls on all of them alike.
  """
  for call in calls:
    jax.block_until_ready(call())
  times: list[list[float]] = [[] for _ in calls]
  for r in range(runs):
    for j in range(len(calls)):
      i = (r + j) % len(calls)
      start = time.perf_counter()
      jax.block_until_ready(calls[i]())
      times[i].append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]
