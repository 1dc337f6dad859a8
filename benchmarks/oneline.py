"""`python -m benchmarks oneline [--sections lm1b,lm1b-h100,lm1b-nnx,resnet,...]`: Flax's examples
trained under jaxact's one line (``jaxact.linen.intercept``; for nnx ``jaxact.nnx.swap`` and
``jaxact.nnx.route_activations``), the models as written.

The compiled temp of one training step (``jit(value_and_grad)``, dropout on as the examples train)
of Flax's lm1b LM (its default size: 6 blocks, D 512, MLP 2048, 8 heads, V 30000; 32 sequences of
128 tokens, the example's per-device batch) and ImageNet ResNet-50 (32 images of 224 x 224, batch
statistics under the example's ``axis_name``), the models of ``tests/lm1b_example.py`` and
``tests/resnet_example.py``. Ways: the example as written; the same with each block under
``nn.remat`` (the user's own saving); the one line; the one line with remat; and for lm1b the one
line with the head's one change (``jaxact.linen.LMHead`` given the labels: the loss without the
``(tokens x vocabulary)`` logits). Sections ``lm1b-nnx``: Flax's ``examples/lm1b_nnx`` model
(``tests/lm1b_nnx_example.py``) at the same size, dropout's keys passed to the call as its
``train.py`` does; ways: the example, the example with each block under ``nnx.remat``, swapped,
swapped and routed, swapped and routed with remat. On CPU in float32 and compiled for an H100 in
bfloat16.
Section ``time``: each example's CPU step time under the one line against as written (lm1b at 8
sequences, ResNet-50 at 8 images of 112 x 112; alternated rounds, the median ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import jax
import jax.numpy as jnp

import jaxact.linen as jnn
import jaxact.nnx as jnnx
import support
from benchmarks.harness import rows
from benchmarks.tables import oneline as page
from support import examples

SECTIONS = ("lm1b", "lm1b-h100", "lm1b-nnx", "lm1b-nnx-h100", "resnet", "resnet-h100", "time")
TIME_LM1B_BATCH, TIME_RESNET = 8, (8, 112)  # CPU step times: smaller batches, the same models
LM1B = dict(vocab_size=30000, emb_dim=512, num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048)
LM1B_BATCH, LM1B_LENGTH, RESNET_BATCH = 32, 128, 32


def _lm1b(dtype, remat: bool, head: bool):
  lm1b = examples.load("lm1b_example")
  import flax.linen as nn

  c = lm1b.Config(**LM1B, max_len=LM1B_LENGTH, dtype=dtype, remat=remat)

  class WithHead(nn.Module):  # the one change: the head given the labels returns the loss
    @nn.compact
    def __call__(self, inputs):
      y = lm1b.decoder(c, inputs)
      head = jnn.LMHead(c.vocab_size, dtype=c.dtype, kernel_init=c.kernel_init, name="logitdense")
      return head(y, inputs, where=inputs > 0)

  model = WithHead() if head else lm1b.TransformerLM(c)
  tokens = jax.ShapeDtypeStruct((LM1B_BATCH, LM1B_LENGTH), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones(tokens.shape, jnp.int32)))

  def loss(params, tokens):
    out = model.apply(params, tokens, rngs={"dropout": jax.random.key(1)})
    return out if head else lm1b.weighted_cross_entropy(out, tokens)

  return jax.value_and_grad(loss), params, tokens


def _lm1b_nnx(dtype, swapped: bool, routed: bool, remat: bool):
  lm1b = examples.load("lm1b_nnx_example")
  from flax import nnx

  sizes = LM1B | {"output_vocab_size": LM1B["vocab_size"]}
  c = lm1b.TransformerConfig(**sizes, max_len=LM1B_LENGTH, dtype=dtype, remat=remat)
  model = nnx.eval_shape(lambda: lm1b.TransformerLM(c, rngs=nnx.Rngs(0)))
  model.set_attributes(deterministic=False, decode=False)  # as train.py trains it
  if swapped:
    jnnx.swap(model)
  graphdef, params = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((LM1B_BATCH, LM1B_LENGTH), jnp.int32)

  def loss(params, tokens):
    model = nnx.merge(graphdef, params)
    return lm1b.loss_fn(model, tokens, nnx.Rngs(dropout=jax.random.key(1)))

  return jax.value_and_grad(jnnx.route_activations()(loss) if routed else loss), params, tokens


def _resnet(dtype, remat: bool, batch: int = RESNET_BATCH, side: int = 224):
  resnet = examples.load("resnet_example")
  import flax.linen as nn

  block = nn.remat(resnet.BottleneckResNetBlock) if remat else resnet.BottleneckResNetBlock
  model = resnet.ResNet50(num_classes=1000, dtype=dtype, block_cls=block)
  images = jax.ShapeDtypeStruct((1, batch, side, side, 3), dtype)
  init = jax.vmap(lambda x: model.init(jax.random.key(0), x), axis_name="batch")
  variables = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
    jax.eval_shape(init, jnp.zeros(images.shape, dtype)),
  )

  def loss(variables, x):
    logits, _ = model.apply(variables, x, mutable=["batch_stats"])
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1) - logits[:, 0])

  # the gradient inside the batch axis, as the example's train step runs under pmap
  step = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0), axis_name="batch")
  return step, variables, images


def _temp(value_and_grad, params, x, gpu: bool) -> int:
  leaves, tree = jax.tree.flatten(params)

  def step(x, *leaves):
    return value_and_grad(jax.tree.unflatten(tree, leaves), x)

  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, *leaves)]
  compiled = (
    support.compile_for(step, shapes, auto=True) if gpu else jax.jit(step).lower(*shapes).compile()
  )
  return compiled.memory_analysis().temp_size_in_bytes


def _concrete(tree, key):
  """Arrays for shapes (tokens in [1, 100), everything else normal)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  made = [
    jax.random.randint(k, s.shape, 1, 100, s.dtype)
    if jnp.issubdtype(s.dtype, jnp.integer)
    else jax.random.normal(k, s.shape, s.dtype)
    for k, s in zip(keys, leaves, strict=True)
  ]
  return jax.tree.unflatten(treedef, made)


def time_rows(runs: int) -> list[str]:
  """Each example's CPU step time under the one line against as written: alternated rounds, the
  median of the within-round ratios."""
  global LM1B_BATCH
  import statistics
  import time

  saved, LM1B_BATCH = LM1B_BATCH, TIME_LM1B_BATCH
  try:
    models = {
      f"lm1b, {TIME_LM1B_BATCH} x {LM1B_LENGTH} tokens": functools.partial(
        _lm1b, jnp.float32, False, False
      ),
      f"ResNet-50, {TIME_RESNET[0]} images of {TIME_RESNET[1]}": functools.partial(
        _resnet, jnp.float32, False, *TIME_RESNET
      ),
    }
    for model, build in models.items():
      step, params, x = build()
      params, x = _concrete(params, jax.random.key(0)), _concrete(x, jax.random.key(1))
      plain = jax.jit(step)
      with jnn.intercept():
        line = jax.jit(functools.partial(step)).lower(params, x).compile()  # a new function
      plain = plain.lower(params, x).compile()
      jax.block_until_ready((plain(params, x), line(params, x)))  # warm
      ratios, seconds = [], []
      for _ in range(runs):
        t = []
        for f in (plain, line):
          start = time.perf_counter()
          jax.block_until_ready(f(params, x))
          t.append(time.perf_counter() - start)
        ratios.append(t[1] / t[0])
        seconds.append(t[0])
      ratio = statistics.median(ratios)
      rows.add(
        "time", model, model=model, runs=runs, example_s=statistics.median(seconds), ratio=ratio
      )
      print(f"  time: {model}: {ratio:.3f}x the example's step", flush=True)
  finally:
    LM1B_BATCH = saved
  return page.tables(rows.current().rows, "time")


def measure(section: str) -> list[str]:
  gpu = section.endswith("-h100")
  dtype = jnp.bfloat16 if gpu else jnp.float32
  intercepted: set[str] = set()
  if section.startswith("lm1b-nnx"):
    model = "Flax's lm1b_nnx LM"
    size = f"{LM1B_BATCH} x {LM1B_LENGTH} tokens, D 512, 6 blocks, V 30000"
    ways = {  # (swapped, routed, remat)
      "the example": (False, False, False),
      "the example + remat": (False, False, True),
      "swap": (True, False, False),
      "swap + route_activations": (True, True, False),
      "swap + route_activations + remat": (True, True, True),
    }
    build = {w: functools.partial(_lm1b_nnx, dtype, *spec) for w, spec in ways.items()}
  elif section.startswith("lm1b"):
    model, size = "Flax's lm1b LM", f"{LM1B_BATCH} x {LM1B_LENGTH} tokens, D 512, 6 blocks, V 30000"
    ways = {
      "the example": (False, False, False),
      "the example + remat": (False, True, False),
      "one line": (True, False, False),
      "one line + remat": (True, True, False),
      "one line + the head's change": (True, False, True),
      "one line + the head's change + remat": (True, True, True),
    }
    build = {
      w: functools.partial(_lm1b, dtype, remat, head) for w, (_, remat, head) in ways.items()
    }
    intercepted = {w for w, spec in ways.items() if spec[0]}
  else:
    model, size = "Flax's ImageNet ResNet-50", f"{RESNET_BATCH} images of 224 x 224"
    ways = {
      "the example": (False, False),
      "the example + remat": (False, True),
      "one line": (True, False),
      "one line + remat": (True, True),
    }
    build = {w: functools.partial(_resnet, dtype, remat) for w, (_, remat) in ways.items()}
    intercepted = {w for w, spec in ways.items() if spec[0]}
  base = None
  for way in ways:
    step, params, x = build[way]()
    with jnn.intercept() if way in intercepted else contextlib.nullcontext():
      temp = _temp(step, params, x, gpu)
    base = temp if base is None else base
    rows.add(section, way, way=way, model=model, size=size, temp_bytes=temp, ratio=temp / base)
    print(f"  {section}: {way}: {temp / 2**20:.1f} MiB ({temp / base:.2f}x)", flush=True)
  return page.tables(rows.current().rows, section)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sections", default=",".join(SECTIONS))
  parser.add_argument("--out", default="bench-out", help="the folder of oneline.rows.jsonl")
  parser.add_argument("--runs", type=int, default=5, help="alternated rounds (section time)")
  a = parser.parse_args(argv)
  wanted = a.sections.split(",")
  if unknown := [s for s in wanted if s not in SECTIONS]:
    parser.error(f"sections {unknown} are not known; choose from {', '.join(SECTIONS)}")
  if any(s.endswith("-h100") for s in wanted) and not support.use_gpu_compiler():
    print("the H100 sections need jax's CUDA compiler: python tests/install_gpu_compiler.py")
    return 1
  for section in wanted:
    lines = time_rows(a.runs) if section == "time" else measure(section)
    print("\n".join(lines), flush=True)
  return 0
