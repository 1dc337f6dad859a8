"""The Hopper kernels on a GPU (sections ``hopper``, ``check-mosaic`` and ``hopper-bwd`` of
``python -m benchmarks gpu``): the Mosaic GPU forward checked, timed against ``jnp.dot`` and
the other paths, its tiles swept, one layer's step with each backward option; the Mosaic GPU
backward kernels alone, for the tilings ``support.hopper_bwd_variants`` lists, against XLA's."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxact
from benchmarks.gpu.common import ROTATE, TOL, inputs, median_seconds, rel
from pallas_kernels import dense_triton as pk_dense
from support import epilogue, fused_dense, hopper_bwd_variants, layer_step

HOPPER_SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096), (4096, 4096, 4096), (8192, 8192, 8192))


def _forward(*args, **kwargs):
  """The Mosaic GPU forward on this process's GPU (one persistent CTA per SM)."""
  from pallas_kernels.dense_mosaic import hopper_dense_bias_act_fwd

  return hopper_dense_bias_act_fwd(*args, num_sms=jax.devices()[0].core_count, **kwargs)


def mosaic_check_cases(quick: bool = False):
  """``check-mosaic``'s cases: every activation the kernels take, bfloat16 and float16, and batch
  dimensions. elu and softplus: expm1 / log1p, computed from exp / log in the kernels. `quick`:
  batch dimensions in bfloat16 for three of them only (~150 s on an H100)."""
  names = ("identity", "relu", "tanh", "gelu", "silu", "hard_silu", "elu", "softplus")
  batched = ("identity", "relu", "gelu") if quick else names
  cases = [(n, d, (1024, 1024, 2048)) for n in names for d in ("bfloat16", "float16")]
  cases += [
    (n, d, (2, 512, 256, 768))
    for n in batched
    for d in (("bfloat16",) if quick else ("bfloat16", "float16"))
  ]
  return cases


def xla_backward(ep, x, w, r, g):
  """``(dx, dw, db)`` as jaxact's XLA backward forms them: a dz fusion (the 16-bit dz behind a
  barrier for input-residual activations), db summed from it, cuBLAS dx and dw."""
  dz = (g.astype(jnp.float32) * ep.derivative(r.astype(jnp.float32))).astype(x.dtype)
  if ep.residual == "input":
    dz = lax.optimization_barrier(dz)
  db = jnp.sum(dz, 0, dtype=jnp.float32).astype(x.dtype)
  return jnp.dot(dz, w.T), jnp.dot(x.T, dz), db


def hopper_layer(name, backward):
  """``act(x @ w + b)`` with the Hopper forward kernel and one of the backward options.

  backward: ``"xla"`` (dz by an XLA fusion, db summed from it, cuBLAS dx/dw), ``"eltwise"`` (dz and
  db by the one-pass Triton kernel, in place over g, then cuBLAS dx/dw) or ``"triton"`` (the fused
  Triton dx/dw kernels). The Mosaic GPU backward kernels are ``jaxact``'s ``"mosaic"``.
  """
  from pallas_kernels import bias_act_bwd, dense_bias_act_bwd

  ep = epilogue(name)

  @jax.custom_vjp
  def f(x, w, b):
    return _forward(x, w, b, epilogue=ep)[0]

  def f_fwd(x, w, b):
    y, z = _forward(x, w, b, epilogue=ep)
    return y, (x, w, y if z is None else z)

  def f_bwd(res, g):
    x, w, r = res
    if backward == "triton":
      return dense_bias_act_bwd(x, w, r, g, epilogue=ep, has_bias=True)
    if backward == "xla":
      return xla_backward(ep, x, w, r, g)
    dz, db = bias_act_bwd(g, r, epilogue=ep, has_bias=True, dz_dtype=x.dtype)
    dw = jnp.dot(x.T, dz)
    dx = jnp.dot(dz, w.T)
    return dx, dw, db.astype(x.dtype)

  f.defvjp(f_fwd, f_bwd)
  return f


def section_hopper(runs, dot_tflops=None, shapes=HOPPER_SHAPES, sweep=True):
  """The Mosaic GPU forward (pallas_kernels.dense_mosaic): check, time, sweep; backward options."""
  from pallas_kernels.dense_mosaic import HopperTiles, hopper_unsupported

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
    x, w, b, _ = inputs(shape, jnp.dtype(dtype), 100 + i)
    ep = epilogue(name)
    why = hopper_unsupported((int(np.prod(shape[:-2])), shape[-2], shape[-1]), x.dtype, x.dtype, ep)
    if why is not None:
      lines.append(f"| {name} | {dtype} | {shape} | unsupported: {why} | | |")
      continue
    up = [a.astype(jnp.float32) for a in (x, w, b)]
    zr = jnp.dot(up[0], up[1], precision=lax.Precision.HIGHEST) + up[2]
    yr = ep.fn(zr)
    try:
      y, z = jax.jit(lambda x, w, b, ep=ep: _forward(x, w, b, epilogue=ep))(x, w, b)
      ey = rel(y, yr)
      ez = rel(z, zr) if z is not None else 0.0
    except Exception as e:
      traceback.print_exc()
      ey = ez = math.inf
      print(f"hopper {name} {dtype} {shape}: {e}"[:2000], file=sys.stderr)
    ex = rel(jaxact.dense_bias_act(x, w, b, activation=name, implementation="xla"), yr)
    ok = math.isfinite(ey) and ey <= max(2 * ex, 1e-5) + TOL[dtype] and ez <= TOL[dtype]
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
    sets = [inputs((m, k, n), jnp.bfloat16, s)[:3] for s in range(ROTATE)]
    flops = 2 * m * k * n
    row = {}
    for path in ("jnp.dot (no epilogue)", "jax.nn", "jaxact xla", "hopper kernel", "triton kernel"):
      cells = []
      for name in ("relu", "gelu"):
        ep = epilogue(name)
        act = getattr(jax.nn, name)
        f = {
          "jnp.dot (no epilogue)": lambda x, w, b: jnp.dot(x, w),
          "jax.nn": lambda x, w, b, act=act: act(jnp.dot(x, w) + b),
          "jaxact xla": fused_dense(name, "xla"),
          "hopper kernel": lambda x, w, b, ep=ep: _forward(x, w, b, epilogue=ep),
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
      sets = [inputs((m, k, n), jnp.bfloat16, s)[:3] for s in range(ROTATE)]
      for name in ("relu", "gelu"):
        ep = epilogue(name)
        for c in cands:
          f = lambda x, w, b, c=c, ep=ep: _forward(x, w, b, epilogue=ep, tiles=c)
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
    sets = [inputs((m, k, n), jnp.bfloat16, s) for s in range(ROTATE)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,), (m, n))]
    for name in ("relu", "gelu"):
      act = getattr(jax.nn, name)
      paths = {
        "jax.nn": lambda x, w, b, act=act: act(jnp.dot(x, w) + b),
        "jaxact xla": fused_dense(name, "xla"),
        "hopper fwd + xla bwd": hopper_layer(name, "xla"),
        "hopper fwd + eltwise kernel + cuBLAS": hopper_layer(name, "eltwise"),
        "hopper fwd + triton bwd": hopper_layer(name, "triton"),
        "hopper fwd + mosaic bwd (jaxact 'mosaic')": fused_dense(name, "mosaic"),
      }
      for path, f in paths.items():
        try:
          step = layer_step(f)
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


def bwd_tiling(t) -> str:
  """A backward tiling in a table cell: warpgroups, per-warpgroup dx and dw tiles, stages."""
  return (
    f"(wgs {t.wgs}; dx {t.dx_m}x{t.dx_k} by {t.dx_n}, {t.dx_stages} st; "
    f"dw {t.dw_k}x{t.dw_n} by {t.dw_m}, {t.dw_stages} st)"
  )


def section_hopper_bwd(runs, shapes=HOPPER_SHAPES[:2]):
  """The Mosaic GPU backward kernels alone against XLA's backward, for a few tilings."""
  from pallas_kernels.dense_mosaic_bwd import hopper_dense_bias_act_bwd

  out = {"bwd": []}
  lines = ["backward alone, bf16: dx, dw, db from (x, w, residual, g) (ms; temp MiB)", ""]
  lines += [
    "| M, K, N | activation | path | ms | TFLOP/s | temp MiB |",
    "|---|---|---|---|---|---|",
  ]

  for m, k, n in shapes:
    for name in ("relu", "gelu"):
      ep = epilogue(name)
      sets = []
      for s in range(ROTATE):
        x, w, b, g = inputs((m, k, n), jnp.bfloat16, s)
        z = jnp.dot(x, w) + b
        sets.append((x, w, (ep.fn(z) if ep.residual == "output" else z).astype(x.dtype), g))
      args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in sets[0]]
      paths = {"xla (dz fusion + cuBLAS)": functools.partial(xla_backward, ep)}
      for variant, t in hopper_bwd_variants((m, k, n), ep.residual != "none").items():
        paths[f"mosaic {variant} {bwd_tiling(t)}"] = lambda x, w, r, g, t=t, ep=ep: (
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
