"""A gated unit's activation arithmetic, shared by the op families that gate (the gated MLP and
the mixture-of-experts experts): ``h = act(a) * b`` and its cotangents in ``a`` and ``b``, from
the kept (rounded) projections, in the accumulation dtype. `act` is a resolved activation
(:class:`jaxact._src.activations.resolve.Act`): a spec table rule, or a plain callable that JAX
differentiates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jaxact._src.activations.resolve import Act
from jaxact._src.core.numerics import mul3, safe_mul


def activate(act: Act, a: Array, dynamic, acc) -> Array:
  """``act(a)`` in the accumulation dtype `acc`."""
  if act.fn is not None:  # a plain callable sees what `act(x @ w + b)` would give it
    return act.fn(a, *dynamic).astype(acc)
  return act.rule.spec.fn(a.astype(acc), **act.rule.params(dynamic))


def _may_overflow(act: Act, dynamic) -> bool:
  """Whether the rule's ``act(a)`` overflows for some finite ``a`` (the spec table's `unbounded`;
  traced parameters: assumed). Static: the others' products take no derivative (XLA would keep a
  buffer for it)."""
  if dynamic:
    return True
  spec = act.rule.spec
  return spec.unbounded is not None and spec.unbounded(**act.rule.params(()))


def _times_act(act_a: Array, a: Array, slope: Array, q: Array) -> Array:
  """``act(a) * q`` from ``act(a)`` and ``act'(a)`` (the `slope`), as :func:`safe_mul`; where
  ``act(a)`` overflowed for a finite ``a`` and ``q != 0``, ``(q a) act'(a)``, finite where the
  product is. The spec table's activations overflow only on a piece linear through 0 (selu,
  leaky_relu with a slope beyond 1), where ``act(a) = act'(a) a`` and ``|act'(a)| > 1`` (so ``q a``
  overflows only where the product does), or grow as fast as their derivative (celu with a
  negative alpha: inf either way). The gated Triton kernels form the same
  (:func:`pallas_kernels.epilogue.times_act`)."""
  over = jnp.isinf(act_a) & jnp.isfinite(a) & (q != 0)
  return jnp.where(over, (q * a) * slope, safe_mul(act_a, q))


def hidden(act: Act, a: Array, b: Array, dynamic, acc, out) -> Array:
  """``h = act(a) * b`` in the dtype `out`, computed in `acc`."""
  b32 = b.astype(acc)
  if act.fn is not None:
    return safe_mul(activate(act, a, dynamic, acc), b32).astype(out)
  spec, params = act.rule.spec, act.rule.params(dynamic)
  a32 = a.astype(acc)
  act_a = spec.fn(a32, **params)
  if not _may_overflow(act, dynamic):
    return safe_mul(act_a, b32).astype(out)
  slope = spec.derivative_from_input(a32, **params)
  return _times_act(act_a, a32, slope, b32).astype(out)


def gate_cotangents(act: Act, a: Array, b: Array, gh: Array, dynamic, acc):
  """``(da, db, d_dynamic)`` in the accumulation dtype `acc` from `gh`, the cotangent of h (and
  the cotangents of the activation's traced parameters)."""
  gh32, b32 = gh.astype(acc), b.astype(acc)
  if act.fn is not None:
    act_a, pull = jax.vjp(act.fn, a, *dynamic)
    da, *d_dynamic = pull((gh32 * b32).astype(act_a.dtype))
    return da.astype(acc), gh32 * act_a.astype(acc), d_dynamic
  spec, params = act.rule.spec, act.rule.params(dynamic)
  a32 = a.astype(acc)
  act_a = spec.fn(a32, **params)
  slope = spec.derivative_from_input(a32, **params)
  da = mul3(gh32, slope, b32)
  d_dynamic: list = []
  if dynamic:  # traced parameters (alpha, slope, ...): autodiff of the forward formula

    def fn_of_params(*p):
      return spec.fn(a32, **act.rule.params(p))

    d_dynamic = list(jax.vjp(fn_of_params, *dynamic)[1](gh32 * b32))
  db = _times_act(act_a, a32, slope, gh32) if _may_overflow(act, dynamic) else gh32 * act_a
  return da, db, d_dynamic
