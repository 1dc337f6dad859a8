"""The ``custom_vjp`` of :func:`jaxact.linear_cross_entropy` and :func:`jaxact.linear_log_probs`.

Per token ``t``, with logits ``z = x_t @ w + b`` accumulated in float32 (float64 for float64
inputs), capped logits ``s = c tanh(z / c) / T`` (or ``s = z / T``; the temperature ``T`` is 1
for the loss), label smoothing ``a`` and z-loss ``k``, the op returns the per-token loss

    loss_t = lse_t - (1 - a) s[t, y_t] - a mean_v s[t, v] + k lse_t^2,
    lse_t = m_t + log se_t,   m_t = max_v s[t, v],   se_t = sum_v exp(s[t, v] - m_t),

and keeps ``x``, ``w``, ``b``, ``labels`` and ``m_t``, ``se_t`` (two numbers a token) for the
backward pass, which recomputes the logits block by block and forms

    G[t, v] = g_t ((1 + 2 k lse_t) p[t, v] - (1 - a) [v = y_t] - a / V) ds/dz,
    p[t, v] = exp(s[t, v] - m_t) / se_t,

from the per-token cotangent ``g_t`` (whatever it is: the caller's reduction over tokens is JAX
code outside this rule), then ``dx = G wᵀ``, ``dw = xᵀ G``, ``db = Σ_t G``. No array of shape
(tokens, vocabulary) exists in either pass: the largest temporaries are one block of logits and
its ``G``.

T5X's label smoothing is optax's with ``a V / (V - 1)`` and a constant subtracted from every loss
(``loss_offset``: :func:`jaxact._src.lce.plan.t5x_smoothing`); per-token weights multiply ``g_t``
outside this rule. With ``predictions`` the forward also returns each token's argmax column of
``s``, tracked in the same loop (a running max and its column; across vocabulary shards a ``pmax``
and a ``pmin``). With ``entropy`` it also returns ``H_t = log se_t - mo_t / se_t``, the softmax's
entropy, from a third number a token kept for the backward, ``mo_t = sum_v exp(s - m_t)(s - m_t)``
(accumulated in the same loop, rescaled as ``se`` is), whose cotangent ``h_t`` adds
``-h_t p[t, v] (s[t, v] - m_t - mo_t / se_t)`` to ``G``. ``w`` is (D, V), or (V, D) for
``w_layout="vd"`` (an embedding table, sliced by rows, its gradient written by rows: no transposed
copy).

Masked vocabulary entries (``z = -inf``, from a bias of -inf) stay ``-inf`` under the cap, count
neither in the smoothing mean nor in ``G``, and get zero gradients. A row whose every logit is
``-inf`` has ``se = 0`` and loss ``+inf`` (its label is impossible), as has a token whose label
is outside ``[0, V)``; their gradients stay finite, and zero where their cotangent is zero.

``m`` and ``se`` are kept apart because one float32 ``lse`` loses ``log se`` next to logits of
-1e9, and the loss is formed from differences to ``m`` (:mod:`jaxact._src.lce.xla`). The XLA path
loops over blocks of the vocabulary, each device on its shards under Explicit mesh axes
(:mod:`jaxact._src.lce.sharding`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array

from jaxact._src.core import shardings
from jaxact._src.lce.plan import LcePlan
from jaxact._src.lce.sharding import gathered, gradients, statistics
from jaxact._src.lce.xla_tiles import entropy_of, loss_of, scales

# ------------------------------------------------------------------------- the custom_vjp


def _fwd(plan: LcePlan, x, w, b, labels, where):
  vocab = w.shape[plan.vocab_axis]
  x = gathered(plan, x)  # kept so: the backward needs the features whole again
  m, se, sy, gap, pred, moment = statistics(plan, x, w, b, labels, vocab)
  loss = loss_of(plan, m, se, sy, gap, labels, vocab, where)
  extra = (pred,) if plan.predictions else ()
  if plan.entropy:
    extra = (*extra, entropy_of(se, moment, where))
  out = (loss, *extra) if extra else loss
  return out, (x, w, b, labels, where, m, se, moment)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_token_loss(
  plan: LcePlan, x: Array, w: Array, b: Array | None, labels: Array, where: Array | None = None
) -> Array | tuple[Array, Array]:
  """The loss per token (``labels.shape``, the accumulation dtype; 0 where `where` is False),
  keeping ``x``, ``w``, ``b``, ``labels``, ``where``, each row's max and sum of exponentials; see
  the module docstring. With ``plan.predictions``, ``(loss, argmax column)``, the columns int32 (of
  every token); with ``plan.entropy``, the softmax's entropy last (``(loss, entropy)``, 0 where
  `where` is False), and its moment kept too."""
  return _fwd(plan, x, w, b, labels, where)[0]


def _bwd(plan: LcePlan, res, g):
  x, w, b, labels, where, m, se, moment = res
  gh = None
  if plan.entropy:
    g, gh = g[0], g[-1]
  elif plan.predictions:
    g = g[0]  # the predictions' cotangent is float0
  if where is not None:
    g = jnp.where(where, g, 0)
    gh = None if gh is None else jnp.where(where, gh, 0)
  row_scales = scales(plan, g, m, se, labels, w.shape[plan.vocab_axis], gh, moment)
  dx, dw, db = gradients(plan, x, w, b, labels, m, row_scales)
  dx, dw, db = shardings.retype((dx, dw, db), plan.shardings)
  return dx, dw, db, None, None


per_token_loss.defvjp(_fwd, _bwd)
