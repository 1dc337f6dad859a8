"""The experts' ``jax.vmap`` rule: a batch of independent MoE calls run as one call over all their
tokens.

``jax.lax.ragged_dot`` has no batching rule for a batched left operand and group sizes, so the
experts' value, forward and backward (:mod:`jaxact._src.moe.vjp`) are each a
:class:`jax.custom_batching.custom_vmap` (inside the ``custom_vjp``, as JAX composes the two).
Under ``vmap`` each element keeps its own routing (the routing and the auxiliary losses are plain
JAX, batched as written), and its routed rows join one grouped call: the elements' rows sorted by
expert, then by element (by element, then expert, where the experts' weights are batched too), so
every product is one ragged product over ``B * T * k`` rows, and each row sees exactly what its own
call would. The rows' order (the fold's ``layout``) is computed from the integer routing alone, the
same in the forward and the backward: a batched ``a``, ``b`` kept between them is in that order.

The backward gives each element its own gradient of shared expert weights (what ``vmap`` of a
gradient asks for; JAX sums them where the gradient is of the vmapped function), one element at a
time from its own rows (as many grouped rows in all as one call over every token: XLA's
ragged_dot is a dense product over its groups, so groups of (expert, element) would cost the
mapped size times more). Calls with traced activation parameters run the elements one after
another (``lax.map``), and so does a map of a mapped backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.moe.plan import MoEPlan

# The leading arguments of the three functions: x, weights, w_gate, w_up, w_down, order, inverse,
# sizes. The backward's go on with per_element (None, or a map's elements' rows and group sizes:
# vjp.weight_grad), a, b, gy; every function ends with the dynamic (traced activation) parameters.
ROUTED = 8
_BACKWARD_EXTRA = 4


def batchable(plan: MoEPlan, impl: Callable, kind: str) -> Callable:
  """``impl(plan, *args)`` (kind ``"value"``, ``"forward"`` or ``"backward"``) with the fold as
  its vmap rule."""
  f = jax.custom_batching.custom_vmap(lambda *args: impl(plan, *args))
  f.def_vmap(lambda size, batched, *args: _rule(plan, impl, kind, size, batched, args))
  return f


def _rule(plan: MoEPlan, impl, kind: str, size: int, batched, args):
  if size == 0:  # an empty mapped axis: the outputs' shapes, with no element
    leaves, tree = jax.tree.flatten(args)
    flags = jax.tree.leaves(batched)
    one = [jax.ShapeDtypeStruct(a.shape[b:], a.dtype) for a, b in zip(leaves, flags, strict=True)]
    out = jax.eval_shape(lambda *a: impl(plan, *a), *jax.tree.unflatten(tree, one))
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), out), jax.tree.map(
      lambda _: True, out
    )
  fixed = ROUTED + (_BACKWARD_EXTRA if kind == "backward" else 0)
  if len(args) > fixed:  # traced activation parameters: one element at a time
    return _sequential(plan, impl, kind, batched, args)
  if kind == "backward" and args[ROUTED] is not None:
    # A map of a map's per-element weight gradients (their rows index the inner map's fold): one
    # element at a time, its a and b taken back from where the folded forward put them.
    args = list(args)
    layout = _fold(size, batched, args)[3]
    for i in (ROUTED + 1, ROUTED + 2):
      if batched[i]:
        v = args[i].reshape(-1, args[i].shape[-1])
        args[i] = v[_inverse(layout)].reshape(args[i].shape)
    return _sequential(plan, impl, kind, batched, tuple(args))
  return _folded(plan, impl, kind, size, batched, args)


def _sequential(plan: MoEPlan, impl, kind: str, batched, args):
  leaves, tree = jax.tree.flatten(args)
  flags = jax.tree.leaves(batched)
  mapped = [a for a, b in zip(leaves, flags, strict=True) if b]

  def one(mapped_one):
    it = iter(mapped_one)
    full = [next(it) if b else a for a, b in zip(leaves, flags, strict=True)]
    return batchable(plan, impl, kind)(*jax.tree.unflatten(tree, full))

  out = lax.map(one, mapped)
  return out, jax.tree.map(lambda _: True, out)


def _rows(v: Array, is_batched: bool, layout: Array) -> Array:
  """An element's kept (T*k, n) sorted rows as the one call's (B*T*k, n): batched, they are the
  folded forward's, already in the fold's order; shared, each row taken where `layout` says."""
  if is_batched:
    return v.reshape(-1, v.shape[-1])
  return v[layout % v.shape[0]]


def _broadcast(v: Array, is_batched: bool, size: int) -> Array:
  return v if is_batched else jnp.broadcast_to(v, (size, *v.shape))


def _fold_routing(order, sizes, per_element_experts):
  """The one call's ``(order, inverse, sizes, layout)`` from each element's (B, T*k) `order` and
  (B, E) group `sizes`."""
  n, rows = order.shape
  experts = sizes.shape[1]
  element = jnp.arange(n, dtype=jnp.int32)[:, None]
  # Each element's sorted position's expert: the groups that end at or before it (E: dropped).
  ends = jnp.cumsum(sizes, axis=1)
  marks = jnp.zeros((n, rows + 1), jnp.int32).at[element, ends].add(1)
  expert = jnp.cumsum(marks, axis=1)[:, :rows]
  if per_element_experts:
    key = jnp.where(expert < experts, element * experts + expert, n * experts)
  else:
    key = expert  # by expert, then element (stable): the dropped rows last
  layout = jnp.argsort(key.reshape(-1), stable=True).astype(jnp.int32)
  folded = (order + element * rows).reshape(-1)[layout]
  inverse = _inverse(folded)
  sizes = sizes.reshape(-1) if per_element_experts else jnp.sum(sizes, axis=0)
  return folded, inverse, sizes, layout


def _inverse(permutation: Array) -> Array:
  n = permutation.shape[0]
  return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(n, dtype=permutation.dtype))


def _fold(size: int, batched, args):
  """``(order, inverse, sizes, layout, sizes_b)`` of the one call, as :func:`_fold_routing`
  makes them from the call's routing (every element's group sizes, (B, E), last)."""
  order = _broadcast(args[5], batched[5], size)
  sizes_b = _broadcast(args[7], batched[7], size)
  return (*_fold_routing(order, sizes_b, any(batched[2:5])), sizes_b)


def _folded(plan: MoEPlan, impl, kind: str, size: int, batched, args):
  x, weights, w_gate, w_up, w_down = args[:5]
  bx, bweights, *bws = batched[:5]
  per_element = any(bws)
  t = x.shape[-2]
  folded, inverse, g_sizes, layout, sizes_b = _fold(size, batched, args)
  ws = [w_gate, w_up, w_down]
  if per_element:  # each element's experts: (B*E, in, out), groups (element, expert)
    ws = [_broadcast(w, b, size).reshape(-1, *w.shape[-2:]) for w, b in zip(ws, bws, strict=True)]
  x_g = _broadcast(x, bx, size).reshape(size * t, x.shape[-1])
  weights_g = _broadcast(weights, bweights, size).reshape(size * t, weights.shape[-1])
  plan_g = dataclasses.replace(plan, tokens=size * t, experts=g_sizes.shape[0])
  routed = (x_g, weights_g, *ws, folded, inverse, g_sizes)
  call = batchable(plan_g, impl, kind)
  if kind == "value":
    y = call(*routed)
    return y.reshape(size, t, -1), True
  if kind == "forward":
    y, a, b = call(*routed)
    # a and b as each element's (T*k, F) rows, kept in the fold's order (see _rows).
    a, b = (v.reshape(size, -1, v.shape[-1]) for v in (a, b))
    return (y.reshape(size, t, -1), a, b), (True, True, True)
  _, a, b, gy = args[ROUTED:]
  ba, bb, bgy = batched[ROUTED + 1 :]
  gy_g = _broadcast(gy, bgy, size).reshape(size * t, gy.shape[-1])
  kept = [_rows(v, is_batched, layout) for v, is_batched in ((a, ba), (b, bb))]
  # Each element's own gradient of the experts' weights: from its rows (where the fold put them,
  # in the element's own order) when the weights are shared; groups (element, expert) else.
  each = None if per_element else (_inverse(layout).reshape(size, -1), sizes_b)
  dx, d_weights, *dws = call(*routed, each, *kept, gy_g)
  if per_element:
    dws = [g.reshape(size, -1, *g.shape[1:]) for g in dws]
  grads = (dx.reshape(size, t, -1), d_weights.reshape(size, t, -1), *dws)
  return grads, (True,) * len(grads)
