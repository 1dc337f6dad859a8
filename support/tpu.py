"""Compiling for a TPU on a machine without one: libtpu's compiler, deviceless.

``libtpu`` (the TPU runtime, about 640 MB, ``jax[tpu]``'s pin of it) holds XLA's TPU compiler, and
``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")`` gives
compile-only devices of any TPU slice. On a CPU machine that gives the program as the TPU would run
it (XLA's TPU fusions and layouts, Pallas TPU kernels compiled by Mosaic TPU) and XLA's buffer
assignment for the chip (``memory_analysis()``: exact), and XLA's cost analysis of the compiled
program (flops, bytes), from which :mod:`support.roofline` ESTIMATES a step's time
against the chip's published peaks. Nothing runs, so nothing is timed.

``tests/install_tpu_compiler.py`` installs libtpu into :data:`TPU_COMPILER`, outside the venv's
site-packages, so that it loads only in processes that ask for it (:func:`use_tpu_compiler`, before
jax's backends start). With ``JAX_PLATFORMS=cpu`` jax never starts a TPU backend: the topology API
alone is used. A user does the same with ``pip install "jax[tpu]"`` and the same jax calls
(docs/tpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# Where tests/install_tpu_compiler.py puts libtpu.
TPU_COMPILER = pathlib.Path(sys.prefix) / "tpu-compiler"


class TpuUnavailable(RuntimeError):
  """This machine cannot compile for a TPU (libtpu is not installed where it is looked for)."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation: its one-chip topology and Google Cloud's published per-chip peaks."""

  name: str
  one_chip: str  # the topology name of one chip
  device_kind: str  # jax's device_kind of its devices
  flops_per_s: float  # dense bfloat16
  bytes_per_s: float  # HBM bandwidth
  hbm_bytes: int

  @property
  def rates(self) -> dict[str, float]:
    """:func:`support.roofline.seconds`'s rates."""
    return {"flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s}


# cloud.google.com/tpu/docs/v5e, /v5p, /v6e: per chip, bf16 peak, HBM bandwidth and capacity.
CHIPS = {
  "v5e": Chip("v5e", "v5e:1x1", "TPU v5 lite", 197e12, 819e9, 16 * 2**30),
  "v5p": Chip("v5p", "v5p:1x1x1", "TPU v5", 459e12, 2765e9, 95 * 2**30),
  "v6e": Chip("v6e", "v6e:1x1", "TPU v6 lite", 918e12, 1640e9, 32 * 2**30),
}


def use_tpu_compiler() -> bool:
  """Put libtpu, when installed in :data:`TPU_COMPILER`, on ``sys.path``, and tell it this is no
  TPU host (it would query the cloud's metadata server and print warnings about hostnames)."""
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # Several processes compile at once (pytest -n, a benchmark beside the tests): libtpu would
  # otherwise take a lockfile meant for one process a TPU host.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if TPU_COMPILER.is_dir() and str(TPU_COMPILER) not in sys.path:
    sys.path.append(str(TPU_COMPILER))
  return TPU_COMPILER.is_dir()


def chip(target: str) -> Chip:
  """The chip of `target`: a generation (``"v5p"``) or a slice (``"v5p:2x2x1"``)."""
  name = target.split(":")[0]
  if name not in CHIPS:
    raise ValueError(f"TPU target {target!r} is not known; choose one of {', '.join(CHIPS)}")
  return CHIPS[name]


def _topology_name(target: str) -> str:
  return target if ":" in target else chip(target).one_chip


@functools.cache
def topology(target: str):
  """The compile-only topology of `target` (one chip of a generation, or a slice)."""
  from jax.experimental import topologies

  chip(target)
  use_tpu_compiler()
  try:
    import libtpu  # noqa: F401
  except ImportError as e:
    raise TpuUnavailable(
      "compiling for a TPU without one needs libtpu: run `python tests/install_tpu_compiler.py` "
      f'(it installs it into {TPU_COMPILER}), or `pip install "jax[tpu]"`'
    ) from e
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=_topology_name(target))
  except (NotImplementedError, RuntimeError) as e:
    raise TpuUnavailable(f"jax cannot build the TPU topology {target!r} here: {e}") from e


def devices(target: str) -> list:
  """`target`'s compile-only devices, one a chip (a v5p chip's two cores act as one device)."""
  return list(topology(target).devices)


def mesh(target: str, axes: dict[str, int] | None = None, explicit: bool = False):
  """A mesh over `target`'s chips: `axes` (name to size, their product the chip count; one axis
  ``"data"`` over every chip when None), Explicit axes with `explicit`, else Auto."""
  devs = devices(target)
  axes = axes or {"data": len(devs)}
  if math.prod(axes.values()) != len(devs):
    raise ValueError(f"mesh axes {axes} do not cover the {len(devs)} chips of {target!r}")
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.sharding.Mesh(
    np.array(devs).reshape(tuple(axes.values())),
    tuple(axes),
    axis_types=(kind,) * len(axes),
  )


def lower_for_tpu(
  fn: Callable[..., Any],
  shapes: Sequence[jax.ShapeDtypeStruct],
  target: str = "v5p",
  *,
  in_specs: Sequence[jax.sharding.PartitionSpec | None] | None = None,
  mesh_axes: dict[str, int] | None = None,
  explicit: bool = False,
):
  """``jax.jit(fn)`` lowered for `target` (:func:`compile_for_tpu`'s arguments)."""
  m = mesh(target, mesh_axes, explicit)
  specs = list(in_specs) if in_specs is not None else [None] * len(shapes)
  if len(specs) != len(shapes):
    raise ValueError(f"{len(specs)} in_specs for {len(shapes)} shapes")
  P, Named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
  args = [
    jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=Named(m, spec or P()))
    for s, spec in zip(shapes, specs, strict=True)
  ]
  with jax.set_mesh(m):
    return jax.jit(fn).lower(*args)


def compile_for_tpu(
  fn: Callable[..., Any],
  shapes: Sequence[jax.ShapeDtypeStruct],
  target: str = "v5p",
  *,
  in_specs: Sequence[jax.sharding.PartitionSpec | None] | None = None,
  mesh_axes: dict[str, int] | None = None,
  explicit: bool = False,
  options: dict[str, Any] | None = None,
):
  """``jax.jit(fn)`` lowered and compiled for `target`.

  One chip (``"v5e"``, ``"v5p"``, ``"v6e"``): every argument on it. A slice (``"v5p:2x2x1"``):
  each argument placed by its entry of `in_specs` (a ``PartitionSpec`` over :func:`mesh`'s axes,
  None replicated), the program run under that mesh (``jax.set_mesh``) as the user's program
  would be. ``memory_analysis()`` of the result is per chip.
  """
  lowered = lower_for_tpu(
    fn, shapes, target, in_specs=in_specs, mesh_axes=mesh_axes, explicit=explicit
  )
  return lowered.compile(compiler_options=dict(options or {}))
