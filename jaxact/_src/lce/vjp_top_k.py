"""The ``custom_vjp`` of :func:`jaxact.top_k_distillation_loss`'s student side: each token's
log-probabilities at K given vocabulary entries and of the rest of the vocabulary, ``(T, K + 1)``
(:mod:`jaxact._src.lce.xla_top_k`). It keeps ``x``, ``w``, ``bias``, the K entries and four
numbers a token (the whole softmax's max and sum of exponentials, the tail's), and recomputes the
logits block by block in the backward, each device on its shards under Explicit mesh axes
(:mod:`jaxact._src.lce.sharding_top_k`). Every cotangent is typed as its primal."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array

from jaxact._src.core import shardings
from jaxact._src.lce import sharding_top_k
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.sharding import gathered
from jaxact._src.lce.xla_top_k import buckets, normalizer


def _fwd(plan: LcePlan, x, w, b, idx):
  x = gathered(plan, x)  # the features whole on each device, kept so for the backward
  m_tail, se_tail, picked = sharding_top_k.sums(plan, x, w, b, idx)
  valid = (idx >= 0) & (idx < w.shape[plan.vocab_axis])  # under jit: an entry outside is impossible
  picked = jnp.where(valid, picked, -jnp.inf)
  m, se = normalizer(plan, m_tail, se_tail, picked)
  return buckets(plan, m_tail, se_tail, picked, m, se), (x, w, b, idx, m_tail, se_tail, m, se)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bucket_log_probs(plan: LcePlan, x, w, b, idx) -> Array:
  """``(T, K + 1)`` in the accumulation dtype: the log-probabilities under the softmax of the head
  ``(x, w, b)`` (plan `plan`, tokens flattened to rows) of each row's K entries `idx` (int32,
  distinct; -inf for one outside ``[0, V)``) and, last, of all the other entries together."""
  return _fwd(plan, x, w, b, idx)[0]


def _bwd(plan: LcePlan, res, g):
  x, w, b, idx, m_tail, se_tail, m, se = res
  dx, dw, db = sharding_top_k.grads(plan, x, w, b, idx, m_tail, se_tail, m, se, g)
  dx, dw, db = shardings.retype((dx, dw, db), plan.shardings)
  return dx, dw, db, None


bucket_log_probs.defvjp(_fwd, _bwd)
