""":func:`jaxact.distillation_loss` on each device's shards under Explicit mesh axes: both heads'
statistics, the divergence and the student's gradients per device, and the few per-token numbers
combined across devices.

The pattern is the LM head's (:mod:`jaxact._src.lce.sharding`): the tokens over data axes, both
heads' vocabulary over the same model axes (each device holds the same columns of the student's
and the teacher's head; a teacher typed otherwise is resharded to the student's pattern), a split
contraction dimension gathered. Per device, each head's row max and sum of exponentials over its
columns (:func:`jaxact._src.lce.xla_distill.row_sums`), combined over the model axes by a ``pmax``
of the maxima and a ``psum`` of the sums rescaled to it
(:func:`jaxact._src.lce.sharding.global_sums`); then each device's part of the divergence's
per-token sums over its columns, ``psum``-ed; the backward on each device's columns, ``dx`` summed
over the model axes and ``dw``, ``db`` over the data axes. Only per-token numbers, ``dx`` and
``dw``, ``db`` cross devices, never a block of logits. The pattern is ``ps.decision.sharding``,
derived once where the call is planned (:func:`pattern_of`); None runs the loops as one program
(under Auto axes XLA partitions them).
"""

from __future__ import annotations

import functools

from jaxact._src.core import pallas_sharding
from jaxact._src.lce import rules, xla_distill
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.sharding import global_sums, gradient_specs, split_axes, w_spec


def pattern_of(ps: LcePlan, pt: LcePlan, xs, ws, xt, wt):
  """The sharding plan both heads run in: the student head's dense pattern
  (:func:`jaxact._src.lce.rules.sharding_of`), the teacher's where only the teacher is split over
  devices, None where neither is (raises for a pattern no device split covers)."""
  for plan, x, w in ((ps, xs, ws), (pt, xt, wt)):
    pattern = rules.per_device(rules.sharding_of(plan, x, w))
    if pattern is not None:
      return pattern
  return None


def _in_specs(ps: LcePlan, pt: LcePlan, pattern) -> tuple:
  """The specs of ``(xs, ws, bs, xt, wt, bt)`` on the devices: both heads' rows and columns split
  alike (tokens rows ``(T, D)``, each head in its own layout)."""
  columns = (pattern.model,)
  return (
    pattern.x,
    w_spec(ps, pattern.w),
    columns,
    pattern.x,
    w_spec(pt, pattern.w),
    columns,
  )


def _local_norms(ps, pt, xs, ws, bs, xt, wt, bt, *, model, pad):
  (ms, ses), (mt, set_) = xla_distill.row_sums(ps, pt, xs, ws, bs, xt, wt, bt, pad)
  if model:  # the vocabulary split over devices: each head's sums over all of it
    (ms, ses), (mt, set_) = global_sums(ps, ms, ses, model), global_sums(pt, mt, set_, model)
  return ms, ses, mt, set_


def statistics(ps: LcePlan, pt: LcePlan, xs, ws, bs, xt, wt, bt, pad=None):
  """:func:`jaxact._src.lce.xla_distill.statistics`, on each device's shards when sharded (a
  `pad` only where the vocabulary is not split: checked where the call is planned)."""
  pattern = ps.decision.sharding
  if pattern is None:
    return xla_distill.statistics(ps, pt, xs, ws, bs, xt, wt, bt, pad)
  rows = pattern.x[:-1]
  model = split_axes(pattern, pattern.model)
  ms, ses, mt, set_ = pallas_sharding.per_shard(
    functools.partial(_local_norms, ps, pt, model=model, pad=pad),
    (xs, ws, bs, xt, wt, bt),
    _in_specs(ps, pt, pattern),
    (rows,) * 4,
    mesh=pattern.mesh,
  )
  return (ms, ses), (mt, set_)


def _local_divergence(ps, pt, kind, beta, pad, xs, ws, bs, xt, wt, bt, ms, ses, mt, set_):
  norms = (ms, ses), (mt, set_)
  return xla_distill.divergence(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, *norms, pad)


def divergence(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, pad=None):
  """:func:`jaxact._src.lce.xla_distill.divergence`, on each device's shards when sharded: each
  device's sums over its columns, summed over the model axes."""
  pattern = ps.decision.sharding
  if pattern is None:
    norms = norm_s, norm_t
    return xla_distill.divergence(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, *norms, pad)
  rows = pattern.x[:-1]
  return pallas_sharding.per_shard(
    functools.partial(_local_divergence, ps, pt, kind, beta, pad),
    (xs, ws, bs, xt, wt, bt, *norm_s, *norm_t),
    (*_in_specs(ps, pt, pattern), rows, rows, rows, rows),
    (rows, rows),
    mesh=pattern.mesh,
    sum_over=(pattern.model, pattern.model),
  )


def _local_grads(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, ms, ses, mt, set_, aux, g):
  norms = (ms, ses), (mt, set_)
  return xla_distill.student_grads(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, *norms, aux, g)


def student_grads(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, aux, g):
  """:func:`jaxact._src.lce.xla_distill.student_grads`, on each device's shards when sharded:
  ``dx`` summed over the vocabulary's axes and ``dw``, ``db`` over the tokens', each then split as
  its primal is (``ps.shardings``)."""
  pattern = ps.decision.sharding
  if pattern is None:
    return xla_distill.student_grads(
      ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, aux, g
    )
  rows = pattern.x[:-1]
  local, final = gradient_specs(ps, pattern)
  return pallas_sharding.per_shard(
    functools.partial(_local_grads, ps, pt, kind, beta),
    (xs, ws, bs, xt, wt, bt, *norm_s, *norm_t, aux, g),
    (*_in_specs(ps, pt, pattern), *(rows,) * 6),
    final,
    mesh=pattern.mesh,
    sum_over=(pattern.model, pattern.data, pattern.data),
    local_specs=local,
  )
