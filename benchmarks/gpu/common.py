"""What the GPU benchmarks (``python -m benchmarks gpu``) share: the GPU, timing, inputs,
float32 references, the error rule (:mod:`support.gpu_compare`'s ``TOL``, ``rel``,
``within``) and the ``env`` section (the ceilings the others are read against)."""

from __future__ import annotations

import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxact
from support import param_defaults
from support.gpu_compare import TOL as TOL
from support.gpu_compare import rel as rel
from support.gpu_compare import within as within

SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096))
ROTATE = 4  # input sets cycled through, so that no call reads what the last left in L2
INNER = 5  # back-to-back calls per timed repetition
_NHWC = ("NHWC", "HWIO", "NHWC")


def gpu_device():
  """This process's first CUDA device, or None."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  return devices[0] if devices else None


def median_seconds(fn, arg_sets, runs: int) -> float:
  """Median wall time of one call of `fn`, from `runs` repetitions of INNER queued calls."""
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  times = []
  for r in range(runs):
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[(r * INNER + i) % len(arg_sets)]) for i in range(INNER)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / INNER)
  return statistics.median(times)


# --------------------------------------------------------------------- inputs and references


def inputs(shape, dtype, seed):
  """x (batch..., K), w (K, N), b (N,) and a cotangent g, random (never zeros), z of unit size."""
  *batch, k, n = shape
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (*batch, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  b = jax.random.normal(kb, (n,), jnp.float32).astype(dtype)
  g = jax.random.normal(kg, (*batch, n), jnp.float32).astype(dtype)
  return x, w, b, g


def conv_inputs(x_shape, w_shape, dtype, seed):
  """x (NHWC), w (HWIO), b and g of a convolution layer, as :func:`inputs`."""
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
  fan_in = int(np.prod(w_shape[:-1]))
  w = (jax.random.normal(kw, w_shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)
  b = jax.random.normal(kb, (w_shape[-1],), jnp.float32).astype(dtype)
  g = jax.random.normal(kg, (*x_shape[:-1], w_shape[-1]), jnp.float32).astype(dtype)
  return x, w, b, g


def reference(name):
  """The float32 reference of a dense layer: the spec's plain formula at HIGHEST precision."""
  spec = jaxact.get_spec(name)
  params = param_defaults(spec)

  def f(x, w, b):
    z = jnp.dot(x, w, precision=lax.Precision.HIGHEST) + b
    return spec.fn(z, **params)

  return f


def conv_reference(name):
  """The float32 reference of a 3x3 SAME convolution layer, as :func:`reference`."""
  spec = jaxact.get_spec(name)
  params = param_defaults(spec)

  def f(x, w, b):
    z = lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=_NHWC, precision=lax.Precision.HIGHEST
    )
    return spec.fn(z + b, **params)

  return f


def conv_paths(name, implementations=("xla", "pallas")):
  """The jax.nn composition and jaxact's `implementations` of a 3x3 SAME convolution layer."""
  act = getattr(jax.nn, name)

  def composition(x, w, b):
    return act(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_NHWC) + b)

  def fused(impl):
    return lambda x, w, b: jaxact.conv_bias_act(
      x, w, b, activation=name, padding="SAME", implementation=impl
    )

  return {"jax.nn": composition} | {f"jaxact {i}": fused(i) for i in implementations}


# ------------------------------------------------------------------------------------- env


PACKAGES = ("jaxlib", "flax", "triton", "jax-cuda13-plugin", "jax-cuda12-plugin")


def versions(*names: str) -> dict[str, str]:
  """The installed version of each distribution in `names` (default :data:`PACKAGES`: what the
  kernels and layers run on beside jax) that is installed."""
  from importlib import metadata

  names = names or PACKAGES
  installed = {(d.metadata["Name"] or "").lower(): d.version for d in metadata.distributions()}
  return {n: installed[n] for n in names if n in installed}


def section_env(gpu, runs):
  """Device, jax version, and the two ceilings: device-to-device copy bandwidth (a jitted copy of
  1 GiB, bytes read + written) and the bfloat16 matmul rate of ``jnp.dot`` (8192^3)."""
  n = 1 << 28  # 1 GiB of float32
  sets = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(2)]
  copy = jax.jit(lambda a: a * 1.0)  # read once, write once
  t_copy = median_seconds(copy, [(s,) for s in sets], runs)
  gbps = 2 * 4 * n / t_copy / 1e9
  del sets
  d = 8192
  mats = [
    (
      jax.random.normal(jax.random.key(2 * i), (d, d), jnp.bfloat16),
      jax.random.normal(jax.random.key(2 * i + 1), (d, d), jnp.bfloat16),
    )
    for i in range(2)
  ]
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
  t_dot = median_seconds(dot, mats, runs)
  tflops = 2 * d**3 / t_dot / 1e12
  info = {
    "device": gpu.device_kind,
    "compute_capability": getattr(gpu, "compute_capability", "?"),
    "jax": jax.__version__,
    # what else the image brings that the kernels and layers run on (KINDS.md names jax's only)
    "packages": versions(),
    "date": datetime.date.today().isoformat(),
    "copy_GBps": gbps,
    "bf16_matmul_TFLOPs": tflops,
  }
  lines = [
    f"device: {info['device']} (compute capability {info['compute_capability']}), "
    f"jax {info['jax']}, {info['date']}",
    f"device-to-device copy (1 GiB, read + write): {gbps:.0f} GB/s",
    f"bf16 jnp.dot 8192^3: {tflops:.0f} TFLOP/s",
    "packages: " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()),
  ]
  return info, lines
