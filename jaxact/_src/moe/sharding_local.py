"""One device's part of the expert-parallel :func:`jaxact.moe_mlp`: its tokens' assignments sent to
the devices that hold their experts (``jax.lax.all_to_all`` over the expert axes), the grouped
matmuls there, the outputs sent back and combined; the forward and the backward, each run inside
``jax.shard_map`` by :mod:`jaxact._src.moe.sharding`.

XLA:CPU has no ``ragged_all_to_all``, so the exchange is a plain ``all_to_all`` of fixed chunks:
each device sends each device of its expert group ``chunk`` rows (its assignments to that device's
experts, sorted by expert, then zeros), and receives ``n * chunk`` rows, which it sorts by its local
expert (padding last) into ``rows`` rows for ``ragged_dot``. The sizes are static and large enough
that nothing is ever dropped (:class:`~jaxact._src.moe.sharding.Pattern` derives them). The
capacity drop, when asked for, happens before the sending, by each assignment's rank in its
expert's queue over the whole batch (the counts of the devices before it, ``all_gather``-ed):
the one-device drop, device by device.

Between the passes each device keeps its ``x``, the top-k weights and experts (inputs of the op),
and ``a`` and ``b`` of the ``rows`` rows it computed; the backward recomputes the integer layout,
sends ``x``, the output cotangent and the weights again, and sends back ``dx`` and the weights'
cotangent.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.core import barriers
from jaxact._src.core.numerics import safe_mul
from jaxact._src.moe.plan import MoEPlan
from jaxact._src.moe.vjp import CHECKPOINT_NAMES, grouped_grads, hidden, matmul_dtype, ragged


class Layout(NamedTuple):
  """Where one device's assignments go and where its experts' rows come from (all int32)."""

  slot_of: Array  # (Tl*k,): the send slot of each local assignment (t*k + j); n*chunk if dropped
  slot_assign: Array  # (n*chunk,): the local assignment in each send slot; Tl*k for padding
  perm: Array  # (rows,): the received slot each expert row reads, sorted by local expert
  row_of: Array  # (n*chunk,): the expert row of each received slot; `rows` for padding
  sizes: Array  # (local experts,): the rows each local expert computes


def _take(v: Array, index: Array) -> Array:
  """``v[index]`` along the first axis, zeros where `index` is out of range (padding)."""
  return jnp.take(v, index, axis=0, mode="fill", fill_value=0)


def exchange(pat, v: Array) -> Array:
  """The all-to-all over the expert axes: chunk ``d`` of the (n*chunk, ...) `v` to device ``d``,
  the chunks received stacked by source."""
  if pat.n == 1:
    return v
  return lax.all_to_all(v, pat.expert, 0, 0, tiled=True)


def _kept(plan: MoEPlan, pat, flat: Array, order: Array) -> Array:
  """Whether each sorted assignment is within its expert's capacity, ranked over the whole batch in
  token order: the devices before this one (along the token axes) come first."""
  counts = jnp.bincount(flat, length=plan.experts).astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  ranked = flat[order]
  position = jnp.arange(flat.size, dtype=jnp.int32) - starts[ranked]
  if pat.tokens:
    every = lax.all_gather(counts, pat.tokens)  # (token devices, E), in the order of axis_index
    me = lax.axis_index(pat.tokens)
    earlier = jnp.arange(every.shape[0])[:, None] < me
    position = position + jnp.sum(jnp.where(earlier, every, 0), axis=0)[ranked]
  return position < plan.capacity


def layout(plan: MoEPlan, pat, experts: Array) -> Layout:
  """The :class:`Layout` of this device's (Tl, k) top-k `experts` (global indices)."""
  n, chunk, local = pat.n, pat.chunk, pat.local_experts
  flat = experts.reshape(-1)
  size = flat.size
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  key = flat[order]
  if plan.capacity is not None:  # the dropped ones after every expert's (key E)
    key = jnp.where(_kept(plan, pat, flat, order), key, plan.experts)
    resort = jnp.argsort(key, stable=True)
    order, key = order[resort], key[resort]
  dst = key // local  # n for the dropped
  sends = jnp.bincount(dst, length=n + 1)[:n].astype(jnp.int32)
  starts = jnp.cumsum(sends) - sends
  i = jnp.arange(size, dtype=jnp.int32)
  slot = jnp.where(dst < n, dst * chunk + i - starts[jnp.minimum(dst, n - 1)], n * chunk)
  slot_of = jnp.zeros(size, jnp.int32).at[order].set(slot.astype(jnp.int32))
  d, j = jnp.divmod(jnp.arange(n * chunk, dtype=jnp.int32), chunk)
  valid = j < sends[d]
  pos = jnp.minimum(starts[d] + j, size - 1)
  slot_assign = jnp.where(valid, order[pos], size)
  ids = jnp.where(valid, key[pos] - d * local, local)  # each slot's expert on its device
  got = exchange(pat, ids)
  full = jnp.argsort(got, stable=True).astype(jnp.int32)  # padding (id `local`) last
  rank = jnp.argsort(full).astype(jnp.int32)
  row_of = jnp.where(rank < pat.rows, rank, pat.rows)
  sizes = jnp.bincount(got, length=local + 1)[:local].astype(jnp.int32)
  return Layout(slot_of, slot_assign, full[: pat.rows], row_of, sizes)


def to_experts(pat, lay: Layout, v: Array, index: Array) -> Array:
  """The rows ``v[index]`` of this device's send slots, sent, received and sorted by expert."""
  return exchange(pat, _take(v, index))[lay.perm]


def from_experts(pat, lay: Layout, rows: Array) -> Array:
  """The expert `rows` sent back to the devices their assignments came from: (Tl*k, ...) in
  assignment order, zeros for the dropped ones."""
  return _take(exchange(pat, _take(rows, lay.row_of)), lay.slot_of)


def _psum(v: Array, axes) -> Array:
  return lax.psum(v, axes) if axes else v


def forward(plan: MoEPlan, pat, x, weights, w_gate, w_up, w_down, experts, *dynamic):
  """``(y, a, b)`` of this device's (Tl, D) tokens `x`."""
  mm, acc, k = matmul_dtype(plan, x.dtype), plan.acc_dtype, plan.top_k
  lay = layout(plan, pat, experts)
  xs = to_experts(pat, lay, x, lay.slot_assign // k)
  a = ragged(plan, xs, w_gate, lay.sizes, mm).astype(plan.out_dtype)
  b = ragged(plan, xs, w_up, lay.sizes, mm).astype(plan.out_dtype)
  # With the hidden features split (tensor parallel), each device's o is a partial sum.
  o = _psum(ragged(plan, hidden(plan, a, b, dynamic), w_down, lay.sizes, mm).astype(acc), pat.model)
  o = from_experts(pat, lay, o.astype(mm)).astype(acc).reshape(*weights.shape, -1)
  y = jnp.sum(safe_mul(o, weights[..., None]), axis=1).astype(plan.out_dtype)
  y, a, b = lax.optimization_barrier((y, a, b))
  a, b = (checkpoint_name(v, n) for v, n in zip((a, b), CHECKPOINT_NAMES, strict=True))
  return y, a, b


def backward(plan: MoEPlan, pat, x, weights, w_gate, w_up, w_down, experts, a, b, gy, *dynamic):
  """``(dx, d_weights, dw_gate, dw_up, dw_down, *d_dynamic)`` of this device: the weights' and
  the dynamic parameters' summed over the devices that share them."""
  mm, k = matmul_dtype(plan, x.dtype), plan.top_k
  (a, b), gy = barriers.after_cotangent((a, b), gy)
  lay = layout(plan, pat, experts)
  tokens = lay.slot_assign // k
  gys = to_experts(pat, lay, gy.astype(mm), tokens)
  ws = to_experts(pat, lay, weights.reshape(-1), lay.slot_assign)[:, None]
  xs = to_experts(pat, lay, x, tokens)
  rows = (xs, gys, ws, a, b, w_gate, w_up, w_down, lay.sizes, dynamic)
  d_ws, dxs, dw_gate, dw_up, dw_down, d_dynamic = grouped_grads(plan, *rows)
  d_ws = _psum(d_ws, pat.model)
  dxs = _psum(dxs, pat.model)
  dx = from_experts(pat, lay, dxs).reshape(*weights.shape, -1).sum(axis=1).astype(x.dtype)
  d_weights = from_experts(pat, lay, d_ws).reshape(weights.shape).astype(weights.dtype)
  # Each data-parallel group computed its own share of the experts' gradients.
  dws = [
    _psum(g.astype(w.dtype), pat.data)
    for g, w in zip((dw_gate, dw_up, dw_down), (w_gate, w_up, w_down), strict=True)
  ]
  d_dynamic = [_psum(g, (*pat.tokens, *pat.model)) for g in d_dynamic]
  return (dx, d_weights, *dws, *d_dynamic)
