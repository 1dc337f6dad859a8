"""`python -m benchmarks attention [--sections ...]`: attention that keeps its output, in a decoder.

Sections:

* ``decoder``: a Llama-style decoder step (embedding, 4 scanned blocks of RMS norm, causal
  attention, a gated MLP, final norm, head and loss; D = 512, 8 heads, V = 32000), CPU float32,
  4 x 512 and 1 x 2048 tokens: compiled temp of ``jit(value_and_grad(loss))`` for Flax's
  composition, Flax + block remat, jaxact (``rms_norm``, ``gated_mlp``, ``linear_cross_entropy``)
  with ``jax.nn.dot_product_attention``, and with ``jaxact.dot_product_attention``, each + block
  remat; what attention takes of each step (against the same step with attention replaced by
  ``v``);
* ``time``: CPU step time of the same steps, as the median of within-round ratios against the
  step with jax.nn's attention;
* ``decoder-h100``: the decoder compiled for an H100 on this machine, bfloat16, B = 4, D = 2048,
  16 heads, F = 5632, V = 128256, T = 2048, 4096, 8192;
* ``fits-h100``: the longest sequence (B = 4, a multiple of 1024) whose step fits an 80 GB H100,
  for each body;
* ``blocks-h100``: the XLA path's block sizes compiled for an H100 on this machine: the temp of
  attention's forward and backward alone (``jax.vjp`` and its pullback; causal, B = 4, 8 query
  and 2 key/value heads) for square blocks of 64 to 512 and the default, over head dims 64, 128,
  256, bfloat16 and float32, T = 512, 2048, 8192; and of ``benchmarks.gemma``'s training step of
  the port (bfloat16, 4 x 512) for the same blocks, against the port with the example's
  attention;
* ``tpu``: the attention step compiled for TPU v5p and v6e chips here: jax.nn, jaxact's XLA path,
  jaxact as ``implementation=None`` takes it, splash attention; temp exact, step time ESTIMATED
  (:mod:`benchmarks.attention_tpu`; needs libtpu: ``python tests/install_tpu_compiler.py``).

Results: benchmarks/results/attention.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
import support
from benchmarks import decoder, gemma
from benchmarks.harness import memory, rows, timing
from benchmarks.tables import attention as page
from jaxact._src.attention.plan import default_blocks

MiB, GiB = 2**20, 2**30
CPU_SHAPES = ((4, 512), (1, 2048))  # (batch, seq)
GPU_SEQS = (2048, 4096, 8192)

# label: (body of benchmarks.lce, head); jaxact's bodies with jaxact.rms_norm.
STEPS = {
  "Flax": ("flax", "plain"),
  "Flax + block remat": ("flax_remat", "plain"),
  "jaxact, jax.nn attention": ("jaxact", "fused"),
  "jaxact, jax.nn attention + block remat": ("jaxact_remat", "fused"),
  "jaxact, jaxact attention": ("jaxact_attn", "fused"),
  "jaxact, jaxact attention + block remat": ("jaxact_attn_remat", "fused"),
}
BASE = page.BASE  # the step the goals compare jaxact's attention with


def cpu_decoder(batch: int, seq: int) -> decoder.Decoder:
  return decoder.Decoder(batch=batch, seq=seq, dim=512, hidden=1408, heads=8, vocab=32000)


def gpu_decoder(seq: int, batch: int = 4) -> decoder.Decoder:
  return decoder.Decoder(
    batch=batch, seq=seq, dim=2048, hidden=5632, heads=16, vocab=128256, dtype="bfloat16"
  )


def _norm(body: str):
  return decoder.jaxact_rms_norm if body.startswith("jaxact") else decoder.rms_norm


def step_temp(c: decoder.Decoder, label: str, gpu: bool) -> int:
  body, head = STEPS[label]
  return decoder.decoder_temp(c, body, head, gpu, norm=_norm(body))


def _no_attention_temp(c: decoder.Decoder, gpu: bool) -> int:
  """The jaxact step with attention replaced by ``v``: what the rest of the step takes."""
  saved = decoder.BODIES["jaxact"]
  decoder.BODIES["jaxact"] = (saved[0], None, lambda q, k, v: v)
  try:
    return step_temp(c, BASE, gpu)
  finally:
    decoder.BODIES["jaxact"] = saved


@dataclasses.dataclass
class DecoderRow:
  batch: int
  seq: int
  temps: dict[str, int]  # label -> bytes
  rest: int  # the step without attention


def section_decoder(gpu: bool = False, seqs=None) -> list[DecoderRow]:
  found = []
  shapes = [(4, s) for s in (seqs or GPU_SEQS)] if gpu else CPU_SHAPES
  for batch, seq in shapes:
    c = gpu_decoder(seq, batch) if gpu else cpu_decoder(batch, seq)
    temps = {label: step_temp(c, label, gpu) for label in STEPS}
    found.append(DecoderRow(batch, seq, temps, _no_attention_temp(c, gpu)))
    print(f"  [{batch} x {seq}: done]", file=sys.stderr, flush=True)
  return found


def section_time(runs: int = 5, batch: int = 4, seq: int = 512) -> dict[str, float]:
  """Each step's CPU time against :data:`BASE`'s (median of within-round ratios); BASE: its
  median seconds."""
  c = cpu_decoder(batch, seq)
  rng = np.random.default_rng(0)
  params, tokens, _ = decoder.decoder_shapes(c)
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.02, s.dtype), params)
  toks = jnp.asarray(rng.integers(0, c.vocab, tokens.shape), jnp.int32)
  labels = [BASE, "jaxact, jaxact attention", "Flax", "Flax + block remat"]
  calls = []
  for label in labels:
    body, head = STEPS[label]
    f = jax.jit(jax.value_and_grad(decoder.decoder_loss(c, body, head, norm=_norm(body))))
    calls.append(lambda f=f: f(params, toks, toks))
  base, ratios = timing.alternated_ratios(calls, runs)
  return {BASE: base, **dict(zip(labels[1:], ratios, strict=True))}


def longest_fit(label: str, capacity: int, batch: int = 4, step: int = 1024) -> tuple[int, int]:
  """``(seq, bytes)``: the longest multiple of `step` whose step (temp, arguments, outputs) fits
  `capacity`, compiled for an H100."""

  def total(seq: int) -> int:
    body, head = STEPS[label]
    c = gpu_decoder(seq, batch)
    step = jax.value_and_grad(decoder.decoder_loss(c, body, head, norm=_norm(body)))
    leaves, tree = jax.tree.flatten(decoder.decoder_shapes(c))

    def flat(*leaves):
      return step(*jax.tree.unflatten(tree, leaves))

    m = support.compile_for(flat, leaves).memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes

  return memory.largest_fit_of(total, capacity, step=step, start=(2048, 8192))


# -------------------------------------------------------------------------- block sizes

BLOCKS = (64, 128, 256, 512)
BLOCK_HEAD_DIMS = (64, 128, 256)
BLOCK_DTYPES = ("bfloat16", "float32")
BLOCK_SEQS = (512, 2048, 8192)


def attention_vjp(block_sizes, batch: int = 4, heads: int = 8, kv_heads: int = 2):
  """``(q, k, v, do) -> (o, dq, dk, dv)``: causal attention's forward and backward, the blocks
  given (None: the default)."""

  def run(q, k, v, do):
    f = lambda q, k, v: jaxact.dot_product_attention(
      q, k, v, is_causal=True, block_sizes=block_sizes
    )
    o, pullback = jax.vjp(f, q, k, v)
    return (o, *pullback(do))

  return run


def attention_temp(head_dim, dtype, seq, block_sizes, batch=4, heads=8, kv_heads=2) -> int:
  """Compiled temp (bytes) of :func:`attention_vjp` for an H100."""
  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), dtype)
  compiled = support.compile_for(attention_vjp(block_sizes), [q, kv, kv, q])
  return compiled.memory_analysis().temp_size_in_bytes


def section_blocks(
  head_dims=BLOCK_HEAD_DIMS, dtypes=BLOCK_DTYPES, seqs=BLOCK_SEQS, blocks=BLOCKS, batch=4, heads=8
) -> list[dict]:
  """One row a (head dim, dtype, T): the temp of each square block and of the default."""
  found = []
  for head_dim in head_dims:
    for dtype in dtypes:
      for seq in seqs:
        temps = {b: attention_temp(head_dim, dtype, seq, (b, b), batch, heads) for b in blocks}
        temps["default"] = attention_temp(head_dim, dtype, seq, None, batch, heads)
        default = default_blocks(batch * heads, seq, seq, head_dim=head_dim, gpu=True)
        temps = {str(b): t for b, t in temps.items()}
        figures = dict(head_dim=head_dim, dtype=dtype, seq=seq, default=default, temps=temps)
        found.append(rows.add("blocks-h100", f"H {head_dim}, {dtype}, T {seq}", **figures))
        print(f"  [H {head_dim} {dtype} T {seq}: done]", file=sys.stderr, flush=True)
  return found


def section_gemma_blocks(blocks=BLOCKS) -> list[dict]:
  """The Gemma port's training step (``benchmarks.gemma``, bfloat16, 4 x 512) compiled for an
  H100: temp for each square block, the default, and the port with the example's attention."""
  config = gemma.Config(dtype=jnp.bfloat16)
  temps = {}
  for b in (*blocks, None):
    c = dataclasses.replace(config, block_sizes=None if b is None else (b, b))
    temps[b or "default"] = gemma.temp(c, "jaxact", gpu=True)
  c = dataclasses.replace(config, example_attention=True)
  temps["example's attention"] = gemma.temp(c, "jaxact", gpu=True)
  heads = config.batch * config.heads
  default = default_blocks(heads, config.length, config.length, head_dim=config.head_dim, gpu=True)
  found = []
  for label, temp in temps.items():
    block = label if isinstance(label, int) else None
    if block is not None:
      label = f"jaxact, {label} x {label} blocks"
    elif label == "default":
      label = f"jaxact, default blocks ({default[0]} x {default[1]})"
    found.append(
      rows.add("gemma-blocks-h100", label, block=block, default=default, temp_bytes=temp)
    )
  return found


# ----------------------------------------------------------------------------- rendering


def record_decoder(section: str, found: list[DecoderRow]) -> list[dict]:
  """The decoder's rows, a row a (B x T, step): its temp and that of the step without
  attention."""
  return [
    rows.add(
      section,
      f"{r.batch} x {r.seq}, {label}",
      batch=r.batch,
      seq=r.seq,
      step=label,
      temp_bytes=temp,
      rest_bytes=r.rest,
    )
    for r in found
    for label, temp in r.temps.items()
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks attention", description=__doc__)
  parser.add_argument(
    "--sections",
    default="decoder,time,decoder-h100,fits-h100",
    help="comma-separated: decoder, time, decoder-h100, fits-h100, blocks-h100, tpu",
  )
  parser.add_argument("--chips", default="v5p,v6e", help="the tpu section's chips")
  parser.add_argument("--seqs", default="2048,4096,8192", help="the tpu section's lengths")
  parser.add_argument("--runs", type=int, default=5, help="timing rounds")
  parser.add_argument("--out", default="bench-out", help="the folder of attention.rows.jsonl")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  gpu_compiler = support.use_gpu_compiler()  # before the first computation starts jax
  if "tpu" in sections:
    from benchmarks import attention_tpu
    from support import tpu

    try:  # libtpu, before the first computation starts jax's backends
      tpu.topology("v5p")
    except tpu.TpuUnavailable as e:
      print(f"the tpu section needs libtpu: {e}", file=sys.stderr)
      return 1
  print(f"jax {jax.__version__}, backend {jax.default_backend()}")

  def show(section: str) -> None:
    print("\n".join(page.tables(rows.current().section(section))), flush=True)

  if "decoder" in sections:
    record_decoder("decoder", section_decoder())
    show("decoder")
  if "time" in sections:
    times = section_time(args.runs)
    for i, (label, figure) in enumerate(times.items()):
      seconds, ratio = (figure, 1.0) if i == 0 else (None, figure)
      rows.add("time", label, ratio=ratio, seconds=seconds, runs=args.runs)
    show("time")
  if {"decoder-h100", "fits-h100", "blocks-h100"} & set(sections) and not gpu_compiler:
    print("the H100 sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  if "decoder-h100" in sections:
    record_decoder("decoder-h100", section_decoder(gpu=True))
    show("decoder-h100")
  if "fits-h100" in sections:
    cap = memory.capacity()
    for label in STEPS:
      seq, total = longest_fit(label, cap)
      rows.add("fits-h100", label, seq=seq, total_bytes=total, capacity_bytes=cap)
    show("fits-h100")
  if "blocks-h100" in sections:
    section_gemma_blocks()
    show("gemma-blocks-h100")
    section_blocks()
    show("blocks-h100")
  if "tpu" in sections:
    chips, seqs = args.chips.split(","), [int(s) for s in args.seqs.split(",")]
    attention_tpu.section(chips, seqs)
    show("tpu")
  return 0
