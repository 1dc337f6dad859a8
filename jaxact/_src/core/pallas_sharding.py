"""Per-shard Pallas kernels: ``jax.shard_map`` around a kernel, planned from the arrays' types.

A ``pallas_call`` cannot be partitioned by XLA: given sharded operands, XLA would gather them and
run the whole kernel on every device. Under Explicit mesh axes the sharding is part of each array's
type (``jax.typeof(a).sharding``), so at trace time this module decides which layer-parallel
pattern a call is, runs the kernel on each device's shard inside ``jax.shard_map``, and adds the
reductions the pattern needs (``psum``; never an all-gather). The ``custom_vjp`` stays outside: a
forward and a backward kernel are wrapped separately.

Interface. Every ``*_forward`` / ``*_backward`` function takes a per-shard kernel and returns a
function with the kernel's own signature (arrays positionally, static options such as
``interpret=`` by keyword) that runs it per shard. Calls on arrays whose types name no mesh with
Explicit axes run the kernel as it is. For a sharded call that the pattern does not cover,
the matching ``*_reason`` gives a string (the wrapped function raises ``NotImplementedError``):
callers check it first and use another implementation.

Dense, ``y = act(x @ w + b)`` with ``x`` ``(..., K)``, ``w`` ``(K, N)``, ``b`` ``(N,)`` or None:

* ``dense_reason(x, w) -> str | None``;
* ``dense_forward(kernel)``: ``kernel(x, w, b, **static) -> (y, z)``, ``y`` and ``z`` (None or an
  array) shaped ``(..., N)``;
* ``dense_backward(kernel)``: ``kernel(x, w, kept, g, **static) -> (dx, dw, db)``, ``kept`` None or
  shaped like ``g``, ``db`` None or ``(N,)``.

Two patterns, alone or together (a 2-D ``("data", "model")`` mesh): *data-parallel*, ``x`` sharded
over its leading (row) dimensions: each device multiplies its rows, and ``dw``, ``db`` are the
per-shard partial sums ``psum``-ed over those axes; *column-parallel*, ``w`` sharded over ``N``:
each device computes its columns of ``y``, and ``dx`` is ``psum``-ed over those axes. ``b`` is
resharded like ``w``'s columns (a local slice of a replicated ``b``). A sharded contraction
dimension ``K`` is not covered.

Elementwise over a feature axis, e.g. a convolution's epilogue ``y = act(z + b)`` on NHWC ``z``:

* ``elementwise_reason(z, feature_axis=-1) -> str | None``;
* ``elementwise_forward(kernel, feature_axis=-1)``: ``kernel(z, b, **static) -> y`` shaped like
  ``z``, or a tuple of such arrays (or None), ``b`` ``(C,)`` or None;
* ``elementwise_backward(kernel, feature_axis=-1)``: ``kernel(g, kept, **static) -> (dz, db)``,
  ``kept`` None or shaped like ``g``, ``dz`` shaped like ``g``, ``db`` ``(C,)`` or None.

Data-parallel only: ``z`` may be sharded over any axis but the feature axis; ``b`` is replicated and
``db`` is ``psum``-ed over the axes ``g`` is sharded over.

Both are built on ``per_shard(kernel, args, in_specs, out_specs, *, mesh, sum_over=None,
**static)``, which runs any kernel per shard given the specs of its inputs and outputs (as
:func:`spec_of` gives them: a tuple of mesh axes per dimension) and the mesh axes to sum each output
over.

The mesh is the one in the arrays' types (an ``AbstractMesh`` under ``jit``). On it, replicated
operands go under ``shard_map`` too (each device runs the whole kernel). The kernel is manual over
the Explicit axes only: Auto axes stay XLA's, and inside a caller's ``shard_map`` (Manual axes; it
must have ``check_vma=False``, as kernels written for one device need) the wrapper nests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import Array
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]


# ------------------------------------------------------------------------------------- types


def _axes(entry: Any) -> Axes:
  """The mesh axes of one partition-spec entry (None, a name, or a tuple of names)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _sharding(a: Array | None) -> NamedSharding | None:
  """`a`'s sharding, when its type has one over a mesh with at least one Explicit axis."""
  if a is None:
    return None
  typed = a if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a)
  sharding = getattr(typed, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
    return None
  return sharding


def typed_sharding(a: Array | None) -> NamedSharding | None:
  """`a`'s sharding when its type holds one over a mesh with Explicit axes, else None."""
  return _sharding(a)


def spec_of(a: Array) -> tuple[Axes, ...]:
  """`a`'s partition spec from its type, one tuple of mesh axes per dimension (empty: unsharded)."""
  sharding = _sharding(a)
  spec = () if sharding is None else tuple(sharding.spec)
  return tuple(_axes(e) for e in spec) + ((),) * (a.ndim - len(spec))


def _mesh(*arrays: Array | None):
  """The one mesh with Explicit axes in the arrays' types, None if there is none, or a reason.

  Replicated arrays count: in interpret mode a pallas_call fails on operands typed over Explicit
  axes (its buffers are not), so on such a mesh the kernels go under shard_map all the same.
  """
  meshes = []
  for a in arrays:
    sharding = _sharding(a)
    if sharding is not None:
      meshes.append(sharding.mesh)
  if not meshes:
    return None
  if any(m != meshes[0] for m in meshes[1:]):
    return "inputs sharded over different meshes"
  return meshes[0]


def _pspec(spec: Sequence[Axes]) -> P:
  return P(*(None if not a else a[0] if len(a) == 1 else a for a in spec))


def sharding_spec(sharding: NamedSharding | P, ndim: int) -> tuple[Axes, ...]:
  """A ``NamedSharding``'s or ``PartitionSpec``'s spec as :func:`spec_of` writes one, padded to
  `ndim` dimensions."""
  spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  return tuple(_axes(e) for e in spec) + ((),) * (ndim - len(spec))


# ---------------------------------------------------------------------------------- per_shard


def per_shard(
  kernel: Callable[..., Any],
  args: Sequence[Array | None],
  in_specs: Sequence[Sequence[Axes] | None],
  out_specs: Sequence[Sequence[Axes]],
  *,
  mesh: Any,
  sum_over: Sequence[Axes] | None = None,
  local_specs: Sequence[Sequence[Axes]] | None = None,
  **static: Any,
) -> tuple[Any, ...]:
  """``kernel(*args, **static)`` run on each device's shards, inside ``jax.shard_map``.

  Args:
    kernel: the per-shard function; returns a tuple with one entry per entry of `out_specs`: an
      array, None, or a pytree of arrays that the one spec covers.
    args: its array arguments (None passes through as None).
    in_specs, out_specs: one spec per argument and per output: a tuple of mesh axes per dimension
      (``()`` for an unsharded one). An argument whose type has another sharding is resharded
      first (``jax.sharding.reshard``).
    mesh: the mesh of the arguments' types.
    sum_over: per output, the mesh axes to sum its per-shard value over (default none).
    local_specs: per output, the spec of the block the kernel returns (default: `out_specs`);
      where an output's spec splits a dimension further, the block is cut to it after the sum:
      a reduce-scatter (``psum_scatter``) over the summed axes that split it, a local slice over
      the others (a gradient summed over the data axes and split as its FSDP weight is).
    **static: passed to `kernel` as they are.

  Returns:
    The outputs, as global arrays sharded by `out_specs`.
  """
  sum_over = tuple(sum_over) if sum_over is not None else ((),) * len(out_specs)
  # A sum over an axis of one device is the identity, which XLA would still run as a collective.
  sum_over = tuple(tuple(a for a in axes if mesh.shape[a] > 1) for axes in sum_over)
  local_specs = tuple(local_specs) if local_specs is not None else tuple(out_specs)
  present = [i for i, a in enumerate(args) if a is not None]
  operands = []
  for i in present:
    a, want = args[i], tuple(in_specs[i])
    if spec_of(a) != want:
      a = jax.sharding.reshard(a, NamedSharding(mesh, _pspec(want)))
    operands.append(a)

  def body(*operands):
    full: list[Array | None] = [None] * len(args)
    for i, a in zip(present, operands, strict=True):
      full[i] = a
    outs = tuple(kernel(*full, **static))
    return tuple(
      o if o is None else _reduce(o, axes, tuple(local), tuple(final), mesh)
      for o, axes, local, final in zip(outs, sum_over, local_specs, out_specs, strict=True)
    )

  # Manual over the Explicit axes only: Auto axes stay XLA's, Manual ones are a caller's shard_map.
  explicit = {
    n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
  }
  kw = {} if explicit == set(mesh.axis_names) else {"axis_names": explicit}
  # check_vma=False: with it, pallas_call needs every out_shape to say how it varies over the mesh
  # (ShapeDtypeStruct's manual_axis_type), which kernels written for one device do not. Outputs
  # vary over every axis their inputs are split over; `sum_over` makes the summed ones invariant,
  # as `out_specs` state.
  kw["check_vma"] = False
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=tuple(_pspec(in_specs[i]) for i in present),
    out_specs=tuple(_pspec(s) for s in out_specs),
    **kw,
  )(*operands)


def _reduce(o, sum_axes: Axes, local, final, mesh):
  """A pytree of per-shard blocks `o` (spec `local`) summed over `sum_axes` and cut to `final`,
  whose entry for each dimension starts with `local`'s."""
  remaining = list(sum_axes)

  def cut(a):
    nonlocal_sum = list(remaining)
    for d, (have, want) in enumerate(zip(local, final, strict=True)):
      if tuple(want[: len(have)]) != tuple(have):
        raise ValueError(f"per_shard: output spec {final} does not refine {local} at dim {d}")
      extra = tuple(a for a in want[len(have) :] if mesh.shape[a] > 1)
      if not extra:
        continue
      if all(ax in nonlocal_sum for ax in extra):  # summed and split: one reduce-scatter
        a = jax.lax.psum_scatter(a, extra, scatter_dimension=d, tiled=True)
        nonlocal_sum = [ax for ax in nonlocal_sum if ax not in extra]
        continue
      summed = tuple(ax for ax in extra if ax in nonlocal_sum)
      if summed:
        a = jax.lax.psum(a, summed)
        nonlocal_sum = [ax for ax in nonlocal_sum if ax not in summed]
      size = a.shape[d] // math.prod(mesh.shape[ax] for ax in extra)
      a = jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(extra) * size, size, d)
    return jax.lax.psum(a, tuple(nonlocal_sum)) if nonlocal_sum else a

  if all(tuple(w) == tuple(h) for w, h in zip(final, local, strict=True)):
    return o if not remaining else jax.tree.map(lambda a: jax.lax.psum(a, tuple(remaining)), o)
  return jax.tree.map(cut, o)


# -------------------------------------------------------------------------------------- dense


@dataclasses.dataclass(frozen=True)
class _DensePlan:
  mesh: Any
  x: tuple[Axes, ...]  # x's spec: rows sharded, K not
  w: tuple[Axes, ...]  # ((), columns)
  y: tuple[Axes, ...]  # (*x's rows, columns)
  data: Axes  # the axes x's rows are split over: dw, db are summed over them
  model: Axes  # the axes w's columns are split over: dx is summed over them


def _dense_plan(
  x: Array, w: Array, w_transposed: bool = False, gather: bool = False
) -> _DensePlan | str | None:
  mesh = _mesh(x, w)
  if mesh is None or isinstance(mesh, str):
    return mesh
  xs, ws = spec_of(x), spec_of(w)
  if w_transposed:
    ws = ws[::-1]
  if gather:  # each device holds the whole contraction dimension: gathered where it is split
    xs, ws = (*xs[:-1], ()), ((), ws[1])
  if xs[-1] or ws[0]:
    return (
      f"the contraction dimension is sharded (x over {_pspec(xs)}, w over {_pspec(ws)}; "
      "per-shard kernels split x's rows and w's columns only)"
    )
  data = tuple(a for axes in xs[:-1] for a in axes)
  model = ws[1]
  if set(data) & set(model):
    return (
      f"x's rows and w's columns are sharded over the same mesh axes ({_pspec(xs)}, {_pspec(ws)})"
    )
  return _DensePlan(mesh, xs, ws, (*xs[:-1], model), data, model)


def dense_pattern(
  x: Array, w: Array, w_transposed: bool = False, gather: bool = False
) -> _DensePlan | str | None:
  """The dense pattern of ``x @ w`` (``x @ w.T`` when `w_transposed`; the pattern's ``w`` spec is
  then the transpose's) on sharded operands (mesh, specs, ``data`` and ``model`` axes), None when
  their types name no Explicit mesh, or why no per-shard pattern covers them. With `gather`, a
  sharded contraction dimension is taken whole on each device (the pattern's specs leave it
  unsplit: ``x`` and ``w`` are gathered along it, as XLA does for FSDP weights)."""
  return _dense_plan(x, w, w_transposed, gather)


def dense_reason(x: Array, w: Array, out: Sequence[Axes] | None = None) -> str | None:
  """Why the per-shard dense kernels cannot run on these sharded operands, or None; `out`, the
  spec the caller asked for the output (``out_sharding``), must be the one they give."""
  plan = _dense_plan(x, w)
  if isinstance(plan, str):
    return plan
  return _out_reason(out, ((),) * x.ndim if plan is None else plan.y)


def _out_reason(out: Sequence[Axes] | None, given: Sequence[Axes]) -> str | None:
  if out is None or tuple(out) == tuple(given):
    return None
  return (
    f"out_sharding={_pspec(out)} differs from the per-shard kernels' output sharding "
    f"{_pspec(given)} (x's rows by w's columns)"
  )


def dense_shard_shape(x: Array, w: Array) -> tuple[int, int, int]:
  """``(M, K, N)`` of the matmul each device runs (the whole layer's when unsharded); `x` and `w`
  must be a pattern :func:`dense_reason` accepts."""
  m, (k, n) = math.prod(x.shape[:-1]), w.shape
  plan = _dense_plan(x, w)
  if isinstance(plan, _DensePlan):
    m //= math.prod(plan.mesh.shape[a] for a in plan.data)
    n //= math.prod(plan.mesh.shape[a] for a in plan.model)
  return m, k, n


def _require(plan):
  if isinstance(plan, str):
    raise NotImplementedError(f"per-shard kernels: {plan}")
  return plan


def dense_forward(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel(x, w, b, **static) -> (y, z)`` per shard; see the module docstring."""

  def run(x, w, b, **static):
    plan = _require(_dense_plan(x, w))
    if plan is None:
      return kernel(x, w, b, **static)
    return per_shard(
      kernel,
      (x, w, b),
      (plan.x, plan.w, (plan.model,)),
      (plan.y, plan.y),
      mesh=plan.mesh,
      **static,
    )

  return run


def dense_backward(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel(x, w, kept, g, **static) -> (dx, dw, db)`` per shard; see the module docstring."""

  def run(x, w, kept, g, **static):
    plan = _require(_dense_plan(x, w))
    if plan is None:
      return kernel(x, w, kept, g, **static)
    return per_shard(
      kernel,
      (x, w, kept, g),
      (plan.x, plan.w, plan.y, plan.y),
      (plan.x, plan.w, (plan.model,)),
      mesh=plan.mesh,
      sum_over=(plan.model, plan.data, plan.data),
      **static,
    )

  return run


# -------------------------------------------------------------------------------- elementwise


def _elementwise_plan(z: Array, feature_axis: int) -> tuple[Any, tuple[Axes, ...]] | str | None:
  mesh = _mesh(z)
  if mesh is None or isinstance(mesh, str):
    return mesh
  spec = spec_of(z)
  if spec[feature_axis]:
    return f"the feature axis is sharded ({_pspec(spec)}; per-shard kernels split the batch only)"
  return mesh, spec


def elementwise_reason(z: Array, feature_axis: int = -1) -> str | None:
  """Why the per-shard elementwise kernels cannot run on this sharded operand, or None."""
  plan = _elementwise_plan(z, feature_axis)
  return plan if isinstance(plan, str) else None


def elementwise_forward(kernel: Callable[..., Any], feature_axis: int = -1) -> Callable[..., Any]:
  """``kernel(z, b, **static) -> y`` or a tuple of outputs (each like `z` or None) per shard."""

  def run(z, b, **static):
    plan = _require(_elementwise_plan(z, feature_axis))
    if plan is None:
      return kernel(z, b, **static)
    mesh, spec = plan
    # One output, the kernel's whole result (an array or a tuple), so that one spec covers it all:
    # its structure is not known before the kernel runs (a pallas_call on sharded global arrays,
    # even under eval_shape, is an error).
    whole = lambda z, b: (kernel(z, b, **static),)
    return per_shard(whole, (z, b), (spec, ((),)), (spec,), mesh=mesh)[0]

  return run


def elementwise_backward(kernel: Callable[..., Any], feature_axis: int = -1) -> Callable[..., Any]:
  """``kernel(g, kept, **static) -> (dz, db)`` per shard; see the module docstring."""

  def run(g, kept, **static):
    plan = _require(_elementwise_plan(g, feature_axis))
    if plan is None:
      return kernel(g, kept, **static)
    mesh, spec = plan
    data = tuple(a for axes in spec for a in axes)
    return per_shard(
      kernel,
      (g, kept),
      (spec, spec),
      (spec, ((),)),
      mesh=mesh,
      sum_over=((), data),
      **static,
    )

  return run


# -------------------------------------------------------------------------------------- gated


def gated_reason(
  x: Array, w_gate: Array, w_up: Array, hidden: Sequence[Axes] | None = None
) -> str | None:
  """Why the per-shard gated forward kernel cannot run on these sharded operands (`hidden`: the
  hidden's spec the call asks for), or None."""
  mesh = _mesh(x, w_gate, w_up)
  if isinstance(mesh, str):
    return mesh
  return dense_reason(x, w_gate, hidden)


def gated_forward(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel(x, w_gate, w_up, b_gate, b_up, **static) -> (h, a, b)`` per shard, in the dense
  patterns (x's rows and the weights' columns split; `w_up` split as `w_gate`, the biases as
  their columns). No sum: each device's h, a and b are its block of the whole."""

  def run(x, w_gate, w_up, b_gate, b_up, **static):
    plan = _require(_dense_plan(x, w_gate))
    if plan is None:
      return kernel(x, w_gate, w_up, b_gate, b_up, **static)
    bias = (plan.model,)
    return per_shard(
      kernel,
      (x, w_gate, w_up, b_gate, b_up),
      (plan.x, plan.w, plan.w, bias, bias),
      (plan.y, plan.y, plan.y),
      mesh=plan.mesh,
      **static,
    )

  return run


def pointwise(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel(*arrays, **static)`` per shard, for a kernel that maps arrays of one shape to a tuple
  of arrays (or None) of that shape, elementwise: any sharding, the first array's for every input
  and output, and no collective."""

  def run(*arrays, **static):
    mesh = _mesh(*arrays)
    if isinstance(mesh, str):
      raise NotImplementedError(f"per-shard kernels: {mesh}")
    if mesh is None:
      return kernel(*arrays, **static)
    spec = spec_of(arrays[0])
    # One output, the kernel's whole result, as in elementwise_forward.
    whole = lambda *a: (kernel(*a, **static),)
    return per_shard(whole, arrays, (spec,) * len(arrays), (spec,), mesh=mesh)[0]

  return run
