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


def mosaic_forward_only(x, w, labels):
  """``implementation="mosaic"`` with XLA's blocked backward in place of the backward kernel: what
  the two kernels are each worth, apart."""
  from jaxact._src import dispatch
  from jaxact._src.lce_vjp import LcePlan, default_block, kernel_block, per_token_loss

  tokens, vocab = x.shape[0], w.shape[1]
  plan = LcePlan(
    block=kernel_block(default_block(tokens, vocab, gpu=True), vocab),
    decision=dispatch.Decision("mosaic", "xla", forced=True, target=dispatch.target()),
  )
  return per_token_loss(plan, x, w, None, labels.astype(jnp.int32), None).mean()


def paths(hopper: bool) -> dict[str, Callable]:
  """label: ``loss(x, w, labels)`` for every path the section times (the Mosaic GPU ones, both
  kernels and the forward kernel alone, on Hopper only; tokamax's where it imports)."""
  out: dict[str, Callable] = {
    "plain": plain,
    "jaxact xla": functools.partial(jaxact.linear_cross_entropy, implementation="xla"),
  }
  if hopper:
    out["jaxact mosaic"] = functools.partial(jaxact.linear_cross_entropy, implementation="mosaic")
    out["jaxact mosaic fwd"] = mosaic_forward_only
  if tokamax is not None:
    out["tokamax"] = lambda x, w, labels: tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="mean"
    )
  return out
