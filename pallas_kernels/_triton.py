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

import jax  # noqa: E402
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


__all__ = [
  "CUSTOM_CALL_TARGET_NAME",
  "CompilerParams",
  "load",
  "pl",
  "store",
  "unlowered_primitives",
]
