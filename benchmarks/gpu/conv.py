"""Convolution epilogues on a GPU (sections ``conv`` and ``conv-bwd`` of
``python -m benchmarks gpu``): the conv layer checked against a float32 reference, the
epilogue kernels alone against XLA's fusion of the same pass and the copy bandwidth, and the layer's
step (time and compiled temp memory)."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from benchmarks.gpu.common import (
  conv_inputs,
  conv_paths,
  conv_reference,
  median_seconds,
  rel,
  within,
)
from pallas_kernels import EltwiseTiles, default_tiles
from pallas_kernels import bias_act_triton as pk_eltwise
from support import epilogue, layer_step, param_defaults

CONV_X, CONV_W = (128, 56, 56, 256), (3, 3, 256, 256)


def check_case(name, dtype, x_shape, w_shape, seed, impl="pallas"):
  """One 3x3 SAME conv layer through `impl` and ``"xla"`` against the float32 reference:
  ``(errs, xla_errs, ok)`` of y, dx, dw, db."""
  x, w, b, g = conv_inputs(x_shape, w_shape, jnp.dtype(dtype), seed)
  paths = conv_paths(name, ("xla", impl))
  ref = layer_step(conv_reference(name))(*(a.astype(jnp.float32) for a in (x, w, b, g)))

  def errs(path):
    return [rel(a, r) for a, r in zip(layer_step(paths[path])(x, w, b, g), ref, strict=True)]

  got, xla = errs(f"jaxact {impl}"), errs("jaxact xla")
  return got, xla, within(got, xla, dtype)


def section_conv(runs, copy_gbps=None):
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
    got, xla, ok = check_case(name, dtype, xs, ws, 100 + i)
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
    ep = epilogue(name)
    spec = jaxact.get_spec(name)
    params = param_defaults(spec)
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
        "default " + str(default_tiles((rows, c), dt))
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
  sets = [conv_inputs(CONV_X, CONV_W, dt, 300 + s) for s in range(2)]
  for name in ("relu", "gelu"):
    paths = conv_paths(name)
    for path, f in paths.items():
      t_f = median_seconds(jax.jit(f), [s_[:3] for s_ in sets], runs)
      t_s = median_seconds(layer_step(f), sets, runs)
      ma = layer_step(f).lower(*sets[0]).compile().memory_analysis()
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


def section_conv_bwd(runs, copy_gbps=None):
  """The conv epilogue's backward kernel alone at the conv layer's output size, by the row tiles a
  program walks (``EltwiseTiles.steps``: fewer rows of db partial sums)."""
  rows, c = int(np.prod(CONV_X[:-1])), CONV_W[-1]
  dt = jnp.bfloat16
  zs = [
    jax.random.normal(jax.random.key(200 + s), (rows, c), jnp.float32).astype(dt) for s in range(2)
  ]
  sets = [(zs[0], zs[1]), (zs[1], zs[0])]
  nbytes = 3 * rows * c * jnp.dtype(dt).itemsize  # g, r read; dz written
  lines = [f"({rows}, {c}) bfloat16, dz and db; copy = {copy_gbps} GB/s", ""]
  lines += ["| activation | tiles x steps | ms | GB/s | of copy |"]
  lines += ["|---|---|---|---|---|"]
  out = {"rows": []}
  base = default_tiles((rows, c), dt)
  for name in ("relu", "gelu"):
    ep = epilogue(name)
    for tiles in [base] + [dataclasses.replace(base, steps=k) for k in (4, 8, 16)]:
      f = jax.jit(
        lambda g, r, t=tiles, ep=ep: pk_eltwise.bias_act_bwd(
          g, r, epilogue=ep, has_bias=True, block_config=t, in_place=False
        )
      )
      t = median_seconds(f, sets, runs)
      gbps = nbytes / t / 1e9
      frac = f"{gbps / copy_gbps:.0%}" if copy_gbps else "-"
      label = f"({tiles.rows}, {tiles.cols}, {tiles.num_warps}) x {tiles.steps}"
      lines.append(f"| {name} | {label} | {1e3 * t:.3f} | {gbps:.0f} | {frac} |")
      out["rows"].append({"act": name, "tiles": label, "s": t, "GBps": gbps})
      print(lines[-1], flush=True)
  return out, lines
