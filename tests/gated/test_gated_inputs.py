"""gated_dense and gated_mlp on the inputs a program hands them besides unit-sized rows
(``tests/input_cases.py``): rows of huge, tiny and zero values in every dtype, with each
implementation the family declares; empty arrays (no rows, no input, hidden or output features);
and ``jax.vmap`` over the input and over a kernel. Against the formula in float64."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from input_cases import DTYPE_IDS, DTYPES, assert_like_formula, assert_vmap_is_a_loop, rows
from jaxact._src.gated.rules import FAMILY

from cases import backends

ACTS = {"silu": jax.nn.silu, "selu": jax.nn.selu}


def _ours(implementation, act, mlp):
  if mlp:
    return lambda *a: jaxact.gated_mlp(*a, activation=act, implementation=implementation)
  return lambda *a: jaxact.gated_dense(*a, activation=act, implementation=implementation)


def _formula(act, mlp):
  def f(x, w_gate, w_up, *w_down):
    h = ACTS[act](x @ w_gate) * (x @ w_up)
    return h @ w_down[0] if mlp else h

  return f


def _operands(dtype, mlp, n=128, d=64, f=128, o=128, seed=0):
  """Tile-sized for every kernel: the huge, tiny and zero tokens first."""
  ks = jax.random.split(jax.random.key(seed), 4)
  x = rows(ks[0], (n, d), dtype, squared=True)
  shapes = [(d, f), (d, f), (f, o)][: 3 if mlp else 2]
  scales = [d**-0.5, d**-0.5, f**-0.5]
  keys = ks[1 : 1 + len(shapes)]
  ws = [
    np.asarray(jax.random.normal(k, s, jnp.float64)) * c
    for k, s, c in zip(keys, shapes, scales[: len(shapes)], strict=True)
  ]
  return [x, *ws]


CASES = list(itertools.product(["dense", "mlp"], ["silu", "selu"], DTYPES))
IDS = [f"{op}-{act}-{DTYPE_IDS[DTYPES.index(dt)]}" for op, act, dt in CASES]


@pytest.mark.sample(1, "pallas-mlp-selu-float16")
@pytest.mark.parametrize("op,act,dtype", CASES, ids=IDS)
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_huge_tiny_and_zero_rows(implementation, op, act, dtype):
  mlp = op == "mlp"
  args = _operands(dtype, mlp)
  assert_like_formula(_ours(implementation, act, mlp), _formula(act, mlp), args, dtype)


EMPTY = {  # x, hidden, out
  "no-rows": ((0, 8), 6, 4),
  "no-rows-batch": ((3, 0, 8), 6, 4),
  "no-in-features": ((5, 0), 6, 4),
  "no-hidden-features": ((5, 8), 0, 4),
  "no-out-features": ((5, 8), 6, 0),
}


@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_arrays_give_the_formulas_empty_or_zero_values(case):
  """On XLA's path (the kernels refuse zero-size operands, by name)."""
  xs, f, o = EMPTY[case]
  d = xs[-1]
  x = jnp.ones(xs, jnp.float32)
  ws = [jnp.full(s, 0.5, jnp.float32) for s in ((d, f), (d, f), (f, o))]
  assert_like_formula(_ours(None, "silu", True), _formula("silu", True), [x, *ws], jnp.float32)
  if 0 in x.shape or 0 in ws[0].shape:
    with pytest.raises(NotImplementedError, match="zero-size operands"):
      _ours("pallas", "silu", True)(x, *ws)


@pytest.mark.sample(1, "xla-w_gate")
@pytest.mark.parametrize("axis", ["x", "w_gate"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_vmap_is_a_loop(implementation, axis):
  if implementation == "mosaic":
    pytest.skip("off a GPU the Mosaic interpreter's host callbacks do not batch (docs/gated.md)")
  x, wg, wu, wd = _operands(jnp.float32, True)
  x, wg, wu, wd = (jnp.asarray(v, jnp.float32) for v in (x[3:] / 4, wg, wu, wd))  # ordinary rows
  if axis == "x":
    args, in_axes = (jnp.stack([x, -x]), wg, wu, wd), (0, None, None, None)
  else:
    args, in_axes = (x, jnp.stack([wg, 2 * wg]), wu, wd), (None, 0, None, None)
  assert_vmap_is_a_loop(_ours(implementation, "silu", True), args, in_axes, atol=1e-4)
