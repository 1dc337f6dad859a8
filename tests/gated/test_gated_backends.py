"""One behaviour suite for ``gated_dense`` and ``gated_mlp`` over every implementation the family
declares (``gated.rules.FAMILY``: XLA, the Triton kernels, the Mosaic GPU forward, and None), each
meeting the same assertions against autodiff of the plain composition
(``jaxact/_src/gated/reference.py``). Off a GPU the kernels run in Pallas' interpreters; a backend
that cannot run a call skips with its own reason. The kernels' own corners are in
``test_gated_triton.py`` and ``test_gated_mosaic.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.gated.reference import composition, reference_activation
from jaxact._src.gated.rules import FAMILY

from cases import assert_trees_close, backends, value_and_grads_or_skip

TOL = {jnp.float32: 3e-5, jnp.bfloat16: 5e-2}
D, F, OUT = 128, 256, 128


def _operands(dtype):
  ks = jax.random.split(jax.random.key(2), 7)
  shapes = [(2, 64, D), (D, F), (D, F), (F, OUT), (F,), (F,), (OUT,)]
  scales = [1.0, 2 * D**-0.5, D**-0.5, F**-0.5, 0.5, 0.5, 0.5]
  return [
    (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    for k, shape, s in zip(ks, shapes, scales, strict=True)
  ]


@pytest.mark.sample(1, "xla-mlp-bfloat16", "pallas-dense-float32", "mosaic-dense-bfloat16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mlp", [False, True], ids=["dense", "mlp"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_equals_autodiff_of_the_composition(implementation, mlp, dtype):
  """silu, every bias present, a (2, 64, 128) input: tile-sized for every kernel."""
  ops = _operands(dtype)
  x, wg, wu, _, bg, bu, _ = ops
  if mlp:
    args = ops
    ours = lambda *a: jaxact.gated_mlp(*a, activation="silu", implementation=implementation)
  else:
    args = [x, wg, wu, bg, bu]
    ours = lambda x, wg, wu, bg, bu: jaxact.gated_dense(
      x, wg, wu, bg, bu, activation="silu", implementation=implementation
    )
  got = value_and_grads_or_skip(ours, *args)
  plain = composition(reference_activation("silu"), mlp)
  if not mlp:
    plain_dense = plain
    plain = lambda x, wg, wu, bg, bu: plain_dense(x, wg, wu, None, bg, bu, None)
  want = value_and_grads_or_skip(plain, *[a.astype(jnp.float32) for a in args])
  assert_trees_close(got, want, TOL[dtype])


@pytest.mark.sample(1, "pallas-float32", "mosaic-bfloat16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_an_overflowing_activation_gives_the_finite_product(implementation, dtype):
  """selu(a) = inf for a = 3.3e38, where act(a) * b and the gradients are finite (docs/gated.md's
  example): the output was the documented 0 for b = 0, but dx was NaN and dw_up inf where the
  exact entries are about 1e36; for b = 1e-3, h was inf where it is 3.5e35. Against the formula in
  float64 from the same (rounded) operands."""
  n, d, f, o = 128, 64, 128, 128  # tile-sized for every kernel
  ks = jax.random.split(jax.random.key(3), 4)
  x = np.asarray(jax.random.normal(ks[0], (n, d), jnp.float32)) * 0.5
  x[:, 0], x[0, :], x[0, 0] = 0.0, 0.0, 1.0  # row 0 reads row 0 of the weights alone
  wg = np.asarray(jax.random.normal(ks[1], (d, f), jnp.float32)) * d**-0.5
  wu = np.asarray(jax.random.normal(ks[2], (d, f), jnp.float32)) * d**-0.5
  wg[0, :2], wu[0, :2] = 3.3e38, (1e-3, 0.0)  # a[0, :2] = 3.3e38; b[0, :2] = 1e-3 and 0
  wd = np.asarray(jax.random.normal(ks[3], (f, o), jnp.float32)) * 0.05
  gy = np.full((n, o), 0.01, np.float32)
  args = [jnp.asarray(v, dtype) for v in (x, wg, wu, wd)]

  def ours(*a):
    return jaxact.gated_mlp(*a, activation="selu", implementation=implementation)

  try:
    y, pull = jax.vjp(ours, *args)
  except NotImplementedError as e:
    pytest.skip(f"the backend declines: {e}")
  got = [y, *pull(jnp.asarray(gy, dtype))]

  x, wg, wu, wd = (np.asarray(a, np.float64) for a in args)
  a, b = x @ wg, x @ wu
  scale, alpha = 1.0507009873554805, 1.6732632423543772
  act = scale * np.where(a > 0, a, alpha * np.expm1(np.minimum(a, 0)))
  slope = scale * np.where(a > 0, 1.0, alpha * np.exp(np.minimum(a, 0)))
  gh = np.asarray(jnp.asarray(gy, dtype), np.float64) @ wd.T

  def products(h, da, db, x, wg, wu, wd, gy):
    return [h @ wd, da @ wg.T + db @ wu.T, x.T @ da, x.T @ db, h.T @ gy]

  operands = (act * b, gh * slope * b, gh * act, x, wg, wu, wd, gy)
  want = products(*operands)
  sizes = products(*map(np.abs, operands))  # what each sum's rounding is relative to
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  for i, (g, w, size) in enumerate(zip(got, want, sizes, strict=True)):
    g = np.asarray(g, np.float64)
    assert np.isfinite(w).all() and np.isfinite(g).all(), i
    assert (np.abs(g - w) <= tol * size).all(), (i, np.max(np.abs(g - w) / (tol * size)))
