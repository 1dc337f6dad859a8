"""The ``custom_vjp`` of :func:`jaxact.dot_product_attention` and its blocked XLA path.

For query rows ``t`` and key columns ``u`` of one head, with logits accumulated in float32 (float64
for float64 inputs),

    s = c tanh(scale q_t . k_u / c) + bias,   over the (t, u) that the masks leave,
    P = softmax_u(s),   O_t = sum_u P[t, u] v_u   (dropout: P * keep / (1 - rate)),

the op keeps ``q``, ``k``, ``v``, ``O`` and two numbers a (row, head): the row's largest logit
``m_t`` and ``l_t = log sum_u exp(s[t, u] - m_t)``, never an array of shape (T, S)
(FlashAttention's idea: the softmax's output O and its normaliser are all its backward needs). The
two are kept apart, not as one ``lse = m + l``: for a row of logits near -1e9 float32 rounds ``l``
(a few units) away from ``m`` and the backward's probabilities would be off by ``exp(l)``. The
backward pass recomputes ``P = exp(s - m - l)`` block by block in FlashAttention-2's order (key
blocks outside, query blocks inside) and forms

    dP = dO vᵀ,   dS = P (dP - D),   D_t = sum_h dO[t, h] O[t, h],

then ``dq = scale dS k ds/dz``, ``dk = scale dSᵀ q ds/dz`` (summed over the query heads of a
group), ``dv = Pᵀ dO``, ``dbias = dS`` summed over the bias's broadcast axes. Where ``scale q . k``
lies beyond the float range its logit is clipped there, and ``ds/dz`` is 0.

Blocks: the forward loops over query blocks and, inside, over the key blocks that hold an
unmasked (t, u) for the causal mask and the window, with an online softmax (running max and sum);
blocks wholly outside are never visited. A last block that would run past T (or S) starts earlier
instead (the same block shape throughout); the rows (columns) it shares with the block before are
masked where counting them twice would be wrong. A row that sees no key keeps ``m = l = 0``, gives
O = 0 and zero gradients.

No infinity is made from finite operands (``jax.debug_infs`` stays quiet): masked logits are the
float's lowest finite value, one step below any logit that counts (those are clipped to the next
float up), and the running maximum starts at that next float, so that ``exp(masked - max)`` is
``exp(-2e31) = 0`` where ``exp(-inf)`` was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxact._src.attention.plan import AttentionPlan, Aux
from jaxact._src.core.barriers import zeros_from
from jaxact._src.core.dropout import keep_from_index
from jaxact._src.core.numerics import exp_diff

# ----------------------------------------------------------------------------- the blocks


@dataclasses.dataclass(frozen=True)
class _Shapes:
  batch: int
  q_len: int
  kv_len: int
  kv_heads: int
  groups: int


def _start(index, block: int, length: int):
  """First row of block `index`: ``index * block``, moved back so the block ends by `length`."""
  return jnp.minimum(jnp.asarray(index, jnp.int32) * block, length - block)


def _key_blocks(plan: AttentionPlan, sh: _Shapes, q0):
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


def _query_blocks(plan: AttentionPlan, sh: _Shapes, j):
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


def _slice(a: Array | None, axis_starts: dict[int, Any], sizes: dict[int, int]):
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
class _Inputs:
  """The operands in the blocks' layouts: q (B, T, K, G, H); k, v (B, S, K, H); bias and mask
  (B|1, K|1, G|1, T|1, S|1); the rest as :class:`Aux` holds them."""

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


def _grouped(a: Array | None, sh: _Shapes) -> Array | None:
  """A (B|1, N|1, T|1, S|1) bias or mask as (B|1, K|1, G|1, T|1, S|1)."""
  if a is None:
    return None
  b, n, t, s = a.shape
  if n == 1:
    return a.reshape(b, 1, 1, t, s)
  return a.reshape(b, sh.kv_heads, sh.groups, t, s)


class _Block(NamedTuple):
  """One block of logits (B, K, G, bq, bk) and what the passes read with it."""

  s: Array  # the logits, in [_floor, max] where (t, u) counts; the float's lowest value elsewhere
  slope: Array | None  # ds / d(scale q.k): 0 where clipped, the cap's 1 - (z / c)^2; backward only


def _logits(plan: AttentionPlan, sh: _Shapes, x: _Inputs, q_blk, k_blk, q0, k0, i, j, *, backward):
  """One :class:`_Block`: ``c tanh(scale q.k / c) + bias``, ``scale q.k`` clipped to the float
  range first (a clipped logit's derivative is 0), masked by every mask of the call."""
  acc = plan.acc_dtype
  z = jnp.einsum(
    "btkgh,bskh->bkgts", q_blk, k_blk, preferred_element_type=acc, precision=plan.precision
  )
  fmax = jnp.finfo(acc).max
  z = z * jnp.asarray(plan.scale, acc)
  slope = None
  if backward:
    slope = jnp.abs(z) <= fmax  # scale q.k overflowed: clipped below, derivative 0
  z = jnp.clip(z, _floor(acc), fmax)  # finite logits, whatever q . k is
  if plan.soft_cap is not None:
    c = jnp.asarray(plan.soft_cap, acc)
    z = c * jnp.tanh(z / c)
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
    valid = valid & _slice(x.mask, {3: q0, 4: k0}, {3: bq, 4: bk})
  if x.bias is not None:
    z = z + _slice(x.bias, {3: q0, 4: k0}, {3: bq, 4: bk}).astype(acc)
    valid = valid & (z > -jnp.inf)  # a bias of -inf masks
    z = jnp.clip(z, _floor(acc), fmax)
  return _Block(jnp.where(valid, z, jnp.finfo(acc).min), slope)


def _floor(dtype) -> np.ndarray:
  """The least logit that counts: one float above the lowest, which marks masked logits."""
  return np.nextafter(np.finfo(dtype).min, 0, dtype=dtype)


def _keep(plan: AttentionPlan, sh: _Shapes, x: _Inputs, q0, k0) -> Array:
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


def _shapes(q: Array, k: Array) -> _Shapes:
  b, t, kv_heads, g, _ = q.shape
  return _Shapes(b, t, k.shape[1], kv_heads, g)


# ---------------------------------------------------------------------------- forward


def forward(plan: AttentionPlan, x: _Inputs) -> tuple[Array, Array]:
  """``(O, stats)``: O (B, T, K, G, Hv) in q's dtype; stats (B, K, G, 2, T) in the accumulation
  dtype, each row's largest logit ``m`` then ``l = log sum exp(s - m)`` (0 and 0 without keys)."""
  sh = _shapes(x.q, x.k)
  acc, bq, bk = plan.acc_dtype, plan.block_q, plan.block_k
  b, kh, g, hv = sh.batch, sh.kv_heads, sh.groups, x.v.shape[-1]
  n_q = -(-sh.q_len // bq)

  def q_block(i, carry):
    o, stats = carry
    q0 = _start(i, bq, sh.q_len)
    q_blk = lax.dynamic_slice_in_dim(x.q, q0, bq, 1)

    def k_block(j, state):
      m, denom, o_acc = state
      k0 = _start(j, bk, sh.kv_len)
      k_blk = lax.dynamic_slice_in_dim(x.k, k0, bk, 1)
      v_blk = lax.dynamic_slice_in_dim(x.v, k0, bk, 1)
      blk = _logits(plan, sh, x, q_blk, k_blk, q0, k0, i, j, backward=False)
      m_new = jnp.maximum(m, jnp.max(blk.s, -1))
      p = jnp.exp(blk.s - m_new[..., None])  # 0 where masked
      alpha = exp_diff(m, m_new)
      denom = alpha * denom + jnp.sum(p, -1)
      if plan.dropout is not None:
        p = jnp.where(_keep(plan, sh, x, q0, k0), p * jnp.asarray(1 / plan.dropout.keep, acc), 0)
      pv = jnp.einsum(
        "bkgts,bskh->bkgth",
        p.astype(x.v.dtype),
        v_blk,
        preferred_element_type=acc,
        precision=plan.precision,
      )
      return m_new, denom, alpha[..., None] * o_acc + pv

    # Made from the block's queries (barriers.zeros_from): with one query block this runs outside
    # any loop, and zeros made of nothing would be hoisted out of a scan over layers.
    rows = zeros_from(jnp.transpose(q_blk[..., 0], (0, 2, 3, 1)), acc)  # (B, K, G, bq)
    init = (rows + _floor(acc), rows, jnp.broadcast_to(rows[..., None], (b, kh, g, bq, hv)))
    lo, hi = _key_blocks(plan, sh, q0)
    m, denom, o_acc = _loop(lo, hi, k_block, init)
    empty = denom == 0
    zero = zeros_from(denom)  # a scalar 0 would be broadcast, and hoisted out of a scan
    denom = jnp.where(empty, zero + 1, denom)
    o_blk = jnp.where(empty[..., None], zero[..., None], o_acc / denom[..., None])
    stats_blk = jnp.stack([jnp.where(empty, zero, m), jnp.log(denom)], axis=3)
    o_blk = jnp.transpose(o_blk.astype(x.q.dtype), (0, 3, 1, 2, 4))  # (B, bq, K, G, Hv)
    o = lax.dynamic_update_slice_in_dim(o, o_blk, q0, 1)
    stats = lax.dynamic_update_slice_in_dim(stats, stats_blk, q0, 4)
    return o, stats

  rows = zeros_from(x.q[..., :1])  # (B, T, K, G, 1): made in the step (barriers.zeros_from)
  init = (
    jnp.broadcast_to(rows, (b, sh.q_len, kh, g, hv)),
    jnp.broadcast_to(jnp.transpose(rows, (0, 2, 3, 4, 1)).astype(acc), (b, kh, g, 2, sh.q_len)),
  )
  return _loop(0, n_q, q_block, init)


def _loop(lo, hi, body, init):
  """``fori_loop(lo, hi, body, init)``, the body called once in place when there is one step."""
  if isinstance(lo, int) and isinstance(hi, int) and hi - lo == 1:
    return body(lo, init)
  return lax.fori_loop(lo, hi, body, init)


# --------------------------------------------------------------------------- backward


def backward(plan: AttentionPlan, x: _Inputs, o: Array, stats: Array, do: Array):
  """``(dq, dk, dv, dbias)`` from O, the forward's `stats` and the cotangent dO, in the operands'
  layouts (dq (B, T, K, G, H), dbias like the grouped bias, None without one)."""
  sh = _shapes(x.q, x.k)
  acc, bq, bk = plan.acc_dtype, plan.block_q, plan.block_k
  n_k = -(-sh.kv_len // bk)
  row_max, log_sum = stats[:, :, :, 0], stats[:, :, :, 1]

  def k_block(j, carry):
    dq, dk, dv, dbias = carry
    k0 = _start(j, bk, sh.kv_len)
    k_blk = lax.dynamic_slice_in_dim(x.k, k0, bk, 1)
    v_blk = lax.dynamic_slice_in_dim(x.v, k0, bk, 1)

    def q_block(i, state):
      dq, dk_j, dv_j, dbias = state
      q0 = _start(i, bq, sh.q_len)
      q_blk = lax.dynamic_slice_in_dim(x.q, q0, bq, 1)
      do_blk = lax.dynamic_slice_in_dim(do, q0, bq, 1)
      blk = _logits(plan, sh, x, q_blk, k_blk, q0, k0, i, j, backward=True)
      m_blk = lax.dynamic_slice_in_dim(row_max, q0, bq, 3)[..., None]
      l_blk = lax.dynamic_slice_in_dim(log_sum, q0, bq, 3)[..., None]
      # D_t = sum_h dO O, the softmax's backward term, one number a (row, head) (B, K, G, bq):
      # formed a block at a time from the block's dO and O (h products a row, beside the block's
      # bq x bk logits). Formed once over whole arrays, XLA (for GPUs) first wrote float32
      # transposed copies of dO and O.
      o_blk = lax.dynamic_slice_in_dim(o, q0, bq, 1)
      d_blk = jnp.sum(do_blk.astype(acc) * o_blk.astype(acc), -1).transpose(0, 2, 3, 1)
      # s - m <= 0, but for a recomputed logit an ulp above the forward's (a huge exponent for
      # huge logits).
      p = jnp.exp(jnp.minimum(blk.s - m_blk, 0) - l_blk)
      dp = jnp.einsum(
        "btkgh,bskh->bkgts", do_blk, v_blk, preferred_element_type=acc, precision=plan.precision
      )
      p_v = p
      if plan.dropout is not None:
        keep = _keep(plan, sh, x, q0, k0)
        inv = jnp.asarray(1 / plan.dropout.keep, acc)
        p_v = jnp.where(keep, p * inv, 0)
        dp = jnp.where(keep, dp * inv, 0)
      dv_j = dv_j + jnp.einsum(
        "bkgts,btkgh->bskh",
        p_v.astype(do.dtype),
        do_blk,
        preferred_element_type=acc,
        precision=plan.precision,
      )
      ds = p * (dp - d_blk[..., None])  # d loss / d s
      if dbias is not None:
        dbias = _add_block(dbias, ds, q0, k0, plan)
      ds = ds * blk.slope if plan.soft_cap is not None else jnp.where(blk.slope, ds, 0)
      ds = (ds * jnp.asarray(plan.scale, acc)).astype(x.q.dtype)
      dq_blk = jnp.einsum(
        "bkgts,bskh->btkgh", ds, k_blk, preferred_element_type=acc, precision=plan.precision
      )
      dq = lax.dynamic_update_slice_in_dim(
        dq, lax.dynamic_slice_in_dim(dq, q0, bq, 1) + dq_blk, q0, 1
      )
      dk_j = dk_j + jnp.einsum(
        "bkgts,btkgh->bskh", ds, q_blk, preferred_element_type=acc, precision=plan.precision
      )
      return dq, dk_j, dv_j, dbias

    # Made from the block's keys and values: with one key block this runs outside any loop.
    init = (dq, zeros_from(k_blk, acc), zeros_from(v_blk, acc), dbias)
    lo, hi = _query_blocks(plan, sh, j)
    dq, dk_j, dv_j, dbias = _loop(lo, hi, q_block, init)
    # Columns a moved-back last block shares with the one before got nothing here (masked).
    shared = (k0 + jnp.arange(bk) < j * bk)[None, :, None, None]
    dk = _write_block(dk, dk_j, k0, shared)
    dv = _write_block(dv, dv_j, k0, shared)
    return dq, dk, dv, dbias

  init = (  # made in the step, not hoisted out of a scan over layers (barriers.zeros_from)
    zeros_from(x.q, acc),
    zeros_from(x.k),
    zeros_from(x.v),
    None if x.bias is None else zeros_from(x.bias, acc),
  )
  dq, dk, dv, dbias = _loop(0, n_k, k_block, init)
  dbias = None if dbias is None else dbias.astype(x.bias.dtype)
  return dq.astype(x.q.dtype), dk, dv, dbias


def _write_block(buf: Array, blk: Array, k0, shared: Array) -> Array:
  """`blk` written over rows ``[k0, k0 + bk)`` of `buf`, but for the `shared` rows."""
  old = lax.dynamic_slice_in_dim(buf, k0, blk.shape[1], 1)
  return lax.dynamic_update_slice_in_dim(buf, jnp.where(shared, old, blk.astype(buf.dtype)), k0, 1)


def _add_block(dbias: Array, ds: Array, q0, k0, plan: AttentionPlan) -> Array:
  """``dbias += ds`` summed over the bias's broadcast (size 1) axes, at the block's place."""
  axes = tuple(d for d in range(5) if dbias.shape[d] == 1 and ds.shape[d] != 1)
  part = jnp.sum(ds, axes, keepdims=True) if axes else ds
  sizes = {3: plan.block_q, 4: plan.block_k}
  old = _slice(dbias, {3: q0, 4: k0}, sizes)
  zero = jnp.int32(0)
  starts = [
    zero,
    zero,
    zero,
    q0 if dbias.shape[3] != 1 else zero,
    k0 if dbias.shape[4] != 1 else zero,
  ]
  return lax.dynamic_update_slice(dbias, old + part, starts)


# ------------------------------------------------------------ jax.nn's layouts in and out


def _grouped_inputs(q, k, v, bias, aux: Aux) -> _Inputs:
  """jax.nn's layouts (q (B, T, N, H), k and v (B, S, K, H), bias and mask (B|1, N|1, T|1,
  S|1)) as the blocks read them: reshapes only, free under jit."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  sh = _Shapes(b, t, k.shape[1], kv_heads, n // kv_heads)
  q5 = q.reshape(b, t, kv_heads, n // kv_heads, h)
  a = aux
  return _Inputs(
    q5,
    k,
    v,
    _grouped(bias, sh),
    _grouped(a.mask, sh),
    a.q_lengths,
    a.kv_lengths,
    a.q_segments,
    a.kv_segments,
    a.key_data,
  )


def _ungrouped(o: Array) -> Array:
  b, t, kv_heads, g, h = o.shape
  return o.reshape(b, t, kv_heads * g, h)


def xla_forward(plan: AttentionPlan, q, k, v, bias, aux: Aux):
  """``(O (B, T, N, Hv), stats (B, N, 2, T))`` of the blocked XLA path."""
  o, stats = forward(plan, _grouped_inputs(q, k, v, bias, aux))
  b, _, _, _, t = stats.shape
  return _ungrouped(o), stats.reshape(b, -1, 2, t)


def xla_backward(plan: AttentionPlan, q, k, v, bias, aux: Aux, o, stats, do):
  x = _grouped_inputs(q, k, v, bias, aux)
  shape5 = (*x.q.shape[:-1], do.shape[-1])
  stats = stats.reshape(*x.q.shape[:1], *x.q.shape[2:4], *stats.shape[2:])  # (B, K, G, 2, T)
  dq, dk, dv, dbias = backward(plan, x, o.reshape(shape5), stats, do.reshape(shape5))
  dbias = None if dbias is None else dbias.reshape(bias.shape)
  return dq.reshape(q.shape), dk, dv, dbias
