"""The GPU truth run's timings of the op families that landed after the first ones: the norms
fused with their activation and the mixture-of-experts MLP, each against the plain composition JAX
differentiates, in this process (time and compiled temp)."""

from __future__ import annotations

import functools
import math
import traceback

import jax
import jax.numpy as jnp

from benchmarks.gpu.truth_timings import _ratio_verdict
from support import truth as th


def time_norm_act(ctx: th.Context):
  """Batch norm + relu (a ResNet stage, NHWC) and group norm + SiLU (a U-Net block) in bfloat16,
  training mode, forward and backward: jaxact.batch_norm_act / group_norm_act on XLA (the default)
  and on the Triton normalize-and-activate kernels (``implementation="pallas"``) against the plain
  composition JAX differentiates (the statistics in float32, as Flax computes them); time and the
  compiled temp of each, and the kernels' time against jaxact's XLA path."""
  import jaxact
  from jaxact._src.norm_act import reference

  runs = 1 if ctx.small else min(ctx.runs, 5)
  shapes = {
    "batch_norm_act relu": ctx.pick((64, 56, 56, 256), (2, 4, 4, 8)),
    "group_norm_act silu": ctx.pick((8, 64, 64, 320), (2, 4, 4, 8)),
  }
  lines = ["| op | shape | path | fwd+bwd ms | / plain | temp MiB |", "|---|---|---|---|---|---|"]
  data = {}
  for op, shape in shapes.items():
    x = jax.random.normal(jax.random.key(71), shape, jnp.float32).astype(jnp.bfloat16)
    scale, bias = jnp.ones(shape[-1:], jnp.bfloat16), jnp.zeros(shape[-1:], jnp.bfloat16)
    if op.startswith("batch"):

      def mine(x, s, b, impl):
        return jaxact.batch_norm_act(x, s, b, activation="relu", implementation=impl)[0]

      plain = lambda x, s, b: reference.batch_norm_act(x, s, b, jax.nn.relu)[0]
    else:
      groups = min(32, shape[-1] // 2)

      def mine(x, s, b, impl, g=groups):
        return jaxact.group_norm_act(x, s, b, activation="silu", num_groups=g, implementation=impl)

      plain = lambda x, s, b, g=groups: reference.group_norm_act(x, s, b, jax.nn.silu, num_groups=g)
    base = xla = math.nan
    paths = {
      "plain": plain,
      "jaxact": functools.partial(mine, impl=None),
      "jaxact pallas": functools.partial(mine, impl="pallas"),
    }
    for label, fn in paths.items():
      loss = lambda x, s, b, fn=fn: jnp.sum(fn(x, s, b).astype(jnp.float32))
      step = jax.jit(jax.grad(loss, (0, 1, 2)))
      try:
        temp = step.lower(x, scale, bias).compile().memory_analysis().temp_size_in_bytes / 2**20
        seconds = median_seconds_of(step, (x, scale, bias), runs)
      except Exception as e:
        ctx.log(f"time-norm-act {op} {label}\n{traceback.format_exc()}")
        ctx.verdict(f"time-norm-act {op} {label}", "ERROR", th.one_line(e))
        continue
      base = seconds if label == "plain" else base
      xla = seconds if label == "jaxact" else xla
      data[f"{op} {label}"] = [seconds, temp]
      lines.append(
        f"| {op} | {shape} | {label} | {1e3 * seconds:.2f} | {seconds / base:.2f} | {temp:.0f} |"
      )
      if label == "jaxact":
        _ratio_verdict(ctx, f"time-norm-act {op}", seconds, base, "plain")
      elif label == "jaxact pallas":
        _ratio_verdict(ctx, f"time-norm-act {op} pallas", seconds, xla, "jaxact xla")
  return lines, data


def median_seconds_of(step, args, runs: int) -> float:
  from benchmarks.gpu.common import median_seconds

  return median_seconds(step, [args], runs)


def time_norms(ctx: th.Context):
  """RMS norm and layer norm of a decoder's hidden states (bfloat16, 16384 x 4096), forward alone
  and forward + backward: jaxact.rms_norm / layer_norm against Flax's formula JAX differentiates
  (statistics in float32). jaxact's statistics are scaled by a power of two a row, which costs XLA's
  one-read norm fusion (compiled for an H100: x read 3 times forward, against 1); this measures
  what that costs a step."""
  import jaxact

  def plain_rms(x, s):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
    return (xf * r * s.astype(jnp.float32)).astype(x.dtype)

  def plain_layer(x, s):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, -1, keepdims=True)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mu), -1, keepdims=True) + 1e-6)
    return ((xf - mu) * r * s.astype(jnp.float32)).astype(x.dtype)

  ops = {
    "rms_norm": (plain_rms, lambda x, s: jaxact.rms_norm(x, s, epsilon=1e-6)),
    "layer_norm": (plain_layer, lambda x, s: jaxact.layer_norm(x, s, epsilon=1e-6)),
  }
  runs = 1 if ctx.small else min(ctx.runs, 5)
  shape = ctx.pick((16384, 4096), (8, 16))
  x = jax.random.normal(jax.random.key(73), shape, jnp.float32).astype(jnp.bfloat16)
  s = jnp.ones(shape[-1:], jnp.bfloat16)
  lines = ["| op | pass | path | ms | / plain |", "|---|---|---|---|---|"]
  data = {}
  for op, (plain, mine) in ops.items():
    for what in ("fwd", "fwd+bwd"):
      base = math.nan
      for label, fn in (("plain", plain), ("jaxact", mine)):
        if what == "fwd":
          step = jax.jit(fn)
        else:
          step = jax.jit(
            jax.grad(lambda x, s, fn=fn: jnp.sum(fn(x, s).astype(jnp.float32)), (0, 1))
          )
        try:
          seconds = median_seconds_of(step, (x, s), runs)
        except Exception as e:
          ctx.log(f"time-norms {op} {what} {label}\n{traceback.format_exc()}")
          ctx.verdict(f"time-norms {op} {what} {label}", "ERROR", th.one_line(e))
          continue
        base = seconds if label == "plain" else base
        data[f"{op} {what} {label}"] = seconds
        lines.append(f"| {op} | {what} | {label} | {1e3 * seconds:.3f} | {seconds / base:.2f} |")
        if label == "jaxact":
          _ratio_verdict(ctx, f"time-norms {op} {what}", seconds, base, "plain")
  return lines, data


def time_moe(ctx: th.Context):
  """A mixture-of-experts MLP (64 experts, top 8, SiLU gates) in bfloat16, forward and backward:
  jaxact.moe_mlp (``None``: XLA's ragged_dot; ``"pallas"``: the grouped Triton kernels) against
  the same routing and ``jax.lax.ragged_dot`` experts differentiated by JAX (the plain ragged
  composition), and that composition with tokamax's ``ragged_dot`` where tokamax imports; time and
  the compiled temp of each."""
  import jaxact

  runs = 1 if ctx.small else min(ctx.runs, 5)
  t, d, f, e, k = ctx.pick((16384, 2048, 1408, 64, 8), (32, 16, 8, 4, 2))
  keys = jax.random.split(jax.random.key(72), 5)
  bf = jnp.bfloat16
  x = jax.random.normal(keys[0], (t, d), jnp.float32).astype(bf)
  router = (d**-0.5 * jax.random.normal(keys[1], (d, e), jnp.float32)).astype(bf)
  w_gate, w_up = (
    (d**-0.5 * jax.random.normal(kk, (e, d, f), jnp.float32)).astype(bf) for kk in keys[2:4]
  )
  w_down = (f**-0.5 * jax.random.normal(keys[4], (e, f, d), jnp.float32)).astype(bf)

  def composition(ragged_dot):
    def plain(x, router, w_gate, w_up, w_down):
      scores = jax.nn.softmax(jnp.dot(x, router, preferred_element_type=jnp.float32), -1)
      weights, idx = jax.lax.top_k(scores, k)
      weights = weights / jnp.sum(weights, -1, keepdims=True)
      order = jnp.argsort(idx.reshape(-1), stable=True)
      sizes = jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)
      xs = x[order // k]
      a = ragged_dot(xs, w_gate, sizes)
      h = jax.nn.silu(a) * ragged_dot(xs, w_up, sizes)
      o = ragged_dot(h, w_down, sizes)[jnp.argsort(order)].reshape(t, k, d)
      return jnp.sum(o * weights[..., None].astype(o.dtype), 1)

    return plain

  def mine(implementation):
    def f(x, router, w_gate, w_up, w_down):
      return jaxact.moe_mlp(
        x, router, w_gate, w_up, w_down, top_k=k, implementation=implementation
      )[0]

    return f

  paths = {
    "plain": composition(jax.lax.ragged_dot),
    "jaxact": mine(None),
    "jaxact pallas": mine("pallas"),
  }
  try:
    import tokamax
  except ImportError:
    ctx.verdict("time-moe tokamax", "skipped", "tokamax does not import here")
  else:
    paths["tokamax"] = composition(tokamax.ragged_dot)

  lines = [
    f"MoE MLP, (T, D, F, E, k) = {(t, d, f, e, k)}, bfloat16",
    "",
    "| path | fwd+bwd ms | / plain | temp MiB |",
    "|---|---|---|---|",
  ]
  data, base = {}, math.nan
  args = (x, router, w_gate, w_up, w_down)
  for label, fn in paths.items():
    loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32))
    step = jax.jit(jax.grad(loss, tuple(range(5))))
    try:
      temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
      seconds = median_seconds_of(step, args, runs)
    except Exception as e:
      ctx.log(f"time-moe {label}\n{traceback.format_exc()}")
      ctx.verdict(f"time-moe {label}", "ERROR", th.one_line(e))
      continue
    base = seconds if label == "plain" else base
    data[label] = [seconds, temp]
    lines.append(f"| {label} | {1e3 * seconds:.1f} | {seconds / base:.2f} | {temp:.0f} |")
    if label != "plain":  # the verdicts: time-moe (jaxact's None), time-moe pallas, ...
      name = "time-moe" if label == "jaxact" else f"time-moe {label.removeprefix('jaxact ')}"
      _ratio_verdict(ctx, name, seconds, base, "plain")
  return lines, data
