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

Dense, ``y = act(x @ w + b)`` with ``x`` ``(..., K)``, ``w`` ``(K, N)``, ``b`` ``(N,)`` or None.
The pattern is derived once, where a call's backend is decided, and handed down with the decision
(``Decision.sharding``) to the wrappers:

* ``dense_pattern(x, w) -> DensePattern | str | None``, ``pattern_reason(pattern, x.ndim, out)``
  and ``dense_reason(x, w) -> str | None``;
* ``dense_forward(kernel, pattern)``: ``kernel(x, w, b, **static) -> (y, z)``, ``y`` and ``z``
  (None or an array) shaped ``(..., N)``;
* ``dense_backward(kernel, pattern)``: ``kernel(x, w, kept, g, **static) -> (dx, dw, db)``,
  ``kept`` None or shaped like ``g``, ``db`` None or ``(N,)``.

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
:func:`jaxact._src.core.shardings.spec_of` gives them: a tuple of mesh axes per dimension) and the
mesh axes to sum each output over.

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

from jaxact._src.core.shardings import Axes, explicit_mesh, pspec, spec_of, splits

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
      a = jax.sharding.reshard(a, NamedSharding(mesh, pspec(want)))
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
    in_specs=tuple(pspec(in_specs[i]) for i in present),
    out_specs=tuple(pspec(s) for s in out_specs),
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
class DensePattern:
  """The per-shard pattern of ``x @ w`` on sharded operands: derived once from their types (where a
  call's backend is decided) and handed down to what runs per shard.

  Attributes:
    mesh: the mesh of the operands' types.
    x, w, y: the specs the product runs in: x's rows split, its contraction dimension whole; w
      ``((), columns)``; y ``(*x's rows, columns)``.
    data: the axes x's rows are split over: dw, db are summed over them.
    model: the axes w's columns are split over: dx is summed over them.
    gathers: why per-shard kernels could not run on the operands as they are typed (their
      contraction dimension split) where the pattern gathers it (:func:`dense_pattern`'s
      `gather`), else None.
  """

  mesh: Any
  x: tuple[Axes, ...]
  w: tuple[Axes, ...]
  y: tuple[Axes, ...]
  data: Axes
  model: Axes
  gathers: str | None = None


def dense_pattern(
  x: Array, w: Array, w_transposed: bool = False, gather: bool = False
) -> DensePattern | str | None:
  """The dense pattern of ``x @ w`` (``x @ w.T`` when `w_transposed`; the pattern's ``w`` spec is
  then the transpose's) on sharded operands, None when their types name no Explicit mesh, or why no
  per-shard pattern covers them. With `gather`, a sharded contraction dimension is taken whole on
  each device (the pattern's specs leave it unsplit: ``x`` and ``w`` are gathered along it, as XLA
  does for FSDP weights)."""
  mesh = explicit_mesh(x, w)
  if mesh is None or isinstance(mesh, str):
    return mesh
  xs, ws = spec_of(x), spec_of(w)
  if w_transposed:
    ws = ws[::-1]
  split = None
  if splits(mesh, xs[-1]) or splits(mesh, ws[0]):  # axes of one device hold it whole
    split = (
      f"the contraction dimension is sharded (x over {pspec(xs)}, w over {pspec(ws)}; "
      "per-shard kernels split x's rows and w's columns only)"
    )
    if not gather:
      return split
    # each device holds the whole contraction dimension: gathered where it is split
    xs, ws = (*xs[:-1], ()), ((), ws[1])
  data = tuple(a for axes in xs[:-1] for a in axes)
  model = ws[1]
  if {a for a in data if splits(mesh, (a,))} & {a for a in model if splits(mesh, (a,))}:
    return (
      f"x's rows and w's columns are sharded over the same mesh axes ({pspec(xs)}, {pspec(ws)})"
    )
  return DensePattern(mesh, xs, ws, (*xs[:-1], model), data, model, split)


def pattern_reason(
  pattern: DensePattern | str | None, ndim: int, out: Sequence[Axes] | None = None
) -> str | None:
  """Why the per-shard dense kernels cannot run in `pattern` (:func:`dense_pattern`'s answer for
  operands whose ``x`` has `ndim` dimensions), or None; `out`, the spec the caller asked for the
  output (``out_sharding``), must be the one they give."""
  if isinstance(pattern, str):
    return pattern
  return _out_reason(out, ((),) * ndim if pattern is None else pattern.y)


def dense_reason(x: Array, w: Array, out: Sequence[Axes] | None = None) -> str | None:
  """Why the per-shard dense kernels cannot run on these sharded operands, or None; `out`, the
  spec the caller asked for the output (``out_sharding``), must be the one they give."""
  return pattern_reason(dense_pattern(x, w), x.ndim, out)


def _out_reason(out: Sequence[Axes] | None, given: Sequence[Axes]) -> str | None:
  if out is None or tuple(out) == tuple(given):
    return None
  return (
    f"out_sharding={pspec(out)} differs from the per-shard kernels' output sharding "
    f"{pspec(given)} (x's rows by w's columns)"
  )


def dense_shard_shape(pattern: DensePattern | None, x: Array, w: Array) -> tuple[int, int, int]:
  """``(M, K, N)`` of the matmul each device runs in `pattern` (the whole layer's for None)."""
  m, (k, n) = math.prod(x.shape[:-1]), w.shape
  if isinstance(pattern, DensePattern):
    m //= math.prod(pattern.mesh.shape[a] for a in pattern.data)
    n //= math.prod(pattern.mesh.shape[a] for a in pattern.model)
  return m, k, n


def _require(pattern):
  if isinstance(pattern, str):
    raise NotImplementedError(f"per-shard kernels: {pattern}")
  return pattern


def dense_forward(kernel: Callable[..., Any], pattern: DensePattern | None) -> Callable[..., Any]:
  """``kernel(x, w, b, **static) -> (y, z)`` per shard in `pattern` (:func:`dense_pattern`'s, as
  the call's decision holds it; None: the kernel as it is); see the module docstring."""
  pattern = _require(pattern)

  def run(x, w, b, **static):
    if pattern is None:
      return kernel(x, w, b, **static)
    return per_shard(
      kernel,
      (x, w, b),
      (pattern.x, pattern.w, (pattern.model,)),
      (pattern.y, pattern.y),
      mesh=pattern.mesh,
      **static,
    )

  return run


def dense_backward(kernel: Callable[..., Any], pattern: DensePattern | None) -> Callable[..., Any]:
  """``kernel(x, w, kept, g, **static) -> (dx, dw, db)`` per shard in `pattern` (as
  :func:`dense_forward`); see the module docstring."""
  pattern = _require(pattern)

  def run(x, w, kept, g, **static):
    if pattern is None:
      return kernel(x, w, kept, g, **static)
    return per_shard(
      kernel,
      (x, w, kept, g),
      (pattern.x, pattern.w, pattern.y, pattern.y),
      (pattern.x, pattern.w, (pattern.model,)),
      mesh=pattern.mesh,
      sum_over=(pattern.model, pattern.data, pattern.data),
      **static,
    )

  return run


# -------------------------------------------------------------------------------- elementwise


def _elementwise_plan(z: Array, feature_axis: int) -> tuple[Any, tuple[Axes, ...]] | str | None:
  mesh = explicit_mesh(z)
  if mesh is None or isinstance(mesh, str):
    return mesh
  spec = spec_of(z)
  if splits(mesh, spec[feature_axis]):
    return f"the feature axis is sharded ({pspec(spec)}; per-shard kernels split the batch only)"
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


def gated_pattern(x: Array, w_gate: Array, w_up: Array) -> DensePattern | str | None:
  """The dense pattern of the gated projections ``x @ w_gate`` and ``x @ w_up`` (`w_up` split as
  `w_gate`), None when the operands' types name no Explicit mesh, or why none covers them."""
  mesh = explicit_mesh(x, w_gate, w_up)
  if isinstance(mesh, str):
    return mesh
  return dense_pattern(x, w_gate)


def gated_forward(kernel: Callable[..., Any], pattern: DensePattern | None) -> Callable[..., Any]:
  """``kernel(x, w_gate, w_up, b_gate, b_up, **static) -> (h, a, b)`` per shard in `pattern`
  (:func:`gated_pattern`'s: x's rows and the weights' columns split; `w_up` split as `w_gate`, the
  biases as their columns). No sum: each device's h, a and b are its block of the whole."""
  pattern = _require(pattern)

  def run(x, w_gate, w_up, b_gate, b_up, **static):
    if pattern is None:
      return kernel(x, w_gate, w_up, b_gate, b_up, **static)
    bias = (pattern.model,)
    return per_shard(
      kernel,
      (x, w_gate, w_up, b_gate, b_up),
      (pattern.x, pattern.w, pattern.w, bias, bias),
      (pattern.y, pattern.y, pattern.y),
      mesh=pattern.mesh,
      **static,
    )

  return run


def pointwise(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel(*arrays, **static)`` per shard, for a kernel that maps arrays of one shape to a tuple
  of arrays (or None) of that shape, elementwise: any sharding, the first array's for every input
  and output, and no collective."""

  def run(*arrays, **static):
    mesh = explicit_mesh(*arrays)
    if isinstance(mesh, str):
      raise NotImplementedError(f"per-shard kernels: {mesh}")
    if mesh is None:
      return kernel(*arrays, **static)
    spec = spec_of(arrays[0])
    # One output, the kernel's whole result, as in elementwise_forward.
    whole = lambda *a: (kernel(*a, **static),)
    return per_shard(whole, arrays, (spec,) * len(arrays), (spec,), mesh=mesh)[0]

  return run
