"""`python -m benchmarks moe [--sections memory,memory-h100,time]`.

`jaxact.moe_mlp` against the plain ragged composition (the same routing, `jax.lax.ragged_dot`
gate/up/down, `jax.nn.silu`, the weighted combine, differentiated by JAX: what MaxText and
tokamax users write), in residual blocks ``x + moe(rms_norm(x))`` stacked with `lax.scan`:

* ``memory`` / ``memory-h100``: compiled temp of ``jit(value_and_grad)`` at 2 and 8 blocks and
  the growth a block, CPU float32 and compiled for an H100 (bfloat16), for the plain composition,
  + block remat, + remat saving its gate and up projections by name (MaxText's ``mlpwi_0`` /
  ``mlpwi_1``), jaxact, + block remat, + remat saving jaxact's names; and what one MoE MLP's
  pullback keeps (the arrays beyond its weights), jaxact's against the plain one's;
* ``time``: the CPU step time of each (8 blocks, median of rounds alternated), with its temp: the
  MoE stack's memory-time points. On CPU ``ragged_dot`` is a dense product over every expert, so
  the times say little about a GPU's;
* ``tpu``: the H100 stacks compiled for a TPU v5p chip: the plain composition, jaxact, and the
  plain composition on megablox's grouped matmul kernels; temp exact, step time ESTIMATED
  (:mod:`benchmarks.moe_tpu`; needs libtpu: ``python tests/install_tpu_compiler.py``).

Two configurations: 8 experts top-2 (Mixtral's routing) and 64 experts top-8 (fine-grained, as
Qwen3-MoE and DeepSeek-V3 route).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

import jaxact
import support
from benchmarks import gated
from benchmarks.harness import memory, rows, timing
from benchmarks.tables import moe as page
from jaxact._src.moe.reference import ragged_composition

SECTIONS = ("memory", "memory-h100", "time", "tpu")
BLOCKS = (2, 8)
# MaxText's names of the experts' gate and up projections (its `mlpwi_0`, `mlpwi_1`).
PLAIN_NAMES = ("mlpwi_0", "mlpwi_1")


@dataclasses.dataclass(frozen=True)
class Config:
  tokens: int
  dim: int
  hidden: int  # each expert's
  experts: int
  top_k: int

  def __str__(self) -> str:
    return (
      f"{self.experts} experts top-{self.top_k}, {self.tokens} tokens, D {self.dim}, "
      f"expert hidden {self.hidden}"
    )


CPU = (Config(1024, 256, 512, 8, 2), Config(512, 256, 128, 64, 8))
# XLA's GPU ragged_dot (jax 0.12) is a dense product over an (rows, experts * D) masked operand:
# the 64-expert stack runs 2048 tokens so that operand stays 4 GiB.
H100 = (Config(8192, 2048, 5632, 8, 2), Config(2048, 2048, 768, 64, 8))
# The main job's MoE frontier (`frontier`): small enough to time on 2 cores in seconds.
MAIN = Config(512, 128, 256, 8, 2)
MAIN_BLOCKS = 8
# How the stacks compile for an H100 here: CUB's radix sort asks the CUDA runtime for its scratch
# size while compiling, which fails without a GPU ("invalid device ordinal"), so XLA's own sort
# (not the peak); under an Auto mesh axis (jax's Explicit inference refuses ragged_dot).
GPU_COMPILE = {"options": {"xla_gpu_enable_cub_radix_sort": False}, "auto": True}


def plain_moe(x, router, w_gate, w_up, w_down, *, top_k: int, named: bool = False):
  """The plain ragged composition (:func:`jaxact._src.moe.reference.ragged_composition`);
  `named`: the gate and up projections carry MaxText's names."""
  names = PLAIN_NAMES if named else None
  return ragged_composition(x, router, w_gate, w_up, w_down, top_k=top_k, names=names)


def jaxact_moe(x, router, w_gate, w_up, w_down, *, top_k: int):
  return jaxact.moe_mlp(x, router, w_gate, w_up, w_down, top_k=top_k)[0]


_SAVE = jax.checkpoint_policies.save_only_these_names
_NOTHING = jax.checkpoint_policies.nothing_saveable
# point (the frontier's keys): (the MoE MLP, named, remat policy or None)
POINTS = {
  "flax": (plain_moe, False, None),
  "remat": (plain_moe, False, _NOTHING),
  "names": (plain_moe, True, _SAVE(*PLAIN_NAMES)),
  "jaxact": (jaxact_moe, False, None),
  "jaxact_remat": (jaxact_moe, False, _NOTHING),
  "jaxact_names": (jaxact_moe, False, _SAVE(*jaxact.MOE_CHECKPOINT_NAMES)),
}


def block(key: str, top_k: int):
  moe, named, policy = POINTS[key]
  kw = {"named": True} if named else {}

  def run(x, p):
    return x + moe(gated.rms_norm(x), *p, top_k=top_k, **kw)

  return run if policy is None else jax.checkpoint(run, policy=policy)


def loss_of(key: str, top_k: int):
  """``loss(params, x)`` of a scanned stack of :func:`block` (params stacked over the blocks)."""
  step = block(key, top_k)

  def loss(params, x):
    y, _ = lax.scan(lambda x, p: (step(x, p), None), x, params)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return loss


def shapes(c: Config, blocks: int, dtype):
  e, d, f = c.experts, c.dim, c.hidden
  s = jax.ShapeDtypeStruct
  params = tuple(s((blocks, *shape), dtype) for shape in ((d, e), (e, d, f), (e, d, f), (e, f, d)))
  return params, s((c.tokens, d), dtype)


def make(c: Config, blocks: int, dtype, key=0):
  """Concrete :func:`shapes`: weights scaled by their fan in, the input standard normal."""
  params, x = shapes(c, blocks, dtype)
  keys = jax.random.split(jax.random.key(key), 5)
  made = tuple(
    (jax.random.normal(k, p.shape, jnp.float32) * p.shape[-2] ** -0.5).astype(dtype)
    for k, p in zip(keys, params, strict=False)
  )
  return made, jax.random.normal(keys[-1], x.shape, jnp.float32).astype(dtype)


def kept_bytes(c: Config, moe, dtype) -> int:
  """Bytes one MoE MLP's pullback holds beyond its weights: its input, the routing and the routed
  tokens' arrays (each array once)."""
  (router, w_gate, w_up, w_down), x = make(c, 1, dtype)
  weights = [w[0] for w in (router, w_gate, w_up, w_down)]
  _, pull = jax.vjp(lambda x, *w: moe(x, *w, top_k=c.top_k), x, *weights)
  leaves = {id(v): v for v in jax.tree.leaves(pull) if isinstance(v, jax.Array)}.values()
  return sum(v.nbytes for v in leaves if v.shape not in {w.shape for w in weights})


def memory_rows(gpu: bool) -> list[str]:
  section = "memory-h100" if gpu else "memory"
  dtype = jnp.bfloat16 if gpu else jnp.float32
  for c in H100 if gpu else CPU:
    temps = {}
    for key in POINTS:
      for n in BLOCKS:
        params, x = shapes(c, n, dtype)
        loss = loss_of(key, c.top_k)
        if gpu:
          temps[key, n] = memory.gpu_memory(loss, params, x, **GPU_COMPILE)[0]
        else:
          temps[key, n] = memory.cpu_memory(loss, params, x)
    lo, hi = BLOCKS
    growth = {key: (temps[key, hi] - temps[key, lo]) / (hi - lo) for key in POINTS}
    kept = {} if gpu else {k: kept_bytes(c, POINTS[k][0], dtype) for k in ("flax", "jaxact")}
    for key in POINTS:
      rows.add(
        section,
        f"{c}, {key}",
        config=str(c),
        point=key,
        temp_bytes=[temps[key, n] for n in BLOCKS],
        growth_bytes=growth[key],
        growth_vs_plain=growth[key] / growth["flax"],
        **({"mlp_kept_bytes": kept[key]} if key in kept else {}),
      )
  return page.tables(rows.current().rows, section)


def frontier(
  runs: int, warmup: bool = True, c: Config = MAIN, blocks: int = MAIN_BLOCKS
) -> tuple[float, dict]:
  """``(the plain step's seconds, {point: (temp bytes, median time ratio, rounds' ratios)})`` for
  every point of :data:`POINTS`: `c` in `blocks` scanned blocks on CPU, float32 (by default the
  main job's MoE frontier)."""
  params, x = make(c, blocks, jnp.float32)
  temps, calls = {}, []
  for key in POINTS:
    compiled = jax.jit(jax.value_and_grad(loss_of(key, c.top_k))).lower(params, x).compile()
    temps[key] = compiled.memory_analysis().temp_size_in_bytes
    calls.append(functools.partial(compiled, params, x))
  return timing.frontier_points(temps, calls, runs, warmup)


def time_rows(runs: int) -> list[str]:
  """Each configuration's points at 8 blocks: compiled temp and CPU step time against plain."""
  n = BLOCKS[-1]
  for c in CPU:
    seconds, points = frontier(runs, True, c, n)
    for key, (temp, ratio, spread) in points.items():
      rows.add(
        "time",
        f"{c}, {key}",
        config=str(c),
        point=key,
        blocks=n,
        temp_bytes=temp,
        ratio=ratio,
        rounds=spread,
        first_seconds=seconds,
        runs=runs,
      )
  return page.tables(rows.current().rows, "time")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sections", default=",".join(SECTIONS))
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--out", default="bench-out", help="the folder of moe.rows.jsonl")
  a = parser.parse_args(argv)
  wanted = a.sections.split(",")
  if unknown := [n for n in wanted if n not in SECTIONS]:
    parser.error(f"sections {unknown} are not known; choose from {', '.join(SECTIONS)}")
  if "memory-h100" in wanted:
    support.use_gpu_compiler()  # before the first computation starts jax's backends
  if "tpu" in wanted:
    from benchmarks import moe_tpu
    from support import tpu

    try:  # libtpu, before the first computation starts jax's backends
      tpu.topology(moe_tpu.CHIP)
    except tpu.TpuUnavailable as e:
      parser.error(f"the tpu section needs libtpu: {e}")
  out = {
    "memory": lambda: memory_rows(False),
    "memory-h100": lambda: memory_rows(True),
    "time": lambda: time_rows(a.runs),
    "tpu": lambda: (moe_tpu.section(), page.tables(rows.current().rows, "tpu"))[1],
  }
  print(f"jax {jax.__version__}")
  for name in wanted:
    print(f"\n{page.heading(name)}\n")
    print("\n".join(out[name]()), flush=True)
  return 0
