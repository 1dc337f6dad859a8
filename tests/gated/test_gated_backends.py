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
