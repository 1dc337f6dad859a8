"""The LM head's loss on a GPU (section ``lce`` of ``python -m benchmarks gpu``).

Two tables, bfloat16:

1. correctness: ``jaxact.linear_cross_entropy(..., implementation="mosaic")`` (the Hopper forward
   kernel, :mod:`pallas_kernels.lce_mosaic`, and the backward's G kernel,
   :mod:`pallas_kernels.lce_mosaic_bwd`, feeding XLA's products) against
   ``implementation="xla"`` and the plain composition in float32, loss and the gradients of x, w
   and b, with and without the options (smoothing, z-loss, soft cap); the kernel's statistics
   against :func:`pallas_kernels.lce_mosaic.lce_reference`;
2. time of ``jit(value_and_grad)`` (fwd+bwd) and of the loss alone, at 16384 tokens, D = 4096, V
   = 131072 and 262144: the plain composition (``x @ w``, optax), jaxact ``"xla"``, jaxact
   ``"mosaic"`` and ``"mosaic fwd"`` (the forward kernel with XLA's backward; Hopper only) and
   tokamax's ``linear_softmax_cross_entropy_loss`` where it
   imports; each as a ratio to the plain composition (the issue: the kernel <= 1.10x, no slower
   than tokamax).

The functions it times are built by :func:`support.gpu_lce.paths`, which
``tests/lce/test_lce_mosaic.py`` lowers for an abstract H100 so that the section cannot rot
between GPU sessions.
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from benchmarks.gpu.common import median_seconds
from support import gpu_lce

SIZES = ((16384, 4096, 131072), (16384, 4096, 262144))
CHECK = (4096, 1024, 32768)
OPTIONS = {"plain": {}, "options": dict(label_smoothing=0.1, z_loss=1e-4, logit_soft_cap=30.0)}
paths = gpu_lce.paths


def _inputs(tokens, dim, vocab, seed=0):
  kx, kw, kl = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (tokens, dim), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (dim, vocab), jnp.float32) / np.sqrt(dim)).astype(jnp.bfloat16)
  return x, w, jax.random.randint(kl, (tokens,), 0, vocab, jnp.int32)


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_table(hopper: bool) -> tuple[dict, list[str]]:
  lines = [
    f"#### correctness, bfloat16, (tokens, D, V) = {CHECK}: relative error against "
    "implementation='xla'",
    "",
    "| options | loss | dx | dw | db | kernel statistics vs lce_reference (max abs) |",
    "|---|---|---|---|---|---|",
  ]
  failed = []
  if not hopper:
    return {"failed": failed}, [*lines, "| skipped: not a Hopper GPU (the kernel needs sm_90) |"]
  from pallas_kernels import lce_mosaic

  x, w, labels = _inputs(*CHECK)
  b = jnp.zeros((CHECK[2],), jnp.bfloat16)
  for name, options in OPTIONS.items():

    def step(impl, options=options):
      def loss(x, w, b):
        return jaxact.linear_cross_entropy(x, w, labels, bias=b, implementation=impl, **options)

      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, b)

    (l1, g1), (l2, g2) = step("mosaic"), step("xla")
    errs = [_rel(l1, l2), *(_rel(a, c) for a, c in zip(g1, g2, strict=True))]
    cap = options.get("logit_soft_cap")
    got = lce_mosaic.lce_fwd(x, w, None, labels, soft_cap=cap, want_mean=True, num_sms=132)
    ref = lce_mosaic.lce_reference(x, w, None, labels, soft_cap=cap, want_mean=True)
    stat = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(got, ref, strict=True))
    ok = max(errs) < 1e-3 and stat < 1e-3
    if not ok:
      failed.append(name)
    lines.append(
      f"| {name} | "
      + " | ".join(f"{e:.1e}" for e in errs)
      + f" | {stat:.1e}"
      + ("" if ok else " FAILED")
      + " |"
    )
  return {"failed": failed}, lines


def time_table(runs: int, hopper: bool, sizes=SIZES, on_row=None) -> tuple[dict, list[str]]:
  """Each path's fwd+bwd and loss-alone time at each of `sizes`; data: ``"(size) label"`` ->
  (step s, loss s), and ``"failed"``: the paths that raised, with the error. `on_row(label,
  times, plain's times)` is called as each path is timed (times None: it raised, with the
  error in its place)."""
  lines = [
    "#### time, bfloat16: ms, and the ratio to the plain composition",
    "",
    "| (tokens, D, V) | path | fwd+bwd ms | / plain | loss alone ms | / plain |",
    "|---|---|---|---|---|---|",
  ]
  data = {"failed": []}
  for size in sizes:
    arg_sets = [_inputs(*size, seed=s) for s in range(2)]
    base = {}
    for label, loss in paths(hopper).items():
      try:
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        fwd = jax.jit(loss)
        t = (median_seconds(step, arg_sets, runs), median_seconds(fwd, arg_sets, runs))
      except Exception as e:  # one path failing (memory) must not hide the others
        traceback.print_exc()
        lines.append(f"| {size} | {label} | failed: {type(e).__name__} | | | |")
        data["failed"].append(f"{size} {label}: {type(e).__name__}: {e}"[:300])
        if on_row is not None:
          on_row(label, None, f"{type(e).__name__}: {e}")
        continue
      base = base or dict(zip(("step", "fwd"), t, strict=True))
      data[f"{size} {label}"] = t
      if on_row is not None:
        on_row(label, t, (base["step"], base["fwd"]))
      lines.append(
        f"| {size} | {label} | {t[0] * 1e3:.1f} | {t[0] / base['step']:.2f} | "
        f"{t[1] * 1e3:.1f} | {t[1] / base['fwd']:.2f} |"
      )
  return data, lines


def section_lce(runs: int, hopper: bool) -> tuple[dict, list[str]]:
  check, lines = check_table(hopper)
  data, more = time_table(runs, hopper)
  return {"failed": check["failed"], "times": data}, [*lines, "", *more]
