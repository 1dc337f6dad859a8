"""Flax models: `nn.Dense` / `nn.Conv` + jax.nn, under remat, and jaxact layers, under remat too.

The MLP and CNN of :mod:`benchmarks.fused` (same sizes), written as a Flax user writes them,
in every variant a user could pick (:data:`VARIANTS`):

* ``flax``: each layer ``nn.Dense`` or ``nn.Conv`` (3x3, SAME), then the jax.nn activation;
* ``remat``: the same layers, each wrapped in ``nn.remat(..., policy=nothing_saveable)``: a layer
  keeps only its input and recomputes its matmul or convolution, bias and activation in the
  backward pass (one ``jax.checkpoint`` around the whole loss saves nothing: the backward pass
  recomputes the whole forward and then needs all of it at once);
* ``dots``: each layer under ``nn.remat(..., policy=dots_saveable)``, which keeps the
  matmul/conv output next to the input;
* ``jaxact``: ``jaxact.linen.DenseAct`` / ``ConvAct`` (the same parameters and initializers,
  computed as :func:`jaxact.dense_bias_act` / :func:`jaxact.conv_bias_act`);
* ``jaxact_remat``, ``jaxact_dots``: those layers under the same two remat policies;
* ``jaxact_8``, ``jaxact_4``, ``jaxact_2``: those layers with ``residual_bits`` 8, 4, 2, for the
  activations that take derivative codes (gelu-like ones: :func:`variants`).

Measured per model and activation (:func:`frontier`): XLA's compiled ``temp_size_in_bytes`` of
``jit(grad(loss))`` in activation buffers and the step time of that same compiled program,
relative to Flax's, from alternated runs; and (:func:`kept`) the activation-sized arrays held by
``jax.vjp``'s pullback per layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxact.linen
from benchmarks import activations as bench
from benchmarks import fused
from benchmarks.harness import timing
from jaxact._src.codes import code as codes

VARIANTS = (
  "flax",
  "remat",
  "dots",
  "jaxact",
  "jaxact_remat",
  "jaxact_dots",
  *(f"jaxact_{bits}" for bits in codes.BITS),
)
MODELS = ("MLP", "CNN")
_POLICIES = {
  "remat": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_saveable,
}


def variants(activation: str) -> tuple[str, ...]:
  """The variants that apply to `activation`: the codes only where it takes them."""
  coded = {f"jaxact_{bits}" for bits in codes.BITS}
  return tuple(v for v in VARIANTS if activation in codes.CODED or v not in coded)


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
  residual_bits: int | None = None

  @nn.compact
  def __call__(self, x):
    if self.conv:
      return jaxact.linen.ConvAct(
        self.features, (3, 3), activation=self.activation, residual_bits=self.residual_bits
      )(x)
    return jaxact.linen.DenseAct(
      self.features, activation=self.activation, residual_bits=self.residual_bits
    )(x)


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
  if variant not in VARIANTS:
    raise ValueError(f"`variant` {variant!r} is not known; choose one of: {', '.join(VARIANTS)}")
  if variant.startswith("jaxact"):
    layer, option = JaxactLayer, variant.removeprefix("jaxact").removeprefix("_")
  else:
    layer, option = FlaxLayer, variant.removeprefix("flax")
  if option.isdigit():
    return functools.partial(layer, residual_bits=int(option))
  return nn.remat(layer, policy=_POLICIES[option]) if option else layer


def _stack(model: str, variant: str, activation: str, features: int) -> Stack:
  if model not in MODELS:
    raise ValueError(f"`model` {model!r} is not known; choose one of: {', '.join(MODELS)}")
  layers = fused.MLP_LAYERS if model == "MLP" else fused.CNN_LAYERS
  return Stack(_layer(variant), layers, features, activation, model == "CNN")


def build(model: str, variant: str, activation: str):
  """(apply, params, x, layers) for `model` ("MLP" or "CNN") written as `variant`."""
  shape = (fused.MLP_BATCH, fused.MLP_WIDTH) if model == "MLP" else fused.CNN_SHAPE
  features = fused.MLP_WIDTH if model == "MLP" else fused.CNN_KERNEL[3]
  module = _stack(model, variant, activation, features)
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
  return module.apply, _init(module, x), x, module.layers


def shaped(model: str, variant: str, activation: str, x_shape: tuple[int, ...], dtype):
  """``(step, shapes)``: ``step(x, *params)``, the gradient of `model` written as `variant` with
  input `x_shape` (its width the layers' too), and the shapes of its arguments, all in `dtype`:
  what compiling for a GPU needs, no array made."""
  module = _stack(model, variant, activation, x_shape[-1])
  x = jax.ShapeDtypeStruct(x_shape, dtype)
  found = jax.eval_shape(module.init, jax.random.key(0), x)
  leaves, tree = jax.tree.flatten(found)
  grad = jax.grad(_loss(module.apply))

  def step(x, *leaves):
    return grad(jax.tree.unflatten(tree, leaves), x)

  return step, [x, *(jax.ShapeDtypeStruct(p.shape, dtype) for p in leaves)]


def _init(module: nn.Module, x):
  """Parameters at the scale of Flax's defaults (kernels normal with variance 1 / fan in, biases
  zero), drawn without `module.init`, which would run the forward pass eagerly."""
  shapes = jax.eval_shape(module.init, jax.random.key(0), x)
  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  made = []
  for k, leaf in zip(keys, leaves, strict=True):
    if leaf.ndim == 1:  # bias
      made.append(jnp.zeros(leaf.shape, leaf.dtype))
    else:  # kernel (in, out) or (h, w, in, out): fan in = all but the last axis
      fan_in = math.prod(leaf.shape[:-1])
      made.append(jax.random.normal(k, leaf.shape, leaf.dtype) * fan_in**-0.5)
  return jax.tree.unflatten(tree, made)


def _loss(apply):
  return lambda params, x: jnp.sum(apply(params, x))


def frontier(
  model: str, activation: str, runs: int, warmup: bool = True
) -> tuple[float, dict[str, tuple]]:
  """``(Flax's step in seconds, {variant: (temp in activation buffers, step time / Flax's, its
  rounds' ratios)})``.

  Each variant's ``jit(grad(loss))`` is compiled once; its memory analysis gives the temp, and the
  compiled programs themselves are timed, alternated, the ratios taken within rounds."""
  found, calls = {}, []
  for variant in variants(activation):
    apply, params, x, _ = build(model, variant, activation)
    compiled = jax.jit(jax.grad(_loss(apply))).lower(params, x).compile()
    found[variant] = compiled.memory_analysis().temp_size_in_bytes / (x.size * x.dtype.itemsize)
    calls.append(functools.partial(compiled, params, x))
  return timing.frontier_points(found, calls, runs, warmup)


def kept(model: str, variant: str, activation: str) -> float:
  """Activation-sized arrays `jax.vjp`'s pullback holds per layer (eager; parameters and input
  excluded)."""
  apply, params, x, layers = build(model, variant, activation)
  _, pullback = jax.vjp(lambda p: apply(p, x), params)
  return bench.kept_arrays(pullback, x.size, exclude=[x, *jax.tree.leaves(params)]) / layers
