"""`python -m benchmarks posttrain [--quick] [--sections ...]`: post-training's LM head (issue 45).

The loss part of a post-training step (the policy's hidden states and head in, their gradients
out: ``jax.jit(jax.grad(loss, argnums=(0, 1)))``), two steps, each against what a JAX user writes
instead:

* GRPO (DeepSeekMath's sequence-mean loss, clip 0.2, k3 KL to a frozen reference with beta 0.04,
  old and reference log-probs given), a group of 8 completions of T tokens, D = 4096:
  ``plain`` (``log_softmax`` of the full logits, the loss of ``jaxact/_src/lce/reference.py``'s
  ``policy_gradient_reference``, which also computes each token's entropy, multiplied by 0, as
  jaxact's metrics do), ``plain-lp`` (the same log-probs, the loss by hand and no entropy:
  tunix's default), ``chunk+remat`` (the log-probs over chunks of 1024 tokens, each under
  ``jax.checkpoint`` in a ``lax.map``, then the loss by hand: tunix's and EasyDeL's option),
  ``log_probs+loss`` (``jaxact.linear_log_probs`` and the loss by hand) and ``jaxact``
  (``jaxact.policy_gradient_loss``);
* distillation (forward KL, the teacher frozen, D = 4096 both), 8 sequences of T tokens:
  ``plain`` (``distillation_reference``: both models' full logits), ``chunk+remat`` (the KL summed
  over chunks of 1024 tokens under ``jax.checkpoint``), ``jaxact`` (``jaxact.distillation_loss``).

Sections:

* ``memory``: compiled temp (``memory_analysis().temp_size_in_bytes``) on CPU, float32, T 1024 /
  4096 / 8192, V 32768 / 128256 / 151936 / 262144;
* ``memory-h100``: the same compiled for an H100 on this machine (``support.compile_for``),
  bfloat16 hidden states and heads, T 8192 (``--gpu-lengths``);
* ``memory-tpu``: the same compiled for TPU chips (``--chip``, v5p and v6e unless told), T as
  ``memory-h100``'s: compiled temp a chip, and each step's time ESTIMATED from XLA's cost analysis
  against the chip's published peaks;
* ``fit-h100``: for each method at V 128256 (``--fit-vocabs``), the longest completion (T, the
  group of 8) whose compiled temp plus arguments and outputs fits the H100's 80 GB
  (``harness.memory.largest_fit_of``);
* ``time``: CPU step time, float32, 4 x 256 tokens, D = 512, V = 32768 (chunks of 256), the median
  of within-round ratios to ``plain`` over alternated rounds, and each loss's relative difference
  from ``plain``'s;
* ``precision``: the GRPO step's gradients from bfloat16 hidden states and head (8 x 1024 tokens,
  D = 256, V = 8192, on the CPU), each method's relative error (Frobenius norm) against the float64
  gradient of the same inputs; chunk+remat with 8 and 64 chunks (its ``dw`` is summed over the
  chunks in the head's bfloat16), beside the exact gradient rounded once to bfloat16.

``--quick``: T 1024, V 128256, 3 timing rounds (about 3 minutes). Results:
benchmarks/results/posttrain.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
import support
from benchmarks.harness import chips, memory, timing
from benchmarks.harness.rows import add as add_row
from benchmarks.tables import posttrain as page
from jaxact._src.lce import reference

MiB, GiB = 2**20, 2**30
SEQUENCES, DIM = page.SEQUENCES, page.DIM  # a GRPO group; Llama 3 8B's width
LENGTHS = (1024, 4096, 8192)  # tokens a completion
VOCABS = (32768, 128256, 151936, 262144)  # 32k, Llama 3's, Qwen's, Gemma's
CHUNK = 1024  # tokens a chunk of chunk+remat
EPSILON, BETA = 0.2, 0.04  # GRPO's clip and KL coefficient (DeepSeekMath)
TIME_SHAPE = page.TIME_SHAPE  # sequences, T, D, V of the CPU timing
TIME_CHUNK = 256
FIT_STEP = 256  # tokens a completion between compiled candidates of the fit
PRECISION_SHAPE = page.PRECISION_SHAPE  # sequences, T, D, V of the precision section

# ----------------------------------------------------------------------------- GRPO


def grpo_from_log_probs(logp, advantages, mask, old, ref):
  """GRPO's loss by hand from per-token log-probs (DeepSeekMath, as tunix writes it): the clipped
  ratio surrogate, minus beta times the k3 KL, each sequence's mean, then the group's."""
  m = mask.astype(logp.dtype)
  ratio = jnp.exp(logp - old)
  a = advantages[..., None]
  surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - EPSILON, 1 + EPSILON) * a)
  d = ref - logp
  per_token = surrogate - BETA * (jnp.exp(d) - d - 1)
  return -jnp.mean(jnp.sum(per_token * m, -1) / jnp.maximum(jnp.sum(m, -1), 1))


def chunked_log_probs(x, w, tokens, chunk):
  """Per-token log-probs over chunks of `chunk` tokens, each chunk's logits and log-softmax under
  ``jax.checkpoint`` in a ``lax.map`` (recomputed in the backward, one chunk live at a time)."""

  @jax.checkpoint
  def one(args):
    xc, tc = args
    z = jnp.matmul(xc, w, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(z, -1), tc[:, None], -1)[:, 0]

  xs = x.reshape(-1, chunk, x.shape[-1])
  return jax.lax.map(one, (xs, tokens.reshape(-1, chunk))).reshape(tokens.shape)


def grpo_plain(x, w, tokens, adv, mask, old, ref, chunk=CHUNK):
  return reference.policy_gradient_reference(
    x, w, tokens, adv, mask=mask, old_log_probs=old, ref_log_probs=ref, epsilon=EPSILON, beta=BETA
  )


def grpo_plain_lean(x, w, tokens, adv, mask, old, ref, chunk=CHUNK):
  """tunix's form: the log-probs from ``log_softmax`` of the full logits, the loss by hand (no
  entropy: the reference computes it, multiplied by 0, as jaxact's metrics do)."""
  logp = reference.log_probs_reference(x, w, tokens)
  return grpo_from_log_probs(logp, adv, mask, old, ref)


def grpo_chunked(x, w, tokens, adv, mask, old, ref, chunk=CHUNK):
  return grpo_from_log_probs(chunked_log_probs(x, w, tokens, chunk), adv, mask, old, ref)


def grpo_log_probs(x, w, tokens, adv, mask, old, ref, chunk=CHUNK):
  logp = jaxact.linear_log_probs(x, w, tokens, where=mask)
  return grpo_from_log_probs(logp, adv, mask, old, ref)


def grpo_jaxact(x, w, tokens, adv, mask, old, ref, chunk=CHUNK):
  return jaxact.policy_gradient_loss(
    x, w, tokens, adv, mask=mask, old_log_probs=old, ref_log_probs=ref, epsilon=EPSILON, beta=BETA
  )[0]


# ----------------------------------------------------------------------------- distillation


def distill_plain(x, w, xt, wt, chunk=CHUNK):
  return reference.distillation_reference(x, w, xt, wt)


def distill_chunked(x, w, xt, wt, chunk=CHUNK):
  """Forward KL summed over chunks of `chunk` tokens, each under ``jax.checkpoint``."""

  @jax.checkpoint
  def one(args):
    xc, xtc = args
    lq = jax.nn.log_softmax(jnp.matmul(xc, w, preferred_element_type=jnp.float32), -1)
    lp = jax.nn.log_softmax(jnp.matmul(xtc, wt, preferred_element_type=jnp.float32), -1)
    lp = jax.lax.stop_gradient(lp)
    return jnp.sum(jnp.exp(lp) * (lp - lq))

  xs, xts = x.reshape(-1, chunk, x.shape[-1]), xt.reshape(-1, chunk, xt.shape[-1])
  return jnp.sum(jax.lax.map(one, (xs, xts))) / (x.size // x.shape[-1])


def distill_jaxact(x, w, xt, wt, chunk=CHUNK):
  return jaxact.distillation_loss(x, w, xt, wt)[0]


TASKS = {
  "grpo": {
    "plain": grpo_plain,
    "plain-lp": grpo_plain_lean,
    "chunk+remat": grpo_chunked,
    "log_probs+loss": grpo_log_probs,
    "jaxact": grpo_jaxact,
  },
  "distill": {"plain": distill_plain, "chunk+remat": distill_chunked, "jaxact": distill_jaxact},
}


def shapes(task, sequences, length, dim, vocab, dtype) -> list[jax.ShapeDtypeStruct]:
  s = jax.ShapeDtypeStruct
  x, w = s((sequences, length, dim), dtype), s((dim, vocab), dtype)
  if task == "distill":
    return [x, w, x, w]  # the teacher as wide as the student
  per_token = s((sequences, length), jnp.float32)
  tokens, mask = s((sequences, length), jnp.int32), s((sequences, length), jnp.bool_)
  return [x, w, tokens, s((sequences,), jnp.float32), mask, per_token, per_token]


def concrete(task, sequences, length, dim, vocab) -> list[jax.Array]:
  k = jax.random.split(jax.random.key(0), 8)
  x = jax.random.normal(k[0], (sequences, length, dim))
  w = jax.random.normal(k[1], (dim, vocab)) * dim**-0.5
  if task == "distill":
    return [x, w, jax.random.normal(k[2], x.shape), jax.random.normal(k[3], w.shape) * dim**-0.5]
  tokens = jax.random.randint(k[2], (sequences, length), 0, vocab)
  adv = jax.random.normal(k[3], (sequences,))
  lengths = jax.random.randint(k[4], (sequences, 1), length // 2, length + 1)
  mask = jnp.arange(length) < lengths
  logp = reference.log_probs_reference(x, w, tokens)
  old = logp + 0.1 * jax.random.normal(k[5], logp.shape)  # a step stale: some clips bind
  ref = logp + 0.1 * jax.random.normal(k[6], logp.shape)
  return [x, w, tokens, adv, mask, old, ref]


def step(loss, chunk=CHUNK):
  return jax.grad(functools.partial(loss, chunk=chunk), argnums=(0, 1))


# ----------------------------------------------------------------------------- rows


@dataclasses.dataclass
class MemRow:
  task: str
  method: str
  sequences: int
  length: int  # tokens a completion
  dim: int
  vocab: int
  dtype: str
  temp_bytes: int
  vs_plain: float = 1.0


@dataclasses.dataclass
class FitRow:
  task: str
  method: str
  sequences: int
  dim: int
  vocab: int
  length: int  # the longest completion that fits
  total_bytes: int  # its temp + arguments + outputs


@dataclasses.dataclass
class TimeRow:
  task: str
  method: str
  sequences: int
  length: int
  dim: int
  vocab: int
  seconds: float  # the plain step's median seconds times the median ratio
  vs_plain: float  # median of within-round ratios
  low: float  # the rounds' smallest and largest ratio
  high: float
  loss_error: float  # |loss - plain's| / |plain's|


def record(section: str, found: list) -> list[dict]:
  """Each measured row as a row of the job (`harness.rows.add`), its fields as figures."""
  return [add_row(section, _case(r), **vars(r)) for r in found]


def _case(r) -> str:
  case = f"{r.task}, {getattr(r, 'length', '')}, V={r.vocab}, {r.method}"
  return f"{r.chip}, {case}" if getattr(r, "chip", "") else case


@dataclasses.dataclass
class PrecisionRow:
  task: str
  method: str  # "exact" is the float64 gradient rounded to bfloat16 once
  chunks: int  # chunk+remat's chunks (0: not chunked)
  sequences: int
  length: int
  dim: int
  vocab: int
  dx_error: float  # ||g - g64|| / ||g64||
  dw_error: float


# ----------------------------------------------------------------------------- sections


@dataclasses.dataclass
class TpuMemRow(MemRow):
  """A step compiled for a TPU chip (its ``harness.chips.figures``)."""

  chip: str = ""
  total_bytes: int | None = None
  estimate_s: float | None = None  # an ESTIMATE (roofline at the chip's peaks)
  unknown_loops: int = 0
  over_hbm: bool = False


def section_memory(
  lengths, vocabs, gpu: bool, tasks=TASKS, chip: str | None = None, cache=None
) -> list[MemRow]:
  """Each step's temp on CPU or compiled for an H100 (`gpu`), or with `chip` for that TPU chip
  (bfloat16; each step's time ESTIMATED)."""
  dtype = jnp.bfloat16 if gpu or chip else jnp.float32
  compile_ = support.compile_for if gpu else lambda f, a: jax.jit(f).lower(*a).compile()
  found = []
  for task, methods in tasks.items():
    for length in lengths:
      for vocab in vocabs:
        args = shapes(task, SEQUENCES, length, DIM, vocab, dtype)
        rows = {}
        for name, loss in methods.items():
          mem = (task, name, SEQUENCES, length, DIM, vocab, jnp.dtype(dtype).name)
          if chip is not None:
            got = chips.figures(step(loss), args, chip, cache=cache)
            kept = {k: got.get(k) for k in ("total_bytes", "estimate_s", "unknown_loops")}
            rows[name] = TpuMemRow(*mem, got["temp_bytes"], chip=chip, **kept)
            rows[name].over_hbm = got["over_hbm"]
            continue
          temp = compile_(step(loss), args).memory_analysis().temp_size_in_bytes
          rows[name] = MemRow(*mem, temp)
        for r in rows.values():
          r.vs_plain = r.temp_bytes / rows["plain"].temp_bytes
        found += rows.values()
        print(f"  {task} T={length} V={vocab}: compiled", flush=True)
  return found


def _gpu_total(loss, task, length, vocab) -> int:
  args = shapes(task, SEQUENCES, length, DIM, vocab, jnp.bfloat16)
  return memory.footprint(support.compile_for(step(loss), args).memory_analysis())


def section_fit(vocabs, tasks=TASKS) -> list[FitRow]:
  cap = memory.capacity()
  found = []
  for task, methods in tasks.items():
    for vocab in vocabs:
      for name, loss in methods.items():
        total = functools.partial(_gpu_total, loss, task, vocab=vocab)
        length, used = memory.largest_fit_of(
          lambda t, total=total: total(t), cap, step=FIT_STEP, start=(1024, 4096)
        )
        found.append(FitRow(task, name, SEQUENCES, DIM, vocab, length, used))
        print(f"  {task} V={vocab} {name}: T={length}", flush=True)
  return found


def section_time(runs: int, tasks=TASKS) -> list[TimeRow]:
  sequences, length, dim, vocab = TIME_SHAPE
  found = []
  for task, methods in tasks.items():
    args = concrete(task, sequences, length, dim, vocab)
    names = list(methods)
    loss = {
      k: float(jax.jit(functools.partial(methods[k], chunk=TIME_CHUNK))(*args)) for k in names
    }
    calls = [functools.partial(jax.jit(step(methods[k], TIME_CHUNK)), *args) for k in names]
    seconds, by_round = timing.alternated_round_ratios(calls, runs)
    for name, ratios in zip(names, [[1.0] * runs, *by_round], strict=True):
      ratio = statistics.median(ratios)
      error = abs(loss[name] - loss["plain"]) / abs(loss["plain"])
      found.append(
        TimeRow(
          task,
          name,
          sequences,
          length,
          dim,
          vocab,
          seconds * ratio,
          ratio,
          min(ratios),
          max(ratios),
          error,
        )
      )
  return found


def section_precision(shape=PRECISION_SHAPE) -> list[PrecisionRow]:
  sequences, length, dim, vocab = shape
  args = concrete("grpo", sequences, length, dim, vocab)
  half = [a.astype(jnp.bfloat16) if i < 2 else a for i, a in enumerate(args)]
  with jax.enable_x64():
    wide = [a.astype(jnp.float64) if i < 2 else a for i, a in enumerate(half)]
    exact = [np.asarray(g) for g in jax.jit(step(grpo_plain_lean))(*wide)]

  def error(g, r) -> float:
    return float(np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r))

  def row(method, chunks, grads) -> PrecisionRow:
    dx, dw = (error(g, r) for g, r in zip(grads, exact, strict=True))
    return PrecisionRow("grpo", method, chunks, sequences, length, dim, vocab, dx, dw)

  tokens = sequences * length
  found = [row("exact", 0, [jnp.asarray(g, jnp.bfloat16) for g in exact])]
  for name, loss in TASKS["grpo"].items():
    for chunks in (8, 64) if name == "chunk+remat" else (0,):
      chunk = tokens // chunks if chunks else CHUNK
      found.append(row(name, chunks, jax.jit(step(loss, chunk))(*half)))
  return found


# ----------------------------------------------------------------------------- tables from rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks posttrain", description=__doc__)
  parser.add_argument(
    "--sections",
    default="memory,memory-h100,fit-h100,time,precision",
    help="comma-separated: memory, memory-h100, memory-tpu, fit-h100, time, precision",
  )
  parser.add_argument("--quick", action="store_true", help="T 1024, V 128256, 3 rounds")
  parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="T (memory)")
  parser.add_argument("--gpu-lengths", default="8192", help="T (memory-h100, memory-tpu)")
  parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)), help="V (memory sections)")
  parser.add_argument("--fit-vocabs", default="128256", help="V (fit-h100)")
  parser.add_argument("--runs", type=int, default=5, help="timing rounds")
  parser.add_argument("--chip", default=",".join(chips.TPU_CHIPS), help="TPU chips (memory-tpu)")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled TPU figures' JSON (memory-tpu)")
  parser.add_argument("--out", default="bench-out", help="the folder of posttrain.rows.jsonl")
  args = parser.parse_args(argv)
  ints = lambda s: tuple(int(v) for v in s.split(","))
  lengths, gpu_lengths, vocabs, fit_vocabs = map(
    ints, (args.lengths, args.gpu_lengths, args.vocabs, args.fit_vocabs)
  )
  runs = args.runs
  if args.quick:
    lengths = gpu_lengths = (1024,)
    vocabs, fit_vocabs, runs = (128256,), (128256,), 3
  sections = args.sections.split(",")
  gpu_compiler = support.use_gpu_compiler()  # before the first computation starts jax
  if "memory-tpu" in sections and (why := chips.available()):
    print(f"benchmarks.posttrain: {why}", file=sys.stderr)
    return 1
  print(f"jax {jax.__version__}, backend {jax.default_backend()}")
  if {"memory-h100", "fit-h100"} & set(sections) and not gpu_compiler:
    print("the H100 sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  start = time.perf_counter()
  found: list[dict] = []
  for name in ("memory", "memory-h100"):
    if name in sections:
      got = record(
        name, section_memory(lengths if name == "memory" else gpu_lengths, vocabs, name != "memory")
      )
      found += got
      print("\n".join(page.tables(got, name)))
  if "memory-tpu" in sections:
    for chip in chips.chips(args.chip):
      found += record(
        "memory-tpu", section_memory(gpu_lengths, vocabs, False, chip=chip, cache=args.cache)
      )
    print("\n".join(page.tables(found, "memory-tpu")))
  if "fit-h100" in sections:
    got = record("fit-h100", section_fit(fit_vocabs))
    found += got
    print("\n".join(page.tables(got, "fit-h100")))
  if "time" in sections:
    got = record("time", section_time(runs))
    found += got
    print("\n".join(page.tables(got, "time")))
  if "precision" in sections:
    got = record("precision", section_precision())
    found += got
    print("\n".join(page.tables(got, "precision")))
  print("\n### Headline\n")
  print("\n".join(page.headline(found)))
  print(f"\n{time.perf_counter() - start:.0f} s")
  return 0
