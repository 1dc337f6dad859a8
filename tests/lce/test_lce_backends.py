"""One behaviour suite for ``linear_cross_entropy`` and ``linear_log_probs`` over every
implementation the family declares (``lce.rules.FAMILY``: the blocked XLA path, the Mosaic GPU
(Hopper) kernels, ``"pallas"``, which has no Triton kernel and says so, and None), each meeting the
same assertions against autodiff of the plain formula (``jaxact/_src/lce/reference.py``). Off a GPU
the kernels run in Pallas' interpreter; a backend that cannot run a call skips with its own reason.
The kernels' own corners are in ``test_lce_mosaic.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxact
from jaxact._src.lce.reference import (
  cross_entropy_reference,
  entropy_reference,
  log_probs_reference,
)
from jaxact._src.lce.rules import FAMILY

from cases import assert_trees_close, backends, value_and_grads_or_skip

# bfloat16: the logits of bf16 operands accumulate in float32 in every path; the gradients of
# x and w are rounded to bf16.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
T, D, V = 256, 128, 1024


# The Hopper kernels run by default in test_lce_mosaic.py (7 s in the interpreter). Off a GPU
# implementation=None is the XLA path, which test_lce.py checks in float32 against float64 with
# these options by default: by default the automatic choice in bfloat16 only.
@pytest.mark.sample(1)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_equals_autodiff_of_the_formula(implementation, dtype):
  """Mean loss over (256, 128) tokens and a (128, 1024) head, a bias, a where-mask, soft cap."""
  kx, kw, kb, kl, km = jax.random.split(jax.random.key(3), 5)
  x = jax.random.normal(kx, (T, D), jnp.float32).astype(dtype)
  w = (D**-0.5 * jax.random.normal(kw, (D, V), jnp.float32)).astype(dtype)
  b = (0.5 * jax.random.normal(kb, (V,), jnp.float32)).astype(dtype)
  labels = jax.random.randint(kl, (T,), 0, V)
  where = jax.random.uniform(km, (T,)) > 0.2
  kw_ = dict(where=where, logit_soft_cap=30.0)
  ours = lambda x, w, b: jaxact.linear_cross_entropy(
    x, w, labels, bias=b, implementation=implementation, **kw_
  )
  got = value_and_grads_or_skip(lambda x, w, b: ours(x, w, b)[None], x, w, b)
  up = lambda a: a.astype(jnp.float32)
  plain = lambda x, w, b: cross_entropy_reference(x, w, labels, bias=b, **kw_)[None]
  want = value_and_grads_or_skip(plain, up(x), up(w), up(b))
  assert_trees_close(got, want, TOL[dtype])


# Off a GPU every default case here is the XLA path, which test_log_probs.py checks by default
# with the same options (test_float32_within_1e5_of_the_float64_reference, in float32;
# test_half_precision_is_computed_in_float32[bfloat16]); the kernels' cases run under -m exhaustive.
@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_log_probs_and_entropy_equal_autodiff_of_the_formula(implementation, dtype):
  """``linear_log_probs`` with its entropy, a temperature and a soft cap, on the same call: the
  cotangents reach both outputs."""
  kx, kw, kl = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(kx, (T, D), jnp.float32).astype(dtype)
  w = (D**-0.5 * jax.random.normal(kw, (D, V), jnp.float32)).astype(dtype)
  tokens = jax.random.randint(kl, (T,), 0, V)
  options = dict(temperature=0.7, logit_soft_cap=30.0)

  def ours(x, w):
    logp, h = jaxact.linear_log_probs(
      x, w, tokens, return_entropy=True, implementation=implementation, **options
    )
    return jnp.stack([logp, h])

  def plain(x, w):
    return jnp.stack(
      [log_probs_reference(x, w, tokens, **options), entropy_reference(x, w, **options)]
    )

  got = value_and_grads_or_skip(ours, x, w)
  want = value_and_grads_or_skip(plain, x.astype(jnp.float32), w.astype(jnp.float32))
  assert_trees_close(got, want, TOL[dtype])
