"""`python -m benchmarks lce [--sections ...]`: the LM head and its loss, alone and in a decoder.

Sections:

* ``head``: the head alone on CPU, float32, 4096 tokens, D = 512, V = 32768 and 131072 (``--vocabs``
  for others): compiled temp memory of ``jit(value_and_grad)`` in x, w (and the largest array XLA
  allocates), the loss's relative difference from the plain composition's, and step time as the
  median of within-round ratios against the plain composition, for the plain
  composition (``x @ w``, optax's softmax cross-entropy), the same under ``jax.checkpoint``,
  ``jaxact.linear_cross_entropy`` (its XLA path blocked over the vocabulary), its variant blocked
  over tokens, and tokamax's ``linear_softmax_cross_entropy_loss`` where tokamax imports;
* ``head-h100``: the same compiled for an H100 on this machine, bfloat16, 16384 tokens, D = 4096,
  V = 131072 and 262144, with the largest token count whose step fits the H100's memory;
* ``decoder``: a Llama-style decoder step (embedding, 4 scanned blocks of RMS norm, causal
  attention through ``jax.nn.dot_product_attention``, a gated MLP, final norm, head), CPU,
  float32, 4 x 512 tokens, D = 512, V = 32000: compiled temp of the step for each body (Flax's
  composition, with block remat, with ``dots_saveable``; ``jaxact.gated_mlp``, with block remat)
  and each head (plain, fused, none: the loss a mean square of the final hidden state), and how
  much of each step the head takes;
* ``decoder-h100``: the decoder compiled for an H100, bfloat16, 16 x 1024 tokens, D = 4096,
  F = 14336, V = 128256 (Llama 3's);
* ``head-tpu`` / ``decoder-tpu``: the H100 sections compiled for TPU chips (``--chip``, v5p and
  v6e unless told), tokamax's Pallas TPU kernel beside its chunked XLA path where tokamax imports:
  compiled temp a chip, and each step's time ESTIMATED from XLA's cost analysis against the chip's
  published peaks (no fit);
* ``tied``: a head tied to the embedding table (V, D), CPU float32 (2048 tokens, D = 512,
  V = 32000) and compiled for an H100 (bfloat16, V = 32768): compiled temp of the step in x and the
  table for the untied head (D, V), the table passed as ``emb.T``, the table read by rows
  (``w_layout="vd"``, what ``attend_cross_entropy`` calls) and the plain ``x @ emb.T``.

Training parity is ``python -m benchmarks lm --mlp flax,flax+lce --reference``. Results:
benchmarks/results/lce.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxact
import support
from benchmarks import decoder
from benchmarks.harness import chips, memory, timing
from benchmarks.harness.rows import add as add_row
from benchmarks.harness.rows import current
from benchmarks.tables import lce as page
from jaxact._src.lce import plan as lce_plan
from jaxact._src.lce import vjp as lce_vjp

try:
  import tokamax
except ImportError:  # not in jaxact's venv (benchmarks/results/lce.md says how to add it)
  tokamax = None

MiB, GiB = 2**20, 2**30
HEAD_CPU, HEAD_GPU, TIED = page.HEAD_CPU, page.HEAD_GPU, page.TIED  # tokens, D
CPU_VOCABS = (32768, 131072)
SECTIONS = ("head", "head-h100", "head-tpu", "decoder", "decoder-h100", "decoder-tpu", "tied")
GPU_VOCABS = (131072, 262144)

# ----------------------------------------------------------------------------- the heads


def plain_head(x, w, labels):
  """What a JAX user writes: the logits, then optax's loss."""
  return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()


def _by_tokens(x, w, labels):
  """jaxact's rule blocked over tokens (blocks of an eighth of them) instead of the vocabulary."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  plan = lce_plan.LcePlan(block=max(1, x.shape[0] // 8), by="tokens", acc_dtype=np.dtype(acc))
  return jnp.mean(lce_vjp.per_token_loss(plan, x, w, None, labels))


def _tokamax_head(x, w, labels):
  """tokamax's memory-efficient XLA path ("chunked_xla"; its default on CPU and GPU builds the
  logits)."""
  return tokamax.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="mean", implementation="chunked_xla"
  )


def _tokamax_tpu_head(x, w, labels):
  """tokamax's Pallas TPU kernel (its default on a TPU; traced under :func:`_cross_compile`)."""
  return tokamax.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="mean", implementation="mosaic_tpu"
  )


def _cross_compile():
  """tokamax's checks of the default device (this CPU) off, while a step is traced for a TPU."""
  return contextlib.nullcontext() if tokamax is None else tokamax.config.cross_compile(True)


def heads(tpu: bool = False) -> dict[str, Callable]:
  """label: ``head(x, w, labels) -> loss``; `tpu`: with tokamax's TPU kernel too."""
  out = {
    "plain": plain_head,
    "checkpoint": jax.checkpoint(plain_head),
    "jaxact": lambda x, w, labels: jaxact.linear_cross_entropy(x, w, labels),
    "jaxact_tokens": _by_tokens,
  }
  if tokamax is not None:
    out["tokamax"] = _tokamax_head
    if tpu:
      out["tokamax_tpu"] = _tokamax_tpu_head
  return out


def _head_args(tokens, dim, vocab, dtype, concrete=False):
  if not concrete:
    return [
      jax.ShapeDtypeStruct((tokens, dim), dtype),
      jax.ShapeDtypeStruct((dim, vocab), dtype),
      jax.ShapeDtypeStruct((tokens,), jnp.int32),
    ]
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (tokens, dim), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (dim, vocab), jnp.float32) * dim**-0.5).astype(dtype)
  return [x, w, jax.random.randint(k[2], (tokens,), 0, vocab)]


def _step(head):
  return jax.value_and_grad(head, argnums=(0, 1))


def largest_array(compiled) -> int:
  """Bytes of the largest array in a compiled program's text."""
  sizes = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "f64": 8, "pred": 1, "u8": 1, "s8": 1}
  best = 0
  for dtype, dims in re.findall(
    r"\b(f32|s32|bf16|f16|f64|pred|u8|s8)\[([\d,]+)\]", compiled.as_text()
  ):
    best = max(best, sizes[dtype] * int(np.prod([int(d) for d in dims.split(",")])))
  return best


@dataclasses.dataclass
class HeadRow:
  vocab: int
  peer: str
  temp: float  # bytes
  largest: float  # bytes
  ratio: float | None = None  # step time against the plain head
  fit: str = ""
  error: float | None = None  # |loss - the plain head's| / the plain head's


def section_head(runs: int = 5, vocabs=CPU_VOCABS, time_it: bool = True) -> list[HeadRow]:
  tokens, dim = HEAD_CPU
  rows = []
  for vocab in vocabs:
    args = _head_args(tokens, dim, vocab, jnp.float32)
    found = {}
    for label, head in heads().items():
      compiled = jax.jit(_step(head)).lower(*args).compile()
      found[label] = HeadRow(
        vocab, label, compiled.memory_analysis().temp_size_in_bytes, largest_array(compiled)
      )
    if time_it:
      concrete = _head_args(tokens, dim, vocab, jnp.float32, concrete=True)
      want = float(plain_head(*concrete))
      for label, row in found.items():
        row.error = abs(float(jax.jit(heads()[label])(*concrete)) - want) / abs(want)
      labels = list(found)
      calls = [functools.partial(jax.jit(_step(heads()[k])), *concrete) for k in labels]
      _, ratios = timing.alternated_ratios(calls, runs)
      for label, ratio in zip(labels[1:], ratios, strict=True):
        found[label].ratio = ratio
      found["plain"].ratio = 1.0
    rows.extend(found.values())
  return rows


def _gpu_head_total(head, tokens, dim, vocab) -> tuple[int, int]:
  m = support.compile_for(_step(head), _head_args(tokens, dim, vocab, jnp.bfloat16))
  m = m.memory_analysis()
  return m.temp_size_in_bytes, memory.footprint(m)


@dataclasses.dataclass
class TpuHeadRow(HeadRow):
  """A head compiled for a TPU chip (its ``harness.chips.figures``)."""

  chip: str = ""
  total_bytes: int | None = None
  estimate_s: float | None = None  # an ESTIMATE (roofline at the chip's peaks)
  unknown_loops: int = 0
  over_hbm: bool = False


def section_head_h100(fits: bool = True, chip: str | None = None, cache=None) -> list[HeadRow]:
  """The heads compiled for an H100, or with `chip` for that TPU chip (no fit; each step's time
  ESTIMATED)."""
  tokens, dim = HEAD_GPU
  rows = []
  cap = memory.capacity() if chip is None else 0
  for vocab in GPU_VOCABS:
    for label, head in heads(tpu=chip is not None).items():
      if chip is not None:
        args = _head_args(tokens, dim, vocab, jnp.bfloat16)
        with _cross_compile():
          found = chips.figures(_step(head), args, chip, cache=cache)
        kept = {k: found.get(k) for k in ("total_bytes", "estimate_s", "unknown_loops", "over_hbm")}
        rows.append(TpuHeadRow(vocab, label, found["temp_bytes"], 0.0, chip=chip, **kept))
        continue
      temp, _ = _gpu_head_total(head, tokens, dim, vocab)
      row = HeadRow(vocab, label, temp, 0.0)
      if fits and label in ("plain", "checkpoint", "jaxact", "tokamax"):
        fit, total = memory.largest_fit_of(
          lambda t, head=head, vocab=vocab: _gpu_head_total(head, t, dim, vocab)[1], cap
        )
        row.fit = f"{fit} ({total / GiB:.1f} GiB)"
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------- rendering


TIED_HEADS = {
  "untied: w (D, V)": lambda w, x, y: jaxact.linear_cross_entropy(x, w, y),
  "tied: emb.T": lambda e, x, y: jaxact.linear_cross_entropy(x, e.T, y),
  'tied: w_layout="vd"': lambda e, x, y: jaxact.linear_cross_entropy(x, e, y, w_layout="vd"),
  "plain: x @ emb.T, optax": lambda e, x, y: plain_head(x, e.T, y),
}


def section_tied(gpu: bool) -> list[str]:
  """The tied head's compiled temp (MiB) on CPU (float32) or for an H100 (bfloat16)."""
  tokens, dim = TIED
  vocab, dtype = (32768, jnp.bfloat16) if gpu else (32000, jnp.float32)
  x = jax.ShapeDtypeStruct((tokens, dim), dtype)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
  section = "tied-h100" if gpu else "tied"
  for name, head in TIED_HEADS.items():
    w = jax.ShapeDtypeStruct((dim, vocab) if name.startswith("untied") else (vocab, dim), dtype)
    step, args = jax.grad(head, argnums=(0, 1)), (w, x, labels)
    compile_ = support.compile_for if gpu else lambda f, a: jax.jit(f).lower(*a).compile()
    compiled = compile_(step, args)
    temp = compiled.memory_analysis().temp_size_in_bytes
    add_row(section, name, tokens=tokens, dim=dim, vocab=vocab, temp_bytes=temp)
  return page.tables(current().rows, section)


def record_head(section: str, found: list[HeadRow]) -> list[dict]:
  """The head's rows, a row a (vocabulary, head): :class:`HeadRow`'s fields as figures."""
  return [add_row(section, _head_case(r), **dataclasses.asdict(r)) for r in found]


def _head_case(r: HeadRow) -> str:
  return (
    f"{r.chip}, V={r.vocab}, {r.peer}" if isinstance(r, TpuHeadRow) else f"V={r.vocab}, {r.peer}"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks lce", description=__doc__)
  parser.add_argument(
    "--sections",
    default="head,head-h100,decoder,decoder-h100",
    help=f"comma-separated, any of: {', '.join(SECTIONS)}",
  )
  parser.add_argument("--runs", type=int, default=5, help="timing rounds (head)")
  parser.add_argument("--chip", default=",".join(chips.TPU_CHIPS), help="TPU chips (-tpu sections)")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled TPU figures' JSON (-tpu)")
  parser.add_argument(
    "--vocabs", default=",".join(map(str, CPU_VOCABS)), help="comma-separated V (head)"
  )
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  if unknown := [s for s in sections if s not in SECTIONS]:
    parser.error(f"sections {unknown} are not known; choose from {', '.join(SECTIONS)}")
  gpu_compiler = support.use_gpu_compiler()  # before the first computation starts jax
  if any(s.endswith("-tpu") for s in sections) and (why := chips.available()):
    print(f"benchmarks.lce: {why}", file=sys.stderr)
    return 2
  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, tokamax "
    f"{getattr(tokamax, '__version__', 'not installed')}"
  )

  def show(section: str) -> None:
    print("\n".join(page.tables(current().section(section))), flush=True)

  if "head" in sections:
    vocabs = tuple(int(v) for v in args.vocabs.split(","))
    record_head("head", section_head(args.runs, vocabs))
    show("head")
  if {"head-h100", "decoder-h100"} & set(sections) and not gpu_compiler:
    print("the GPU sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  if "head-h100" in sections:
    record_head("head-h100", section_head_h100())
    show("head-h100")
  if "decoder" in sections:
    decoder.record_decoder("decoder", decoder.section_decoder(), decoder.DECODER_CPU)
    show("decoder")
  if "decoder-h100" in sections:
    found = decoder.section_decoder(gpu=True)
    decoder.record_decoder("decoder-h100", found, decoder.DECODER_GPU)
    show("decoder-h100")
  for chip in chips.chips(args.chip) if "head-tpu" in sections else ():
    record_head("head-tpu", section_head_h100(False, chip, args.cache))
  if "head-tpu" in sections:
    show("head-tpu")
  for chip in chips.chips(args.chip) if "decoder-tpu" in sections else ():
    found = decoder.section_decoder(chip=chip, cache=args.cache)
    decoder.record_decoder("decoder-tpu", found, decoder.DECODER_GPU, chip)
  if "decoder-tpu" in sections:
    show("decoder-tpu")
  if "tied" in sections:
    section_tied(gpu=False)
    show("tied")
    if gpu_compiler:
      section_tied(gpu=True)
      show("tied-h100")
  return 0
