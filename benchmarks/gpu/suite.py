"""GPU timings: the fused layers and the elementwise activations, and their fractions of peak.

The suite runs this section only when ``jax.default_backend() == "gpu"``. It times, in bfloat16,

* one dense and one 3x3 convolution layer, ``jit(value_and_grad)`` of ``sum(act(x @ w + b))``
  with respect to ``x``, ``w`` and ``b``: the jax.nn composition, jaxact with
  ``implementation="xla"``, and jaxact's default (``implementation=None``, the best available: the
  Pallas kernels where they support the call, else the same XLA path). Throughput counts the
  matmul/convolution FLOPs of the forward and the two backward products (3 x 2 x MACs);
* the elementwise activations, forward (``jax.vjp``) and backward (the pullback) as two jitted
  calls, so that the residual is written and read as in a training step. Bandwidth counts the
  minimum traffic of the pair: read x, write y; read one residual and the cotangent, write dx
  (five arrays).

Fractions of peak use the vendor's data-sheet figures for the device (``PEAKS``); devices not
listed get throughput without a fraction.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import jaxact
from benchmarks.gpu.common import conv_paths
from benchmarks.harness import timing
from support import layer_paths

# Data-sheet peaks, (HBM bandwidth in TB/s, dense bfloat16 tensor-core TFLOP/s), matched against
# jax's device_kind in this order (the first substring found wins: "H100 PCIe" before "H100").
PEAKS = (
  ("H200", (4.8, 989.0)),
  ("H100 PCIe", (2.0, 756.0)),
  ("H100 NVL", (3.9, 835.0)),
  ("H100", (3.35, 989.0)),
  ("A100-SXM4-80GB", (2.039, 312.0)),
  ("A100 80GB PCIe", (1.935, 312.0)),
  ("A100", (1.555, 312.0)),
)

ACTIVATIONS = ("relu", "gelu")
ELEMENTWISE = ("relu", "sigmoid", "tanh", "softplus", "gelu", "silu")
DTYPE = jnp.bfloat16


def peaks(device_kind: str) -> tuple[float, float] | None:
  for key, value in PEAKS:
    if key.lower() in device_kind.lower():
      return value
  return None


@dataclasses.dataclass
class LayerRow:
  op: str
  shape: str
  activation: str
  composition: float  # seconds
  xla: float
  default: float
  tflops: float  # of the default implementation
  peak_fraction: float | None


@dataclasses.dataclass
class ElementwiseRow:
  activation: str
  size: int
  jaxnn: float  # seconds, forward + backward
  jaxact: float
  gbps: float  # of jaxact
  peak_fraction: float | None


def _layer_configs(small: bool):
  """(op, x shape, w shape, MACs per forward, paths(activation, implementations))."""
  if small:  # a smoke test of this module on any backend
    m, k, n, img, ch = 256, 128, 128, (8, 16, 16, 32), 32
  else:
    m, k, n, img, ch = 16384, 4096, 4096, (128, 56, 56, 256), 256
  h, w_ = img[1], img[2]
  return (
    ("dense", (m, k), (k, n), m * k * n, layer_paths),
    ("conv 3x3", img, (3, 3, ch, ch), img[0] * h * w_ * ch * ch * 9, conv_paths),
  )


def layers(runs: int, small: bool = False) -> list[LayerRow]:
  peak = peaks(jax.devices()[0].device_kind)
  rows = []
  for op, x_shape, w_shape, macs, paths in _layer_configs(small):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape, DTYPE)
    w = (jax.random.normal(kw, w_shape, jnp.float32) / (macs / x.size) ** 0.5).astype(DTYPE)
    b = jnp.zeros((w_shape[-1],), DTYPE)
    for act in ACTIVATIONS:
      calls = []
      # the jax.nn composition, jaxact "xla", jaxact's default
      for f in paths(act, ("xla", None)).values():
        loss = functools.partial(_layer_loss, f)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        calls.append(lambda step=step, x=x, w=w, b=b: step(x, w, b))
      t_comp, t_xla, t_default = timing.alternated_medians(calls, runs)
      tflops = 3 * 2 * macs / t_default / 1e12
      rows.append(
        LayerRow(
          op,
          f"{x_shape} x {w_shape}",
          act,
          t_comp,
          t_xla,
          t_default,
          tflops,
          None if peak is None else tflops / peak[1],
        )
      )
  return rows


def _layer_loss(layer, x, w, b):
  return jnp.sum(layer(x, w, b).astype(jnp.float32))


def elementwise(runs: int, small: bool = False) -> list[ElementwiseRow]:
  peak = peaks(jax.devices()[0].device_kind)
  size = 1 << (16 if small else 28)
  x = jax.random.normal(jax.random.key(0), (size,), DTYPE) * 3
  g = jnp.ones((size,), DTYPE)
  backward = jax.jit(lambda pullback, g: pullback(g)[0])
  rows = []
  for name in ELEMENTWISE:
    calls = []
    for f in (getattr(jax.nn, name), getattr(jaxact, name)):
      forward = jax.jit(lambda x, f=f: jax.vjp(f, x))
      _, pullback = forward(x)
      # One call is a forward and a backward, each its own jitted computation, as in training.
      calls.append(lambda forward=forward, pullback=pullback: (forward(x), backward(pullback, g)))
    t_ref, t_ours = timing.alternated_medians(calls, runs)
    gbps = 5 * size * jnp.dtype(DTYPE).itemsize / t_ours / 1e9
    rows.append(
      ElementwiseRow(
        name, size, t_ref, t_ours, gbps, None if peak is None else gbps / 1e3 / peak[0]
      )
    )
  return rows
