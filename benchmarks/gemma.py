"""`python -m benchmarks gemma [--sections cpu,h100] [--check] [--out FILE]`: a trimmed Gemma, as
Flax's ``examples/gemma`` writes it and ported to jaxact.

One nnx model, :class:`Gemma`, in two builds with the same parameter tree (the example's names:
``embedder.embedding``, ``layers.<i>.attn.q_einsum.kernel``, ``layers.<i>.mlp.gate_proj.kernel``,
``layers.<i>.pre_attention_norm.scale``, ``final_norm.scale``, ...):

- ``original``: the example's computation: Gemma's RMS norm ``x_hat * (1 + scale)``, attention
  as the example's ``Attention.__call__`` computes it (``example_attention`` of
  ``support.flax_gemma``, which tests/repo/test_porting_guide.py checks the guide's
  recipe against) under train.py's ``make_causal_attn_mask``, with its symmetric sliding window
  on every other layer, GeGLU MLP of three
  ``nnx.Linear``, the tied head ``embedder.attend`` with a final soft cap, and T5X's weighted
  cross-entropy with label smoothing (``train.py``'s ``compute_weighted_cross_entropy``), the
  accuracy from the logits;
- ``jaxact``: the swaps the docs page "Porting a Flax model" shows, nothing else:
  ``jaxact.nnx.RMSNorm(scale_offset=1.0)``, ``jaxact.dot_product_attention`` (``mask``,
  ``is_causal``, ``local_window_size``, ``logits_soft_cap``, ``scale``, GQA; ``is_causal`` and the
  left window because this model's mask is exactly train.py's causal padding mask: the guide's
  general recipe passes the module's ``attn_mask`` instead), ``jaxact.nnx.GatedMLP``
  (gelu), and ``jaxact.nnx.attend_cross_entropy`` (T5X smoothing, weights, soft cap,
  ``return_predictions`` for the accuracy).

Each with and without block remat (``nnx.remat`` of every block). ``--sections cpu`` compiles the
training step (``value_and_grad`` over the parameters) on CPU in float32 at the issue's sizes (4
layers, embed 512, hidden 2048, vocab 32k, 4 x 512 tokens) and reports its temp; ``h100`` the
same compiled for an H100 with bfloat16 activations (float32 weights, the example's
``use_bfloat16``). ``--check`` (8 devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)
builds a small model under the ``("fsdp", "tensor")`` meshes of :data:`MESHES` (8 x 1, what every
shipped config builds on 8 devices, and 4 x 2), Explicit axes, with its ``fsdp_tp_sharding``
layout, and prints one JSON line a mesh: the loss and every gradient against the same model on one
device and against the original (the same parameters loaded by name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from benchmarks.gemma_model import (
  SMALL,
  Config,
  Layout,
  abstract,
  batch,
  build,
  loss_and_grads,
  split,
)
from benchmarks.harness import rows
from benchmarks.tables import gemma as page

MODELS = {
  "original": (False, False),
  "original + block remat": (False, True),
  "jaxact": (True, False),
  "jaxact + block remat": (True, True),
}


def temp(config: Config, name: str, gpu: bool = False) -> int:
  """Compiled temp of the training step of model `name` (CPU, or an H100)."""
  use_jaxact, remat = MODELS[name]
  config = dataclasses.replace(config, remat=remat)
  graphdef, params, rest = abstract(config, use_jaxact)
  step = loss_and_grads(graphdef, rest)
  data = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in batch(config)]
  if not gpu:
    return jax.jit(step).lower(params, *data).compile().memory_analysis().temp_size_in_bytes
  import support

  leaves, tree = jax.tree.flatten((params, *data))

  def flat(*leaves):
    return step(*jax.tree.unflatten(tree, leaves))

  return support.compile_for(flat, leaves).memory_analysis().temp_size_in_bytes


def section_memory(gpu: bool) -> list[str]:
  config = Config(dtype=jnp.bfloat16) if gpu else Config()
  temps = {name: temp(config, name, gpu) for name in MODELS}
  base, base_remat = temps["original"], temps["original + block remat"]
  section = "h100" if gpu else "cpu"
  found = [
    rows.add(section, name, temp_bytes=t, vs_original=t / base, vs_original_remat=t / base_remat)
    for name, t in temps.items()
  ]
  return page.MEMORY.lines(found)


COLLECTIVE = re.compile(
  r"= (.*?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\("
)
SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}


def collective_bytes(compiled) -> tuple[int, int]:
  """``(bytes, in loops)``: the bytes a device's collectives produce in the compiled program,
  each written once (those inside a loop body, counted apart, run once an iteration)."""
  total = in_loops = 0
  for line in compiled.as_text().splitlines():
    found = COLLECTIVE.search(line)
    if found is None:
      continue
    size = sum(
      BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      for dtype, dims in SHAPE.findall(found.group(1))
    )
    total += size
    in_loops += size if "/while/body/" in line else 0
  return total, in_loops


def section_mesh(config: Config | None = None) -> list[str]:
  """Each model's step under a 4 x 2 ``("fsdp", "tensor")`` mesh (8 CPU devices: FSDP and tensor
  parallelism), Explicit axes, its fsdp_tp_sharding layout: per-device temp and collective
  bytes."""
  config = Config() if config is None else config
  if jax.device_count() < 8:
    raise SystemExit(
      "--sections mesh needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=jax.devices()[:8])
  found, base = [], None
  for name, (use_jaxact, remat) in MODELS.items():
    c = dataclasses.replace(config, remat=remat)
    with jax.set_mesh(mesh):
      model = build(c, use_jaxact, Layout(), mesh=mesh)
      graphdef, params, rest = split(model)
      data = [jax.device_put(a, P("fsdp")) for a in batch(c)]
      compiled = jax.jit(loss_and_grads(graphdef, rest)).lower(params, *data).compile()
    t = compiled.memory_analysis().temp_size_in_bytes
    base = base or t
    moved, looped = collective_bytes(compiled)
    figures = dict(temp_bytes=t, vs_original=t / base, collective_bytes=moved)
    found.append(rows.add("mesh", name, **figures, collective_bytes_in_loops=looped))
  return page.MESH.lines(found)


# ----------------------------------------------------------------------------- the check


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tree_err(a, b) -> float:
  return max(rel_err(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# The shipped configs' mesh (fsdp_parallelism=-1, tensor_parallelism=1: 8 x 1 on 8 devices) and one
# with tensor parallelism on (4 x 2), which no shipped config uses.
MESHES = ((8, 1), (4, 2))


def check(config: Config = SMALL) -> list[dict]:
  """The jaxact model under each of :data:`MESHES` (Explicit axes, fsdp_tp_sharding), against the
  same model on one device and the original with the same parameters: one dict a mesh."""
  if jax.device_count() < 8:
    raise SystemExit(
      "--check needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (CPU)"
    )
  data = batch(config, seed=1)
  graphdef, params, rest = split(build(config, True))
  (loss1, (correct1, _)), grads1 = jax.jit(loss_and_grads(graphdef, rest))(params, *data)
  original = build(config, False, seed=1)  # other values; the port's are loaded below
  names = lambda state: [jax.tree_util.keystr(k) for k, _ in nnx.to_flat_state(state)]
  same_names = names(nnx.state(original, nnx.Param)) == names(params)
  nnx.update(original, params)  # the port's parameters into the original, by name
  o_graph, o_params, o_rest = split(original)
  (loss0, (correct0, _)), grads0 = jax.jit(loss_and_grads(o_graph, o_rest))(o_params, *data)

  results = []
  for shape in MESHES:
    mesh = jax.make_mesh(shape, ("fsdp", "tensor"), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
      # As train.py builds it: the model under the mesh, each parameter sharded by its metadata.
      model = build(config, True, Layout(), mesh=mesh)
      s_graph, s_params, s_rest = split(model)
      sharded = [jax.device_put(a, P("fsdp")) for a in data]
      step = jax.jit(loss_and_grads(s_graph, s_rest))
      (loss, (correct, _)), grads = step(s_params, *sharded)
      specs_equal = jax.tree.map(lambda g, p: g.sharding.spec == p.sharding.spec, grads, s_params)
    results.append(
      dict(
        case=f"gemma_{shape[0]}x{shape[1]}",
        devices=jax.device_count(),
        loss_err=rel_err(loss, loss1),
        grad_err=tree_err(grads, grads1),
        correct_equal=int(correct) == int(correct1),
        grad_specs_equal=all(jax.tree.leaves(specs_equal)),
        weights_sharded=str(s_params["layers"][0]["mlp"]["gate_proj"]["kernel"].sharding.spec),
        same_names=same_names,
        original_loss_err=rel_err(loss1, loss0),
        original_grad_err=tree_err(grads1, grads0),
        original_correct_equal=int(correct1) == int(correct0),
      )
    )
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--sections", default="cpu", help="comma-separated: cpu, h100, mesh (8 devices)"
  )
  parser.add_argument(
    "--check", action="store_true", help="the 8 x 1 and 4 x 2 mesh checks (8 devices)"
  )
  parser.add_argument("--out", help="also write the tables to this file")
  args = parser.parse_args(argv)
  if "h100" in args.sections:
    import support

    support.use_gpu_compiler()  # before the first computation starts jax's backends
  if args.check:
    for result in check():
      rows.add("check", result["case"], **{k: v for k, v in result.items() if k != "case"})
      print(json.dumps(result), flush=True)
    return 0
  for section in args.sections.split(","):
    section_mesh() if section == "mesh" else section_memory(gpu=section == "h100")
  text = "\n".join([*page.tables(rows.current().rows), ""])
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0
