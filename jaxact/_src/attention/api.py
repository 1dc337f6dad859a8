"""The public op :func:`dot_product_attention`: the arguments checked into one call's plan
(:mod:`.api_checks`), the backend decided (:mod:`.rules`), the call run (:mod:`.xla`, the Triton
kernels or jax.nn's cuDNN path)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from jaxact._src.attention import api_checks, rules, sharding
from jaxact._src.attention.plan import Call
from jaxact._src.attention.vjp import attention
from jaxact._src.core import args, shardings
from jaxact._src.core.dispatch import Decision

_FN = api_checks.FN


def _run(call: Call, decision: Decision, block_sizes) -> Array:
  """O ``(B, T, N, Hv)`` on the decided backend; zeros where there is nothing to attend, or to
  return."""
  plan, q, k, v, bias, aux = call
  b, t, n, h = q.shape
  if 0 in q.shape or 0 in k.shape or 0 in v.shape[-1:]:
    return jnp.zeros((b, t, n, v.shape[-1]), q.dtype)
  if decision.forward == "cudnn":
    return jax.nn.dot_product_attention(
      q,
      k,
      v,
      bias,
      aux.mask,
      scale=plan.scale,
      is_causal=plan.causal,
      query_seq_lengths=aux.q_lengths,
      key_value_seq_lengths=aux.kv_lengths,
      local_window_size=plan.window,
      implementation="cudnn",
    )
  # a symbolic batch or head count (jax.export) counts as 1 in the block budget
  heads = args.static_size(b) * args.static_size(n)
  block_q, block_k = api_checks.blocks(block_sizes, heads, t, k.shape[1], args.static_size(h))
  plan = dataclasses.replace(plan, block_q=block_q, block_k=block_k, decision=decision)
  return sharding.per_device(attention, plan, q, k, v, bias, aux)(q, k, v, bias, aux)


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
    scale: multiplies ``Q Kᵀ``; None: ``1 / sqrt(H)``. At most the logits' dtype's largest float
      in magnitude (float32's, float64's for float64 inputs).
    is_causal: mask keys after each query (``u > t``, jax.nn's top-left aligned ``tril``).
    query_seq_lengths: ``(B,)`` integers: rows at or beyond give 0.
    key_value_seq_lengths: ``(B,)`` integers: keys at or beyond are masked.
    local_window_size: ``(left, right)`` or an int for both: each query ``t`` sees keys ``t -
      left`` to ``t + right``.
    logits_soft_cap: :math:`c > 0`, a normal number of the logits' dtype (float32: 1.2e-38 to
      3.4e38), or None for no cap.
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
    implementation: ``None`` (the best measured, see the dispatch docs: splash attention where the
      program is lowered for a TPU and splash takes the call, XLA elsewhere), ``"xla"``,
      ``"splash"`` (jax's splash attention kernels for TPUs, wrapped in this op's ``custom_vjp``,
      interpret mode off a TPU; ``NotImplementedError`` for masks but the causal one, lengths,
      segment ids, windows, dropout, ``precision``, float16/64, and T or S not a multiple of
      128), or
      ``"pallas"`` (the Triton kernels of :mod:`pallas_kernels.attention_triton`, interpret mode off
      CUDA; ``NotImplementedError`` for a bias, a mask array, dropout, float64 and head dims they
      cannot tile), ``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``, with
      jax.nn's semantics; ``NotImplementedError`` for soft cap, dropout, float32/64 and windows
      cuDNN lacks). ``"mosaic"`` raises: there is no Hopper attention kernel yet.
    block_sizes: ``(block_q, block_k)`` of the XLA path; None chooses square blocks from the
      sizes (about 512 KiB of float32 logits a block on CPU; for a GPU or a TPU at most 64 MiB and
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
    call, unbatched = api_checks.call(
      query,
      key,
      value,
      bias,
      mask,
      scale=scale,
      is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap,
      query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
      broadcast_dropout=broadcast_dropout,
      precision=precision,
    )
    out = _run(call, rules.decide(_FN, implementation, call), block_sizes)
    out = out[0] if unbatched else out
    out_sharding = shardings.check(_FN, out_sharding, out.ndim)
    return shardings.constrain(shardings.reshard(out, out_sharding), out_sharding)
