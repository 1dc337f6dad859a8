"""The public op :func:`dot_product_attention`: arguments checked, the plan built, the backend
decided (:mod:`.rules`), the call run (:mod:`.xla`, or jax.nn's cuDNN path)."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from jaxact._src.attention import rules, sharding
from jaxact._src.attention.plan import AttentionPlan, Aux, default_blocks
from jaxact._src.attention.vjp import attention
from jaxact._src.core import args, dispatch, dropout, shardings, validation

_FN = "dot_product_attention"


def _err(msg: str) -> str:
  return f"jaxact.{_FN}: {msg}"


def _operands(query, key, value) -> tuple[Array, Array, Array, bool]:
  """q, k, v as 4-d arrays, checked; and whether they came without a batch axis (3-d)."""
  q, k, v = (
    validation.as_real_array(_FN, a, n)
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
  a = validation.as_real_array(_FN, arr, name)
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
  a = validation.as_real_array(_FN, arr, name)
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
    a = validation.as_real_array(_FN, ids, name)
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


def _blocks(block_sizes, heads: int, t, s, head_dim: int) -> tuple:
  """The XLA path's blocks, at most T by S (symbolic where T or S is)."""
  if block_sizes is None:
    return default_blocks(heads, t, s, head_dim=head_dim, gpu=dispatch.target().cuda)
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


def dot_product_attention(
  query: ArrayLike,
  key: ArrayLike,
  value: ArrayLike,
  bias: ArrayLike | None = None,
  mask: ArrayLike | None = None,
  *,
  scale: float | None = None,
  is_causal: bool = False,
  query_seq_lengths: ArrayLike | None = None,
  key_value_seq_lengths: ArrayLike | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  logits_soft_cap: float | None = None,
  query_segment_ids: ArrayLike | None = None,
  key_value_segment_ids: ArrayLike | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: ArrayLike | None = None,
  broadcast_dropout: bool = True,
  precision: lax.PrecisionLike = None,
  implementation: str | None = None,
  block_sizes: tuple[int, int] | None = None,
  out_sharding: NamedSharding | PartitionSpec | None = None,
) -> Array:
  r"""Scaled dot-product attention that keeps its output, not its probabilities.

  ``jax.nn.dot_product_attention``'s signature, defaults and layouts (query ``(B, T, N, H)``, key
  and value ``(B, S, K, H)``, or all without the batch axis; grouped-query attention when the
  ``K`` key/value heads divide the ``N`` query heads), computing for each head

  .. math::
    O = \operatorname{softmax}\!\left(c \tanh\!\left(\frac{\mathrm{scale}\; Q K^\top}{c}\right)
      + B\right) V

  over the keys that the masks leave (``mask``, ``is_causal``, ``local_window_size``, the
  lengths, combined as jax.nn combines them), with Gemma 2's soft cap :math:`c`
  (``logits_soft_cap``; without it the logits are ``scale Q Kᵀ + B``). The cap applies before
  the bias, so a bias of ``-inf`` masks as a mask does.

  One ``custom_vjp`` keeps ``query``, ``key``, ``value``, the output ``O`` and two float32 numbers
  a (row, head), the row's largest logit and the log of its softmax's sum (kept apart: one
  log-sum-exp loses the sum next to a logit of -1e9), for the backward pass (and ``bias``,
  ``mask``, the lengths and the dropout key where given), which recomputes the probabilities
  block by block (FlashAttention-2's order). No (T, S) array is kept or built: the XLA path loops
  over blocks of ``block_sizes`` with an online softmax and skips the blocks that the causal mask
  and the window leave empty. Half precision inputs are multiplied with float32 accumulation;
  logits, statistics and softmax are float32 (float64 for float64 inputs). Logits of any finite
  size never overflow: ``scale Q Kᵀ`` is clipped to the float range before the softmax, and the
  derivative of a clipped logit is 0.

  Differences from jax.nn: a row that sees no key at all (every key masked) gives 0 and zero
  gradients, where jax.nn returns the mean of the values; ``logits_soft_cap``, segment ids,
  dropout, ``precision`` and ``block_sizes`` are extra; the lengths may be of any integer dtype
  and the value head dim may differ from the query's.

  Under Explicit mesh axes (``jax.set_mesh`` of a mesh from ``jax.make_mesh``) each device runs
  the op on its batch rows and query heads (data and tensor parallelism, as Gemma's ``act_btnh``
  splits them), with no collective; key/value heads that cannot split as the query heads do (MQA
  under tensor parallelism) are taken whole and each device picks the ones its heads read.
  Sequence-sharded operands raise ``NotImplementedError``. Under Auto axes the op is XLA's to
  partition.

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``, floating point.
    key: ``(B, S, K, H)`` or ``(S, K, H)``, the dtype of ``query``; ``N % K == 0``.
    value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``, the dtype of ``query``.
    bias: added to the (capped) logits, broadcastable to ``(B, N, T, S)`` (rank <= 4, leading
      axes added); its gradient is computed. ``-inf`` entries mask.
    mask: bool, broadcastable to ``(B, N, T, S)``: True attends.
    scale: multiplies ``Q Kᵀ``; None: ``1 / sqrt(H)``.
    is_causal: mask keys after each query (``u > t``, jax.nn's top-left aligned ``tril``).
    query_seq_lengths: ``(B,)`` integers: rows at or beyond give 0.
    key_value_seq_lengths: ``(B,)`` integers: keys at or beyond are masked.
    local_window_size: ``(left, right)`` or an int for both: each query ``t`` sees keys ``t -
      left`` to ``t + right``.
    logits_soft_cap: :math:`c > 0`, or None for no cap.
    query_segment_ids: ``(B, T)`` integers for packed sequences: a query attends only to keys
      of its own segment id (alone it serves the keys too, when T == S).
    key_value_segment_ids: ``(B, S)`` integers, the keys' segment ids (alone it serves the
      queries too, when T == S).
    dropout_rate: Flax's attention dropout of the probabilities (0 for none); the mask is drawn
      from `dropout_rng` as ``flax.linen.dot_product_attention`` draws it (the same key gives the
      same mask), in both passes, and never kept.
    dropout_rng: a threefry PRNG key, required when ``dropout_rate > 0``.
    broadcast_dropout: one ``(T, S)`` mask for every batch row and head (Flax's default).
    precision: of the products, as :func:`jax.lax.dot_general` takes it.
    implementation: ``None`` (the best measured: XLA, see the dispatch docs), ``"xla"``, or
      ``"pallas"`` (the Triton kernels of :mod:`pallas_kernels.attention_triton`, interpret mode off
      CUDA; ``NotImplementedError`` for a bias, a mask array, dropout, float64 and head dims they
      cannot tile), ``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``, with
      jax.nn's semantics; ``NotImplementedError`` for soft cap, dropout, float32/64 and windows
      cuDNN lacks). ``"mosaic"`` raises: there is no Hopper attention kernel yet.
    block_sizes: ``(block_q, block_k)`` of the XLA path; None chooses square blocks from the
      sizes (about 512 KiB of float32 logits a block on CPU; for a GPU at most 64 MiB and
      ``block_q * block_k <= T * H / 8``).
    out_sharding: ``O``'s sharding (a ``PartitionSpec`` or ``NamedSharding``), or None for the
      query's batch and heads. Under Explicit mesh axes each device attends its own batch rows
      and heads (see above) and ``O`` is then resharded to it (a copy where it differs); under
      Auto axes it is a sharding constraint.

  Returns:
    ``O``, shaped like ``query`` with ``value``'s head dim, in ``query``'s dtype.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxact
    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> o = jaxact.dot_product_attention(q, k, v, is_causal=True)
    >>> o.shape
    (1, 4, 2, 8)
    >>> lengths = jnp.array([0])  # a batch row with no keys: 0, not NaN
    >>> float(jaxact.dot_product_attention(q, k, v, key_value_seq_lengths=lengths).sum())
    0.0
  """
  with jax.named_scope(f"jaxact.{_FN}"):
    rules.check_implementation(_FN, implementation)
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
    cap = None
    if logits_soft_cap is not None:
      cap = _static_float("logits_soft_cap", logits_soft_cap, positive=True)
    scale = (
      1 / math.sqrt(h)
      if scale is None and h
      else _static_float("scale", 1.0 if scale is None else scale, positive=False)
    )
    drop, key_data = dropout.check(_FN, dropout_rate, dropout_rng, (), 4)
    if drop is not None:
      if not drop.threefry:
        raise NotImplementedError(
          _err(
            f"dropout with a {drop.impl} key: attention draws its mask block by block, which "
            "jaxact does for threefry keys (jax's default) only"
          )
        )
      drawn = t * s if broadcast_dropout else b * n * t * s
      if drawn >= 2**32:
        raise NotImplementedError(
          _err(f"dropout over {drawn} elements (>= 2**32, where jax draws 64-bit counters)")
        )
    out_shape = (b, t, n, v.shape[-1])
    acc = np.dtype(validation.compute_dtype(q.dtype))
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
    decision = rules.decide(_FN, implementation, plan, q, k, v, bias, aux)
    if 0 in q.shape or 0 in k.shape or 0 in v.shape[-1:]:  # nothing to attend, or to return
      out = jnp.zeros(out_shape, q.dtype)
    elif decision.forward == "cudnn":
      out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias,
        mask,
        scale=scale,
        is_causal=bool(is_causal),
        query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len,
        local_window_size=window,
        implementation="cudnn",
      )
    else:
      # a symbolic batch or head count (jax.export) counts as 1 in the block budget
      heads = args.static_size(b) * args.static_size(n)
      block_q, block_k = _blocks(block_sizes, heads, t, s, args.static_size(h))
      plan = dataclasses.replace(plan, block_q=block_q, block_k=block_k, decision=decision)
      out = sharding.per_device(attention, plan, q, k, v, bias, aux)(q, k, v, bias, aux)
    out = out[0] if unbatched else out
    out_sharding = shardings.check(_FN, out_sharding, out.ndim)
    return shardings.constrain(shardings.reshard(out, out_sharding), out_sharding)
