"""The 8-layer MLP and 6-layer CNN of :mod:`benchmarks.fused` (``dense_bias_act`` /
``conv_bias_act`` as ``jaxact.linen`` layers against ``nn.Dense`` / ``nn.Conv`` + jax.nn),
unrolled and scanned: compiled temp on CPU and for an H100 (``python -m benchmarks gated
--sections layers,layers-h100``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxact.linen
from benchmarks.harness import rows
from benchmarks.harness.blocks import stack
from benchmarks.harness.memory import cpu_memory, gpu_memory

LAYER_PEERS = ("flax", "remat", "jaxact")
LAYER_SIZES = {
  # model: (layers, CPU x shape, GPU x shape)
  "MLP": (8, (8192, 512), (8192, 4096)),
  "CNN": (6, (32, 32, 32, 64), (128, 56, 56, 256)),
}


def _layer(model: str, peer: str, activation: str, features: int):
  conv = model == "CNN"
  if peer == "jaxact":
    if conv:
      module = jaxact.linen.ConvAct(features, (3, 3), activation=activation)
    else:
      module = jaxact.linen.DenseAct(features, activation=activation)
    return lambda x, p: module.apply({"params": {"kernel": p[0], "bias": p[1]}}, x)
  module = nn.Conv(features, (3, 3)) if conv else nn.Dense(features)
  act = getattr(jax.nn, activation)

  def layer(x, p):
    return act(module.apply({"params": {"kernel": p[0], "bias": p[1]}}, x))

  if peer == "remat":
    return jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
  return layer


def layer_shapes(model: str, layers: int, x_shape, dtype):
  c = x_shape[-1]
  kernel = (3, 3, c, c) if model == "CNN" else (c, c)
  params = (
    jax.ShapeDtypeStruct((layers, *kernel), dtype),
    jax.ShapeDtypeStruct((layers, c), dtype),
  )
  return params, jax.ShapeDtypeStruct(x_shape, dtype)


def section_layers(gpu: bool, activations=("relu", "gelu")) -> list[dict]:
  found = []
  for model, (layers, cpu_x, gpu_x) in LAYER_SIZES.items():
    x_shape, dtype = (gpu_x, jnp.bfloat16) if gpu else (cpu_x, jnp.float32)
    buffer = jnp.dtype(dtype).itemsize
    for s in x_shape:
      buffer *= s
    for activation in activations:
      for peer in LAYER_PEERS:
        row = {"model": model, "activation": activation, "peer": peer}
        layer = _layer(model, peer, activation, x_shape[-1])
        for scan in (False, True):
          _, loss = stack(layer, scan)
          params, x = layer_shapes(model, layers, x_shape, dtype)
          temp = gpu_memory(loss, params, x)[0] if gpu else cpu_memory(loss, params, x)
          row["scan" if scan else "unrolled"] = temp / buffer
        found.append(row)
  return found


def record_layers(section: str, found: list[dict]) -> list[dict]:
  """`found` (:func:`section_layers`) added as rows, a row a model, activation and peer."""
  return [rows.add(section, f"{r['model']}, {r['activation']}, {r['peer']}", **r) for r in found]
