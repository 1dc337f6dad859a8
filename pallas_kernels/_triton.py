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

from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

CompilerParams = plgpu.CompilerParams
CUSTOM_CALL_TARGET_NAME: str = plgpu.CUSTOM_CALL_TARGET_NAME
load = plgpu.load
store = plgpu.store

__all__ = ["CUSTOM_CALL_TARGET_NAME", "CompilerParams", "load", "pl", "store"]
