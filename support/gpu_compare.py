"""A kernel path against the XLA path, as the GPU checks judge it.

Both run at the inputs' dtype and are measured against one reference: the XLA path on the inputs
upcast to float32 at ``precision=HIGHEST``. Each output (the value and the gradients from a random
cotangent) passes when its relative error ``‖got - ref‖ / ‖ref‖`` is finite and at most
``max(2 x XLA's, 1e-5)`` plus its dtype's rounding tolerance (:data:`TOL`): a kernel may be as
inexact as XLA's own path, twice over, and round once more, no worse.

``benchmarks/gpu/dense.py`` (``check``) and ``benchmarks/gpu/conv.py`` judge dense and
convolution layers by the same rule; :func:`compare_to_xla` applies it to any op given as
``build(implementation, precision) -> f(*args)`` (the gated MLP, the LM head's loss).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Rounding tolerance of an output of each dtype: TF32 operands for float32 on a GPU, one half
# precision rounding (and the float32 sums' order) for the others.
TOL = {"float64": 1e-6, "float32": 1e-3, "bfloat16": 3e-2, "float16": 5e-3}


def rel(got, ref) -> float:
  """``‖got - ref‖ / ‖ref‖`` in float64; inf when `got` is not finite."""
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(got)):
    return math.inf
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def allowed(xla_err: float, dtype: str) -> float:
  """The largest error a kernel's output of `dtype` may have where XLA's has `xla_err`."""
  return max(2 * xla_err, 1e-5) + TOL[dtype]


def within(errs, xla_errs, dtype: str | Sequence[str]) -> bool:
  """Whether each error is finite and at most :func:`allowed` (`dtype`: one, or one an error)."""
  dtypes = [dtype] * len(errs) if isinstance(dtype, str) else list(dtype)
  return all(
    math.isfinite(e) and e <= allowed(xe, d)
    for e, xe, d in zip(errs, xla_errs, dtypes, strict=True)
  )


@dataclasses.dataclass
class Comparison:
  """One op through a kernel path and through XLA's, each against the float32 reference.

  Attributes:
    names: the outputs compared (``"y"``, then one gradient per argument).
    errs, xla_errs: the kernel path's and the XLA path's relative errors.
    dtypes: each output's dtype (its tolerance).
  """

  names: tuple[str, ...]
  errs: tuple[float, ...]
  xla_errs: tuple[float, ...]
  dtypes: tuple[str, ...]

  @property
  def ok(self) -> bool:
    return within(self.errs, self.xla_errs, self.dtypes)

  def summary(self) -> str:
    """The worst output, or each output over its allowance."""
    bad = [
      f"{n} {e:.1e} > {allowed(x, d):.1e} allowed (xla {x:.1e})"
      for n, e, x, d in zip(self.names, self.errs, self.xla_errs, self.dtypes, strict=True)
      if not (math.isfinite(e) and e <= allowed(x, d))
    ]
    if bad:
      return "; ".join(bad)
    i = int(np.argmax(self.errs))
    return f"max rel err {self.errs[i]:.1e} ({self.names[i]}) vs xla {self.xla_errs[i]:.1e}"


def _vjp_step(f: Callable[..., Any]):
  @jax.jit
  def step(args, g):
    y, pull = jax.vjp(f, *args)
    return (y, *pull(g))

  return step


def compare_to_xla(
  build: Callable[[str, Any], Callable[..., Any]],
  args: Sequence[jax.Array],
  implementation: str,
  *,
  names: Sequence[str] | None = None,
  seed: int = 0,
) -> Comparison:
  """`implementation` and ``"xla"`` of ``build(implementation, precision)(*args)`` against the
  float32 reference: the value and the gradients of every argument from a random cotangent.

  Arguments that are not differentiated (labels, masks) are closed over by `build`.
  """
  args = tuple(args)
  out = jax.eval_shape(build("xla", None), *args)
  g = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32).astype(out.dtype)
  got = _vjp_step(build(implementation, None))(args, g)  # first: a refusal costs no compile
  up = tuple(a.astype(jnp.float32) for a in args)
  ref = _vjp_step(build("xla", lax.Precision.HIGHEST))(up, g.astype(jnp.float32))
  xla = _vjp_step(build("xla", None))(args, g)
  names = tuple(names or ("y", *(f"d{i}" for i in range(len(args)))))
  return Comparison(
    names=names,
    errs=tuple(rel(a, r) for a, r in zip(got, ref, strict=True)),
    xla_errs=tuple(rel(a, r) for a, r in zip(xla, ref, strict=True)),
    dtypes=tuple(np.dtype(a.dtype).name for a in got),
  )
