"""The kernels or XLA, by the platform a program is lowered for: what every family's kernel calls
share.

A family's kernel calls (``<family>/kernels.py``) wrap its Pallas kernels to run per shard
(:mod:`jaxact._src.core.pallas_sharding`) and hand them, with the XLA path that computes the same,
to :func:`switch` (or :func:`by_platform`), which runs them behind ``jax.lax.platform_dependent``,
so that the choice follows the platform a program is lowered for, the kernels' own
(:data:`KERNEL_PLATFORMS`: CUDA for the GPU kernels, a TPU for splash attention):

========================  ==========================  ==========================================
decision                  lowered for the kernels'    lowered for any other platform (CPU, ...)
========================  ==========================  ==========================================
kernels, not forced       the kernels                 XLA
kernels, forced           the kernels                 the kernels in interpret mode
========================  ==========================  ==========================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax import lax

if TYPE_CHECKING:
  from jaxact._src.core.dispatch import Decision

# The platform each kernel backend compiles for (``lax.platform_dependent``'s keyword).
KERNEL_PLATFORMS = {"triton": "cuda", "mosaic": "cuda", "cudnn": "cuda", "splash": "tpu"}


def with_xla_derivatives(kernels: Callable[..., Any], xla: Callable[..., Any], interpret: bool):
  """`kernels`, differentiated as `xla` (the same function): Pallas calls have no JVP rule.

  Needed for forward-over-reverse (``jax.hessian``) of the fused ops, whose backward runs the
  kernels, and because ``platform_dependent`` differentiates every branch, the CUDA one included,
  whatever the platform.
  """

  @jax.custom_jvp
  def f(*args):
    return kernels(*args, interpret=interpret)

  @f.defjvp
  def f_jvp(primals, tangents):
    return f(*primals), jax.jvp(xla, primals, tangents)[1]

  return f


def switch(args, kernels: Callable[..., Any], xla: Callable[..., Any], d: Decision, mosaic: bool):
  """`kernels` (with an `interpret` flag) or `xla`, by lowering platform.

  Forced kernels run in interpret mode off CUDA. Mosaic GPU's interpreter is effectful (ordered
  host callbacks), and a ``platform_dependent`` whose other branch has effects does not lower for
  CUDA: when the trace is known to be for a CUDA GPU, forced Mosaic kernels are staged alone.
  """
  gpu = with_xla_derivatives(kernels, xla, interpret=False)
  if d.forced and mosaic and d.target.cuda:
    return gpu(*args)
  if d.forced:
    cpu = with_xla_derivatives(kernels, xla, interpret=True)
    return lax.platform_dependent(*args, cuda=gpu, default=cpu)
  return lax.platform_dependent(*args, cuda=gpu, default=xla)


def by_platform(args, kernel: Callable[..., Any], xla: Callable[..., Any], d: Decision, backend):
  """``kernel(*args, interpret=False)`` where the program is lowered for `backend`'s platform
  (:data:`KERNEL_PLATFORMS`); elsewhere ``kernel(*args, interpret=True)`` when the decision was
  forced, else ``xla(*args)``. For kernels that run inside a ``custom_vjp``'s rules (no JVP)."""
  native = functools.partial(kernel, interpret=False)
  other = functools.partial(kernel, interpret=True) if d.forced else xla
  return lax.platform_dependent(*args, default=other, **{KERNEL_PLATFORMS[backend]: native})
