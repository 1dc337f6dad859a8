"""Attention that keeps q, k, v, its output and two numbers a row: FlashAttention-2 forward and
backward as Pallas kernels (Triton backend, sm80+).

Layout as ``jax.nn.dot_product_attention``: q ``(B, T, N, H)``, k and v ``(B, S, K, H)`` with K
dividing N (query head ``n`` reads kv head ``n // (N // K)``: grouped and multi-query attention);
the output o ``(B, T, N, H)`` in q's dtype and each row's statistics, stats ``(B, N, 2, T)``
float32: the row's largest ``z`` (``s = unit * z``:
:class:`~pallas_kernels.attention_triton_kernels.Logits`) and
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

from pallas_kernels._triton import DTYPES, CompilerParams, allow_tf32, pl, slots
from pallas_kernels.attention_triton_kernels import Logits, Mask, dkv_kernel, dq_kernel, fwd_kernel
from pallas_kernels.attention_triton_tiles import (
  HEAD_DIMS,
  AttentionBlockConfig,
  AttentionTiles,
  block_config,
)

__all__ = [
  "AttentionBlockConfig",
  "AttentionTiles",
  "attention_backward",
  "attention_forward",
  "attention_mask",
  "attention_reference",
  "attention_unsupported",
  "block_config",
]


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
  if h not in HEAD_DIMS:
    return (
      f"head dimension {h} (the kernels take one tile of a power of two from 16 to 256: "
      f"{', '.join(map(str, HEAD_DIMS))})"
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
    mask=Mask.of(causal, window, q.shape[1], k.shape[1]),
    logits=Logits(float(scale), None if soft_cap is None else float(soft_cap)),
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

  `block_q`, `block_k`, `num_warps`, `num_stages` replace :func:`block_config`'s choice for the
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
  default = block_config(q.shape, k.shape, q.dtype).fwd
  tiles = _tiles(default, block_q, block_k, num_warps, num_stages, name)
  static = _static(
    q, k, scale=scale, causal=causal, window=window, soft_cap=soft_cap, precision=precision
  )
  lengths = (_lengths(q_lengths), _lengths(kv_lengths))
  kernel = slots(
    fwd_kernel,
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

  `block_q`, `block_k`, `num_warps`, `num_stages` replace :func:`block_config`'s choice for both
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
  cfg = block_config(q.shape, k.shape, q.dtype)
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
    slots(dq_kernel, (*present, True), tiles=dq_tiles, **static),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    grid=(pl.cdiv(t, dq_tiles.block_q), b, n),
    compiler_params=_params(dq_tiles),
    interpret=interpret,
    name="jaxact_attention_bwd_dq",
  )(*args)
  dk, dv = pl.pallas_call(
    slots(dkv_kernel, (*present, True, True), tiles=dkv_tiles, **static),
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
  valid = Mask.of(causal, window, t, s).valid(rows, cols, s)[None, None]
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
