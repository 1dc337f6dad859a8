"""The one dispatch point: which backend each fused call gets, for each target, and why.

Decisions are read from :func:`jaxact._src.core.dispatch.decide` directly (what the fused ops
ask), under abstract meshes of an H100, an A100 and a pre-Ampere GPU, with no GPU here. The lowered
programs that these decisions produce are checked in tests/fused/test_dense_triton.py and
tests/fused/test_dense_mosaic.py.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxact._src import docs
from jaxact._src.activations import api as activations
from jaxact._src.activations.resolve import Act
from jaxact._src.core import dispatch
from jaxact._src.fused import rules
from jaxact._src.fused.plan import Conv, Dense, Plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
H100, A100, V100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB"


def mesh(kind: str, platform: str = "cuda") -> AbstractMesh:
  device = AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
  return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)


def plan(activation="gelu", dtype=jnp.bfloat16, conv=False, precision=None) -> Plan:
  spec = activations.get_spec(activation)
  z = jax.ShapeDtypeStruct((256, 512), jnp.float32)
  rule, dynamic = activations._split_params(spec, z, {p.name: p.default for p in spec.params})
  assert not dynamic
  if conv:
    dn = jax.lax.conv_dimension_numbers((1, 8, 8, 64), (3, 3, 64, 512), ("NHWC", "HWIO", "NHWC"))
    linear = Conv((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), dn, 1, precision)
  else:
    linear = Dense(precision)
  return Plan(linear, Act(rule=rule), jnp.dtype(jnp.float32), jnp.dtype(dtype), True)


def operands(m=256, k=128, n=512, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)


def decide(implementation, p=None, x_w=None, kind=None):
  p = p or plan()
  x, w = x_w or operands()
  if kind is None:
    return rules.decide("dense_bias_act", implementation, p, x, w)
  with jax.sharding.use_abstract_mesh(mesh(kind)):
    return rules.decide("dense_bias_act", implementation, p, x, w)


def test_the_target_is_read_from_the_abstract_mesh():
  with jax.sharding.use_abstract_mesh(mesh(H100)):
    t = dispatch.target()
    assert t.cuda and t.hopper and t.device_kind == H100 and t.sms == 132
  with jax.sharding.use_abstract_mesh(mesh(A100)):
    t = dispatch.target()
    assert t.cuda and not t.hopper and t.ampere_or_newer
  with jax.sharding.use_abstract_mesh(mesh("cpu", platform="cpu")):
    assert not dispatch.target().cuda
  assert not dispatch.target().cuda  # this machine: CPU only
  assert dispatch.Target(device_kind="NVIDIA H200").hopper
  assert not dispatch.Target(compute_capability=7.0).ampere_or_newer


def test_xla_is_xla_everywhere():
  for kind in (None, H100, A100):
    assert decide("xla", kind=kind) == dispatch.Decision()


def test_none_on_hopper_takes_the_mosaic_forward_and_xlas_backward():
  d = decide(None, kind=H100)
  assert (d.forward, d.backward, d.forced) == ("mosaic", "xla", False)
  assert d.target.hopper


def test_none_on_hopper_keeps_xla_for_dense_layers_the_mosaic_kernel_does_not_take():
  # M = 200 is not a multiple of the Mosaic kernel's 128-row tile; the Triton kernels could run
  # it, but measured slower than XLA on Hopper.
  d = decide(None, x_w=operands(m=200), kind=H100)
  assert (d.forward, d.backward) == ("xla", "xla")
  assert "Triton matmul kernels" in d.declined


def test_none_on_ampere_takes_the_triton_kernels():
  d = decide(None, x_w=operands(m=200), kind=A100)
  assert (d.forward, d.backward, d.forced) == ("triton", "triton", False)


def test_none_for_convolutions_on_hopper_takes_the_triton_epilogues():
  x = jax.ShapeDtypeStruct((1, 8, 8, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((3, 3, 64, 512), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(mesh(H100)):
    d = rules.decide("conv_bias_act", None, plan(conv=True), x, w)
  assert (d.forward, d.backward) == ("triton", "triton")


def test_none_keeps_xla_before_ampere(monkeypatch):
  monkeypatch.setattr(dispatch, "target", lambda: dispatch.Target(True, V100, 80, 7.0))
  d = decide(None)
  assert (d.forward, d.backward) == ("xla", "xla") and "8.0" in d.declined


def test_none_declines_kernels_for_calls_they_cannot_run_with_the_reason():
  d = decide(None, p=plan(dtype=jnp.float64), x_w=operands(dtype=jnp.float64), kind=A100)
  assert (d.forward, d.backward) == ("xla", "xla") and "float64" in d.declined


def test_named_kernels_are_forced_and_refuse_what_they_cannot_run():
  d = decide("pallas", kind=A100)
  assert (d.forward, d.backward, d.forced) == ("triton", "triton", True)
  d = decide("mosaic", kind=H100)
  assert (d.forward, d.backward, d.forced) == ("mosaic", "mosaic", True)
  with pytest.raises(NotImplementedError, match=r"implementation='mosaic' .* M=200"):
    decide("mosaic", x_w=operands(m=200))
  with pytest.raises(NotImplementedError, match=r"implementation='pallas' .*float64"):
    decide("pallas", p=plan(dtype=jnp.float64), x_w=operands(dtype=jnp.float64))
  with pytest.raises(ValueError, match=r"`implementation` 'cuda' is not known; choose one of"):
    decide("cuda")


def test_every_rule_that_declines_a_kernel_on_measurement_cites_a_results_section():
  table = dispatch.rules_table(*docs.rule_tables())
  rules = [rule for rules in docs.rule_tables() for rule in rules]
  cited = [rule for rule in rules if rule.evidence is not None]
  assert cited
  for rule in cited:
    # "results/<page>.md: <heading>": the page exists under benchmarks/ and has that heading.
    page, section = rule.evidence.split(": ", 1)
    assert re.fullmatch(r"results/[\w-]+\.md", page), rule.evidence
    text = (ROOT / "benchmarks" / page).read_text()
    assert re.search(rf"^#+ {re.escape(section)}$", text, re.M), (rule.where, rule.evidence)
    # The docs' table links it (the anchor is checked by the strict docs build).
    assert f"[{rule.evidence}](benchmarks/{page}#" in table, rule.evidence
  assert all(rule.where in table for rule in rules)


def test_every_familys_rules_are_in_the_one_dispatch_table():
  """Each op family decides its calls in its own rules.py; every table of rules there is one the
  docs' dispatch page is generated from, so that page stays the one decision point."""
  listed = [id(table) for table in docs.rule_tables()]
  paths = sorted((ROOT / "jaxact" / "_src").glob("*/rules.py"))
  assert {p.parent.name for p in paths} >= {"fused", "gated", "lce", "attention"}
  for path in paths:
    module = importlib.import_module(f"jaxact._src.{path.parent.name}.rules")
    tables = [
      v
      for v in vars(module).values()
      if isinstance(v, tuple) and v and all(isinstance(r, dispatch.Rule) for r in v)
    ]
    assert tables, path
    assert all(id(table) in listed for table in tables), path


def _calls(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Attribute):
      names.add(node.attr)
  return names


def test_kernels_know_no_devices_and_the_target_is_looked_up_in_one_place():
  lookups = {"devices", "get_abstract_mesh", "default_backend", "local_devices"}
  for path in sorted((ROOT / "pallas_kernels").glob("*.py")):
    assert not _calls(path) & lookups, path.name
  for path in sorted((ROOT / "jaxact").rglob("*.py")):
    if path.name != "dispatch.py":
      assert not _calls(path) & lookups, path.name
