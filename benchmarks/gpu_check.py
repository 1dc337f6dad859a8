"""Check the Pallas kernels against the XLA path on a GPU, time both, and measure memory.

    python -m benchmarks.gpu_check [--out DIR] [--sections env,check,time,memory,sweep] [--runs 30]

Sections (each prints a markdown table; ``--out`` also gets ``gpu_check.md`` and ``.json``):

* ``env``: device, jax version, and the two ceilings measured here: device-to-device copy bandwidth
  (a jitted copy of 1 GiB, bytes read + written) and the bfloat16 matmul rate of ``jnp.dot``
  (8192 x 8192 x 8192).
* ``check``: ``jaxact.dense_bias_act(..., implementation="pallas")`` and ``"xla"`` against a float32
  reference (upcast inputs, ``precision=HIGHEST``, JAX autodiff of the spec table's plain formula),
  for the value and dx, dw, db; ``‖got - ref‖ / ‖ref‖`` of each. Every elementwise activation in
  bfloat16 on a ragged shape; identity/relu/gelu in float32, bfloat16 and float16 on tiny,
  ragged, batched and large shapes. Fresh random inputs for every case (never zeros). Fails when the
  kernels' error exceeds ``max(2 x XLA's, 1e-5)`` plus the dtype's rounding tolerance, or is
  not finite.
* ``time``: forward and forward+backward (``jit`` of ``jax.vjp`` and its pullback) of the jax.nn
  composition, jaxact ``"xla"`` and jaxact ``"pallas"`` in bfloat16 for the issue's shapes; the
  median over ``--runs`` repetitions of 5 back-to-back calls (each repetition ended by
  ``block_until_ready``), cycling through 4 input sets so no call reads what the last left in L2.
* ``memory``: compiled ``memory_analysis()`` of the jitted training step (temp bytes; and temp +
  outputs) for the same three paths.
* ``sweep``: each kernel's candidate tilings timed alone, for tuning ``_block_config``.
* ``hopper``: the Mosaic GPU forward (``pallas_kernels.hopper``): its y and z against a float32
  reference for every activation it accepts, its forward time against ``jnp.dot`` and the other
  paths, a tile sweep, and one layer's training step with each backward option.
* ``check-mosaic``: as ``check``, through ``jaxact.dense_bias_act(..., implementation="mosaic")``
  (values and dx, dw, db: the Mosaic GPU forward and backward kernels) for the shapes they take.
* ``hopper-bwd``: the Mosaic GPU backward kernels alone, for a few tilings, against XLA's
  backward (time and compiled temp memory).
* ``conv``, ``train``, ``eltwise``, ``suite``: the conv epilogue kernels, an 8-layer MLP step, lone
  activations, and the benchmark suite's GPU section.
* ``conv-bwd``: the conv epilogue's backward kernel alone, by row steps a program (db partial
  sums) and, for gelu, the derivative's sigmoid pair from two exps (the spec's) or one.

Needs a CUDA GPU of compute capability >= 8.0; elsewhere it exits with status 2, saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxact
from pallas_kernels import dense as pk_dense

SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096))
ROTATE = 4
INNER = 5


def _gpu():
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  return devices[0] if devices else None


def _block(tree):
  return jax.block_until_ready(tree)


def median_seconds(fn, arg_sets, runs: int) -> float:
  """Median wall time of one call of `fn`, from `runs` repetitions of INNER queued calls."""
  for args in arg_sets:
    _block(fn(*args))
  times = []
  for r in range(runs):
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[(r * INNER + i) % len(arg_sets)]) for i in range(INNER)]
    _block(outs)
    times.append((time.perf_counter() - t0) / INNER)
  return statistics.median(times)


# ------------------------------------------------------------------------------------- env


def section_env(gpu, runs):
  n = 1 << 28  # 1 GiB of float32
  sets = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(2)]
  copy = jax.jit(lambda a: a * 1.0)  # read once, write once
  t_copy = median_seconds(copy, [(s,) for s in sets], runs)
  gbps = 2 * 4 * n / t_copy / 1e9
  del sets
  d = 8192
  mats = [
    (
      jax.random.normal(jax.random.key(2 * i), (d, d), jnp.bfloat16),
      jax.random.normal(jax.random.key(2 * i + 1), (d, d), jnp.bfloat16),
    )
    for i in range(2)
  ]
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
  t_dot = median_seconds(dot, mats, runs)
  tflops = 2 * d**3 / t_dot / 1e12
  info = {
    "device": gpu.device_kind,
    "compute_capability": getattr(gpu, "compute_capability", "?"),
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "copy_GBps": gbps,
    "bf16_matmul_TFLOPs": tflops,
  }
  lines = [
    f"device: {info['device']} (compute capability {info['compute_capability']}), "
    f"jax {info['jax']}, {info['date']}",
    f"device-to-device copy (1 GiB, read + write): {gbps:.0f} GB/s",
    f"bf16 jnp.dot 8192^3: {tflops:.0f} TFLOP/s",
  ]
  return info, lines


# ----------------------------------------------------------------------------------- check


def _param_defaults(spec):
  return {p.name: p.default for p in spec.params}


def _reference(name):
  spec = jaxact.get_spec(name)
  params = _param_defaults(spec)

  def f(x, w, b):
    z = jnp.dot(x, w, precision=lax.Precision.HIGHEST) + b
    return spec.fn(z, **params)

  return f


def _inputs(shape, dtype, seed):
  *batch, k, n = shape
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (*batch, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  b = jax.random.normal(kb, (n,), jnp.float32).astype(dtype)
  g = jax.random.normal(kg, (*batch, n), jnp.float32).astype(dtype)
  return x, w, b, g


def _step(f):
  def step(x, w, b, g):
    y, pull = jax.vjp(f, x, w, b)
    return (y, *pull(g))

  return jax.jit(step)


def _jaxact(name, impl, precision=None):
  def f(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation=name, implementation=impl, precision=precision)

  return f


def _rel(got, ref):
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(got)):
    return math.inf
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


_TOL = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 5e-3}  # TF32 / half-precision operands


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


def section_check(cases, seed=0, impl="pallas"):
  rows = []
  failed = []
  for i, (name, dtype, shape) in enumerate(cases):
    x, w, b, g = _inputs(shape, jnp.dtype(dtype), seed + i)
    up = [a.astype(jnp.float32) for a in (x, w, b, g)]
    ref = _step(_reference(name))(*up)
    try:
      got = _step(_jaxact(name, impl))(x, w, b, g)
      errs = [_rel(a, r) for a, r in zip(got, ref, strict=False)]
    except Exception as e:
      errs = [math.inf] * 4
      traceback.print_exc()
      print(f"{name} {dtype} {shape}: {type(e).__name__}: {e}"[:2000], file=sys.stderr)
    xla = [_rel(a, r) for a, r in zip(_step(_jaxact(name, "xla"))(x, w, b, g), ref, strict=False)]
    ok = all(
      math.isfinite(e) and e <= max(2 * xe, 1e-5) + _TOL[dtype]
      for e, xe in zip(errs, xla, strict=False)
    )
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


# ------------------------------------------------------------------------------------ time


def _paths(name, implementations=("xla", "pallas", None)):
  """The jax.nn composition and jaxact's `implementations` of one dense layer, by label."""
  act = getattr(jax.nn, name)

  def composition(x, w, b):
    return act(jnp.dot(x, w) + b)

  return {"jax.nn": composition} | {f"jaxact {i}": _jaxact(name, i) for i in implementations}


def section_time(runs, activations=("relu", "gelu"), shapes=SHAPES):
  out = []
  lines = [
    "| M, K, N | activation | path | fwd (ms) | fwd TFLOP/s | fwd+bwd (ms) | fwd+bwd TFLOP/s |",
    "|---|---|---|---|---|---|---|",
  ]
  for m, k, n in shapes:
    sets = [_inputs((m, k, n), jnp.bfloat16, s) for s in range(ROTATE)]
    flops = 2 * m * k * n
    for name in activations:
      for path, f in _paths(name).items():
        t_f = median_seconds(jax.jit(f), [s[:3] for s in sets], runs)
        t_s = median_seconds(_step(f), sets, runs)
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
      for path, f in _paths(name).items():
        ma = _step(f).lower(*args).compile().memory_analysis()
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

  spec_epi = _epilogue(name)
  lines = [
    "| M, K, N | kernel | rows, cols, step, warps, stages | ms | TFLOP/s |",
    "|---|---|---|---|---|",
  ]
  out = []
  for m, k, n in shapes:
    sets = [_inputs((m, k, n), jnp.bfloat16, s) for s in range(ROTATE)]
    base = pk_dense._block_config((m, k, n), jnp.bfloat16)
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


def _epilogue(name):
  from pallas_kernels import Epilogue

  spec = jaxact.get_spec(name)
  params = _param_defaults(spec)
  if spec.residual == "output":
    return Epilogue(lambda z: spec.fn(z, **params), lambda y: spec.d_output(y, **params), "output")
  return Epilogue(
    lambda z: spec.fn(z, **params), lambda z: spec.derivative_from_input(z, **params), "input"
  )


# ------------------------------------------------------------------------------------ conv

CONV_X, CONV_W = (128, 56, 56, 256), (3, 3, 256, 256)


def _conv_inputs(x_shape, w_shape, dtype, seed):
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
  fan_in = int(np.prod(w_shape[:-1]))
  w = (jax.random.normal(kw, w_shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)
  b = jax.random.normal(kb, (w_shape[-1],), jnp.float32).astype(dtype)
  g = jax.random.normal(kg, (*x_shape[:-1], w_shape[-1]), jnp.float32).astype(dtype)
  return x, w, b, g


def _conv_paths(name):
  act = getattr(jax.nn, name)
  spec = jaxact.get_spec(name)
  params = _param_defaults(spec)
  dn = ("NHWC", "HWIO", "NHWC")

  def composition(x, w, b):
    return act(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn) + b)

  def reference(x, w, b):
    z = lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=dn, precision=lax.Precision.HIGHEST
    )
    return spec.fn(z + b, **params)

  def fused(impl):
    return lambda x, w, b: jaxact.conv_bias_act(
      x, w, b, activation=name, padding="SAME", implementation=impl
    )

  return reference, {
    "jax.nn": composition,
    "jaxact xla": fused("xla"),
    "jaxact pallas": fused("pallas"),
  }


def section_conv(runs, copy_gbps=None):
  from pallas_kernels import EltwiseTiles
  from pallas_kernels import bias_act as pk_eltwise

  lines = ["#### correctness (rel. err against float32 HIGHEST autodiff: y, dx, dw, db)", ""]
  lines += ["| activation | dtype | x, w | pallas | xla | ok |", "|---|---|---|---|---|---|"]
  failed = []
  for i, (name, dtype, xs, ws) in enumerate(
    [
      (n, d, (8, 28, 28, 64), (3, 3, 64, 96))
      for n in ("relu", "gelu", "tanh", "identity")
      for d in ("float32", "bfloat16")
    ]
    + [(n, "bfloat16", (3, 13, 13, 5), (3, 3, 5, 37)) for n in ("relu", "gelu")]
  ):
    x, w, b, g = _conv_inputs(xs, ws, jnp.dtype(dtype), 100 + i)
    reference, paths = _conv_paths(name)
    ref = _step(reference)(*(a.astype(jnp.float32) for a in (x, w, b, g)))
    got = [_rel(a, r) for a, r in zip(_step(paths["jaxact pallas"])(x, w, b, g), ref, strict=True)]
    xla = [_rel(a, r) for a, r in zip(_step(paths["jaxact xla"])(x, w, b, g), ref, strict=True)]
    ok = all(
      math.isfinite(e) and e <= max(2 * xe, 1e-5) + _TOL[dtype]
      for e, xe in zip(got, xla, strict=True)
    )
    if not ok:
      failed.append((name, dtype, xs))
    lines.append(
      f"| {name} | {dtype} | {xs} {ws} | {', '.join(f'{e:.1e}' for e in got)} | "
      f"{', '.join(f'{e:.1e}' for e in xla)} | {'yes' if ok else '**NO**'} |"
    )
    print(lines[-1], flush=True)

  # The kernels alone, against XLA's fusion of the same pass, on the convolution's output size.
  rows = int(np.prod(CONV_X[:-1]))
  c = CONV_W[-1]
  dt = jnp.bfloat16
  item = jnp.dtype(dt).itemsize
  zs = [
    jax.random.normal(jax.random.key(200 + s), (rows, c), jnp.float32).astype(dt) for s in range(2)
  ]
  bs = jax.random.normal(jax.random.key(210), (c,), jnp.float32).astype(dt)
  lines += ["", f"#### epilogue kernels alone, ({rows}, {c}) bfloat16; copy = {copy_gbps} GB/s", ""]
  lines += [
    "| pass | tiles (rows, cols, warps) | pallas ms | pallas GB/s | of copy | xla ms | xla GB/s |",
    "|---|---|---|---|---|---|---|",
  ]
  data = {"check_failed": [str(f) for f in failed], "kernels": []}
  for name in ("relu", "gelu"):
    ep = _epilogue(name)
    spec = jaxact.get_spec(name)
    params = _param_defaults(spec)
    n_fwd = 3 if ep.residual == "input" else 2  # arrays read + written
    n_bwd = 3

    def xla_fwd(z, b, spec=spec, params=params, ep=ep):
      v = z.astype(jnp.float32) + b.astype(jnp.float32)
      y = spec.fn(v, **params).astype(z.dtype)
      return (y, v.astype(z.dtype)) if ep.residual == "input" else y

    def xla_bwd(g, r, ep=ep):
      d = g.astype(jnp.float32) * ep.derivative(r.astype(jnp.float32))
      return d.astype(g.dtype), jnp.sum(d, axis=0)

    t_xf = median_seconds(jax.jit(xla_fwd), [(z, bs) for z in zs], runs)
    t_xb = median_seconds(jax.jit(xla_bwd), [(zs[0], zs[1]), (zs[1], zs[0])], runs)
    candidates = [None] + [
      EltwiseTiles(max(1, n // min(c, 256)), min(c, 256), wp)
      for n in (2048, 4096, 16384, 32768)
      for wp in (4, 8)
    ]
    for tiles in candidates:
      fwd = jax.jit(
        lambda z, b, t=tiles, ep=ep: pk_eltwise.bias_act_fwd(
          z, b, epilogue=ep, block_config=t, in_place=False
        )
      )
      bwd = jax.jit(
        lambda g, r, t=tiles, ep=ep: pk_eltwise.bias_act_bwd(
          g, r, epilogue=ep, has_bias=True, block_config=t, in_place=False
        )
      )
      try:
        t_f = median_seconds(fwd, [(z, bs) for z in zs], runs)
        t_b = median_seconds(bwd, [(zs[0], zs[1]), (zs[1], zs[0])], runs)
      except Exception as e:
        print(f"eltwise {name} {tiles}: {e}"[:1500], file=sys.stderr)
        continue
      label = (
        "default " + str(pk_eltwise._block_config((rows, c), dt))
        if tiles is None
        else str((tiles.rows, tiles.cols, tiles.num_warps))
      )
      for pas, t, n_arr, tx in (
        ("fwd " + name, t_f, n_fwd, t_xf),
        ("bwd " + name, t_b, n_bwd, t_xb),
      ):
        gbps = n_arr * rows * c * item / t / 1e9
        xg = n_arr * rows * c * item / tx / 1e9
        frac = f"{gbps / copy_gbps:.0%}" if copy_gbps else "-"
        lines.append(
          f"| {pas} | {label} | {1e3 * t:.3f} | {gbps:.0f} | {frac} | {1e3 * tx:.3f} | {xg:.0f} |"
        )
        data["kernels"].append({"pass": pas, "tiles": label, "s": t, "xla_s": tx, "GBps": gbps})
        print(lines[-1], flush=True)

  # The layer: fwd and fwd+bwd, and the training step's compiled temp memory.
  lines += ["", f"#### conv layer 3x3 SAME, x {CONV_X}, w {CONV_W}, bfloat16", ""]
  lines += ["| activation | path | fwd ms | fwd+bwd ms | step temp MiB |", "|---|---|---|---|---|"]
  sets = [_conv_inputs(CONV_X, CONV_W, dt, 300 + s) for s in range(2)]
  for name in ("relu", "gelu"):
    _, paths = _conv_paths(name)
    for path, f in paths.items():
      t_f = median_seconds(jax.jit(f), [s_[:3] for s_ in sets], runs)
      t_s = median_seconds(_step(f), sets, runs)
      ma = _step(f).lower(*sets[0]).compile().memory_analysis()
      lines.append(
        f"| {name} | {path} | {1e3 * t_f:.3f} | {1e3 * t_s:.3f} | "
        f"{ma.temp_size_in_bytes / 2**20:.0f} |"
      )
      data.setdefault("layer", []).append(
        {
          "activation": name,
          "path": path,
          "fwd_s": t_f,
          "step_s": t_s,
          "temp": ma.temp_size_in_bytes,
        }
      )
      print(lines[-1], flush=True)
  return data, lines


def _gelu_d_one_exp(x):
  """gelu's (tanh form) derivative as the spec table writes it, but with its sigmoid pair from
  one exp and one division (``e = exp(-|v|)``: ``1 / (1 + e)`` and ``e / (1 + e)``) instead of
  two ``logistic`` calls. Runs 10-11 measured the conv backward kernel with it at 72% -> 78% and
  73% -> 75% of the copy bandwidth; not adopted: in the Triton dense kernels its gelu backward
  spills registers on an A100 ((40, 40, 200) float16, tests/test_gpu_compile.py)."""
  xc = jnp.clip(x, -1e4, 1e4)
  c = math.sqrt(2 / math.pi)
  v = 2.0 * c * (xc + 0.044715 * xc**3)
  e = jnp.exp(-jnp.abs(v))
  big = 1.0 / (1.0 + e)
  small = e * big
  s, s_neg = jnp.where(v >= 0, big, small), jnp.where(v >= 0, small, big)
  return s + 2.0 * xc * s * s_neg * c * (1.0 + 3.0 * 0.044715 * xc * xc)


def section_conv_bwd(runs, copy_gbps=None):
  """The conv epilogue's backward kernel alone at the conv layer's output size: row tiles a
  program walks (``EltwiseTiles.steps``: fewer rows of db partial sums) and, for gelu, the spec's
  derivative against one whose sigmoid pair comes from one exp instead of two."""
  from pallas_kernels import bias_act as pk_eltwise

  rows, c = int(np.prod(CONV_X[:-1])), CONV_W[-1]
  dt = jnp.bfloat16
  zs = [
    jax.random.normal(jax.random.key(200 + s), (rows, c), jnp.float32).astype(dt) for s in range(2)
  ]
  sets = [(zs[0], zs[1]), (zs[1], zs[0])]
  nbytes = 3 * rows * c * jnp.dtype(dt).itemsize  # g, r read; dz written
  lines = [f"({rows}, {c}) bfloat16, dz and db; copy = {copy_gbps} GB/s", ""]
  lines += ["| activation | derivative | tiles x steps | ms | GB/s | of copy |"]
  lines += ["|---|---|---|---|---|---|"]
  out = {"rows": []}
  base = pk_eltwise._block_config((rows, c), dt)
  for name in ("relu", "gelu"):
    ep = _epilogue(name)
    forms = {"spec": ep}
    if name == "gelu":
      forms["one exp"] = dataclasses.replace(ep, derivative=_gelu_d_one_exp)
    for form, e in forms.items():
      for tiles in [base] + [dataclasses.replace(base, steps=k) for k in (4, 8, 16)]:
        f = jax.jit(
          lambda g, r, t=tiles, e=e: pk_eltwise.bias_act_bwd(
            g, r, epilogue=e, has_bias=True, block_config=t, in_place=False
          )
        )
        t = median_seconds(f, sets, runs)
        gbps = nbytes / t / 1e9
        frac = f"{gbps / copy_gbps:.0%}" if copy_gbps else "-"
        label = f"({tiles.rows}, {tiles.cols}, {tiles.num_warps}) x {tiles.steps}"
        lines.append(f"| {name} | {form} | {label} | {1e3 * t:.3f} | {gbps:.0f} | {frac} |")
        out["rows"].append({"act": name, "form": form, "tiles": label, "s": t, "GBps": gbps})
        print(lines[-1], flush=True)
  return out, lines


def section_suite(runs):
  """benchmarks/gpu.py's layer and elementwise tables (`python -m benchmarks` on a GPU)."""
  from benchmarks import gpu as suite

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
  for name in ("relu", "gelu"):
    act = getattr(jax.nn, name)
    paths = {
      "jax.nn": lambda h, w, b, act=act: act(jnp.dot(h, w) + b),
      "jaxact xla": lambda h, w, b, a=name: jaxact.dense_bias_act(
        h, w, b, activation=a, implementation="xla"
      ),
      "jaxact None": lambda h, w, b, a=name: jaxact.dense_bias_act(h, w, b, activation=a),
      "jaxact pallas": lambda h, w, b, a=name: jaxact.dense_bias_act(
        h, w, b, activation=a, implementation="pallas"
      ),
    }
    if "H100" in jax.devices()[0].device_kind or "H200" in jax.devices()[0].device_kind:
      paths["jaxact mosaic"] = lambda h, w, b, a=name: jaxact.dense_bias_act(
        h, w, b, activation=a, implementation="mosaic"
      )
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


# ---------------------------------------------------------------------------------- hopper

HOPPER_SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096), (4096, 4096, 4096), (8192, 8192, 8192))


def _xla_backward(ep, x, w, r, g):
  """``(dx, dw, db)`` as jaxact's XLA backward forms them: a dz fusion (the 16-bit dz behind a
  barrier for input-residual activations), db summed from it, cuBLAS dx and dw."""
  dz = (g.astype(jnp.float32) * ep.derivative(r.astype(jnp.float32))).astype(x.dtype)
  if ep.residual == "input":
    dz = lax.optimization_barrier(dz)
  db = jnp.sum(dz, 0, dtype=jnp.float32).astype(x.dtype)
  return jnp.dot(dz, w.T), jnp.dot(x.T, dz), db


def _hopper_layer(name, backward):
  """``act(x @ w + b)`` with the Hopper forward kernel and one of the backward options.

  backward: ``"xla"`` (dz by an XLA fusion, db summed from it, cuBLAS dx/dw), ``"eltwise"`` (dz and
  db by the one-pass Triton kernel, in place over g, then cuBLAS dx/dw) or ``"triton"`` (the fused
  Triton dx/dw kernels). The Mosaic GPU backward kernels are ``jaxact``'s ``"mosaic"``.
  """
  from pallas_kernels import bias_act_bwd, dense_bias_act_bwd
  from pallas_kernels.hopper import hopper_dense_bias_act_fwd

  ep = _epilogue(name)

  @jax.custom_vjp
  def f(x, w, b):
    return hopper_dense_bias_act_fwd(x, w, b, epilogue=ep)[0]

  def f_fwd(x, w, b):
    y, z = hopper_dense_bias_act_fwd(x, w, b, epilogue=ep)
    return y, (x, w, y if z is None else z)

  def f_bwd(res, g):
    x, w, r = res
    if backward == "triton":
      return dense_bias_act_bwd(x, w, r, g, epilogue=ep, has_bias=True)
    if backward == "xla":
      return _xla_backward(ep, x, w, r, g)
    dz, db = bias_act_bwd(g, r, epilogue=ep, has_bias=True, dz_dtype=x.dtype)
    dw = jnp.dot(x.T, dz)
    dx = jnp.dot(dz, w.T)
    return dx, dw, db.astype(x.dtype)

  f.defvjp(f_fwd, f_bwd)
  return f


def section_hopper(runs, dot_tflops=None, shapes=HOPPER_SHAPES, sweep=True):
  """The Mosaic GPU forward (pallas_kernels.hopper): check, time, sweep; backward options."""
  from pallas_kernels.hopper import HopperTiles, hopper_dense_bias_act_fwd, hopper_unsupported

  out = {"check": [], "fwd": [], "sweep": [], "step": []}
  lines = ["check: ‖got - ref‖/‖ref‖ of y (and z) against float32 HIGHEST, with XLA's error", ""]
  lines += [
    "| activation | dtype | M, K, N | hopper y | hopper z | xla y |",
    "|---|---|---|---|---|---|",
  ]
  failed = []
  elementwise = [n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise]
  cases = [(n, "bfloat16", (512, 320, 768)) for n in elementwise]
  cases += [
    (n, d, (1024, 1024, 2048))
    for n in ("identity", "relu", "gelu")
    for d in ("bfloat16", "float16")
  ]
  cases += [(n, "bfloat16", (2, 384, 256, 512)) for n in ("tanh", "gelu")]
  for i, (name, dtype, shape) in enumerate(cases):
    x, w, b, _ = _inputs(shape, jnp.dtype(dtype), 100 + i)
    ep = _epilogue(name)
    why = hopper_unsupported((int(np.prod(shape[:-2])), shape[-2], shape[-1]), x.dtype, x.dtype, ep)
    if why is not None:
      lines.append(f"| {name} | {dtype} | {shape} | unsupported: {why} | | |")
      continue
    up = [a.astype(jnp.float32) for a in (x, w, b)]
    zr = jnp.dot(up[0], up[1], precision=lax.Precision.HIGHEST) + up[2]
    yr = ep.fn(zr)
    try:
      y, z = jax.jit(lambda x, w, b, ep=ep: hopper_dense_bias_act_fwd(x, w, b, epilogue=ep))(
        x, w, b
      )
      ey = _rel(y, yr)
      ez = _rel(z, zr) if z is not None else 0.0
    except Exception as e:
      traceback.print_exc()
      ey = ez = math.inf
      print(f"hopper {name} {dtype} {shape}: {e}"[:2000], file=sys.stderr)
    ex = _rel(jaxact.dense_bias_act(x, w, b, activation=name, implementation="xla"), yr)
    ok = math.isfinite(ey) and ey <= max(2 * ex, 1e-5) + _TOL[dtype] and ez <= _TOL[dtype]
    if not ok:
      failed.append((name, dtype, shape))
    out["check"].append([name, dtype, shape, ey, ez, ex, ok])
    lines.append(
      f"| {name} | {dtype} | {shape} | {ey:.1e} | {ez:.1e} | {ex:.1e} |{'' if ok else ' **NO**'}"
    )
    print(lines[-1], flush=True)
  out["failed"] = [str(f) for f in failed]

  lines += ["", "forward alone, bf16 (ms, TFLOP/s; % of jnp.dot's 8192^3 rate measured in env)", ""]
  lines += [
    "| M, K, N | path | relu ms | relu TFLOP/s | gelu ms | gelu TFLOP/s |",
    "|---|---|---|---|---|---|",
  ]
  for m, k, n in shapes:
    sets = [_inputs((m, k, n), jnp.bfloat16, s)[:3] for s in range(ROTATE)]
    flops = 2 * m * k * n
    row = {}
    for path in ("jnp.dot (no epilogue)", "jax.nn", "jaxact xla", "hopper kernel", "triton kernel"):
      cells = []
      for name in ("relu", "gelu"):
        ep = _epilogue(name)
        act = getattr(jax.nn, name)
        f = {
          "jnp.dot (no epilogue)": lambda x, w, b: jnp.dot(x, w),
          "jax.nn": lambda x, w, b, act=act: act(jnp.dot(x, w) + b),
          "jaxact xla": _jaxact(name, "xla"),
          "hopper kernel": lambda x, w, b, ep=ep: hopper_dense_bias_act_fwd(x, w, b, epilogue=ep),
          "triton kernel": lambda x, w, b, ep=ep: pk_dense.dense_bias_act_fwd(x, w, b, epilogue=ep),
        }[path]
        try:
          t = median_seconds(jax.jit(f), sets, runs)
        except Exception as e:
          print(f"fwd {path} {name}: {e}"[:1500], file=sys.stderr)
          t = math.nan
        row[(path, name)] = t
        pct = f" ({100 * flops / t / 1e12 / dot_tflops:.0f}%)" if dot_tflops else ""
        cells.append(f"{1e3 * t:.3f} | {flops / t / 1e12:.0f}{pct}")
      out["fwd"].append(
        {
          "shape": [m, k, n],
          "path": path,
          "relu_s": row[(path, "relu")],
          "gelu_s": row[(path, "gelu")],
        }
      )
      lines.append(f"| {m}, {k}, {n} | {path} | {' | '.join(cells)} |")
      print(lines[-1], flush=True)

  if sweep:
    lines += ["", "tile sweep (hopper forward, gelu: y and z written), bf16", ""]
    lines += [
      "| M, K, N | tile_m, tile_n, tile_k, stages, epi_m, epi_n, snake | ms | TFLOP/s |",
      "|---|---|---|---|",
    ]
    cands = [
      HopperTiles(128, 128, 64, 4, 64, 64, 8),
      HopperTiles(128, 128, 64, 3, 64, 64, 8),
      HopperTiles(128, 128, 64, 4, 64, 64, 4),
      HopperTiles(128, 128, 64, 4, 64, 64, 16),
      HopperTiles(128, 128, 64, 4, 64, 128, 8),
      HopperTiles(128, 64, 64, 5, 64, 64, 8),
      HopperTiles(64, 128, 64, 5, 64, 64, 8),
      HopperTiles(128, 128, 32, 6, 64, 64, 8),
    ]
    for m, k, n in shapes[:2]:
      sets = [_inputs((m, k, n), jnp.bfloat16, s)[:3] for s in range(ROTATE)]
      for name in ("relu", "gelu"):
        ep = _epilogue(name)
        for c in cands:
          f = lambda x, w, b, c=c, ep=ep: hopper_dense_bias_act_fwd(x, w, b, epilogue=ep, tiles=c)
          try:
            t = median_seconds(jax.jit(f), sets, runs)
            msg = f"{1e3 * t:.3f} | {2 * m * k * n / t / 1e12:.0f}"
          except Exception as e:
            t, msg = None, f"failed: {type(e).__name__}: {str(e)[:80]} | -"
          out["sweep"].append(
            {"shape": [m, k, n], "act": name, "tiles": dataclasses.astuple(c), "s": t}
          )
          lines.append(f"| {m}, {k}, {n} {name} | {dataclasses.astuple(c)} | {msg} |")
          print(lines[-1], flush=True)

  lines += [
    "",
    "training step of one layer, bf16: forward + backward options (ms; step temp MiB)",
    "",
  ]
  lines += [
    "| M, K, N | activation | path | fwd+bwd ms | TFLOP/s | temp MiB |",
    "|---|---|---|---|---|---|",
  ]
  for m, k, n in shapes[:2]:
    sets = [_inputs((m, k, n), jnp.bfloat16, s) for s in range(ROTATE)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,), (m, n))]
    for name in ("relu", "gelu"):
      act = getattr(jax.nn, name)
      paths = {
        "jax.nn": lambda x, w, b, act=act: act(jnp.dot(x, w) + b),
        "jaxact xla": _jaxact(name, "xla"),
        "hopper fwd + xla bwd": _hopper_layer(name, "xla"),
        "hopper fwd + eltwise kernel + cuBLAS": _hopper_layer(name, "eltwise"),
        "hopper fwd + triton bwd": _hopper_layer(name, "triton"),
        "hopper fwd + mosaic bwd (jaxact 'mosaic')": _jaxact(name, "mosaic"),
      }
      for path, f in paths.items():
        try:
          step = _step(f)
          t = median_seconds(step, sets, runs)
          temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
        except Exception as e:
          print(f"step {path} {name}: {e}"[:1500], file=sys.stderr)
          t, temp = math.nan, math.nan
        out["step"].append(
          {"shape": [m, k, n], "activation": name, "path": path, "s": t, "temp_MiB": temp}
        )
        lines.append(
          f"| {m}, {k}, {n} | {name} | {path} | {1e3 * t:.3f} | "
          f"{6 * m * k * n / t / 1e12:.0f} | {temp:.0f} |"
        )
        print(lines[-1], flush=True)
  return out, lines


def _bwd_tiling(t) -> str:
  """A backward tiling in a table cell: warpgroups, per-warpgroup dx and dw tiles, stages."""
  return (
    f"(wgs {t.wgs}; dx {t.dx_m}x{t.dx_k} by {t.dx_n}, {t.dx_stages} st; "
    f"dw {t.dw_k}x{t.dw_n} by {t.dw_m}, {t.dw_stages} st)"
  )


def section_hopper_bwd(runs, shapes=HOPPER_SHAPES[:2]):
  """The Mosaic GPU backward kernels alone against XLA's backward, for a few tilings."""
  from pallas_kernels.hopper import hopper_bwd_variants, hopper_dense_bias_act_bwd

  out = {"bwd": []}
  lines = ["backward alone, bf16: dx, dw, db from (x, w, residual, g) (ms; temp MiB)", ""]
  lines += [
    "| M, K, N | activation | path | ms | TFLOP/s | temp MiB |",
    "|---|---|---|---|---|---|",
  ]

  for m, k, n in shapes:
    for name in ("relu", "gelu"):
      ep = _epilogue(name)
      sets = []
      for s in range(ROTATE):
        x, w, b, g = _inputs((m, k, n), jnp.bfloat16, s)
        z = jnp.dot(x, w) + b
        sets.append((x, w, (ep.fn(z) if ep.residual == "output" else z).astype(x.dtype), g))
      args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in sets[0]]
      paths = {"xla (dz fusion + cuBLAS)": functools.partial(_xla_backward, ep)}
      for variant, t in hopper_bwd_variants((m, k, n), ep.residual != "none").items():
        paths[f"mosaic {variant} {_bwd_tiling(t)}"] = lambda x, w, r, g, t=t, ep=ep: (
          hopper_dense_bias_act_bwd(x, w, r, g, epilogue=ep, has_bias=True, tiles=t)
        )
      for path, f in paths.items():
        try:
          fj = jax.jit(f)
          t = median_seconds(fj, sets, runs)
          temp = fj.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
        except Exception as e:
          print(f"bwd {path} {name}: {e}"[:1500], file=sys.stderr)
          t, temp = math.nan, math.nan
        out["bwd"].append({"shape": [m, k, n], "act": name, "path": path, "s": t, "temp": temp})
        lines.append(
          f"| {m}, {k}, {n} | {name} | {path} | {1e3 * t:.3f} | "
          f"{4 * m * k * n / t / 1e12:.0f} | {temp:.0f} |"
        )
        print(lines[-1], flush=True)
  return out, lines


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=30)
  parser.add_argument("--sections", default="env,check,time,memory")
  parser.add_argument("--out", default=None)
  parser.add_argument("--quick-check", action="store_true", help="check large tiles only")
  args = parser.parse_args(argv)
  gpu = _gpu()
  if gpu is None:
    print(
      "benchmarks.gpu_check needs a CUDA GPU; this machine has none (jax sees: "
      f"{', '.join(sorted({d.platform for d in jax.devices()}))}). On CPU the kernels are tested "
      "in interpret mode by tests/test_pallas.py instead.",
      file=sys.stderr,
    )
    return 2
  cc = float(getattr(gpu, "compute_capability", "0"))
  if cc < 8.0:
    print(
      f"{gpu.device_kind} has compute capability {cc}; the kernels need >= 8.0", file=sys.stderr
    )
    return 2
  sections = args.sections.split(",")
  results, report = {}, []
  ok = True

  def emit(title, data, lines):
    results[title] = data
    report.extend([f"### {title}", "", *lines, ""])
    print("\n".join([f"### {title}", "", *lines, ""]), flush=True)
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "gpu_check.md"), "w") as fh:
        fh.write("\n".join(report))
      with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)

  for section in sections:
    t0 = time.perf_counter()
    try:
      if section == "env":
        emit("env", *section_env(gpu, args.runs))
      elif section == "check":
        data, lines = section_check(check_cases(args.quick_check))
        ok &= not data["failed"]
        emit("check", data, lines)
      elif section == "time":
        emit("time", *section_time(args.runs))
      elif section == "memory":
        emit("memory", *section_memory())
      elif section == "sweep":
        emit("sweep", *section_sweep(args.runs))
      elif section == "conv":
        data, lines = section_conv(args.runs, results.get("env", {}).get("copy_GBps"))
        ok &= not data["check_failed"]
        emit("conv", data, lines)
      elif section == "conv-bwd":
        emit("conv-bwd", *section_conv_bwd(args.runs, results.get("env", {}).get("copy_GBps")))
      elif section == "train":
        emit("train", *section_train(args.runs))
      elif section == "eltwise":
        emit("eltwise", *section_eltwise(args.runs))
      elif section == "check-mosaic":
        # elu and softplus: expm1 / log1p, computed from exp / log in the kernels. With
        # --quick-check, batch dimensions in bfloat16 for three of them only (~150 s on an H100).
        names = ("identity", "relu", "tanh", "gelu", "silu", "hard_silu", "elu", "softplus")
        batched = ("identity", "relu", "gelu") if args.quick_check else names
        cases = [(n, d, (1024, 1024, 2048)) for n in names for d in ("bfloat16", "float16")]
        cases += [
          (n, d, (2, 512, 256, 768))
          for n in batched
          for d in (("bfloat16",) if args.quick_check else ("bfloat16", "float16"))
        ]
        data, lines = section_check(cases, impl="mosaic")
        ok &= not data["failed"]
        emit("check-mosaic", data, lines)
      elif section == "hopper":
        data, lines = section_hopper(
          args.runs, results.get("env", {}).get("bf16_matmul_TFLOPs"), sweep=not args.quick_check
        )
        ok &= not data["failed"]
        emit("hopper", data, lines)
      elif section == "hopper-bwd":
        emit("hopper-bwd", *section_hopper_bwd(args.runs))
      elif section == "suite":
        emit("suite", *section_suite(args.runs))
      else:
        parser.error(f"unknown section {section!r}")
    except Exception:
      ok = False
      traceback.print_exc()
    print(f"[{section}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
