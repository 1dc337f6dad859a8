"""The attention kernels' bodies (:mod:`pallas_kernels.attention_triton` launches them): the
masks as block bounds (:class:`Mask`), the logits in z's units (:class:`Logits`), the row
statistics, and the forward, dq and dk/dv kernels, one program each."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels._triton import dot, iota, load, pl, store

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Mask:
  """What excludes a key from a row's softmax, beside the rows' and keys' lengths."""

  causal: bool
  window: tuple[int, int] | None

  @classmethod
  def of(cls, causal: bool, window, t: int, s: int) -> Mask:
    """The mask of `causal` and `window` over T rows and S keys, the window's sides clipped to
    +-(T + S) (the same mask, in int32 index arithmetic)."""
    if window is not None:
      window = tuple(min(max(int(w), -(t + s)), t + s) for w in window)
    return cls(bool(causal), window)

  def valid(self, t: Array, u: Array, kv_len) -> Array:
    """Whether row `t` sees key `u` (broadcast; past ``q_lengths`` is the caller's)."""
    ok = u < kv_len
    if self.causal:
      ok &= u <= t
    if self.window is not None:
      left, right = self.window
      ok &= (u >= t - left) & (u <= t + right)
    return ok

  def key_range(self, t0, t_end, kv_len):
    """``(first, last + 1)``: the keys some row of ``[t0, t_end)`` sees, and ``(lo, hi)``: the keys
    every row of it sees (an empty range where none)."""
    first, end, lo, hi = 0, kv_len, 0, kv_len
    if self.causal:
      end = jnp.minimum(end, t_end)  # the last row sees up to itself
      hi = jnp.minimum(hi, t0 + 1)  # the first row sees no further than itself
    if self.window is not None:
      left, right = self.window
      first = jnp.maximum(t0 - left, 0)
      end = jnp.minimum(end, t_end + right)
      lo = jnp.maximum(t_end - 1 - left, 0)
      hi = jnp.minimum(hi, t0 + 1 + right)
    return (first, end), (lo, hi)

  def row_range(self, u0, u_end, q_len, block_k: int):
    """``(first, last + 1)``: the rows that see some key of ``[u0, u_end)``, and ``(lo, hi)``: the
    rows that see every key of the block ``[u0, u0 + block_k)``."""
    first, end, lo, hi = 0, q_len, 0, q_len
    if self.causal:
      first = jnp.maximum(first, u0)
      lo = jnp.maximum(lo, u0 + block_k - 1)
    if self.window is not None:
      left, right = self.window
      first = jnp.maximum(first, u0 - right)
      end = jnp.minimum(end, u_end + left)
      lo = jnp.maximum(lo, u0 + block_k - 1 - right)
      hi = jnp.minimum(hi, u0 + 1 + left)
    return (first, end), (lo, hi)


def _div(a, b: int) -> Array:
  """``a // b`` for non-negative int32 `a` (lax.div: no floor correction to compute)."""
  return lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def _blocks(outer: tuple, inner: tuple, block: int, nonempty) -> tuple[Array, ...]:
  """Loop bounds ``(a, b, c, d)`` over blocks of `block` items: ``[a, d)`` covers the `outer`
  item range (empty unless `nonempty`), ``[b, c)`` the blocks whose every item is in `inner`."""
  start, end = (jnp.maximum(jnp.asarray(v, jnp.int32), 0) for v in outer)
  lo, hi = (jnp.maximum(jnp.asarray(v, jnp.int32), 0) for v in inner)
  a = _div(start, block)
  d = jnp.where(nonempty & (end > start), jnp.maximum(_div(end + block - 1, block), a), a)
  b = jnp.clip(_div(lo + block - 1, block), a, d)
  c = jnp.clip(_div(hi, block), b, d)
  return a, b, c, d


def _phases(bounds, body, carry):
  """``body(i, carry, masked)`` over the blocks ``[b, c)`` unmasked, then over ``[a, b)`` and
  ``[c, d)`` masked (one loop for both edges, so that the kernel holds two loop bodies)."""
  a, b, c, d = bounds
  carry = lax.fori_loop(b, c, lambda i, x: body(i, x, False), carry)
  before = b - a

  def edge(i, x):
    return body(jnp.where(i < before, a + i, c + i - before), x, True)

  return lax.fori_loop(0, before + d - c, edge, carry)


def _length(ref, b, limit: int):
  """``clip(ref[b], 0, limit)``, or `limit` without a lengths array."""
  if ref is None:
    return jnp.int32(limit)
  return jnp.clip(ref[b], 0, limit).astype(jnp.int32)


def _rows(ref, b, r0, head, rows: int):
  """Rows ``[r0, r0 + rows)`` of head `head` of batch `b` of a ``(B, L, heads, H)`` ref, and the
  mask of those inside it. Every index an int32 (the interpreter's stores need one index type,
  also under x64)."""
  h = ref.shape[3]
  inside = jnp.broadcast_to(((r0 + iota(rows)) < ref.shape[1])[:, None], (rows, h))
  return ref.at[b, pl.ds(r0, rows), head, pl.ds(jnp.int32(0), h)], inside


def _load_rows(ref, b, r0, head, rows: int) -> Array:
  """Rows ``[r0, r0 + rows)`` of head `head` of batch `b`, zeros past the array."""
  block, inside = _rows(ref, b, r0, head, rows)
  return load(block, mask=inside, other=jnp.zeros((), ref.dtype))


def _store_rows(ref, b, r0, head, value: Array) -> None:
  block, inside = _rows(ref, b, r0, head, value.shape[0])
  store(block, value.astype(ref.dtype), mask=inside)


@dataclasses.dataclass(frozen=True)
class Logits:
  """The logits as ``s = unit * z``: ``z = q.k`` and ``unit = scale``, or under a soft cap c
  ``z = tanh(scale q.k / c)`` and ``unit = c``.

  The softmax works on z: ``exp(s - m) = exp2((z - m_z) * unit * log2(e))``, the difference taken
  before any product. ``exp2(s * c - m)`` would let the compiler contract the product into an FMA
  in one place and round it in another (the running maximum), and an ulp of a huge logit is a
  huge exponent: that is how logits of 1e32 turned into inf and NaN. ``z - m_z <= 0`` exactly.
  """

  scale: float
  soft_cap: float | None

  @property
  def unit(self) -> float:
    return self.scale if self.soft_cap is None else self.soft_cap

  def __call__(self, qk: Array) -> Array:
    if self.soft_cap is None:
      return qk
    return jnp.tanh(qk * (self.scale / self.soft_cap))

  def exp(self, z: Array, m: Array) -> Array:
    """``exp(unit * (z - m))``, 0 where z is -inf (and m finite or +inf)."""
    return jnp.exp2((z - m) * (self.unit * _LOG2E))

  def grad(self, ds: Array, z: Array) -> Array:
    """dS with respect to ``scale * q.k`` from dS with respect to s (z unmasked: a masked -inf
    would make ``0 * -inf``)."""
    return ds if self.soft_cap is None else ds * (1.0 - z * z)


def _row_stats(stats_ref, delta_ref, b, n, t0, rows: int, q_len):
  """``(m, l2, delta)`` of rows ``[t0, t0 + rows)``: the row maximum of z, ``l`` in base 2 (+inf
  past ``q_len``, so that its P is exactly 0), and delta."""
  t = t0 + iota(rows)
  inside = t < stats_ref.shape[3]
  m = load(stats_ref.at[b, n, jnp.int32(0), pl.ds(t0, rows)], mask=inside, other=0.0)
  l2 = load(stats_ref.at[b, n, jnp.int32(1), pl.ds(t0, rows)], mask=inside, other=0.0) * _LOG2E
  delta = load(delta_ref.at[b, n, pl.ds(t0, rows)], mask=inside, other=0.0)
  return m, jnp.where(t < q_len, l2, jnp.inf), delta


def _probabilities(logits: Logits, z: Array, m: Array, l2: Array) -> Array:
  """P from z and the rows' statistics (broadcast). ``z - m <= 0`` but for a recomputed logit an
  ulp above the forward's maximum (for huge logits an ulp is a huge exponent): clamped."""
  return jnp.exp2(jnp.minimum((z - m) * (logits.unit * _LOG2E), 0.0) - l2)


def _softmax_grad(p: Array, dp: Array, delta: Array) -> Array:
  """dS = P (dP - delta), 0 where P is exactly 1: the row is one-hot and dP - delta only rounding
  (delta from the stored O), which rows of q or k of 1e30 would make a gradient of 1e22."""
  return jnp.where(p == 1.0, 0.0, p * (dp - delta))


class _QueryBlock(NamedTuple):
  b: Array
  n: Array
  kv_head: Array
  t0: Array
  t: Array  # the block's rows
  q_len: Array
  kv_len: Array
  q: Array
  t_end: Array  # the rows whose output counts end here
  bounds: tuple[Array, ...]  # the key blocks visited (_blocks)


def _query_block(q_ref, k_ref, qlen_ref, kvlen_ref, *, mask, groups, tiles) -> _QueryBlock:
  """What a program over query block ``i`` of head ``n`` of batch ``b`` (the forward's, dq's)
  reads first: its indices, rows and lengths, its q tile, and the key blocks it visits."""
  bq, bk = tiles.block_q, tiles.block_k
  i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t0 = i * bq
  q_len = _length(qlen_ref, b, q_ref.shape[1])
  kv_len = _length(kvlen_ref, b, k_ref.shape[1])
  t_end = jnp.minimum(t0 + bq, q_len)
  outer, inner = mask.key_range(t0, t_end, kv_len)
  bounds = _blocks(outer, inner, bk, t_end > t0)
  q = _load_rows(q_ref, b, t0, n, bq)
  return _QueryBlock(b, n, _div(n, groups), t0, t0 + iota(bq), q_len, kv_len, q, t_end, bounds)


def fwd_kernel(
  q_ref, k_ref, v_ref, qlen_ref, kvlen_ref, o_ref, stats_ref, *, mask, logits, groups, tiles, tf32
):
  """o and stats of query block ``i`` of head ``n`` of batch ``b``."""
  bq, bk = tiles.block_q, tiles.block_k
  blk = _query_block(q_ref, k_ref, qlen_ref, kvlen_ref, mask=mask, groups=groups, tiles=tiles)
  b, n, kv_head, t0, t, q_len, kv_len, q, _, bounds = blk

  def body(j, carry, masked: bool):
    acc, m, total = carry
    u0 = j * bk
    k = _load_rows(k_ref, b, u0, kv_head, bk)
    z = logits(dot(q, k, trans_b=True, tf32=tf32))
    if masked:
      z = jnp.where(mask.valid(t[:, None], (u0 + iota(bk))[None, :], kv_len), z, -jnp.inf)
    m_next = jnp.maximum(m, jnp.max(z, axis=1))
    base = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # no exp(-inf - -inf)
    p = logits.exp(z, base[:, None])
    alpha = logits.exp(m, base)
    v = _load_rows(v_ref, b, u0, kv_head, bk)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, tf32=tf32)
    return acc, m_next, total * alpha + jnp.sum(p, axis=1)

  init = (
    jnp.zeros((bq, q_ref.shape[3]), jnp.float32),
    jnp.full((bq,), -jnp.inf, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  acc, m, total = _phases(bounds, body, init)
  seen = (t < q_len) & (total > 0)
  total = jnp.where(seen, total, 1.0)
  _store_rows(o_ref, b, t0, n, jnp.where(seen[:, None], acc / total[:, None], 0.0))
  inside = t < stats_ref.shape[3]
  store(stats_ref.at[b, n, jnp.int32(0), pl.ds(t0, bq)], jnp.where(seen, m, 0.0), mask=inside)
  store(stats_ref.at[b, n, jnp.int32(1), pl.ds(t0, bq)], jnp.log2(total) * _LN2, mask=inside)


def dq_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  stats_ref,
  delta_ref,
  qlen_ref,
  kvlen_ref,
  dq_ref,
  *,
  mask,
  logits,
  groups,
  tiles,
  tf32,
):
  """dq of query block ``i`` of head ``n`` of batch ``b``: ``scale * sum_u dS[:, u] k[u]``."""
  bq, bk = tiles.block_q, tiles.block_k
  blk = _query_block(q_ref, k_ref, qlen_ref, kvlen_ref, mask=mask, groups=groups, tiles=tiles)
  b, n, kv_head, t0, t, q_len, kv_len, q, _, bounds = blk
  do = _load_rows(do_ref, b, t0, n, bq)
  m, l2, delta = _row_stats(stats_ref, delta_ref, b, n, t0, bq, q_len)

  def body(j, dq, masked: bool):
    u0 = j * bk
    k = _load_rows(k_ref, b, u0, kv_head, bk)
    v = _load_rows(v_ref, b, u0, kv_head, bk)
    z = zm = logits(dot(q, k, trans_b=True, tf32=tf32))
    if masked:
      zm = jnp.where(mask.valid(t[:, None], (u0 + iota(bk))[None, :], kv_len), z, -jnp.inf)
    p = _probabilities(logits, zm, m[:, None], l2[:, None])
    dp = dot(do, v, trans_b=True, tf32=tf32)
    ds = logits.grad(_softmax_grad(p, dp, delta[:, None]), z)
    return dq + dot(ds.astype(k.dtype), k, tf32=tf32)

  dq = _phases(bounds, body, jnp.zeros((bq, q_ref.shape[3]), jnp.float32))
  _store_rows(dq_ref, b, t0, n, dq * logits.scale)


def dkv_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  stats_ref,
  delta_ref,
  qlen_ref,
  kvlen_ref,
  dk_ref,
  dv_ref,
  *,
  mask,
  logits,
  groups,
  tiles,
  tf32,
):
  """dk, dv of key block ``j`` of kv head ``h`` of batch ``b``, summed over the query heads of
  the group: ``dv = sum P^T dO``, ``dk = scale * sum dS^T q``."""
  bq, bk = tiles.block_q, tiles.block_k
  j, b, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  u0 = j * bk
  q_len = _length(qlen_ref, b, q_ref.shape[1])
  kv_len = _length(kvlen_ref, b, k_ref.shape[1])
  u = u0 + iota(bk)
  k = _load_rows(k_ref, b, u0, kv_head, bk)
  v = _load_rows(v_ref, b, u0, kv_head, bk)
  u_end = jnp.minimum(u0 + bk, kv_len)  # the keys whose gradient is not 0
  outer, inner = mask.row_range(u0, u_end, q_len, bk)
  # Only a block of keys that all count can skip the mask.
  inner = (inner[0], jnp.where(u0 + bk <= kv_len, inner[1], 0))
  bounds = _blocks(outer, inner, bq, u_end > u0)

  def head(g, carry):
    n = kv_head * groups + g

    def body(i, carry, masked: bool):
      dk, dv = carry
      t0 = i * bq
      q = _load_rows(q_ref, b, t0, n, bq)
      do = _load_rows(do_ref, b, t0, n, bq)
      m, l2, delta = _row_stats(stats_ref, delta_ref, b, n, t0, bq, q_len)
      z = zm = logits(dot(k, q, trans_b=True, tf32=tf32))  # (keys, rows)
      if masked:
        zm = jnp.where(mask.valid((t0 + iota(bq))[None, :], u[:, None], kv_len), z, -jnp.inf)
      p = _probabilities(logits, zm, m[None, :], l2[None, :])
      dv = dv + dot(p.astype(do.dtype), do, tf32=tf32)
      dp = dot(v, do, trans_b=True, tf32=tf32)
      ds = logits.grad(_softmax_grad(p, dp, delta[None, :]), z)
      return dk + dot(ds.astype(q.dtype), q, tf32=tf32), dv

    return _phases(bounds, body, carry)

  zeros = jnp.zeros((bk, k_ref.shape[3]), jnp.float32)
  if groups == 1:
    dk, dv = head(0, (zeros, zeros))
  else:
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
  _store_rows(dk_ref, b, u0, kv_head, dk * logits.scale)
  _store_rows(dv_ref, b, u0, kv_head, dv)
