"""The tile math of :func:`jaxact.linear_cross_entropy`'s XLA path (:mod:`jaxact._src.lce.xla`):
one block of logits, its statistics and their online merge, its ``G``, and the per-token loss and
gradient scales formed from the merged statistics.

Each token's statistics are its largest logit ``m`` and ``se = Σ exp(s - m)``, kept apart (not as
one ``lse = m + log se``): next to a logit of -1e9 float32 rounds ``log se`` (at most ``log V``)
away from ``m``, and the backward's probabilities ``exp(s - m) / se`` would be off by a factor of
``se``. The loss is formed as ``log se + (m - s_y)``, whose difference is exact for near-equal
logits. No infinity is made from finite operands (``jax.debug_infs`` stays quiet): the running max
starts at the float's lowest finite value and never drops below it, so a row whose every logit is
``-inf`` (a masked vocabulary) keeps ``m`` finite and ``se = 0``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src.core.numerics import exp_diff
from jaxact._src.lce.plan import LcePlan


def logits(plan: LcePlan, x: Array, w: Array, b: Array | None) -> Array:
  """``x @ w + b`` in the accumulation dtype. The forward and the backward pass both call this one
  function on the same blocks, so the backward's logits are the forward's."""
  dims = (((x.ndim - 1,), (1 - plan.vocab_axis,)), ((), ()))
  z = lax.dot_general(x, w, dims, plan.precision, preferred_element_type=plan.acc_dtype)
  return z if b is None else z + b.astype(plan.acc_dtype)[None, :]


def input_grad(plan: LcePlan, g: Array, w: Array) -> Array:
  """``g @ wᵀ`` (``g`` (T, Vb) against a block of ``w``'s columns, or rows for ``"vd"``) in the
  accumulation dtype."""
  dims = (((1,), (plan.vocab_axis,)), ((), ()))
  return lax.dot_general(g, w, dims, plan.precision, preferred_element_type=plan.acc_dtype)


def weight_grad(plan: LcePlan, x: Array, g: Array) -> Array:
  """``xᵀ g`` in ``w``'s layout: (D, Vb), or (Vb, D) for ``"vd"``; accumulation dtype."""
  dims = (((0,), (0,)), ((), ()))
  acc = plan.acc_dtype
  if plan.w_layout == "vd":
    return lax.dot_general(g, x, dims, plan.precision, preferred_element_type=acc)
  return lax.dot_general(x, g, dims, plan.precision, preferred_element_type=acc)


def capped(plan: LcePlan, z: Array) -> tuple[Array, Array | None]:
  """``(r, dr)``: the logits in the units the statistics are kept in, and the factor of ``G`` the
  cap contributes (None without a cap; 0 at -inf; -inf stays -inf). At ``T = 1`` ``r`` is what the
  softmax reads, ``s = c tanh(z / c)`` (or ``z``), and ``dr = ds/dz``. Under a temperature
  ``r = tanh(z / c)`` (or ``z``), the softmax reads ``s = k r`` with ``k = c / T`` (or ``1 / T``)
  and ``ds/dz = dr / T``: ``k`` multiplies only differences to the row max (:func:`shift`), where
  no multiply feeds a subtraction that XLA could fuse into one rounding in one pass and not in the
  other (a logit recomputed an ulp apart is ``1 / T`` ulps apart in ``s``), and ``1 / T``
  multiplies the products of ``G`` (:func:`grad_scale`), where no ``inf - inf`` can form. The
  forward and the backward both transform each block through this one function."""
  if plan.soft_cap is None:
    return z, None
  c = plan.soft_cap
  t = jnp.tanh(z / c)
  r = t if plan.temperature != 1 else c * t
  return jnp.where(z == -jnp.inf, z, r), 1 - t * t


def _factors(num: float, den: float, dtype) -> tuple[float, ...]:
  """``num / den`` (positive, finite) as factors each a normal number of `dtype`: itself where it
  is one, else its mantissa and powers of two (exact) that carry it past the dtype's range a
  step at a time, all on one side of 1, so that a product that ends in range never leaves it."""
  info = np.finfo(dtype)
  with np.errstate(over="ignore", under="ignore"):
    k = np.float64(num) / np.float64(den)
  if info.tiny <= k <= info.max:
    return (float(k),)
  (mn, en), (md, ed) = math.frexp(num), math.frexp(den)
  out, e = [mn / md], en - ed
  while e:
    step = max(-100, min(100, e))
    out.append(2.0**step)
    e -= step
  return tuple(out)


def _times(d: Array, factors: tuple[float, ...], clip: bool) -> Array:
  """``d`` times the product of `factors`; with `clip` (``d <= 0``) at least ``_FAR``, clipped
  before each factor above 1 too, so that no far difference overflows to -inf. Several factors are
  scalars behind a barrier: XLA's simplifier would fold them into one constant (jax 0.11's did),
  the overflowing product they are there to avoid."""
  for f in factors:
    if clip and f > 1:
      d = jnp.maximum(d, _FAR)
    d = d * (f if len(factors) == 1 else lax.optimization_barrier(jnp.asarray(f, d.dtype)))
  return jnp.maximum(d, _FAR) if clip else d


def _spread(plan: LcePlan) -> tuple[float, ...]:
  """The factors of ``k``, the softmax's logits per unit of :func:`capped`'s ``r``."""
  return _factors(plan.soft_cap or 1.0, plan.temperature, plan.acc_dtype)


def shift(plan: LcePlan, r: Array, m: Array) -> Array:
  """``s - m`` from ``r`` and a max ``m`` in :func:`capped`'s units: ``r - m`` at ``T = 1``;
  ``k (r - m)`` under a temperature, at least ``_FAR`` (where its exponential is 0)."""
  if plan.temperature == 1:
    return r - m
  return _times(r - m, _spread(plan), clip=True)


def spread(plan: LcePlan, d: Array) -> Array:
  """A difference of :func:`capped`'s ``r`` in the softmax's units (``k d``), not clipped: a
  log-probability, ``-inf`` only where it is beyond the float's range."""
  return d if plan.temperature == 1 else _times(d, _spread(plan), clip=False)


def rescale(plan: LcePlan, a: Array, b: Array) -> Array:
  """``exp(s_a - s_b)`` of two finite maxima ``a <= b`` in :func:`capped`'s units, whose
  difference may overflow (their halves' cannot): an online softmax's rescaling factor."""
  if plan.temperature == 1:
    return exp_diff(a, b)
  return jnp.exp(_times(a / 2 - b / 2, (2.0, *_spread(plan)), clip=True))


def grad_scale(plan: LcePlan, g: Array) -> Array:
  """A product of ``G`` (``dx``, a block of ``dw``, ``db``) times ``1 / T``, the rest of
  ``ds/dz`` (:func:`capped`); the products themselves are of numbers at most the cotangents."""
  if plan.temperature == 1:
    return g
  return _times(g, _factors(1.0, plan.temperature, plan.acc_dtype), clip=False)


# Below this, s - m is the same as -inf to exp (0 in float32 and float64): the entropy's terms
# ``p (s - m)`` read s - m clipped to it, so that a masked logit's term is 0 times a finite number.
_FAR = -1e4


def lowest(dtype) -> np.ndarray:
  """The float's lowest finite value: the running max before any column, and a row's max where
  no logit is finite (so that ``s - m`` is never ``-inf - -inf``)."""
  return np.finfo(dtype).min


def tile_stats(plan: LcePlan, s, labels, cols, fresh, vocab, bias=None):
  """One tile's ``(max, Σ exp(s - max), label logit, gap, moment)`` per row over its `fresh` columns
  (all when None). The max is at least :func:`lowest`, as :func:`merge` wants. ``gap`` (None
  without smoothing) is ``(Σ (max - s) / V, count)`` over the columns that count in the smoothing
  mean (those whose `bias` is not -inf): how far below the max the mean lies, kept relative to the
  max as the log-sum-exp is (a mean summed from logits of -1e9 would round away the loss), and how
  many columns it covers (the same for every row, so that no second mask of the tile's shape is
  formed). ``moment`` (None unless ``plan.entropy``) is ``Σ exp(s - max) (s - max)``, the
  entropy's one more number, with ``s - max`` clipped at ``_FAR`` (where its exponential is 0: a
  masked logit's ``0 · -inf`` is never formed)."""
  hit = cols[None, :] == labels[:, None]
  kept = s
  if fresh is not None:
    hit = hit & fresh[None, :]
    kept = jnp.where(fresh[None, :], s, lowest(s.dtype))
  m = jnp.maximum(jnp.max(kept, axis=-1), lowest(s.dtype))
  e = jnp.exp(shift(plan, kept, m[:, None]))
  if fresh is not None:  # the lowest float is not far below m under a temperature above 1
    e = jnp.where(fresh[None, :], e, 0)
  se = jnp.sum(e, axis=-1)
  sy = jnp.sum(jnp.where(hit, s, 0), axis=-1)
  gap = None
  if plan.label_smoothing:
    counted = fresh
    if bias is not None:
      finite = bias > -jnp.inf
      counted = finite if fresh is None else fresh & finite
    below = (m[:, None] - s) / vocab
    if counted is None:
      count = jnp.full(m.shape, s.shape[-1], s.dtype)
    else:
      below = jnp.where(counted[None, :], below, 0)
      count = jnp.broadcast_to(jnp.sum(counted, dtype=s.dtype), m.shape)
    gap = jnp.sum(below, axis=-1), count
  moment = None
  if plan.entropy:  # e > 0 only where fresh
    moment = jnp.sum(e * jnp.maximum(shift(plan, kept, m[:, None]), _FAR), axis=-1)
  return m, se, sy, gap, moment


def lift_gap(gap, m_old: Array, m: Array, vocab: int):
  """A ``(gap, count)`` of :func:`tile_stats` measured from the max `m_old`, measured from a
  max ``m >= m_old`` instead: ``count / V (m - m_old)`` more (by halves: ``m - m_old`` of two
  finite floats may overflow, and a count of 0 then adds 0)."""
  g, count = gap
  return g + (count / vocab * (m / 2 - m_old / 2)) * 2, count


def mean_gap(m: Array, gap, vocab: int) -> Array:
  """``m - mean``, the smoothing mean ``Σ s / V`` over the columns that count (a masked logit
  counts as 0 in it), from a ``(gap, count)`` measured from the max `m`. ``V - count`` is exact,
  0 without masks: ``1 - count / V`` would leave ``m`` times a rounding error where XLA fuses the
  difference into a multiply-add (30 for logits of -1e9)."""
  g, count = gap
  return g + (vocab - count) / vocab * m


def lift_moment(plan: LcePlan, moment: Array, se: Array, m_old: Array, m: Array) -> Array:
  """A ``Σ exp(s - m_old) (s - m_old)`` of :func:`tile_stats` (its row's ``se`` beside it) measured
  from a max ``m >= m_old`` instead: ``exp(m_old - m) (moment + (m_old - m) se)``, the maxima in
  :func:`capped`'s units, the difference in the softmax's. The difference is taken only where the
  factor is not 0, where it is at most a few hundred (by halves: that of two finite floats may
  overflow); elsewhere the moment is 0 (no ``0 · inf``)."""
  scale = rescale(plan, m_old, m)
  half = jnp.where(scale > 0, m_old / 2 - m / 2, 0)
  return scale * (moment + spread(plan, half) * 2 * se)


def merge(plan: LcePlan, a, b, vocab: int):
  """Two ``(m, Σ exp(s - m), gap, moment)`` of :func:`tile_stats` as one: the online log-sum-exp
  step, the entropy's moment rescaled with the sum."""
  (ma, sa, ga, da), (mb, sb, gb, db) = a, b
  m = jnp.maximum(ma, mb)
  gap = moment = None
  if ga is not None:
    (g1, c1), (g2, c2) = lift_gap(ga, ma, m, vocab), lift_gap(gb, mb, m, vocab)
    gap = g1 + g2, c1 + c2
  if da is not None:
    moment = lift_moment(plan, da, sa, ma, m) + lift_moment(plan, db, sb, mb, m)
  return m, sa * rescale(plan, ma, m) + sb * rescale(plan, mb, m), gap, moment


def tile_argmax(s: Array, cols: Array) -> tuple[Array, Array]:
  """``(max, its column)`` per row of a tile: the column of ``jnp.argmax`` (the first of equal
  maxima, a NaN before any number)."""
  i = jnp.argmax(s, axis=-1)
  return jnp.take_along_axis(s, i[:, None], axis=-1)[:, 0], cols[i].astype(jnp.int32)


def merge_argmax(best, tile):
  """The running ``(max, column)`` and a tile's as one, as ``jnp.argmax`` over both: the larger
  value (a NaN before any number), of equal ones the smaller column, so that columns seen twice
  (an overlapping last block) change nothing; a running column of -1 is no column yet."""
  (bv, bi), (tv, ti) = best, tile
  b_nan, t_nan, first = jnp.isnan(bv), jnp.isnan(tv), ti < bi
  later = (bi < 0) | (t_nan & (~b_nan | first)) | (~b_nan & ((tv > bv) | ((tv == bv) & first)))
  return jnp.where(later, tv, bv), jnp.where(later, ti, bi)


def tile_grad(plan: LcePlan, s, dcap, labels, cols, m, scales, vocab_dtype) -> Array:
  """``G`` of one tile from the rows' max `m` and the per-row scales (:func:`scales`: the first
  holds ``1 / se``; the last, the entropy's, multiplies ``p (s - m)``, ``s - m`` clipped at
  ``_FAR`` where ``p`` is 0). ``s - m <= 0`` but for a recomputed logit an ulp above the forward's
  (a huge exponent next to huge logits), hence the ``minimum``."""
  p_scale, label_scale, uniform_scale, h_scale = scales
  if h_scale is None:
    g = p_scale[:, None] * jnp.exp(jnp.minimum(shift(plan, s, m[:, None]), 0))
  else:
    d = jnp.clip(shift(plan, s, m[:, None]), _FAR, 0)
    g = jnp.exp(d) * (p_scale[:, None] - h_scale[:, None] * d)
  if label_scale is not None:
    g = g - jnp.where(cols[None, :] == labels[:, None], label_scale[:, None], 0)
  if uniform_scale is not None:
    g = g - jnp.where(jnp.isfinite(s), uniform_scale[:, None], 0)
  if dcap is not None:
    g = g * dcap
  return g.astype(vocab_dtype)


def _log_sum(se: Array) -> tuple[Array, Array]:
  """``(log se, no finite logit)``: the log is 0 where ``se = 0`` (the row's flag is True); a NaN
  stays NaN."""
  empty = se == 0
  return jnp.log(jnp.where(empty, 1, se)), empty


def lse_of(m: Array, se: Array) -> Array:
  """The log-sum-exp ``m + log se`` (0 where no logit is finite), for the z-loss: rounded to
  ``m``'s ulp, which the z-loss's own size dwarfs."""
  log_se, empty = _log_sum(se)
  return jnp.where(empty, 0, m + log_se)


def scales(
  plan: LcePlan, g: Array, m: Array, se: Array, labels: Array, vocab: int, gh=None, moment=None
):
  """The per-token factors of ``G`` for the loss's cotangent `g` and the entropy's `gh` (None
  without): ``((g (1 + 2 k lse) + gh μ) / se, g (1 - a) [label valid], g a / V, gh / se)``, with
  ``μ = moment / se = E_p[s] - m`` (the entropy's ``dH/ds = -p (s - m - μ)``); None where a term is
  absent, 0 in the first and last where no logit is finite (``se = 0``)."""
  acc = plan.acc_dtype
  g = g.astype(acc)
  empty = se == 0
  inv = 1 / jnp.where(empty, 1, se)
  p_scale = g * inv
  if plan.z_loss:
    p_scale = p_scale * (1 + 2 * plan.z_loss * lse_of(m, se))
  h_scale = None
  if gh is not None:
    h_scale = jnp.where(empty, 0, gh.astype(acc) * inv)
    p_scale = p_scale + h_scale * (moment * inv)
  p_scale = jnp.where(empty, 0, p_scale)
  label_scale = None
  if plan.label_smoothing != 1:
    valid = (labels >= 0) & (labels < vocab)
    label_scale = jnp.where(valid, g * (1 - plan.label_smoothing), 0).astype(acc)
  uniform_scale = g * (plan.label_smoothing / vocab) if plan.label_smoothing else None
  return p_scale, label_scale, uniform_scale, h_scale


def entropy_of(se: Array, moment: Array, where: Array | None = None) -> Array:
  """The entropy of each row's softmax, ``H = lse - E_p[s] = log se - moment / se``, both terms
  relative to the max (exact for equal logits of any size: ``log V``), at least 0; 0 where no
  logit is finite and where `where` is False."""
  log_se, empty = _log_sum(se)
  h = jnp.maximum(log_se - moment / jnp.where(empty, 1, se), 0)
  keep = ~empty if where is None else where & ~empty
  return jnp.where(keep, h, 0)


def loss_of(plan: LcePlan, m, se, sy, gap, labels, vocab, where=None) -> Array:
  """The loss from the statistics, as ``log se + (1 - a)(m - s_y) + a gap + k lse²`` (``gap``:
  ``m - mean`` of :func:`mean_gap`, None without smoothing): the differences to the max are
  exact for near-equal logits, whatever their size. +inf where the label is outside ``[0, V)`` or
  no logit is finite; NaN where the logits hold a NaN; 0 where `where` is False (and no infinity
  made there)."""
  a = plan.label_smoothing
  loss, empty = _log_sum(se)
  # se >= 1 (the max's own term) and m >= s_y; but under jit XLA may compute one logit twice,
  # rounded apart (a temperature's division fused into two kernels), which at 1e7 is a whole unit:
  # both are clipped to what they are mathematically (NaN stays NaN).
  loss = jnp.maximum(loss, 0)
  if a != 1:
    loss = loss + (1 - a) * jnp.maximum(spread(plan, m - sy), 0)
  if gap is not None:
    loss = loss + a * gap
  if plan.z_loss:
    lse = lse_of(m, se)
    loss = loss + plan.z_loss * lse * lse
  if plan.loss_offset:
    loss = loss - plan.loss_offset
  valid = (labels >= 0) & (labels < vocab) & ~empty
  if where is None:
    return jnp.where(valid, loss, jnp.inf)
  return jnp.where(valid | ~where, jnp.where(where, loss, 0), jnp.inf)
