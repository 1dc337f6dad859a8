"""Gated MLP stack: `jaxact.gated_mlp` against Flax, Flax + remat and tokamax; memory and time.

Run with ``JAX_PLATFORMS=cpu python -m benchmarks gated [--sections S,...]``. The model
is a stack of residual gated-MLP blocks, ``x = x + mlp(rms_norm(x))`` with the plain-jnp RMS norm
``x * rsqrt(mean(x^2) + eps)`` (no scale, the same in every peer, evaluated once a block in float32)
and a silu gate, built both unrolled under ``jit`` and as ``jax.lax.scan`` over stacked block
parameters. Peers, all with the same weights:

* ``flax``: three ``nn.Dense(use_bias=False)`` (gate, up, down) and ``jax.nn.silu``;
* ``remat``: the same block under ``jax.checkpoint(policy=nothing_saveable)``: it keeps only its
  input and recomputes the rest in the backward pass;
* ``jaxact``: ``jaxact.gated_mlp(h, w_gate, w_up, w_down)``;
* ``tokamax``: ``tokamax.gated_linear_unit(h, (w_gate, w_up), activation=jax.nn.silu)``, then
  the down ``nn.Dense`` (only where tokamax imports; it needs its own venv, see
  benchmarks/results/gated.md).

Sections (loss: mean square of the output; gradients with respect to the parameters):

* ``cpu``: float32, 4096 tokens, D = 512, F = 1408: compiled temp of ``jit(value_and_grad)`` for
  1, 2 and 8 blocks, growth per block, and the activation-sized arrays ``jax.vjp``'s pullback keeps
  (``python -m benchmarks`` measures this section too);
* ``h100``: the same compiled for an H100 on this machine (``support.compile_for``),
  bfloat16, 8192 tokens, D = 4096, F = 11008, and the largest token count that fits the H100
  (found by compiling: :func:`largest_fit`);
* ``tpu``: the ``h100`` section's scanned stacks compiled for TPU chips on this machine
  (``support.tpu``; ``--chip``, v5p and v6e unless told): the compiled temp a chip (exact), and the
  8-block step's time ESTIMATED from XLA's cost analysis against the chip's published peaks;
* ``time``: CPU step time of ``jit(value_and_grad)``, wall and process CPU time, minimum over
  interleaved repeats;
* ``layers``: the 8-layer MLP and 6-layer CNN of :mod:`benchmarks.fused` (``dense_bias_act``
  / ``conv_bias_act`` as ``jaxact.linen`` layers against ``nn.Dense`` / ``nn.Conv`` + jax.nn),
  unrolled and scanned, on CPU (``layers``) and compiled for an H100 (``layers-h100``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxact
import jaxact.linen
import support
from benchmarks import fused_scanned
from benchmarks.harness import chips, rows, timing
from benchmarks.harness.blocks import stack
from benchmarks.harness.memory import capacity, cpu_memory, gpu_memory, largest_fit_of, tpu_memory
from benchmarks.tables import gated as page

try:
  import tokamax
except ImportError:  # not in jaxact's venv: it would change its packages (results/gated.md)
  tokamax = None

EPS = 1e-6
BLOCKS = page.BLOCKS
CPU_SIZE = (4096, 512, 1408)  # tokens, D, F
GPU_SIZE = (8192, 4096, 11008)
MiB = 2**20

# ----------------------------------------------------------------------------- the blocks


def rms_norm(x):
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS)).astype(x.dtype)


# The names a Flax user gives the gate and up projections (jax.ad_checkpoint.checkpoint_name) to
# save them under remat, as jaxact.GATED_CHECKPOINT_NAMES name gated_mlp's a and b.
FLAX_CHECKPOINT_NAMES = ("flax.gate", "flax.up")


class FlaxGatedMLP(nn.Module):
  """The Llama MLP as a Flax user writes it; `named` names the two projections
  (:data:`FLAX_CHECKPOINT_NAMES`), which changes nothing outside a remat policy that saves them."""

  hidden: int
  features: int
  named: bool = False

  @nn.compact
  def __call__(self, x):
    gate = nn.Dense(self.hidden, use_bias=False, name="gate")(x)
    up = nn.Dense(self.hidden, use_bias=False, name="up")(x)
    if self.named:
      gate = checkpoint_name(gate, FLAX_CHECKPOINT_NAMES[0])
      up = checkpoint_name(up, FLAX_CHECKPOINT_NAMES[1])
    return nn.Dense(self.features, use_bias=False, name="down")(jax.nn.silu(gate) * up)


def _flax_mlp(h, w_gate, w_up, w_down, named=False):
  params = {"gate": {"kernel": w_gate}, "up": {"kernel": w_up}, "down": {"kernel": w_down}}
  return FlaxGatedMLP(w_gate.shape[1], w_down.shape[1], named).apply({"params": params}, h)


def _jaxact_mlp(h, w_gate, w_up, w_down, residuals="projections"):
  return jaxact.gated_mlp(h, w_gate, w_up, w_down, residuals=residuals)


def _tokamax_mlp(h, w_gate, w_up, w_down, implementation=None):
  hid = tokamax.gated_linear_unit(
    h, (w_gate, w_up), activation=jax.nn.silu, implementation=implementation
  )
  dense = nn.Dense(w_down.shape[1], use_bias=False)
  return dense.apply({"params": {"kernel": w_down}}, hid)


def _block(mlp):
  def block(x, p):
    return x + mlp(rms_norm(x), *p)

  return block


def peers(tokamax_implementation=None) -> dict[str, Callable]:
  """label: ``block(x, (w_gate, w_up, w_down)) -> x``."""
  out = {
    "flax": _block(_flax_mlp),
    "remat": jax.checkpoint(_block(_flax_mlp), policy=jax.checkpoint_policies.nothing_saveable),
    "jaxact": _block(_jaxact_mlp),
    # The block under remat that saves gated_mlp's a and b by name: the norm is recomputed.
    "jaxact_saved": jax.checkpoint(
      _block(_jaxact_mlp),
      policy=jax.checkpoint_policies.save_only_these_names(*jaxact.GATED_CHECKPOINT_NAMES),
    ),
    # The op keeping its input alone: a and b recomputed inside its backward pass.
    "jaxact_input": _block(functools.partial(_jaxact_mlp, residuals="input")),
  }
  if tokamax is not None:
    mlp = functools.partial(_tokamax_mlp, implementation=tokamax_implementation)
    out["tokamax"] = _block(mlp)
  return out


LABELS = page.LABELS
# The frontier's points (harness.frontier's keys) and the peer each is: every block under one
# remat policy, or none.
FRONTIER = {
  "flax": "flax",
  "remat": "remat",
  "dots": "flax_dots",
  "names": "flax_names",
  "jaxact": "jaxact",
  "jaxact_remat": "jaxact_remat",
  "jaxact_dots": "jaxact_dots",
  "jaxact_names": "jaxact_saved",
  "jaxact_input": "jaxact_input",
}


def frontier_peers() -> dict[str, Callable]:
  """point: block, for every point of :data:`FRONTIER`."""
  saveable = jax.checkpoint_policies
  extra = {
    "flax_dots": jax.checkpoint(_block(_flax_mlp), policy=saveable.dots_saveable),
    "flax_names": jax.checkpoint(
      _block(functools.partial(_flax_mlp, named=True)),
      policy=saveable.save_only_these_names(*FLAX_CHECKPOINT_NAMES),
    ),
    "jaxact_remat": jax.checkpoint(_block(_jaxact_mlp), policy=saveable.nothing_saveable),
    "jaxact_dots": jax.checkpoint(_block(_jaxact_mlp), policy=saveable.dots_saveable),
  }
  both = {**peers(), **extra}
  return {key: both[peer] for key, peer in FRONTIER.items()}


def shapes(blocks, size, dtype):
  t, d, f = size
  params = tuple(jax.ShapeDtypeStruct((blocks, *s), dtype) for s in ((d, f), (d, f), (f, d)))
  return params, jax.ShapeDtypeStruct((t, d), dtype)


def make(blocks, size, dtype, key=0):
  t, d, f = size
  k = jax.random.split(jax.random.key(key), 4)
  params = tuple(
    (jax.random.normal(kk, (blocks, *s), jnp.float32) / s[0] ** 0.5).astype(dtype)
    for kk, s in zip(k[:3], ((d, f), (d, f), (f, d)), strict=True)
  )
  return params, jax.random.normal(k[3], (t, d), jnp.float32).astype(dtype)


# ----------------------------------------------------------------------------- measuring


def kept(forward, params, x, size) -> str:
  """The activation-sized arrays ``jax.vjp``'s pullback keeps per block, by shape."""
  t, d, f = size
  blocks = params[0].shape[0]
  _, pullback = jax.vjp(lambda p: forward(p, x), params)
  excluded = {id(a) for a in (x, *params)}
  arrays = {id(a): a for a in jax.tree.leaves(pullback) if hasattr(a, "shape")}
  counts = {"(T,D)": 0, "(T,F)": 0}
  for i, a in arrays.items():
    if i in excluded:
      continue
    shape = a.shape[1:] if a.ndim == 3 and a.shape[0] == blocks else a.shape
    n = blocks if a.ndim == 3 and a.shape[0] == blocks else 1
    for label, s in (("(T,D)", (t, d)), ("(T,F)", (t, f))):
      if shape == s:
        counts[label] += n
  per = {k: v / blocks for k, v in counts.items()}
  mib = (per["(T,D)"] * t * d + per["(T,F)"] * t * f) * x.dtype.itemsize / MiB
  return f"{per['(T,D)']:g} (T,D) + {per['(T,F)']:g} (T,F) = {mib:.1f} MiB"


@dataclasses.dataclass
class MemoryRow:
  peer: str
  layout: str  # "scan" or "unrolled"
  temp1: float  # MiB, one block
  temp2: float  # MiB, two blocks
  temp8: float  # MiB, BLOCKS blocks
  kept: str = ""
  total8: float | None = None  # bytes with arguments and outputs (GPU)
  fit: str = ""

  @property
  def growth(self) -> float:
    return (self.temp8 - self.temp1) / (BLOCKS - 1)

  @property
  def growth2(self) -> float:
    """Without the first block: XLA turns a scan of length 1 into straight-line code."""
    return (self.temp8 - self.temp2) / (BLOCKS - 2)


def section_cpu(with_kept: bool = True) -> list[MemoryRow]:
  rows = []
  for scan in (True, False):
    for label, block in peers().items():
      forward, loss = stack(block, scan)
      temps = [cpu_memory(loss, *shapes(n, CPU_SIZE, jnp.float32)) / MiB for n in (1, 2, BLOCKS)]
      row = MemoryRow(label, "scan" if scan else "unrolled", *temps)
      if with_kept:
        row.kept = kept(forward, *make(BLOCKS, CPU_SIZE, jnp.float32), CPU_SIZE)
      rows.append(row)
  return rows


def _gpu_total(loss, tokens, size) -> int:
  params, x = shapes(BLOCKS, (tokens, *size[1:]), jnp.bfloat16)
  return gpu_memory(loss, params, x)[1]


def largest_fit(loss, capacity: int, size=GPU_SIZE, step=1024) -> tuple[int, int]:
  """The largest multiple of `step` tokens whose stack step fits `capacity` bytes
  (:func:`largest_fit_of`)."""
  return largest_fit_of(lambda t: _gpu_total(loss, t, size), capacity, step)


@dataclasses.dataclass
class TpuRow(MemoryRow):
  """A row compiled for a TPU chip: the L=BLOCKS step's figures (``harness.chips.figures``)."""

  chip: str = ""
  estimate_s: float | None = None  # an ESTIMATE (roofline at the chip's peaks)
  unknown_loops: int = 0  # loops counted once: the estimate a lower bound
  over_hbm: bool = False


def _stack_memory(loss, blocks: int, chip: str | None, cache=None) -> dict:
  """The stack's step at `blocks` blocks compiled for an H100 or a TPU `chip`: its figures."""
  params, x = shapes(blocks, GPU_SIZE, jnp.bfloat16)
  if chip is not None:
    return tpu_memory(loss, params, x, chip, cache)
  temp, total = gpu_memory(loss, params, x)
  return {"temp_bytes": temp, "total_bytes": total}


def section_h100(
  fits: bool = True, tokamax_implementation=None, chip: str | None = None, cache=None
) -> list[MemoryRow]:
  """The stacks compiled for an H100, or with `chip` for that TPU chip (scanned, as a TPU
  user's stack is; no fit; each row's L=BLOCKS step time ESTIMATED)."""
  rows = []
  for scan in (True,) if chip else (True, False):
    for label, block in peers(tokamax_implementation).items():
      _, loss = stack(block, scan)
      out = [_stack_memory(loss, n, chip, cache) for n in (1, 2, BLOCKS)]
      temps = (o["temp_bytes"] / MiB for o in out)
      row = MemoryRow(label, "scan" if scan else "unrolled", *temps, total8=out[-1]["total_bytes"])
      if chip is not None:
        last = out[-1]
        estimate = None if last["over_hbm"] else last["estimate_s"]
        unknown = last.get("unknown_loops", 0)
        row = TpuRow(**dataclasses.asdict(row), chip=chip, estimate_s=estimate)
        row.unknown_loops, row.over_hbm = unknown, any(o["over_hbm"] for o in out)
      if fits and scan and chip is None:
        tokens, total = largest_fit(loss, capacity())
        row.fit = f"{tokens} ({total / 2**30:.1f} GiB)"
      rows.append(row)
  return rows


def step_times(
  size=CPU_SIZE, repeats: int = 5, unrolled: bool = True, block_repeats: int | None = None
) -> dict[tuple[str, str], tuple[float, float]]:
  """(wall, process CPU) seconds of a CPU step, each the minimum over rounds that run every peer
  once (the peer that starts a round rotates): `repeats` rounds for the stacks, `block_repeats`
  (5 x `repeats`) for one block. On a shared machine the CPU time (all of XLA's threads) is the
  steadier figure: other processes' load stretches the wall time, not the work done."""
  programs = [("1 block", 1, False, block_repeats or 5 * repeats)]
  programs.append((f"{BLOCKS} blocks, scan", BLOCKS, True, repeats))
  if unrolled:
    programs.append((f"{BLOCKS} blocks, unrolled", BLOCKS, False, repeats))
  best = {}
  for layout, blocks, scan, rounds in programs:
    params, x = make(blocks, size, jnp.float32)
    calls = {}
    for label, block in peers().items():
      step = jax.jit(jax.value_and_grad(stack(block, scan)[1]))
      calls[label, layout] = functools.partial(step, params, x)
    for call in calls.values():
      jax.block_until_ready(call())
    keys = list(calls)
    for r in range(rounds):
      for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
        start, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(calls[key]())
        now = (time.perf_counter() - start, time.process_time() - cpu)
        best[key] = tuple(map(min, best.get(key, now), now))
  return best


def frontier(
  runs: int,
  timed_blocks: int = 2,
  known: dict[str, float] | None = None,
  warmup: bool = True,
) -> tuple[float, dict[str, tuple]]:
  """``(Flax's step in seconds, {point: (temp in MiB, step time / Flax's, its rounds' ratios)})``
  for every point of :data:`FRONTIER`, float32 at :data:`CPU_SIZE`.

  The temp is the compiled ``jit(value_and_grad)`` of the :data:`BLOCKS`-block scanned stack
  (`known`: those :func:`section_cpu` measured, in MiB, by peer); the step time, alternated runs
  of a `timed_blocks`-block scan of the same blocks (the stack's per-block work, at a fraction of
  its time), the ratios taken within rounds."""
  known = known or {}
  temps, calls = {}, []
  params, x = make(timed_blocks, CPU_SIZE, jnp.float32)
  for key, block in frontier_peers().items():
    _, loss = stack(block, scan=True)
    peer = FRONTIER[key]
    if peer not in known:
      known[peer] = cpu_memory(loss, *shapes(BLOCKS, CPU_SIZE, jnp.float32)) / MiB
    temps[key] = known[peer]
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
    calls.append(functools.partial(compiled, params, x))
  return timing.frontier_points(temps, calls, runs, warmup)


def _memory_rows(section: str, found: list[MemoryRow]) -> list[MemoryRow]:
  """`found` added as rows (:class:`MemoryRow`'s fields, temps in MiB); read back from them."""
  added = [rows.add(section, _case(r), **dataclasses.asdict(r)) for r in found]
  return [type(r)(**a["figures"]) for r, a in zip(found, added, strict=True)]


def _case(r: MemoryRow) -> str:
  return f"{r.chip}, {r.layout}, {r.peer}" if isinstance(r, TpuRow) else f"{r.layout}, {r.peer}"


SECTIONS = ("cpu", "h100", "time", "layers", "layers-h100")  # "tpu" on request: it needs libtpu


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--sections", default=",".join(SECTIONS), help=f"any of {','.join(SECTIONS)},tpu"
  )
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds (section time)")
  parser.add_argument("--tokamax-implementation", default=None, help="e.g. xla (H100 section)")
  parser.add_argument("--chip", default=",".join(chips.TPU_CHIPS), help="TPU chips (section tpu)")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled TPU figures' JSON (tpu)")
  args = parser.parse_args(argv)
  names = args.sections.split(",")
  if any(n.endswith("h100") for n in names):
    try:  # before the first computation starts jax's backends
      support.device(support.H100)
    except support.Unavailable as e:
      print(f"benchmarks.gated: {e}", file=sys.stderr)
      return 2
  if "tpu" in names and (why := chips.available()):
    print(f"benchmarks.gated: {why}", file=sys.stderr)
    return 2
  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, tokamax "
    f"{getattr(tokamax, '__version__', 'not installed')}",
    flush=True,
  )
  for name in names:
    start = time.perf_counter()
    if name == "cpu":
      _memory_rows(name, section_cpu())
    elif name == "h100":
      _memory_rows(name, section_h100(tokamax_implementation=args.tokamax_implementation))
    elif name == "tpu":
      for chip in chips.chips(args.chip):
        _memory_rows(name, section_h100(False, args.tokamax_implementation, chip, args.cache))
    elif name == "time":
      times = step_times(repeats=args.repeats)
      for (peer, program), (wall, cpu) in times.items():  # the rows; the table drawn from them
        rows.add(name, f"{program}, {peer}", peer=peer, program=program, wall_s=wall, cpu_s=cpu)
    elif name in ("layers", "layers-h100"):
      fused_scanned.record_layers(name, fused_scanned.section_layers(name != "layers"))
    else:
      parser.error(f"section {name!r} is not known; choose from {', '.join(SECTIONS)}, tpu")
    lines = page.tables(rows.current().rows, name)
    print(f"\n## {name} ({time.perf_counter() - start:.0f} s)\n", flush=True)
    print("\n".join(lines), flush=True)
  return 0
