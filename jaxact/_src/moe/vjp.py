"""The ``custom_vjp`` of the experts' gated MLPs: grouped matmuls over the tokens sorted by expert.

With the assignments (token, slot) sorted by expert (``order``, ``group_sizes``: the routing), the
forward gathers the sorted input ``xs = x[order // k]``, computes ``a = xs @ W_g[e]`` and
``b = xs @ W_u[e]`` as :func:`jax.lax.ragged_dot` (one group an expert), ``h = act(a) * b``,
``o = h @ W_d[e]``, and combines ``y_t = sum_j w_tj o_(t, j)`` back in token order.

Between the passes it keeps the input ``x``, ``a`` and ``b`` (two (T*k, F) arrays), the top-k
weights and the integer routing (two (T*k,) permutations and the (E,) group sizes), nothing else:
the backward gathers ``xs`` again, recomputes ``h`` from ``a`` and ``b``, and gets the weights'
gradient ``<gy_t, o_(t, j)> = <gy_t W_d[e]^T, h>`` from the product it needs anyway for ``gh``, so
``o`` is never recomputed. Autodiff of the same composition keeps ``xs``, ``act(a)`` (and the
activation's intermediates), ``h`` and ``o`` besides.

The matmuls' transposes are :func:`jax.linear_transpose` of the forward's ragged_dot (JAX's own
grouped transposes). With ``implementation="pallas"`` (``plan.decision``) every grouped product,
forward and backward, is a Triton grouped matmul instead (:mod:`jaxact._src.moe.kernels`).
Products with a weight that may be 0 next to an overflowed factor are
:func:`~jaxact._src.core.numerics.safe_mul`: 0, not NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.activations import gating
from jaxact._src.core import barriers
from jaxact._src.core.numerics import safe_mul
from jaxact._src.moe import kernels, vjp_batching
from jaxact._src.moe.plan import MoEPlan

# The names of the residuals a and b (jax.ad_checkpoint.checkpoint_name), for remat policies.
CHECKPOINT_NAMES = ("jaxact.moe.a", "jaxact.moe.b")


def matmul_dtype(plan: MoEPlan, operands) -> np.dtype:
  """16-bit operands give a 16-bit product (as XLA's GPU GEMMs write it); else the acc dtype."""
  return np.dtype(operands) if np.dtype(operands).itemsize == 2 else plan.acc_dtype


def _ragged_dot(plan: MoEPlan, lhs: Array, w: Array, group_sizes: Array, dtype) -> Array:
  return lax.ragged_dot(lhs, w, group_sizes, plan.precision, preferred_element_type=dtype)


def ragged(plan: MoEPlan, lhs: Array, w: Array, group_sizes: Array, dtype) -> Array:
  """``lhs[rows of e] @ w[e]`` in `dtype`: XLA's ragged_dot, or the decision's kernel."""
  xla = lambda lhs, w, sizes: _ragged_dot(plan, lhs, w, sizes, dtype)
  if plan.decision.forward != "xla":
    return kernels.gmm(plan, lhs, w, group_sizes, dtype, xla)
  return xla(lhs, w, group_sizes)


def hidden(plan: MoEPlan, a: Array, b: Array, dynamic) -> Array:
  """``h = act(a) * b`` in the output dtype, from the kept (rounded) a and b."""
  return gating.hidden(plan.act, a, b, dynamic, plan.acc_dtype, plan.out_dtype)


def _combine(plan: MoEPlan, rows: Array, inverse: Array, weights: Array | None) -> Array:
  """The sorted (T*k, n) `rows` back in token order, summed over each token's k slots (weighted
  by `weights` (T, k) where given), in the accumulation dtype: (T, n)."""
  rows = rows[inverse].astype(plan.acc_dtype).reshape(plan.tokens, plan.top_k, -1)
  if weights is not None:
    rows = safe_mul(rows, weights[..., None])
  return jnp.sum(rows, axis=1)


def _forward(plan: MoEPlan, x, weights, w_gate, w_up, w_down, order, inverse, sizes, *dynamic):
  """``(y, a, b)``: the experts' outputs combined in token order, and the kept projections."""
  mm = matmul_dtype(plan, x.dtype)
  xs = x[order // plan.top_k]
  a = ragged(plan, xs, w_gate, sizes, mm).astype(plan.out_dtype)
  b = ragged(plan, xs, w_up, sizes, mm).astype(plan.out_dtype)
  o = ragged(plan, hidden(plan, a, b, dynamic), w_down, sizes, mm)
  return _combine(plan, o, inverse, weights).astype(plan.out_dtype), a, b


def _value(plan: MoEPlan, *args):
  return _forward(plan, *args)[0]


def _experts_fwd(plan: MoEPlan, x, weights, w_gate, w_up, w_down, order, inverse, sizes, *dynamic):
  args = (x, weights, w_gate, w_up, w_down, order, inverse, sizes)
  y, a, b = vjp_batching.batchable(plan, _forward, "forward")(*args, *dynamic)
  # As the gated family: hide a and b's origin, so that XLA neither recomputes them in the backward
  # nor keeps the forward's act(a), h or o alive to share with the backward's.
  y, a, b = lax.optimization_barrier((y, a, b))
  a, b = (checkpoint_name(v, n) for v, n in zip((a, b), CHECKPOINT_NAMES, strict=True))
  return y, (*args, a, b, dynamic)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(plan: MoEPlan, x, weights, w_gate, w_up, w_down, order, inverse, sizes, *dynamic):
  args = (x, weights, w_gate, w_up, w_down, order, inverse, sizes, *dynamic)
  return vjp_batching.batchable(plan, _value, "value")(*args)


def transpose(f, primal: Array, ct: Array) -> Array:
  """The transpose of the linear `f` in `primal` (a ragged_dot's) applied to `ct`."""
  return jax.linear_transpose(f, primal)(ct)[0]


def weight_grad(plan: MoEPlan, lhs, ct, w, sizes, dtype, per_element=None) -> Array:
  """The cotangent of `w` in ``ragged(lhs, w)`` from the output's `ct`; with `per_element`
  (``(rows, sizes)``, (B, R) and (B, E): a vmapped call's elements' rows, each in its own expert
  order, and group sizes) each element's own, (B, *w.shape), one element at a time (each costs
  what its own call's does: XLA's ragged_dot is a dense product over its groups)."""
  if per_element is not None:
    rows, each = per_element

    def one(element):
      r, s = element
      return weight_grad(plan, lhs[r], ct[r], w, s, dtype)

    return lax.map(one, (rows, each))

  def xla(lhs, ct, sizes):
    return transpose(lambda w_: _ragged_dot(plan, lhs, w_, sizes, dtype), w, ct)

  if plan.decision.backward != "xla":
    return kernels.tgmm(plan, lhs, ct, sizes, dtype, xla)
  return xla(lhs, ct, sizes)


def input_grad(plan: MoEPlan, ct, w, lhs, sizes, dtype) -> Array:
  """The cotangent of `lhs` in ``ragged(lhs, w)`` from the output's `ct`."""

  def xla(ct, w, sizes):
    return transpose(lambda v: _ragged_dot(plan, v, w, sizes, dtype), lhs, ct)

  if plan.decision.backward != "xla":
    return kernels.gmm_t(plan, ct, w, sizes, dtype, xla)
  return xla(ct, w, sizes)


def grouped_grads(
  plan: MoEPlan, xs, gys, ws, a, b, w_gate, w_up, w_down, sizes, dynamic, per_element=None
):
  """The experts' backward over their sorted rows: ``(d_ws, dxs, dw_gate, dw_up, dw_down,
  d_dynamic)`` from the rows' inputs `xs`, cotangents `gys` (before their weights), weights `ws`
  (rows, 1) and kept `a`, `b`; ``d_ws`` the gradient of each row's weight, ``dxs`` of its input.
  With `per_element`, the weights' gradients are each vmapped element's (:func:`weight_grad`).

  One grouped product at a time: XLA's ragged_dot (jax 0.12, CPU and GPU) is a dense product over
  a masked (experts x rows) operand, and the barriers chain the six so that one such operand is
  alive at once, not three (a scanned block's backward: 152 -> 92 MiB on CPU, 8 experts top-2,
  1024 tokens, D 256, F 512; 2176 -> 1472 MiB compiled for an H100 at 2048 tokens, D 2048, F 5632).
  """
  acc, mm = plan.acc_dtype, matmul_dtype(plan, xs.dtype)
  h = hidden(plan, a, b, dynamic)
  gyw = safe_mul(gys.astype(acc), ws).astype(mm)
  dw_down = weight_grad(plan, h, gyw, w_down, sizes, mm, per_element)
  (gys, h), dw_down = lax.optimization_barrier(((gys, h), dw_down))
  # g_o = gy W_d[e]^T: both the weights' gradient <g_o, h> and gh = w g_o come from it.
  g_o = input_grad(plan, gys, w_down, h, sizes, mm).astype(acc)
  d_ws = jnp.sum(safe_mul(g_o, h.astype(acc)), axis=-1)
  da, db, d_dynamic = gating.gate_cotangents(plan.act, a, b, safe_mul(g_o, ws), dynamic, acc)
  da, db = da.astype(mm), db.astype(mm)
  dw_gate = weight_grad(plan, xs, da, w_gate, sizes, mm, per_element)
  (xs, db), dw_gate = lax.optimization_barrier(((xs, db), dw_gate))
  dw_up = weight_grad(plan, xs, db, w_up, sizes, mm, per_element)
  (xs, da), dw_up = lax.optimization_barrier(((xs, da), dw_up))
  dxs = input_grad(plan, da, w_gate, xs, sizes, mm).astype(acc)
  (xs, db), dxs = lax.optimization_barrier(((xs, db), dxs))
  dxs = dxs + input_grad(plan, db, w_up, xs, sizes, mm).astype(acc)
  return d_ws, dxs, dw_gate, dw_up, dw_down, d_dynamic


def _backward(
  plan: MoEPlan,
  x,
  weights,
  w_gate,
  w_up,
  w_down,
  order,
  inverse,
  sizes,
  per_element,
  a,
  b,
  gy,
  *dynamic,
):
  """``(dx, d_weights, dw_gate, dw_up, dw_down, *d_dynamic)``; with `per_element` (None, or a
  vmapped call's, :func:`weight_grad`) the weights' gradients each element's."""
  mm = matmul_dtype(plan, x.dtype)
  # Nothing of the backward (xs, h) may run before the cotangent exists (barriers.after_cotangent).
  (a, b), gy = barriers.after_cotangent((a, b), gy)
  tokens = order // plan.top_k
  ws = weights.reshape(-1)[order][:, None]  # each sorted row's weight
  gys = gy[tokens].astype(mm)  # (T*k, out): each sorted row's cotangent, before its weight
  rows = (x[tokens], gys, ws, a, b, w_gate, w_up, w_down, sizes, dynamic, per_element)
  d_ws, dxs, dw_gate, dw_up, dw_down, d_dynamic = grouped_grads(plan, *rows)
  d_weights = d_ws[inverse].reshape(weights.shape).astype(weights.dtype)
  dx = _combine(plan, dxs, inverse, None).astype(x.dtype)
  dws = (dw_gate.astype(w_gate.dtype), dw_up.astype(w_up.dtype), dw_down.astype(w_down.dtype))
  return (dx, d_weights, *dws, *d_dynamic)


def _experts_bwd(plan: MoEPlan, res, gy: Array):
  x, weights, w_gate, w_up, w_down, order, inverse, sizes, a, b, dynamic = res
  args = (x, weights, w_gate, w_up, w_down, order, inverse, sizes, None, a, b, gy, *dynamic)
  dx, d_weights, *grads = vjp_batching.batchable(plan, _backward, "backward")(*args)
  return (dx, d_weights, *grads[:3], None, None, None, *grads[3:])


_experts.defvjp(_experts_fwd, _experts_bwd)
_experts_jit = jax.jit(_experts, static_argnums=0)


def experts(plan: MoEPlan, x, weights, w_gate, w_up, w_down, order, inverse, sizes, *dynamic):
  """``y`` (T, out): the experts' gated MLPs of the routed (T, D) `x`, combined with `weights`."""
  # A closure-converted callable is a new object on every call; jit would retrace each time.
  run = _experts_jit if plan.act.fn is None else _experts
  return run(plan, x, weights, w_gate, w_up, w_down, order, inverse, sizes, *dynamic)
