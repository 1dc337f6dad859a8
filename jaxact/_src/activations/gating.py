"""A gated unit's activation arithmetic, shared by the op families that gate (the gated MLP and
the mixture-of-experts experts): ``h = act(a) * b`` and its cotangents in ``a`` and ``b``, from
the kept (rounded) projections, in the accumulation dtype. `act` is a resolved activation
(:class:`jaxact._src.activations.resolve.Act`): a spec table rule, or a plain callable that JAX
differentiates."""

from __future__ import annotations

import jax
from jax import Array

from jaxact._src.activations.resolve import Act
from jaxact._src.core.numerics import safe_mul


def activate(act: Act, a: Array, dynamic, acc) -> Array:
  """``act(a)`` in the accumulation dtype `acc`."""
  if act.fn is not None:  # a plain callable sees what `act(x @ w + b)` would give it
    return act.fn(a, *dynamic).astype(acc)
  return act.rule.spec.fn(a.astype(acc), **act.rule.params(dynamic))


def hidden(act: Act, a: Array, b: Array, dynamic, acc, out) -> Array:
  """``h = act(a) * b`` in the dtype `out`, computed in `acc`."""
  return safe_mul(activate(act, a, dynamic, acc), b.astype(acc)).astype(out)


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
  da = safe_mul(gh32 * spec.derivative_from_input(a32, **params), b32)
  d_dynamic: list = []
  if dynamic:  # traced parameters (alpha, slope, ...): autodiff of the forward formula

    def fn_of_params(*p):
      return spec.fn(a32, **act.rule.params(p))

    d_dynamic = list(jax.vjp(fn_of_params, *dynamic)[1](gh32 * b32))
  return da, gh32 * act_a, d_dynamic
