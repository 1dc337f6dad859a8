"""The one place that imports Pallas and its Triton backend.

Every kernel module takes ``pl`` and the Triton-specific names from here, so a change in
``jax.experimental.pallas`` (the API moves between JAX releases) touches one file.

The Triton backend is deprecated from JAX 0.11 in favour of Mosaic GPU, which does not run on
Ampere and Ada GPUs (A100, L4, RTX 30/40) that these kernels are written for. JAX 0.12 warns
(``DeprecationWarning``, deprecation id ``jax-pallas-triton``) each time a Triton ``pallas_call`` is
lowered, i.e. once per compiled kernel; we know, and filter exactly that message here rather than
letting it reach every user of jaxact. The filter is installed before the import so that a release
that warns at import time is covered too. Should JAX *accelerate* the deprecation (turn it into an
error), lowering raises and jaxact's automatic dispatch cannot hide it: that is deliberate.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings(
  "ignore",
  message=r".*Pallas Triton backend is deprecated",
  category=DeprecationWarning,
)

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import Array, lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

CompilerParams = plgpu.CompilerParams
CUSTOM_CALL_TARGET_NAME: str = plgpu.CUSTOM_CALL_TARGET_NAME
load = plgpu.load
store = plgpu.store


def unlowered_primitives(fn: Callable[..., jax.Array], *args: jax.ShapeDtypeStruct) -> list[str]:
  """The primitives of ``fn(*args)`` that the Triton backend has no lowering for (``erfc``, for
  one), sorted; empty when every one lowers, or when this JAX keeps its rule table elsewhere (then
  lowering itself reports them). In interpret mode every primitive runs."""
  try:
    from jax._src.pallas.triton.lowering import triton_lowering_rules
  except ImportError:  # pragma: no cover - depends on the JAX release
    return []
  missing: set[str] = set()

  def walk(jaxpr) -> None:
    for eqn in jaxpr.eqns:
      subs = [v for p in eqn.params.values() for v in (p if isinstance(p, (tuple, list)) else [p])]
      subs = [getattr(v, "jaxpr", v) for v in subs if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
      if subs:
        for sub in subs:
          walk(sub)
      elif eqn.primitive not in triton_lowering_rules:
        missing.add(eqn.primitive.name)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return sorted(missing)


# ---------------------------------------------------- what every Triton kernel module shares

DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def supported_dtypes() -> tuple[np.dtype, ...]:
  return DTYPES


def allow_tf32(precision: Any) -> bool:
  """Whether float32 dots may use TF32 under `precision` (a ``lax.dot_general`` precision).

  The mapping XLA uses on GPU: TF32 unless an operand asks for more than ``HIGH``. ``None`` defers
  to ``jax_default_matmul_precision`` (unset: TF32, as XLA's default on Ampere and newer);
  ``"highest"``/``"float32"``/``Precision.HIGHEST`` give exact float32 (IEEE) dots. Dot algorithm
  presets are not supported by these kernels.
  """
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
    if precision is None:
      return True
  if isinstance(precision, (str, lax.Precision)):
    precision = (precision, precision)
  if not isinstance(precision, (tuple, list)) or len(precision) != 2:
    raise NotImplementedError(f"precision {precision!r} is not supported by the Pallas kernels")
  allowed = (lax.Precision.DEFAULT, lax.Precision.HIGH)
  return all(lax.Precision(p) in allowed for p in precision if p is not None)


def iota(n: int) -> Array:
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def dot(a: Array, b: Array, *, tf32: bool, trans_a: bool = False, trans_b: bool = False) -> Array:
  """float32-accumulated ``a @ b`` (optionally of transposes), as the Triton backend lowers it.

  ``lax.dot_general`` directly, not ``pl.dot`` (removed in JAX 0.12): the backend maps the
  precision pair ``DEFAULT`` to TF32 and ``HIGHEST`` to IEEE float32 for float32 operands.
  """
  p = lax.Precision.DEFAULT if tf32 else lax.Precision.HIGHEST
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=(p, p), preferred_element_type=jnp.float32)


def load_tile(ref, r0, c0, rows: int, cols: int) -> Array:
  """The ``(rows, cols)`` tile of a 2-D ref at ``(r0, c0)``; zeros outside the array."""
  n_rows, n_cols = ref.shape
  mask = ((r0 + iota(rows)) < n_rows)[:, None] & ((c0 + iota(cols)) < n_cols)[None, :]
  block = ref.at[pl.ds(r0, rows), pl.ds(c0, cols)]
  return load(block, mask=mask, other=jnp.zeros((), ref.dtype))


def store_tile(ref, r0, c0, value: Array) -> None:
  rows, cols = value.shape
  n_rows, n_cols = ref.shape
  mask = ((r0 + iota(rows)) < n_rows)[:, None] & ((c0 + iota(cols)) < n_cols)[None, :]
  store(ref.at[pl.ds(r0, rows), pl.ds(c0, cols)], value.astype(ref.dtype), mask=mask)


def slots(kernel: Callable[..., None], present: tuple[bool, ...], **static):
  """`kernel` taking one ref per slot, called with the refs of the present slots (None else)."""

  def wrapped(*refs):
    it = iter(refs)
    kernel(*(next(it) if p else None for p in present), **static)

  return wrapped


__all__ = [
  "CUSTOM_CALL_TARGET_NAME",
  "DTYPES",
  "CompilerParams",
  "allow_tf32",
  "dot",
  "iota",
  "load",
  "load_tile",
  "pl",
  "slots",
  "store",
  "store_tile",
  "supported_dtypes",
  "unlowered_primitives",
]
