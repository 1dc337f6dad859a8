"""The post-training losses under a mesh, on 8 virtual CPU devices: jaxact.policy_gradient_loss,
jaxact.preference_loss, jaxact.distillation_loss and jaxact.top_k_distillation_loss with the
sequences split over "data" and the head(s) over their vocabulary ("model"), data-parallel only,
FSDP heads (as (D, V) and as (V, D) tables), and under Auto axes; each equal to one device (the
loss, the metrics, the gradients of x, w and the bias), the gradients typed as their inputs, and no
collective of the compiled step moving a (tokens, vocabulary) array.

The module runs itself as the 8-device script in a subprocess (as tests/eight_devices.py does it):
one run for the whole module: the top-k distillation's 2x4 case and the distillation's (V, D) FSDP
case by default, the others under -m exhaustive.
"""

from __future__ import annotations

import json
import os
import sys

# Only when run as the 8-device script: pytest's own process must not get 8 devices; the shared
# test helpers (eight_devices) are in tests/, which pytest's conftest puts on the path.
if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eight_devices
import jaxact

EXHAUSTIVE = pytest.mark.exhaustive
SCRIPT = Path(__file__)
# 8 sequences of 4 tokens, D = 24 (the teacher's 40), V = 256 in blocks of 48: a device's 64
# columns (over "model" of 4) end in a block overlapping its predecessor.
B, T, D, DT, V, BLOCK = 8, 4, 24, 40, 256, 48
FEATURES = {D, DT, D // 2, DT // 2}  # whole, or split over "data" (an FSDP head's)
# (mesh shape, axis names, Auto axes, head layout, head's feature axis): the sequences over "data",
# the vocabulary over "model"; "fsdp" also splits each head's features over "data" (an FSDP head),
# "vd" does so for heads stored as (V, D) tables.
MESHES = {
  "2x4": ((2, 4), ("data", "model"), False, "dv", None),
  "data": ((8,), ("data",), False, "dv", None),
  "auto": ((2, 4), ("data", "model"), True, "dv", None),
  "fsdp": ((2, 4), ("data", "model"), False, "dv", "data"),
  "vd": ((2, 4), ("data", "model"), False, "vd", "data"),
}
HEAD = "head"  # a head's spec in the builders: (features, vocabulary) axes as the mesh case says
LOSSES = ("policy", "preference", "distill", "topk")
CASES = [f"{loss}-{mesh}" for loss in LOSSES for mesh in MESHES]
# The default run: the two distillations, whose per-device loops are their own (the distillation's
# as an FSDP table: its vocabulary-split loop is distill-2x4's, on the head gathered over "data");
# the others are linear_log_probs calls, whose 2x4 case tests/lce/test_log_probs.py runs by default.
DEFAULT = {"topk-2x4", "distill-vd"}


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b), initial=0) / max(np.max(np.abs(b), initial=0), 1e-30))


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(key, shape, jnp.float32)


def _as(w, layout):
  """A (D, V) head in `layout`."""
  return w if layout == "dv" else w.T


def _policy(layout):
  """``(loss, arrays, specs)``: GRPO with old and reference log-probs, KL, entropy bonus, a
  temperature and a soft cap; arrays ``(x, w, bias, *rest)``, the gradients taken of the first
  three."""
  k = jax.random.split(jax.random.key(0), 7)
  x, w, b = _normal(k[0], (B, T, D)), _normal(k[1], (D, V), 3 / D**0.5), _normal(k[2], (V,))
  tokens = jax.random.randint(k[3], (B, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([4, 3, 4, 1, 2, 4, 4, 3])[:, None]
  adv = _normal(k[4], (B,))
  old = -3 + 0.3 * _normal(k[5], (B, T))
  ref = -3 + 0.3 * _normal(k[6], (B, T))

  def loss(x, w, b, tokens, mask, adv, old, ref):
    return jaxact.policy_gradient_loss(
      x,
      w,
      tokens,
      adv,
      mask=mask,
      old_log_probs=old,
      ref_log_probs=ref,
      bias=b,
      beta=0.04,
      entropy_coef=0.01,
      temperature=0.8,
      logit_soft_cap=5.0,
      w_layout=layout,
      vocab_block_size=BLOCK,
    )

  rows = ("data",)
  specs = (rows, HEAD, ("model",), rows, rows, rows, rows, rows)
  return loss, (x, _as(w, layout), b, tokens, mask, adv, old, ref), specs


def _preference(layout):
  """DPO with the reference computed in the call from its own (vocabulary-split) head."""
  k = jax.random.split(jax.random.key(1), 7)
  x_c, x_r = _normal(k[0], (B, T, D)), _normal(k[1], (B, T, D))
  w, b = _normal(k[2], (D, V), 2 / D**0.5), _normal(k[3], (V,))
  ref_w = w + 0.1 * _normal(k[4], (D, V), 1 / D**0.5)
  t_c, t_r = jax.random.randint(k[5], (B, T), 0, V), jax.random.randint(k[6], (B, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([4, 3, 4, 2, 2, 4, 4, 3])[:, None]

  def loss(x_c, w, b, x_r, t_c, t_r, mask, ref_w):
    return jaxact.preference_loss(
      x_c,
      x_r,
      w,
      t_c,
      t_r,
      chosen_mask=mask,
      rejected_mask=mask,
      bias=b,
      loss="dpo",
      beta=0.1,
      ref_x_chosen=x_c,
      ref_x_rejected=x_r,
      ref_w=ref_w,
      temperature=0.9,
      w_layout=layout,
      vocab_block_size=BLOCK,
    )

  rows = ("data",)
  specs = (rows, HEAD, ("model",), rows, rows, rows, rows, HEAD)
  return loss, (x_c, _as(w, layout), b, x_r, t_c, t_r, mask, _as(ref_w, layout)), specs


def _distill(layout):
  """The generalized JSD with soft caps on both heads, a temperature, a mask and hard labels."""
  k = jax.random.split(jax.random.key(2), 7)
  x, w, b = _normal(k[0], (B, T, D)), _normal(k[1], (D, V), 2 / D**0.5), _normal(k[2], (V,))
  xt, wt, bt = _normal(k[3], (B, T, DT)), _normal(k[4], (DT, V), 2 / DT**0.5), _normal(k[5], (V,))
  labels = jax.random.randint(k[6], (B, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([4, 3, 4, 1, 2, 4, 4, 3])[:, None]

  def loss(x, w, b, xt, wt, bt, labels, mask):
    return jaxact.distillation_loss(
      x,
      w,
      xt,
      wt,
      bias=b,
      teacher_bias=bt,
      divergence="jsd",
      beta=0.3,
      temperature=0.7,
      mask=mask,
      labels=labels,
      hard_label_weight=0.3,
      logit_soft_cap=5.0,
      teacher_logit_soft_cap=6.0,
      w_layout=layout,
      teacher_w_layout=layout,
      vocab_block_size=BLOCK,
    )

  rows = ("data",)
  specs = (rows, HEAD, ("model",), rows, HEAD, ("model",), rows, rows)
  return loss, (x, _as(w, layout), b, xt, _as(wt, layout), bt, labels, mask), specs


def _topk(layout):
  """The generalized JSD from a stored top-16 (in random order), a soft cap, a temperature, a
  mask and hard labels."""
  k = jax.random.split(jax.random.key(3), 6)
  x, w, b = _normal(k[0], (B, T, D)), _normal(k[1], (D, V), 2 / D**0.5), _normal(k[2], (V,))
  teacher = jax.nn.log_softmax(2 * _normal(k[3], (B, T, V)))
  idx = jnp.argsort(jax.random.uniform(k[4], (B, T, V)), axis=-1)[..., :16]
  lp = jnp.take_along_axis(teacher, idx, axis=-1)
  labels = jax.random.randint(k[5], (B, T), 0, V)
  mask = jnp.arange(T)[None, :] < jnp.array([4, 3, 4, 1, 2, 4, 4, 3])[:, None]

  def loss(x, w, b, idx, lp, labels, mask):
    return jaxact.top_k_distillation_loss(
      x,
      w,
      idx,
      lp,
      bias=b,
      divergence="jsd",
      beta=0.3,
      temperature=0.7,
      mask=mask,
      labels=labels,
      hard_label_weight=0.3,
      logit_soft_cap=5.0,
      w_layout=layout,
      vocab_block_size=BLOCK,
    )

  rows = ("data",)
  specs = (rows, HEAD, ("model",), rows, rows, rows, rows)
  return loss, (x, _as(w, layout), b, idx, lp, labels, mask), specs


BUILD = {"policy": _policy, "preference": _preference, "distill": _distill, "topk": _topk}
COLLECTIVE = re.compile(
  r"= (.*?) (all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\("
)


def _collectives(text: str) -> list[str]:
  """``"op f32[a,b]"`` for every array a collective of the compiled program produces."""
  out = set()
  for shapes, op in COLLECTIVE.findall(text):
    out |= {f"{op} {s}" for s in re.findall(r"[a-z]+\d*\[[\d,]*\]", shapes)}
  return sorted(out)


def _logits_sized(entry: str) -> bool:
  """Whether a collective's array is (tokens, vocabulary)-like: at least two dimensions, none of
  them a feature size (dx, dw are weight- or activation-sized), one of them a vocabulary block
  (48 columns or more), and more numbers than a bias of the whole vocabulary."""
  dims = [int(d) for d in re.findall(r"\d+", entry.split("[", 1)[1])]
  return len(dims) >= 2 and not FEATURES & set(dims) and max(dims) >= BLOCK and math.prod(dims) > V


def _spec(spec, ndim: int) -> str:
  """A partition spec padded to `ndim` entries (P('data') and P('data', None) are one sharding)."""
  return str((*spec, *(None,) * (ndim - len(spec))))


def mesh_case(name: str) -> None:
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  loss_name, mesh_name = name.split("-")
  shape, axes, auto, layout, features = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, axes, (AxisType.Auto if auto else AxisType.Explicit,) * len(axes))
  loss, arrays, specs = BUILD[loss_name](layout)
  head = (features, "model") if layout == "dv" else ("model", features)
  specs = tuple(head if s == HEAD else s for s in specs)

  def step(*arrays):
    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(*arrays)

  single = jax.jit(step)(*jax.device_put(arrays, jax.devices()[0]))

  def pspec(spec):
    return P(*(a if a in axes else None for a in spec))

  shardings = [NamedSharding(mesh, pspec(s)) for s in specs]
  with jax.set_mesh(mesh):
    sharded = tuple(jax.device_put(a, s) for a, s in zip(arrays, shardings, strict=True))
    compiled = jax.jit(step).lower(*sharded).compile()
    got = jax.jit(step)(*sharded)
  ((value, metrics), grads), ((value1, metrics1), grads1) = got, single
  collectives = _collectives(compiled.as_text())
  result = dict(
    case=name,
    devices=jax.device_count(),
    value_err=rel_err(value, value1),
    metrics_err={k: rel_err(metrics[k], metrics1[k]) for k in metrics},
    grad_err=[rel_err(a, r) for a, r in zip(grads, grads1, strict=True)],
    grad_specs=[_spec(g.sharding.spec, g.ndim) for g in grads],
    input_specs=[_spec(s.spec, a.ndim) for s, a in zip(shardings[:3], arrays, strict=False)],
    collectives=collectives,
    logits_sized=[c for c in collectives if _logits_sized(c)],
  )
  print(json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, dict]:
  names = eight_devices.selected_cases(request, __name__, {})
  return eight_devices.run_script_once(SCRIPT, tmp_path_factory, names)


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=[] if n in DEFAULT else EXHAUSTIVE) for n in CASES]
)
# Under -m exhaustive (CI runs it): the default run's sharded LCE is tests/lce/test_log_probs.py's.
@pytest.mark.exhaustive
def test_sharded_equals_one_device(results, name):
  """The loss, every metric and the gradients of x, w and the bias as on one device (float32,
  relative 1e-5); under Explicit axes the gradients typed as their inputs; no collective of the
  compiled step moves an array of (tokens, vocabulary) numbers: per-token numbers, dx and dw,
  db (or each device's columns of them) only."""
  result = eight_devices.get(results, name, SCRIPT)
  assert result["value_err"] < 1e-5, result["value_err"]
  bad = {k: e for k, e in result["metrics_err"].items() if not e < 1e-5}
  assert bad == {}, bad
  assert max(result["grad_err"]) < 1e-5, result["grad_err"]
  _, _, auto, _, fsdp = MESHES[name.split("-")[1]]
  if not auto:
    # Explicit axes: the gradients typed as their inputs, and only sums cross devices (no input
    # resharded: no all-to-all or collective-permute; an all-gather only of an FSDP head, whose
    # gradient is reduce-scattered back)
    assert result["grad_specs"] == result["input_specs"]
    sums = ("all-reduce", "reduce-scatter") + (("all-gather",) if fsdp else ())
    moved = [c for c in result["collectives"] if not c.startswith(sums)]
    assert moved == [], result["collectives"]
    gathered = [c for c in result["collectives"] if c.startswith("all-gather")]
    assert len(gathered) == (0 if not fsdp else 2 if name.startswith("distill") else 1), gathered
  if name == "topk-auto":
    # Known and documented (docs/post-training.md): under Auto axes XLA partitions the top-k
    # loop's per-block scatter and gather itself and all-reduces a (tokens, block) array a block.
    assert all(c.startswith("all-reduce") for c in result["logits_sized"]), result["collectives"]
    return
  assert result["logits_sized"] == [], result["collectives"]


if __name__ == "__main__":
  eight_devices.run_cases({n: functools.partial(mesh_case, n) for n in CASES}, sys.argv[1:])
