"""The names jaxact's ops give what they keep (``jaxact.*_CHECKPOINT_NAMES``): under
``jax.checkpoint(policy=save_only_these_names(*names))`` a block keeps what the op keeps and its
backward pass runs without the op's forward, as under a policy that saves everything (the same
compiled flops); under a policy that saves nothing the forward is recomputed. The gated ops' names
are tested in tests/gated."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

B, T, N, H = 2, 64, 2, 16
D = N * H


def _attention(q, k, v):
  return jaxact.dot_product_attention(q, k, v, is_causal=True)


def _norm(x, scale):
  return jaxact.rms_norm(x, scale) * 2.0


def _dense(x, w):
  return jaxact.dense_bias_act(x, w, activation="tanh")


def _dense_gelu(x, w):
  return jaxact.dense_bias_act(x, w, activation="gelu")


def _args(name):
  k = jax.random.split(jax.random.key(0), 3)
  if name == "attention":
    return [jax.random.normal(k[i], (B, T, N, H)) for i in range(3)]
  if name == "norm":
    return [jax.random.normal(k[0], (B, T, D)), jnp.ones((D,))]
  return [jax.random.normal(k[0], (B * T, D)), jax.random.normal(k[1], (D, D)) / D**0.5]


# op, its names, the shapes of what the names keep
CASES = {
  "attention": (_attention, jaxact.ATTENTION_CHECKPOINT_NAMES, [(B, T, N, H), (B, N, 2, T)]),
  "norm": (_norm, jaxact.NORM_CHECKPOINT_NAMES, [(B, T, D), (B, T, 1)]),
  "dense": (_dense, jaxact.FUSED_CHECKPOINT_NAMES, [(B * T, D)]),
  "dense_gelu": (_dense_gelu, jaxact.FUSED_CHECKPOINT_NAMES, [(B * T, D)]),  # z, not y
}


def _flops(fn, args) -> float:
  loss = lambda *a: jnp.sum(fn(*a) ** 2)
  compiled = jax.jit(jax.grad(loss, tuple(range(len(args))))).lower(*args).compile()
  return compiled.cost_analysis()["flops"]


@pytest.mark.parametrize("name", CASES)
def test_named_residuals_spare_the_forward_under_remat(name):
  op, names, shapes = CASES[name]
  args = _args(name)
  save = jax.checkpoint(op, policy=jax.checkpoint_policies.save_only_these_names(*names))
  nothing = jax.checkpoint(op, policy=jax.checkpoint_policies.nothing_saveable)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):  # "f32[2,64] named 'jaxact.x' from ..." a line
    jax.ad_checkpoint.print_saved_residuals(save, *args)
  # Besides the arguments: the named arrays (shown as a jitted function's outputs where the op
  # runs under its own jit, whose inner names the policy reads)
  kept = [
    tuple(int(d) for d in re.findall(r"\d+", dims))
    for dims, why in re.findall(r"^\w+\[([\d,]*)\] (.*)$", out.getvalue(), re.M)
    if not why.startswith(("from the argument", "from a literal"))
  ]
  assert sorted(kept) == sorted(shapes), out.getvalue()
  assert all(n.startswith("jaxact.") for n in re.findall(r"named '([^']+)'", out.getvalue()))
  everything = jax.checkpoint(op, policy=jax.checkpoint_policies.everything_saveable)
  saved, best, recomputed = (_flops(f, args) for f in (save, everything, nothing))
  assert saved == pytest.approx(best, rel=1e-6), (saved, best)
  assert recomputed > saved, (saved, recomputed)
  ct = jnp.ones_like(op(*args))
  for got, want in zip(jax.vjp(save, *args)[1](ct), jax.vjp(op, *args)[1](ct), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
