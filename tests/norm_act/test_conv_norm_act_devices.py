"""ConvNormAct and NormActConv with ``axis_name`` across devices, on 8 virtual CPU devices: the
batch statistics averaged over the devices, as Flax's ``nn.BatchNorm(axis_name=...)`` averages
them. Under ``jax.pmap`` (the ImageNet example's ``train.py``) and ``jax.shard_map``, each
layer's output, gradients (parameters, pmean'd; input) and updated batch statistics equal Flax's
composition there and one device on the whole batch; the same layer without ``axis_name`` does
not (what a port that drops it gets).

The module runs itself as the 8-device script in a subprocess (as tests/eight_devices.py does it),
once for the module.
"""

from __future__ import annotations

import json
import os
import sys

# Only when run as the 8-device script: pytest's own process must not get 8 devices.
if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact.linen as jnn
import jaxact.nnx as jnnx

from cases import representatives

SCRIPT = Path(__file__)
CASES = (
  "conv-norm-act-pmap",
  "norm-act-conv-pmap",
  "conv-norm-act-nnx-shard_map",
  "norm-act-conv-nnx-shard_map",
)
# The default suite: nnx under shard_map (tests/norm_act/test_norm_act_mesh.py's statistics under
# shard_map too); linen under pmap, the ImageNet example's way, and the other pairings under
# `pytest -m exhaustive` (the suite's time).
DEFAULT = {"norm-act-conv-nnx-shard_map"}
BN = dict(momentum=0.9, epsilon=1e-5)  # the ImageNet example's


class FlaxUnit(nn.Module):
  """The example's conv, batch norm and relu, in `order` ("conv-norm-act" or "norm-act-conv")."""

  order: str = "conv-norm-act"
  axis_name: str | None = "batch"

  @nn.compact
  def __call__(self, x):
    norm = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name, **BN)
    if self.order == "conv-norm-act":
      return nn.relu(norm(nn.Conv(8, (3, 3), use_bias=False)(x)))
    return nn.Conv(8, (3, 3))(nn.relu(norm(x)))


def ours(order, axis_name="batch"):
  layer = jnn.ConvNormAct if order == "conv-norm-act" else jnn.NormActConv
  kw = dict(use_running_average=False, axis_name=axis_name, activation="relu", **BN)
  return layer(8, (3, 3), **kw)


def _inputs():
  kx, kc = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (16, 6, 6, 4), jnp.float32) * 2 + 0.5
  return x, jax.random.normal(kc, (16, 6, 6, 8), jnp.float32)


def _step(module, variables, axis_name):
  """(y, d params, d x, new batch_stats) of sum(y * ct), the gradients and statistics pmean'd
  over `axis_name` as train.py's step does (None: one device)."""

  def loss(params, x, ct):
    y, new = module.apply({**variables, "params": params}, x, mutable=["batch_stats"])
    return jnp.sum(y * ct), (y, new)

  def run(x, ct):
    (grads, dx), (y, new) = jax.grad(loss, (0, 1), has_aux=True)(variables["params"], x, ct)
    if axis_name is not None:
      grads, new = jax.lax.psum(grads, axis_name), jax.lax.pmean(new, axis_name)
    return y, grads, dx, new

  return run


def _error(got, want) -> float:
  """The largest error relative to each array's scale."""
  pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  return max(
    float(np.abs(np.asarray(g) - np.asarray(w)).max() / max(1.0, np.abs(np.asarray(w)).max()))
    for g, w in pairs
  )


def _split(a):
  return a.reshape(8, -1, *a.shape[1:])


def _join(tree):  # y and dx back to one batch; the replicated gradients and statistics: one copy
  y, grads, dx, new = tree
  one = lambda t: jax.tree.map(lambda a: a[0], t)
  return y.reshape(-1, *y.shape[2:]), one(grads), dx.reshape(-1, *dx.shape[2:]), one(new)


def case_linen(order: str) -> dict:
  x, ct = _inputs()
  variables = FlaxUnit(order).init(jax.random.key(1), x)
  variables = jax.tree.map(lambda v: v + 0.1, variables)  # a trained checkpoint

  def pmapped(module, axis_name="batch"):
    f = jax.pmap(_step(module, variables, axis_name), axis_name="batch")
    return _join(f(_split(x), _split(ct)))

  whole = _step(FlaxUnit(order, axis_name=None), variables, None)(x, ct)
  got = pmapped(ours(order))
  return {
    "vs_flax": _error(got, pmapped(FlaxUnit(order))),
    "vs_one_device": _error(got, whole),
    "without_axis_name": _error(pmapped(ours(order, axis_name=None)), whole),
  }


def case_nnx(order: str) -> dict:
  x, ct = _inputs()
  layer = jnnx.ConvNormAct if order == "conv-norm-act" else jnnx.NormActConv
  make = lambda axis_name: layer(
    4, 8, (3, 3), activation="relu", axis_name=axis_name, rngs=nnx.Rngs(0), **BN
  )

  def step(axis_name):
    graph, state = nnx.split(make(axis_name))

    def run(state, x, ct):
      def loss(state, x):
        layer = nnx.merge(graph, state)
        y = layer(x)
        return jnp.sum(y * ct), (y, nnx.state(layer, nnx.BatchStat))

      (grads, dx), (y, stats) = jax.grad(loss, (0, 1), has_aux=True)(state, x)
      grads = nnx.state(nnx.merge(graph, grads), nnx.Param)
      if axis_name is not None:
        grads = jax.lax.psum(grads, axis_name)
      return y, grads, dx, stats

    return state, run

  state, run = step(None)
  whole = run(state, x, ct)
  mesh = jax.make_mesh((8,), ("batch",))
  results = {}
  for name, axis_name in (("vs_one_device", "batch"), ("without_axis_name", None)):
    state, run = step(axis_name)
    f = jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(P(), P("batch"), P("batch")),
      out_specs=(P("batch"), P(), P("batch"), P()),
      check_vma=False,
    )
    with jax.set_mesh(mesh):
      rows = jax.sharding.NamedSharding(mesh, P("batch"))
      args = jax.device_put(x, rows), jax.device_put(ct, rows)
      results[name] = _error(jax.jit(f)(state, *args), whole)
  return results


def case(name: str) -> None:
  order, _, how = name.rpartition("-")
  errors = case_nnx(order[: -len("-nnx")]) if how == "shard_map" else case_linen(order)
  print(json.dumps(dict(case=name, devices=jax.device_count(), errors=errors)), flush=True)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
  names = eight_devices.selected_cases(request, __name__, {})
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


@pytest.mark.parametrize("name", representatives(list(CASES), DEFAULT))
def test_axis_name_averages_the_statistics_over_the_devices(results, name):
  errors = dict(eight_devices.get(results, name, SCRIPT)["errors"])
  dropped = errors.pop("without_axis_name")
  assert errors and all(e < 1e-5 for e in errors.values()), errors
  assert dropped > 1e-3, dropped  # the check sees a layer that drops axis_name


if __name__ == "__main__":
  eight_devices.run_cases({n: (lambda n=n: case(n)) for n in CASES}, sys.argv[1:])
