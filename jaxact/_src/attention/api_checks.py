"""The argument checks of :func:`jaxact.dot_product_attention`, and the :class:`.plan.Call` they
give: every error names the function, the argument, the value and what is accepted."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxact._src.attention.plan import AttentionPlan, Aux, Call, default_blocks
from jaxact._src.core import args, dispatch, dropout, validation

FN = "dot_product_attention"


def _err(msg: str) -> str:
  return f"jaxact.{FN}: {msg}"


def _operands(query, key, value) -> tuple[Array, Array, Array, bool]:
  """q, k, v as 4-d arrays, checked; and whether they came without a batch axis (3-d)."""
  q, k, v = (
    validation.as_real_array(FN, a, n)
    for a, n in ((query, "query"), (key, "key"), (value, "value"))
  )
  for a, name in ((q, "query"), (k, "key"), (v, "value")):
    if not validation.is_floating(a.dtype):
      raise TypeError(
        _err(f"`{name}` has dtype {a.dtype}; accepted: float16, bfloat16, float32 or float64")
      )
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(
      _err(
        f"`query`, `key` and `value` must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype} "
        "(cast them first, as jax.nn requires too)"
      )
    )
  shapes = f"query.shape={q.shape}, key.shape={k.shape}, value.shape={v.shape}"
  if q.ndim not in (3, 4) or not q.ndim == k.ndim == v.ndim:
    raise ValueError(
      _err(
        "`query`, `key` and `value` must all be 4-d (batch, length, heads, head_dim) or all 3-d "
        f"(length, heads, head_dim); got {shapes}"
      )
    )
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(_err(f"`key` and `value` must agree in batch, length and heads; got {shapes}"))
  if q.shape[0] != k.shape[0]:
    raise ValueError(_err(f"`query` and `key` have different batch sizes ({shapes})"))
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(_err(f"`query` and `key` have different head dims ({shapes})"))
  n, kv_heads = q.shape[2], k.shape[2]
  if kv_heads == 0 or n % kv_heads:
    raise ValueError(
      _err(
        f"`query` has {n} heads, which is not a multiple of `key`'s {kv_heads} (grouped-query "
        f"attention needs N % K == 0; {shapes})"
      )
    )
  return q, k, v, unbatched


def _map(arr, name: str, full: tuple[int, int, int, int], kind: str) -> Array | None:
  """A bias or mask broadcastable to (B, N, T, S), as a 4-d array of sizes 1 or full."""
  if arr is None:
    return None
  a = validation.as_real_array(FN, arr, name)
  if kind == "mask" and a.dtype != jnp.bool_:
    raise TypeError(
      _err(
        f"`mask` has dtype {a.dtype}; accepted: bool (True attends; an additive mask goes in "
        "`bias`)"
      )
    )
  if kind == "bias" and not validation.is_floating(a.dtype):
    raise TypeError(_err(f"`bias` has dtype {a.dtype}; accepted: a floating-point dtype"))
  if a.ndim > 4:
    raise ValueError(_err(f"`{name}` has rank {a.ndim}; accepted: rank <= 4, (B, N, T, S)"))
  a = a.reshape((1,) * (4 - a.ndim) + a.shape)
  if any(d not in (1, f) for d, f in zip(a.shape, full, strict=True)):
    raise ValueError(
      _err(
        f"`{name}` has shape {a.shape}, which does not broadcast to (batch, heads, q_len, "
        f"kv_len) = {full}"
      )
    )
  return a


def _lengths(arr, name: str, batch: int) -> Array | None:
  if arr is None:
    return None
  a = validation.as_real_array(FN, arr, name)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError(_err(f"`{name}` has dtype {a.dtype}; accepted: an integer dtype"))
  if a.shape != (batch,):
    raise ValueError(_err(f"`{name}` has shape {a.shape}; accepted: ({batch},), one a batch row"))
  return a.astype(jnp.int32)


def _segments(q_ids, kv_ids, b: int, t: int, s: int) -> tuple[Array | None, Array | None]:
  """Segment ids, (B, T) and (B, S) int32; one given alone serves both when T == S."""
  if q_ids is None and kv_ids is None:
    return None, None
  if kv_ids is None or q_ids is None:
    if t != s:
      given = "query_segment_ids" if kv_ids is None else "key_value_segment_ids"
      raise ValueError(
        _err(f"`{given}` alone serves both sides only when T == S (T={t}, S={s}); pass both")
      )
    q_ids = kv_ids if q_ids is None else q_ids
    kv_ids = q_ids if kv_ids is None else kv_ids
  out = []
  for ids, name, n in ((q_ids, "query_segment_ids", t), (kv_ids, "key_value_segment_ids", s)):
    a = validation.as_real_array(FN, ids, name)
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise TypeError(_err(f"`{name}` has dtype {a.dtype}; accepted: an integer dtype"))
    if a.shape != (b, n):
      raise ValueError(_err(f"`{name}` has shape {a.shape}; accepted: ({b}, {n})"))
    out.append(a.astype(jnp.int32))
  return out[0], out[1]


def _window(window) -> tuple[int, int] | None:
  if window is None:
    return None
  pair = (window, window) if isinstance(window, (int, np.integer)) else window
  ok = (
    isinstance(pair, (tuple, list))
    and len(pair) == 2
    and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0 for w in pair)
  )
  if not ok:
    raise ValueError(
      _err(
        f"`local_window_size` is {window!r}; accepted: None, an int >= 0, or a pair (left, "
        "right) of ints >= 0"
      )
    )
  return int(pair[0]), int(pair[1])


def _static_float(name: str, value, *, positive: bool) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(_err(f"`{name}` must be a Python float; got {type(value).__name__} {value!r}"))
  v = float(value)
  if not math.isfinite(v) or (positive and v <= 0):
    raise ValueError(
      _err(f"`{name}` is {value!r}; accepted: a finite number" + (" > 0" if positive else ""))
    )
  return v


def _held(name: str, value: float, acc: np.dtype, *, cap: bool) -> float:
  """`value` where the logits' dtype `acc` holds it: a soft cap as a normal number (``z / c`` and
  ``c tanh`` of a subnormal or infinite cap make NaN), a scale within the float's range."""
  tiny, high = float(np.finfo(acc).tiny), float(np.finfo(acc).max)
  if tiny <= value <= high if cap else abs(value) <= high:
    return value
  accepted = f"from {tiny:.4g} to {high:.4g}" if cap else f"at most {high:.4g} in magnitude"
  raise ValueError(
    _err(
      f"`{name}` is {value!r}, which {acc.name}, the logits' dtype, does not hold; accepted: "
      f"{accepted}"
    )
  )


def blocks(block_sizes, heads: int, t, s, head_dim: int) -> tuple:
  """The XLA path's blocks, at most T by S (symbolic where T or S is)."""
  if block_sizes is None:
    return default_blocks(heads, t, s, head_dim=head_dim, gpu=dispatch.target().accelerator)
  ok = (
    isinstance(block_sizes, (tuple, list))
    and len(block_sizes) == 2
    and all(
      isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in block_sizes
    )
  )
  if not ok:
    raise ValueError(
      _err(f"`block_sizes` is {block_sizes!r}; accepted: None or (block_q, block_k), ints > 0")
    )
  return args.dim_min(int(block_sizes[0]), t), args.dim_min(int(block_sizes[1]), s)


def _dropout(rate, rng, broadcast: bool, full: tuple[int, int, int, int]):
  """``(Dropout or None, the key's raw data or None)``: Flax's attention dropout, checked."""
  drop, key_data = dropout.check(FN, rate, rng, (), 4)
  if drop is not None:
    if not drop.threefry:
      raise NotImplementedError(
        _err(
          f"dropout with a {drop.impl} key: attention draws its mask block by block, which "
          "jaxact does for threefry keys (jax's default) only"
        )
      )
    b, n, t, s = full
    drawn = t * s if broadcast else b * n * t * s
    if drawn >= 2**32:
      raise NotImplementedError(
        _err(f"dropout over {drawn} elements (>= 2**32, where jax draws 64-bit counters)")
      )
  return drop, key_data


def call(
  query,
  key,
  value,
  bias,
  mask,
  *,
  scale,
  is_causal,
  query_seq_lengths,
  key_value_seq_lengths,
  local_window_size,
  logits_soft_cap,
  query_segment_ids,
  key_value_segment_ids,
  dropout_rate,
  dropout_rng,
  broadcast_dropout,
  precision,
) -> tuple[Call, bool]:
  """The public arguments checked, as one :class:`.plan.Call` (4-d operands, the static plan and
  the arrays without gradients), and whether the operands came without a batch axis."""
  q, k, v, unbatched = _operands(query, key, value)
  b, t, n, h = q.shape
  s = k.shape[1]
  full = (b, n, t, s)
  bias = _map(bias, "bias", full, "bias")
  mask = _map(mask, "mask", full, "mask")
  q_len = _lengths(query_seq_lengths, "query_seq_lengths", b)
  kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b)
  seg_ids = [query_segment_ids, key_value_segment_ids]
  if unbatched:  # (T,) and (S,) for unbatched inputs
    seg_ids = [i[None] if i is not None and np.ndim(i) == 1 else i for i in seg_ids]
  q_seg, kv_seg = _segments(*seg_ids, b, t, s)
  window = _window(local_window_size)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(_err(f"`is_causal` must be a bool; got {is_causal!r}"))
  acc = np.dtype(validation.compute_dtype(q.dtype))
  cap = None
  if logits_soft_cap is not None:
    cap = _static_float("logits_soft_cap", logits_soft_cap, positive=True)
    cap = _held("logits_soft_cap", cap, acc, cap=True)
  if scale is not None:
    scale = _held("scale", _static_float("scale", scale, positive=False), acc, cap=False)
  scale = 1 / math.sqrt(h) if scale is None and h else 1.0 if scale is None else scale
  drop, key_data = _dropout(dropout_rate, dropout_rng, broadcast_dropout, full)
  plan = AttentionPlan(
    scale=scale,
    causal=bool(is_causal),
    window=window,
    soft_cap=cap,
    dropout=drop,
    broadcast_dropout=bool(broadcast_dropout),
    precision=args.hashable_precision(precision),
    acc_dtype=acc,
  )
  aux = Aux(mask, q_len, kv_len, q_seg, kv_seg, key_data)
  return Call(plan, q, k, v, bias, aux), unbatched
