"""The correctness steps of the GPU truth run (:mod:`benchmarks.gpu.truth`'s table).

Each takes the run's :class:`~support.truth.Context` and the row's parameters,
records one verdict a kernel (``ctx.verdict``) and returns its markdown lines and data. The checks
themselves are the GPU sections' (``benchmarks.gpu.dense.check_case``,
``benchmarks.gpu.conv.check_case``) and ``support``'s (``gpu_codes.check``,
``gpu_gated.check``, ``gpu_lce.check``), at small shapes (``ctx.pick(on_the_gpu, rehearsal)``).
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp

from support import gpu_codes as gc
from support import gpu_gated, gpu_lce
from support import truth as th
from support.gpu_compare import Comparison

DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
FAMILIES = ("identity", "relu", "gelu")  # one activation a residual: none, output, input


def judge(ctx: th.Context, kernel: str, check) -> None:
  """Run `check` (``() -> Comparison``) and record its verdict: ok / FAIL with the errors,
  ``skipped: unsupported`` when the kernels refuse the call, ERROR when anything raises."""
  try:
    c = check()
  except NotImplementedError as e:
    ctx.verdict(kernel, "skipped", f"unsupported: {th.one_line(e)}")
    return
  except Exception as e:
    ctx.log(f"{kernel}\n{traceback.format_exc()}")
    ctx.verdict(kernel, "ERROR", th.one_line(e))
    return
  ctx.verdict(kernel, "ok" if c.ok else "FAIL", c.summary())


def env(ctx: th.Context):
  """The device and its ceilings (copy bandwidth, bf16 matmul rate)."""
  from benchmarks.gpu.common import gpu_device, section_env, versions

  gpu = gpu_device()
  if gpu is None or ctx.small:
    packages = ", ".join(f"{k} {v}" for k, v in versions().items())
    ctx.verdict(
      "env", "ok", f"no GPU: {jax.devices()[0].device_kind}; jax {jax.__version__}, {packages}"
    )
    return [], {}
  info, lines = section_env(gpu, ctx.runs)
  ctx.results["copy_GBps"] = info["copy_GBps"]
  rates = f"copy {info['copy_GBps']:.0f} GB/s, bf16 dot {info['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
  ctx.verdict("env", "ok", rates)
  return lines, info


def dense(ctx: th.Context, dtype: str, impl: str):
  """``dense_bias_act`` through the Triton (``pallas``) or Hopper (``mosaic``) kernels:
  y, dx, dw, db (``benchmarks.gpu.dense.check_case``)."""
  from benchmarks.gpu import dense as gpu_dense

  if impl == "pallas":
    shape = ctx.pick((2, 300, 257, 513), (2, 9, 19, 23))  # ragged in every dimension
  else:
    shape = ctx.pick((2, 2048, 256, 2048), (128, 64, 256))  # 256 tiles of 128 x 256
  kind = "triton" if impl == "pallas" else "mosaic"
  for i, name in enumerate(FAMILIES):
    kernel = f"dense-{kind} {dtype} {name}"

    def check(name=name, i=i):
      errs, xla, _, error = gpu_dense.check_case(name, DTYPES[dtype], shape, 10 + i, impl)
      if error is not None:
        raise RuntimeError(error)
      return Comparison(("y", "dx", "dw", "db"), tuple(errs), tuple(xla), (DTYPES[dtype],) * 4)

    judge(ctx, kernel, check)
  return [f"shape (..., K, N) = {shape}"], {"shape": shape}


def conv(ctx: th.Context, dtype: str):
  """``conv_bias_act`` (3x3 SAME) through the Triton epilogue kernels
  (``benchmarks.gpu.conv.check_case``)."""
  from benchmarks.gpu import conv as gpu_conv

  xs, ws = ctx.pick(((4, 28, 28, 24), (3, 3, 24, 100)), ((1, 5, 5, 3), (3, 3, 3, 8)))
  for i, name in enumerate(FAMILIES):

    def check(name=name, i=i):
      errs, xla, _ = gpu_conv.check_case(name, DTYPES[dtype], xs, ws, 20 + i)
      return Comparison(("y", "dx", "dw", "db"), tuple(errs), tuple(xla), (DTYPES[dtype],) * 4)

    judge(ctx, f"conv-triton {dtype} {name}", check)
  return [f"x {xs}, w {ws}"], {"x": xs, "w": ws}


def codes(
  ctx: th.Context, dtype: str, op: str, impl: str, cases=(("gelu", 8), ("gelu", 4), ("gelu", 2))
):
  """Few-bit derivative codes through the kernels against XLA's: y, the kept codes, dx, dw, db
  (``support.gpu_codes.check``, exact pre-activations)."""
  from benchmarks.gpu import codes as gpu_codes

  if op == "dense":
    shape = ctx.pick(gpu_codes.CHECK_DENSE, (128, 64, 256))
    args = gc.exact_dense(shape, jnp.dtype(DTYPES[dtype]), 30)
  else:
    shape = ctx.pick(gpu_codes.CHECK_CONV, ((2, 6, 6, 3), (3, 3, 3, 16)))
    args = gc.exact_conv(*shape, jnp.dtype(DTYPES[dtype]), 31)
  kind = {"pallas": "triton", "mosaic": "mosaic"}[impl]
  for name, bits in cases:
    kernel = f"codes-{kind}-{op} {dtype} {name} {bits}-bit"
    try:
      c = gc.check(op, impl, name, bits, args)
    except Exception as e:
      ctx.log(f"{kernel}\n{traceback.format_exc()}")
      ctx.verdict(kernel, "ERROR", th.one_line(e))
      continue
    if c.error is not None:
      status = "skipped" if c.error.startswith("NotImplementedError") else "ERROR"
      ctx.verdict(kernel, status, ("unsupported: " if status == "skipped" else "") + c.error[:300])
      continue
    detail = (
      f"y {c.y_ulps:.1f} eps off, codes {c.code_diff} of {c.code_count} differ (max step "
      f"{c.code_step}), grads vs xla {max(c.errs):.1e}"
    )
    ctx.verdict(kernel, "ok" if c.ok else "FAIL", detail)
  return [f"shape {shape}"], {"shape": shape}


def gated(ctx: th.Context, dtype: str, impl: str, activations=gpu_gated.ACTIVATIONS):
  """``gated_mlp`` with every bias through the Triton kernels (``pallas``) or the Hopper forward
  (``mosaic``) against XLA's: y and the gradients of x, the kernels and the biases."""
  if impl == "pallas":
    shape = ctx.pick((2, 300, 257, 1000, 200), (2, 10, 24, 40, 16))  # (..., D, F, O), ragged
  else:
    shape = ctx.pick((4096, 256, 1024, 256), (128, 64, 128, 64))  # 256 CTA tiles of 128 x 128
  kind = "triton" if impl == "pallas" else "mosaic"
  for name in activations:
    judge(
      ctx,
      f"gated-{kind} {dtype} {name}",
      functools.partial(gpu_gated.check, name, impl, shape, jnp.dtype(DTYPES[dtype])),
    )
  return [f"shape (..., D, F, O) = {shape}"], {"shape": shape}


def lce(ctx: th.Context, dtype: str, cases=tuple(gpu_lce.OPTION_CASES)):
  """``linear_cross_entropy(..., implementation="mosaic")`` (the Hopper forward and backward
  kernels) against XLA's, for each option: the loss and the gradients of x, w and the bias."""
  shape = ctx.pick((1024, 256, 8192), (128, 64, 512))  # (tokens, D, V): 256 CTA tiles
  for case in cases:
    judge(
      ctx,
      f"lce-mosaic {dtype} {case}",
      functools.partial(gpu_lce.check, case, "mosaic", shape, jnp.dtype(DTYPES[dtype])),
    )
  return [f"(tokens, D, V) = {shape}"], {"shape": shape}


def attention(ctx: th.Context, dtype: str):
  """``jaxact.dot_product_attention`` through jaxact's Triton kernels (``pallas``; there is no
  Hopper attention kernel yet) and cuDNN's against XLA's blocked path,
  plain, causal, soft-capped, and causal with a window and lengths (a batch row with no key): O
  and the gradients of q, k, v."""
  import jaxact
  from support.gpu_compare import compare_to_xla

  b, t, n, h = ctx.pick((2, 1024, 4, 128), (1, 16, 2, 16))
  keys = jax.random.split(jax.random.key(40), 3)
  qkv = [jax.random.normal(k, (b, t, n, h), jnp.float32).astype(DTYPES[dtype]) for k in keys]
  lengths = jnp.asarray([t // 3, 0][:b] if b > 1 else [t // 3], jnp.int32)
  gqa = {"is_causal": True, "local_window_size": (t // 4, 0), "key_value_seq_lengths": lengths}
  for options in ({}, {"is_causal": True}, {"logits_soft_cap": 30.0}, gqa):

    def build(impl, precision, options=options):
      def f(q, k, v):
        return jaxact.dot_product_attention(
          q, k, v, precision=precision, implementation=impl, **options
        )

      return f

    label = (
      "window+lengths"
      if options is gqa
      else (",".join(f"{key}={val}" for key, val in options.items()) or "plain")
    )
    for impl in ("pallas",) + (() if ctx.small else ("cudnn",)):  # cuDNN: a GPU's
      judge(
        ctx,
        f"attention-{impl} {dtype} {label}",
        lambda build=build, impl=impl: compare_to_xla(
          build, qkv, impl, names=("y", "dq", "dk", "dv")
        ),
      )
  return [f"(B, T, N, H) = {(b, t, n, h)}"], {}


# The norm + activation cases: op, activation (a residual family each), by given statistics.
NORM_ACT_CASES = ("batch relu", "batch-infer silu", "group silu", "group gelu")


def norm_act(ctx: th.Context, dtype: str, cases=NORM_ACT_CASES):
  """``batch_norm_act`` / ``group_norm_act`` through the Triton normalize-and-activate kernels
  (``implementation="pallas"``) against XLA's: y and the gradients of x, scale (every fourth
  channel 0) and bias; batch norm by its batch statistics and by given ones, group norm."""
  import jaxact
  from support.gpu_compare import compare_to_xla

  shape = ctx.pick((16, 28, 28, 200), (2, 3, 5, 12))  # 200 channels: a ragged column tile
  groups = ctx.pick(8, 4)
  c = shape[-1]
  keys = jax.random.split(jax.random.key(50), 3)
  dt = jnp.dtype(DTYPES[dtype])
  x = (2 * jax.random.normal(keys[0], shape, jnp.float32) + 0.5).astype(dt)
  scale = jax.random.normal(keys[1], (c,), jnp.float32).at[::4].set(0.0).astype(dt)
  bias = jax.random.normal(keys[2], (c,), jnp.float32).astype(dt)
  mean, var = jnp.linspace(-0.5, 1.0, c), jnp.linspace(0.5, 4.0, c)
  for case in cases:
    op, activation = case.split()

    def build(impl, precision, op=op, activation=activation):
      del precision  # no matmul
      if op == "group":
        return lambda x, s, b: jaxact.group_norm_act(
          x, s, b, activation=activation, num_groups=groups, implementation=impl
        )
      given = {"mean": mean, "var": var} if op == "batch-infer" else {}
      return lambda x, s, b: jaxact.batch_norm_act(
        x, s, b, activation=activation, implementation=impl, **given
      )[0]

    judge(
      ctx,
      f"norm-act-triton {dtype} {case}",
      lambda build=build: compare_to_xla(
        build, (x, scale, bias), "pallas", names=("y", "dx", "dscale", "dbias")
      ),
    )
  return [f"x {shape}, {groups} groups"], {"x": shape, "groups": groups}


def moe(ctx: th.Context, dtype: str):
  """``moe_mlp(..., implementation="pallas")`` (the grouped Triton kernels: the forward's three
  products, the backward's six) against XLA's ragged_dot path, dropless and with a capacity (its
  dropped rows past the groups): y and the gradients of x, the router and the three expert
  weights. Each router column picks one feature of x, which is bf16-exact: the logits are exact in
  every path and precision, so every path routes alike (TF32 and rounding cannot flip a top-k)."""
  import jaxact
  from support.gpu_compare import compare_to_xla

  t, d, f, e, k = ctx.pick((1024, 256, 320, 16, 4), (24, 16, 20, 6, 2))
  keys = jax.random.split(jax.random.key(50), 5)
  dt = jnp.dtype(DTYPES[dtype])
  x = jax.random.normal(keys[0], (t, d), jnp.float32).astype(jnp.bfloat16).astype(dt)
  picks = jax.random.permutation(keys[1], d)[:e]
  router = jax.nn.one_hot(picks, d, dtype=dt).T  # (d, e): expert i's logit is x[:, picks[i]]
  w_gate, w_up = ((d**-0.5 * jax.random.normal(kk, (e, d, f))).astype(dt) for kk in keys[2:4])
  w_down = (f**-0.5 * jax.random.normal(keys[4], (e, f, d))).astype(dt)
  args = (x, router, w_gate, w_up, w_down)
  names = ("y", "dx", "drouter", "dw_gate", "dw_up", "dw_down")
  for label, options in (("dropless", {}), ("capacity 0.5", {"capacity_factor": 0.5})):

    def build(impl, precision, options=options):
      def f(*args):
        y, _ = jaxact.moe_mlp(*args, top_k=k, precision=precision, implementation=impl, **options)
        return y

      return f

    judge(
      ctx,
      f"moe-triton {dtype} {label}",
      functools.partial(compare_to_xla, build, args, "pallas", names=names),
    )
  return [f"(T, D, F, E, k) = {(t, d, f, e, k)}"], {"shape": (t, d, f, e, k)}
