"""Attention that keeps q, k, v, its output and two numbers a row: FlashAttention-2 forward and
backward as Pallas kernels (Triton backend, sm80+).

Layout as ``jax.nn.dot_product_attention``: q ``(B, T, N, H)``, k and v ``(B, S, K, H)`` with K
dividing N (query head ``n`` reads kv head ``n // (N // K)``: grouped and multi-query attention);
the output o ``(B, T, N, H)`` in q's dtype and each row's statistics, stats ``(B, N, 2, T)``
float32: the row's largest ``z`` (see :class:`_Logits`: ``s = unit * z``) and
``l = log sum exp(s - unit * max z)``, so that the log-sum-exp is
``unit * stats[:, :, 0] + stats[:, :, 1]``. They are kept apart because one float32 ``lse``
rounds ``l`` away next to a huge row maximum. The logits ``s = scale * q k^T`` accumulate in
float32 and are optionally soft-capped (``c * tanh(s / c)``). A key is excluded from a row's
softmax where `causal` and ``u > t`` (top-left aligned, ``jnp.tril``), outside a `window`
``(left, right)`` (``t - left <= u <= t + right``), or at or past ``kv_lengths[b]``; rows at or
past ``q_lengths[b]`` see no key. A row that sees no key gives ``o = 0``, stats ``(0, 0)`` and
zero gradients, never NaN.

Forward (:func:`attention_forward`): one program per (query block, batch, head) keeps its q tile in
registers and loops over the key blocks its rows can see, with an online softmax in base 2 (a
running row maximum, so that no finite logit overflows; while a row has seen only masked keys its
maximum is -inf and the exponentials are taken against 0, never ``exp(-inf + inf)``). Key blocks
entirely outside the causal mask, the window or ``kv_lengths`` are not visited (the loop bounds
exclude them); of the others only those the mask cuts evaluate it.

Backward (:func:`attention_backward`), FlashAttention-2's order: ``delta = rowsum(dO * O)`` in
float32 (one XLA reduction), then two kernels that recompute ``P = exp(s - m - l)`` block by
block:

* dk, dv: one program per (key block, batch, kv head) loops over the query heads of its group and
  the query blocks that see its keys: ``dv += P^T dO``, ``dk += dS^T q``, the group's sum kept in
  registers (no per-query-head dk, dv in memory);
* dq: one program per (query block, batch, head) loops over key blocks as the forward:
  ``dq += dS k``;

with ``dS = P * (dP - delta)``, ``dP = dO v^T``, times ``1 - (s / c)^2`` under a soft cap, and the
scale applied once at the end. A row past ``q_lengths`` has its ``l`` read as +inf, and a row
without keys has every logit masked: their P is exactly 0.

Ragged T and S are masked, not padded: loads past the arrays read 0 and stores past them are
dropped. The head dimension is one tile (a power of two from 16 to 256,
:func:`attention_unsupported`). Precision: P is rounded to v's dtype before ``P V`` (and dS to the
operands' dtype before its dots), as FlashAttention does; float32 operands use TF32 exactly when
:func:`pallas_kernels.allow_tf32` says the `precision` allows it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from pallas_kernels._triton import (
  DTYPES,
  CompilerParams,
  allow_tf32,
  dot,
  iota,
  load,
  pl,
  slots,
  store,
)

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
  """One kernel's tiling: ``block_q`` query rows by ``block_k`` keys a step."""

  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class AttentionBlockConfig:
  fwd: AttentionTiles  # o, stats: a program per query block, stepping over key blocks
  dq: AttentionTiles  # dq: a program per query block, stepping over key blocks
  dkv: AttentionTiles  # dk, dv: a program per key block, stepping over query blocks


# (fwd, dq, dkv) as (block_q, block_k, num_warps, num_stages), by the largest head dimension each
# row takes; 16-bit operands, then float32 (TF32 dots). See _block_config.
_HALF_TILES = {
  64: ((128, 64, 8, 3), (64, 32, 4, 3), (32, 64, 4, 2)),
  128: ((128, 64, 8, 2), (64, 32, 8, 3), (32, 64, 8, 3)),
  256: ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
}
_FLOAT32_TILES = {
  32: ((128, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)),
  64: ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2)),
  128: ((128, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
  256: ((32, 32, 8, 1), (32, 32, 8, 1), (32, 16, 8, 1)),
}


def _block_config(q_shape, k_shape, dtype) -> AttentionBlockConfig:
  """Tile sizes and launch parameters for attention of `q_shape`, `k_shape` in `dtype`.

  Reasoning. There is no GPU here to tune on: the sizes follow jax's Pallas attention op (128 x
  128 forward, 4 warps up to H = 64 and 8 above), tokamax's Triton flash attention (64 x 32 for
  dq, 32 x 64 for dk, dv) and Triton's fused-attention tutorial (128 x 64 forward on Hopper, more
  stages in the backward), tuned on A100s and H100s, then cut where XLA's register-spill check
  failed them compiled for an A100 or an H100 (tests/test_pallas_attention.py: B 4,
  T = S = 2048, every head dimension and dtype, causal alone and with a window, a soft cap and
  lengths, which cost registers):
  * Forward: 128 query rows by 64 keys a step. q and the float32 accumulator (block_q x H) stay in
    registers through the key loop beside the (128, 64) logits, over 8 warps (4 spilled at H = 64
    on an A100 with a soft cap, a window and lengths). Stages are k and v tiles, 2 x 64 x H x 2 B:
    three at H <= 64, two at H = 128 (64 KiB compiled on an A100, 96 KiB on an H100, beside q).
    H = 256 (Gemma) halves rows and keys.
  * dq holds q, dO and the float32 dq (block_q x H) through its loop: 64 rows by 32 keys; dk, dv
    hold k, v and two float32 accumulators (block_k x H): 64 keys by 32 rows. Three stages of
    q and dO tiles from H = 128 (at most 68 KiB on an A100); two for dk, dv below (three spilled
    at H = 16 on an A100 with the options above).
  * float32 operands (TF32 dots) take twice the registers and shared memory of a tile: 128 x 64
    forward tiles spilled at H = 64 on an H100, 64-row dq and 64-key dk, dv tiles at H = 64 on an
    A100 and at H = 128 on an H100, 64 x 32 forward tiles at H = 256 on an H100, 32-key dk, dv
    tiles at H = 256 on an A100 with the options above; those are halved.
  * A sequence shorter than a block takes the smallest power of two >= 16 (Triton's smallest dot
    operand side) that covers it, so short sequences do not compute mostly masked tiles.
  """
  t, s, h = q_shape[1], k_shape[1], q_shape[3]
  table = _FLOAT32_TILES if np.dtype(dtype).itemsize == 4 else _HALF_TILES
  fwd, dq, dkv = table[min(d for d in table if d >= h)]

  def tiles(block_q: int, block_k: int, warps: int, stages: int) -> AttentionTiles:
    return AttentionTiles(_fit(block_q, t), _fit(block_k, s), warps, stages)

  return AttentionBlockConfig(fwd=tiles(*fwd), dq=tiles(*dq), dkv=tiles(*dkv))


def _fit(block: int, length: int) -> int:
  return min(block, max(16, pl.next_power_of_2(length)))


# --------------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class _Mask:
  """What excludes a key from a row's softmax, beside the rows' and keys' lengths."""

  causal: bool
  window: tuple[int, int] | None

  @classmethod
  def of(cls, causal: bool, window, t: int, s: int) -> _Mask:
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
class _Logits:
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


def _probabilities(logits: _Logits, z: Array, m: Array, l2: Array) -> Array:
  """P from z and the rows' statistics (broadcast). ``z - m <= 0`` but for a recomputed logit an
  ulp above the forward's maximum (for huge logits an ulp is a huge exponent): clamped."""
  return jnp.exp2(jnp.minimum((z - m) * (logits.unit * _LOG2E), 0.0) - l2)


def _fwd_kernel(
  q_ref, k_ref, v_ref, qlen_ref, kvlen_ref, o_ref, stats_ref, *, mask, logits, groups, tiles, tf32
):
  """o and stats of query block ``i`` of head ``n`` of batch ``b``."""
  bq, bk = tiles.block_q, tiles.block_k
  i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  kv_head = _div(n, groups)
  t0 = i * bq
  q_len = _length(qlen_ref, b, q_ref.shape[1])
  kv_len = _length(kvlen_ref, b, k_ref.shape[1])
  t = t0 + iota(bq)
  q = _load_rows(q_ref, b, t0, n, bq)
  t_end = jnp.minimum(t0 + bq, q_len)  # the rows whose output counts
  outer, inner = mask.key_range(t0, t_end, kv_len)
  bounds = _blocks(outer, inner, bk, t_end > t0)

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


def _dq_kernel(
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
  i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  kv_head = _div(n, groups)
  t0 = i * bq
  q_len = _length(qlen_ref, b, q_ref.shape[1])
  kv_len = _length(kvlen_ref, b, k_ref.shape[1])
  t = t0 + iota(bq)
  q = _load_rows(q_ref, b, t0, n, bq)
  do = _load_rows(do_ref, b, t0, n, bq)
  m, l2, delta = _row_stats(stats_ref, delta_ref, b, n, t0, bq, q_len)
  t_end = jnp.minimum(t0 + bq, q_len)
  outer, inner = mask.key_range(t0, t_end, kv_len)
  bounds = _blocks(outer, inner, bk, t_end > t0)

  def body(j, dq, masked: bool):
    u0 = j * bk
    k = _load_rows(k_ref, b, u0, kv_head, bk)
    v = _load_rows(v_ref, b, u0, kv_head, bk)
    z = zm = logits(dot(q, k, trans_b=True, tf32=tf32))
    if masked:
      zm = jnp.where(mask.valid(t[:, None], (u0 + iota(bk))[None, :], kv_len), z, -jnp.inf)
    p = _probabilities(logits, zm, m[:, None], l2[:, None])
    dp = dot(do, v, trans_b=True, tf32=tf32)
    ds = logits.grad(p * (dp - delta[:, None]), z)
    return dq + dot(ds.astype(k.dtype), k, tf32=tf32)

  dq = _phases(bounds, body, jnp.zeros((bq, q_ref.shape[3]), jnp.float32))
  _store_rows(dq_ref, b, t0, n, dq * logits.scale)


def _dkv_kernel(
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
      ds = logits.grad(p * (dp - delta[None, :]), z)
      return dk + dot(ds.astype(q.dtype), q, tf32=tf32), dv

    return _phases(bounds, body, carry)

  zeros = jnp.zeros((bk, k_ref.shape[3]), jnp.float32)
  if groups == 1:
    dk, dv = head(0, (zeros, zeros))
  else:
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
  _store_rows(dk_ref, b, u0, kv_head, dk * logits.scale)
  _store_rows(dv_ref, b, u0, kv_head, dv)


# --------------------------------------------------------------------------- pallas_calls


def attention_unsupported(
  q_shape: tuple[int, ...],
  k_shape: tuple[int, ...],
  dtype,
  *,
  v_shape: tuple[int, ...] | None = None,
  precision: Any = None,
) -> str | None:
  """Why the kernels cannot run attention of these shapes, `dtype` and dot `precision`, or None
  when they can.

  Everything else the kernels refuse (shapes that do not fit together, lengths, options) is an
  error in the call, raised by :func:`attention_forward` and :func:`attention_backward`."""
  if np.dtype(dtype) not in DTYPES:
    return f"dtype {np.dtype(dtype).name} (the kernels take float32, bfloat16 or float16)"
  if len(q_shape) != 4 or len(k_shape) != 4:
    return f"q and k must be (B, T, N, H) and (B, S, K, H); got {q_shape} and {k_shape}"
  h = q_shape[3]
  if h not in _HEAD_DIMS:
    return (
      f"head dimension {h} (the kernels take one tile of a power of two from 16 to 256: "
      f"{', '.join(map(str, _HEAD_DIMS))})"
    )
  if k_shape[3] != h or (v_shape is not None and v_shape[3] != h):
    v_dim = None if v_shape is None else v_shape[3]
    return f"head dimensions differ (q {h}, k {k_shape[3]}, v {v_dim}): the kernels take one"
  if np.dtype(dtype) == np.dtype(jnp.float32) and not allow_tf32(precision):
    # Triton's IEEE float32 dots are FMA loops: compiled, they spilled registers at every tile
    # that keeps a float32 accumulator worth having (down to 16 x 32 at H = 64 on an A100).
    return (
      f"exact float32 dots (precision {precision!r}, jax_default_matmul_precision "
      f"{jax.config.jax_default_matmul_precision!r}): the kernels take TF32 float32 dots"
    )
  return None


def _check(name, q, k, v, q_lengths, kv_lengths, *, scale, window, soft_cap, precision) -> None:
  """Raise for a call the kernels cannot take, naming the argument."""
  for arg, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name}: `{arg}` must be (B, L, heads, H); got {arg}.shape={x.shape}")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(
      f"{name}: `q`, `k` and `v` must have one dtype; got {q.dtype}, {k.dtype} and {v.dtype}"
    )
  b, _, n, _ = q.shape
  if k.shape != v.shape or k.shape[0] != b or n % k.shape[2]:
    raise ValueError(
      f"{name}: `k` and `v` must be (B, S, K, H) with B as q's and K dividing q's N; got "
      f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
    )
  why = attention_unsupported(q.shape, k.shape, q.dtype, v_shape=v.shape, precision=precision)
  if why is not None:
    raise ValueError(f"{name}: the kernels cannot take {why}")
  for arg, lengths in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
    if lengths is not None and (
      lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer)
    ):
      raise ValueError(
        f"{name}: `{arg}` must be an integer array of shape ({b},); got shape {lengths.shape} "
        f"and dtype {lengths.dtype}"
      )
  if not isinstance(scale, numbers.Real):
    raise TypeError(f"{name}: `scale` must be a positive finite Python number; got {scale!r}")
  if not 0 < scale < math.inf:
    raise ValueError(f"{name}: `scale` must be a positive finite Python number; got {scale!r}")
  if soft_cap is not None and (
    not isinstance(soft_cap, numbers.Real) or not 0 < soft_cap < math.inf
  ):
    raise ValueError(
      f"{name}: `soft_cap` must be None or a positive finite Python number; got {soft_cap!r}"
    )
  if window is not None and not (
    isinstance(window, tuple)
    and len(window) == 2
    and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)
  ):
    raise ValueError(
      f"{name}: `window` must be None or a (left, right) pair of ints; got {window!r}"
    )


def _tiles(
  default: AttentionTiles, block_q, block_k, num_warps, num_stages, name: str
) -> AttentionTiles:
  """`default` with the caller's values in place of its own (each checked, none changed)."""
  for arg, value in (("block_q", block_q), ("block_k", block_k)):
    if value is not None and (not isinstance(value, int) or value < 16 or value & (value - 1)):
      raise ValueError(f"{name}: `{arg}` must be a power of two >= 16; got {value!r}")
  if num_warps is not None and (
    not isinstance(num_warps, int) or num_warps < 1 or num_warps & (num_warps - 1)
  ):
    raise ValueError(f"{name}: `num_warps` must be a power of two; got {num_warps!r}")
  if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
    raise ValueError(f"{name}: `num_stages` must be a positive int; got {num_stages!r}")
  given = dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
  return dataclasses.replace(default, **{k: v for k, v in given.items() if v is not None})


def _lengths(x: Array | None) -> Array | None:
  return None if x is None else x.astype(jnp.int32)


def _static(q, k, *, scale, causal, window, soft_cap, precision) -> dict[str, Any]:
  return dict(
    mask=_Mask.of(causal, window, q.shape[1], k.shape[1]),
    logits=_Logits(float(scale), None if soft_cap is None else float(soft_cap)),
    groups=q.shape[2] // k.shape[2],
    tf32=allow_tf32(precision),
  )


def _params(t: AttentionTiles) -> CompilerParams:
  return CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def attention_forward(
  q: Array,
  k: Array,
  v: Array,
  q_lengths: Array | None = None,
  kv_lengths: Array | None = None,
  *,
  scale: float,
  causal: bool = False,
  window: tuple[int, int] | None = None,
  soft_cap: float | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
  precision: Any = None,
  interpret: bool = False,
) -> tuple[Array, Array]:
  """``(o, stats)``: o ``(B, T, N, H)`` in q's dtype and the float32 row statistics ``(B, N, 2,
  T)`` (the module docstring says what they hold).

  `block_q`, `block_k`, `num_warps`, `num_stages` replace :func:`_block_config`'s choice for the
  forward kernel. Raises ValueError (TypeError for dtypes and `scale`) for what the kernels cannot
  take, naming the argument."""
  name = "pallas_kernels.attention_forward"
  _check(
    name,
    q,
    k,
    v,
    q_lengths,
    kv_lengths,
    scale=scale,
    window=window,
    soft_cap=soft_cap,
    precision=precision,
  )
  b, t, n, _ = q.shape
  default = _block_config(q.shape, k.shape, q.dtype).fwd
  tiles = _tiles(default, block_q, block_k, num_warps, num_stages, name)
  static = _static(
    q, k, scale=scale, causal=causal, window=window, soft_cap=soft_cap, precision=precision
  )
  lengths = (_lengths(q_lengths), _lengths(kv_lengths))
  kernel = slots(
    _fwd_kernel,
    (True, True, True, q_lengths is not None, kv_lengths is not None, True, True),
    tiles=tiles,
    **static,
  )
  o, stats = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((b, n, 2, t), jnp.float32),
    ),
    grid=(pl.cdiv(t, tiles.block_q), b, n),
    compiler_params=_params(tiles),
    interpret=interpret,
    name="jaxact_attention_fwd",
  )(q, k, v, *(x for x in lengths if x is not None))
  return o, stats


def attention_backward(
  q: Array,
  k: Array,
  v: Array,
  o: Array,
  stats: Array,
  do: Array,
  q_lengths: Array | None = None,
  kv_lengths: Array | None = None,
  *,
  scale: float,
  causal: bool = False,
  window: tuple[int, int] | None = None,
  soft_cap: float | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
  precision: Any = None,
  interpret: bool = False,
) -> tuple[Array, Array, Array]:
  """``(dq, dk, dv)`` in q's, k's and v's dtypes for the cotangent `do` of ``o``, from what
  :func:`attention_forward` returned (`o`, `stats`) and its arguments.

  `block_q`, `block_k`, `num_warps`, `num_stages` replace :func:`_block_config`'s choice for both
  backward kernels."""
  name = "pallas_kernels.attention_backward"
  _check(
    name,
    q,
    k,
    v,
    q_lengths,
    kv_lengths,
    scale=scale,
    window=window,
    soft_cap=soft_cap,
    precision=precision,
  )
  b, t, n, _ = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  for arg, x, shape in (("o", o, q.shape), ("do", do, q.shape), ("stats", stats, (b, n, 2, t))):
    if x.shape != shape:
      raise ValueError(f"{name}: `{arg}` must have shape {shape}; got {arg}.shape={x.shape}")
  if stats.dtype != jnp.float32:
    raise TypeError(f"{name}: `stats` must be float32; got {stats.dtype}")
  cfg = _block_config(q.shape, k.shape, q.dtype)
  dq_tiles = _tiles(cfg.dq, block_q, block_k, num_warps, num_stages, name)
  dkv_tiles = _tiles(cfg.dkv, block_q, block_k, num_warps, num_stages, name)
  static = _static(
    q, k, scale=scale, causal=causal, window=window, soft_cap=soft_cap, precision=precision
  )
  # FlashAttention-2's delta = rowsum(dO * O), in float32: one fused XLA reduction of (B, N, T).
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
  lengths = tuple(x for x in (_lengths(q_lengths), _lengths(kv_lengths)) if x is not None)
  present = (True,) * 6 + (q_lengths is not None, kv_lengths is not None)
  args = (q, k, v, do, stats, delta, *lengths)

  dq = pl.pallas_call(
    slots(_dq_kernel, (*present, True), tiles=dq_tiles, **static),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    grid=(pl.cdiv(t, dq_tiles.block_q), b, n),
    compiler_params=_params(dq_tiles),
    interpret=interpret,
    name="jaxact_attention_bwd_dq",
  )(*args)
  dk, dv = pl.pallas_call(
    slots(_dkv_kernel, (*present, True, True), tiles=dkv_tiles, **static),
    out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
    grid=(pl.cdiv(s, dkv_tiles.block_k), b, kv_heads),
    compiler_params=_params(dkv_tiles),
    interpret=interpret,
    name="jaxact_attention_bwd_dkv",
  )(*args)
  return dq, dk, dv


# ------------------------------------------------------------------------------- reference


def attention_mask(t: int, s: int, q_lengths=None, kv_lengths=None, *, causal=False, window=None):
  """The boolean ``(B or 1, 1, T, S)`` mask of the keys each row sees, as the kernels define it."""
  rows = jnp.arange(t)[:, None]
  cols = jnp.arange(s)[None, :]
  valid = _Mask.of(causal, window, t, s).valid(rows, cols, s)[None, None]
  if q_lengths is not None:
    valid = valid & (rows < q_lengths[:, None, None, None])
  if kv_lengths is not None:
    valid = valid & (cols < kv_lengths[:, None, None, None])
  return valid


def attention_reference(
  q: Array,
  k: Array,
  v: Array,
  q_lengths: Array | None = None,
  kv_lengths: Array | None = None,
  *,
  scale: float,
  causal: bool = False,
  window: tuple[int, int] | None = None,
  soft_cap: float | None = None,
) -> tuple[Array, Array]:
  """Pure-jnp ``(o, lse)`` over the whole T x S logits: float32 logits and statistics (float64
  for float64 inputs), P rounded to v's dtype before ``P V``, o in q's dtype; a row without keys
  gives o = 0 and lse = -inf, and its gradients through this function are 0."""
  acc = jnp.promote_types(q.dtype, jnp.float32)
  groups = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=acc) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  valid = attention_mask(
    q.shape[1], k.shape[1], q_lengths, kv_lengths, causal=causal, window=window
  )
  s = jnp.where(valid, s, -jnp.inf)
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(m == -jnp.inf, 0.0, m)
  e = jnp.where(valid, jnp.exp(s - m), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  p = (e / total).astype(v.dtype)
  o = jnp.einsum("bnts,bsnh->btnh", p, v, preferred_element_type=acc).astype(q.dtype)
  lse = jnp.where(seen, m + jnp.log(total), -jnp.inf)[..., 0]
  return o, lse
