""":func:`jaxact.linear_cross_entropy` on each device's shards: the XLA path (or the Hopper
kernels) per device under Explicit mesh axes, and the few per-token reductions across devices.

Under Explicit mesh axes each device runs the loop on its shards
(:mod:`jaxact._src.core.pallas_sharding`'s dense pattern: tokens over data axes, the vocabulary
over model axes, as Megatron's vocab-parallel loss) and only per-token statistics, ``dx``, and for
data-parallel ``dw`` and ``db`` are reduced across devices. A sharded contraction dimension (an
FSDP table, feature-sharded ``x``) is gathered on each device, ``x`` once in the forward and kept
so; ``dx`` and ``dw`` are reduce-scattered back to their primals' shardings. The pattern is the
plan's ``decision.sharding``, derived once where the backend is decided
(:func:`jaxact._src.lce.rules.per_device`).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.core import pallas_sharding, shardings
from jaxact._src.lce import kernels
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.xla import grads_by_tokens, grads_by_vocab, stats_by_tokens, stats_by_vocab
from jaxact._src.lce.xla_tiles import lift_gap, lift_moment, mean_gap, rescale

# ------------------------------------------------------------------------ per device (shards)


def _flat(x: Array, labels: Array) -> tuple[Array, Array]:
  """``x`` as (tokens, D) and the labels as (tokens,) (D may be 0)."""
  tokens = math.prod(labels.shape)
  return x.reshape(tokens, x.shape[-1]), labels.reshape(tokens)


def global_sums(plan: LcePlan, m, se, model: tuple[str, ...], m_all=None):
  """``(max, Σ exp(s - max))`` of each token over all the devices of the `model` axes, from each
  device's over its columns: the ``pmax`` of the maxima (`m_all`, when already taken) and the
  ``psum`` of the sums, each rescaled to it first."""
  m_all = lax.pmax(m, model) if m_all is None else m_all
  return m_all, lax.psum(se * rescale(plan, m, m_all), model)


def _local_stats(plan: LcePlan, x, w, b, labels, *, vocab: int, model: tuple[str, ...] = ()):
  """``(max, Σ exp(s - max), label logit, gap, argmax column, moment)`` for one device's tokens
  ``x`` (..., D) and columns `w` (``gap``: the smoothing mean's distance below the max, None
  without smoothing; ``moment``: the entropy's ``Σ exp(s - max) (s - max)``, None without it);
  over `model` axes (the vocabulary split across devices) the statistics are combined by
  ``pmax``/``psum``/``pmin`` of per-token numbers, each device's sum and moment rescaled to the
  max over all of them first."""
  shape = x.shape[:-1]
  x2, labels2 = _flat(x, labels)
  first = 0  # the global index of this device's first column
  if model:
    first = lax.axis_index(model) * w.shape[plan.vocab_axis]
    labels2 = labels2 - first
  if plan.decision.forward == "mosaic":

    def xla(x, w, b, labels):
      m, se, sy, gap, _, _ = stats_by_vocab(plan, x, w, b, labels, vocab)
      return m, se, sy, None if gap is None else mean_gap(m, gap, vocab)

    # Never with the vocabulary split over `model` axes, nor with predictions, the entropy or a
    # temperature (rules.mosaic_unsupported).
    m, se, sy, gap = kernels.forward(plan, x2, w, b, labels2, xla)
    pred = moment = None
  else:
    by = stats_by_vocab if plan.by == "vocab" else stats_by_tokens
    m, se, sy, gap, best, moment = by(plan, x2, w, b, labels2, vocab)
    if model:
      m_all = lax.pmax(m, model)
      if moment is not None:  # each device's moment measured from the max over all of them
        moment = lax.psum(lift_moment(plan, moment, se, m, m_all), model)
      if gap is not None:  # each device's gap measured from the max over all of them
        gap = lax.psum(lift_gap(gap, m, m_all, vocab), model)
      m, se = global_sums(plan, m, se, model, m_all)
    gap = None if gap is None else mean_gap(m, gap, vocab)
    pred = None
    if best is not None:
      value, pred = best
      pred = pred + first
      if model:  # the first column of the largest value over the devices (NaN: as jnp.argmax)
        top = lax.pmax(jnp.where(jnp.isnan(value), jnp.inf, value), model)
        mine = (value == top) | (jnp.isnan(value) & (top == jnp.inf))
        pred = lax.pmin(jnp.where(mine, pred, vocab), model)
  if model:
    sy = lax.psum(sy, model)
  return tuple(None if v is None else v.reshape(shape) for v in (m, se, sy, gap, pred, moment))


def _local_grads(
  plan: LcePlan,
  x,
  w,
  b,
  labels,
  m,
  p_scale,
  label_scale,
  uniform_scale,
  h_scale,
  *,
  model: tuple[str, ...] = (),
):
  """``(dx, dw, db)`` of one device's shards (dx still to be summed over `model`, dw and db over
  the data axes: :func:`pallas_sharding.per_shard` does it)."""
  x2, labels2 = _flat(x, labels)
  if model:
    labels2 = labels2 - lax.axis_index(model) * w.shape[plan.vocab_axis]

  def flat(v):
    return None if v is None else v.reshape(labels2.shape)

  row_scales = (flat(p_scale), flat(label_scale), flat(uniform_scale), flat(h_scale))
  # The Hopper kernel forms G block by block inside grads_by_vocab (plan.decision.backward).
  by = grads_by_vocab if plan.by == "vocab" else grads_by_tokens
  dx, dw, db = by(plan, x2, w, b, labels2, flat(m), row_scales)
  return dx.reshape(x.shape), dw, db


def w_spec(plan: LcePlan, spec):
  """A (D, V) spec in `w`'s own layout."""
  return spec if plan.w_layout == "dv" else spec[::-1]


def split_axes(pattern, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The `axes` of more than one device (over one, the reductions would be collectives that do
  nothing)."""
  return tuple(a for a in axes if pattern.mesh.shape[a] > 1)


def gathered(plan: LcePlan, x):
  """`x` with its features whole on each device (gathered where they are split, as the product
  needs them): the array the forward multiplies and the backward keeps."""
  pattern = plan.decision.sharding
  return x if pattern is None else shardings.to_spec(x, pattern.x)


def statistics(plan: LcePlan, x, w, b, labels, vocab: int):
  """``(max, Σ exp(s - max), label logit, gap, argmax column, moment)`` per token
  (:func:`_local_stats`), on each device's shards when sharded (in the plan's
  ``decision.sharding``)."""
  pattern = plan.decision.sharding
  if pattern is None:
    return _local_stats(plan, x, w, b, labels, vocab=vocab)
  rows = pattern.x[:-1]
  return pallas_sharding.per_shard(
    functools.partial(_local_stats, plan, vocab=vocab, model=split_axes(pattern, pattern.model)),
    (x, w, b, labels),
    (pattern.x, w_spec(plan, pattern.w), (pattern.model,), rows),
    (rows, rows, rows, rows, rows, rows),
    mesh=pattern.mesh,
  )


def gradients(plan: LcePlan, x, w, b, labels, m, row_scales):
  """``(dx, dw, db)``, on each device's shards when sharded: dx summed over the vocabulary's axes
  and dw, db over the tokens', each then split as its primal is (``plan.shardings``; a
  reduce-scatter where a summed axis splits it: an FSDP table's gradient)."""
  pattern = plan.decision.sharding
  if pattern is None:
    return _local_grads(plan, x, w, b, labels, m, *row_scales)
  rows = pattern.x[:-1]
  local, final = gradient_specs(plan, pattern)
  return pallas_sharding.per_shard(
    functools.partial(_local_grads, plan, model=split_axes(pattern, pattern.model)),
    (x, w, b, labels, m, *row_scales),
    (pattern.x, local[1], (pattern.model,), rows, rows, rows, rows, rows, rows),
    final,
    mesh=pattern.mesh,
    sum_over=(pattern.model, pattern.data, pattern.data),
    local_specs=local,
  )


def gradient_specs(plan: LcePlan, pattern):
  """``(local, final)``: the specs of ``(dx, dw, db)`` as each device computes them in `pattern`
  (its rows of dx, its columns of dw and db) and as they come back, each its primal's
  (``plan.shardings``; where the primal's type holds none, the local one)."""
  w_local = w_spec(plan, pattern.w)
  x_typed, w_typed, _ = plan.shardings
  local = (pattern.x, w_local, (pattern.model,))
  final = (
    pattern.x if x_typed is None else x_typed,
    w_local if w_typed is None else w_typed,
    (pattern.model,),
  )
  return local, final
