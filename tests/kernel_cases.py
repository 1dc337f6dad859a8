"""Helpers shared by the kernel tests (test_pallas*.py): inputs, lowering for an abstract GPU, and
the float32 reference of the Hopper backward.

Lowering under an abstract mesh of a CUDA device needs no GPU: jaxact's dispatch reads the target
from the mesh, and Pallas lowers the kernels to their custom calls.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import pallas_kernels
import support
from support import GPUS

TRITON = pallas_kernels.CUSTOM_CALL_TARGET_NAME
MOSAIC = "mosaic_gpu_v2"


def _gpu_compiler() -> str | None:
  """Why this machine cannot compile for a GPU (jax's CUDA compiler plugin), or None; CI installs
  the plugin, so there its absence is an error, not a skip."""
  try:
    support.device(support.H100)
  except support.Unavailable as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI"):
      raise RuntimeError(f"CI installs jax's CUDA compiler, yet: {e}") from e
    return str(e)
  return None


_NO_COMPILER = _gpu_compiler()
needs_gpu_compiler = pytest.mark.skipif(
  _NO_COMPILER is not None, reason=f"cannot compile for a GPU here: {_NO_COMPILER}"
)


def args(shape, dtype, seed=0, bias=True):
  """x (batch..., K), w (K, N), b (N,), scaled so that z is of unit size (not saturated)."""
  *batch, k, n = shape
  kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (*batch, k), jnp.float32)
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  b = jax.random.normal(kb, (n,), jnp.float32) if bias else None
  return tuple(None if v is None else v.astype(dtype) for v in (x, w, b))


def cuda_mesh(kind: str) -> AbstractMesh:
  """A one-device abstract mesh of the GPU `kind` ("H100" or "A100")."""
  device = AbstractDevice(device_kind=GPUS[kind], num_cores=None, platform="cuda")
  return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)


def lowered_text(fn, arg_shapes, platform: str = "cuda", kind: str = "H100") -> str:
  """``jax.jit(fn)`` traced under `kind`'s mesh and lowered for `platform`, as text."""
  with jax.sharding.use_abstract_mesh(cuda_mesh(kind)):
    traced = jax.jit(fn).trace(*arg_shapes)
    try:
      return traced.lower(lowering_platforms=(platform,)).as_text()
    except Exception as e:  # pragma: no cover - depends on the installed jaxlib
      if platform == "cuda" and "cuda" in str(e).lower() and "platform" in str(e).lower():
        pytest.skip(f"this jaxlib cannot lower for CUDA: {e}")
      raise


def backward_reference(x, w, r, g, derivative):
  """dx, dw in float32 from the same bf16/f16 dz the kernels feed to wgmma; db the float32 sum of
  dz before that rounding (as bias_grad sums it)."""
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  exact = f32(g) if derivative is None else f32(g) * derivative(f32(r))
  dz = f32(exact.astype(g.dtype))
  hi = jax.lax.Precision.HIGHEST
  return jnp.dot(dz, f32(w).T, precision=hi), jnp.dot(f32(x).T, dz, precision=hi), exact.sum(0)
