"""A benchmark's step compiled for a TPU chip or slice on this machine (``support.tpu``), and the
figures every TPU section records of it.

Per chip: the compiled temp, arguments and outputs (XLA's buffer assignment for the chip's HBM:
exact), and the step time ESTIMATED from XLA's cost analysis of the compiled program against the
chip's published bf16 and HBM peaks (:mod:`support.roofline`). A program the chip's
HBM cannot hold is refused by the compiler (``CompileTimeHbmOom``): its figures are then what the
compiler says it needed for its temporaries, ``over_hbm`` set, and no estimate.

`cache` (a JSON file) keeps each program's figures by a hash of its lowered text and target, so
that a rerun, or a search over sizes that meets a size again, compiles nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from collections.abc import Callable, Sequence

import jax

from support import roofline, tpu

TPU_CHIPS = ("v5p", "v6e")  # the chips a TPU section compiles for unless told
_OVER = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def chips(text: str) -> list[str]:
  """The chips of a ``--chip`` option (comma-separated, one of :data:`support.tpu.CHIPS`)."""
  names = [c for c in text.split(",") if c]
  if unknown := [c for c in names if c not in tpu.CHIPS]:
    raise ValueError(f"--chip {unknown} is not known; choose from {', '.join(tpu.CHIPS)}")
  return names


def available(target: str = "v5p") -> str | None:
  """Why this machine cannot compile for a TPU (None: it can); call before jax's backends start."""
  try:
    tpu.topology(target)
  except tpu.TpuUnavailable as e:
    return str(e)
  return None


def _over_hbm(error: Exception) -> int | None:
  """The temp the compiler said it needed, when `error` is its refusal of a program too large."""
  found = _OVER.search(str(error))
  if "CompileTimeHbmOom" not in str(error) or found is None:
    return None
  return round(float(found[1]) * _UNIT[found[2]])


def figures(
  fn: Callable,
  shapes: Sequence[jax.ShapeDtypeStruct],
  target: str,
  *,
  in_specs=None,
  mesh_axes: dict[str, int] | None = None,
  cache: pathlib.Path | None = None,
) -> dict:
  """``jax.jit(fn)`` compiled for `target` (``support.tpu.compile_for_tpu``'s arguments): per
  chip ``temp_bytes``, ``total_bytes`` (temp, arguments and outputs, less what aliases),
  ``flops``, ``bytes`` and ``estimate_s`` (the roofline at the chip's peaks: an ESTIMATE), and
  ``over_hbm``."""
  lowered = tpu.lower_for_tpu(fn, shapes, target, in_specs=in_specs, mesh_axes=mesh_axes)
  key = hashlib.sha256(f"{target}\n{lowered.as_text()}".encode()).hexdigest()
  known = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
  if key in known:
    return known[key]
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    needed = _over_hbm(e)
    if needed is None:
      raise
    found = {"temp_bytes": needed, "total_bytes": None, "over_hbm": True}
  else:
    m = compiled.memory_analysis()
    cost = roofline.cost(compiled.as_text(), jax.devices("cpu")[0].client)
    found = {
      "temp_bytes": m.temp_size_in_bytes,
      "total_bytes": m.temp_size_in_bytes
      + m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes,
      "over_hbm": False,
      "flops": cost.flops,
      "bytes": cost.bytes,
      "estimate_s": roofline.seconds(cost.flops, cost.bytes, tpu.chip(target).rates),
      "kernels": list(cost.kernels),  # custom calls whose flops the count leaves out
      "unknown_loops": cost.unknown_loops,  # loops counted once: the estimate a lower bound
    }
  if cache is not None:  # reread: another section of the same run may have added to it
    known = json.loads(cache.read_text()) if cache.exists() else {}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({**known, key: found}, indent=0))
  return found
