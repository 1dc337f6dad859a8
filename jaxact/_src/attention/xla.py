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
lies beyond the float range its logit is clipped there, and ``ds/dz`` is 0; a query row whose
products could overflow is scaled by a power of two first (:mod:`.xla_blocks`), so that a logit
that fits is exact. Where P is exactly 1 (a one-hot row) ``dS`` is 0.

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

import jax.numpy as jnp
from jax import Array, lax

from jaxact._src.attention.plan import AttentionPlan, Aux
from jaxact._src.attention.xla_blocks import (
  Inputs,
  Shapes,
  floor,
  grouped,
  keep_mask,
  key_blocks,
  logits,
  query_blocks,
  shapes,
  sliced,
  start,
)
from jaxact._src.core.barriers import zeros_from
from jaxact._src.core.numerics import exp_diff

# ---------------------------------------------------------------------------- forward


def forward(plan: AttentionPlan, x: Inputs) -> tuple[Array, Array]:
  """``(O, stats)``: O (B, T, K, G, Hv) in q's dtype; stats (B, K, G, 2, T) in the accumulation
  dtype, each row's largest logit ``m`` then ``l = log sum exp(s - m)`` (0 and 0 without keys)."""
  sh = shapes(x.q, x.k)
  acc, bq, bk = plan.acc_dtype, plan.block_q, plan.block_k
  b, kh, g, hv = sh.batch, sh.kv_heads, sh.groups, x.v.shape[-1]
  n_q = -(-sh.q_len // bq)

  def q_block(i, carry):
    o, stats = carry
    q0 = start(i, bq, sh.q_len)
    q_blk = lax.dynamic_slice_in_dim(x.q, q0, bq, 1)

    def k_block(j, state):
      m, denom, o_acc = state
      k0 = start(j, bk, sh.kv_len)
      k_blk = lax.dynamic_slice_in_dim(x.k, k0, bk, 1)
      v_blk = lax.dynamic_slice_in_dim(x.v, k0, bk, 1)
      blk = logits(plan, sh, x, q_blk, k_blk, q0, k0, i, j, backward=False)
      m_new = jnp.maximum(m, jnp.max(blk.s, -1))
      p = jnp.exp(blk.s - m_new[..., None])  # 0 where masked
      alpha = exp_diff(m, m_new)
      denom = alpha * denom + jnp.sum(p, -1)
      if plan.dropout is not None:
        keep = keep_mask(plan, sh, x, q0, k0)
        p = jnp.where(keep, p * jnp.asarray(1 / plan.dropout.keep, acc), 0)
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
    init = (rows + floor(acc), rows, jnp.broadcast_to(rows[..., None], (b, kh, g, bq, hv)))
    lo, hi = key_blocks(plan, sh, q0)
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
  """``fori_loop(lo, hi, body, init)``, the body called once in place when there is one step.

  The bounds go in as traced integers: a while loop. With static bounds ``fori_loop`` is a
  ``scan``, and under ``jax.checkpoint`` the step then kept the blocks' intermediates (about four
  arrays a layer where the checkpoint keeps its input: tests/attention/test_attention_remat.py)."""
  if isinstance(lo, int) and isinstance(hi, int) and hi - lo == 1:
    return body(lo, init)
  return lax.fori_loop(jnp.int32(lo), jnp.int32(hi), body, init)


# --------------------------------------------------------------------------- backward


def backward(plan: AttentionPlan, x: Inputs, o: Array, stats: Array, do: Array):
  """``(dq, dk, dv, dbias)`` from O, the forward's `stats` and the cotangent dO, in the operands'
  layouts (dq (B, T, K, G, H), dbias like the grouped bias, None without one)."""
  sh = shapes(x.q, x.k)
  acc, bq, bk = plan.acc_dtype, plan.block_q, plan.block_k
  n_k = -(-sh.kv_len // bk)
  row_max, log_sum = stats[:, :, :, 0], stats[:, :, :, 1]

  def k_block(j, carry):
    dq, dk, dv, dbias = carry
    k0 = start(j, bk, sh.kv_len)
    k_blk = lax.dynamic_slice_in_dim(x.k, k0, bk, 1)
    v_blk = lax.dynamic_slice_in_dim(x.v, k0, bk, 1)

    def q_block(i, state):
      dq, dk_j, dv_j, dbias = state
      q0 = start(i, bq, sh.q_len)
      q_blk = lax.dynamic_slice_in_dim(x.q, q0, bq, 1)
      do_blk = lax.dynamic_slice_in_dim(do, q0, bq, 1)
      blk = logits(plan, sh, x, q_blk, k_blk, q0, k0, i, j, backward=True)
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
        keep = keep_mask(plan, sh, x, q0, k0)
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
      # d loss / d s. Where P is exactly 1 the row is one-hot and dS is 0: dP - D is then only
      # rounding (D from the stored O), which q or k rows of 1e30 would make a gradient of 1e22.
      ds = jnp.where(p == 1, 0, p * (dp - d_blk[..., None]))
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
    lo, hi = query_blocks(plan, sh, j)
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
  old = sliced(dbias, {3: q0, 4: k0}, sizes)
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


def _grouped_inputs(q, k, v, bias, aux: Aux) -> Inputs:
  """jax.nn's layouts (q (B, T, N, H), k and v (B, S, K, H), bias and mask (B|1, N|1, T|1,
  S|1)) as the blocks read them: reshapes only, free under jit."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  sh = Shapes(b, t, k.shape[1], kv_heads, n // kv_heads)
  q5 = q.reshape(b, t, kv_heads, n // kv_heads, h)
  a = aux
  return Inputs(
    q5,
    k,
    v,
    grouped(bias, sh),
    grouped(a.mask, sh),
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
