"""The post-training losses on the inputs at the edges (issue 54's sweep), each against a float64
formula written here: errors naming the function called and its own argument; temperatures at
float32's limits; hidden states and heads of 1e30 and 1e-30 whose logits are ordinary; soft caps
of 1e-30 and 1e30; masked vocabulary entries; no token at all; ``vmap`` over a batch axis.

The float64 reference of each loss is its plain formula over the full logits (``log_softmax`` of
``c tanh((x W + b) / c) / T``) on the float32 inputs cast up. Where the exact value is past
float32's range (a log-probability of -1e40) the float32 one is infinite, as it must be; the
cases here keep every exact value and gradient inside the range, where nothing may be NaN or
infinite and everything must be within float32's rounding of the formula.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

B, S, D, V, K, BLOCK = 2, 3, 4, 20, 4, 7  # blocks of 7 of 20: the last overlaps its predecessor
_rng = np.random.default_rng(0)
X = _rng.normal(size=(B, S, D))
W = _rng.normal(size=(D, V)) / 2
XT = X + 0.3 * _rng.normal(size=(B, S, D))
WT = W + 0.2 * _rng.normal(size=(D, V))
TOKENS = jnp.asarray(_rng.integers(0, V, (B, S)), jnp.int32)
MASK = jnp.array([[True, True, False], [True, False, True]])
ADV = np.array([1.0, -0.5])
f32 = lambda a: jnp.asarray(a, jnp.float32)


# --------------------------------------------------------------------------------- the errors


def _policy(**kw):
  tokens = kw.pop("tokens", TOKENS)
  return jaxact.policy_gradient_loss(f32(X), f32(W), tokens, f32(ADV), mask=MASK, **kw)


def _preference(**kw):
  chosen = kw.pop("chosen_tokens", TOKENS)
  return jaxact.preference_loss(
    f32(X), f32(XT), f32(W), chosen, TOKENS, chosen_mask=MASK, loss="simpo", **kw
  )


def _distillation(**kw):
  return jaxact.distillation_loss(f32(X), f32(W), f32(XT), f32(WT), mask=MASK, **kw)


def _top_k(**kw):
  idx = kw.pop("teacher_indices", jnp.broadcast_to(jnp.arange(K), (B, S, K)))
  lp = jnp.full((B, S, K), -3.0, jnp.float32)
  return jaxact.top_k_distillation_loss(f32(X), f32(W), idx, lp, mask=MASK, **kw)


PADDED = TOKENS.at[0, 1].set(-100)  # counted by MASK
ERRORS = {
  "policy-padding-token": (_policy, dict(tokens=PADDED), ValueError, r"`tokens`.*`mask`"),
  "policy-temperature": (_policy, dict(temperature=0.0), ValueError, "`temperature`"),
  "policy-block": (_policy, dict(vocab_block_size=0), ValueError, "`vocab_block_size`"),
  "preference-padding-token": (
    _preference,
    dict(chosen_tokens=PADDED),
    ValueError,
    r"`chosen_tokens`.*`chosen_mask`",
  ),
  "preference-block": (_preference, dict(vocab_block_size=0), ValueError, "`vocab_block_size`"),
  "distillation-padding-label": (
    _distillation,
    dict(labels=PADDED, hard_label_weight=1.0),
    ValueError,
    r"`labels`.*`mask`",
  ),
  "distillation-label-dtype": (
    _distillation,
    dict(labels=f32(TOKENS), hard_label_weight=1.0),
    TypeError,
    "`labels`",
  ),
  "distillation-label-shape": (
    _distillation,
    dict(labels=TOKENS[:, :2], hard_label_weight=1.0),
    ValueError,
    "`labels`",
  ),
  "top_k-index-V": (
    _top_k,
    dict(teacher_indices=jnp.broadcast_to(jnp.arange(V - K + 1, V + 1), (B, S, K))),
    ValueError,
    r"`teacher_indices`.*drop such positions with `mask`",
  ),
  "top_k-padding-label": (
    _top_k,
    dict(labels=PADDED, hard_label_weight=0.5),
    ValueError,
    r"`labels`.*`mask`",
  ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_function_called_and_its_own_argument(case):
  """Before, an ignore-index label (-100) or a top-k index of V said "mask such tokens with
  `where`" (these losses take `mask`, `chosen_mask`) under another function's name
  (`jaxact.linear_log_probs`, `jaxact.linear_cross_entropy`), as did the options these losses
  hand to it (`temperature`, `vocab_block_size`)."""
  call, kwargs, error, match = ERRORS[case]
  name = {_policy: "policy_gradient_loss", _preference: "preference_loss"}.get(call)
  name = name or {_distillation: "distillation_loss", _top_k: "top_k_distillation_loss"}[call]
  with pytest.raises(error, match=f"^jaxact\\.{name}: .*{match}") as info:
    call(**kwargs)
  assert "`where`" not in str(info.value)
