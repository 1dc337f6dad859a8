"""batch_norm_act's statistics across devices, on 8 virtual CPU devices: ``axis_name`` inside
``shard_map`` (typed and untyped), and a batch sharded under ``jit`` (Auto
and Explicit mesh axes), each equal to one device (output, statistics, gradients of x, scale and
bias), and ``axis_index_groups`` under ``pmap`` equal to one device a group.

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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact
from jaxact._src.norm_act import reference as R

from cases import representatives

SCRIPT = Path(__file__)
CASES = ("shard_map", "shard_map-untyped", "groups", "jit-auto", "jit-explicit")
# The default suite: axis_name in a typed shard_map, axis_index_groups, a batch sharded under jit
# (Explicit axes); the untyped shard_map and Auto axes under `pytest -m exhaustive`.
DEFAULT = {"shard_map", "groups", "jit-explicit"}


def _inputs():
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (16, 3, 8), jnp.float32) * 2 + 0.5
  scale = jax.random.normal(k[1], (8,), jnp.float32).at[::3].set(0.0)
  bias = jax.random.normal(k[2], (8,), jnp.float32)
  ct = jax.random.normal(k[3], x.shape, jnp.float32)
  return x, scale, bias, ct


def _grads(norm, x, scale, bias, ct):
  """``(y, mean, var, dx, dscale, dbias)`` of ``sum(norm(x, scale, bias)[0] * ct)``."""

  def loss(x, scale, bias):
    y, mean, var = norm(x, scale, bias)
    return jnp.sum(y * ct), (y, mean, var)

  grads, aux = jax.grad(loss, (0, 1, 2), has_aux=True)(x, scale, bias)
  return (*aux, *grads)


def ours(axis_name=None, groups=None):
  return lambda x, s, b: jaxact.batch_norm_act(
    x, s, b, activation="silu", axis_name=axis_name, axis_index_groups=groups
  )


def ref(axis_name=None):
  return lambda x, s, b: R.batch_norm_act(x, s, b, jax.nn.silu, axis_name=axis_name)


def _error(got, want) -> float:
  """The largest error relative to each array's scale."""
  return max(
    float(np.abs(np.asarray(g) - np.asarray(w)).max() / max(1.0, np.abs(np.asarray(w)).max()))
    for g, w in zip(got, want, strict=True)
  )


def case(name: str) -> None:
  x, scale, bias, ct = _inputs()
  one = jax.jit(lambda *a: _grads(ours(), *a))(x, scale, bias, ct)
  errors = {}
  if name.startswith("shard_map"):
    typed = name == "shard_map"
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    specs = (P("data"), P(), P(), P("data"))
    # typed: the statistics and the parameters' gradients are the same on every device (psum'd);
    # untyped: each device's own parameter gradients, as autodiff gives them there
    outs = (P("data"), P(), P(), P("data"), P(), P()) if typed else (P("data"), *[P("data")] * 5)

    def run(norm):
      f = jax.shard_map(
        lambda *a: _grads(norm, *a), mesh=mesh, in_specs=specs, out_specs=outs, check_vma=typed
      )
      with jax.set_mesh(mesh):
        args = [
          jax.device_put(a, NamedSharding(mesh, s))
          for a, s in zip((x, scale, bias, ct), specs, strict=True)
        ]
        return jax.jit(f)(*args)

    got, want = run(ours("data")), run(ref("data"))
    errors["vs_autodiff"] = _error(got, want)
    if typed:
      errors["vs_one_device"] = _error(got, one)
  elif name == "groups":  # pmap: shard_map's collectives take no axis_index_groups
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    f = jax.pmap(lambda x: ours("data", groups)(x, scale, bias)[0], axis_name="data")
    y = f(x.reshape(8, 2, *x.shape[1:])).reshape(x.shape)
    halves = [ours()(h, scale, bias)[0] for h in (x[:8], x[8:])]
    errors["vs_halves"] = _error([y], [jnp.concatenate(halves)])
  else:
    kind = AxisType.Auto if name == "jit-auto" else AxisType.Explicit
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P("data")))
      cts = jax.device_put(ct, NamedSharding(mesh, P("data")))
      got = jax.jit(lambda *a: _grads(ours(), *a))(xs, scale, bias, cts)
    errors["vs_one_device"] = _error(got, one)
  print(json.dumps(dict(case=name, devices=jax.device_count(), errors=errors)), flush=True)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
  names = eight_devices.selected_cases(request, __name__, {})
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


@pytest.mark.parametrize("name", representatives(list(CASES), DEFAULT))
# Under -m exhaustive (CI runs it): the default run's statistics over devices are
# tests/norm_act/test_conv_norm_act_devices.py's.
@pytest.mark.exhaustive
def test_sharded_statistics_equal_one_device(results, name):
  errors = eight_devices.get(results, name, SCRIPT)["errors"]
  assert errors and all(e < 1e-5 for e in errors.values()), errors


if __name__ == "__main__":
  eight_devices.run_cases({n: (lambda n=n: case(n)) for n in CASES}, sys.argv[1:])
