"""Splash attention (jax's Mosaic TPU attention kernels) in jaxact's layouts and residual contract.

``jax.experimental.pallas.ops.tpu.splash_attention`` is the TPU kernel a JAX user trains with
(MaxText's default): FlashAttention's forward and backward for one batch row, heads first, with the
causal mask's empty blocks skipped and a logit soft cap. Here it serves jaxact's ``custom_vjp``:
the forward returns O and each row's log-sum-exp (splash's ``save_residuals=True``), and the
backward takes them back with q, k, v and dO, so that nothing else is kept between the passes.

Layouts: q ``(B, T, N, H)``, k ``(B, S, K, H)``, v ``(B, S, K, Hv)`` (jax.nn's), the ``N / K``
query heads of each key/value head one splash call in its MQA form (q ``(G, T, H)`` against k
``(S, H)``), vmapped over the batch and the key/value heads. Splash applies no scale: q is scaled
before the kernels, in its dtype (as splash's users do), and dq after.

Splash's public kernel keeps its own residuals for its backward, and would run the forward again
to make them from q, k and v; its backward with given residuals is the private
``_splash_attention_bwd`` (its ``custom_vjp``'s backward rule, the same signature in jax 0.11.2
and 0.12): the one private name used, checked where it is imported (:func:`splash_unsupported`).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

# splash's key blocks are multiples of the TPU's 128 lanes; 512 is MaxText's block for every pass.
LANES = 128
MAX_BLOCK = 512
_DTYPES = ("float32", "bfloat16")
_BWD_PARAMS = (
  "save_residuals",
  "mask_value",
  "is_mqa",
  "block_sizes",
  "residual_checkpoint_name",
  "mask_function",
  "attn_logits_soft_cap",
  "interpret",
  "res",
  "do",
)


@functools.cache
def _splash():
  """``(splash_attention, its kernel module)``, or the reason they cannot serve here."""
  try:
    from jax.experimental.pallas.ops.tpu import splash_attention
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  except ImportError as e:  # pragma: no cover - jax without Pallas TPU
    return f"jax has no splash attention here ({e})"
  bwd = getattr(splash_attention_kernel, "_splash_attention_bwd", None)
  if bwd is None or tuple(inspect.signature(bwd).parameters) != _BWD_PARAMS:
    return f"jax {jax.__version__}'s splash attention has no backward of the signature used here"
  return splash_attention, splash_attention_kernel


def _side(n: int) -> int:
  """The largest power of two at most :data:`MAX_BLOCK` dividing `n` (a multiple of 128)."""
  return min(MAX_BLOCK, n & -n)


def block_sizes(q_len: int, kv_len: int):
  """splash's ``BlockSizes``: square 512 blocks for every pass (MaxText's), smaller where a
  sequence is not a multiple of 512; the backward's dq apart from dk and dv (splash's fused
  backward kernel keeps a partial dq a key block, in the operands' dtype)."""
  splash, _ = _splash()
  bq, bk = _side(q_len), _side(kv_len)
  return splash.BlockSizes(
    block_q=bq,
    block_kv=bk,
    block_kv_compute=bk,
    block_q_dkv=bq,
    block_kv_dkv=bk,
    block_kv_dkv_compute=bk,
    block_q_dq=bq,
    block_kv_dq=bk,
  )


def splash_unsupported(q_shape, k_shape, v_shape, dtype) -> str | None:
  """Why splash attention cannot run attention of these shapes (jax.nn's layouts) and dtype, or
  None. The masks, bias and other options are the caller's to check: splash takes a causal mask
  or none, and a soft cap."""
  found = _splash()
  if isinstance(found, str):
    return found
  name = np.dtype(dtype).name
  if name not in _DTYPES:
    return f"dtype {name} (splash attention takes {', '.join(_DTYPES)})"
  t, s = q_shape[1], k_shape[1]
  if not all(isinstance(n, int) for n in (t, s)) or t % LANES or s % LANES:
    return f"sequence lengths T={t}, S={s} (splash attention's blocks need multiples of {LANES})"
  if q_shape[-1] != k_shape[-1]:
    return f"query head dim {q_shape[-1]} against key head dim {k_shape[-1]}"
  return None


def _kernel(q_len: int, kv_len: int, groups: int, causal: bool, soft_cap, interpret: bool):
  """One batch row's MQA kernel for a group of `groups` query heads. Made in each trace, never
  kept: it holds the mask's block tables as arrays of the trace that made it (splash caches the
  tables' computation itself)."""
  splash, _ = _splash()
  shape = (q_len, kv_len)
  mask = splash.CausalMask(shape) if causal else splash.FullMask(shape)
  return splash.make_splash_mqa(
    splash.MultiHeadMask([mask] * groups),
    block_sizes=block_sizes(q_len, kv_len),
    head_shards=1,
    q_seq_shards=1,
    attn_logits_soft_cap=soft_cap,
    save_residuals=True,
    interpret=interpret,
  )


def _heads_first(q, kv_heads: int):
  """``(B, T, N, H)`` as ``(B, K, G, T, H)``."""
  b, t, n, h = q.shape
  return q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _heads_last(o):
  """``(B, K, G, T, H)`` as ``(B, T, N, H)``."""
  b, kh, g, t, h = o.shape
  return o.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, h)


def _scaled(q, scale: float):
  return (q.astype(jnp.float32) * scale).astype(q.dtype)


def splash_forward(q, k, v, *, scale: float, causal: bool, soft_cap, interpret: bool = False):
  """``(O (B, T, N, Hv), lse (B, N, T) float32)``: attention of ``softmax(c tanh(scale q.k /
  c))`` (no cap without `soft_cap`) under the causal mask or none, and each row's log-sum-exp of
  those logits."""
  b, t, n, _ = q.shape
  kv_heads = k.shape[2]
  kernel = _kernel(t, k.shape[1], n // kv_heads, causal, soft_cap, interpret)
  qh = _heads_first(_scaled(q, scale), kv_heads)
  kh, vh = (a.transpose(0, 2, 1, 3) for a in (k, v))
  o, (lse,) = jax.vmap(jax.vmap(kernel))(qh, kh, vh)
  return _heads_last(o), lse.reshape(b, n, t)


def splash_backward(
  q, k, v, o, lse, do, *, scale: float, causal: bool, soft_cap, interpret: bool = False
):
  """``(dq, dk, dv)`` of :func:`splash_forward` from its inputs, its O and lse, and dO."""
  _, kernels = _splash()
  b, t, n, _ = q.shape
  kv_heads = k.shape[2]
  kernel = _kernel(t, k.shape[1], n // kv_heads, causal, soft_cap, interpret)
  kw = kernel.kwargs

  def one(q, k, v, o, lse, do):  # one batch row's group of query heads
    res = (q, k, v, None, None, o, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
    grads = kernels._splash_attention_bwd(
      False,
      kw["mask_value"],
      kw["is_mqa"],
      kw["block_sizes"],
      None,
      kw["mask_function"],
      kw["attn_logits_soft_cap"],
      kw["interpret"],
      res,
      do,
    )
    return grads[3:6]

  heads = lambda a: _heads_first(a, kv_heads)
  lse = lse.reshape(b, kv_heads, n // kv_heads, t)
  kh, vh = (a.transpose(0, 2, 1, 3) for a in (k, v))
  dq, dk, dv = jax.vmap(jax.vmap(one))(heads(_scaled(q, scale)), kh, vh, heads(o), lse, heads(do))
  dq = _heads_last(_scaled(dq, scale))
  return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
