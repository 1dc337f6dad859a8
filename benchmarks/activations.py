"""Per-activation measurements: MLP training memory, arrays kept by the pullback, step time, NaNs.

Every figure is a ratio or a count measured in one run against jax.nn on the same machine:

* ``mlp_memory``: an L-layer MLP ``h = act(h @ w)`` under ``jit(grad(loss))``; XLA's compiled
  ``temp_size_in_bytes`` divided by one activation buffer (batch x width x 4 bytes).
* the kept arrays (``mlp_memory`` too): activation-sized arrays held by ``jax.vjp``'s pullback of
  the same MLP, parameters and input excluded; counted at :data:`KEPT_BATCH` rows, where the eager
  forward is cheap (the count does not depend on the batch: the same at 8192 rows for every
  activation).
* ``step_time``: ``jit(value_and_grad(sum(act(x) * c)))`` on a 2048 x 2048 float32 ``x``, ``c`` an
  array of the output's shape (a layer's cotangent: a scalar, or none, XLA folds into the formula),
  the two libraries run alternately, medians compared; gelu also with ``approximate=False``.
* ``nan_counts``: NaN in values and NaN/inf in gradients over the extreme-input grid, finite inputs
  only (±inf and NaN inputs are excluded: their limits are tested in tests/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from benchmarks.harness import timing

DTYPES = ("float32", "bfloat16", "float16", "float64")


def reference(name: str) -> Callable | None:
  """The jax.nn function jaxact's `name` replaces (None for jaxact's own gelu_quick)."""
  return getattr(jax.nn, name) if jaxact.get_spec(name).jax_nn else None


def _mlp_params(layers: int, width: int, batch: int):
  keys = jax.random.split(jax.random.key(0), layers + 1)
  scale = float(
    np.sqrt(width)
  )  # a Python float: a NumPy float64 would promote to float64 under x64
  ws = [jax.random.normal(k, (width, width), jnp.float32) / scale for k in keys[:-1]]
  x = jax.random.normal(keys[-1], (batch, width), jnp.float32)
  return ws, x


def _mlp(act: Callable):
  def forward(ws, x):
    h = x
    for w in ws:
      h = act(h @ w)
    return h

  return forward


def kept_arrays(pullback, size: int, exclude=()) -> int:
  """Distinct arrays of `size` elements a `jax.vjp` pullback holds, those in `exclude` not counted.

  The pullback's leaves are the residuals of the linearized function; an array that two rules keep
  (a layer's output, kept by its activation and as the next matmul's input) is counted once.
  """
  excluded = {id(a) for a in exclude}
  kept = {
    id(a): a
    for a in jax.tree.leaves(pullback)
    if hasattr(a, "shape") and a.size == size and id(a) not in excluded
  }
  return len(kept)


@dataclasses.dataclass
class MemoryRow:
  name: str
  residual: str
  temp_jaxnn: float | None
  temp_jaxact: float
  kept_jaxnn: float | None
  kept_jaxact: float


KEPT_BATCH = 1024  # rows of the counted forward; not the width, or the weights would count


def mlp_memory(name: str, layers: int = 8, width: int = 512, batch: int = 8192) -> MemoryRow:
  ws, x = _mlp_params(layers, width, batch)
  small = x[:KEPT_BATCH]
  buffer = batch * width * 4
  out = {}
  for lib, act in (("jax.nn", reference(name)), ("jaxact", getattr(jaxact, name))):
    if act is None:
      out[lib] = (None, None)
      continue
    forward = _mlp(act)
    loss = lambda ws, x, forward=forward: jnp.sum(forward(ws, x))
    compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / buffer
    _, pullback = jax.vjp(forward, ws, small)
    out[lib] = (temp, kept_arrays(pullback, small.size, exclude=[*ws, small]) / layers)
  return MemoryRow(
    name,
    jaxact.get_spec(name).residual,
    out["jax.nn"][0],
    out["jaxact"][0],
    out["jax.nn"][1],
    out["jaxact"][1],
  )


STEP_SHAPE = (2048, 2048)
# Timed after the activation of the same name, at its defaults: the other formula of gelu.
STEP_VARIANTS = {"gelu approximate=False": ("gelu", {"approximate": False})}


def step_cases(names) -> list[str]:
  """The step-time cases of `names`: each name, followed by its :data:`STEP_VARIANTS`."""
  return [c for n in names for c in (n, *(k for k, v in STEP_VARIANTS.items() if v[0] == n))]


def step_time(case: str, shape=STEP_SHAPE, reps: int = 30) -> tuple[float, float] | None:
  """Median seconds of ``jit(value_and_grad(sum(f(x) * c)))`` for (jax.nn, jaxact), alternating
  runs; `case` is an activation's name or a key of :data:`STEP_VARIANTS`."""
  name, params = STEP_VARIANTS.get(case, (case, {}))
  ref = reference(name)
  if ref is None:
    return None
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32) * 3
  out = jax.eval_shape(lambda v: ref(v, **params), x)
  c = jax.random.normal(jax.random.key(2), out.shape, jnp.float32)
  fns = [
    jax.jit(jax.value_and_grad(lambda x, c, f=f: jnp.sum(f(x, **params) * c)))
    for f in (ref, getattr(jaxact, name))
  ]
  t_ref, t_ours = timing.alternated_medians([lambda f=f: f(x, c) for f in fns], reps)
  return t_ref, t_ours


def extreme_grid(dtype) -> np.ndarray:
  """Finite extremes of the issue's grid, in `dtype` (values that overflow it are dropped)."""
  info = jnp.finfo(dtype)
  mags = [
    1e30,
    float(info.max),
    88.8,
    548.0,
    300.0,
    17.0,
    float(info.tiny),
    float(info.smallest_subnormal),
    1.0,
  ]
  vals = sorted({s * m for m in mags for s in (1.0, -1.0)} | {0.0})
  with np.errstate(over="ignore"):
    arr = np.asarray(vals, np.float64).astype(jnp.dtype(dtype))
  return arr[np.isfinite(arr)]


def nan_counts(name: str, dtype: str) -> dict[str, tuple[int, int] | None]:
  """{lib: (NaN values, NaN/inf gradients)} on the finite extreme grid."""
  x = jnp.asarray(extreme_grid(dtype))
  if name == "glu":  # pair every grid value with every other (a, b) halves
    a, b = jnp.meshgrid(x, x)
    x = jnp.concatenate([a.reshape(-1, 1), b.reshape(-1, 1)], axis=-1)
  elif name in ("softmax", "log_softmax"):  # rows of extremes, and each value against the rest
    x = jnp.stack([x, jnp.roll(x, 1), jnp.flip(x)])
  out: dict[str, tuple[int, int] | None] = {}
  for lib, f in (("jax.nn", reference(name)), ("jaxact", getattr(jaxact, name))):
    if f is None:
      out[lib] = None
      continue
    y = f(x)
    # An upstream gradient of ones in x's dtype; sum in float32 so the loss itself cannot overflow.
    g = jax.grad(lambda v, f=f: jnp.sum(f(v).astype(jnp.float32)))(x)
    nan_y = int(jnp.sum(jnp.isnan(y)))
    bad_g = int(jnp.sum(~jnp.isfinite(g)))
    out[lib] = (nan_y, bad_g)
  return out
