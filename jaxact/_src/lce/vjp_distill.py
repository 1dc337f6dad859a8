"""The ``custom_vjp`` of :func:`jaxact.distillation_loss`'s divergence: it keeps both heads' inputs
(which the caller holds anyway), each head's row max and sum of exponentials and one number a
token, and recomputes the logits block by block in the backward
(:mod:`jaxact._src.lce.xla_distill`), each device on its shards under Explicit mesh axes
(:mod:`jaxact._src.lce.sharding_distill`). The
teacher is frozen: its arguments get zero cotangents. Every cotangent is typed as its primal."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array

from jaxact._src.core import shardings
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.sharding import gathered
from jaxact._src.lce.sharding_distill import divergence, statistics, student_grads


def _fwd(ps: LcePlan, pt: LcePlan, kind: str, beta: float, pad, xs, ws, bs, xt, wt, bt, where):
  # Both heads' features whole on each device (gathered where split), kept so for the backward.
  xs, xt = gathered(ps, xs), gathered(ps, xt)
  norm_s, norm_t = statistics(ps, pt, xs, ws, bs, xt, wt, bt, pad)
  d, aux = divergence(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, pad)
  if where is not None:
    d = jnp.where(where, d, 0)
  return d, (xs, ws, bs, xt, wt, bt, where, norm_s, norm_t, aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def per_token_divergence(
  ps: LcePlan, pt: LcePlan, kind: str, beta: float, pad, xs, ws, bs, xt, wt, bt, where
) -> Array:
  """Each token's divergence (``xs.shape[:1]``, the accumulation dtype; 0 where `where` is
  False) between the student head ``(xs, ws, bs)`` under plan `ps` and the teacher's under `pt`
  (tokens flattened to rows); `pad` (a float or None) the student's logit at each of the
  teacher's columns past its own."""
  return _fwd(ps, pt, kind, beta, pad, xs, ws, bs, xt, wt, bt, where)[0]


def _bwd(ps, pt, kind, beta, pad, res, g):
  xs, ws, bs, xt, wt, bt, where, norm_s, norm_t, aux = res
  if where is not None:
    g = jnp.where(where, g, 0)
  dx, dw, db = student_grads(ps, pt, kind, beta, xs, ws, bs, xt, wt, bt, norm_s, norm_t, aux, g)
  zero = lambda a: None if a is None else jnp.zeros_like(a)
  dx, dw, db = shardings.retype((dx, dw, db), ps.shardings)
  teacher = shardings.retype((zero(xt), zero(wt), zero(bt)), pt.shardings)
  return dx, dw, db, *teacher, None


per_token_divergence.defvjp(_fwd, _bwd)
