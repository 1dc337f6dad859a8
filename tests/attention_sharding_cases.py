"""jaxact.dot_product_attention on 8 virtual CPU devices: run as a script (tests/eight_devices.py).

``python tests/attention_sharding_cases.py [case ...]`` prints one JSON object per case
(tests/attention/test_attention_sharding.py asserts on them): batch and heads sharded (data and
tensor parallel, multi- and grouped-query attention with fewer key/value heads than devices),
Explicit and Auto mesh axes, with bias, lengths, segment ids and dropout; each against the same
program on one device (``err``: the largest relative difference of the value and the gradients of
q, k, v, bias), with the collectives of the compiled gradient (``collectives``, with the shapes they
produce) and the error a sequence-sharded query raises.
"""

from __future__ import annotations

import json
import os
import re
import sys

if __name__ == "__main__" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eight_devices
import jaxact

B, T, H = 8, 24, 8
COLLECTIVE = re.compile(
  r"= (.*?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\("
)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def arrays(n, kv_heads):
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (B, T, n, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, T, kv_heads, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, T, kv_heads, H), jnp.float32)
  bias = jax.random.normal(ks[3], (B, 1, T, T), jnp.float32)
  w = jax.random.normal(ks[4], (B, T, n, H), jnp.float32)
  return q, k, v, bias, w


def case(name, mesh, n, kv_heads, q_spec, kv_spec, explicit=True, **kw):
  q, k, v, bias, w = arrays(n, kv_heads)
  lengths = jnp.asarray(np.arange(B) % 5 + T - 4, jnp.int32)
  segments = jnp.asarray(np.arange(T)[None] // (np.arange(B)[:, None] + 5), jnp.int32)
  extra = dict(key_value_seq_lengths=lengths, is_causal=True, logits_soft_cap=3.0, **kw)
  if extra.pop("segments", False):
    extra["query_segment_ids"] = segments

  def loss(q, k, v, bias, w):
    out = jaxact.dot_product_attention(q, k, v, bias, block_sizes=(8, 8), **extra)
    return jnp.sum(out * w)

  step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
  want = jax.jit(step)(q, k, v, bias, w)
  b_spec = P(q_spec[0], None, None, None)
  specs = (q_spec, kv_spec, kv_spec, b_spec, q_spec)
  shardings = [NamedSharding(mesh, s) for s in specs]
  args = [jax.device_put(a, s) for a, s in zip((q, k, v, bias, w), shardings, strict=True)]
  if explicit:
    with jax.set_mesh(mesh):
      lengths = jax.device_put(lengths, NamedSharding(mesh, P(q_spec[0])))
      extra["key_value_seq_lengths"] = lengths
      if "query_segment_ids" in extra:
        rows = NamedSharding(mesh, P(q_spec[0], None))
        extra["query_segment_ids"] = jax.device_put(segments, rows)
      compiled = jax.jit(step).lower(*args).compile()
      got = compiled(*args)
  else:
    compiled = jax.jit(step, in_shardings=shardings).lower(*args).compile()
    got = compiled(*args)
  err = max(rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
  found = COLLECTIVE.findall(compiled.as_text())
  shapes = sorted({f"{op} {s}" for p, op in found for s in re.findall(r"[a-z]+\d*\[[\d,]*\]", p)})
  rows = B // mesh.shape["data"]  # a device's batch rows
  allowed = [1, rows * T * T, rows * T * kv_heads * H]  # loss; bias and k/v gradients' shards
  print(
    json.dumps(
      dict(case=name, devices=jax.device_count(), err=err, collectives=shapes, allowed=allowed)
    )
  )


def seq_sharded(name, mesh):
  q, k, v, _, _ = arrays(8, 8)
  with jax.set_mesh(mesh):
    qs = jax.device_put(q, NamedSharding(mesh, P(None, "data")))
    try:
      jax.jit(jaxact.dot_product_attention)(qs, k, v)
      error = None
    except NotImplementedError as e:
      error = str(e)
  print(json.dumps(dict(case=name, devices=jax.device_count(), error_text=error)))


def main(names) -> None:
  auto = AxisType.Auto
  dp = lambda t=None: jax.make_mesh((8,), ("data",), t)
  tp = lambda t=None: jax.make_mesh((2, 4), ("data", "model"), t)
  cases = {
    "dp_explicit": lambda: case("dp_explicit", dp(), 4, 2, P("data"), P("data")),
    "tp_explicit": lambda: case(
      "tp_explicit", tp(), 8, 4, P("data", None, "model"), P("data", None, "model")
    ),
    "mqa_tp_explicit": lambda: case(
      "mqa_tp_explicit", tp(), 8, 1, P("data", None, "model"), P("data")
    ),
    "gqa_tp_explicit": lambda: case(
      "gqa_tp_explicit", tp(), 8, 2, P("data", None, "model"), P("data")
    ),
    "dp_dropout_explicit": lambda: case(
      "dp_dropout_explicit",
      dp(),
      4,
      4,
      P("data"),
      P("data"),
      dropout_rate=0.2,
      dropout_rng=jax.random.key(1),
      segments=True,
    ),
    "tp_auto": lambda: case(
      "tp_auto",
      tp((auto, auto)),
      8,
      4,
      P("data", None, "model"),
      P("data", None, "model"),
      explicit=False,
    ),
    "seq_explicit": lambda: seq_sharded("seq_explicit", dp()),
  }
  eight_devices.run_cases(cases, names)


if __name__ == "__main__":
  main(sys.argv[1:])
