"""Expert parallelism of jaxact.moe_mlp on 8 virtual CPU devices, under Explicit mesh axes: experts
split over an ``expert`` axis (all-to-all dispatch and combine), with data-parallel tokens, tensor-
parallel hidden features and FSDP-split weights beside, dropless (a skewed router sending every
token to two experts) and with a capacity. Each case's value, auxiliary losses and gradients (x,
router, every expert weight), float64, against the same program on one device and against autodiff
of the dense per-expert loop; the collectives read from the compiled gradient's HLO; the errors of
layouts the op refuses.

The module runs itself as the 8-device script in a subprocess (tests/eight_devices.py), once.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

# Only when run as the 8-device script: pytest's own process must not get 8 devices.
if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact
from jaxact._src.moe.reference import moe_reference
from moe_cases import CASES

from cases import representatives

SCRIPT = Path(__file__)
B, S, D, F, E, K = 8, 4, 6, 8, 8, 2  # 32 tokens
# XLA:CPU writes an all-to-all as a tuple of its chunks: `= (f32[4,6], ...) all-to-all(`.
COLLECTIVE = re.compile(
  r"= (\(.*?\)|\S+) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
  r"(?:-start)?\("
)

ERRORS = (
  "error_up_split_otherwise",
  "error_tokens_do_not_split",
  "error_vmap_expert_parallel",
  "error_capacity_per_sequence",
)


def _operands():
  jax.config.update("jax_enable_x64", True)
  ks = jax.random.split(jax.random.key(0), 6)
  shapes = [(B, S, D), (D, E), (E, D, F), (E, D, F), (E, F, D), (B, S, D)]
  scales = [1.0, 1.0, D**-0.5, D**-0.5, F**-0.5, 1.0]
  return [
    s * jax.random.normal(k, sh, jnp.float64) for k, sh, s in zip(ks, shapes, scales, strict=True)
  ]


def _loss(f, ct, **kw):
  def run(x, router, wg, wu, wd):
    y, aux = f(x, router, wg, wu, wd, **kw)
    return jnp.sum(y * ct) + 0.3 * aux["load_balancing_loss"] + 0.1 * aux["router_z_loss"]

  return jax.jit(jax.value_and_grad(run, argnums=range(5)))


def _err(got, want) -> float:
  return max(
    float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / max(1.0, np.max(np.abs(w))))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  )


def case(name: str) -> None:
  shape, names, specs, options = CASES[name]
  x, router, wg, wu, wd, ct = _operands()
  kw = dict(options, top_k=K)
  if kw.pop("router_bias", False):
    kw["router_bias"] = jnp.zeros(E, jnp.float64).at[:2].set(100.0)
  one = _loss(jaxact.moe_mlp, ct, **kw)(x, router, wg, wu, wd)
  ref = _loss(lambda *a, **k: moe_reference(*a, act=jax.nn.silu, **k), ct, **kw)
  # The dense loop has no group limit or sequence-wise loss: those cases against one device (whose
  # routing tests/moe/test_moe_transformers.py checks against transformers').
  dense = one if "expert_groups" in kw else ref(x, router, wg, wu, wd)
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
  with jax.set_mesh(mesh):
    args = [
      jax.device_put(a, NamedSharding(mesh, s))
      for a, s in zip((x, router, wg, wu, wd), specs, strict=True)
    ]
    ct_s = jax.device_put(ct, NamedSharding(mesh, specs[0]))
    step = _loss(jaxact.moe_mlp, ct_s, **kw)
    compiled = step.lower(*args).compile()
    got = compiled(*args)
  kept = [
    g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim)
    for g, s in zip(got[1], specs, strict=True)
  ]
  found = COLLECTIVE.findall(compiled.as_text())
  collectives = sorted(
    {f"{op} {s}" for p, op in found for s in re.findall(r"[a-z]+\d*\[[\d,]*\]", p)}
  )
  # The capacity must drop something here, or the case could not tell a wrong drop from none.
  dropless = dense
  if "capacity_factor" in kw:
    kw.pop("capacity_factor")
    dropless = _loss(lambda *a, **k: moe_reference(*a, act=jax.nn.silu, **k), ct, **kw)(
      x, router, wg, wu, wd
    )
  result = dict(
    case=name,
    devices=jax.device_count(),
    vs_one_device=_err(got, one),
    vs_dense_loop=_err(got, dense),
    capacity_changes_the_loss=float(abs(dense[0] - dropless[0])),
    gradients_keep_their_primals_sharding=all(kept),
    collectives=collectives,
  )
  print(json.dumps(result), flush=True)


def error_case(name: str) -> None:
  x, router, wg, wu, wd, _ = _operands()
  call = functools.partial(jaxact.moe_mlp, top_k=K)
  if name == "error_up_split_otherwise":
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,))
    specs = (P("expert"), P(), P("expert"), P(), P("expert"))
  elif name == "error_capacity_per_sequence":  # its drop is ranked over the whole batch
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,))
    specs = (P("expert"), P(), P("expert"), P("expert"), P("expert"))
    call = functools.partial(call, capacity_factor=1.0, capacity_per_sequence=True)
  elif name == "error_vmap_expert_parallel":  # a batch axis mapped over an expert-parallel call
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,))
    specs = (P(None, "expert"), P(), P("expert"), P("expert"), P("expert"))
    x = jnp.concatenate([x, x], axis=1)  # 8 tokens an element, one a device
    call = jax.vmap(call, (0, None, None, None, None))
  else:  # 15 tokens do not split over the 4 devices of the expert axis
    x = x[:5, :3]
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    specs = (P(), P(), P("expert"), P("expert"), P("expert"))
  with jax.set_mesh(mesh):
    args = [
      jax.device_put(a, NamedSharding(mesh, s))
      for a, s in zip((x, router, wg, wu, wd), specs, strict=True)
    ]
    try:
      jax.jit(call)(*args)
      error = None
    except (ValueError, NotImplementedError) as e:
      error = f"{type(e).__name__}: {e}"
  print(json.dumps(dict(case=name, devices=jax.device_count(), error_text=error)), flush=True)


# The default suite: every axis kind at once, the capacity; the rest (the dropless extreme, the
# DeepSeek-V3 routing options, ep_skewed, among them) under `pytest -m exhaustive`.
DEFAULT = {"ep_data_tensor", "ep_data_capacity"}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
  reads = {"test_layouts_it_cannot_run_are_refused_by_name": "error_up_split_otherwise"}
  names = set(eight_devices.selected_cases(request, __name__, reads))
  if names & {"error_up_split_otherwise"}:
    names |= set(ERRORS)
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, sorted(names))


def _size(collective: str) -> int:
  return int(np.prod([int(d) for d in collective.split("[")[1].rstrip("]").split(",") if d]))


@pytest.mark.parametrize("name", representatives(list(CASES), DEFAULT))
def test_expert_parallel_equals_one_device_and_the_dense_loop(results, name):
  r = eight_devices.get(results, name, SCRIPT)
  assert r["vs_one_device"] < 1e-12 and r["vs_dense_loop"] < 1e-12, r
  assert r["gradients_keep_their_primals_sharding"]
  if name == "ep_data_capacity":
    assert r["capacity_changes_the_loss"] > 1e-3


@pytest.mark.parametrize("name", representatives(list(CASES), DEFAULT))
def test_tokens_move_by_all_to_all_and_nothing_token_sized_is_gathered(results, name):
  collectives = eight_devices.get(results, name, SCRIPT)["collectives"]
  ops = {c.split()[0] for c in collectives}
  # A device's assignments to one device of its group: (tokens a device * min(k, E a device), D).
  shape, names, _, _ = CASES[name]
  n = dict(zip(names, shape, strict=True)).get("expert", 1)
  local_tokens = B * S // (n * dict(zip(names, shape, strict=True)).get("data", 1))
  chunk = local_tokens * min(K, E // n)
  if name == "ep_data_capacity":  # capacity ceil(1.0 * 32 * 2 / 8) = 8 a expert, 2 experts a device
    chunk = min(chunk, 8 * E // n)
  if n > 1:
    assert f"all-to-all f64[{chunk},{D}]" in collectives, collectives
  else:
    assert "all-to-all" not in ops, collectives
  gathered = [c for c in collectives if c.startswith("all-gather")]
  if name == "ep_fsdp":  # the FSDP weights, gathered over `data`: (E/4, D, F) a device
    assert gathered and all(_size(c) == (E // 4) * D * F for c in gathered), gathered
  elif name == "ep_data_capacity":  # each device's (E,) counts, for the rank in the batch
    assert gathered and all(_size(c) == 8 * E for c in gathered), gathered
  else:
    assert gathered == [], gathered
  # Nothing token-sized is summed: the reductions are of the weights' gradients, the tensor-
  # parallel partial rows (a device's own), and scalars.
  for c in collectives:
    if c.startswith("all-reduce"):
      assert _size(c) <= E * D * F, c


def test_layouts_it_cannot_run_are_refused_by_name(results):
  r = eight_devices.get(results, "error_up_split_otherwise", SCRIPT)
  assert "`w_up` and `w_down` must split the experts" in r["error_text"]
  r = eight_devices.get(results, "error_tokens_do_not_split", SCRIPT)
  assert "`x` has 15 tokens, which do not split over the 4 devices" in r["error_text"]
  # vmap raised ragged_dot's "vmap over any dim but 0 - NYI" from inside the experts' shard_map.
  r = eight_devices.get(results, "error_capacity_per_sequence", SCRIPT)
  assert "`capacity_per_sequence` with the experts split over mesh axes" in r["error_text"], r
  r = eight_devices.get(results, "error_vmap_expert_parallel", SCRIPT)
  assert r["error_text"].startswith("NotImplementedError: jaxact.moe_mlp: jax.vmap of an "), r


if __name__ == "__main__":
  cases = {n: (lambda n=n: case(n)) for n in CASES}
  cases.update({n: (lambda n=n: error_case(n)) for n in ERRORS})
  eight_devices.run_cases(cases, sys.argv[1:])
