"""The bit-pattern sweep: every elementwise activation and parameter corner, value and gradient.

Inputs are bit patterns: every ``stride``-th float32 pattern (``stride=1``: all 2**32), and every
bfloat16 and float16 pattern; the finite ones are kept (NaN propagation is tested in tests/). Each
is run through the public function and its ``custom_vjp`` gradient in its own dtype and compared
with the float64 reference: the spec's forward formula evaluated in float64 at the same value and
differentiated by autodiff (tests/ also check the formulas against independent references).

Per (activation, parameters, dtype) :func:`sweep` reports NaN counts, the gradients that are
non-finite where the float64 gradient rounded to the dtype is finite, and the worst error of the
value and of the gradient in ulps of ``max(1, |reference|)``. The gradient's worst error leaves out
what the output residual cannot know and XLA:CPU does (docs/numerics.md): the kinks (a convention)
and inputs within 4 ulps of a nonzero kink (the output rounds onto it), and, for float32 and
bfloat16 (whose subnormals float32 arithmetic flushes to zero on XLA:CPU), subnormal inputs.

tests/activations/test_sweep.py runs it at a stride the suite affords; ``python -m benchmarks
sweep`` at full size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from jaxact._src.core.spec import SPECS

# Parameter corners beyond the defaults: the ones that change which formula or residual is used.
CORNERS: dict[str, tuple[dict, ...]] = {
  "leaky_relu": ({"negative_slope": 0.0}, {"negative_slope": -0.1}),
  "elu": ({"alpha": -0.5},),
  "celu": ({"alpha": -0.7},),
  "squareplus": ({"b": 0},),
  "gelu": ({"approximate": False},),
}

CASES: tuple[tuple[str, dict], ...] = tuple(
  (s.name, p) for s in SPECS if s.elementwise for p in ({}, *CORNERS.get(s.name, ()))
)

_BITS = {"float32": (jnp.uint32, 32), "bfloat16": (jnp.uint16, 16), "float16": (jnp.uint16, 16)}


@dataclasses.dataclass
class Row:
  name: str
  params: dict
  dtype: str
  inputs: int = 0
  nan: int = 0
  nonfinite_grad: int = 0
  value_ulps: float = 0.0
  grad_ulps: float = 0.0
  grad_worst_x: float = float("nan")

  @property
  def case(self) -> str:
    return self.name + "".join(f" {k}={v}" for k, v in self.params.items())


def _ulps(got, want, scale, eps, big):
  # Past the dtype's range every value counts as +-finfo.max: an output that overflows where the
  # reference rounds to finfo.max (or the reverse) is off by what separates them, not by inf.
  got = jnp.clip(got.astype(jnp.float64), -big, big)
  return jnp.abs(got - jnp.clip(want, -big, big)) / (eps * scale)


@functools.cache
def _chunk_fn(name: str, params: tuple, dtype: str, size: int, stride: int, finite_only: bool):
  spec = jaxact.get_spec(name)
  kw = {p.name: p.default for p in spec.params} | dict(params)
  fn = functools.partial(jaxact.get_activation(name), **kw)
  ref = functools.partial(spec.fn, **kw)
  udt, nbits = _BITS[dtype]
  dt = jnp.dtype(dtype)
  eps = float(jnp.finfo(dt).eps)
  tiny = float(jnp.finfo(dt).tiny)
  big = float(jnp.finfo(dt).max)
  flushes = dtype in ("float32", "bfloat16")
  kinks = tuple(spec.kinks) + tuple(spec.jax_nn_kinks)

  @jax.jit
  def run(start):
    i = jnp.arange(size, dtype=jnp.uint64)
    bits = (start + i * stride) % (1 << nbits)
    valid = start + i * stride < (1 << nbits)
    x = jax.lax.bitcast_convert_type(bits.astype(udt), dt)
    keep = valid & jnp.isfinite(x)
    x = jnp.where(keep, x, jnp.zeros((), dt))
    y, pull = jax.vjp(fn, x)
    (g,) = pull(jnp.ones_like(y))
    if finite_only:
      # Without the float64 reference (the sweep's slow half): the non-finite gradients counted
      # here are candidates, which :func:`sweep` re-judges against the reference (celu with
      # alpha < 0 has a derivative that does overflow).
      nan = keep & (jnp.isnan(y) | jnp.isnan(g))
      zero = jnp.zeros((), jnp.float64)
      return keep.sum(), nan.sum(), (keep & ~jnp.isfinite(g)).sum(), zero, zero, zero
    x64 = x.astype(jnp.float64)
    y64, pull64 = jax.vjp(ref, x64)
    (g64,) = pull64(jnp.ones_like(y64))

    nan = keep & (jnp.isnan(y) | jnp.isnan(g))
    g_rounded = g64.astype(dt)
    nonfinite = keep & ~jnp.isfinite(g) & jnp.isfinite(g_rounded)
    # Values in ulps of max(1, |f|, |x f'|): |x f'| is what rounding x alone costs (celu with
    # alpha < 0 multiplies it by |x / alpha| through exp), so this is the problem's own condition.
    y_scale = jnp.maximum(1.0, jnp.maximum(jnp.abs(y64), jnp.abs(x64 * g64)))
    y_err = jnp.where(keep & ~jnp.isnan(y64), _ulps(y, y64, y_scale, eps, big), 0.0)
    # x = +-0 is left to tests/: autodiff of max(x, 0) or |x| there is a convention, not f'(0).
    judged = keep & jnp.isfinite(g64) & (x64 != 0)
    for k in kinks:
      judged &= jnp.abs(x64 - k) > 4 * eps * abs(k)
    if flushes:
      judged &= jnp.abs(x64) >= tiny
    g_err = jnp.where(judged, _ulps(g, g64, jnp.maximum(1.0, jnp.abs(g64)), eps, big), 0.0)
    g_err = jnp.where(judged & jnp.isnan(g_err), jnp.inf, g_err)
    worst = jnp.argmax(g_err)
    return (
      keep.sum(),
      nan.sum(),
      nonfinite.sum(),
      y_err.max(),
      g_err[worst],
      x64[worst],
    )

  return run


def sweep(
  name: str,
  params: dict,
  dtype: str,
  stride: int = 1,
  chunk: int = 1 << 22,
  finite_only: bool = False,
) -> Row:
  """One (activation, parameters, dtype) over every `stride`-th bit pattern of `dtype`; with
  `finite_only`, the NaN and non-finite-gradient counts alone (no ulps; the float64 reference is
  evaluated only for chunks with a non-finite gradient)."""
  nbits = _BITS[dtype][1]
  total = -(-(1 << nbits) // stride)
  size = min(chunk, total)
  key = (name, tuple(sorted(params.items())), dtype, size, stride)
  run = _chunk_fn(*key, finite_only)
  row = Row(name, params, dtype)
  for first in range(0, total, size):
    n, nan, nonfinite, y_err, g_err, gx = (
      np.asarray(v).item() for v in run(np.uint64(first * stride))
    )
    if finite_only and nonfinite:  # candidates: the chunk again, against the reference
      n, nan, nonfinite, _, _, _ = (
        np.asarray(v).item() for v in _chunk_fn(*key, False)(np.uint64(first * stride))
      )
    row.inputs += n
    row.nan += nan
    row.nonfinite_grad += nonfinite
    row.value_ulps = max(row.value_ulps, y_err)
    if g_err > row.grad_ulps or first == 0:
      row.grad_ulps, row.grad_worst_x = g_err, gx
  return row
