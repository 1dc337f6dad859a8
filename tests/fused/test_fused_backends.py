"""One behaviour suite for ``dense_bias_act`` and ``conv_bias_act`` over every implementation the
family declares (``fused.rules.FAMILY``: XLA, the Triton kernels, the Mosaic GPU kernels, and None),
each meeting the same assertions against autodiff of the plain formula
(``jaxact/_src/fused/reference.py``). Off a GPU the kernels run in Pallas' interpreters; a backend
that cannot run a call skips with its own reason. The kernels' own corners (tiles, epilogues,
lowering, spills) are in ``test_dense_triton.py``, ``test_conv_triton.py`` and
``test_dense_mosaic.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxact
from jaxact._src.fused.reference import conv_reference, dense_reference, reference_activation
from jaxact._src.fused.rules import FAMILY

from cases import assert_trees_close, backends, value_and_grads_or_skip

# float32: the kernels and XLA differ by summation order; bfloat16 by where the bias is added
# before rounding (tests/fused/test_dense_triton.py) and by the gradients' bf16 rounding.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2}


def _normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@pytest.mark.sample(1, "pallas-float32", "mosaic-bfloat16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_dense_bias_act_equals_autodiff_of_the_formula(implementation, dtype):
  """gelu (kept input) over a (2, 64, 128) x (128, 256) layer: tile-sized for every kernel."""
  kx, kw, kb = jax.random.split(jax.random.key(0), 3)
  x = _normal(kx, (2, 64, 128), dtype)
  w, b = _normal(kw, (128, 256), dtype, 128**-0.5 * 2), _normal(kb, (256,), dtype, 0.5)
  ours = lambda x, w, b: jaxact.dense_bias_act(
    x, w, b, activation="gelu", implementation=implementation
  )
  got = value_and_grads_or_skip(ours, x, w, b)
  up = lambda a: a.astype(jnp.float32)
  want = value_and_grads_or_skip(dense_reference(reference_activation("gelu")), up(x), up(w), up(b))
  assert_trees_close(got, want, TOL[dtype])


@pytest.mark.sample(1, "pallas")
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_conv_bias_act_equals_autodiff_of_the_formula(implementation):
  """A 3x3 SAME convolution with relu (kept output), NHWC, float32."""
  kx, kw, kb = jax.random.split(jax.random.key(1), 3)
  x = _normal(kx, (2, 8, 8, 16), jnp.float32)
  w, b = _normal(kw, (3, 3, 16, 32), jnp.float32, 0.2), _normal(kb, (32,), jnp.float32, 0.5)
  ours = lambda x, w, b: jaxact.conv_bias_act(
    x, w, b, activation="relu", padding="SAME", implementation=implementation
  )
  got = value_and_grads_or_skip(ours, x, w, b)
  want = value_and_grads_or_skip(conv_reference(jax.nn.relu, n=2), x, w, b)
  assert_trees_close(got, want, TOL[jnp.float32])
