"""A trimmed Gemma as Flax's ``examples/gemma`` writes it, in two builds with one parameter tree:
the example's computation (``original``) and its port to jaxact (``jaxact``); what each is and
what ``python -m benchmarks gemma`` measures of them: :mod:`benchmarks.gemma`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxact
import jaxact.nnx as jnnx
from support.flax_gemma import example_attention, make_causal_attn_mask

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 4
  vocab: int = 32000
  embed: int = 512
  hidden: int = 2048
  heads: int = 8
  kv_heads: int = 2
  head_dim: int = 64
  window: int = 128  # the sliding window of the local layers (every other one)
  attn_cap: float | None = 50.0
  final_cap: float | None = 30.0
  smoothing: float = 0.1  # T5X's label smoothing, as train.py applies it
  batch: int = 4
  length: int = 512
  dtype: jnp.dtype = jnp.float32  # activations; the weights are float32
  remat: bool = False
  block_sizes: tuple[int, int] | None = None  # the port's attention blocks (None: the default)
  example_attention: bool = False  # the port, but with the example's attention

  def local(self, i: int) -> bool:
    return i % 2 == 0


# The check's model. Its window of 4 leaves the last padding tokens of a padded row no key at all:
# there jaxact's attention gives 0 where the example's averages the values (neither counts).
SMALL = Config(
  layers=2, vocab=512, embed=64, hidden=256, heads=4, kv_heads=2, head_dim=16, window=4, batch=8,
  length=32,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Layout:
  """The example's fsdp_tp_sharding: weights' model dimension over `fsdp`, heads, hidden and
  vocabulary over `tensor`; activations (batch, length, features) with the batch over `fsdp` and
  the features over `tensor` (``act_btd``). None everywhere: unsharded."""

  fsdp: str | None = "fsdp"
  tensor: str | None = "tensor"

  @property
  def act_btd(self):
    return P(self.fsdp, None, self.tensor)

  @property
  def act_btf(self):
    return P(self.fsdp, None, self.tensor)

  @property
  def act_btnh(self):
    return P(self.fsdp, None, self.tensor, None)

  @property
  def act_cbtkh(self):
    return P(None, self.fsdp, None, self.tensor, None)


def _meta(layout: Layout | None, *names) -> dict:
  """`out_sharding` metadata of a parameter: the layout's axes by role (None: no metadata)."""
  if layout is None:
    return {}
  axes = {"fsdp": layout.fsdp, "tensor": layout.tensor, None: None}
  return {"out_sharding": P(*(axes[n] for n in names))}


def _out(layout: Layout | None, name: str):
  return None if layout is None else getattr(layout, name)


# --------------------------------------------------------------------------------- modules


class GemmaNorm(nnx.Module):
  """The example's RMS norm: ``x_hat * (1 + scale)``, the scale initialised to zeros."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs, metadata: dict, dtype):
    del rngs  # zeros need no key
    self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32), **metadata)
    self.dtype = dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (normed * (1 + self.scale[...])).astype(self.dtype)


def norm(config: Config, use_jaxact: bool, layout, rngs):
  metadata = _meta(layout, "tensor")
  if use_jaxact:  # Gemma's 1 + scale: scale_offset=1.0, and the zeros the example initialises
    return jnnx.RMSNorm(
      config.embed,
      scale_offset=1.0,
      scale_init=nnx.initializers.zeros,
      scale_metadata=metadata,
      dtype=config.dtype,
      rngs=rngs,
    )
  return GemmaNorm(config.embed, rngs=rngs, metadata=metadata, dtype=config.dtype)


def rope(x, positions, max_wavelength: float = 10_000.0):
  """Rotary embeddings of (B, T, heads, H) by (B, T) positions, half-split."""
  half = x.shape[-1] // 2
  fraction = 2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1]
  angle = positions[..., None, None].astype(jnp.float32) / max_wavelength**fraction
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, config: Config, local: bool, use_jaxact: bool, layout, rngs):
    c = config
    self.config, self.local, self.use_jaxact, self.layout = c, local, use_jaxact, layout
    einsum = lambda spec, shape, *names: nnx.Einsum(
      spec,
      shape,
      dtype=c.dtype,
      rngs=rngs,
      kernel_metadata=_meta(layout, *names),
    )
    self.q_einsum = einsum("BTD,NDH->BTNH", (c.heads, c.embed, c.head_dim), "tensor", "fsdp", None)
    self.kv_einsum = einsum(
      "BTD,CKDH->CBTKH", (2, c.kv_heads, c.embed, c.head_dim), None, "tensor", "fsdp", None
    )
    self.attn_vec_einsum = einsum(
      "BTNH,NHD->BTD", (c.heads, c.head_dim, c.embed), "tensor", None, "fsdp"
    )

  def __call__(self, x, positions, input_mask):
    c, layout = self.config, self.layout
    q = self.q_einsum(x, out_sharding=_out(layout, "act_btnh"))
    k, v = self.kv_einsum(x, out_sharding=_out(layout, "act_cbtkh"))
    q, k = rope(q, positions), rope(k, positions)
    window = c.window if self.local else None
    if self.use_jaxact and not c.example_attention:
      # The model's mask is exactly causal and padding (make_causal_attn_mask): is_causal with the
      # padding as a key mask, and the window's left half (its right half is above the diagonal).
      encoded = jaxact.dot_product_attention(
        q,
        k,
        v,
        mask=input_mask[:, None, None, :],  # keys that are not padding
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        logits_soft_cap=c.attn_cap,
        scale=c.head_dim**-0.5,
        block_sizes=c.block_sizes,
        out_sharding=_out(layout, "act_btnh"),
      )
    else:
      encoded = example_attention(
        q,
        k,
        v,
        make_causal_attn_mask(input_mask),
        query_pre_attn_scalar=c.head_dim**-0.5,
        attn_logits_soft_cap=c.attn_cap,
        sliding_window_size=window,
      )
    return self.attn_vec_einsum(encoded, out_sharding=_out(layout, "act_btd"))


class FeedForward(nnx.Module):
  """The example's GeGLU MLP: three ``nnx.Linear`` without bias."""

  def __init__(self, config: Config, layout, rngs):
    c = config

    def linear(n_in, n_out, *names):
      return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=c.dtype,
        rngs=rngs,
        kernel_metadata=_meta(layout, *names),
      )

    self.gate_proj = linear(c.embed, c.hidden, "fsdp", "tensor")
    self.up_proj = linear(c.embed, c.hidden, "fsdp", "tensor")
    self.down_proj = linear(c.hidden, c.embed, "tensor", "fsdp")
    self.layout = layout

  def __call__(self, x):
    gate = nnx.gelu(self.gate_proj(x, out_sharding=_out(self.layout, "act_btf")))
    hidden = gate * self.up_proj(x, out_sharding=_out(self.layout, "act_btf"))
    return self.down_proj(hidden, out_sharding=_out(self.layout, "act_btd"))


def mlp(config: Config, use_jaxact: bool, layout, rngs):
  if not use_jaxact:
    return FeedForward(config, layout, rngs)
  # The same three kernels (gate_proj, up_proj, down_proj), computed as one gated_mlp.
  return jnnx.GatedMLP(
    config.embed,
    config.hidden,
    activation="gelu",
    dtype=config.dtype,
    rngs=rngs,
    kernel_metadata=_meta(layout, "fsdp", "tensor"),
    down_kernel_metadata=_meta(layout, "tensor", "fsdp"),
  )


class Block(nnx.Module):
  def __init__(self, config: Config, i: int, use_jaxact: bool, layout, rngs):
    self.pre_attention_norm = norm(config, use_jaxact, layout, rngs)
    self.attn = Attention(config, config.local(i), use_jaxact, layout, rngs)
    self.post_attention_norm = norm(config, use_jaxact, layout, rngs)
    self.pre_ffw_norm = norm(config, use_jaxact, layout, rngs)
    self.mlp = mlp(config, use_jaxact, layout, rngs)
    self.post_ffw_norm = norm(config, use_jaxact, layout, rngs)
    self.layout = layout

  def __call__(self, x, positions, input_mask):
    x = x + self.post_attention_norm(self.attn(self.pre_attention_norm(x), positions, input_mask))
    h = self.pre_ffw_norm(x)
    if isinstance(self.mlp, jnnx.GatedMLP):
      h = self.mlp(h, out_sharding=_out(self.layout, "act_btd"))
    else:
      h = self.mlp(h)
    return x + self.post_ffw_norm(h)


class Gemma(nnx.Module):
  def __init__(self, config: Config, *, use_jaxact: bool, layout=None, rngs: nnx.Rngs):
    self.config, self.use_jaxact, self.layout = config, use_jaxact, layout
    self.embedder = nnx.Embed(
      config.vocab,
      config.embed,
      dtype=config.dtype,
      rngs=rngs,
      embedding_metadata=_meta(layout, "tensor", "fsdp"),
    )
    self.layers = nnx.List(
      [Block(config, i, use_jaxact, layout, rngs) for i in range(config.layers)]
    )
    self.final_norm = norm(config, use_jaxact, layout, rngs)

  def __call__(self, tokens, targets, weights):
    """``(loss, (correct, counted))``: T5X's weighted loss and the accuracy's counts."""
    c = self.config
    input_mask = tokens > 0
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embedder(tokens, out_sharding=_out(self.layout, "act_btd")) * math.sqrt(c.embed)
    for block in self.layers:
      if c.remat:
        x = nnx.remat(lambda block, x: block(x, positions, input_mask))(block, x)
      else:
        x = block(x, positions, input_mask)
    x = self.final_norm(x)
    if self.use_jaxact:
      loss, predictions = jnnx.attend_cross_entropy(
        self.embedder,
        x,
        targets,
        weights=weights,
        label_smoothing=c.smoothing,
        label_smoothing_style="t5x",
        logit_soft_cap=c.final_cap,
        return_predictions=True,
      )
    else:
      logits = self.embedder.attend(x, out_sharding=_out(self.layout, "act_btd"))
      if c.final_cap is not None:
        logits = jnp.tanh(logits / c.final_cap) * c.final_cap
      loss = t5x_loss(logits.astype(jnp.float32), targets, weights, c.smoothing)
      predictions = jnp.argmax(logits, -1)
    correct = jnp.sum(jnp.where(weights > 0, predictions == targets, False))
    return loss, (correct, jnp.sum(weights > 0))


def t5x_loss(logits, targets, weights, smoothing: float):
  """train.py's weighted cross-entropy with T5X's smoothing, reduced to its mean over weights."""
  vocab = logits.shape[-1]
  confidence = 1.0 - smoothing
  low = smoothing / (vocab - 1)
  constant = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  loss = -jnp.sum(soft * jax.nn.log_softmax(logits), -1) - constant
  return jnp.sum(loss * weights) / jnp.sum(weights)


# ------------------------------------------------------------------------------ the step


def batch(config: Config, seed: int = 0):
  """Tokens (0 is padding: the last few of every other row), next-token targets, weights."""
  rng = np.random.default_rng(seed)
  b, t = config.batch, config.length
  tokens = rng.integers(1, config.vocab, (b, t + 1))
  tokens[1::2, -max(1, t // 8) :] = 0
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  weights = (inputs > 0).astype(np.float32)
  return jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32), jnp.asarray(weights)


def loss_and_grads(graphdef, rest):
  """``step(params, tokens, targets, weights) -> ((loss, metrics), grads)``."""

  def loss(params, *data):
    return nnx.merge(graphdef, params, rest)(*data)

  return jax.value_and_grad(loss, has_aux=True)


def build(config: Config, use_jaxact: bool, layout=None, seed: int = 0, mesh=None) -> Gemma:
  """The model with parameters drawn on the host, as a checkpoint's values would be loaded: under
  a mesh each is placed as its ``out_sharding`` metadata says (``nnx.get_named_sharding``). The
  model is built abstractly (``nnx.eval_shape``): drawn eagerly, every initializer compiles a
  program of its own, longer than the check itself."""
  model = nnx.eval_shape(
    lambda: Gemma(config, use_jaxact=use_jaxact, layout=layout, rngs=nnx.Rngs(0))
  )
  state = nnx.state(model, nnx.Param)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    scale = 0.1 if name.endswith("['scale']") else config.embed**-0.5
    return (rng.standard_normal(leaf.shape) * scale).astype(leaf.dtype)

  values = jax.tree_util.tree_map_with_path(draw, state)
  if mesh is not None:
    shardings = nnx.get_named_sharding(state, mesh)
    values = jax.tree.map(jax.device_put, values, shardings)
  else:
    values = jax.tree.map(jnp.asarray, values)
  nnx.update(model, values)
  return model


def split(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest


def abstract(config: Config, use_jaxact: bool):
  """The model's graph, abstract parameters and other state (no arrays created)."""
  model = nnx.eval_shape(lambda: Gemma(config, use_jaxact=use_jaxact, rngs=nnx.Rngs(0)))
  return split(model)
