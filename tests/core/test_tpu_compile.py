"""Every op family compiled for TPU v5e, v5p and v6e chips this machine does not have.

libtpu's compiler runs here (``support.tpu``): a family's training step, a few scanned layers in
bfloat16, compiles for each chip, and XLA's buffer assignment for the chip gives its temp, checked
against the plain composition a TPU user would write (jax.nn, optax, ``lax.ragged_dot``) compiled
the same way. The values are the CPU suites' (the same XLA programs); on a TPU nothing runs here.

The default suite compiles three families, one for each chip, and a sharded step for a v5p
slice; ``pytest -m exhaustive`` every family for every chip.

Needs libtpu (``python tests/install_tpu_compiler.py``, part of the README's test command; Linux
wheels only). Without it these tests skip, saying why, except under CI (``CI`` set), which installs
it itself: there they fail.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

from support import roofline, tpu

try:
  tpu.topology("v5p")
except tpu.TpuUnavailable as e:  # pragma: no cover - depends on the environment
  if os.environ.get("CI"):
    raise RuntimeError(f"CI installs libtpu, yet: {e}") from e
  pytest.skip(f"cannot compile for a TPU here: {e}", allow_module_level=True)

import jaxact
from jaxact._src.moe.reference import ragged_composition

BF16 = jnp.bfloat16
LAYERS = 4
P = jax.sharding.PartitionSpec


@pytest.fixture(autouse=True)
def _float32_defaults():
  """Compile as a TPU user's program is compiled: without the suite's 64-bit mode."""
  with jax.enable_x64(False):
    yield


def s(*shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def scanned(layer: Callable, x_index: int = 0):
  """``value_and_grad`` of a mean over `LAYERS` scanned applications of ``layer(x, *params)``,
  the params stacked over the layers (argument 1 on), with respect to everything."""

  def loss(x, *params):
    y, _ = lax.scan(lambda x, p: (layer(x, *p), None), x, params)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return jax.value_and_grad(loss, argnums=tuple(range(1 + x_index)))


def stacked(*shapes):
  return [s(LAYERS, *shape.shape, dtype=shape.dtype) for shape in shapes]


class Case(NamedTuple):
  plain: Callable
  jaxact: Callable
  shapes: list
  bound: float  # jaxact's temp at most this times the plain step's


# Large enough that a layer's stash outgrows a chip's on-chip memory (VMEM: XLA keeps smaller
# working sets there, out of the HBM temp measured here).
T, D, F = 8192, 2048, 5632


def _dense(act):
  def layer(x, w, b):
    return act(x @ w + b)

  return layer


def _gated(mlp):
  def layer(x, wg, wu, wd):
    return x + mlp(x, wg, wu, wd)

  return layer


def _plain_gated(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _jaxact_gated(x, wg, wu, wd):
  return jaxact.gated_mlp(x, wg, wu, wd, activation="silu")


def _norm(norm):
  def layer(x, scale, w):
    return x + jax.nn.relu(norm(x, scale) @ w)

  return layer


def _plain_rms(x, scale):
  xf = x.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * scale.astype(jnp.float32)
  return y.astype(x.dtype)


def _attention(attend):
  def layer(x, wq, wkv):
    b, t, d = x.shape
    q = (x @ wq).reshape(b, t, 16, d // 16)
    k, v = jnp.split((x @ wkv).reshape(b, t, 4, d // 8), 2, axis=-1)
    return x + attend(q, k, v, is_causal=True).reshape(b, t, d)

  return layer


def _conv(act, conv_act):
  def plain(x, w, b):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return act(y + b)

  def fused(x, w, b):
    return conv_act(x, w, b)

  return plain, fused


def _batch_norm(norm_act):
  def layer(x, w, scale, bias):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return x + norm_act(y, scale, bias)

  return layer


def _plain_batch_norm(y, scale, bias):
  yf = y.astype(jnp.float32)
  mean = jnp.mean(yf, (0, 1, 2))
  var = jnp.mean(jnp.square(yf - mean), (0, 1, 2))
  return jax.nn.relu((yf - mean) * lax.rsqrt(var + 1e-5) * scale + bias).astype(y.dtype)


def _jaxact_batch_norm(y, scale, bias):
  return jaxact.batch_norm_act(y, scale, bias, activation="relu")[0]


def _moe(moe):
  def layer(x, router, wg, wu, wd):
    return x + moe(x, router, wg, wu, wd)

  return layer


def _plain_moe(x, router, wg, wu, wd):
  return ragged_composition(x, router, wg, wu, wd, top_k=2)


def _jaxact_moe(x, router, wg, wu, wd):
  return jaxact.moe_mlp(x, router, wg, wu, wd, top_k=2)[0]


def _head(loss):
  def step(x, w, labels):
    return jax.value_and_grad(loss, (0, 1))(x, w, labels)

  return step


def _plain_lce(x, w, labels):
  logits = (x @ w).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _jaxact_lce(x, w, labels):
  return jnp.mean(jaxact.linear_cross_entropy(x, w, labels))


def _plain_log_probs(x, w, labels):
  logp = jax.nn.log_softmax((x @ w).astype(jnp.float32))
  return jnp.sum(jnp.take_along_axis(logp, labels[:, None], -1))


def _jaxact_log_probs(x, w, labels):
  return jnp.sum(jaxact.linear_log_probs(x, w, labels))


def _cases() -> dict[str, Case]:
  conv_plain, conv_fused = _conv(
    jax.nn.gelu, functools.partial(jaxact.conv_bias_act, activation="gelu")
  )
  conv_shapes = [s(32, 64, 64, 256), *stacked(s(3, 3, 256, 256), s(256))]
  heads_v = 32768
  head_shapes = [s(T, D), s(D, heads_v), s(T, dtype=jnp.int32)]
  return {
    "activations": Case(
      scanned(_dense(jax.nn.gelu)),
      scanned(_dense(jaxact.gelu)),
      [s(T, D), *stacked(s(D, D), s(D))],
      0.5,
    ),
    "fused": Case(
      scanned(_dense(jax.nn.gelu)),
      scanned(lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation="gelu")),
      [s(T, D), *stacked(s(D, D), s(D))],
      0.5,
    ),
    "conv": Case(scanned(conv_plain), scanned(conv_fused), conv_shapes, 0.5),
    "gated": Case(
      scanned(_gated(_plain_gated)),
      scanned(_gated(_jaxact_gated)),
      [s(T, D), *stacked(s(D, F), s(D, F), s(F, D))],
      0.65,
    ),
    "norms": Case(
      scanned(_norm(_plain_rms)),
      scanned(_norm(jaxact.rms_norm)),
      [s(T, D), *stacked(s(D), s(D, D))],
      0.75,
    ),
    "norm_act": Case(
      scanned(_batch_norm(_plain_batch_norm)),
      scanned(_batch_norm(_jaxact_batch_norm)),
      [s(32, 64, 64, 256), *stacked(s(3, 3, 256, 256), s(256), s(256))],
      0.6,
    ),
    "attention": Case(
      scanned(_attention(jax.nn.dot_product_attention)),
      scanned(_attention(jaxact.dot_product_attention)),
      [s(2, 2048, 1024), *stacked(s(1024, 1024), s(1024, 512))],
      0.1,
    ),
    "moe": Case(
      scanned(_moe(_plain_moe)),
      scanned(_moe(_jaxact_moe)),
      [s(T, D), *stacked(s(D, 8), s(8, D, F), s(8, D, F), s(8, F, D))],
      0.7,
    ),
    "lce": Case(_head(_plain_lce), _head(_jaxact_lce), head_shapes, 0.06),
    "log_probs": Case(_head(_plain_log_probs), _head(_jaxact_log_probs), head_shapes, 0.06),
  }


CASES = _cases()
CHIPS = tuple(tpu.CHIPS)
# Each compile pair costs 5-30 s here (MoE's plain ragged composition 100 s): the default run's TPU
# compile is attention's (tests/attention/test_attention_tpu.py); every family on every chip, and
# the slice, under -m exhaustive, which CI runs.
DEFAULT: set[tuple[str, str]] = set()


def _temp(fn, shapes, target) -> int:
  return tpu.compile_for_tpu(fn, shapes, target).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
  "family,target",
  [
    pytest.param(n, c, marks=() if (n, c) in DEFAULT else pytest.mark.exhaustive)
    for n in CASES
    for c in CHIPS
  ],
)
def test_every_family_compiles_for_a_tpu_within_its_bound(family, target):
  """The family's step compiles for the chip and its temp is at most `bound` times the plain
  composition's (the families' memory claims, on a TPU's buffer assignment)."""
  case = CASES[family]
  plain = _temp(case.plain, case.shapes, target)
  ours = _temp(case.jaxact, case.shapes, target)
  assert ours <= case.bound * plain, (family, target, ours / 2**20, plain / 2**20)


@pytest.mark.exhaustive
def test_a_sharded_step_compiles_for_a_v5p_slice():
  """The dense stack under data parallelism over a v5p 2x2x1 slice (4 chips): jaxact's per-chip
  temp within its bound of the plain step's, and about a quarter of its one-chip temp (the
  activations split over the chips)."""
  case = CASES["fused"]
  specs = [P("data"), *[None] * (len(case.shapes) - 1)]

  def temp(fn, target, in_specs=None):
    compiled = tpu.compile_for_tpu(fn, case.shapes, target, in_specs=in_specs)
    return compiled.memory_analysis().temp_size_in_bytes

  ours, plain = temp(case.jaxact, "v5p:2x2x1", specs), temp(case.plain, "v5p:2x2x1", specs)
  assert ours <= case.bound * plain
  assert ours <= 0.3 * temp(case.jaxact, "v5p")


def test_unknown_tpu_target_is_refused():
  with pytest.raises(ValueError, match=r"TPU target 'v4x' is not known; choose one of v5e"):
    tpu.compile_for_tpu(jnp.sin, [s(4)], "v4x")
  with pytest.raises(ValueError, match=r"mesh axes \{'data': 3\} do not cover the 4 chips"):
    tpu.mesh("v5p:2x2x1", {"data": 3})


@pytest.mark.exhaustive
@pytest.mark.parametrize("target", CHIPS)
def test_the_lm_head_is_at_the_chips_flops(target):
  """The vocabulary-blocked head's step compiled for the chip (16384 tokens, D 4096, V 131072):
  by XLA's cost analysis its HBM traffic takes no longer than its flops at the chip's peaks (too
  narrow a block re-reads x from HBM for every few columns: 256 columns took a v6e 4.3x as long).
  (The counts: support.roofline's, each loop its trip count of times.)"""
  shapes = [s(16384, 4096), s(4096, 131072), s(16384, dtype=jnp.int32)]
  compiled = tpu.compile_for_tpu(_head(_jaxact_lce), shapes, target)
  cost = roofline.cost(compiled.as_text(), jax.devices("cpu")[0].client)
  rates = tpu.chip(target).rates
  bytes_time, flops_time = cost.bytes / rates["bytes_per_s"], cost.flops / rates["flops_per_s"]
  assert bytes_time <= flops_time, (target, bytes_time, flops_time)
