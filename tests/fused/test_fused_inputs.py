"""dense_bias_act and conv_bias_act on the inputs a program hands them besides unit-sized rows
(``tests/input_cases.py``): rows of huge, tiny and zero values in every dtype, with each
implementation the family declares; empty arrays (no rows, no input or output features); and
``jax.vmap`` over the input and over the kernel. Against the formula in float64."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from input_cases import DTYPE_IDS, DTYPES, assert_like_formula, assert_vmap_is_a_loop, rows
from jaxact._src.fused.rules import FAMILY

from cases import backends

# An input residual and an output one, both smooth (a kink would be decided on the rounded z).
ACTS = {"gelu": lambda z: jax.nn.gelu(z, approximate=True), "softplus": jax.nn.softplus}
CONV = dict(window_strides=1, padding="SAME")


def _dense(implementation, act):
  return lambda x, w, b: jaxact.dense_bias_act(
    x, w, b, activation=act, implementation=implementation
  )


def _conv(implementation, act):
  return lambda x, w, b: jaxact.conv_bias_act(
    x, w, b, activation=act, implementation=implementation, **CONV
  )


def _conv_formula(act):
  def f(x, w, b):
    dims = ("NHWC", "HWIO", "NHWC")
    z = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)
    return ACTS[act](z + b)

  return f


def _operands(op, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  if op == "dense":  # (tokens, in): the huge, tiny and zero tokens first
    x = rows(ks[0], (128, 64), dtype)  # tile-sized for every kernel
    w = np.asarray(jax.random.normal(ks[1], (64, 256), jnp.float64)) / 8
    b = np.asarray(jax.random.normal(ks[2], (256,), jnp.float64))
  else:  # (images, H, W, C): the huge, tiny and zero images first
    x = np.moveaxis(rows(ks[0], (6, 6, 5, 4), dtype), 2, 0)
    w = np.asarray(jax.random.normal(ks[1], (3, 3, 4, 8), jnp.float64)) / 6
    b = np.asarray(jax.random.normal(ks[2], (8,), jnp.float64))
  return [x, w, b]


CASES = list(itertools.product(["dense", "conv"], ["gelu", "softplus"], DTYPES))
IDS = [f"{op}-{act}-{DTYPE_IDS[DTYPES.index(dt)]}" for op, act, dt in CASES]


@pytest.mark.sample(1, "pallas-conv-softplus-bfloat16")
@pytest.mark.parametrize("op,act,dtype", CASES, ids=IDS)
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_huge_tiny_and_zero_rows(implementation, op, act, dtype):
  ours = (_dense if op == "dense" else _conv)(implementation, act)
  formula = (lambda x, w, b: ACTS[act](x @ w + b)) if op == "dense" else _conv_formula(act)
  assert_like_formula(ours, formula, _operands(op, dtype), dtype)


EMPTY = {
  "dense-no-rows": ((0, 8), (8, 4)),
  "dense-no-rows-batch": ((3, 0, 8), (8, 4)),
  "dense-no-in-features": ((5, 0), (0, 4)),
  "dense-no-out-features": ((5, 8), (8, 0)),
  "conv-no-images": ((0, 6, 6, 3), (3, 3, 3, 4)),
  "conv-no-in-channels": ((2, 6, 6, 0), (3, 3, 0, 4)),
  "conv-no-out-channels": ((2, 6, 6, 3), (3, 3, 3, 0)),
}


@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_arrays_give_the_formulas_empty_or_bias_values(case):
  """On XLA's path (the kernels refuse zero-size operands, by name)."""
  xs, ws = EMPTY[case]
  x, w = jnp.ones(xs, jnp.float32), jnp.full(ws, 0.5, jnp.float32)
  b = jnp.linspace(-1.0, 1.0, ws[-1], dtype=jnp.float32)
  dense = case.startswith("dense")
  ours = (_dense if dense else _conv)(None, "gelu")
  formula = (lambda x, w, b: ACTS["gelu"](x @ w + b)) if dense else _conv_formula("gelu")
  assert_like_formula(ours, formula, [x, w, b], jnp.float32)
  with pytest.raises(NotImplementedError, match="zero-size operands"):
    (_dense if dense else _conv)("pallas", "gelu")(x, w, b)


VMAP = list(itertools.product(["dense", "conv"], ["x", "w"]))


@pytest.mark.sample(1, "pallas-conv-w")
@pytest.mark.parametrize("op,axis", VMAP, ids=[f"{o}-{a}" for o, a in VMAP])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_vmap_is_a_loop(implementation, op, axis):
  x, w, b = _operands(op, jnp.float32)
  x, w, b = (jnp.asarray(v, jnp.float32) for v in (x[3:] / 4, w, b))  # the ordinary rows
  if axis == "x":
    args, in_axes = (jnp.stack([x, -x]), w, b), (0, None, None)
  else:
    args, in_axes = (x, jnp.stack([w, 2 * w]), b), (None, 0, None)
  if implementation == "mosaic":
    pytest.skip(
      "off a GPU the Mosaic interpreter's host callbacks do not batch (docs/fused-ops.md)"
    )
  ours = (_dense if op == "dense" else _conv)(implementation, "gelu")
  assert_vmap_is_a_loop(ours, args, in_axes, atol=1e-4)
