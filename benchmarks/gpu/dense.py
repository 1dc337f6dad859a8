"""Dense layers on a GPU: the kernels checked against a float32 reference, timed and measured
against the XLA path and jax.nn (sections ``check``, ``time``, ``memory``, ``sweep``, ``train``,
``eltwise``, ``suite`` of ``python -m benchmarks gpu``)."""

from __future__ import annotations

import dataclasses
import math
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from benchmarks.gpu.common import (
  ROTATE,
  SHAPES,
  inputs,
  median_seconds,
  reference,
  rel,
  within,
)
from pallas_kernels import default_block_config
from pallas_kernels import dense_triton as pk_dense
from support import (
  epilogue,
  fused_dense,
  is_hopper,
  layer_paths,
  layer_step,
)


def check_cases(quick: bool = False):
  if quick:  # the large-tile configurations only
    return [
      (n, d, s)
      for n in ("identity", "relu", "gelu")
      for d in ("bfloat16", "float16")
      for s in ((4096, 1024, 1024), (2, 300, 257, 513))
    ]
  elementwise = [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise]
  cases = [(n, "bfloat16", (1000, 300, 513)) for n in elementwise]
  shapes = ((1, 1, 1), (37, 19, 23), (130, 70, 140), (4, 33, 100, 65), (4096, 1024, 1024))
  for dtype in ("float32", "bfloat16", "float16"):
    for name in ("identity", "relu", "gelu"):
      for shape in shapes:
        cases.append((name, dtype, shape))
  return cases


def check_case(name, dtype, shape, seed, impl="pallas"):
  """One layer through `impl` and through ``"xla"`` against the float32 reference: ``(errs,
  xla_errs, ok, error)``, the relative errors of y, dx, dw, db; `error` the kernel's exception in
  one line (its errors inf), else None."""
  x, w, b, g = inputs(shape, jnp.dtype(dtype), seed)
  up = [a.astype(jnp.float32) for a in (x, w, b, g)]
  ref = layer_step(reference(name))(*up)
  error = None
  try:
    got = layer_step(fused_dense(name, impl))(x, w, b, g)
    errs = [rel(a, r) for a, r in zip(got, ref, strict=False)]
  except Exception as e:
    errs = [math.inf] * 4
    traceback.print_exc()
    error = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    print(f"{name} {dtype} {shape}: {type(e).__name__}: {e}"[:2000], file=sys.stderr)
  xla = [
    rel(a, r) for a, r in zip(layer_step(fused_dense(name, "xla"))(x, w, b, g), ref, strict=False)
  ]
  return errs, xla, within(errs, xla, dtype), error


def section_check(cases, seed=0, impl="pallas"):
  rows = []
  failed = []
  for i, (name, dtype, shape) in enumerate(cases):
    errs, xla, ok, _ = check_case(name, dtype, shape, seed + i, impl)
    rows.append((name, dtype, shape, errs, xla, ok))
    print(f"check {name} {dtype} {shape}: {errs} (xla {xla}) {ok}", flush=True)
    if not ok:
      failed.append((name, dtype, shape))
  lines = [
    f"| activation | dtype | shape (…, K, N) | {impl} rel. err y, dx, dw, db | xla rel. err | ok |",
    "|---|---|---|---|---|---|",
  ]
  for name, dtype, shape, errs, xla, ok in rows:
    lines.append(
      f"| {name} | {dtype} | {shape} | {', '.join(f'{e:.1e}' for e in errs)} | "
      f"{', '.join(f'{e:.1e}' for e in xla)} | {'yes' if ok else '**NO**'} |"
    )
  return {"rows": [list(map(str, r)) for r in rows], "failed": [str(f) for f in failed]}, lines


def section_time(runs, activations=("relu", "gelu"), shapes=SHAPES):
  out = []
  lines = [
    "| M, K, N | activation | path | fwd (ms) | fwd TFLOP/s | fwd+bwd (ms) | fwd+bwd TFLOP/s |",
    "|---|---|---|---|---|---|---|",
  ]
  for m, k, n in shapes:
    sets = [inputs((m, k, n), jnp.bfloat16, s) for s in range(ROTATE)]
    flops = 2 * m * k * n
    for name in activations:
      for path, f in layer_paths(name).items():
        t_f = median_seconds(jax.jit(f), [s[:3] for s in sets], runs)
        t_s = median_seconds(layer_step(f), sets, runs)
        out.append(
          {"shape": [m, k, n], "activation": name, "path": path, "fwd_s": t_f, "step_s": t_s}
        )
        lines.append(
          f"| {m}, {k}, {n} | {name} | {path} | {1e3 * t_f:.3f} | {flops / t_f / 1e12:.0f} | "
          f"{1e3 * t_s:.3f} | {3 * flops / t_s / 1e12:.0f} |"
        )
  return out, lines


# ---------------------------------------------------------------------------------- memory


def section_memory(activations=("relu", "gelu"), shapes=SHAPES):
  out = []
  lines = [
    "| M, K, N | activation | path | step temp (MiB) | temp + outputs (MiB) |",
    "|---|---|---|---|---|",
  ]
  for m, k, n in shapes:
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,), (m, n))]
    for name in activations:
      for path, f in layer_paths(name).items():
        ma = layer_step(f).lower(*args).compile().memory_analysis()
        temp = ma.temp_size_in_bytes / 2**20
        total = (ma.temp_size_in_bytes + ma.output_size_in_bytes) / 2**20
        out.append({"shape": [m, k, n], "activation": name, "path": path, "temp_MiB": temp})
        lines.append(f"| {m}, {k}, {n} | {name} | {path} | {temp:.0f} | {total:.0f} |")
  return out, lines


# ----------------------------------------------------------------------------------- sweep

_CANDIDATES = (
  # rows, cols, step, warps, stages
  (128, 128, 64, 8, 3),
  (128, 128, 64, 4, 4),
  (128, 128, 32, 4, 4),
  (128, 256, 64, 8, 3),
  (256, 128, 64, 8, 3),
  (128, 256, 32, 8, 4),
  (64, 128, 64, 4, 4),
  (128, 64, 64, 4, 4),
  (64, 256, 64, 8, 3),
)


def section_sweep(runs, name="gelu", shapes=SHAPES, candidates=None):
  from pallas_kernels import Tiles

  spec_epi = epilogue(name)
  lines = [
    "| M, K, N | kernel | rows, cols, step, warps, stages | ms | TFLOP/s |",
    "|---|---|---|---|---|",
  ]
  out = []
  for m, k, n in shapes:
    sets = [inputs((m, k, n), jnp.bfloat16, s) for s in range(ROTATE)]
    base = default_block_config(
      (m, k, n), jnp.bfloat16, hopper=is_hopper(jax.devices()[0].device_kind)
    )
    flops = 2 * m * k * n
    for kernel in ("fwd", "dx", "dw"):
      for cand in candidates or _CANDIDATES:
        cfg = dataclasses.replace(base, **{kernel: Tiles(*cand)})
        if kernel == "fwd":

          def f(x, w, b, g, cfg=cfg):
            return pk_dense.dense_bias_act_fwd(x, w, b, epilogue=spec_epi, block_config=cfg)[0]

        else:

          def f(x, w, b, g, cfg=cfg):
            # g stands in for the (m, n) residual: the kernels' work does not depend on its values
            return pk_dense.dense_bias_act_bwd(
              x, w, g, g, epilogue=spec_epi, has_bias=True, block_config=cfg
            )

        try:
          t = median_seconds(jax.jit(f), sets, runs)
          msg = f"{1e3 * t:.3f} | {flops / t / 1e12 * (1 if kernel == 'fwd' else 2):.0f}"
        except Exception as e:
          t = None
          msg = f"failed: {type(e).__name__} | -"
          print(f"sweep {kernel} {cand}: {e}"[:1500], file=sys.stderr)
        out.append({"shape": [m, k, n], "kernel": kernel, "tiles": cand, "s": t})
        print(f"sweep {m},{k},{n} {kernel} {cand}: {msg}", flush=True)
        lines.append(f"| {m}, {k}, {n} | {kernel} (bwd total) | {cand} | {msg} |")
  lines.append("")
  lines.append(
    "dx and dw rows time the whole backward (both kernels) with only that kernel's tiles changed; "
    "their TFLOP/s count both products."
  )
  return out, lines


def section_suite(runs):
  """benchmarks/gpu/suite.py's layer and elementwise tables (`python -m benchmarks` on a GPU)."""
  from benchmarks.gpu import suite

  lines = [
    "| op | shape | activation | composition ms | jaxact xla ms | jaxact None ms | TFLOP/s |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in suite.layers(runs):
    lines.append(
      f"| {r.op} | {r.shape} | {r.activation} | {1e3 * r.composition:.3f} | "
      f"{1e3 * r.xla:.3f} | {1e3 * r.default:.3f} | {r.tflops:.0f} |"
    )
  lines += [
    "",
    "| activation | size | jax.nn fwd+bwd ms | jaxact fwd+bwd ms | jaxact GB/s |",
    "|---|---|---|---|---|",
  ]
  for r in suite.elementwise(runs):
    lines.append(
      f"| {r.activation} | {r.size} | {1e3 * r.jaxnn:.3f} | {1e3 * r.jaxact:.3f} | {r.gbps:.0f} |"
    )
  return {}, lines


# ----------------------------------------------------------------------------- training step


def section_train(runs, layers=8, m=8192, d=4096):
  """An MLP of `layers` bf16 dense layers, one jitted value_and_grad: time and compiled temp."""
  lines = [
    f"MLP {layers} x ({m}, {d}) x ({d}, {d}) bfloat16, jit(value_and_grad)",
    "",
    "| activation | path | step ms | step temp MiB |",
    "|---|---|---|---|",
  ]
  out = []
  keys = jax.random.split(jax.random.key(7), layers + 2)
  ws = [
    (jax.random.normal(k, (d, d), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    for k in keys[:layers]
  ]
  bs = [jnp.zeros((d,), jnp.bfloat16) for _ in range(layers)]
  xs = [jax.random.normal(k, (m, d), jnp.float32).astype(jnp.bfloat16) for k in keys[layers:]]
  kind = jax.devices()[0].device_kind
  implementations = ("xla", None, "pallas") + (("mosaic",) if is_hopper(kind) else ())
  for name in ("relu", "gelu"):
    paths = layer_paths(name, implementations)
    for path, layer in paths.items():

      def loss(params, x, layer=layer):
        h = x
        for w, b in params:
          h = layer(h, w, b)
        return jnp.sum(h.astype(jnp.float32))

      step = jax.jit(jax.value_and_grad(loss))
      params = list(zip(ws, bs, strict=True))
      try:
        t = median_seconds(step, [(params, x) for x in xs], runs)
        temp = step.lower(params, xs[0]).compile().memory_analysis().temp_size_in_bytes / 2**20
      except Exception as e:
        print(f"train {path} {name}: {e}"[:1500], file=sys.stderr)
        t, temp = math.nan, math.nan
      out.append({"activation": name, "path": path, "s": t, "temp_MiB": temp})
      lines.append(f"| {name} | {path} | {1e3 * t:.3f} | {temp:.0f} |")
      print(lines[-1], flush=True)
  return out, lines


def section_eltwise(runs, size=1 << 28):
  """Each activation inside one jit(value_and_grad(sum(act(x) * c))), bf16, jax.nn vs jaxact."""
  lines = [
    "| activation | jax.nn ms | jaxact ms | ratio | step temp MiB jax.nn / jaxact |",
    "|---|---|---|---|---|",
  ]
  out = []
  xs = [
    jax.random.normal(jax.random.key(i), (size,), jnp.float32).astype(jnp.bfloat16) * 3
    for i in range(2)
  ]
  c = jax.random.normal(jax.random.key(9), (size,), jnp.float32).astype(jnp.bfloat16)
  for name in ("relu", "sigmoid", "tanh", "softplus", "elu", "gelu", "silu"):
    res = []
    for f in (getattr(jax.nn, name), getattr(jaxact, name)):
      step = jax.jit(jax.value_and_grad(lambda x, c, f=f: jnp.sum((f(x) * c).astype(jnp.float32))))
      t = median_seconds(step, [(x, c) for x in xs], runs)
      temp = step.lower(xs[0], c).compile().memory_analysis().temp_size_in_bytes / 2**20
      res.append((t, temp))
    (t0, m0), (t1, m1) = res
    out.append({"activation": name, "jax.nn_s": t0, "jaxact_s": t1, "temp": [m0, m1]})
    lines.append(
      f"| {name} | {1e3 * t0:.3f} | {1e3 * t1:.3f} | {t1 / t0:.2f} | {m0:.0f} / {m1:.0f} |"
    )
    print(lines[-1], flush=True)
  return out, lines
