"""One behaviour suite for ``dot_product_attention`` over every implementation the family declares
(``attention.rules.FAMILY``: the blocked XLA path, the Triton kernels, cuDNN through jax.nn, and
``"mosaic"``, which has no kernel yet and says so, and None), each meeting the same assertions
against autodiff of the plain formula (``jaxact/_src/attention/reference.py``). Off a GPU the
Triton kernels run in Pallas' interpreter; a backend that cannot run a call (cuDNN off a GPU)
skips with its own reason. The kernels' own corners are in ``test_attention_triton.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxact
from jaxact._src.attention.reference import attention_reference
from jaxact._src.attention.rules import FAMILY

from cases import assert_trees_close, backends, value_and_grads_or_skip

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
B, T, N, K, H = 2, 64, 4, 2, 32


# None takes the XLA path off a GPU (rules.FAMILY: every target): none-float32 is that path by
# default; bfloat16 through it is test_attention.py's half precision against float32.
@pytest.mark.sample(1, "pallas-bfloat16", "cudnn-float32", "splash-bfloat16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_equals_autodiff_of_the_formula(implementation, dtype):
  """Causal grouped-query attention (4 query heads on 2 key/value heads) with a soft cap."""
  kq, kk, kv = jax.random.split(jax.random.key(4), 3)
  q, k, v = (
    jax.random.normal(key, shape, jnp.float32).astype(dtype)
    for key, shape in ((kq, (B, T, N, H)), (kk, (B, T, K, H)), (kv, (B, T, K, H)))
  )
  options = dict(is_causal=True, logits_soft_cap=20.0)
  ours = lambda q, k, v: jaxact.dot_product_attention(
    q, k, v, implementation=implementation, **options
  )
  got = value_and_grads_or_skip(ours, q, k, v)
  up = lambda a: a.astype(jnp.float32)
  want = value_and_grads_or_skip(lambda *a: attention_reference(*a, **options), up(q), up(k), up(v))
  assert_trees_close(got, want, TOL[dtype])
