"""Few-bit derivative codes on a GPU (section ``codes`` of ``python -m benchmarks gpu``).

``residual_bits=8|4|2`` keeps ``act'(z)`` coded instead of ``z``. Four tables:

1. correctness: gelu and silu layers with each code through ``"pallas"`` (dense and the 3x3
   convolution) and ``"mosaic"`` (dense, Hopper only) against ``"xla"`` on inputs whose
   pre-activation is exact in bfloat16: y and the kept codes equal (8-bit codes within one step:
   ``act'`` through the GPU's ``exp``/``tanh``), dx, dw, db within :data:`GRAD_TOL` of XLA's;
2. the convolution epilogue kernels alone at the ``conv`` section's output size: forward (``z, b ->
   y, kept``) and backward (``g, kept -> dz, db``), exact (z kept) and each code, GB/s of the bytes
   each really moves (a 4-bit code is half a byte an element; the backward's db partial sums are
   written and read back) as a fraction of ``env``'s copy bandwidth (the issue asks >= 80%), and
   XLA's fusion of the same pass;
3. the Mosaic GPU forward alone (Hopper only) writing y and z or y and each code, against
   ``jnp.dot``;
4. one layer's training step (``layer_step``: forward and backward from a cotangent), dense and
   convolution, exact and each code, for ``"xla"``, ``None``, ``"pallas"`` and, on Hopper,
   ``"mosaic"``: ms, against the same path's exact step, and compiled temp memory.

What it checks and times is built in ``support.gpu_codes``, which
``tests/codes/test_gpu_codes_section.py`` runs on CPU (interpret mode, small shapes) and lowers for
an abstract H100.
"""

from __future__ import annotations

import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import ROTATE, conv_inputs, inputs, median_seconds
from benchmarks.gpu.conv import CONV_W, CONV_X
from support import gpu_codes as gc
from support import layer_step

CODED = gc.BITS[1:]
DENSE = (8192, 4096, 4096)
# Correctness shapes: K (the conv's fan-in, 3 x 3 x 7) at most 64, so that z stays exact.
CHECK_DENSE = (4096, 64, 2048)
CHECK_CONV = ((8, 28, 28, 7), (3, 3, 7, 256))


def _short(e: Exception | str, n: int = 160) -> str:
  text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
  return text.splitlines()[0][:n] if text else "?"


def check_table(hopper: bool, dense=CHECK_DENSE, conv=CHECK_CONV, names=gc.NAMES, bits=CODED):
  """Table 1: each kernel path against XLA's, the same code kept (:func:`gc.check`)."""
  lines = [
    "#### correctness: kernels against implementation='xla', exact pre-activation, bfloat16",
    "",
  ]
  lines += [
    "| op | path | activation | code | x, w | y differ | codes differ (max step) | "
    "rel. err vs xla dx, dw, db | ok |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  cases = [("dense", "pallas"), ("conv", "pallas")]
  if hopper:
    cases.append(("dense", "mosaic"))
  else:
    lines.append(
      "| dense | mosaic | skipped: not a Hopper GPU (the Mosaic GPU kernels need sm_90) |"
    )
  rows, failed = [], []
  for i, (op, impl) in enumerate(cases):
    args = (
      gc.exact_dense(dense, jnp.bfloat16, 10 + i)
      if op == "dense"
      else gc.exact_conv(*conv, jnp.bfloat16, 10 + i)
    )
    for name in names:
      for b in bits:
        c = gc.check(op, impl, name, b, args)
        if c.error is not None:
          cells = f"failed: {_short(c.error)} | | |"
        else:
          cells = (
            f"{c.y_diff} ({c.y_ulps:.1f} eps) | {c.code_diff} of {c.code_count} ({c.code_step}) | "
            f"{', '.join(f'{e:.1e}' for e in c.errs)}"
          )
        lines.append(
          f"| {op} | {impl} | {name} | {gc.label(b)} | {c.shape[0]} {c.shape[1]} | {cells} | "
          f"{'yes' if c.ok else '**NO**'} |"
        )
        print(lines[-1], flush=True)
        if not c.ok:
          failed.append(f"{op} {impl} {name} {gc.label(b)}: {c.error or c}")
        rows.append(vars(c) | {"ok": c.ok})
  return {"check": rows, "check_failed": failed}, lines


def kernel_table(runs, copy_gbps, rows: int, c: int, name="gelu", bits=gc.BITS, interpret=False):
  """Table 2: the conv epilogue kernels alone, exact and each code, and XLA's fusion of each
  (`interpret`: the kernels in interpret mode, to try the table on CPU)."""
  lines = ["", f"#### conv epilogue kernels alone, {name}, ({rows}, {c}) bfloat16", ""]
  lines += [f"copy bandwidth (env): {f'{copy_gbps:.0f} GB/s' if copy_gbps else 'not measured'}", ""]
  lines += [
    "| pass | kept | MB moved | pallas ms | pallas GB/s | of copy | xla MB | xla ms | xla GB/s |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  out = []
  for b in bits:
    for p in gc.epilogue_passes(name, b, rows, c, interpret=interpret):
      sets = [gc.random_args(p.args, 20 + s) for s in range(2)]
      try:
        t = median_seconds(jax.jit(p.kernel), sets, runs)
      except Exception as e:
        print(f"codes kernel {p.name}: {e}"[:1500], file=sys.stderr)
        lines.append(f"| {p.name} | | | failed: {_short(e)} | | | | | |")
        continue
      tx = median_seconds(jax.jit(p.xla), sets, runs)
      gbps, xgbps = p.bytes / t / 1e9, p.xla_bytes / tx / 1e9
      frac = f"{gbps / copy_gbps:.0%}" if copy_gbps else "-"
      kept = "z" if b is None else f"{b}-bit code"
      lines.append(
        f"| {p.name.split()[0]} | {kept} | {p.bytes / 1e6:.0f} | {1e3 * t:.3f} | {gbps:.0f} | "
        f"{frac} | {p.xla_bytes / 1e6:.0f} | {1e3 * tx:.3f} | {xgbps:.0f} |"
      )
      print(lines[-1], flush=True)
      out.append({"pass": p.name, "bytes": p.bytes, "s": t, "GBps": gbps, "xla_s": tx})
  return out, lines


def hopper_table(runs, num_sms: int, shape=DENSE, name="gelu", bits=gc.BITS, interpret=False):
  """Table 3: the Mosaic GPU forward alone, y and z or y and each code, against jnp.dot."""
  m, k, n = shape
  lines = ["", f"#### Mosaic GPU forward alone, {name}, (M, K, N) = {shape} bfloat16", ""]
  lines += ["| path | writes | ms | TFLOP/s | of jnp.dot |", "|---|---|---|---|---|"]
  sets = [inputs(shape, jnp.bfloat16, s)[:3] for s in range(ROTATE)]
  flops = 2 * m * k * n
  t_dot = median_seconds(jax.jit(lambda x, w, b: jnp.dot(x, w)), sets, runs)
  lines.append(f"| jnp.dot | y | {1e3 * t_dot:.3f} | {flops / t_dot / 1e12:.0f} | 100% |")
  out = [{"path": "jnp.dot", "s": t_dot}]
  for b in bits:
    writes = "y, z" if b is None else f"y, {b}-bit code"
    why = gc.hopper_unsupported(name, b, shape)
    try:
      if why is not None:
        raise ValueError(why)
      t = median_seconds(jax.jit(gc.hopper_forward(name, b, num_sms, interpret)), sets, runs)
    except Exception as e:
      print(f"codes hopper {gc.label(b)}: {e}"[:1500], file=sys.stderr)
      lines.append(f"| mosaic forward | {writes} | skipped: {_short(e)} | | |")
      continue
    lines.append(
      f"| mosaic forward | {writes} | {1e3 * t:.3f} | {flops / t / 1e12:.0f} | {t_dot / t:.0%} |"
    )
    print(lines[-1], flush=True)
    out.append({"path": f"mosaic {gc.label(b)}", "s": t})
  return out, lines


def step_table(runs, hopper: bool, dense=DENSE, conv=(CONV_X, CONV_W), names=("gelu",)):
  """Table 4: one layer's training step, exact and each code, per implementation."""
  lines = ["", "#### one layer's training step (fwd + bwd), bfloat16", ""]
  lines += [
    "| layer | activation | path | kept | fwd+bwd ms | of exact | temp MiB |",
    "|---|---|---|---|---|---|---|",
  ]
  layers = {
    "dense": (f"dense {dense}", [inputs(dense, jnp.bfloat16, s) for s in range(ROTATE)]),
    "conv": (f"conv {conv[0]} {conv[1]}", [conv_inputs(*conv, jnp.bfloat16, s) for s in range(2)]),
  }
  out = []
  for op, (title, sets) in layers.items():
    impls = ["xla", None, "pallas"] + (["mosaic"] if op == "dense" and hopper else [])
    if op == "dense" and not hopper:
      lines.append(f"| {title} | | mosaic | | skipped: not a Hopper GPU | | |")
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in sets[0]]
    for name in names:
      for impl in impls:
        exact = None
        for b in gc.BITS:
          step = layer_step(gc.layer_fn(op, name, b, impl))
          try:
            t = median_seconds(step, sets, runs)
            temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
          except Exception as e:
            print(f"codes step {op} {impl} {gc.label(b)}: {e}"[:1500], file=sys.stderr)
            lines.append(
              f"| {title} | {name} | {impl} | {gc.label(b)} | skipped: {_short(e)} | | |"
            )
            continue
          exact = t if b is None else exact
          ratio = f"{t / exact:.2f}x" if exact else "-"
          lines.append(
            f"| {title} | {name} | {impl} | {gc.label(b)} | {1e3 * t:.3f} | {ratio} | {temp:.0f} |"
          )
          print(lines[-1], flush=True)
          out.append({"op": op, "act": name, "impl": str(impl), "bits": b, "s": t, "temp": temp})
  return out, lines


def section_codes(runs, copy_gbps=None, hopper: bool = False, num_sms: int | None = None):
  """The four tables; `hopper`: the device is a Hopper GPU with `num_sms` SMs. A table that
  raises is reported by a line and fails the section; the others still run."""
  rows, c = int(np.prod(CONV_X[:-1])), CONV_W[-1]
  tables = {
    "check": lambda: check_table(hopper),
    "kernels": lambda: kernel_table(runs, copy_gbps, rows, c),
    "hopper": lambda: (
      hopper_table(runs, num_sms)
      if hopper
      else ([], ["", "#### Mosaic GPU forward alone: skipped, not a Hopper GPU"])
    ),
    "step": lambda: step_table(runs, hopper),
  }
  data, lines = {"failed": []}, []
  for key, table in tables.items():
    try:
      part, more = table()
    except Exception as e:
      traceback.print_exc()
      data["failed"].append(f"{key}: {_short(e)}")
      lines += ["", f"#### {key}: failed, {_short(e)}"]
      continue
    if key == "check":
      data["check_failed"] = part["check_failed"]
      part = part["check"]
    data[key] = part
    lines += more
  return data, lines
