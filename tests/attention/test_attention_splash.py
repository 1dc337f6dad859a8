"""``dot_product_attention`` on splash attention (jax's Mosaic TPU kernels,
``pallas_kernels.attention_splash``) and the choice of it on a TPU.

On CPU the kernels run in Pallas interpret mode (``implementation="splash"``), against the float64
autodiff of the plain formula written here (values and the gradients of q, k and v): causal and
not, grouped-query and multi-query, with and without a soft cap. Which backend ``None`` takes is
read from the decision under abstract meshes of TPU, GPU and CPU devices (no libtpu needed);
tests/attention/test_attention_tpu.py compiles the op for TPU chips.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import jaxact
from jaxact._src.attention import api_checks, rules
from jaxact._src.core import dispatch

from cases import assert_trees_close

F64 = jnp.float64
TPU = "TPU v5"


@dataclasses.dataclass(frozen=True)
class Case:
  t: int = 256
  s: int = 256
  heads: tuple[int, int] = (4, 2)  # N query heads, K key/value heads
  h: int = 128
  causal: bool = True
  soft_cap: float | None = 20.0
  b: int = 1
  dtype: type = jnp.float32


def formula(q, k, v, *, causal: bool, soft_cap):
  """Attention written out: grouped heads, ``c tanh(s / c)``, top-left causal mask, softmax."""
  _, t, n, h = q.shape
  kv_heads = k.shape[2]
  k = jnp.repeat(k, n // kv_heads, axis=2)
  v = jnp.repeat(v, n // kv_heads, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)


def value_and_grads(f, q, k, v, c):
  return jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * c), (0, 1, 2))(q, k, v)


CASES = {
  "causal-gqa-cap": Case(),
  "full-mqa": Case(heads=(2, 1), causal=False, soft_cap=None),
  "causal-mha-t-below-s": Case(t=128, s=256, heads=(2, 2), soft_cap=None),
  "causal-gqa-cap-bfloat16": Case(dtype=jnp.bfloat16),
}
# Largest error, relative to the largest entry of the float64 result: float32 rounding; bfloat16
# operands, their products accumulated in float32, and q scaled in bfloat16 before the kernels.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=() if n == "causal-gqa-cap" else pytest.mark.exhaustive) for n in CASES],
)
def test_splash_equals_autodiff_of_the_formula(name):
  """Values and the gradients of q, k and v through the kernels (interpret mode), within the
  dtype's rounding of the float64 formula's."""
  case = CASES[name]
  n, kv_heads = case.heads
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, c = (
    jax.random.normal(key, shape, jnp.float32).astype(case.dtype)
    for key, shape in zip(
      keys,
      [
        (case.b, case.t, n, case.h),
        *[(case.b, case.s, kv_heads, case.h)] * 2,
        (case.b, case.t, n, case.h),
      ],
      strict=True,
    )
  )
  opts = dict(is_causal=case.causal, logits_soft_cap=case.soft_cap)

  def ours(q, k, v):
    return jaxact.dot_product_attention(q, k, v, implementation="splash", **opts)

  got = jax.jit(lambda *a: value_and_grads(ours, *a))(q, k, v, c)
  up = lambda a: a.astype(F64)
  want = value_and_grads(
    lambda q, k, v: formula(q, k, v, causal=case.causal, soft_cap=case.soft_cap),
    up(q),
    up(k),
    up(v),
    up(c),
  )
  assert_trees_close(got, want, TOL[case.dtype])


DEFAULTS = dict(
  scale=None,
  is_causal=True,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  logits_soft_cap=None,
  query_segment_ids=None,
  key_value_segment_ids=None,
  dropout_rate=0.0,
  dropout_rng=None,
  broadcast_dropout=True,
  precision=None,
)


def _call(t=256, dtype=jnp.bfloat16, **options):
  """The checked call of ``dot_product_attention`` (bf16, 8 query heads on 2, H 128) that the
  rules decide on."""
  q = np.zeros((2, t, 8, 128), dtype)
  k = np.zeros((2, t, 2, 128), dtype)
  return api_checks.call(q, k, k, None, None, **(DEFAULTS | options))[0]


def _mesh(platform: str, kind: str, size: int = 1, axis_type=AxisType.Explicit) -> AbstractMesh:
  device = AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
  return AbstractMesh((size,), ("x",), (axis_type,), abstract_device=device)


def _decide(mesh=None, implementation=None, **options):
  call = _call(**options)
  if mesh is None:
    return rules.decide("dot_product_attention", implementation, call)
  with jax.sharding.use_abstract_mesh(mesh):
    return rules.decide("dot_product_attention", implementation, call)


def test_the_target_is_a_tpu_under_a_mesh_of_tpu_devices():
  with jax.sharding.use_abstract_mesh(_mesh("tpu", TPU)):
    t = dispatch.target()
  assert t.tpu and t.accelerator and not t.cuda and t.device_kind == TPU
  assert not dispatch.target().tpu  # this machine: CPU only


def test_none_takes_splash_on_a_tpu_and_xla_everywhere_else():
  d = _decide(_mesh("tpu", TPU))
  assert (d.forward, d.backward, d.forced) == ("splash", "splash", False)
  assert _decide(_mesh("tpu", TPU), logits_soft_cap=30.0).forward == "splash"
  for mesh in (None, _mesh("cuda", "NVIDIA H100 80GB HBM3"), _mesh("cpu", "cpu")):
    d = _decide(mesh)
    assert (d.forward, d.backward) == ("xla", "xla"), mesh


@pytest.mark.parametrize(
  "options,reason",
  [
    (dict(t=192), "multiples of 128"),
    (dict(dtype=jnp.float16), "dtype float16"),
    (dict(local_window_size=(64, 0)), "local_window_size"),
    (dict(query_seq_lengths=np.array([256, 100])), "lengths"),
  ],
  ids=["length", "float16", "window", "lengths"],
)
def test_none_keeps_xla_on_a_tpu_for_calls_splash_does_not_take(options, reason):
  d = _decide(_mesh("tpu", TPU), **options)
  assert (d.forward, d.backward) == ("xla", "xla") and reason in d.declined
  with pytest.raises(NotImplementedError, match=rf"implementation='splash' .*{reason}"):
    _decide(implementation="splash", **options)


def test_none_keeps_xla_under_auto_mesh_axes_that_split_and_splash_refuses_them():
  """A kernel is a custom call XLA cannot partition: under Auto axes it would gather its operands
  whole onto every device."""
  mesh = _mesh("tpu", TPU, size=4, axis_type=AxisType.Auto)
  d = _decide(mesh)
  assert (d.forward, d.backward) == ("xla", "xla") and "Auto mesh axes ['x']" in d.declined
  with pytest.raises(NotImplementedError, match=r"implementation='splash' .*Auto mesh axes"):
    _decide(mesh, implementation="splash")
  assert _decide(_mesh("tpu", TPU, size=4)).forward == "splash"  # Explicit: run per device
