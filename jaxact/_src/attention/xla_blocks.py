"""The blocks of attention's XLA path (:mod:`.xla`): the key (query) blocks a query (key) block
visits, the operands in the blocks' layouts, one block's logits under every mask, and its dropout
mask."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src.attention.plan import AttentionPlan
from jaxact._src.core.dropout import keep_from_index


@dataclasses.dataclass(frozen=True)
class Shapes:
  batch: int
  q_len: int
  kv_len: int
  kv_heads: int
  groups: int


def start(index, block: int, length: int):
  """First row of block `index`: ``index * block``, moved back so the block ends by `length`."""
  return jnp.minimum(jnp.asarray(index, jnp.int32) * block, length - block)


def key_blocks(plan: AttentionPlan, sh: Shapes, q0):
  """``[lo, hi)``: the key blocks holding an unmasked column for query rows ``[q0, q0 +
  block_q)``, by the causal mask and the window; static ``(0, n)`` without either."""
  n = -(-sh.kv_len // plan.block_k)
  right, left = plan.right, plan.left
  if right is None and left is None:
    return 0, n
  lo, hi = jnp.int32(0), jnp.int32(n)
  if left is not None:
    lo = jnp.maximum(q0 - left, 0) // plan.block_k
  if right is not None:
    last = q0 + plan.block_q - 1 + right  # the last column any row of the block sees
    hi = jnp.where(last < 0, 0, jnp.minimum(last, sh.kv_len - 1) // plan.block_k + 1)
  return lo, jnp.maximum(lo, hi)


def query_blocks(plan: AttentionPlan, sh: Shapes, j):
  """``[lo, hi)``: the query blocks holding an unmasked row for key block `j`'s own columns
  ``[j block_k, min((j + 1) block_k, S))``."""
  n = -(-sh.q_len // plan.block_q)
  right, left = plan.right, plan.left
  if right is None and left is None:
    return 0, n
  u0 = j * plan.block_k
  u1 = jnp.minimum(u0 + plan.block_k, sh.kv_len) - 1
  lo, hi = jnp.int32(0), jnp.int32(n)
  if right is not None:
    lo = jnp.clip(u0 - right, 0, sh.q_len) // plan.block_q
  if left is not None:
    last = u1 + left
    hi = jnp.minimum(last, sh.q_len - 1) // plan.block_q + 1
  return jnp.minimum(lo, n), jnp.maximum(jnp.minimum(lo, n), hi)


def sliced(a: Array | None, axis_starts: dict[int, Any], sizes: dict[int, int]):
  """`a` sliced at ``axis_starts`` (axis -> start) with ``sizes``, axes of size 1 kept whole
  (broadcast operands such as a (1, 1, T, S) bias)."""
  if a is None:
    return None
  starts = [jnp.int32(0)] * a.ndim
  shape = list(a.shape)
  for axis, start in axis_starts.items():
    if a.shape[axis] != 1:
      starts[axis], shape[axis] = jnp.asarray(start, jnp.int32), sizes[axis]
  return lax.dynamic_slice(a, starts, shape)


@dataclasses.dataclass(frozen=True)
class Inputs:
  """The operands in the blocks' layouts: q (B, T, K, G, H); k, v (B, S, K, H); bias and mask
  (B|1, K|1, G|1, T|1, S|1); the rest as :class:`.plan.Aux` holds them."""

  q: Array
  k: Array
  v: Array
  bias: Array | None
  mask: Array | None
  q_lengths: Array | None
  kv_lengths: Array | None
  q_segments: Array | None
  kv_segments: Array | None
  key_data: Array | None


def grouped(a: Array | None, sh: Shapes) -> Array | None:
  """A (B|1, N|1, T|1, S|1) bias or mask as (B|1, K|1, G|1, T|1, S|1)."""
  if a is None:
    return None
  b, n, t, s = a.shape
  if n == 1:
    return a.reshape(b, 1, 1, t, s)
  return a.reshape(b, sh.kv_heads, sh.groups, t, s)


class Block(NamedTuple):
  """One block of logits (B, K, G, bq, bk) and what the passes read with it."""

  s: Array  # the logits, in [floor, max] where (t, u) counts; the float's lowest value elsewhere
  slope: Array | None  # ds / d(scale q.k): 0 where clipped, the cap's 1 - (z / c)^2; backward only


def logits(plan: AttentionPlan, sh: Shapes, x: Inputs, q_blk, k_blk, q0, k0, i, j, *, backward):
  """One :class:`Block`: ``c tanh(scale q.k / c) + bias``, ``scale q.k`` clipped to the float
  range first (a clipped logit's derivative is 0), masked by every mask of the call."""
  acc = plan.acc_dtype
  shift = _shift(plan, q_blk, k_blk)
  if shift is not None:  # the rows scaled down by 2**shift (B, bq, K, G): no product overflows
    half = (shift // 2)[..., None]
    q_blk = q_blk * _pow2(-half, q_blk.dtype) * _pow2(half - shift[..., None], q_blk.dtype)
    shift = jnp.transpose(shift, (0, 2, 3, 1))[..., None]  # as z's rows, (B, K, G, bq, 1)
  z = jnp.einsum(
    "btkgh,bskh->bkgts", q_blk, k_blk, preferred_element_type=acc, precision=plan.precision
  )
  z = z * jnp.asarray(plan.scale, acc)
  high, low = np.finfo(acc).max, floor(acc)
  if shift is not None:  # the float's range in the rows' units
    high, low = (jnp.ldexp(jnp.asarray(a, acc), -shift) for a in (high, low))
  slope = None
  if backward:
    slope = jnp.abs(z) <= high  # scale q.k beyond the float: clipped below, derivative 0
  z = jnp.clip(z, low, high)  # finite logits, whatever q . k is
  if shift is not None:  # in two halves: 2**shift alone may be past the float
    half = shift // 2
    z = z * _pow2(half, acc) * _pow2(shift - half, acc)
  if plan.soft_cap is not None:
    c = jnp.asarray(plan.soft_cap, acc)
    y = z / c
    # Where |y| < sqrt(eps) / 2, c tanh(y) is z to the last bit, and y under a cap near the
    # float's largest would fall below its least normal number (flushed to 0 on CPUs and GPUs).
    z = jnp.where(jnp.abs(y) < np.sqrt(np.finfo(acc).eps) / 2, z, c * jnp.tanh(y))
    if backward:
      slope = jnp.where(slope, 1 - jnp.square(z / c), 0)
  bq, bk = plan.block_q, plan.block_k
  rows = q0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, bk), 3)
  cols = k0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, bk), 4)
  valid = cols >= j * bk  # the columns a moved-back last block shares with the one before
  if backward:
    valid &= rows >= i * bq
  if plan.causal:
    valid &= cols <= rows
  if plan.window is not None:
    left, right = plan.window
    valid &= (cols >= rows - left) & (cols <= rows + right)
  if x.q_lengths is not None:
    valid = valid & (rows < x.q_lengths[:, None, None, None, None])
  if x.kv_lengths is not None:
    valid = valid & (cols < x.kv_lengths[:, None, None, None, None])
  if x.q_segments is not None:  # packed sequences: a query sees the keys of its own segment
    seg_q = lax.dynamic_slice_in_dim(x.q_segments, q0, bq, 1)
    seg_k = lax.dynamic_slice_in_dim(x.kv_segments, k0, bk, 1)
    valid = valid & (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]
  if x.mask is not None:
    valid = valid & sliced(x.mask, {3: q0, 4: k0}, {3: bq, 4: bk})
  if x.bias is not None:
    z = z + sliced(x.bias, {3: q0, 4: k0}, {3: bq, 4: bk}).astype(acc)
    valid = valid & (z > -jnp.inf)  # a bias of -inf masks
    z = jnp.clip(z, floor(acc), np.finfo(acc).max)
  return Block(jnp.where(valid, z, jnp.finfo(acc).min), slope)


def _shift(plan: AttentionPlan, q_blk: Array, k_blk: Array) -> Array | None:
  """The power of two (B, bq, K, G) each query row of the block is scaled down by so that no
  product ``scale q_h k_h`` nor their sum overflows (``inf - inf`` is NaN): 0 unless the row's and
  the block's largest ``|q|``, ``|k|`` could; None where the dtypes rule overflow out."""
  acc, h = np.finfo(plan.acc_dtype), q_blk.shape[-1]
  # |scale q.k| < 2**(e_q + e_k + bits), e_q and e_k the exponents of the largest |q| and |k|
  bits = (h - 1).bit_length() + max(0, math.frexp(plan.scale)[1])
  if 2 * jnp.finfo(q_blk.dtype).maxexp + bits < acc.maxexp:
    return None
  _, e_q = jnp.frexp(jnp.max(jnp.abs(q_blk), -1).astype(acc.dtype))  # |q| < 2**e_q
  _, e_k = jnp.frexp(jnp.max(jnp.abs(k_blk), (1, 3)).astype(acc.dtype))  # (B, K)
  return jnp.maximum(e_q + e_k[:, None, :, None] + (bits + 1 - acc.maxexp), 0)


def _pow2(n: Array, dtype) -> Array:
  """``2**n`` in `dtype`, exact (``n`` within its exponents)."""
  return jnp.ldexp(jnp.ones((), dtype), n)


def floor(dtype) -> np.ndarray:
  """The least logit that counts: one float above the lowest, which marks masked logits."""
  return np.nextafter(np.finfo(dtype).min, 0, dtype=dtype)


def keep_mask(plan: AttentionPlan, sh: Shapes, x: Inputs, q0, k0) -> Array:
  """The dropout keep mask of one block, broadcastable to (B, K, G, bq, bk): Flax's
  ``bernoulli(key, 1 - rate, shape)`` over (1, 1, T, S) (broadcast) or (B, N, T, S), drawn from
  each element's linear index (:func:`jaxact._src.core.dropout.keep_from_index`)."""
  bq, bk = plan.block_q, plan.block_k
  t = (q0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, bk), 3)).astype(jnp.uint32)
  u = (k0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, bk), 4)).astype(jnp.uint32)
  index = t * np.uint32(sh.kv_len) + u
  if not plan.broadcast_dropout:
    shape = (sh.batch, sh.kv_heads, sh.groups, 1, 1)
    head = (
      lax.broadcasted_iota(jnp.uint32, shape, 0) * np.uint32(sh.kv_heads * sh.groups)
      + lax.broadcasted_iota(jnp.uint32, shape, 1) * np.uint32(sh.groups)
      + lax.broadcasted_iota(jnp.uint32, shape, 2)
    )
    index = head * np.uint32(sh.q_len * sh.kv_len) + index
  return keep_from_index(x.key_data, plan.dropout.keep, index)


def shapes(q: Array, k: Array) -> Shapes:
  b, t, kv_heads, g, _ = q.shape
  return Shapes(b, t, k.shape[1], kv_heads, g)
