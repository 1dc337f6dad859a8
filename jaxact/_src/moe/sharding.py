"""Expert parallelism for :func:`jaxact.moe_mlp`: experts sharded over mesh axes, each token's
assignments sent to the devices that hold its experts and the outputs sent back
(``jax.lax.all_to_all`` inside ``jax.shard_map``), data- and tensor-parallel axes beside.

The layout is read from the arrays' types under Explicit mesh axes, as the other families read it:

* the expert axes: those the experts' dimension (the first) of ``w_gate`` is split over
  (``w_up`` and ``w_down`` must split theirs alike); each device holds ``E / n`` whole experts;
* the tensor axes: those the hidden dimension of ``w_gate`` / ``w_up`` (their last) and
  ``w_down`` (its second) is split over; each device computes its columns of every routed token's
  ``a``, ``b``, ``h`` and a partial ``o``, summed over them (Megatron's MLP, expert by expert);
* the token axes: those the tokens (``x``'s first dimension) are split over, with the expert axes
  added where they are missing (each device of an expert group routes its own tokens) and the
  tensor axes taken out (every device of a tensor group computes the same tokens); the experts'
  gradients are summed over the token axes that are not expert axes (data parallelism).

A features dimension split over devices (an FSDP weight, feature-sharded ``x``) is gathered first,
as XLA gathers it for ``jnp.dot``; the gradients come back in the primals' shardings.

The routing (router logits, top-k, weights, auxiliary losses) is plain JAX on the sharded tokens;
the experts' ``custom_vjp`` runs its forward and its backward each inside one ``jax.shard_map``
(:mod:`jaxact._src.moe.sharding_local`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax import Array

from jaxact._src.core import shardings
from jaxact._src.core.shardings import Axes, pspec
from jaxact._src.moe import api_routing
from jaxact._src.moe import sharding_local as local
from jaxact._src.moe.plan import MoEPlan


@dataclasses.dataclass(frozen=True)
class Pattern:
  """How one sharded call splits its work; derived once from the operands' types.

  Attributes:
    mesh: the mesh of the operands' types.
    expert, tokens, data, model: the expert, token, data (token minus expert) and tensor axes.
    n: the devices of an expert group (the product of the expert axes' sizes).
    local_experts: the experts a device holds, ``E / n``.
    local_tokens: the tokens a device routes, ``T / (devices of the token axes)``.
    chunk: the rows a device sends each device of its group: the most it can have for it,
      ``local_tokens * min(top_k, local_experts)`` (a token's k experts are distinct), or
      ``local_experts * capacity`` where that is less.
    rows: the rows a device computes: every row it can receive, ``n * chunk``, or
      ``local_experts * capacity`` where that is less.
  """

  mesh: Any
  expert: Axes
  tokens: Axes
  data: Axes
  model: Axes
  n: int
  local_experts: int
  local_tokens: int
  chunk: int
  rows: int


def _axes_size(mesh, axes: Axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def pattern(fn_name: str, plan: MoEPlan, x, router, w_gate, w_up, w_down, router_bias):
  """The :class:`Pattern` of a call whose operands' types name a mesh with Explicit axes, else
  None (one device, or Auto axes: XLA partitions the op as any jnp code)."""
  mesh = shardings.explicit_mesh(x, router, w_gate, w_up, w_down, router_bias)
  if mesh is None:
    return None
  if isinstance(mesh, str):
    raise ValueError(f"jaxact.{fn_name}: {mesh}")
  gs, us, ds = (shardings.spec_of(w) for w in (w_gate, w_up, w_down))
  expert, model = gs[0], gs[2]

  def fail(message):
    specs = ", ".join(f"{n}: {pspec(s)}" for n, s in (("w_gate", gs), ("w_up", us), ("w_down", ds)))
    raise ValueError(f"jaxact.{fn_name}: {message} ({specs})")

  if us[0] != expert or ds[0] != expert:
    fail("`w_up` and `w_down` must split the experts (their first dimension) as `w_gate` does")
  if us[2] != model or ds[1] != model:
    fail("`w_up`'s last dimension and `w_down`'s second (hidden) must be split as `w_gate`'s last")
  if set(expert) & set(model):
    fail("the experts and the hidden features are split over the same mesh axes")
  rows_axes = shardings.spec_of(x)[0]
  tokens = tuple(a for a in rows_axes if a not in model)
  tokens += tuple(a for a in expert if a not in tokens)
  n, devices = _axes_size(mesh, expert), _axes_size(mesh, tokens)
  t = plan.tokens
  if t % devices:
    raise ValueError(
      f"jaxact.{fn_name}: `x` has {t} tokens, which do not split over the {devices} devices of "
      f"the token axes {tokens} (x's first dimension's axes and the expert axes {expert}); "
      "expert parallelism needs an even split"
    )
  local_experts, local_tokens = plan.experts // n, t // devices
  chunk = local_tokens * min(plan.top_k, local_experts)
  rows = n * chunk
  if plan.capacity is not None:
    chunk = min(chunk, local_experts * plan.capacity)
    rows = min(n * chunk, local_experts * plan.capacity)
  return Pattern(
    mesh=mesh,
    expert=expert,
    tokens=tokens,
    data=tuple(a for a in tokens if a not in expert),
    model=model,
    n=n,
    local_experts=local_experts,
    local_tokens=local_tokens,
    chunk=chunk,
    rows=rows,
  )


def _specs(pat: Pattern):
  """The specs inside the shard_map: (tokens rows), (w_gate / w_up), (w_down), (a / b)."""
  rows = (pat.tokens, ())
  return rows, (pat.expert, (), pat.model), (pat.expert, pat.model, ()), (pat.tokens, pat.model)


def place(pat: Pattern, x, weights, experts, w_gate, w_up, w_down):
  """The operands resharded to the pattern's layout (themselves where they already are): what
  gathers an FSDP weight or feature-sharded tokens, as XLA would for ``jnp.dot``."""
  rows, wg, wd, _ = _specs(pat)
  want = (rows, rows, rows, wg, wg, wd)
  return tuple(
    shardings.to_spec(a, s)
    for a, s in zip((x, weights, experts, w_gate, w_up, w_down), want, strict=True)
  )


def _shard_map(pat: Pattern, body, in_specs, out_specs):
  explicit = {
    n
    for n, t in zip(pat.mesh.axis_names, pat.mesh.axis_types, strict=True)
    if t == jax.sharding.AxisType.Explicit
  }
  kw = {} if explicit == set(pat.mesh.axis_names) else {"axis_names": explicit}
  return jax.shard_map(
    body,
    mesh=pat.mesh,
    in_specs=tuple(pspec(s) for s in in_specs),
    out_specs=tuple(pspec(s) for s in out_specs),
    # The collectives (psum over the data and tensor axes) make the replicated outputs so; the
    # body is written for one device and states it through out_specs.
    check_vma=False,
    **kw,
  )


def top_k(pat: Pattern, plan: MoEPlan, select: Array) -> Array:
  """:func:`api_routing.top_k` of each device's rows: XLA gathers the rows of a sharded
  ``lax.top_k`` (the whole (T, E) scores on every device) where each device needs only its own."""
  rows = (pat.tokens, ())
  run = _shard_map(pat, lambda s: (api_routing.top_k(plan, s),), (rows,), (rows,))
  return run(shardings.to_spec(select, rows))[0]


def _refusing_vmap(fn):
  """`fn`, raising under ``jax.vmap``: the exchange between devices has no batching rule, and its
  ragged products none for a batched operand (the one-device path folds the batch instead)."""
  f = jax.custom_batching.custom_vmap(fn)

  @f.def_vmap
  def _(size, batched, *args):
    raise NotImplementedError(
      "jaxact.moe_mlp: jax.vmap of an expert-parallel call (the experts split over mesh axes) is "
      "not supported; give the mapped axis to one call as a leading dimension of `x` (one routing "
      "and one pair of auxiliary losses over all its tokens), or map over experts that are not "
      "split"
    )

  return f


def _forward(plan: MoEPlan, pat: Pattern, x, weights, w_gate, w_up, w_down, experts, *dynamic):
  rows, wg, wd, ab = _specs(pat)
  body = functools.partial(local.forward, plan, pat)
  in_specs = (rows, rows, wg, wg, wd, rows, *[()] * len(dynamic))
  y, a, b = _refusing_vmap(_shard_map(pat, body, in_specs, (rows, ab, ab)))(
    x, weights, w_gate, w_up, w_down, experts, *dynamic
  )
  return y, (x, weights, w_gate, w_up, w_down, experts, a, b, dynamic)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _experts(plan: MoEPlan, pat: Pattern, x, weights, w_gate, w_up, w_down, experts, *dynamic):
  return _forward(plan, pat, x, weights, w_gate, w_up, w_down, experts, *dynamic)[0]


def _backward(plan: MoEPlan, pat: Pattern, res, gy: Array):
  x, weights, w_gate, w_up, w_down, experts, a, b, dynamic = res
  rows, wg, wd, ab = _specs(pat)
  body = functools.partial(local.backward, plan, pat)
  in_specs = (rows, rows, wg, wg, wd, rows, ab, ab, rows, *[()] * len(dynamic))
  out_specs = (rows, rows, wg, wg, wd, *[()] * len(dynamic))
  dx, d_weights, *grads = _shard_map(pat, body, in_specs, out_specs)(
    x, weights, w_gate, w_up, w_down, experts, a, b, gy, *dynamic
  )
  dw_gate, dw_up, dw_down, *d_dynamic = grads
  return (dx, d_weights, dw_gate, dw_up, dw_down, None, *d_dynamic)


_experts.defvjp(_forward, _backward)


def experts(plan: MoEPlan, pat: Pattern, x, weights, w_gate, w_up, w_down, experts_, *dynamic):
  """``y`` (T, out) of the routed (T, D) `x` on each device's shards, sharded as the tokens."""
  return _experts(plan, pat, x, weights, w_gate, w_up, w_down, experts_, *dynamic)
