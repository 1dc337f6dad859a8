"""The LM decoder step the benchmarks share: a Llama-style decoder (embedding, scanned blocks of
RMS norm, causal attention, a gated MLP; final norm and head), its bodies (Flax's composition
under each remat policy, jaxact's) and heads (plain, fused, none), its compiled temp and its
memory-time frontier (the main job's). ``python -m benchmarks lce --sections decoder`` prints
its table."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxact
import support
from benchmarks import gated
from benchmarks.harness import chips, rows, timing
from benchmarks.tables import lce as page

MiB, GiB = 2**20, 2**30


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


def _jaxact_mlp(h, p, residuals="projections"):
  return jaxact.gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"], residuals=residuals)


def make_block(mlp, heads: int, norm=rms_norm, attention=nn_attention):
  def block(x, p):
    x = x + _attention(norm(x, p["attn_norm"]), p, heads, attention)
    return x + mlp(norm(x, p["mlp_norm"]), p)

  return block


_REMAT = jax.checkpoint_policies.nothing_saveable
# The projections' outputs, not attention's batched logits (which dots_saveable would keep too).
_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
_SAVE = jax.checkpoint_policies.save_only_these_names
# What jaxact's ops keep, by name: under a remat saving them a block recomputes only its q, k, v
# projections (and its plain ops), not the attention, the norms or the gated MLP's a, b.
_JAXACT_NAMES = (
  *jaxact.GATED_CHECKPOINT_NAMES,
  *jaxact.ATTENTION_CHECKPOINT_NAMES,
  *jaxact.NORM_CHECKPOINT_NAMES,
)
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
  "jaxact_attn_names": (_jaxact_mlp, _SAVE(*_JAXACT_NAMES), jaxact_attention),
  "jaxact_attn_gated_names": (
    _jaxact_mlp,
    _SAVE(*jaxact.GATED_CHECKPOINT_NAMES),
    jaxact_attention,
  ),
  "jaxact_attn_input": (
    functools.partial(_jaxact_mlp, residuals="input"),
    None,
    jaxact_attention,
  ),
}
BODY_LABELS = page.BODY_LABELS
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
  "jaxact_gated_names": ("jaxact_attn_gated_names", "fused"),
  "jaxact_input": ("jaxact_attn_input", "fused"),
  "jaxact_nn_attn": ("jaxact", "fused"),
  "jaxact_nn_attn_remat": ("jaxact_remat", "fused"),
}
HEADS = page.HEADS


def decoder_loss(c: Decoder, body: str, head: str, norm=rms_norm, activations=None) -> Callable:
  """``loss(params, tokens, labels)`` of the decoder with one of :data:`BODIES` and
  :data:`HEADS`; `activations` (a ``PartitionSpec`` of the (batch, T, D) residual stream, under a
  mesh): the stream constrained to it after the embedding and each block, as MaxText's activation
  rules place it (else XLA may shard it as the weights are, FSDP's axis over D)."""
  mlp, policy, attention = BODIES[body]
  block = make_block(mlp, c.heads, norm, attention)
  if policy is not None:
    block = jax.checkpoint(block, policy=policy)

  def place(x):
    return x if activations is None else jax.lax.with_sharding_constraint(x, activations)

  def loss(params, tokens, labels):
    x = place(params["embed"][tokens])
    x, _ = lax.scan(lambda x, p: (place(block(x, p)), None), x, params["blocks"])
    h = norm(x, params["norm"])
    if head == "plain":
      logits = jnp.dot(h, params["head"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    if head == "fused":
      return jaxact.linear_cross_entropy(h, params["head"], labels)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))  # no head

  return loss


def decoder_step(c: Decoder, body: str, head: str, norm=rms_norm):
  """``(the training step of flat leaves, the leaves' shapes)``."""
  step = jax.value_and_grad(decoder_loss(c, body, head, norm))
  leaves, tree = jax.tree.flatten(decoder_shapes(c, head=head != "none"))

  def flat(*leaves):
    return step(*jax.tree.unflatten(tree, leaves))

  return flat, leaves


def decoder_temp(c: Decoder, body: str, head: str, gpu: bool, norm=rms_norm) -> int:
  step, leaves = decoder_step(c, body, head, norm)
  compiled = support.compile_for(step, leaves) if gpu else jax.jit(step).lower(*leaves).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def decoder_figures(c: Decoder, body: str, head: str, chip: str, norm=rms_norm, cache=None) -> dict:
  """:func:`decoder_temp`'s step compiled for TPU `chip` instead: its ``harness.chips.figures``
  (temp, footprint, the ESTIMATED step time)."""
  return chips.figures(*decoder_step(c, body, head, norm), chip, cache=cache)


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
  return timing.frontier_points(temps, calls, runs, warmup)


def section_decoder(gpu: bool = False, bodies=tuple(BODIES)[:5], chip=None, cache=None) -> dict:
  """``{(body, head): its step's temp}`` on CPU or compiled for an H100 (`gpu`); with `chip`,
  compiled for that TPU chip at the H100's sizes: ``{(body, head): its figures}``."""
  if chip is not None:
    c = DECODER_GPU
    return {(b, h): decoder_figures(c, b, h, chip, cache=cache) for b in bodies for h in HEADS}
  c = DECODER_GPU if gpu else DECODER_CPU
  return {(b, h): decoder_temp(c, b, h, gpu) for b in bodies for h in HEADS}


def record_decoder(section: str, temps: dict, c: Decoder, chip: str | None = None) -> list[dict]:
  """The decoder's rows, a row a (body, head): its compiled temp (`c`: its sizes), or with `chip`
  its figures compiled for that TPU chip."""
  return [
    rows.add(
      section,
      f"{chip}, {body}, {head}" if chip else f"{body}, {head}",
      config=str(c),
      body=body,
      head=head,
      **({"chip": chip, **t} if chip else {"temp_bytes": t}),
    )
    for (body, head), t in temps.items()
  ]
