""":func:`jaxact.top_k_distillation_loss`'s student loops on each device's shards under Explicit
mesh axes, in the LM head's pattern (:mod:`jaxact._src.lce.sharding`): the tokens over data axes,
the vocabulary over model axes, a split contraction dimension gathered.

Per device, the tail's max and sum of exponentials over its columns and the K entries' logits it
holds (:func:`jaxact._src.lce.xla_top_k.sums`, the entries shifted by the device's first column:
another device's fall outside its columns and count 0), combined over the model axes by
:func:`jaxact._src.lce.sharding.global_sums` and a ``psum`` of the (T, K) logits; the backward on
each device's columns, ``dx`` summed over the model axes and ``dw``, ``db`` over the data axes.
Only per-token numbers, ``dx`` and ``dw``, ``db`` cross devices. The pattern is the plan's
``decision.sharding``; None runs the loops as one program (under Auto axes XLA partitions them).
"""

from __future__ import annotations

import functools

from jax import lax

from jaxact._src.core import pallas_sharding
from jaxact._src.lce import xla_top_k
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.sharding import global_sums, gradient_specs, split_axes, w_spec


def _shifted(plan: LcePlan, w, idx, model):
  """`idx` relative to this device's first column over the `model` axes."""
  return idx - lax.axis_index(model) * w.shape[plan.vocab_axis] if model else idx


def _local_sums(plan: LcePlan, x, w, b, idx, *, model):
  m_tail, se_tail, picked = xla_top_k.sums(plan, x, w, b, _shifted(plan, w, idx, model))
  if model:
    m_tail, se_tail = global_sums(plan, m_tail, se_tail, model)
    picked = lax.psum(picked, model)
  return m_tail, se_tail, picked


def sums(plan: LcePlan, x, w, b, idx):
  """:func:`jaxact._src.lce.xla_top_k.sums` over the whole vocabulary, on each device's shards
  when sharded."""
  pattern = plan.decision.sharding
  if pattern is None:
    return xla_top_k.sums(plan, x, w, b, idx)
  rows = pattern.x[:-1]
  model = split_axes(pattern, pattern.model)
  return pallas_sharding.per_shard(
    functools.partial(_local_sums, plan, model=model),
    (x, w, b, idx),
    (pattern.x, w_spec(plan, pattern.w), (pattern.model,), (*rows, ())),
    (rows, rows, (*rows, ())),
    mesh=pattern.mesh,
  )


def _local_grads(plan: LcePlan, x, w, b, idx, m_tail, se_tail, m, se, g, *, model):
  idx = _shifted(plan, w, idx, model)
  return xla_top_k.grads(plan, x, w, b, idx, m_tail, se_tail, m, se, g)


def grads(plan: LcePlan, x, w, b, idx, m_tail, se_tail, m, se, g):
  """:func:`jaxact._src.lce.xla_top_k.grads`, on each device's shards when sharded: ``dx`` summed
  over the vocabulary's axes and ``dw``, ``db`` over the tokens', each then split as its primal
  is (``plan.shardings``)."""
  pattern = plan.decision.sharding
  if pattern is None:
    return xla_top_k.grads(plan, x, w, b, idx, m_tail, se_tail, m, se, g)
  rows = pattern.x[:-1]
  local, final = gradient_specs(plan, pattern)
  return pallas_sharding.per_shard(
    functools.partial(_local_grads, plan, model=split_axes(pattern, pattern.model)),
    (x, w, b, idx, m_tail, se_tail, m, se, g),
    (pattern.x, local[1], (pattern.model,), (*rows, ()), rows, rows, rows, rows, (*rows, ())),
    final,
    mesh=pattern.mesh,
    sum_over=(pattern.model, pattern.data, pattern.data),
    local_specs=local,
  )
