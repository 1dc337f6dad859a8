"""Compiled memory: XLA's buffer assignment of a training step on this machine or compiled for a
GPU (``support.compile_for``) or a TPU chip (:mod:`benchmarks.harness.chips`) on it, and the
largest size whose step fits a GPU."""

from __future__ import annotations

import re
from collections.abc import Callable

import jax

import support
from benchmarks.harness import chips


def cpu_memory(loss, params, x) -> int:
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _step(loss):
  def step(x, *params):
    return jax.value_and_grad(loss)(params, x)

  return step


def gpu_memory(loss, params, x, device_kind=support.H100, **compile_kw) -> tuple[int, int]:
  """(temp, temp + arguments + outputs) of ``jit(value_and_grad(loss))`` compiled for the GPU
  (`compile_kw`: :func:`support.compile_for`'s options)."""
  m = support.compile_for(_step(loss), [x, *params], device_kind, **compile_kw).memory_analysis()
  return m.temp_size_in_bytes, footprint(m)


def tpu_memory(loss, params, x, chip: str, cache=None) -> dict:
  """:func:`benchmarks.harness.chips.figures` of :func:`gpu_memory`'s step compiled for TPU
  `chip` instead: temp, footprint, the ESTIMATED step time."""
  return chips.figures(_step(loss), [x, *params], chip, cache=cache)


def footprint(m) -> int:
  """A compiled program's memory (its ``memory_analysis()``): temp, arguments and outputs, less
  the outputs that alias (are donated) arguments."""
  total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
  return total - m.alias_size_in_bytes


def largest_fit_of(
  total: Callable[[int], int], capacity: int, step=1024, start=(8192, 16384)
) -> tuple[int, int]:
  """``(tokens, bytes)``: the largest multiple of `step` tokens whose ``total(tokens)`` (a step's
  temp, arguments and outputs) fits `capacity` bytes: secant steps from compiles at the two
  `start` sizes, then bisection between the largest size that fits and the next that does not,
  every candidate compiled (near the limit XLA's rematerialization makes memory non-linear, and
  flat: a walk of `step` at a time can take a hundred compiles)."""
  known = {t: total(t) for t in start}
  for _ in range(4):  # secant through the two candidates nearest the limit
    (t0, m0), (t1, m1) = sorted(known.items(), key=lambda tm: abs(tm[1] - capacity))[:2]
    if m1 == m0:
      break
    guess = int((t0 + (capacity - m0) * (t1 - t0) / (m1 - m0)) // step * step)
    if guess in known or guess <= 0:
      break
    known[guess] = total(guess)

  def at(t):
    if t not in known:
      known[t] = total(t)
    return known[t]

  fits = [t for t, m in known.items() if m <= capacity]
  if fits:  # bisect above the largest that fits, after doubling strides to a size that does not
    tokens, stride = max(fits), step
    over = min((t for t in known if t > tokens), default=None)
    while over is None:
      if at(tokens + stride) > capacity:
        over = tokens + stride
      else:
        tokens, stride = tokens + stride, 2 * stride
    while over - tokens > step:
      mid = (tokens + over) // 2 // step * step
      tokens, over = (mid, over) if at(mid) <= capacity else (tokens, mid)
  else:  # walk down from the smallest tried
    tokens = min(known) - step
    while tokens > step and at(tokens) > capacity:
      tokens -= step
  return tokens, at(tokens)


def capacity(device_kind=support.H100) -> int:
  """The GPU's memory in bytes, from XLA's target config for it."""
  found = re.search(r"device_memory_size:\s*(\d+)", support.target_config(device_kind))
  return int(found.group(1))
