"""How the stored few-bit codes are derived: the optimal piecewise-constant ``f'`` and its error.

For 4 and 2 bits, :func:`derive` finds the boundaries on ``x`` and the levels of ``f'`` that
minimise ``E[(f'(x) - q(x))^2]`` for a standard normal ``x`` (Few-Bit Backward, Novikov et al.,
ICML 2023); for 8 bits, the exact range of ``f'``. ``python -m jaxact._src.codes.derive`` writes
the table of every coded activation to ``table.py``, which :mod:`jaxact._src.codes.code` reads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxact._src.codes.code import BITS, CODED, Code, get_code, param_combinations
from jaxact._src.core.spec import SPEC_BY_NAME, ActivationSpec

_Z = 10.0  # beyond |x| = 10 a standard normal has mass 1.5e-23: nothing to the expected error


def _normal_pdf(z: np.ndarray) -> np.ndarray:
  return np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _x64():
  """A context that enables float64 (``jax.enable_x64``; ``jax.experimental``'s in older jax)."""
  import jax

  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64  # jax < 0.12

  return enable_x64()


def _derivative_fn(spec: ActivationSpec, params) -> Callable[[np.ndarray], np.ndarray]:
  """``f'`` of the spec row in float64, on NumPy arrays."""

  def d(z):
    with _x64():
      return np.asarray(spec.derivative_from_input(jnp.asarray(z, jnp.float64), **dict(params)))

  return d


def decoded(code: Code, z: np.ndarray, d) -> np.ndarray:
  """What `code` gives for ``f'`` at `z` (float64, NumPy): the reference of encode + decode."""
  if code.bits == 8:
    lo, hi = code.levels
    q = np.clip(np.round((d(z) - lo) * (255.0 / (hi - lo))), 0, 255)
    return lo + q * ((hi - lo) / 255.0)
  return np.asarray(code.levels)[np.searchsorted(np.asarray(code.boundaries), z, side="left")]


def error_stats(name: str, params, bits: int) -> tuple[float, float]:
  """``(max |f' - q|, E|f' - q|)`` of the stored code, the max over every x (a fine grid on
  [-60, 60], beyond which f' is constant), the mean for a standard normal x."""
  spec = SPEC_BY_NAME[name]
  code, d = get_code(name, params, bits), _derivative_fn(spec, params)
  z = np.linspace(-60.0, 60.0, 1_200_001)
  worst = float(np.max(np.abs(d(z) - decoded(code, z, d))))
  z = np.linspace(-_Z, _Z, 400_001)
  w = _normal_pdf(z)
  mean = float(np.sum(w * np.abs(d(z) - decoded(code, z, d))) / np.sum(w))
  return worst, mean


def _segment(values: np.ndarray, weights: np.ndarray, pieces: int) -> list[int]:
  """Optimal split of a weighted sequence into `pieces` runs (least weighted squared error), by
  dynamic programming; the start indices of runs 2.. ."""
  n = len(values)
  s0 = np.concatenate([[0.0], np.cumsum(weights)])
  s1 = np.concatenate([[0.0], np.cumsum(weights * values)])
  s2 = np.concatenate([[0.0], np.cumsum(weights * values * values)])
  i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
  w = s0[j] - s0[i]
  with np.errstate(divide="ignore", invalid="ignore"):
    cost = (s2[j] - s2[i]) - np.where(w > 0, (s1[j] - s1[i]) ** 2 / w, 0.0)
  cost = np.where(j > i, cost, np.inf)
  best = cost[0]  # one run over [0, j)
  back = []
  for _ in range(pieces - 1):
    total = best[:, None] + cost
    arg = np.argmin(total, axis=0)
    back.append(arg)
    best = total[arg, np.arange(n + 1)]
  cuts, j = [], n
  for arg in reversed(back):
    j = int(arg[j])
    cuts.append(j)
  return sorted(cuts)


def _conditional_means(d, boundaries: np.ndarray, grid: np.ndarray) -> np.ndarray:
  """``E[f'(x) | x in interval]`` for a standard normal x, by quadrature on `grid`."""
  w = _normal_pdf(grid)
  v = d(grid)
  edges = np.concatenate([[-np.inf], boundaries, [np.inf]])
  means = []
  for lo, hi in itertools.pairwise(edges):
    m = (grid > lo) & (grid <= hi)
    means.append(float(np.sum(w[m] * v[m]) / np.sum(w[m])))
  return np.asarray(means)


def expected_error(d, boundaries, levels, grid: np.ndarray | None = None) -> float:
  """``E[(f'(x) - q(x))^2]`` for a standard normal x, by quadrature."""
  grid = np.linspace(-_Z, _Z, 400_001) if grid is None else grid
  w = _normal_pdf(grid)
  q = np.asarray(levels)[np.searchsorted(np.asarray(boundaries), grid, side="left")]
  return float(np.sum(w * (d(grid) - q) ** 2) / np.sum(w))


def derive(spec: ActivationSpec, params, bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """``(boundaries, levels)`` of the optimal code (4 and 2 bits) or ``((), (lo, hi))`` (8 bits)."""
  d = _derivative_fn(spec, params)
  if bits == 8:
    z = np.linspace(-60.0, 60.0, 1_200_001)
    v = d(z)
    # Refine around the grid's extremes (hard_silu's are limits at its jumps).
    step = z[1] - z[0]
    lo, hi = v.min(), v.max()
    for at in (z[np.argmin(v)], z[np.argmax(v)]):
      local = d(np.linspace(at - step, at + step, 200_001))
      lo, hi = min(lo, local.min()), max(hi, local.max())
    return (), (float(lo), float(hi))
  pieces = 2**bits
  coarse = np.linspace(-_Z, _Z, 2001)
  cuts = _segment(d(coarse), _normal_pdf(coarse), pieces)
  boundaries = np.asarray([(coarse[c - 1] + coarse[c]) / 2 for c in cuts])
  # Lloyd refinement on a fine grid: levels are the conditional means, and each boundary moves to
  # where f' is halfway between its two neighbours' levels (the first-order condition).
  fine = np.linspace(-_Z, _Z, 400_001)
  dv = d(fine)
  for _ in range(60):
    levels = _conditional_means(d, boundaries, fine)
    new = boundaries.copy()
    for k, t in enumerate(boundaries):
      mid = 0.5 * (levels[k] + levels[k + 1])
      lo = boundaries[k - 1] if k else -_Z
      hi = boundaries[k + 1] if k + 1 < len(boundaries) else _Z
      m = (fine > lo) & (fine < hi)
      zs, g = fine[m], dv[m] - mid
      crossings = np.nonzero(np.sign(g[:-1]) != np.sign(g[1:]))[0]
      if len(crossings):
        c = crossings[np.argmin(np.abs(zs[crossings] - t))]
        new[k] = zs[c] - g[c] * (zs[c + 1] - zs[c]) / (g[c + 1] - g[c])
    if np.max(np.abs(new - boundaries)) < 1e-12:
      break
    boundaries = new
  levels = _conditional_means(d, boundaries, fine)
  return tuple(float(t) for t in boundaries), tuple(float(v) for v in levels)


def main() -> None:
  import pathlib

  lines = [
    '"""Few-bit derivative codes, generated by `python -m jaxact._src.codes.derive`: '
    'do not edit."""',
    "",
    "# (activation, static params, bits) -> (boundaries on x, levels of f');",
    "# 8 bits: ((), (lo, hi)), the range of f'.",
    "TABLE = {",
  ]
  for name in CODED:
    for params in param_combinations(SPEC_BY_NAME[name]):
      for bits in BITS:
        boundaries, levels = derive(SPEC_BY_NAME[name], params, bits)
        lines.append(f"  ({name!r}, {params!r}, {bits}): (")
        lines.append(f"    ({''.join(f'{t!r}, ' for t in boundaries)}),")
        lines.append(f"    ({''.join(f'{v!r}, ' for v in levels)}),")
        lines.append("  ),")
  lines.append("}")
  path = pathlib.Path(__file__).with_name("table.py")
  path.write_text("\n".join(lines) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
