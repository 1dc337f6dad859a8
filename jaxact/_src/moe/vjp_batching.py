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
gradient asks for; JAX sums them where the gradient is of the vmapped function): one weight block
a (expert, element) group. Calls with traced activation parameters run the elements one after
another (``lax.map``): their parameters' gradients are sums over each element's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.moe.plan import MoEPlan

# The leading arguments of the three functions: x, weights, w_gate, w_up, w_down, order, inverse,
# sizes. The backward's go on with weight_sizes, a, b, gy; every function ends with the dynamic
# (traced activation) parameters.
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
    one = [jax.ShapeDtypeStruct(a.shape[b:], a.dtype) for a, b in zip(args, batched, strict=True)]
    out = jax.eval_shape(lambda *a: impl(plan, *a), *one)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), out), jax.tree.map(
      lambda _: True, out
    )
  fixed = ROUTED + (_BACKWARD_EXTRA if kind == "backward" else 0)
  if len(args) > fixed:  # traced activation parameters: one element at a time
    return _sequential(plan, impl, kind, size, batched, args)
  return _folded(plan, impl, kind, size, batched, args)


def _sequential(plan: MoEPlan, impl, kind: str, size: int, batched, args):
  mapped = [a for a, b in zip(args, batched, strict=True) if b]

  def one(mapped_one):
    it = iter(mapped_one)
    full = [next(it) if b else a for a, b in zip(args, batched, strict=True)]
    return batchable(plan, impl, kind)(*full)

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
  inverse = jnp.zeros_like(folded).at[folded].set(jnp.arange(n * rows, dtype=jnp.int32))
  sizes = sizes.reshape(-1) if per_element_experts else jnp.sum(sizes, axis=0)
  return folded, inverse, sizes, layout


def _folded(plan: MoEPlan, impl, kind: str, size: int, batched, args):
  x, weights, w_gate, w_up, w_down, order, _, sizes = args[:ROUTED]
  bx, bweights, *bws = batched[:5]
  per_element = any(bws)
  order = _broadcast(order, batched[5], size)
  sizes_b = _broadcast(sizes, batched[7], size)
  t = x.shape[-2]
  folded, inverse, g_sizes, layout = _fold_routing(order, sizes_b, per_element)
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
  weight_sizes, a, b, gy = args[ROUTED:]
  ba, bb, bgy = batched[ROUTED + 1 :]
  w_sizes = _weight_groups(_broadcast(weight_sizes, batched[ROUTED], size), per_element, sizes_b)
  gy_g = _broadcast(gy, bgy, size).reshape(size * t, gy.shape[-1])
  kept = [_rows(v, is_batched, layout) for v, is_batched in ((a, ba), (b, bb))]
  dx, d_weights, *dws = call(*routed, w_sizes, *kept, gy_g)
  dws = [_unfold_weight_grad(g, size, sizes_b.shape[1], per_element) for g in dws]
  grads = (dx.reshape(size, t, -1), d_weights.reshape(size, t, -1), *dws)
  return grads, (True,) * len(grads)


def _weight_groups(weight_sizes: Array, per_element: bool, sizes: Array) -> Array:
  """The one call's weight-gradient groups from each element's (B, E*G) `weight_sizes` (G groups
  an expert, in the rows' order): (element, expert, g) where the experts are batched, (expert,
  element, g) where they are shared (the rows' order within an expert)."""
  n, experts = sizes.shape
  if per_element:
    return weight_sizes.reshape(-1)
  w = weight_sizes.reshape(n, experts, -1)
  return jnp.swapaxes(w, 0, 1).reshape(-1)


def _unfold_weight_grad(g: Array, size: int, experts: int, per_element: bool) -> Array:
  """Each element's (E*G, in, out) weight gradient from the one call's blocks, (element, expert,
  g) or (expert, element, g) as :func:`_weight_groups` orders them."""
  if per_element:
    return g.reshape(size, -1, *g.shape[1:])
  g = g.reshape(experts, size, -1, *g.shape[1:])
  return jnp.swapaxes(g, 0, 1).reshape(size, -1, *g.shape[3:])
