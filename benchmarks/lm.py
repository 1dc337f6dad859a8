"""`python -m benchmarks lm [--mlp flax,jaxact] [--steps N] [--out DIR]`: a training check.

A small Llama-style language model (byte vocabulary, rotary embeddings, pre-RMSNorm attention and
gated MLP blocks) trained on real English text that ships with Python: the documentation topics of
``pydoc_data.topics`` (~490 KB, no download). The model is trained once per MLP implementation
from one initialisation on one sequence of batches with optax's adamw:

- ``flax``: three ``nn.Dense`` named gate_proj / up_proj / down_proj and ``jax.nn.silu``;
- ``jaxact``: the same parameters through one :func:`jaxact.gated_mlp`;
- ``denseact``: ``jaxact.linen.DenseAct`` (silu) for the gate, ``nn.Dense`` for up and down.

A name with ``+lce`` (``flax+lce``) computes the head and its loss as one
``jaxact.linear_cross_entropy`` (``jaxact.linen.LMHead``, the same ``lm_head`` parameters; with
``--tied``, the embedding's table transposed). All have one parameter tree, so one init serves
all. Every run's loss is logged each step; the script prints each run's largest absolute and
relative loss difference from the first run, its final training loss and its held-out loss (the
last 10% of the text), and writes DIR/lm_losses.csv and DIR/lm_loss.png. ``--reference`` adds
the scale that float32 rounding alone gives: the first run again from an initialisation moved by
one float32 ulp per parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from pydoc_data.topics import topics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxact
import jaxact.linen as jnn
from benchmarks.harness import plots, rows
from benchmarks.tables import lm as page

VOCAB = 256  # UTF-8 bytes


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 4
  dim: int = 128
  hidden: int = 344  # Llama's 8/3 * dim, rounded to a multiple of 8
  heads: int = 4
  context: int = 128
  batch: int = 16
  steps: int = 300
  lr: float = 3e-3
  weight_decay: float = 0.1
  tied: bool = False
  seed: int = 0


# The MLPs. One parameter tree for all: {gate_proj, up_proj, down_proj: {kernel}}, as
# transformers' FlaxLlamaMLP names them.


class FlaxMLP(nn.Module):
  hidden_features: int

  @nn.compact
  def __call__(self, x):
    gate = nn.Dense(self.hidden_features, use_bias=False, name="gate_proj")(x)
    up = nn.Dense(self.hidden_features, use_bias=False, name="up_proj")(x)
    return nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(jax.nn.silu(gate) * up)


class DenseActMLP(nn.Module):
  hidden_features: int

  @nn.compact
  def __call__(self, x):
    gate = jnn.DenseAct(self.hidden_features, activation="silu", use_bias=False, name="gate_proj")(
      x
    )
    up = nn.Dense(self.hidden_features, use_bias=False, name="up_proj")(x)
    return nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(gate * up)


MLPS: dict[str, type[nn.Module]] = {
  "flax": FlaxMLP,
  "jaxact": jnn.GatedMLP,
  "denseact": DenseActMLP,
}


# The model: transformers' Llama without its options.


def rotary(x, theta: float = 10000.0):
  """Rotary position embedding of x (batch, time, heads, head_dim), Llama's rotate-half form."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq
  cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x):
    batch, length, dim = x.shape
    shape = (batch, length, self.heads, dim // self.heads)
    q, k, v = (nn.Dense(dim, use_bias=False, name=f"{n}_proj")(x).reshape(shape) for n in "qkv")
    y = jax.nn.dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
    return nn.Dense(dim, use_bias=False, name="o_proj")(y.reshape(x.shape))


class Block(nn.Module):
  config: Config
  mlp: type[nn.Module]

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.config.heads, name="self_attn")(nn.RMSNorm(name="input_layernorm")(x))
    h = nn.RMSNorm(name="post_attention_layernorm")(x)
    return x + self.mlp(self.config.hidden, name="mlp")(h)


class LM(nn.Module):
  config: Config
  mlp: type[nn.Module]
  fused_head: bool = False  # with labels: the loss from jaxact.linear_cross_entropy

  @nn.compact
  def __call__(self, tokens, labels=None):
    """The logits, or with `labels` (and a fused head) the mean loss."""
    embed = nn.Embed(
      VOCAB, self.config.dim, embedding_init=nn.initializers.normal(0.02), name="embed_tokens"
    )
    x = embed(tokens)
    for i in range(self.config.layers):
      x = Block(self.config, self.mlp, name=f"layers_{i}")(x)
    x = nn.RMSNorm(name="norm")(x)
    if labels is not None and self.config.tied:
      return jaxact.linear_cross_entropy(x, embed.embedding.T, labels)
    if self.config.tied:
      return embed.attend(x)
    return jnn.LMHead(VOCAB, use_bias=False, name="lm_head")(x, labels)


# Data: the Python documentation's topic texts, bytes, the last 10% held out.


def corpus() -> tuple[np.ndarray, np.ndarray]:
  text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
  data = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
  split = int(0.9 * len(data))
  return data[:split], data[split:]


def train_batches(data: np.ndarray, config: Config) -> np.ndarray:
  """(steps, batch, context + 1) random windows, drawn once so that every run sees the same."""
  rng = np.random.default_rng(config.seed)
  starts = rng.integers(0, len(data) - config.context - 1, (config.steps, config.batch))
  return data[starts[..., None] + np.arange(config.context + 1)]


def heldout_batches(data: np.ndarray, config: Config) -> np.ndarray:
  """Every non-overlapping window of the held-out text, in batches."""
  n = (len(data) - 1) // config.context // config.batch * config.batch
  starts = np.arange(n) * config.context
  windows = data[starts[:, None] + np.arange(config.context + 1)]
  return windows.reshape(-1, config.batch, config.context + 1)


# Training.


def loss_fn(model: nn.Module, params, batch):
  if model.fused_head:
    return model.apply({"params": params}, batch[:, :-1], batch[:, 1:])
  logits = model.apply({"params": params}, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def model_of(name: str, config: Config) -> nn.Module:
  """``"flax"``, ``"jaxact+lce"``, ...: the MLP, and a fused head with ``+lce``."""
  mlp, _, head = name.partition("+")
  if mlp not in MLPS or head not in ("", "lce"):
    raise ValueError(
      f"--mlp {name!r} is not known; choose from: {', '.join(MLPS)}, each optionally with +lce"
    )
  return LM(config, MLPS[mlp], fused_head=head == "lce")


def optimizer(config: Config) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, config.lr, max(1, config.steps // 10), config.steps, end_value=config.lr / 10
  )
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(schedule, b2=0.95, weight_decay=config.weight_decay),
  )


@dataclasses.dataclass
class Run:
  name: str
  losses: np.ndarray  # training loss of every step, before that step's update
  heldout: float  # after the last step
  seconds: float
  grads: dict  # the gradient of the first step


def grad_difference(grads, base) -> float:
  """The largest gradient difference, relative to the largest gradient entry of its parameter."""
  rel = jax.tree.map(lambda g, b: jnp.max(jnp.abs(g - b)) / jnp.max(jnp.abs(b)), grads, base)
  return float(max(jax.tree.leaves(rel)))


def train(name: str, model: nn.Module, params, batches, heldout, config: Config) -> Run:
  opt = optimizer(config)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  evaluate = jax.jit(lambda params, batch: loss_fn(model, params, batch))
  opt_state = opt.init(params)
  losses = []
  start = time.perf_counter()
  for i, batch in enumerate(batches):
    params, opt_state, loss, grads = step(params, opt_state, batch)
    losses.append(loss)
    if i == 0:
      first_grads = grads
    if i % 50 == 0 or i == len(batches) - 1:
      print(f"  {name:>8} step {i:4d}  loss {float(loss):.4f}", flush=True)
  held = float(np.mean([evaluate(params, b) for b in heldout]))
  seconds = time.perf_counter() - start
  return Run(name, np.asarray(jax.device_get(losses)), held, seconds, first_grads)


def ulp_nudge(params, seed: int):
  """Each parameter moved by one float32 ulp up or down at random: rounding-sized noise."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  moved = [
    jnp.nextafter(p, jnp.where(jax.random.bernoulli(k, shape=p.shape), jnp.inf, -jnp.inf))
    for p, k in zip(leaves, keys, strict=True)
  ]
  return jax.tree.unflatten(tree, moved)


def main(argv: list[str] | None = None) -> list[Run]:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks lm", description=__doc__.split("\n")[0]
  )
  parser.add_argument(
    "--mlp",
    default="flax,jaxact",
    help=f"comma-separated MLPs to train, the first is the reference; of: {', '.join(MLPS)}, "
    "each optionally with +lce (the fused head and loss)",
  )
  parser.add_argument("--steps", type=int, default=Config.steps)
  parser.add_argument("--batch", type=int, default=Config.batch)
  parser.add_argument("--layers", type=int, default=Config.layers)
  parser.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
  parser.add_argument(
    "--reference",
    action="store_true",
    help="also train the first MLP from an init moved by one ulp per parameter",
  )
  parser.add_argument("--out", default="bench-out", help="folder for lm_losses.csv and lm_loss.png")
  args = parser.parse_args(argv)
  names = args.mlp.split(",")
  config = Config(steps=args.steps, batch=args.batch, layers=args.layers, tied=args.tied)
  try:
    models = {name: model_of(name, config) for name in names}
  except ValueError as e:
    parser.error(str(e))

  train_data, heldout_data = corpus()
  batches = train_batches(train_data, config)
  heldout = heldout_batches(heldout_data, config)
  params = models[names[0]].init(jax.random.key(config.seed), batches[0, :, :-1])["params"]
  for name, model in models.items():
    shapes = jax.eval_shape(model.init, jax.random.key(config.seed), batches[0, :, :-1])["params"]
    if jax.tree.map(jnp.shape, shapes) != jax.tree.map(jnp.shape, params):
      raise ValueError(f"the {name} model's parameters differ from the {names[0]} model's")
  n_params = sum(p.size for p in jax.tree.leaves(params))
  print(
    f"{config}\n{n_params:,} parameters; {len(train_data):,} training bytes, "
    f"{len(heldout_data):,} held out ({heldout.shape[0] * heldout.shape[1]} windows)"
  )

  runs = [train(name, models[name], params, batches, heldout, config) for name in names]
  if args.reference:
    nudged = ulp_nudge(params, config.seed + 1)
    runs.append(train(f"{names[0]}+ulp", models[names[0]], nudged, batches, heldout, config))

  base = runs[0]
  # Adam's update hardly changes when a gradient is scaled, so the first step's gradients are
  # compared directly as well.
  for run in runs:
    diff = np.abs(run.losses - base.losses)
    rows.add(
      "runs",
      run.name,
      steps=config.steps,
      max_abs_loss_diff=diff.max(),
      max_rel_loss_diff=(diff / base.losses).max(),
      step0_grad_diff=grad_difference(run.grads, base.grads),
      final_loss=run.losses[-1],
      heldout_loss=run.heldout,
      seconds=run.seconds,
    )
  print("\n" + "\n".join(page.tables(rows.current().rows)))

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  table = np.column_stack([np.arange(config.steps)] + [r.losses for r in runs])
  header = ",".join(["step"] + [r.name for r in runs])
  np.savetxt(out / "lm_losses.csv", table, delimiter=",", header=header, comments="", fmt="%.9g")
  plots.lm_loss({r.name: r.losses for r in runs}, out / "lm_loss.png")
  print(f"wrote {out / 'lm_losses.csv'} and {out / 'lm_loss.png'}")
  return runs
