"""Training-step memory of Flax models: ``nn.Dense``/``nn.Conv`` + jax.nn against jaxact's layers.

Run with ``python -m benchmarks flax``. For linen and nnx it compiles ``jit(grad(loss))``
(gradients with respect to the parameters, loss the mean square of the output) of

* an MLP of 4 layers, batch 4096, width 512 (``nn.Dense(512)`` then the activation, against
  ``jaxact.linen.DenseAct(512, activation=...)``; ``nnx.Linear`` against ``jaxact.nnx.LinearAct``);
* a CNN of 4 layers on NHWC 32x32x32x64 activations, 3x3 kernels, SAME padding (``nn.Conv`` /
  ``nnx.Conv`` against ``ConvAct``);

from abstract parameters (nothing is initialised or run), and prints XLA's
``memory_analysis().temp_size_in_bytes`` of both in MiB and in activation buffers (one buffer =
one layer's output, 8 MiB here) with their ratio, all measured in the same run.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxact.linen
import jaxact.nnx
from benchmarks.harness import rows
from benchmarks.tables import flax as page
from benchmarks.tables.flax import TABLE

LAYERS = 4
MLP_BATCH, MLP_WIDTH = 4096, 512
CNN_SHAPE = (32, 32, 32, 64)  # NHWC
ACTIVATIONS = ("relu", "gelu")


class LinenMLP(nn.Module):
  activation: str
  fused: bool

  @nn.compact
  def __call__(self, x):
    for _ in range(LAYERS):
      if self.fused:
        x = jaxact.linen.DenseAct(MLP_WIDTH, activation=self.activation)(x)
      else:
        x = getattr(jax.nn, self.activation)(nn.Dense(MLP_WIDTH)(x))
    return x


class LinenCNN(nn.Module):
  activation: str
  fused: bool

  @nn.compact
  def __call__(self, x):
    features = CNN_SHAPE[-1]
    for _ in range(LAYERS):
      if self.fused:
        x = jaxact.linen.ConvAct(features, (3, 3), activation=self.activation)(x)
      else:
        x = getattr(jax.nn, self.activation)(nn.Conv(features, (3, 3))(x))
    return x


class NnxMLP(nnx.Module):
  def __init__(self, activation: str, fused: bool, rngs: nnx.Rngs):
    self.activation, self.fused = activation, fused
    if fused:
      make = lambda: jaxact.nnx.LinearAct(MLP_WIDTH, MLP_WIDTH, activation=activation, rngs=rngs)
    else:
      make = lambda: nnx.Linear(MLP_WIDTH, MLP_WIDTH, rngs=rngs)
    self.layers = nnx.List([make() for _ in range(LAYERS)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x) if self.fused else getattr(jax.nn, self.activation)(layer(x))
    return x


class NnxCNN(nnx.Module):
  def __init__(self, activation: str, fused: bool, rngs: nnx.Rngs):
    self.activation, self.fused = activation, fused
    c = CNN_SHAPE[-1]
    if fused:
      make = lambda: jaxact.nnx.ConvAct(c, c, (3, 3), activation=activation, rngs=rngs)
    else:
      make = lambda: nnx.Conv(c, c, (3, 3), rngs=rngs)
    self.layers = nnx.List([make() for _ in range(LAYERS)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x) if self.fused else getattr(jax.nn, self.activation)(layer(x))
    return x


def _temp_bytes(loss, params, x) -> int:
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def linen_temp(model_cls, activation: str, fused: bool, x) -> int:
  model = model_cls(activation, fused)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  return _temp_bytes(lambda p, x: jnp.mean(model.apply(p, x) ** 2), params, x)


def nnx_temp(model_cls, activation: str, fused: bool, x) -> int:
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(activation, fused, nnx.Rngs(0))))
  return _temp_bytes(lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2), state, x)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", choices=("linen", "nnx"), default=None)
  args = parser.parse_args(argv)

  mlp_x = jax.ShapeDtypeStruct((MLP_BATCH, MLP_WIDTH), jnp.float32)
  cnn_x = jax.ShapeDtypeStruct(CNN_SHAPE, jnp.float32)
  buffer = MLP_BATCH * MLP_WIDTH * 4
  assert buffer == CNN_SHAPE[0] * CNN_SHAPE[1] * CNN_SHAPE[2] * CNN_SHAPE[3] * 4
  cases = [
    ("linen", f"MLP {LAYERS}x{MLP_WIDTH}, batch {MLP_BATCH}", linen_temp, LinenMLP, mlp_x),
    (
      "linen",
      f"CNN {LAYERS}x conv3x3, NHWC {'x'.join(map(str, CNN_SHAPE))}",
      linen_temp,
      LinenCNN,
      cnn_x,
    ),
    ("nnx", f"MLP {LAYERS}x{MLP_WIDTH}, batch {MLP_BATCH}", nnx_temp, NnxMLP, mlp_x),
    (
      "nnx",
      f"CNN {LAYERS}x conv3x3, NHWC {'x'.join(map(str, CNN_SHAPE))}",
      nnx_temp,
      NnxCNN,
      cnn_x,
    ),
  ]
  if args.only:
    cases = [c for c in cases if c[0] == args.only]

  print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0]}")
  print()
  print(page.intro(buffer))
  print()
  print("\n".join(TABLE.head()))
  for api, label, temp, model_cls, x in cases:
    for activation in ACTIVATIONS:
      flax_bytes = temp(model_cls, activation, False, x)
      ours = temp(model_cls, activation, True, x)
      rows.emit(
        TABLE,
        "temp",
        f"{api}, {label}, {activation}",
        api=api,
        model=label,
        activation=activation,
        flax_bytes=flax_bytes,
        jaxact_bytes=ours,
        buffer_bytes=buffer,
        ratio=ours / flax_bytes,
      )
