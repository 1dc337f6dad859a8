"""`python -m benchmarks dropin [--tokens N] [--runs R]`: jaxact swapped into a Flax example's MLP.

The MLP block of Flax's official transformer examples (wmt, lm1b: ``Dense -> relu -> Dropout ->
Dense -> Dropout``), two blocks with residual adds, trained with dropout 0.1 (CPU float32),
unrolled and as ``nn.scan`` over the blocks. Models, one parameter tree for all (each block
``Dense_0``, ``Dense_1``):

- ``flax``: the example as written;
- ``flax+remat``: the same under block remat (``nn.remat`` of each block, saving nothing inside);
- ``first``: the first ``nn.Dense`` + relu + ``nn.Dropout`` as one ``jaxact.linen.DenseAct(...,
  activation=nn.relu, dropout_rate=0.1)``, the rest as written;
- ``both``: the second ``nn.Dense`` + ``nn.Dropout`` as ``DenseAct`` (identity) too.

Each with dropout 0.1 and with 0 (the same model without dropout). Reported: the compiled temp
memory of ``jit(value_and_grad)`` and its ratio against the Flax model with the same dropout, and
each jaxact model's ratio against itself without dropout (the issue's goal: <= 1.05); the step
time against Flax's (alternated runs); and the activation given as ``nn.relu`` against ``"relu"``
(the same compiled temp).
"""

from __future__ import annotations

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxact.linen as jnn
from benchmarks.harness import rows, timing
from benchmarks.tables import dropin as page

MODELS = ("flax", "flax+remat", "first", "both")


class MlpBlock(nn.Module):
  """Flax's example MLP block; `swap` names how much of it jaxact computes."""

  mlp_dim: int
  rate: float
  swap: str = "flax"
  activation: object = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    out = x.shape[-1]
    if self.swap.startswith("flax"):
      h = nn.relu(nn.Dense(self.mlp_dim, name="Dense_0")(x))
      h = nn.Dropout(self.rate)(h, deterministic=not train)
    else:
      h = jnn.DenseAct(
        self.mlp_dim,
        activation=self.activation,
        dropout_rate=self.rate,
        deterministic=not train,
        name="Dense_0",
      )(x)
    if self.swap == "both":
      return jnn.DenseAct(out, dropout_rate=self.rate, deterministic=not train, name="Dense_1")(h)
    y = nn.Dense(out, name="Dense_1")(h)
    return nn.Dropout(self.rate)(y, deterministic=not train)


class Stack(nn.Module):
  blocks: int
  mlp_dim: int
  rate: float
  swap: str = "flax"
  scan: bool = False
  activation: object = nn.relu

  @nn.compact
  def __call__(self, x):
    block = nn.remat(MlpBlock) if self.swap == "flax+remat" else MlpBlock
    make = functools.partial(block, self.mlp_dim, self.rate, self.swap, self.activation)
    if not self.scan:
      for i in range(self.blocks):
        x = x + make(name=f"block_{i}")(x)
      return x

    def body(block, x, _):
      return x + block(x), None

    scanned = nn.scan(
      body,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      length=self.blocks,
    )
    x, _ = scanned(make(name="block"), x, None)
    return x


def step_fn(model: Stack):
  def loss(params, x, key):
    y = model.apply(params, x, rngs={"dropout": key})
    return jnp.mean(y**2)

  return jax.jit(jax.value_and_grad(loss))


def temp(model: Stack, params, x, key) -> int:
  compiled = step_fn(model).lower(params, x, key).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def measure(tokens: int, dim: int, mlp_dim: int, blocks: int, runs: int) -> list[str]:
  x = jax.random.normal(jax.random.key(0), (tokens, dim))
  key = jax.random.key(1)
  for scan in (False, True):
    temps, steps = {}, {}
    for rate in (0.1, 0.0):
      for swap in MODELS:
        model = Stack(blocks, mlp_dim, rate, swap, scan)
        params = Stack(blocks, mlp_dim, rate, "flax", scan).init(jax.random.key(2), x)
        temps[swap, rate] = temp(model, params, x, key)
        step = step_fn(model)
        steps[swap, rate] = functools.partial(step, params, x, key)
    times = {}
    for rate in (0.1, 0.0):
      _, ratios = timing.alternated_ratios([steps[s, rate] for s in MODELS], runs)
      times.update({(s, rate): r for s, r in zip(MODELS, [1.0, *ratios], strict=True)})
    for rate in (0.1, 0.0):
      for swap in MODELS:
        t, stack = temps[swap, rate], "nn.scan" if scan else "unrolled"
        rows.add(
          "dropin",
          f"{stack}, {swap}, {rate}",
          blocks=blocks,
          tokens=tokens,
          dim=dim,
          mlp_dim=mlp_dim,
          stack=stack,
          model=swap,
          dropout=rate,
          temp_bytes=t,
          ratio_vs_flax=t / temps["flax", rate],
          ratio_vs_no_dropout=t / temps[swap, 0.0],
          step_ratio_vs_flax=times[swap, rate],
        )
  params = Stack(blocks, mlp_dim, 0.1, "flax").init(jax.random.key(2), x)
  named = temp(Stack(blocks, mlp_dim, 0.1, "first", activation="relu"), params, x, key)
  by_fn = temp(Stack(blocks, mlp_dim, 0.1, "first", activation=nn.relu), params, x, key)
  rows.add("activation", "nn.relu against relu", by_fn_bytes=by_fn, named_bytes=named)
  return page.tables(rows.current().rows)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--dim", type=int, default=512)
  parser.add_argument("--mlp-dim", type=int, default=2048)
  parser.add_argument("--blocks", type=int, default=2)
  parser.add_argument("--runs", type=int, default=5)
  a = parser.parse_args(argv)
  print("\n".join(measure(a.tokens, a.dim, a.mlp_dim, a.blocks, a.runs)))
  return 0
