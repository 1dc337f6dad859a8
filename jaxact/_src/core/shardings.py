"""Shardings in the ops' types: specs read from the arrays' types, the ``out_sharding`` argument,
cotangents typed as their primals.

Under Explicit mesh axes an array's sharding is part of its type (``jax.typeof(a).sharding``). A
product whose contraction dimension is sharded on both sides has no one obvious output sharding,
and ``jnp.dot`` asks for it (``out_sharding``); the ops here take the same argument with the same
meaning, and pass it to the same ``lax.dot_general`` / ``lax.conv_general_dilated``, so that XLA
partitions the op's products as it partitions the plain composition's (gathers a weight slice,
reduce-scatters its gradient). A ``custom_vjp``'s backward must give each cotangent its primal's
type: :func:`retype` reshards the ones that came out otherwise (a replicated scale's gradient,
summed from feature-sharded rows, is sharded like the features until then).

Under Auto mesh axes the shardings are XLA's to choose, and ``out_sharding`` is a sharding
constraint on the output (:func:`constrain`; ``jnp.dot`` refuses one there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import Array
from jax._src.core import ShardingTypeError  # jax raises it, and exports it nowhere public
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxact._src.core import dispatch

Axes = tuple[str, ...]  # the mesh axes one dimension is split over
Spec = tuple[Axes, ...]  # one tuple of mesh axes per dimension, as spec_of gives it


# ------------------------------------------------------------------------- in the arrays' types


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


def splits(mesh, axes: Axes) -> bool:
  """Whether `axes` split a dimension over more than one device of `mesh` (a program written for
  any device count types a one-GPU array over axes of one device, which split nothing)."""
  return any(mesh.shape[a] > 1 for a in axes)


def split_spec(a: Array) -> tuple[Axes, ...]:
  """:func:`spec_of` without the mesh axes of one device: the axes that split `a`'s dimensions."""
  sharding = _sharding(a)
  if sharding is None:
    return spec_of(a)
  return tuple(tuple(n for n in axes if splits(sharding.mesh, (n,))) for axes in spec_of(a))


def explicit_mesh(*arrays: Array | None):
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


def pspec(spec: Sequence[Axes]) -> P:
  """A spec as :func:`spec_of` writes one (a tuple of mesh axes per dimension) as a
  ``PartitionSpec``."""
  return P(*(None if not a else a[0] if len(a) == 1 else a for a in spec))


# ------------------------------------------------------------------------- the ops' arguments


def check(fn_name: str, out_sharding: Any, ndim: int) -> NamedSharding | P | None:
  """`out_sharding` if it is None, a ``PartitionSpec`` (of the current mesh) or a ``NamedSharding``
  of at most `ndim` entries, else a ``TypeError`` / ``ValueError`` naming the op."""
  if out_sharding is None:
    return None
  if isinstance(out_sharding, NamedSharding):
    spec = out_sharding.spec
  elif isinstance(out_sharding, P):
    spec = out_sharding
    if dispatch.context_mesh().empty:
      raise ValueError(
        f"jaxact.{fn_name}: `out_sharding` {out_sharding} is a PartitionSpec, which needs a mesh: "
        "call the op under `with jax.set_mesh(mesh):` or pass a NamedSharding"
      )
  else:
    raise TypeError(
      f"jaxact.{fn_name}: `out_sharding` must be a jax.sharding.PartitionSpec, a NamedSharding or "
      f"None (as jnp.dot takes it); got {type(out_sharding).__name__} {out_sharding!r}"
    )
  if len(spec) > ndim:
    raise ValueError(
      f"jaxact.{fn_name}: `out_sharding` {spec} has {len(spec)} entries, but the output has "
      f"{ndim} dimensions"
    )
  return out_sharding


def _mesh(sharding: NamedSharding | P):
  return sharding.mesh if isinstance(sharding, NamedSharding) else dispatch.context_mesh()


def _spec(sharding: NamedSharding | P) -> P:
  return sharding.spec if isinstance(sharding, NamedSharding) else sharding


def is_explicit(sharding: NamedSharding | P | None) -> bool:
  """Whether `sharding` types the output (its mesh axes are Explicit) rather than constrains it."""
  if sharding is None:
    return False
  mesh = _mesh(sharding)
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  named = [a for entry in _spec(sharding) for a in _axes(entry)]
  if named:
    return all(types.get(a) == AxisType.Explicit for a in named)
  return AxisType.Explicit in mesh.axis_types


def typed(sharding: NamedSharding | P | None) -> NamedSharding | P | None:
  """`sharding` when it is an Explicit-axes one (passed to the products), else None."""
  return sharding if is_explicit(sharding) else None


def constrain(y: Array, sharding: NamedSharding | P | None) -> Array:
  """`y` under an Auto-axes `sharding`: a sharding constraint (nothing for None or Explicit
  axes, which the op's products already typed)."""
  if sharding is None or is_explicit(sharding):
    return y
  return jax.lax.with_sharding_constraint(y, sharding)


def reshard(y: Array, sharding: NamedSharding | P | None) -> Array:
  """`y` resharded to the Explicit-axes `sharding` (itself when it already is, or for None)."""
  if sharding is None or not is_explicit(sharding):
    return y
  return to_spec(y, spec_of_sharding(sharding, y.ndim))


def spec_of_sharding(sharding: NamedSharding | P, ndim: int) -> Spec:
  """A ``NamedSharding``'s or ``PartitionSpec``'s spec as :func:`spec_of` writes one, padded to
  `ndim` dimensions."""
  spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  return tuple(_axes(e) for e in spec) + ((),) * (ndim - len(spec))


def spec(a: Array | None) -> Spec | None:
  """`a`'s spec when its type holds an Explicit-axes sharding, else None."""
  if a is None or typed_sharding(a) is None:
    return None
  return spec_of(a)


def specs(*arrays: Array | None) -> tuple[Spec | None, ...]:
  """:func:`spec` of each array: what :func:`retype` gives their cotangents back."""
  return tuple(spec(a) for a in arrays)


def to_spec(a: Array, want: Spec) -> Array:
  """`a` resharded to `want` over the mesh of its own type (itself when it already is, or when its
  type holds no Explicit-axes sharding)."""
  sharding = typed_sharding(a)
  if sharding is None or spec_of(a) == tuple(want):
    return a
  return jax.sharding.reshard(a, NamedSharding(sharding.mesh, pspec(want)))


def retype(cotangents, want: tuple[Spec | None, ...]):
  """Each cotangent resharded to its primal's spec (None entries, either side, left alone)."""
  return tuple(
    c if c is None or s is None else to_spec(c, s) for c, s in zip(cotangents, want, strict=True)
  )


def align(p: Array, like: Array) -> Array:
  """`p`, broadcastable to `like` (its dims of size 1 broadcast), resharded so that each dim of
  `p` that `like` shares is split as `like` splits it and the others are whole: elementwise ops
  under Explicit axes need the shardings of the dims they pair to agree."""
  want = spec(like)
  if want is None or typed_sharding(p) is None:
    return p
  offset = like.ndim - p.ndim
  target = tuple(
    want[offset + d] if p.shape[d] == like.shape[offset + d] and p.shape[d] != 1 else ()
    for d in range(p.ndim)
  )
  return to_spec(p, target)


def product_shape(fn_name: str, product, *operands):
  """``jax.eval_shape(product, *operands)``; the error of an ambiguous sharded product names the
  op and its ``out_sharding`` argument."""
  try:
    return jax.eval_shape(product, *operands)
  except ShardingTypeError as e:
    raise ShardingTypeError(
      f"jaxact.{fn_name}: {e} (pass `out_sharding=` to jaxact.{fn_name}, as to jnp.dot)"
    ) from None


def product_input(x: Array, x_dim: int, w: Array, w_dim: int) -> Spec | None:
  """The spec `x` takes for a product with `w` contracting x's `x_dim` with w's `w_dim`, where
  both are split and x's over other axes (feature-sharded activations against FSDP weights): x
  gathered over the axes w's contraction dimension is not split over, as XLA gathers it for the
  plain ``jnp.dot``. None where x enters as it is."""
  xs, ws = spec(x), spec(w)
  if xs is None or ws is None or not xs[x_dim] or not ws[w_dim]:
    return None
  keep = tuple(a for a in xs[x_dim] if a in ws[w_dim])
  if keep == xs[x_dim]:
    return None
  return (*xs[:x_dim], keep, *xs[x_dim + 1 :])


def struct(a: Array, want: Spec | None) -> Array | jax.ShapeDtypeStruct:
  """`a`'s shape and dtype with the sharding `want` over its mesh (`a` itself for None): the primal
  a transpose is taken against, so that the cotangent comes out in that sharding."""
  if want is None:
    return a
  mesh = typed_sharding(a).mesh
  sharding = NamedSharding(mesh, pspec(want))
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def inferred_or_rows_by_columns(x, w) -> P | None:
  """None where jax infers the sharding of ``x @ w`` (w of shape (in, out)), else the spec of x's
  rows and w's columns (minus axes the rows use): the column-parallel layout of Megatron, and
  Gemma's ``act_btf`` for an ``act_btd`` input and ``(fsdp, tensor)`` weights."""
  try:
    jax.eval_shape(lambda x, w: jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ()))), x, w)
    return None
  except ShardingTypeError:
    pass
  xs = spec(x) or ((),) * x.ndim
  ws = spec(w) or ((), ())
  used = {a for axes in xs[:-1] for a in axes}
  columns = tuple(a for a in ws[1] if a not in used)
  return pspec((*xs[:-1], columns))


def spread(specs_: tuple[Spec | None, ...]) -> bool:
  """Whether an op's operands are or may be split over devices: their `specs_` name mesh axes, or
  the current mesh has Auto axes over more than one device (XLA then chooses their shardings)."""
  if any(any(s) for s in specs_ if s is not None):
    return True
  mesh = dispatch.context_mesh()
  return not mesh.empty and mesh.size > 1 and AxisType.Auto in mesh.axis_types
