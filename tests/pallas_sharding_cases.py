"""Per-shard Pallas kernels on 8 virtual CPU devices (interpret mode): run as a script.

``python tests/pallas_sharding_cases.py [case ...]`` prints one JSON object per case
(tests/core/test_pallas_sharding.py runs it in a subprocess and asserts on them). It needs 8
devices, which XLA:CPU gives only if ``--xla_force_host_platform_device_count=8`` is in
``XLA_FLAGS`` before
JAX initialises its backend, so, run as a script, it sets that flag itself before importing JAX.

Every case shards the operands of one layer over an Explicit mesh (``jax.make_mesh``'s default
axis type), runs a jitted ``jax.value_and_grad`` of a loss through it with
``implementation="pallas"`` and reports, against the same step on one device:

* ``errs``: the largest difference of the value and of each gradient from the one-device run of the
  kernels, relative to that output's largest magnitude (``xla_errs``: the same against XLA);
* ``specs``: the partition spec of each output of the step;
* ``pallas_calls``: each ``pallas_call`` of the step's jaxpr, whether it sits inside a
  ``shard_map`` and the shapes of its operands;
* ``collectives``: the collectives of the compiled step.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

# Only when run: pytest's --doctest-modules imports this file too, and must not get 8 devices.
if __name__ == "__main__" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact
from jaxact._src.core import pallas_sharding

KERNELS = ("pallas_call", "mpmd_map")  # Triton kernels; Mosaic GPU kernels (plgpu.kernel)


def allow_concurrent_mosaic_interpreters() -> None:
  """Let Mosaic GPU's interpreter run on 8 devices at once.

  When one device's kernel ends, the interpreter (jax 0.11-0.12) asserts that no barrier of *any*
  device is still allocated; XLA:CPU runs the 8 devices concurrently, so the assertion trips on
  another device's live barriers ("Barrier remains allocated"). That one check is skipped, in this
  subprocess only; every result is still compared with the same kernels on one device.
  """
  try:
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  except ImportError:  # pragma: no cover - moved in a newer jax: the check then runs
    return
  memory = getattr(shared_memory, "GPUSharedMemory", None)
  if memory is not None and hasattr(memory, "assert_no_barriers_allocated"):
    memory.assert_no_barriers_allocated = lambda self: None


COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(")


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def pallas_calls(jaxpr, in_shard_map: bool = False) -> list[dict]:
  """Every kernel call (pallas_call, Mosaic GPU's mpmd_map) in `jaxpr` (nested jaxprs
  included), in order."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in KERNELS:
      shapes = [list(v.aval.shape) for v in eqn.invars]
      found.append(dict(in_shard_map=in_shard_map, shapes=shapes))
      continue
    inside = in_shard_map or eqn.primitive.name == "shard_map"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          found += pallas_calls(sub, inside)
  return found


def loss_step(layer):
  """Jitted value and gradients of a loss of `layer`'s output (not a plain sum: the cotangent
  varies)."""

  def loss(*args):
    y = layer(*args)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * y.astype(jnp.float32))

  return jax.jit(lambda *args: jax.value_and_grad(loss, tuple(range(len(args))))(*args))


def run_case(name, layer, args, mesh, specs, reference=None, implementation="pallas") -> None:
  """`layer` (with `implementation`) on `args` sharded by `specs` against one device."""
  sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
  one = [jax.device_put(a, jax.devices()[0]) for a in args]
  step = loss_step(functools.partial(layer, implementation=implementation))
  got = step(*sharded)
  want = step(*one)
  ref = loss_step(reference or functools.partial(layer, implementation="xla"))(*one)
  leaves = lambda t: [t[0], *t[1]]
  result = dict(
    case=name,
    devices=jax.device_count(),
    errs=[rel_err(a, b) for a, b in zip(leaves(got), leaves(want), strict=True)],
    xla_errs=[rel_err(a, b) for a, b in zip(leaves(got), leaves(ref), strict=True)],
    specs=[str(v.sharding.spec) for v in leaves(got)],
    pallas_calls=pallas_calls(jax.make_jaxpr(step)(*sharded).jaxpr),
    collectives=sorted(set(COLLECTIVE.findall(step.lower(*sharded).compile().as_text()))),
  )
  print(json.dumps(result), flush=True)


def dense_args(batch, k, n, bias=True, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((*batch, k)).astype(dtype)
  w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
  b = rng.standard_normal((n,)).astype(dtype)
  return (x, w, b) if bias else (x, w)


def dense(activation):
  def layer(x, w, b=None, *, implementation):
    return jaxact.dense_bias_act(x, w, b, activation=activation, implementation=implementation)

  return layer


# ------------------------------------------------------------------------------- elementwise


def _bias_relu_kernel(z_ref, b_ref, y_ref):
  y_ref[...] = jnp.maximum(z_ref[...] + b_ref[...], 0.0)


def _bias_relu_bwd_kernel(g_ref, y_ref, dz_ref, db_ref):
  dz = jnp.where(y_ref[...] > 0, g_ref[...], 0.0)
  dz_ref[...] = dz
  db_ref[...] = jnp.sum(dz.reshape(-1, dz.shape[-1]), axis=0)


def bias_relu_fwd(z, b, *, interpret):
  out = jax.ShapeDtypeStruct(z.shape, z.dtype)
  return pl.pallas_call(_bias_relu_kernel, out_shape=out, interpret=interpret)(z, b)


def bias_relu_bwd(g, y, *, interpret):
  out = (jax.ShapeDtypeStruct(g.shape, g.dtype), jax.ShapeDtypeStruct(g.shape[-1:], g.dtype))
  return pl.pallas_call(_bias_relu_bwd_kernel, out_shape=out, interpret=interpret)(g, y)


@jax.custom_vjp
def bias_relu(z, b):
  """``relu(z + b)`` over NHWC `z`: a convolution epilogue, as a pair of elementwise kernels."""
  return pallas_sharding.elementwise_forward(bias_relu_fwd)(z, b, interpret=True)


def _bias_relu_vjp_fwd(z, b):
  y = bias_relu(z, b)
  return y, y


def _bias_relu_vjp_bwd(y, g):
  return tuple(pallas_sharding.elementwise_backward(bias_relu_bwd)(g, y, interpret=True))


bias_relu.defvjp(_bias_relu_vjp_fwd, _bias_relu_vjp_bwd)


def bias_relu_layer(z, b, *, implementation):
  if implementation == "xla":
    return jax.nn.relu(z + b)
  return bias_relu(z, b)


# ------------------------------------------------------------------------------------ cases


def forward_replicated_b_case(name, mesh) -> None:
  """Column-parallel w with a replicated b: the kernels take their slice of b (resharded), and
  db comes back replicated like b (on the kernel path and the XLA path)."""
  x, w, b = dense_args((8,), 12, 16, seed=9)
  specs = [P("data", None), P(None, "model"), P()]
  sharded = [
    jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, b), specs, strict=True)
  ]
  fn = jax.jit(functools.partial(dense("elu"), implementation="pallas"))
  result = dict(
    case=name,
    devices=jax.device_count(),
    errs=[rel_err(fn(*sharded), fn(x, w, b))],
    specs=[str(fn(*sharded).sharding.spec)],
    pallas_calls=pallas_calls(jax.make_jaxpr(fn)(*sharded).jaxpr),
    collectives=sorted(set(COLLECTIVE.findall(fn.lower(*sharded).compile().as_text()))),
  )
  for impl in ("pallas", "xla"):
    grad = jax.jit(
      jax.grad(lambda *a, i=impl: jnp.sum(dense("elu")(*a, implementation=i) ** 2), (0, 1, 2))
    )
    got, want = grad(*sharded), grad(x, w, b)
    result[f"grad_errs_{impl}"] = [rel_err(a, r) for a, r in zip(got, want, strict=True)]
    result[f"db_spec_{impl}"] = str(got[2].sharding.spec)
  print(json.dumps(result), flush=True)


def unsupported_case(name, mesh) -> None:
  """x sharded over K: None falls back to XLA (no pallas_call at all), "pallas" raises."""
  args = dense_args((16,), 16, 8)
  specs = [P(None, "data"), P(), P()]
  x, w, b = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True))
  step = loss_step(functools.partial(dense("relu"), implementation=None))
  value, _ = step(x, w, b)
  err = rel_err(value, step(*(jax.device_put(a, jax.devices()[0]) for a in args))[0])
  try:
    loss_step(functools.partial(dense("relu"), implementation="pallas"))(x, w, b)
    raised = None
  except NotImplementedError as e:
    raised = str(e)
  result = dict(
    case=name,
    devices=jax.device_count(),
    err=err,
    auto_pallas_calls=pallas_calls(jax.make_jaxpr(step)(x, w, b).jaxpr),
    raised=raised,
  )
  print(json.dumps(result), flush=True)


def main(names) -> None:
  data8 = lambda: jax.make_mesh((8,), ("data",))
  grid = lambda: jax.make_mesh((2, 4), ("data", "model"))
  cases = {
    # 16 rows over 8 devices; gelu keeps z (input residual).
    "dense_dp": lambda: run_case(
      "dense_dp", dense("gelu"), dense_args((16,), 12, 20), data8(), [P("data"), P(), P()]
    ),
    # Rows over "data", w's columns over "model"; tanh keeps y (output residual).
    "dense_dp_tp": lambda: run_case(
      "dense_dp_tp",
      dense("tanh"),
      dense_args((16,), 12, 24, seed=1),
      grid(),
      [P("data", None), P(None, "model"), P("model")],
    ),
    # Two batch dimensions, each over its own mesh axis, and w's columns over a third.
    "dense_batch_dims": lambda: run_case(
      "dense_batch_dims",
      dense("identity"),
      dense_args((4, 2, 8), 12, 8, seed=2),
      jax.make_mesh((2, 2, 2), ("data", "seq", "model")),
      [P("data", "seq", None), P(None, "model"), P("model")],
    ),
    # Replicated operands on an Explicit mesh: each device runs the whole layer.
    "dense_replicated": lambda: run_case(
      "dense_replicated", dense("silu"), dense_args((8,), 12, 8, seed=10), data8(), [P(), P(), P()]
    ),
    # An Explicit "data" axis beside an Auto "model" one: the kernels are manual over "data" only.
    "dense_dp_auto_axis": lambda: run_case(
      "dense_dp_auto_axis",
      dense("gelu"),
      dense_args((16,), 12, 20, seed=11),
      jax.make_mesh((2, 4), ("data", "model"), (AxisType.Explicit, AxisType.Auto)),
      [P("data"), P(), P()],
    ),
    "forward_replicated_b": lambda: forward_replicated_b_case("forward_replicated_b", grid()),
    "dense_no_bias": lambda: run_case(
      "dense_no_bias",
      dense("relu"),
      dense_args((16,), 12, 16, bias=False, seed=3),
      grid(),
      [P("data", None), P(None, "model")],
    ),
    # A 1x1 convolution (the dense kernels over channels), NHWC batch over 8 devices.
    "conv1x1_dp": lambda: run_case(
      "conv1x1_dp",
      lambda x, w, b, *, implementation: jaxact.conv_bias_act(
        x, w, b, activation="silu", implementation=implementation
      ),
      (
        np.random.default_rng(4).standard_normal((8, 3, 3, 6)).astype(np.float32),
        np.random.default_rng(5).standard_normal((1, 1, 6, 10)).astype(np.float32) / 3,
        np.random.default_rng(6).standard_normal((10,)).astype(np.float32),
      ),
      data8(),
      [P("data"), P(), P()],
    ),
    # A 3x3 convolution: XLA's convolution, the epilogue kernels per shard; batch over 8 devices.
    "conv3x3_dp": lambda: run_case(
      "conv3x3_dp",
      lambda x, w, b, *, implementation: jaxact.conv_bias_act(
        x, w, b, activation="gelu", padding="SAME", implementation=implementation
      ),
      (
        np.random.default_rng(9).standard_normal((8, 6, 6, 4)).astype(np.float32),
        np.random.default_rng(10).standard_normal((3, 3, 4, 10)).astype(np.float32) / 6,
        np.random.default_rng(11).standard_normal((10,)).astype(np.float32),
      ),
      data8(),
      [P("data"), P(), P()],
    ),
    # A convolution epilogue's elementwise kernel pair, batch over "data" (and H over "model").
    "elementwise_dp": lambda: run_case(
      "elementwise_dp",
      bias_relu_layer,
      (
        np.random.default_rng(7).standard_normal((4, 8, 3, 5)).astype(np.float32),
        np.random.default_rng(8).standard_normal((5,)).astype(np.float32),
      ),
      grid(),
      [P("data", "model"), P()],
    ),
    "unsupported_k": lambda: unsupported_case("unsupported_k", data8()),
    # The Hopper (Mosaic GPU) kernels per shard, bf16, in shapes they take on each device
    # (M a multiple of 128, N of 256): rows over 8 devices; rows over "data", w's columns over
    # "model".
    "mosaic_dp": lambda: run_case(
      "mosaic_dp",
      dense("gelu"),
      dense_args((1024,), 64, 256, seed=12, dtype=jnp.bfloat16),
      data8(),
      [P("data"), P(), P()],
      implementation="mosaic",
    ),
    "mosaic_dp_tp": lambda: run_case(
      "mosaic_dp_tp",
      dense("tanh"),
      dense_args((256,), 64, 1024, seed=13, dtype=jnp.bfloat16),
      grid(),
      [P("data", None), P(None, "model"), P("model")],
      implementation="mosaic",
    ),
  }
  eight_devices.run_cases(cases, names)


if __name__ == "__main__":
  allow_concurrent_mosaic_interpreters()
  main(sys.argv[1:])
