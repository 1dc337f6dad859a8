"""`python -m benchmarks moe --sections tpu`: the MoE block stack compiled for a TPU v5p chip.

The H100 section's stacks (:data:`benchmarks.moe.H100`, 8 scanned blocks ``x + moe(rms_norm(x))``,
bfloat16, ``jit(value_and_grad)``), compiled here for one TPU v5p chip by libtpu's compiler, for
three ways to compute the experts' grouped products:

* ``plain ragged``: the plain composition with ``lax.ragged_dot`` (XLA's), differentiated by JAX;
* ``jaxact.moe_mlp``: jaxact's op (XLA's ``ragged_dot``; it keeps x, a and b);
* ``megablox``: the plain composition with megablox's ``gmm`` (``jax.experimental.pallas.ops.tpu
  .megablox``, Mosaic TPU kernels; its ``custom_vjp`` runs ``gmm`` for the rows' gradient and
  ``tgmm`` for the weights'), MaxText's tiling ``(512, 1024, 1024)`` clipped to each product.

XLA's TPU compiler runs ``ragged_dot`` as a Mosaic kernel of its own, as megablox's are: custom
calls whose flops XLA's cost analysis cannot see, but both carry a cost estimate (the useful
``2 m k n`` flops; the bytes their grids read), which :func:`roofline.cost` counts. Each row: the
compiled temp (exact) and the step's time ESTIMATED as a roofline against the chip's published
peaks (:mod:`support.roofline`), once with those flops, once with the grouped products
counted as the kernels run them (:func:`products_flops`: every row tile a group visits, XLA's of
128 rows, megablox's of 512). Nothing runs on a TPU.
"""

from __future__ import annotations

import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import gated, moe
from benchmarks.harness import rows
from jaxact._src.moe import reference
from support import roofline, tpu

CHIP = "v5p"
TILING = (512, 1024, 1024)  # MaxText's megablox tiles (m, k, n)
STEPS = ("plain ragged", "jaxact.moe_mlp", "megablox")


def _tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
  return min(TILING[0], m), min(TILING[1], k), min(TILING[2], n)


def megablox_product(lhs, rhs, sizes):
  """``lax.ragged_dot(lhs, rhs, sizes)`` as megablox's ``gmm`` (its custom_vjp)."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm

  (m, k), n = lhs.shape, rhs.shape[-1]
  return gmm(lhs, rhs, sizes, lhs.dtype, _tiles(m, k, n))


composition = reference.ragged_composition  # its grouped products `product=`


def loss_of(step: str, top_k: int):
  if step == "megablox":
    mlp = functools.partial(composition, product=megablox_product)
  else:
    mlp = composition if step == "plain ragged" else moe.jaxact_moe

  def loss(params, x):
    def block(x, p):
      return x + mlp(gated.rms_norm(x), *p, top_k=top_k), None

    y, _ = lax.scan(block, x, params)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return loss


# Each way's grouped-matmul kernel's row tile: XLA's TPU ragged_dot (a Mosaic kernel of XLA's:
# its group metadata has m / 128 + E - 1 entries at these sizes) and megablox at MaxText's tiling.
ROW_TILE = {"plain ragged": 128, "jaxact.moe_mlp": 128, "megablox": TILING[0]}


def products_flops(c: moe.Config, blocks: int, row_tile: int | None = None) -> float:
  """The experts' grouped products of `blocks` blocks, forward and backward: 9 of ``m x D x F``
  a block (gate, up, down; each with its rows' and its weights' gradient), ``m`` the routed rows.
  With `row_tile`: as the kernels run them, ``m / tm + E - 1`` row tiles of ``tm`` rows (a tile a
  group boundary crosses is multiplied once for each group), each a full product."""
  m = c.tokens * c.top_k
  rows_ = m if row_tile is None else (math.ceil(m / row_tile) + c.experts - 1) * row_tile
  return blocks * 9 * 2.0 * rows_ * c.dim * c.hidden


def measure(c: moe.Config, step: str, cpu, blocks: int) -> dict:
  chip = tpu.CHIPS[CHIP]
  start = time.perf_counter()
  grad = jax.value_and_grad(loss_of(step, c.top_k))
  params, x = moe.shapes(c, blocks, jnp.bfloat16)
  compiled = tpu.compile_for_tpu(lambda *a: grad(a[:4], a[4]), [*params, x], CHIP)
  seconds = time.perf_counter() - start
  found = roofline.cost(compiled.as_text(), cpu)  # the kernels' flops: their cost estimates
  tiles = found.flops - products_flops(c, blocks) + products_flops(c, blocks, ROW_TILE[step])
  return rows.add(
    "tpu",
    f"{c}, {step}",
    config=str(c),
    chip=CHIP,
    step=step,
    blocks=blocks,
    temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
    flops=found.flops,
    bytes=found.bytes,
    row_tile=ROW_TILE[step],
    tile_flops=tiles,
    unknown_loops=found.unknown_loops,
    estimate_s=roofline.seconds(found.flops, found.bytes, chip.rates),
    tile_estimate_s=roofline.seconds(tiles, found.bytes, chip.rates),
    compile_s=round(seconds),
  )


def section(configs=moe.H100, steps=STEPS, blocks: int = moe.BLOCKS[-1]) -> list[dict]:
  cpu = jax.devices("cpu")[0].client
  found = []
  for c in configs:
    for step in steps:
      found.append(measure(c, step, cpu, blocks))
      f = found[-1]["figures"]
      print(
        f"  [{c}, {step}: {f['temp_bytes'] / 2**20:.0f} MiB, {f['estimate_s'] * 1e3:.2f} ms, "
        f"{f['compile_s']} s]",
        file=sys.stderr,
        flush=True,
      )
  return found
