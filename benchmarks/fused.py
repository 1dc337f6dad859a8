"""Memory and step time of fused bias+activation layers against the jax.nn composition.

Run with ``python -m benchmarks fused`` (``--quick`` for fewer timing runs, ``--no-time`` to
skip timing). For each activation it compiles ``jit(grad(loss))`` of

* an 8-layer MLP, 8192x512 float32 activations and 512x512 weights, written with
  :func:`jaxact.dense_bias_act` and as ``act(x @ w + b)`` with ``jax.nn``;
* a 6-layer CNN, NHWC 32x32x32x64 activations and 3x3x64x64 kernels, SAME padding, written with
  :func:`jaxact.conv_bias_act` and as ``act(lax.conv_general_dilated(x, w) + b)``;

and reports XLA's ``temp_size_in_bytes`` in units of one activation buffer, and the ratio of the
median ``jit(value_and_grad)`` step times (fused / composition, the two alternated, each
``block_until_ready``). The issue's targets: MLP temp <= L+1 = 9 buffers for relu, elu, tanh,
sigmoid, softplus and <= 2L+1 = 17 for gelu; the CNN likewise against its composition (L = 6: 7 and
13); step time no slower than the composition.

On CPU, XLA computes a convolution's kernel gradient from copies of x and dz in another layout.
Made whole, those copies would be two activation buffers alive next to the L - 1 kept outputs below
the top layer and its dz (L + 2 = 8 for the CNN); ``conv_bias_act`` therefore sums the kernel
gradient over two batch halves on CPU, one after the other, so that one half's copies take one
buffer, no more than the dx allocated next: the CNN's peak is the L - 1 kept outputs, dz and dx.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

import jaxact
from benchmarks.harness import rows, timing
from benchmarks.tables.fused import TABLE, heading

ACTIVATIONS = ("relu", "elu", "tanh", "sigmoid", "softplus", "gelu")
OUTPUT_RESIDUAL = ("relu", "elu", "tanh", "sigmoid", "softplus")

MLP_LAYERS, MLP_BATCH, MLP_WIDTH = 8, 8192, 512
CNN_LAYERS, CNN_SHAPE, CNN_KERNEL = 6, (32, 32, 32, 64), (3, 3, 64, 64)
_NHWC = ("NHWC", "HWIO", "NHWC")


def _mlp(activation: str, fused: bool):
  act = getattr(jax.nn, activation)

  def forward(params, x):
    for w, b in params:
      x = jaxact.dense_bias_act(x, w, b, activation=activation) if fused else act(x @ w + b)
    return x

  key = jax.random.key(0)
  params = []
  for k in jax.random.split(key, MLP_LAYERS):
    w = jax.random.normal(k, (MLP_WIDTH, MLP_WIDTH), jnp.float32) / MLP_WIDTH**0.5
    params.append((w, jnp.zeros((MLP_WIDTH,), jnp.float32)))
  x = jax.random.normal(jax.random.key(1), (MLP_BATCH, MLP_WIDTH), jnp.float32)
  return forward, params, x, MLP_BATCH * MLP_WIDTH * 4


def _cnn(activation: str, fused: bool):
  act = getattr(jax.nn, activation)

  def forward(params, x):
    for w, b in params:
      if fused:
        x = jaxact.conv_bias_act(x, w, b, activation=activation, padding="SAME")
      else:
        z = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_NHWC)
        x = act(z + b)
    return x

  params = []
  fan_in = CNN_KERNEL[0] * CNN_KERNEL[1] * CNN_KERNEL[2]
  for k in jax.random.split(jax.random.key(0), CNN_LAYERS):
    w = jax.random.normal(k, CNN_KERNEL, jnp.float32) / fan_in**0.5
    params.append((w, jnp.zeros((CNN_KERNEL[3],), jnp.float32)))
  x = jax.random.normal(jax.random.key(1), CNN_SHAPE, jnp.float32)
  size = CNN_SHAPE[0] * CNN_SHAPE[1] * CNN_SHAPE[2] * CNN_SHAPE[3] * 4
  return forward, params, x, size


def _loss(forward):
  return lambda params, x: jnp.sum(forward(params, x))


def temp_buffers(model, activation: str, fused: bool) -> float:
  forward, params, x, buffer = model(activation, fused)
  compiled = jax.jit(jax.grad(_loss(forward))).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes / buffer


def time_ratio(model, activation: str, runs: int) -> tuple[float, float, float]:
  """Median step time of the fused model, of the composition, and their ratio (alternated)."""
  steps = []
  for fused in (True, False):
    forward, params, x, _ = model(activation, fused)
    step = jax.jit(jax.value_and_grad(_loss(forward)))
    steps.append((step, params, x))
  calls = [lambda step=step, params=params, x=x: step(params, x) for step, params, x in steps]
  fused_t, comp_t = timing.alternated_medians(calls, runs)
  return fused_t, comp_t, fused_t / comp_t


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=15, help="timed runs per implementation")
  parser.add_argument("--quick", action="store_true", help="5 timed runs (a smoke test)")
  parser.add_argument("--no-time", action="store_true", help="memory only")
  parser.add_argument("--only", choices=("mlp", "cnn"), default=None)
  args = parser.parse_args(argv)
  runs = 5 if args.quick else args.runs

  print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0]}")
  models = [("MLP", _mlp, MLP_LAYERS), ("CNN", _cnn, CNN_LAYERS)]
  if args.only:
    models = [m for m in models if m[0].lower() == args.only]
  for label, model, layers in models:
    print("\n".join(["", heading(label, layers), "", *TABLE.head()]))
    for activation in ACTIVATIONS:
      fused = temp_buffers(model, activation, True)
      comp = temp_buffers(model, activation, False)
      target = layers + 1 if activation in OUTPUT_RESIDUAL else 2 * layers + 1
      f_t = c_t = ratio = None
      if not args.no_time:
        f_t, c_t, ratio = time_ratio(model, activation, runs)
      rows.emit(
        TABLE,
        label,
        activation,
        layers=layers,
        fused_temp=fused,
        jaxnn_temp=comp,
        target=target,
        met=fused <= target + 1e-9,
        fused_seconds=f_t,
        jaxnn_seconds=c_t,
        time_ratio=ratio,
      )
