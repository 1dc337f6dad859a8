"""What the LM head's GPU section times, built where tests reach it.

``python -m benchmarks.gpu_check --sections lce`` (``benchmarks/gpu_lce.py``) times the paths of
:func:`paths`; ``tests/test_pallas_lce_hopper.py`` lowers each of them for an abstract H100, so
that the section a GPU session runs has been traced before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp

import jaxact

try:
  import tokamax
except ImportError:  # a comparison in the benchmark, not a dependency
  tokamax = None


def plain(x, w, labels):
  """What a JAX user writes: float32 logits, then optax's loss."""
  import optax

  logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def paths(hopper: bool) -> dict[str, Callable]:
  """label: ``loss(x, w, labels)`` for every path the section times (the Mosaic GPU one on
  Hopper only; tokamax's where it imports)."""
  out: dict[str, Callable] = {
    "plain": plain,
    "jaxact xla": functools.partial(jaxact.linear_cross_entropy, implementation="xla"),
  }
  if hopper:
    out["jaxact mosaic"] = functools.partial(jaxact.linear_cross_entropy, implementation="mosaic")
  if tokamax is not None:
    out["tokamax"] = lambda x, w, labels: tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="mean"
    )
  return out
