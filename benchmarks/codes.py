"""Few-bit derivative codes (``residual_bits``): memory and step time against the exact residual.

``python -m benchmarks codes [--no-time] [--no-gpu] [--tpu]`` prints markdown tables:

* compiled temp of ``jit(grad(loss))`` in activation buffers for the benchmark's 8-layer MLP
  (8192 x 512 float32, ``dense_bias_act``) and 6-layer CNN (NHWC 32x32x32x64, ``conv_bias_act``)
  with gelu, exact and with 8, 4 and 2 bits, against the jax.nn composition; the arrays the
  pullback keeps per layer (in buffers);
* the same 8-layer MLP in bfloat16 at 8192 x 4096, compiled for an H100 on this machine
  (``support.compile_for``; needs ``tests/install_gpu_compiler.py``), in MiB;
* with ``--tpu``, the same compiled for TPU chips (``--chip``, v5p and v6e unless told): temp in
  MiB, and the step's time ESTIMATED from XLA's cost analysis against the chip's published peaks;
* step time: the activation alone, ``jit(value_and_grad(sum(act(x))))`` on 2**22 float32, against
  jax.nn; and the fused MLP and CNN with codes against exact (medians of per-round ratios).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

import jaxact
from benchmarks import fused
from benchmarks.harness import chips, rows, timing
from benchmarks.tables import codes as page

BITS = (None, 8, 4, 2)
ACTIVATIONS = ("gelu", "silu", "mish")


def _act(name: str, bits):
  return functools.partial(jaxact.get_activation(name), residual_bits=bits)


def _model(model, name: str, bits):
  """benchmarks.fused's MLP/CNN builder, with the coded activation in every layer."""
  forward, params, x, buffer = model("relu", True)  # shapes and params; the activation replaced

  def coded(params, x):
    for w, b in params:
      if x.ndim == 2:
        x = jaxact.dense_bias_act(x, w, b, activation=_act(name, bits))
      else:
        x = jaxact.conv_bias_act(x, w, b, activation=_act(name, bits), padding="SAME")
    return x

  del forward
  return coded, params, x, buffer


_KEYS = page.KEYS  # the ratios' keys


def memory_rows(name: str = "gelu") -> list[str]:
  for label, model in (
    ("MLP 8 x (8192, 512)", fused._mlp),
    ("CNN 6 x NHWC", fused._cnn),
  ):
    comp = fused.temp_buffers(model, name, False)
    for bits in BITS:
      forward, params, x, buffer = _model(model, name, bits)
      loss = fused._loss(forward)
      compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes / buffer
      _, pull = jax.vjp(forward, params, x)
      weights = {id(leaf) for leaf in jax.tree.leaves(params)}
      kept = sum(
        leaf.nbytes
        for leaf in jax.tree.leaves(pull)
        if id(leaf) not in weights and leaf.nbytes > 4096
      )
      per_layer = kept / buffer / len(params)
      residual = "exact (z)" if bits is None else f"{bits} bits"
      rows.add(
        "memory",
        f"{label}, {residual}",
        model=label,
        activation=name,
        bits=bits,
        residual=residual,
        temp_buffers=temp,
        kept_per_layer=per_layer,
        jaxnn_temp_buffers=comp,
      )
  return page.tables(rows.current().rows, "memory")


def h100_rows(
  name: str = "gelu", layers: int = 8, m: int = 8192, d: int = 4096, chip=None, cache=None
) -> list[str]:
  """The MLP compiled for an H100, or with `chip` for that TPU chip (section ``tpu``: its
  figures, the step's time ESTIMATED)."""
  from support import H100, compile_for

  shapes = [jax.ShapeDtypeStruct((m, d), jnp.bfloat16)]
  shapes += [jax.ShapeDtypeStruct(s, jnp.bfloat16) for _ in range(layers) for s in ((d, d), (d,))]

  def temp(layer) -> dict:
    def loss(x, *params):
      for w, b in zip(params[::2], params[1::2], strict=True):
        x = layer(x, w, b)
      return jnp.mean(x.astype(jnp.float32))

    grad = jax.value_and_grad(loss, argnums=tuple(range(1, 2 * layers + 1)))
    if chip is not None:
      found = chips.figures(grad, shapes, chip, cache=cache)
      return {"temp_mib": found["temp_bytes"] / 2**20, "chip": chip} | {
        k: found.get(k) for k in ("total_bytes", "estimate_s", "unknown_loops", "over_hbm")
      }
    return {
      "temp_mib": compile_for(grad, shapes, H100).memory_analysis().temp_size_in_bytes / 2**20
    }

  act = getattr(jax.nn, name)
  section = "h100" if chip is None else "tpu"
  shape = dict(activation=name, layers=layers, m=m, d=d, device=str(H100 if chip is None else chip))
  prefix = "" if chip is None else f"{chip}, "
  rows.add(section, f"{prefix}jax.nn", bits=None, **temp(lambda x, w, b: act(x @ w + b)), **shape)
  for bits in BITS:
    layer = functools.partial(jaxact.dense_bias_act, activation=_act(name, bits))
    label = "exact" if bits is None else f"{bits} bits"
    rows.add(section, f"{prefix}jaxact, {label}", bits=bits, **temp(layer), **shape)
  return page.tables(rows.current().rows, section)


def time_rows(runs: int) -> list[str]:
  x = jax.random.normal(jax.random.key(0), (1 << 22,), jnp.float32)

  def step(f):
    g = jax.jit(jax.value_and_grad(lambda v: jnp.sum(f(v))))
    return lambda: g(x)

  for name in ACTIVATIONS:
    calls = [step(getattr(jax.nn, name))] + [step(_act(name, b)) for b in BITS]
    base, ratios = timing.alternated_ratios(calls, runs)
    rows.add(
      "activation time",
      name,
      jaxnn_seconds=base,
      ratios_vs_jaxnn=dict(zip(_KEYS, ratios, strict=True)),
    )
  for label, model in (("MLP", fused._mlp), ("CNN", fused._cnn)):
    calls = []
    for bits in BITS:
      forward, params, x_, _ = _model(model, "gelu", bits)
      g = jax.jit(jax.value_and_grad(fused._loss(forward)))
      calls.append(functools.partial(g, params, x_))
    base, ratios = timing.alternated_ratios(calls, runs)
    rows.add(
      "model time",
      label,
      exact_seconds=base,
      ratios_vs_exact=dict(zip(_KEYS[1:], ratios, strict=True)),
    )
  done = rows.current().rows
  return [*page.tables(done, "activation time"), "", *page.tables(done, "model time")]


def main(argv=None) -> int | None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=15)
  parser.add_argument("--no-time", action="store_true")
  parser.add_argument("--no-gpu", action="store_true", help="skip the compile for an H100")
  parser.add_argument("--tpu", action="store_true", help="the H100 section for TPU chips too")
  parser.add_argument("--chip", default=",".join(chips.TPU_CHIPS), help="TPU chips (--tpu)")
  parser.add_argument("--cache", type=pathlib.Path, help="compiled TPU figures' JSON (--tpu)")
  args = parser.parse_args(argv)
  gpu = not args.no_gpu
  if gpu:  # the plugin registers its compiler only before JAX's backends start
    from support import use_gpu_compiler

    gpu = use_gpu_compiler()
  if args.tpu and (why := chips.available()):
    print(f"benchmarks.codes: {why}", file=sys.stderr)
    return 2
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs")
  sections = [memory_rows]
  if gpu:
    sections.append(h100_rows)
  elif not args.no_gpu:
    print("(no CUDA compiler plugin: run tests/install_gpu_compiler.py for the H100 figures)")
  if args.tpu:
    for chip in chips.chips(args.chip):
      sections.append(functools.partial(h100_rows, chip=chip, cache=args.cache))
  if not args.no_time:
    sections.append(functools.partial(time_rows, args.runs))
  for section in sections:
    print()
    print("\n".join(section()), flush=True)
