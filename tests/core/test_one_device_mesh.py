"""A program written for any number of devices, run on one: its arrays typed over Explicit mesh
axes of one device (``jax.make_mesh((jax.device_count(),), ("data",), ...)`` on one GPU). Such
axes split nothing, so the kernels run as on untyped arrays: ``implementation=None`` decides as it
does without a mesh, ``"pallas"`` runs (interpret mode here) and equals the untyped call, and every
cotangent is typed as its primal. Before, the rules read a one-device contraction, feature axis,
vocabulary or norm input as sharded and declined the kernels, and attention raised for a sequence
typed over such an axis under every implementation."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxact
from jaxact._src.activations import api as activations
from jaxact._src.activations.resolve import Act
from jaxact._src.fused import rules as fused_rules
from jaxact._src.fused.plan import Dense, Plan
from jaxact._src.norm_act import rules as norm_act_rules

H100 = "NVIDIA H100 80GB HBM3"


def _normal(i, shape, scale=1.0):
  return jax.random.normal(jax.random.key(i), shape, jnp.float32) * scale


X2, W, B = _normal(0, (16, 32)), _normal(1, (32, 64), 0.2), _normal(2, (64,))
X4, WC, BC = _normal(3, (4, 8, 8, 16)), _normal(4, (3, 3, 16, 16), 0.2), _normal(5, (16,))
WG, WU, WD = _normal(6, (32, 48), 0.2), _normal(7, (32, 48), 0.2), _normal(8, (48, 32), 0.2)
# x and w: a token tile and a vocabulary tile of the Hopper kernel (128, 256), the least it runs
XB, WB = (
  _normal(11, (128, 128)).astype(jnp.bfloat16),
  _normal(12, (128, 256), 0.1).astype(jnp.bfloat16),
)
Q, K, V = (_normal(i, (2, 32, 4, 16)) for i in (14, 15, 16))
LABELS = jax.random.randint(jax.random.key(13), (128,), 0, 256)
SCALE, BIAS = 1.3 + _normal(9, (16,), 0.1), _normal(10, (16,), 0.1)

CASES = {
  "dense": (
    lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation="gelu", implementation="pallas"),
    (X2, W, B),
  ),
  "conv": (
    lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation="relu", implementation="pallas"),
    (X4, WC, BC),
  ),
  "gated": (
    lambda x, g, u, d: jaxact.gated_mlp(x, g, u, d, implementation="pallas"),
    (X2, WG, WU, WD),
  ),
  "linear_cross_entropy": (
    lambda x, w: jaxact.linear_cross_entropy(x, w, LABELS, implementation="mosaic"),
    (XB, WB),
    (P("data"), P(None, "data")),  # w's vocabulary over the axis, as x's rows
  ),
  "attention": (  # the sequence over the axis (raised for every implementation before)
    lambda q, k, v: jaxact.dot_product_attention(q, k, v, is_causal=True, implementation="pallas"),
    (Q, K, V),
    (P(None, "data"),) * 3,
  ),
  "batch_norm_act": (
    lambda x, s, b: jaxact.batch_norm_act(x, s, b, activation="relu", implementation="pallas")[0],
    (X4, SCALE, BIAS),
  ),
  "group_norm_act": (
    lambda x, s: jaxact.group_norm_act(
      x, s, None, activation="silu", num_groups=4, implementation="pallas"
    ),
    (X4, SCALE),
  ),
}


def _value_and_grads(fn, args):
  y, pull = jax.vjp(fn, *args)
  return y, pull(jnp.cos(y))


# group_norm_act's kernels decline sharded inputs by batch_norm_act's rule (norm_act.rules:
# _sharding): by default batch_norm_act's case stands for both.
@pytest.mark.parametrize(
  "name",
  # group_norm_act declines as batch_norm_act does; attention's and the LM head's typed calls are
  # their own sharding tests' (tests/attention, tests/lce): under -m exhaustive here
  [
    pytest.param(n, marks=pytest.mark.exhaustive)
    if n in ("group_norm_act", "attention", "linear_cross_entropy")
    else n
    for n in CASES
  ],
)
def test_kernels_on_a_one_device_mesh_equal_the_untyped_call(name):
  fn, args, *specs = CASES[name]
  specs = specs[0] if specs else (P("data"),) * len(args)
  run = jax.jit(_value_and_grads, static_argnums=0)
  want = run(fn, args)
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    # by default every array's first dimension over the axis: x's rows, a weight's contraction
    typed = tuple(
      jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)
    )
    y, grads = run(fn, typed)
  for a, g in zip(typed, grads, strict=True):
    assert jax.typeof(g).sharding.spec == jax.typeof(a).sharding.spec
  if name != "linear_cross_entropy":  # a scalar loss; else rows (and a sequence) typed as x's
    assert jax.typeof(y).sharding.spec[:2] == jax.typeof(typed[0]).sharding.spec[:2]
  for u, v in zip(jax.tree.leaves((y, grads)), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(v))))


def _h100(size: int) -> AbstractMesh:
  device = AbstractDevice(device_kind=H100, num_cores=None, platform="cuda")
  return AbstractMesh((size,), ("data",), (AxisType.Explicit,), abstract_device=device)


def _operand(shape, dtype=jnp.bfloat16, mesh=None):
  """An operand, typed with its first dimension over `mesh`'s data axis (untyped without)."""
  sharding = None if mesh is None else NamedSharding(mesh, P("data"))
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _dense_decision(size: int, typed: bool):
  spec = activations.get_spec("gelu")
  z = jax.ShapeDtypeStruct((256, 512), jnp.float32)
  rule, _ = activations._split_params(spec, z, {p.name: p.default for p in spec.params})
  plan = Plan(Dense(None), Act(rule=rule), jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), True)
  mesh = _h100(size)
  # FSDP's typing: x's rows and w's contraction dimension over the data axis
  x, w = (_operand(s, mesh=mesh if typed else None) for s in ((256, 128), (128, 512)))
  with jax.sharding.use_abstract_mesh(mesh):
    return fused_rules.decide("dense_bias_act", None, plan, x, w)


def test_none_decides_on_one_device_axes_as_without_a_mesh():
  want, got = _dense_decision(1, typed=False), _dense_decision(1, typed=True)
  assert (got.forward, got.backward) == (want.forward, want.backward) == ("mosaic", "xla")
  # over two devices the same typing splits the contraction: the kernels decline
  assert "contraction dimension is sharded" in _dense_decision(2, typed=True).declined


def test_norm_kernels_decline_only_inputs_a_mesh_splits():
  plan = types.SimpleNamespace(axis_name=None)
  x = lambda size: _operand((4, 8, 8, 16), jnp.float32, _h100(size))
  assert norm_act_rules._sharding(plan, (x(1), None, None)) is None
  assert norm_act_rules._sharding(plan, (x(2), None, None)).startswith("inputs sharded")


def test_replicated_gated_operands_on_a_mesh_take_the_blocked_backward(monkeypatch):
  """gated's XLA backward runs in blocks of rows on whole arrays (rules.backward_rows): replicated
  operands on an Explicit mesh are whole arrays (read as sharded before: no blocks); operands
  typed over an axis, even of one device, keep one pass (the blocks' products are not written
  for operands typed over mesh axes)."""
  from jaxact._src.gated import rules as gated_rules

  monkeypatch.setattr(gated_rules, "BACKWARD_ROWS", 4)
  args = (X2, WG, WU, WD)  # 16 tokens: four blocks

  def loops(specs):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
      typed = tuple(jax.device_put(a, NamedSharding(mesh, specs)) for a in args)
      grad = jax.grad(lambda *a: jnp.sum(jaxact.gated_mlp(*a)), (0, 1, 2, 3))
      text = str(jax.make_jaxpr(grad)(*typed))
      np.testing.assert_allclose(
        grad(*typed)[1],
        jax.grad(lambda *a: jnp.sum(jaxact.gated_mlp(*a)), 1)(*args),
        rtol=1e-5,
        atol=1e-5,
      )
    return "while" in text or "scan" in text

  assert loops(P()) and not loops(P("data"))
