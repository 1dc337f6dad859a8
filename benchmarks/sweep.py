"""Bit-pattern sweep: every elementwise activation and parameter corner, value and gradient.

``python -m benchmarks sweep [--stride N] [--dtypes float32,bfloat16,float16] [--finite-only]``

Inputs are bit patterns: every ``stride``-th float32 pattern (``--stride 1``: all 2**32), and every
bfloat16 and float16 pattern; the finite ones are kept (NaN propagation is tested in tests/). Each
is run through the public function and its ``custom_vjp`` gradient in its own dtype and compared
with the float64 reference: the spec's forward formula evaluated in float64 at the same value and
differentiated by autodiff (tests/ also check the formulas against independent references).

Per (activation, parameters, dtype) it reports NaN counts, the gradients that are non-finite where
the float64 gradient rounded to the dtype is finite, and the worst error of the value and of the
gradient in ulps of ``max(1, |reference|)``. The gradient's worst error leaves out what the output
residual cannot know and XLA:CPU does (docs/numerics.md): the kinks (a convention) and inputs
within 4 ulps of a nonzero kink (the output rounds onto it), and, for float32 and bfloat16 (whose
subnormals float32 arithmetic flushes to zero on XLA:CPU), subnormal inputs.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import jax

from benchmarks.harness import rows
from benchmarks.tables.sweep import table, tables  # noqa: F401 (table: the tests' entry)
from support.sweep import CASES, sweep


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stride", type=int, default=1, help="float32 bit-pattern stride")
  parser.add_argument("--dtypes", default="float32,bfloat16,float16")
  parser.add_argument("--only", default="", help="comma-separated activation names")
  parser.add_argument(
    "--finite-only",
    action="store_true",
    help="NaN and non-finite-gradient counts only, the float64 reference only where a gradient "
    "is non-finite (about 3x faster)",
  )
  args = parser.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  dtypes = args.dtypes.split(",")
  only = set(filter(None, args.only.split(",")))
  start = time.perf_counter()
  for name, params in CASES:
    if only and name not in only:
      continue
    for d in dtypes:
      stride = args.stride if d == "float32" else 1
      r = sweep(name, params, d, stride=stride, finite_only=args.finite_only)
      rows.add(
        "sweep",
        r.case,
        activation=name,
        params=r.params,
        dtype=d,
        stride=stride,
        finite_only=args.finite_only,
        inputs=r.inputs,
        nan=r.nan,
        nonfinite_grad=r.nonfinite_grad,
        value_ulps=r.value_ulps,
        grad_ulps=r.grad_ulps,
        grad_worst_x=r.grad_worst_x,
      )
      errors = (
        ""
        if args.finite_only
        else f", value {r.value_ulps:.3g} ulps, grad {r.grad_ulps:.3g} ulps "
        f"(at x={r.grad_worst_x!r})"
      )
      print(
        f"{r.case} {d}: {r.inputs} inputs, NaN {r.nan}, non-finite grad {r.nonfinite_grad}{errors}",
        flush=True,
      )
  print(
    f"\n{datetime.date.today()} {platform.machine()} {platform.processor() or ''} "
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}, stride {args.stride}"
    f"{', finite only' if args.finite_only else ''}, "
    f"{time.perf_counter() - start:.0f} s\n"
  )
  print("\n".join(tables(rows.current().rows)))
