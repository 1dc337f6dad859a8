"""Check the Pallas dense kernels against the XLA path on a GPU, and time both.

    python -m benchmarks.gpu_check [--runs 50] [--activation gelu]

For each (M, K, N) in bfloat16: the values and gradients (dx, dw, db) of
``jaxact.dense_bias_act(..., implementation="pallas")`` are compared with ``implementation="xla"``;
then the forward and the forward+backward (one jitted ``value_and_grad``) of both are timed: the
median of ``--runs`` calls after warm-up, each ended by ``block_until_ready``, rotating over several
input sets so that no call reads what the last one left in L2. Prints a markdown table with the
device name and date. Needs a CUDA GPU (compute capability >= 8.0); elsewhere it exits, saying so.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxact

SHAPES = ((8192, 4096, 4096), (16384, 1024, 4096))
ROTATE = 4  # input sets cycled through by the timed calls


def _gpu():
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  return devices[0] if devices else None


def _inputs(m, k, n, dtype, seed):
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  b = jax.random.normal(kb, (n,), jnp.float32).astype(dtype)
  g = jax.random.normal(kg, (m, n), jnp.float32).astype(dtype)
  return x, w, b, g


def _fns(impl, activation):
  def fwd(x, w, b):
    return jaxact.dense_bias_act(x, w, b, activation=activation, implementation=impl)

  def step(x, w, b, g):
    y, pull = jax.vjp(fwd, x, w, b)
    return y, pull(g)

  return jax.jit(fwd), jax.jit(step)


def _median_ms(fn, arg_sets, runs):
  for args in arg_sets:  # compile and warm up
    jax.block_until_ready(fn(*args))
  times = []
  for i in range(runs):
    args = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def _max_rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=50)
  parser.add_argument("--activation", default="gelu")
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
  dtype = jnp.bfloat16
  rows = []
  for m, k, n in SHAPES:
    sets = [_inputs(m, k, n, dtype, seed) for seed in range(ROTATE)]
    fwd_p, step_p = _fns("pallas", args.activation)
    fwd_x, step_x = _fns("xla", args.activation)
    x, w, b, g = sets[0]
    got, want = step_p(x, w, b, g), step_x(x, w, b, g)
    errs = jax.tree.map(_max_rel_err, got, want)
    y_err, (dx_err, dw_err, db_err) = errs
    worst = max(y_err, dx_err, dw_err, db_err)
    ms = {
      name: _median_ms(fn, [s[:3] if name.startswith("fwd") else s for s in sets], args.runs)
      for name, fn in (
        ("fwd_p", fwd_p),
        ("fwd_x", fwd_x),
        ("step_p", step_p),
        ("step_x", step_x),
      )
    }
    rows.append((m, k, n, worst, ms, (y_err, dx_err, dw_err, db_err)))

  print(f"## Pallas dense kernels vs XLA: {gpu.device_kind}, {datetime.date.today().isoformat()}")
  print(
    f"bfloat16, activation={args.activation}, median of {args.runs} runs, jax {jax.__version__}"
  )
  print()
  print(
    "| M, K, N | fwd pallas (ms) | fwd xla (ms) | fwd+bwd pallas (ms) | fwd+bwd xla (ms) "
    "| fwd+bwd speed-up | max rel. err (y, dx, dw, db) |"
  )
  print("|---|---|---|---|---|---|---|")
  ok = True
  for m, k, n, worst, ms, errs in rows:
    ok &= worst < 2e-2
    print(
      f"| {m}, {k}, {n} | {ms['fwd_p']:.3f} | {ms['fwd_x']:.3f} | {ms['step_p']:.3f} | "
      f"{ms['step_x']:.3f} | {ms['step_x'] / ms['step_p']:.2f}x | "
      f"{', '.join(f'{e:.1e}' for e in errs)} |"
    )
  if not ok:
    print("\nFAILED: the kernels differ from the XLA path by more than 2e-2 (relative)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
