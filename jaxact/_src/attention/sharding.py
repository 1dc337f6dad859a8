"""Attention on operands sharded over Explicit mesh axes: each device attends its own batch rows
and heads (``jax.shard_map`` around the whole ``custom_vjp``), with no collective at all.

Attention is independent across batch rows and heads, so data parallelism (batch sharded) and
tensor parallelism (heads sharded, Megatron's attention) need no communication: each device runs
the op on its shards and its gradients are its shards'. Key/value heads follow the query heads:
where the K key/value heads split as the N query heads do (``K % devices == 0``) each device takes
its slice (a local slice of a replicated k, no gather); where they cannot (multi-query attention,
``K = 1``, under tensor parallelism) every device keeps all K and picks the one (or few) its query
heads read, by its index on the heads axes. The sequence axes are not split: a query or key sharded
over its length (sequence / context parallelism, ring attention) raises ``NotImplementedError``.
Under Auto axes the op is XLA's to partition, as for any jnp code.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jax import lax

from jaxact._src.core import pallas_sharding as ps
from jaxact._src.core import shardings


def _fail(msg: str):
  raise NotImplementedError(f"jaxact.dot_product_attention on sharded operands: {msg}")


def per_device(fn, plan, q, k, v, bias, aux):
  """``fn(plan, q, k, v, bias, aux)`` (`aux`: :class:`.xla.Aux`) as a function of the arrays, run
  per device under ``shard_map`` when their types name a mesh with Explicit axes."""
  mask = aux.mask
  others = (aux.mask, aux.q_lengths, aux.kv_lengths, aux.q_segments, aux.kv_segments)
  mesh = shardings.explicit_mesh(q, k, v, bias, *others)
  if mesh is None:
    return functools.partial(fn, plan)
  if isinstance(mesh, str):
    _fail(mesh)
  qs, ks, vs = shardings.spec_of(q), shardings.spec_of(k), shardings.spec_of(v)
  split = lambda *axes: any(shardings.splits(mesh, a) for a in axes)  # one-device axes split none
  if split(qs[1], ks[1], vs[1]):
    _fail(
      f"the sequence axis is sharded (query {shardings.pspec(qs)}, key {shardings.pspec(ks)}); "
      "each device attends whole sequences: shard batch and heads, or reshard the sequence first"
    )
  if split(qs[3], ks[3], vs[3]):
    _fail(f"the head dim is sharded (query {shardings.pspec(qs)}, key {shardings.pspec(ks)})")
  batch, heads = qs[0], qs[2]
  if plan.dropout is not None and not plan.broadcast_dropout and (batch or heads):
    _fail("dropout with broadcast_dropout=False (its mask is drawn by global batch and head index)")
  n, kv_heads = q.shape[2], k.shape[2]
  parts = math.prod(mesh.shape[a] for a in heads)
  if n % parts:
    _fail(f"{n} query heads do not split over {parts} devices ({heads})")
  kv_split = kv_heads % parts == 0
  # the sequence and head dims whole on each device, typed as given (over axes of one device)
  kv_spec = (batch, ks[1], heads if kv_split else (), ks[3])
  q_spec = (batch, qs[1], heads, qs[3])

  def map_spec(a):  # bias, mask: (B|1, N|1, T|1, S|1)
    if a is None:
      return None
    return (batch if a.shape[0] > 1 else (), heads if a.shape[1] > 1 else (), (), ())

  fields = [f.name for f in dataclasses.fields(aux)]

  def body(q, k, v, bias, *aux_arrays):
    if not kv_split:  # every device holds all K heads: take the ones its query heads read
      k, v = _local_kv(k, v, n, parts, heads)
    return (fn(plan, q, k, v, bias, type(aux)(*aux_arrays)),)

  aux_specs = dict(
    mask=map_spec(mask),
    q_lengths=(batch,),
    kv_lengths=(batch,),
    q_segments=(batch, ()),
    kv_segments=(batch, ()),
    key_data=((),),  # replicated
  )

  def run(q, k, v, bias, aux):
    arrays = [getattr(aux, f) for f in fields]
    specs = [q_spec, kv_spec, kv_spec, map_spec(bias), *(aux_specs[f] for f in fields)]
    return ps.per_shard(body, (q, k, v, bias, *arrays), specs, (q_spec,), mesh=mesh)[0]

  return run


def _local_kv(k, v, n: int, parts: int, heads):
  """The key/value heads that this device's ``n / parts`` query heads read (k, v hold all K)."""
  kv_heads = k.shape[2]
  group = n // kv_heads  # query heads a kv head
  local = n // parts
  index = lax.axis_index(heads)
  if group % local == 0:  # this device's query heads all read one kv head
    first, count = index * local // group, 1
  elif local % group == 0:  # they read local / group whole kv heads
    first, count = index * (local // group), local // group
  else:
    _fail(f"{n} query heads over {parts} devices split a group of {group} unevenly")
  k = lax.dynamic_slice_in_dim(k, first, count, 2)
  v = lax.dynamic_slice_in_dim(v, first, count, 2)
  return k, v
