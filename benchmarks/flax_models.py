"""Flax models: `nn.Dense` / `nn.Conv` + jax.nn, the same under remat, and jaxact layers.

The MLP and CNN of :mod:`benchmarks.fused_memory` (same sizes), written as a Flax user writes them,
in four variants:

* ``flax``: each layer ``nn.Dense`` or ``nn.Conv`` (3x3, SAME), then the jax.nn activation;
* ``remat``: the same layers, each wrapped in ``nn.remat(..., policy=nothing_saveable)``. This is
  the memory-saving alternative Flax users already have, and the policy chosen is the one that
  saves activation memory: each layer keeps only its input and recomputes its matmul or convolution,
  bias and activation in the backward pass. Under the policies that keep the matmul/conv output
  (``dots_saveable``; ``dots_with_no_batch_dims_saveable`` also saves nothing for convolutions), a
  layer keeps its input *and* that output, and on these models the compiled memory is that of the
  plain model for relu (measured: the ``remat_dots`` variant). Wrapping the whole loss in one
  ``jax.checkpoint`` saves nothing either: the backward pass recomputes the whole forward and then
  needs all of it at once;
* ``remat_dots``: each layer under ``nn.remat(..., policy=dots_saveable)`` (memory only, to show
  the above);
* ``jaxact``: ``jaxact.linen.DenseAct`` / ``ConvAct`` (the same parameters and initializers,
  computed as :func:`jaxact.dense_bias_act` / :func:`jaxact.conv_bias_act`).

Measured per model and activation: XLA's compiled ``temp_size_in_bytes`` of ``jit(grad(loss))``
in activation buffers, the activation-sized arrays held by ``jax.vjp``'s pullback per layer, and
the median step time of ``jit(value_and_grad(loss))`` (gradients with respect to the parameters),
the timed variants alternated in one process.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxact.linen
from benchmarks import activations as bench
from benchmarks import fused_memory as fused
from benchmarks import timing

VARIANTS = {
  "flax": "Flax",
  "remat": "Flax + remat",
  "remat_dots": "Flax + remat(dots_saveable)",
  "jaxact": "jaxact layers",
}
TIMED = ("flax", "remat", "jaxact")
MODELS = ("MLP", "CNN")


class FlaxLayer(nn.Module):
  """``nn.Dense`` (or a 3x3 SAME ``nn.Conv``), then the jax.nn activation."""

  features: int
  activation: str
  conv: bool = False

  @nn.compact
  def __call__(self, x):
    if self.conv:
      z = nn.Conv(self.features, (3, 3), padding="SAME")(x)
    else:
      z = nn.Dense(self.features)(x)
    return getattr(jax.nn, self.activation)(z)


class JaxactLayer(nn.Module):
  """The same layer as :class:`FlaxLayer` written with ``jaxact.linen``: same parameters."""

  features: int
  activation: str
  conv: bool = False

  @nn.compact
  def __call__(self, x):
    if self.conv:
      return jaxact.linen.ConvAct(self.features, (3, 3), activation=self.activation)(x)
    return jaxact.linen.DenseAct(self.features, activation=self.activation)(x)


class Stack(nn.Module):
  layer: Callable[..., nn.Module]
  layers: int
  features: int
  activation: str
  conv: bool

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = self.layer(self.features, self.activation, self.conv)(x)
    return x


def _layer(variant: str):
  if variant == "flax":
    return FlaxLayer
  if variant == "remat":
    return nn.remat(FlaxLayer, policy=jax.checkpoint_policies.nothing_saveable)
  if variant == "remat_dots":
    return nn.remat(FlaxLayer, policy=jax.checkpoint_policies.dots_saveable)
  if variant == "jaxact":
    return JaxactLayer
  raise ValueError(f"`variant` {variant!r} is not known; choose one of: {', '.join(VARIANTS)}")


def build(model: str, variant: str, activation: str):
  """(apply, params, x, layers) for `model` ("MLP" or "CNN") written as `variant`."""
  if model == "MLP":
    layers, features, conv = fused.MLP_LAYERS, fused.MLP_WIDTH, False
    shape = (fused.MLP_BATCH, fused.MLP_WIDTH)
  elif model == "CNN":
    layers, features, conv = fused.CNN_LAYERS, fused.CNN_KERNEL[3], True
    shape = fused.CNN_SHAPE
  else:
    raise ValueError(f"`model` {model!r} is not known; choose one of: {', '.join(MODELS)}")
  module = Stack(_layer(variant), layers, features, activation, conv)
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
  params = module.init(jax.random.key(0), x)
  return module.apply, params, x, layers


def _loss(apply):
  return lambda params, x: jnp.sum(apply(params, x))


def memory(model: str, variant: str, activation: str) -> tuple[float, float]:
  """(compiled temp of `jit(grad(loss))` in activation buffers, arrays kept per layer)."""
  apply, params, x, layers = build(model, variant, activation)
  buffer = x.size * x.dtype.itemsize
  compiled = jax.jit(jax.grad(_loss(apply))).lower(params, x).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes / buffer
  _, pullback = jax.vjp(lambda p: apply(p, x), params)
  kept = bench.kept_arrays(pullback, x.size, exclude=[x, *jax.tree.leaves(params)])
  return temp, kept / layers


def step_times(model: str, activation: str, runs: int) -> dict[str, float]:
  """Median seconds of a `jit(value_and_grad(loss))` step per timed variant, alternated."""
  calls = []
  for variant in TIMED:
    apply, params, x, _ = build(model, variant, activation)
    step = jax.jit(jax.value_and_grad(_loss(apply)))
    calls.append(lambda step=step, params=params, x=x: step(params, x))
  return dict(zip(TIMED, timing.alternated_medians(calls, runs), strict=True))
