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
* ``tied``: a head tied to the embedding table (V, D), CPU float32 (2048 tokens, D = 512,
  V = 32000) and compiled for an H100 (bfloat16, V = 32768): compiled temp of the step in x and the
  table for the untied head (D, V), the table passed as ``emb.T``, the table read by rows
  (``w_layout="vd"``, what ``attend_cross_entropy`` calls) and the plain ``x @ emb.T``.

Training parity is ``python -m benchmarks lm --mlp flax,flax+lce --reference``. Results:
benchmarks/results/lce.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxact
import support
from benchmarks import gated
from benchmarks.harness import timing
from jaxact._src.lce import plan as lce_plan
from jaxact._src.lce import vjp as lce_vjp

try:
  import tokamax
except ImportError:  # not in jaxact's venv (benchmarks/results/lce.md says how to add it)
  tokamax = None

MiB, GiB = 2**20, 2**30
HEAD_CPU = (4096, 512)  # tokens, D
HEAD_GPU = (16384, 4096)
CPU_VOCABS = (32768, 131072)
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


def heads() -> dict[str, Callable]:
  out = {
    "plain": plain_head,
    "checkpoint": jax.checkpoint(plain_head),
    "jaxact": lambda x, w, labels: jaxact.linear_cross_entropy(x, w, labels),
    "jaxact_tokens": _by_tokens,
  }
  if tokamax is not None:
    out["tokamax"] = _tokamax_head
  return out


HEAD_LABELS = {
  "plain": "x @ w, optax",
  "checkpoint": "jax.checkpoint(x @ w, optax)",
  "jaxact": "jaxact.linear_cross_entropy (blocked over V)",
  "jaxact_tokens": "jaxact's rule blocked over tokens",
  "tokamax": "tokamax.linear_softmax_cross_entropy_loss (chunked_xla)",
}


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
  total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
  return m.temp_size_in_bytes, total - m.alias_size_in_bytes


def section_head_h100(fits: bool = True) -> list[HeadRow]:
  tokens, dim = HEAD_GPU
  rows = []
  cap = gated.capacity()
  for vocab in GPU_VOCABS:
    for label, head in heads().items():
      temp, _ = _gpu_head_total(head, tokens, dim, vocab)
      row = HeadRow(vocab, label, temp, 0.0)
      if fits and label in ("plain", "checkpoint", "jaxact", "tokamax"):
        fit, total = gated.largest_fit_of(
          lambda t, head=head, vocab=vocab: _gpu_head_total(head, t, dim, vocab)[1], cap
        )
        row.fit = f"{fit} ({total / GiB:.1f} GiB)"
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------- the decoder


@dataclasses.dataclass(frozen=True)
class Decoder:
  batch: int
  seq: int
  dim: int
  hidden: int
  heads: int
  vocab: int
  blocks: int = 4
  dtype: str = "float32"


DECODER_CPU = Decoder(batch=4, seq=512, dim=512, hidden=1408, heads=8, vocab=32000)
# The main job's decoder (python -m benchmarks): one sequence, so that each point's step is compiled
# once for its memory and timed in the same run in seconds.
DECODER_MAIN = Decoder(batch=1, seq=512, dim=512, hidden=1408, heads=8, vocab=32000)
DECODER_GPU = Decoder(
  batch=16, seq=1024, dim=4096, hidden=14336, heads=32, vocab=128256, dtype="bfloat16"
)

BLOCK_SHAPES = {  # per block, stacked over the blocks
  "attn_norm": lambda c: (c.dim,),
  "wq": lambda c: (c.dim, c.dim),
  "wk": lambda c: (c.dim, c.dim),
  "wv": lambda c: (c.dim, c.dim),
  "wo": lambda c: (c.dim, c.dim),
  "mlp_norm": lambda c: (c.dim,),
  "w_gate": lambda c: (c.dim, c.hidden),
  "w_up": lambda c: (c.dim, c.hidden),
  "w_down": lambda c: (c.hidden, c.dim),
}


def decoder_shapes(c: Decoder, head: bool = True):
  """``(params, tokens, labels)`` as ShapeDtypeStructs; without `head`, no head parameter (a
  zero gradient of one would be an output buffer XLA could stash temporaries in)."""
  dt = jnp.dtype(c.dtype)
  blocks = {k: jax.ShapeDtypeStruct((c.blocks, *f(c)), dt) for k, f in BLOCK_SHAPES.items()}
  params = {
    "embed": jax.ShapeDtypeStruct((c.vocab, c.dim), dt),
    "blocks": blocks,
    "norm": jax.ShapeDtypeStruct((c.dim,), dt),
  }
  if head:
    params["head"] = jax.ShapeDtypeStruct((c.dim, c.vocab), dt)
  tokens = jax.ShapeDtypeStruct((c.batch, c.seq), jnp.int32)
  return params, tokens, tokens


def rms_norm(x, scale):
  """Flax's ``nn.RMSNorm``: statistics in float32, the scale applied in x's dtype."""
  return gated.rms_norm(x) * scale


def jaxact_rms_norm(x, scale):
  """:func:`jaxact.rms_norm` (keeping its output), the scale in float32 or wider."""
  scale = scale.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jaxact.rms_norm(x, scale, epsilon=gated.EPS)


def nn_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def jaxact_attention(q, k, v):
  return jaxact.dot_product_attention(q, k, v, is_causal=True)


def _attention(x, p, heads, attention=nn_attention):
  """Causal self-attention; the output projection reads the 4-d O (B, T, N, H) as Flax's
  DenseGeneral and Gemma's einsum do (a reshape to (B, T, D) first would make a scanned stack keep
  jaxact's O twice: docs/attention.md)."""
  b, s, d = x.shape
  q, k, v = (jnp.dot(x, p[n]).reshape(b, s, heads, d // heads) for n in ("wq", "wk", "wv"))
  y = attention(q, k, v)
  return jnp.einsum("btnh,nhd->btd", y, p["wo"].reshape(heads, d // heads, d))


def _flax_mlp(h, p):
  return jnp.dot(jax.nn.silu(jnp.dot(h, p["w_gate"])) * jnp.dot(h, p["w_up"]), p["w_down"])


def _flax_mlp_named(h, p):
  """:func:`_flax_mlp` with its gate and up projections named, for a remat that saves them."""
  gate = checkpoint_name(jnp.dot(h, p["w_gate"]), gated.FLAX_CHECKPOINT_NAMES[0])
  up = checkpoint_name(jnp.dot(h, p["w_up"]), gated.FLAX_CHECKPOINT_NAMES[1])
  return jnp.dot(jax.nn.silu(gate) * up, p["w_down"])


def _jaxact_mlp(h, p):
  return jaxact.gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])


def make_block(mlp, heads: int, norm=rms_norm, attention=nn_attention):
  def block(x, p):
    x = x + _attention(norm(x, p["attn_norm"]), p, heads, attention)
    return x + mlp(norm(x, p["mlp_norm"]), p)

  return block


_REMAT = jax.checkpoint_policies.nothing_saveable
# The projections' outputs, not attention's batched logits (which dots_saveable would keep too).
_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
_SAVE = jax.checkpoint_policies.save_only_these_names
BODIES = {
  # label: (mlp, checkpoint policy or None, attention)
  "flax": (_flax_mlp, None, nn_attention),
  "flax_remat": (_flax_mlp, _REMAT, nn_attention),
  "flax_dots": (_flax_mlp, _DOTS, nn_attention),
  "jaxact": (_jaxact_mlp, None, nn_attention),
  "jaxact_remat": (_jaxact_mlp, _REMAT, nn_attention),
  "jaxact_attn": (_jaxact_mlp, None, jaxact_attention),
  "jaxact_attn_remat": (_jaxact_mlp, _REMAT, jaxact_attention),
  "flax_names": (_flax_mlp_named, _SAVE(*gated.FLAX_CHECKPOINT_NAMES), nn_attention),
  "jaxact_attn_dots": (_jaxact_mlp, _DOTS, jaxact_attention),
  "jaxact_attn_names": (_jaxact_mlp, _SAVE(*jaxact.GATED_CHECKPOINT_NAMES), jaxact_attention),
}
BODY_LABELS = {
  "flax": "Flax",
  "flax_remat": "Flax + block remat",
  "flax_dots": "Flax + remat, dots_saveable",
  "jaxact": "jaxact.gated_mlp",
  "jaxact_remat": "jaxact.gated_mlp + block remat",
  "jaxact_attn": "jaxact.gated_mlp + jaxact attention",
  "jaxact_attn_remat": "jaxact.gated_mlp + jaxact attention + block remat",
  "flax_names": "Flax + block remat saving the gate and up projections by name",
  "jaxact_attn_dots": "jaxact.gated_mlp + jaxact attention + remat, dots_saveable",
  "jaxact_attn_names": "jaxact.gated_mlp + jaxact attention + block remat saving a, b by name",
}
# The main job's frontier: each point (harness.frontier's keys) as (body, head). jaxact's bodies
# run with jaxact.rms_norm (decoder_norm); its `jaxact_nn_attn` points with jax.nn's attention.
FRONTIER = {
  "flax": ("flax", "plain"),
  "remat": ("flax_remat", "plain"),
  "dots": ("flax_dots", "plain"),
  "names": ("flax_names", "plain"),
  "jaxact": ("jaxact_attn", "fused"),
  "jaxact_remat": ("jaxact_attn_remat", "fused"),
  "jaxact_dots": ("jaxact_attn_dots", "fused"),
  "jaxact_names": ("jaxact_attn_names", "fused"),
  "jaxact_nn_attn": ("jaxact", "fused"),
  "jaxact_nn_attn_remat": ("jaxact_remat", "fused"),
}
HEADS = ("plain", "fused", "none")


def decoder_loss(c: Decoder, body: str, head: str, norm=rms_norm) -> Callable:
  """``loss(params, tokens, labels)`` of the decoder with one of :data:`BODIES` and
  :data:`HEADS`."""
  mlp, policy, attention = BODIES[body]
  block = make_block(mlp, c.heads, norm, attention)
  if policy is not None:
    block = jax.checkpoint(block, policy=policy)

  def loss(params, tokens, labels):
    x = params["embed"][tokens]
    x, _ = lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
    h = norm(x, params["norm"])
    if head == "plain":
      logits = jnp.dot(h, params["head"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    if head == "fused":
      return jaxact.linear_cross_entropy(h, params["head"], labels)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))  # no head

  return loss


def decoder_temp(c: Decoder, body: str, head: str, gpu: bool, norm=rms_norm) -> int:
  step = jax.value_and_grad(decoder_loss(c, body, head, norm))
  args = decoder_shapes(c, head=head != "none")
  if gpu:
    leaves, tree = jax.tree.flatten(args)

    def flat(*leaves):
      return step(*jax.tree.unflatten(tree, leaves))

    return support.compile_for(flat, leaves).memory_analysis().temp_size_in_bytes
  return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes


def decoder_norm(body: str):
  """The norm a body runs with: jaxact's for jaxact's bodies."""
  return jaxact_rms_norm if body.startswith("jaxact") else rms_norm


def decoder_args(c: Decoder, key=0):
  """Concrete ``(params, tokens, labels)`` of :func:`decoder_shapes`: norm scales of one, the
  embedding standard normal, every other weight scaled by its fan in."""
  shapes, tokens, _ = decoder_shapes(c)
  paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
  keys = jax.random.split(jax.random.key(key), len(paths) + 2)
  made = []
  for k, (path, leaf) in zip(keys, paths, strict=False):
    name = path[-1].key
    if "norm" in name:
      made.append(jnp.ones(leaf.shape, leaf.dtype))
    else:
      scale = 1.0 if name == "embed" else leaf.shape[-2] ** -0.5
      made.append((jax.random.normal(k, leaf.shape, jnp.float32) * scale).astype(leaf.dtype))
  ids = jax.random.randint(keys[-2], tokens.shape, 0, c.vocab, tokens.dtype)
  labels = jax.random.randint(keys[-1], tokens.shape, 0, c.vocab, tokens.dtype)
  return jax.tree.unflatten(tree, made), ids, labels


def decoder_frontier(c: Decoder, runs: int, warmup: bool = True) -> tuple[float, dict[str, tuple]]:
  """``(Flax's step in seconds, {point: (temp bytes, step time / Flax's, its rounds' ratios)})``
  for every point of :data:`FRONTIER` on CPU: each step compiled once, its memory analysis read
  and the compiled programs timed, alternated, the ratios taken within rounds."""
  args = decoder_args(c)
  temps, calls = {}, []
  for key, (body, head) in FRONTIER.items():
    step = jax.value_and_grad(decoder_loss(c, body, head, decoder_norm(body)))
    compiled = jax.jit(step).lower(*decoder_shapes(c)).compile()
    temps[key] = compiled.memory_analysis().temp_size_in_bytes
    calls.append(functools.partial(compiled, *args))
  seconds, by_round = timing.alternated_round_ratios(calls, runs, warmup)
  return seconds, timing.with_ratios(temps, by_round)


def section_decoder(gpu: bool = False, bodies=tuple(BODIES)[:5]) -> dict[tuple[str, str], int]:
  c = DECODER_GPU if gpu else DECODER_CPU
  return {(b, h): decoder_temp(c, b, h, gpu) for b in bodies for h in HEADS}


# ----------------------------------------------------------------------------- rendering


TIED = (2048, 512)  # tokens, D
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
  rows = ["| head | compiled temp (MiB) |", "|---|---|"]
  for name, head in TIED_HEADS.items():
    w = jax.ShapeDtypeStruct((dim, vocab) if name.startswith("untied") else (vocab, dim), dtype)
    step, args = jax.grad(head, argnums=(0, 1)), (w, x, labels)
    compile_ = support.compile_for if gpu else lambda f, a: jax.jit(f).lower(*a).compile()
    compiled = compile_(step, args)
    rows.append(f"| {name} | {compiled.memory_analysis().temp_size_in_bytes / MiB:.1f} |")
  return rows


def render_head(rows: list[HeadRow], unit=MiB, gpu=False) -> list[str]:
  name = "GiB" if unit == GiB else "MiB"
  head = f"| V | head | compiled temp ({name}) | vs plain | largest array ({name}) |"
  sep = "|---|---|---|---|---|"
  if gpu:
    head, sep = head + " fits an 80 GB H100 (tokens) |", sep + "---|"
  else:
    head, sep = head + " loss vs plain (rel.) | step time vs plain |", sep + "---|---|"
  lines = [head, sep]
  plain = {r.vocab: r.temp for r in rows if r.peer == "plain"}
  for r in rows:
    cells = [
      str(r.vocab),
      HEAD_LABELS[r.peer],
      f"{r.temp / unit:.1f}",
      f"{r.temp / plain[r.vocab]:.3f}",
      f"{r.largest / unit:.1f}" if r.largest else "—",
    ]
    if gpu:
      cells.append(r.fit or "—")
    else:
      cells.append("—" if r.error is None else f"{r.error:.1e}")
      cells.append("—" if r.ratio is None else f"{r.ratio:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def render_decoder(temps: dict[tuple[str, str], int], unit=MiB) -> list[str]:
  name = "GiB" if unit == GiB else "MiB"
  lines = [
    f"| body | plain head ({name}) | fused head ({name}) | no head ({name}) | fused / plain "
    "| the plain head's share | fused / no head |",
    "|---|---|---|---|---|---|---|",
  ]
  for body in dict.fromkeys(b for b, _ in temps):
    p, f, n = (temps[body, h] for h in HEADS)
    lines.append(
      f"| {BODY_LABELS[body]} | {p / unit:.1f} | {f / unit:.1f} | {n / unit:.1f} | "
      f"{f / p:.2f} | {(p - n) / p:.0%} | {f / n:.3f} |"
    )
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks lce", description=__doc__)
  parser.add_argument(
    "--sections",
    default="head,head-h100,decoder,decoder-h100",
    help="comma-separated: head, head-h100, decoder, decoder-h100, tied",
  )
  parser.add_argument("--runs", type=int, default=5, help="timing rounds (head)")
  parser.add_argument(
    "--vocabs", default=",".join(map(str, CPU_VOCABS)), help="comma-separated V (head)"
  )
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  gpu_compiler = support.use_gpu_compiler()  # before the first computation starts jax
  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, tokamax "
    f"{getattr(tokamax, '__version__', 'not installed')}"
  )
  if "head" in sections:
    print(f"\n## Head alone, CPU float32, {HEAD_CPU[0]} tokens, D = {HEAD_CPU[1]}\n")
    vocabs = tuple(int(v) for v in args.vocabs.split(","))
    print("\n".join(render_head(section_head(args.runs, vocabs))))
  if {"head-h100", "decoder-h100"} & set(sections) and not gpu_compiler:
    print("the GPU sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  if "head-h100" in sections:
    print(f"\n## Head alone, compiled for an H100, bfloat16, {HEAD_GPU[0]} tokens, D = 4096\n")
    print("\n".join(render_head(section_head_h100(), GiB, gpu=True)))
  if "decoder" in sections:
    print(f"\n## Decoder step, CPU float32, {DECODER_CPU}\n")
    print("\n".join(render_decoder(section_decoder())))
  if "decoder-h100" in sections:
    print(f"\n## Decoder step, compiled for an H100, {DECODER_GPU}\n")
    print("\n".join(render_decoder(section_decoder(gpu=True), GiB)))
  if "tied" in sections:
    print(f"\n## Tied head, {TIED[0]} tokens, D = {TIED[1]}: CPU float32, V = 32000\n")
    print("\n".join(section_tied(gpu=False)))
    if gpu_compiler:
      print("\n## Tied head, compiled for an H100, bfloat16, V = 32768\n")
      print("\n".join(section_tied(gpu=True)))
  return 0
