"""``dot_product_attention`` compiled for TPU v5e, v5p and v6e chips: ``implementation=None`` runs
splash attention's kernels there, keeping no more than splash attention called directly.

libtpu's compiler runs here (``support.tpu``). The default suite compiles for a v5p; ``pytest -m
exhaustive`` for every chip, and for a v5p slice under Explicit mesh axes (splash per device).
Without libtpu these tests skip, saying why, except under CI (``CI`` set), which installs it: there
they fail. The kernels' values are tested in interpret mode (test_attention_splash.py).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest

from support import tpu

try:
  tpu.topology("v5p")
except tpu.TpuUnavailable as e:  # pragma: no cover - depends on the environment
  if os.environ.get("CI"):
    raise RuntimeError(f"CI installs libtpu, yet: {e}") from e
  pytest.skip(f"cannot compile for a TPU here: {e}", allow_module_level=True)

import jaxact

B, T, N, K, H = 2, 1024, 8, 2, 128
SHAPES = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]
P = jax.sharding.PartitionSpec


@pytest.fixture(autouse=True)
def _float32_defaults():
  """Compile as a TPU user's program is compiled: without the suite's 64-bit mode."""
  with jax.enable_x64(False):
    yield


def _step(attend):
  def loss(q, k, v):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

  return jax.value_and_grad(loss, (0, 1, 2))


def _jaxact(q, k, v):
  return jaxact.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=30.0)


def _splash(q, k, v):
  """Splash attention as a TPU user calls it: a kernel a key/value head's group of query heads,
  vmapped over batch and key/value heads, q scaled first."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  mask = sa.MultiHeadMask([sa.CausalMask((T, T))] * (N // K))
  block = sa.BlockSizes(*[512] * 8)
  kernel = sa.make_splash_mqa(
    mask, block_sizes=block, head_shards=1, q_seq_shards=1, attn_logits_soft_cap=30.0
  )
  q = (q * H**-0.5).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  o = jax.vmap(jax.vmap(kernel))(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
  return o.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _compiled(attend, target, **kw):
  return tpu.compile_for_tpu(_step(attend), SHAPES, target, **kw)


def _kernels(compiled) -> int:
  return compiled.as_text().count('custom_call_target="tpu_custom_call"')


@pytest.mark.parametrize(
  "target", [pytest.param(c, marks=() if c == "v5p" else pytest.mark.exhaustive) for c in tpu.CHIPS]
)
def test_none_runs_splash_on_a_tpu_and_keeps_what_splash_keeps(target):
  """The forward, dk and dv, and dq kernels in the program; its temp at most 1.05 times that of
  splash attention called directly (what jaxact adds: its row statistics' second row)."""
  ours = _compiled(_jaxact, target)
  assert _kernels(ours) == 3
  theirs = _compiled(_splash, target).memory_analysis().temp_size_in_bytes
  assert ours.memory_analysis().temp_size_in_bytes <= 1.05 * theirs


@pytest.mark.exhaustive
def test_splash_runs_per_chip_under_explicit_mesh_axes():
  """Batch over 2 chips and heads over 2 of a v5p 2x2x1 slice: splash attention per chip, and no
  collective but the loss's sum (one all-reduce of a scalar)."""
  compiled = _compiled(
    _jaxact,
    "v5p:2x2x1",
    in_specs=[P("data", None, "model")] * 3,
    mesh_axes={"data": 2, "model": 2},
    explicit=True,
  )
  collectives = re.findall(
    r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute)\(", compiled.as_text()
  )
  assert _kernels(compiled) == 3
  assert [(shape.split("{")[0], op) for shape, op in collectives] == [("f32[]", "all-reduce")]
