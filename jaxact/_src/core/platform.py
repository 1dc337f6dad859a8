"""The kernels or XLA, by the platform a program is lowered for: what every family's kernel calls
share.

A family's kernel calls (``<family>/kernels.py``) wrap its Pallas kernels to run per shard
(:mod:`jaxact._src.core.pallas_sharding`) and hand them, with the XLA path that computes the same,
to :func:`switch`, which runs them behind ``jax.lax.platform_dependent``, so that the choice
follows the platform a program is lowered for:

========================  ==========================  ==========================================
decision                  lowered for CUDA            lowered for any other platform (CPU, ...)
========================  ==========================  ==========================================
kernels, not forced       the kernels                 XLA
kernels, forced           the kernels                 the kernels in interpret mode
========================  ==========================  ==========================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax import lax

if TYPE_CHECKING:
  from jaxact._src.core.dispatch import Decision


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
