"""The plain formula of :func:`jaxact.moe_mlp` for the tests: every expert on every token, masked
by the routing, as JAX differentiates it. Independent of the op's sort, ragged_dot and combine:
the capacity drop is a running count over the tokens, not a position in a sorted order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.activations.reference import jax_nn as reference_activation

__all__ = ["moe_reference", "ragged_composition", "reference_activation"]


def moe_reference(
  x,
  router,
  w_gate,
  w_up,
  w_down,
  *,
  top_k,
  act=jax.nn.silu,
  score="softmax",
  normalize_top_k=True,
  capacity_factor=None,
  router_bias=None,
):
  """``(y, aux)`` as :func:`jaxact.moe_mlp` defines them, by a dense loop over the experts."""
  lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
  t, e = x.shape[0], router.shape[1]
  z = x @ router
  s = jax.nn.softmax(z, -1) if score == "softmax" else jax.nn.sigmoid(z)
  select = lax.stop_gradient(s) + (0 if router_bias is None else router_bias)
  _, idx = lax.top_k(select, top_k)
  w = jnp.take_along_axis(s, idx, -1)
  if normalize_top_k:
    w = w / jnp.sum(w, -1, keepdims=True)
  chosen = jax.nn.one_hot(idx, e, dtype=x.dtype)  # (T, k, E)
  gates = jnp.einsum("tk,tke->te", w, chosen)  # each token's weight for each expert, 0 if unrouted
  routed = jnp.sum(chosen, 1)  # (T, E): 1 where the token goes to the expert
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * t * top_k / e)
    arrived = jnp.cumsum(routed, 0)  # tokens the expert has been given so far, this one included
    gates = jnp.where(arrived <= capacity, gates, 0)
  y = 0
  for i in range(e):
    h = act(x @ w_gate[i]) * (x @ w_up[i])
    y = y + gates[:, i : i + 1] * (h @ w_down[i])
  p = s if score == "softmax" else s / jnp.sum(s, -1, keepdims=True)
  balance = e * jnp.sum(jnp.mean(routed, 0) * jnp.mean(p, 0))
  z_loss = jnp.mean(jax.nn.logsumexp(z, -1) ** 2)
  aux = {"load_balancing_loss": balance, "router_z_loss": z_loss}
  return y.reshape(*lead, -1), aux


def ragged_composition(
  x, router, w_gate, w_up, w_down, *, top_k, names=None, product=lax.ragged_dot
):
  """The same op as users write it with ``jax.lax.ragged_dot`` (softmax scores, normalized top-k
  weights, dropless, silu), for JAX's autodiff to differentiate: the peer whose memory the op is
  measured against. `names`: two ``checkpoint_name``s for the gate and up projections (MaxText's
  ``mlpwi_0`` / ``mlpwi_1``). `product`: the grouped products, ``ragged_dot``'s signature (a TPU
  user's megablox ``gmm`` in the benchmarks)."""
  lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
  p = jax.nn.softmax((x @ router).astype(jnp.float32), -1)
  _, idx = lax.top_k(lax.stop_gradient(p), top_k)
  w = jnp.take_along_axis(p, idx, -1)
  w = (w / jnp.sum(w, -1, keepdims=True)).astype(x.dtype)
  order = jnp.argsort(idx.reshape(-1), stable=True)
  sizes = jnp.bincount(idx.reshape(-1), length=router.shape[1]).astype(jnp.int32)
  xs = x[order // top_k]
  a, b = product(xs, w_gate, sizes), product(xs, w_up, sizes)
  if names is not None:
    a, b = checkpoint_name(a, names[0]), checkpoint_name(b, names[1])
  o = product(jax.nn.silu(a) * b, w_down, sizes)[jnp.argsort(order)]
  y = jnp.einsum("tk,tkd->td", w, o.reshape(*idx.shape, -1))
  return y.reshape(*lead, -1)
