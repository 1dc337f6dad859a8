"""`python -m benchmarks attention --sections tpu`: the attention step compiled for TPU chips.

A scanned stack of 2 attention layers (the q, k, v and output projections included, as
:mod:`benchmarks.decoder` has them; ``x + attention(x)``, no norm, no MLP), ``jit(value_and_grad)``
in bfloat16, causal, B = 4, 16 query heads on 4 key/value heads of 128, T = 2048, 4096, 8192, with
and without Gemma 2's soft cap of 50, compiled here for a TPU v5p and a v6e chip by libtpu's
compiler (``support.tpu``), for each way to attend:

* ``jax.nn``: ``jax.nn.dot_product_attention`` (XLA); with the cap, which jax.nn lacks, the plain
  formula (``einsum``, ``c tanh(s / c)``, the causal mask, ``softmax``, ``einsum``);
* ``jaxact, xla``: ``jaxact.dot_product_attention(implementation="xla")``, the blocked XLA path;
* ``jaxact``: ``jaxact.dot_product_attention`` as ``implementation=None`` takes it on a TPU;
* ``splash``: splash attention as a TPU user calls it (``make_splash_mqa`` a key/value head's
  group of query heads with a ``CausalMask``, ``vmap`` over batch and key/value heads, q scaled
  first, 512 blocks as MaxText's defaults), its own ``custom_vjp``;
* ``splash, fused bwd``: the same with splash's fused backward kernel (dq with dk and dv).

Each row: the compiled temp (XLA's buffer assignment for the chip: exact) and the step's time
ESTIMATED as a roofline (:mod:`support.roofline`) against the chip's published peaks.
XLA's cost analysis counts the XLA ops, its loops their trip counts (the causal inner loops of
jaxact's XLA path, whose bounds are computed, their mean ``(n + 1) / 2`` for ``n`` blocks); a
Pallas kernel is a custom call whose flops it cannot see, so the splash kernels' are counted here
(:func:`splash_cost`): every matmul of every (query block, key block) pair the causal mask leaves
(the diagonal blocks whole), and the blocks the kernels' grids read again. Nothing runs on a TPU.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import jaxact
from benchmarks.harness import rows
from jaxact._src.attention.plan import default_blocks
from support import roofline, tpu

BATCH, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 16, 4, 128, 2
SEQS = (2048, 4096, 8192)
CAPS = (None, 50.0)
CHIPS = ("v5p", "v6e")
BLOCK = 512  # splash's blocks, MaxText's default for every pass
STEPS = ("jax.nn", "jaxact, xla", "jaxact", "splash", "splash, fused bwd")


@dataclasses.dataclass(frozen=True)
class Case:
  chip: str
  seq: int
  cap: float | None

  def __str__(self) -> str:
    return f"{self.chip}, T {self.seq}, {'cap 50' if self.cap else 'no cap'}"


def _plain(q, k, v, cap):
  """The plain formula with a soft cap (jax.nn has none): float32 logits and softmax."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  qg = q.reshape(b, t, k.shape[2], g, h)
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * h**-0.5
  s = cap * jnp.tanh(s / cap)
  s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, -1).astype(v.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h)


def splash_attention(seq: int, cap, fused: bool):
  """``attend(q, k, v)`` in jax.nn's layouts as a TPU user writes it with splash attention."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  groups = HEADS // KV_HEADS
  b = min(BLOCK, seq)
  sizes = sa.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=None if fused else b,
    block_kv_dq=None if fused else b,
    use_fused_bwd_kernel=fused,
  )
  mask = sa.MultiHeadMask([sa.CausalMask((seq, seq))] * groups)

  def attend(q, k, v):
    kernel = sa.make_splash_mqa(
      mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, attn_logits_soft_cap=cap
    )
    bt, t, n, h = q.shape
    q = (q * h**-0.5).reshape(bt, t, KV_HEADS, groups, h).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    o = jax.vmap(jax.vmap(kernel))(q, k, v)
    return o.transpose(0, 3, 1, 2, 4).reshape(bt, t, n, h)

  return attend


def attend_of(step: str, seq: int, cap):
  if step == "jax.nn":
    if cap is None:
      return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return lambda q, k, v: _plain(q, k, v, cap)
  if step.startswith("jaxact"):
    impl = "xla" if step == "jaxact, xla" else None
    return lambda q, k, v: jaxact.dot_product_attention(
      q, k, v, is_causal=True, logits_soft_cap=cap, implementation=impl
    )
  return splash_attention(seq, cap, fused=step.endswith("fused bwd"))


def loss_of(attend):
  """``loss(params, x)``: :data:`LAYERS` scanned attention layers with their projections."""

  def layer(x, p):
    wq, wk, wv, wo = p
    b, t, d = x.shape
    q = (x @ wq).reshape(b, t, HEADS, HEAD_DIM)
    k = (x @ wk).reshape(b, t, KV_HEADS, HEAD_DIM)
    v = (x @ wv).reshape(b, t, KV_HEADS, HEAD_DIM)
    o = attend(q, k, v)
    return x + jnp.einsum("btnh,nhd->btd", o, wo.reshape(HEADS, HEAD_DIM, d)), None

  def loss(params, x):
    y, _ = lax.scan(layer, x, params)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return loss


def shapes(seq: int):
  d, s, bf16 = HEADS * HEAD_DIM, jax.ShapeDtypeStruct, jnp.bfloat16
  kv = KV_HEADS * HEAD_DIM
  params = (s((LAYERS, d, d), bf16), s((LAYERS, d, kv), bf16), s((LAYERS, d, kv), bf16))
  return [*params, s((LAYERS, d, d), bf16), s((BATCH, seq, d), bf16)]


def splash_cost(seq: int, fused: bool, block: int = BLOCK, itemsize: int = 2):
  """``(flops, bytes)`` of one layer's splash kernels, forward and backward, that
  :func:`roofline.cost` does not count (it counts each kernel's operands and results once).

  Flops: 2 b b H a matmul, for every (query block, key block) pair the causal mask leaves, ``n (n
  + 1) / 2`` of ``n = T / b`` (the diagonal blocks whole): 2 matmuls forward, 4 in dk and dv's
  kernel, 3 in dq's (5 with the fused backward). Bytes: the blocks each grid reads again a visited
  pair (forward and dq: a key and a value block; dk and dv: a query and a dO block, two rows of
  statistics); the fused backward's partial dq (a key block's) is counted as its whole result."""
  b = min(block, seq)
  n = seq // b
  pairs = BATCH * HEADS * n * (n + 1) // 2  # over every batch row and query head
  matmul = 2 * b * b * HEAD_DIM
  flops = pairs * matmul * (2 + (5 if fused else 7))
  tile = b * HEAD_DIM * itemsize
  once = BATCH * KV_HEADS * seq * HEAD_DIM * itemsize  # k (or v) once, already counted
  rows_once = BATCH * HEADS * seq * HEAD_DIM * itemsize  # q (or dO) once, already counted
  forward = pairs * 2 * tile - 2 * once
  dkv = pairs * (2 * tile + 2 * b * 4) - 2 * rows_once
  dq = 0 if fused else pairs * 2 * tile - 2 * once
  return flops, forward + dkv + dq


def measure(case: Case, step: str, cpu) -> dict:
  """One step's row: compiled temp, XLA's counts and the kernels', the estimate; or, for a step
  whose temporaries exceed the chip's HBM (XLA's TPU compiler refuses it), what it needs."""
  chip = tpu.CHIPS[case.chip]
  start = time.perf_counter()
  grad = jax.value_and_grad(loss_of(attend_of(step, case.seq, case.cap)))
  try:
    compiled = tpu.compile_for_tpu(lambda *a: grad(a[:4], a[4]), shapes(case.seq), case.chip)
  except jax.errors.JaxRuntimeError as e:
    needed = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
    if needed is None:
      raise
    return rows.add(
      "tpu",
      f"{case}, {step}",
      chip=case.chip,
      seq=case.seq,
      cap=case.cap,
      step=step,
      temp_bytes=None,
      needs_bytes=float(needed.group(1)) * 2**30,
      estimate_s=None,
      compile_s=round(time.perf_counter() - start),
    )
  seconds = time.perf_counter() - start
  block = default_blocks(BATCH * HEADS, case.seq, case.seq, head_dim=HEAD_DIM, gpu=True)[0]
  n = case.seq // block
  found = roofline.cost(compiled.as_text(), cpu, unknown_trips=(n + 1) / 2)
  kernel_flops = kernel_bytes = 0.0
  if found.kernels and "tpu_custom_call" in found.kernels:
    per_layer = splash_cost(case.seq, fused=step.endswith("fused bwd"))
    kernel_flops, kernel_bytes = (LAYERS * c for c in per_layer)
  flops, bytes_ = found.flops + kernel_flops, found.bytes + kernel_bytes
  return rows.add(
    "tpu",
    f"{case}, {step}",
    chip=case.chip,
    seq=case.seq,
    cap=case.cap,
    step=step,
    temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
    flops=flops,
    bytes=bytes_,
    kernel_flops=kernel_flops,
    kernel_bytes=kernel_bytes,
    xla_block=block,
    unknown_loops=found.unknown_loops,
    estimate_s=roofline.seconds(flops, bytes_, chip.rates),
    compile_s=round(seconds),
  )


def section(chips=CHIPS, seqs=SEQS, caps=CAPS, steps=STEPS) -> list[dict]:
  """Every (chip, T, cap) case's rows, a step each."""
  cpu = jax.devices("cpu")[0].client
  found = []
  for chip in chips:
    for seq in seqs:
      for cap in caps:
        case = Case(chip, seq, cap)
        for step in steps:
          found.append(measure(case, step, cpu))
          f = found[-1]["figures"]
          shown = (
            f"needs {f['needs_bytes'] / 2**30:.0f} GiB"
            if f["temp_bytes"] is None
            else f"{f['temp_bytes'] / 2**20:.0f} MiB, {f['estimate_s'] * 1e3:.2f} ms"
          )
          print(f"  [{case}, {step}: {shown}, {f['compile_s']} s]", file=sys.stderr, flush=True)
  return found
