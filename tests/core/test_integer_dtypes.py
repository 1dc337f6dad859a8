"""Every integer dtype through every public op that takes integers (issue 33).

Integer arrays reach jaxact in two places: class labels (``linear_cross_entropy``, the Flax heads
``LMHead`` and ``attend_cross_entropy``) and the activations' input (``jax.nn`` takes integer
arrays, and so must its drop-ins). Each dtype JAX has (int8 to int64, uint8 to uint64: the tests
run with x64 on) goes through each: labels must be taken as the values they hold, whatever the
vocabulary (the loss equals the one of the same labels as int32); an activation must give
``jax.nn``'s result, dtype included, or refuse as ``jax.nn`` does.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxact
import jaxact.linen as jnn
import jaxact.nnx as jnnx

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def _sweep(default):
  """Every dtype, those not in `default` under ``-m exhaustive`` (tests/lce/test_lce.py runs
  linear_cross_entropy itself over every dtype by default)."""
  return [
    pytest.param(d, id=np.dtype(d).name, marks=() if d in default else pytest.mark.exhaustive)
    for d in INT_DTYPES
  ]


# 300 classes: beyond int8 and uint8, whose labels then hold only part of the vocabulary.
T, D, V = 6, 4, 300


def _labels(dtype) -> np.ndarray:
  top = min(int(np.iinfo(dtype).max), V - 1)
  return np.asarray([0, 1, 2, top // 2, top - 1, top], dtype)


@jax.jit
def _heads_loss(x, labels):
  """The loss of the same labels by every public op that takes labels, in one list."""
  w = jnp.asarray(np.random.default_rng(1).normal(size=(D, V)), jnp.float32)
  out = [jaxact.linear_cross_entropy(x, w, labels, reduction="none")]
  out.append(jaxact.linear_cross_entropy(x, w.T, labels, reduction="none", w_layout="vd"))
  head = jnn.LMHead(V, reduction="none")
  params = head.init(jax.random.key(0), x)
  out.append(head.apply(params, x, labels))
  out.append(jnnx.LMHead(D, V, reduction="none", rngs=nnx.Rngs(0))(x, labels))
  embed = nn.Embed(V, D)
  bound = embed.bind(embed.init(jax.random.key(0), jnp.zeros((1,), jnp.int32)))
  out.append(jnn.attend_cross_entropy(bound, x, labels, reduction="none"))
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  out.append(jnnx.attend_cross_entropy(embed, x, labels, reduction="none"))
  return out


@pytest.mark.parametrize("dtype", _sweep([np.uint16]))
def test_labels_of_every_integer_dtype_in_every_op_that_takes_labels(dtype):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(T, D)), jnp.float32)
  labels = _labels(dtype)
  got = _heads_loss(x, labels)
  want = _heads_loss(x, labels.astype(np.int32))
  for g, r in zip(got, want, strict=True):
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g, r)


# jax.nn has every activation jaxact has but gelu_quick.
ACTIVATIONS = [n for n in jaxact.ACTIVATIONS if hasattr(jax.nn, n)]


def _refusal(f, x):
  """The type of the error ``f`` raises for `x` (at trace time), or None."""
  try:
    jax.eval_shape(f, x)
  except (TypeError, ValueError) as e:
    return type(e)
  return None


def _all(module, names, x):
  return jax.jit(lambda x: [getattr(module, n)(x) for n in names])(x)


# jax.nn's formulas cast constants (-1, 6, ...) to the input's dtype: numpy warns for uint8's.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", _sweep([np.int8, np.uint8]))
def test_activations_take_every_integer_dtype_as_jax_nn(dtype):
  """jaxact's activations give integer inputs to jax.nn's (a documented choice), so each dtype
  gives jax.nn's dtype and values or its refusal. jax.nn's softmax, log_softmax, log_sigmoid and
  hard_tanh are wrong on unsigned inputs (``x - max(x)``, ``-x`` and the clip at -1 wrap
  around); jaxact is the same there (NaN compares equal here)."""
  values = [0, 1, 2, 5, 7, 9] if np.iinfo(dtype).min == 0 else [-3, -1, 0, 1, 2, 5]
  x = jnp.asarray([values, values[::-1]], dtype)
  refused = {n: _refusal(getattr(jax.nn, n), x) for n in ACTIVATIONS}
  for name, error in refused.items():
    assert _refusal(getattr(jaxact, name), x) is error, name
  taken = [n for n in ACTIVATIONS if refused[n] is None]
  assert len(taken) > len(ACTIVATIONS) // 2  # the check can fail
  ours, theirs = _all(jaxact, taken, x), _all(jax.nn, taken, x)
  for name, a, b in zip(taken, ours, theirs, strict=True):
    assert a.dtype == b.dtype, name
    np.testing.assert_array_equal(a, b, err_msg=name)
