"""The ``custom_vjp`` of :func:`jaxact.dot_product_attention`: one rule for every backend.

It keeps the arrays the caller passed (q, k, v, bias and the :class:`.plan.Aux` arrays), the output
O and its row statistics ``stats`` (B, N, 2, T): each row's largest logit and the log of its
softmax's sum, kept apart (see :mod:`.xla`; splash attention's forward writes the log-sum-exp and
0), and runs each pass on the backend the decision names: the blocked XLA path (:mod:`.xla`), the
Triton kernels or splash attention (:mod:`.kernels`).
"""

from __future__ import annotations

import functools

import jax
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.attention import kernels
from jaxact._src.attention.plan import AttentionPlan, Aux
from jaxact._src.attention.xla import xla_backward, xla_forward

# The names of the kept O and row statistics (jax.ad_checkpoint.checkpoint_name): under
# jax.checkpoint(policy=save_only_these_names(*CHECKPOINT_NAMES)) a block keeps them (and the
# q, k, v its policy keeps) and its backward runs without the attention forward.
CHECKPOINT_NAMES = ("jaxact.attention.out", "jaxact.attention.stats")


def _forward(plan: AttentionPlan, q, k, v, bias, aux: Aux):
  if plan.decision.forward == "triton":  # lengths only (kernels.triton_unsupported)

    def xla(q, k, v, q_lengths, kv_lengths):
      return xla_forward(plan, q, k, v, None, Aux(q_lengths=q_lengths, kv_lengths=kv_lengths))

    return kernels.forward(plan, q, k, v, aux.q_lengths, aux.kv_lengths, xla)
  if plan.decision.forward == "splash":  # no masks but the causal one (kernels.splash_unsupported)
    return kernels.splash_forward(
      plan, q, k, v, lambda q, k, v: xla_forward(plan, q, k, v, None, Aux())
    )
  return xla_forward(plan, q, k, v, bias, aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: AttentionPlan, q, k, v, bias, aux: Aux) -> Array:
  """O (B, T, N, Hv) for jax.nn's layouts; the arrays the caller passed are the ones kept (the
  grouping reshapes happen inside, so an eager ``jax.vjp`` keeps no reshaped copy)."""
  return _forward(plan, q, k, v, bias, aux)[0]


def _attention_fwd(plan: AttentionPlan, q, k, v, bias, aux: Aux):
  o, stats = _forward(plan, q, k, v, bias, aux)
  # O goes through the barrier with the stats so that the kept O is the returned array (one
  # buffer), and XLA cannot recompute it in the backward from what the forward read.
  o, stats = lax.optimization_barrier((o, stats))
  o, stats = (checkpoint_name(a, n) for a, n in zip((o, stats), CHECKPOINT_NAMES, strict=True))
  return o, ((q, k, v, bias, aux), o, stats)


def _attention_bwd(plan: AttentionPlan, res, do):
  (q, k, v, bias, aux), o, stats = res
  (o, stats), do = lax.optimization_barrier(((o, stats), do))
  if plan.decision.backward == "triton":

    def xla(q, k, v, o, stats, do, q_lengths, kv_lengths):
      lengths = Aux(q_lengths=q_lengths, kv_lengths=kv_lengths)
      return xla_backward(plan, q, k, v, None, lengths, o, stats, do)[:3]

    dq, dk, dv = kernels.backward(plan, q, k, v, o, stats, do, aux.q_lengths, aux.kv_lengths, xla)
    return dq, dk, dv, None, None
  if plan.decision.backward == "splash":

    def xla(q, k, v, o, stats, do):
      return xla_backward(plan, q, k, v, None, Aux(), o, stats, do)[:3]

    return (*kernels.splash_backward(plan, q, k, v, o, stats, do, xla), None, None)
  return (*xla_backward(plan, q, k, v, bias, aux, o, stats, do), None)


attention.defvjp(_attention_fwd, _attention_bwd)
