"""The timing steps of the GPU truth run (:mod:`benchmarks.gpu.truth`'s table): each path
against XLA's (or the plain composition's) in the same process, one verdict a path with the
time and the ratio, recorded as soon as it is measured. The timed functions are the GPU sections'
(``benchmarks.gpu.lce.time_table``, ``benchmarks.gpu.codes``' tables) where they exist.
"""

from __future__ import annotations

import functools
import math
import traceback

import jax
import jax.numpy as jnp

from support import gpu_codes as gc
from support import gpu_gated
from support import truth as th


def _ratio_verdict(ctx, kernel: str, t: float, base: float, label: str = "xla") -> None:
  if math.isfinite(t) and math.isfinite(base):
    ctx.verdict(kernel, "ok", f"{1e3 * t:.3f} ms, {t / base:.2f}x {label}")
  else:
    ctx.verdict(kernel, "ERROR", "not timed")


# (B, T, soft cap) of the attention timings: 8192 tokens each; a soft cap (jaxact only) at 2048.
_ATTENTION_CASES = ((4, 2048, None), (1, 8192, None), (4, 2048, 50.0))


def time_attention(ctx: th.Context):
  """Causal attention in bfloat16 (16 heads of 128, 4 key/value heads; B x T = 4 x 2048 and 1 x
  8192, and 4 x 2048 under a soft cap), forward and forward + backward: jax.nn's XLA attention,
  cuDNN's, jaxact's XLA path and its Triton kernels (jax.nn has no soft cap: jaxact's paths only
  there)."""
  import jaxact
  from benchmarks.gpu.common import median_seconds

  n, kh, h = ctx.pick((16, 4, 128), (2, 1, 16))
  cases = ctx.pick(_ATTENTION_CASES, ((1, 64, None), (1, 64, 2.0)))
  runs = 1 if ctx.small else ctx.runs

  def nn(impl):
    def f(q, k, v):  # grouped heads: jax.nn takes them (XLA repeats k and v itself)
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    return f

  lines = [
    f"causal attention, N {n}, K {kh}, H {h}, bfloat16",
    "",
    "| B x T, cap | path | fwd ms | / jaxact xla | fwd+bwd ms | / jaxact xla |",
    "|---|---|---|---|---|---|",
  ]
  times = {}
  for b, t, cap in cases:
    sets = []
    for s in range(2):
      ks = jax.random.split(jax.random.key(70 + s), 4)
      shapes = ((b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h))
      sets.append(
        [jax.random.normal(k, sh, jnp.bfloat16) for k, sh in zip(ks, shapes, strict=True)]
      )
    mine = functools.partial(jaxact.dot_product_attention, is_causal=True, logits_soft_cap=cap)
    paths = {"jaxact xla": mine, "jaxact pallas": functools.partial(mine, implementation="pallas")}
    if cap is None:
      paths["jax.nn xla"] = nn("xla")
      if not ctx.small:
        paths["jax.nn cudnn"] = nn("cudnn")
    case = f"{b} x {t}" + ("" if cap is None else f", cap {cap:g}")
    base = (math.nan, math.nan)
    for label, fn in paths.items():

      def step(q, k, v, g, fn=fn):
        y, pull = jax.vjp(fn, q, k, v)
        return y, *pull(g)

      name = f"time-attention {case} {label}"
      try:
        t_f = median_seconds(jax.jit(fn), [s[:3] for s in sets], runs)
        t_s = median_seconds(jax.jit(step), sets, runs)
      except Exception as e:
        ctx.log(f"{name}\n{traceback.format_exc()}")
        ctx.verdict(name, "ERROR", th.one_line(e))
        continue
      times[f"{case} {label}"] = (t_f, t_s)
      if label == "jaxact xla":
        base = (t_f, t_s)
      lines.append(
        f"| {case} | {label} | {1e3 * t_f:.3f} | {t_f / base[0]:.2f} | {1e3 * t_s:.3f} | "
        f"{t_s / base[1]:.2f} |"
      )
      ctx.verdict(
        name,
        "ok",
        f"fwd {1e3 * t_f:.3f} ms {t_f / base[0]:.2f}x jaxact xla, fwd+bwd {1e3 * t_s:.3f} ms "
        f"{t_s / base[1]:.2f}x",
      )
  return lines, {"ms": {k: [1e3 * x for x in v] for k, v in times.items()}}


def time_gated(ctx: th.Context):
  """gated_mlp (SwiGLU) in bfloat16, forward and forward + backward: the jax.nn composition,
  jaxact's XLA path (and keeping its input alone), the Triton kernels, the Hopper forward, and
  None."""
  from benchmarks import gated as gated_bench
  from benchmarks.gpu.common import median_seconds

  tokens, d, f = ctx.pick(gated_bench.GPU_SIZE, (128, 64, 128))
  runs = 1 if ctx.small else ctx.runs
  sets = []
  for s in range(2):
    x, wg, wu, wd, *_ = gpu_gated.operands((tokens, d, f, d), jnp.bfloat16, 50 + s)
    g = jax.random.normal(jax.random.key(60 + s), (tokens, d), jnp.float32).astype(jnp.bfloat16)
    sets.append((x, wg, wu, wd, g))

  def composition(x, wg, wu, wd):
    return jnp.dot(jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)

  paths = {"jaxact xla": functools.partial(_gated_mlp, implementation="xla"), "jax.nn": composition}
  # The op keeping its input alone: two more matmuls, in blocks of tokens in the backward.
  paths["jaxact xla, keeps x"] = functools.partial(
    _gated_mlp, implementation="xla", residuals="input"
  )
  for impl in ("pallas", "mosaic", None):
    if impl == "mosaic" and not ctx.hopper:
      continue
    paths[f"jaxact {impl}"] = functools.partial(_gated_mlp, implementation=impl)
  lines = [
    f"gated MLP (SwiGLU), (tokens, D, F) = {(tokens, d, f)}, bfloat16",
    "",
    "| path | fwd ms | / xla | fwd+bwd ms | / xla |",
    "|---|---|---|---|---|",
  ]
  times = {}
  for label, fn in paths.items():

    def step(x, wg, wu, wd, g, fn=fn):
      y, pull = jax.vjp(fn, x, wg, wu, wd)
      return y, *pull(g)

    try:
      t_f = median_seconds(jax.jit(fn), [s[:4] for s in sets], runs)
      t_s = median_seconds(jax.jit(step), sets, runs)
    except Exception as e:
      ctx.log(f"time-gated {label}\n{traceback.format_exc()}")
      ctx.verdict(f"time-gated {label}", "ERROR", th.one_line(e))
      continue
    times[label] = (t_f, t_s)
    base = times.get("jaxact xla", (math.nan, math.nan))
    lines.append(
      f"| {label} | {1e3 * t_f:.3f} | {t_f / base[0]:.2f} | {1e3 * t_s:.3f} | {t_s / base[1]:.2f} |"
    )
    ctx.verdict(
      f"time-gated {label}",
      "ok",
      f"fwd {1e3 * t_f:.3f} ms {t_f / base[0]:.2f}x xla, fwd+bwd {1e3 * t_s:.3f} ms "
      f"{t_s / base[1]:.2f}x xla",
    )
  return lines, {k: list(v) for k, v in times.items()}


def _gated_mlp(x, wg, wu, wd, implementation, residuals="projections"):
  import jaxact

  return jaxact.gated_mlp(x, wg, wu, wd, implementation=implementation, residuals=residuals)


def time_lce(ctx: th.Context):
  """The LM head's loss at 16384 x 4096 x 128k, bfloat16, fwd+bwd and loss alone: the plain
  composition, jaxact's XLA path, the Hopper kernels, the forward kernel alone, tokamax where it
  imports (``benchmarks.gpu.lce.time_table``)."""
  from benchmarks.gpu import lce as lce_bench

  size = ctx.pick(lce_bench.SIZES[0], (128, 64, 512))
  runs = 1 if ctx.small else min(ctx.runs, 5)

  def on_row(label, t, base):
    if t is None:
      ctx.verdict(f"time-lce {label}", "ERROR", th.one_line(base))
      return
    ctx.verdict(
      f"time-lce {label}",
      "ok",
      f"fwd+bwd {1e3 * t[0]:.1f} ms {t[0] / base[0]:.2f}x plain, loss "
      f"{1e3 * t[1]:.1f} ms {t[1] / base[1]:.2f}x plain",
    )

  data, lines = lce_bench.time_table(runs, ctx.hopper, sizes=(size,), on_row=on_row)
  return lines, data


def time_codes_kernels(ctx: th.Context):
  """The conv epilogue kernels alone, exact and with each code, against XLA's fusion
  (``benchmarks.gpu.codes.kernel_table``)."""
  from benchmarks.gpu import codes as gpu_codes
  from benchmarks.gpu.conv import CONV_W, CONV_X

  rows, c = ctx.pick((math.prod(CONV_X[:-1]), CONV_W[-1]), (200, 32))
  copy = ctx.results.get("copy_GBps")
  out, lines = gpu_codes.kernel_table(
    1 if ctx.small else ctx.runs, copy, rows, c, interpret=ctx.small
  )
  for r in out:
    _ratio_verdict(ctx, f"time-codes-kernels {r['pass']}", r["s"], r["xla_s"])
  return lines, out


def time_codes_hopper(ctx: th.Context):
  """The Hopper forward alone writing y and z or y and each code, against ``jnp.dot``
  (``benchmarks.gpu.codes.hopper_table``)."""
  from benchmarks.gpu import codes as gpu_codes

  shape = ctx.pick(gpu_codes.DENSE, (128, 64, 256))
  out, lines = gpu_codes.hopper_table(
    1 if ctx.small else ctx.runs, ctx.num_sms, shape=shape, interpret=ctx.small
  )
  base = out[0]["s"]
  for r in out[1:]:
    _ratio_verdict(ctx, f"time-codes-hopper {r['path']}", r["s"], base, "jnp.dot")
  return lines, out


def time_codes_step(ctx: th.Context):
  """One dense and one conv layer's training step, exact and with each code, per implementation
  (``benchmarks.gpu.codes.step_table``)."""
  from benchmarks.gpu import codes as gpu_codes
  from benchmarks.gpu.conv import CONV_W, CONV_X

  dense_shape = ctx.pick(gpu_codes.DENSE, (128, 64, 256))
  conv_shape = ctx.pick((CONV_X, CONV_W), ((2, 6, 6, 3), (3, 3, 3, 16)))
  out, lines = gpu_codes.step_table(
    1 if ctx.small else ctx.runs, ctx.hopper, dense=dense_shape, conv=conv_shape
  )
  exact = {(r["op"], r["impl"]): r["s"] for r in out if r["bits"] is None}
  for r in out:
    base = exact.get((r["op"], r["impl"]), math.nan)
    _ratio_verdict(
      ctx, f"time-codes-step {r['op']} {r['impl']} {gc.label(r['bits'])}", r["s"], base, "exact"
    )
  return lines, out


def time_decoder(ctx: th.Context):
  """A Llama-style decoder's training step (``benchmarks.decoder``'s: 2 scanned blocks of RMS norm,
  causal attention, a SwiGLU MLP; final norm and head), bfloat16, 16 x 1024 tokens, D 4096,
  F 14336, V 128256: Flax's composition and optax's loss, against jaxact's rms_norm, gated_mlp and
  linear_cross_entropy with ``implementation=None`` and with the kernels asked for."""
  import dataclasses

  import optax
  from jax import lax

  import jaxact
  from benchmarks import decoder
  from benchmarks.gpu.common import median_seconds

  c = dataclasses.replace(decoder.DECODER_GPU, blocks=2)
  if ctx.small:
    c = dataclasses.replace(c, batch=1, seq=128, dim=64, hidden=128, heads=2, vocab=512, blocks=1)
  kernels = "mosaic" if ctx.hopper else "pallas"

  def loss_of(norm, mlp, head):
    block = decoder.make_block(mlp, c.heads, norm)

    def loss(params, tokens, labels):
      x = params["embed"][tokens]
      x, _ = lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
      h = norm(x, params["norm"])
      return head(h, params["head"], labels)

    return loss

  def plain_head(h, w, labels):
    logits = jnp.dot(h, w)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def jaxact_mlp(impl):
    return lambda h, p: jaxact.gated_mlp(
      h, p["w_gate"], p["w_up"], p["w_down"], implementation=impl
    )

  def jaxact_head(impl):
    return lambda h, w, labels: jaxact.linear_cross_entropy(h, w, labels, implementation=impl)

  paths = {
    "Flax + optax": loss_of(decoder.rms_norm, decoder._flax_mlp, plain_head),
    "jaxact None": loss_of(decoder.jaxact_rms_norm, jaxact_mlp(None), jaxact_head(None)),
    f"jaxact {kernels}": loss_of(
      decoder.jaxact_rms_norm,
      jaxact_mlp(kernels),
      jaxact_head("mosaic" if ctx.hopper else None),
    ),
  }
  shapes = decoder.decoder_shapes(c)
  leaves, tree = jax.tree.flatten(shapes[0])
  keys = jax.random.split(jax.random.key(70), len(leaves) + 1)
  params = jax.tree.unflatten(
    tree,
    [
      (jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype)
      for k, s in zip(keys, leaves, strict=False)
    ],
  )
  tokens = jax.random.randint(keys[-1], (c.batch, c.seq), 0, c.vocab, jnp.int32)
  labels = jnp.roll(tokens, -1, axis=1)
  runs = 1 if ctx.small else min(ctx.runs, 3)
  lines = [
    f"decoder {c}",
    "",
    "| path | step ms | / Flax + optax |",
    "|---|---|---|",
  ]
  times = {}
  for label, loss in paths.items():
    try:
      step = jax.jit(jax.value_and_grad(loss))
      times[label] = median_seconds(step, [(params, tokens, labels)], runs)
    except Exception as e:
      ctx.log(f"time-decoder {label}\n{traceback.format_exc()}")
      ctx.verdict(f"time-decoder {label}", "ERROR", th.one_line(e))
      continue
    base = times.get("Flax + optax", math.nan)
    lines.append(f"| {label} | {1e3 * times[label]:.1f} | {times[label] / base:.2f} |")
    _ratio_verdict(ctx, f"time-decoder {label}", times[label], base, "Flax + optax")
  return lines, times


def time_posttrain(ctx: th.Context):
  """A GRPO step's loss part (hidden states and head in, their gradients out) in bfloat16,
  16 x 1024 completion tokens, D 4096, V 128k: the plain composition (the full logits'
  log_softmax, jaxact/_src/lce/reference.py) against jaxact.policy_gradient_loss; time and the
  compiled temp of each."""
  import jaxact
  from benchmarks.gpu.common import median_seconds
  from jaxact._src.lce.reference import policy_gradient_reference

  g, t, d, v = ctx.pick((16, 1024, 4096, 131072), (2, 16, 32, 256))
  runs = 1 if ctx.small else min(ctx.runs, 5)
  k = jax.random.split(jax.random.key(70), 5)
  x = jax.random.normal(k[0], (g, t, d), jnp.float32).astype(jnp.bfloat16)
  w = (d**-0.5 * jax.random.normal(k[1], (d, v), jnp.float32)).astype(jnp.bfloat16)
  tokens = jax.random.randint(k[2], (g, t), 0, v)
  old = -3.0 + 0.1 * jax.random.normal(k[3], (g, t), jnp.float32)
  adv = jax.random.normal(k[4], (g,), jnp.float32)
  kw = dict(old_log_probs=old, ref_log_probs=old, beta=0.04, loss_type="grpo")
  paths = {
    "plain": lambda x, w: policy_gradient_reference(x, w, tokens, adv, **kw),
    "jaxact": lambda x, w: jaxact.policy_gradient_loss(x, w, tokens, adv, **kw)[0],
  }
  lines = [
    f"GRPO loss step, (G, T, D, V) = {(g, t, d, v)}, bfloat16",
    "",
    "| path | fwd+bwd ms | / plain | temp MiB |",
    "|---|---|---|---|",
  ]
  data = {}
  for label, fn in paths.items():
    step = jax.jit(jax.grad(fn, (0, 1)))
    try:
      temp = step.lower(x, w).compile().memory_analysis().temp_size_in_bytes / 2**20
      seconds = median_seconds(step, [(x, w)], runs)
    except Exception as e:
      ctx.log(f"time-posttrain {label}\n{traceback.format_exc()}")
      ctx.verdict(f"time-posttrain {label}", "ERROR", th.one_line(e))
      continue
    data[label] = (seconds, temp)
    base = data.get("plain", (math.nan, math.nan))[0]
    lines.append(f"| {label} | {1e3 * seconds:.1f} | {seconds / base:.2f} | {temp:.0f} |")
    ctx.verdict(
      f"time-posttrain {label}",
      "ok",
      f"{1e3 * seconds:.1f} ms {seconds / base:.2f}x plain, temp {temp:.0f} MiB",
    )
  return lines, {k: list(v) for k, v in data.items()}
