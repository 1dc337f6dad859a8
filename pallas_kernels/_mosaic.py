"""The one place that imports Pallas' Mosaic GPU backend, and what the Hopper kernels share.

* The import (``pl``, ``plgpu``): a change in ``jax.experimental.pallas.mosaic_gpu`` touches one
  file.
* Lowering an epilogue: Mosaic GPU lowers a subset of jax's primitives. :func:`for_kernel` rewrites
  an epilogue's functions so that ``expm1`` and ``log1p``, which it does not lower, are computed
  from ``exp`` and ``log`` (Kahan's formulas, within 4 float32 ulps); :func:`unlowerable` says what
  is still missing, from the lowering rules jax registers (read from jax internals; an empty set
  if they move, and then every epilogue is refused rather than failing to lower).
* Shared-memory tiles: their layout (:func:`transforms`) and the double-buffered TMA write of an
  accumulator (:func:`write_tile`).
* Packing 4- and 2-bit derivative codes and spreading them back (:func:`packing_matrix`,
  :func:`spreading_matrix_t`, :func:`tensor_core_product`): small wgmma against constant matrices.
* The launch (:func:`launch`): warpgroup semantics, one producer and the compute warpgroups, a
  persistent grid of one CTA per SM (one CTA in the interpreter) unless a grid is given.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core as jax_core

from pallas_kernels.epilogue import Epilogue

HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

# Shared memory a CTA may allocate on Hopper (227 KiB; the SM has 228).
HOPPER_SMEM = 227 * 1024


@functools.cache
def _lowerable_primitives() -> frozenset[str]:
  """Names of the primitives Mosaic GPU lowers in warpgroup semantics (empty if unknown)."""
  try:
    from jax._src.pallas.mosaic_gpu import lowering

    rules = lowering.mosaic_lowering_rules[
      (plgpu.LoweringSemantics.Warpgroup, lowering.gpu_core.PrimitiveSemantics.Warpgroup)
    ]
  except (ImportError, AttributeError, KeyError):  # pragma: no cover - jax internals moved
    return frozenset()
  return frozenset(p.name for p in rules)


def primitives(jaxpr) -> set[str]:
  """Names of the primitives in `jaxpr` and in every jaxpr its equations hold (cond branches,
  jit/custom_jvp bodies, loop bodies), which are lowered too."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          names |= primitives(sub)
  return names


def expm1(x):
  """``expm1`` from ``exp`` and ``log`` (Kahan's: the rounding of ``u = exp(x)`` cancels in
  ``(u - 1) * x / log(u)``), within 4 ulps in float32 wherever the result is finite."""
  u = lax.optimization_barrier(jnp.exp(x))  # XLA (interpret mode) would fold log(exp(x)) to x
  um1 = u - 1
  r = um1 * (x / jnp.log(u))  # x / log(u) first: near 1, so large x cannot overflow the product
  r = jnp.where(u == 1, x, r)
  r = jnp.where(um1 == -1, -1.0, r)
  return jnp.where(u == jnp.inf, u, r)


def log1p(x):
  """``log1p`` from ``log`` (Kahan's: ``log(u) * x / (u - 1)`` with ``u = 1 + x``), within 4
  ulps in float32 wherever the result is finite."""
  u = lax.optimization_barrier(1 + x)  # XLA (interpret mode) would fold (1 + x) - 1 to x
  r = jnp.log(u) * (x / (u - 1))
  r = jnp.where(u == 1, x, r)
  return jnp.where(u == jnp.inf, u, r)


# Operations Mosaic GPU does not lower (jax 0.11-0.12), and what kernels compute in their place.
_REWRITES = {"expm1": expm1, "log1p": log1p}


def _eval_rewritten(jaxpr, consts, *args) -> list[Any]:
  """Evaluate `jaxpr` with the operations of ``_REWRITES`` replaced, inlining the bodies of jit
  and custom-derivative calls (only values are needed in a kernel)."""
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if eqn.primitive.name in _REWRITES:
      outs = [_REWRITES[eqn.primitive.name](*ins)]
    elif hasattr(body, "consts"):  # a ClosedJaxpr: jit, custom_jvp_call, custom_vjp_call
      outs = _eval_rewritten(body.jaxpr, body.consts, *ins)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def in_kernel(fn):
  """`fn` as the kernels compute it: `expm1` and `log1p` (which Mosaic GPU does not lower)
  replaced by :func:`expm1` and :func:`log1p`; `fn` itself when it uses neither."""
  if fn is None:
    return None

  @functools.wraps(fn)
  def rewritten(z):
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(z.shape, z.dtype))
    if not primitives(closed.jaxpr) & _REWRITES.keys():
      return fn(z)
    (out,) = _eval_rewritten(closed.jaxpr, closed.consts, z)
    return out

  return rewritten


def for_kernel(epilogue: Epilogue) -> Epilogue:
  """`epilogue` with its functions as the kernels compute them (:func:`in_kernel`)."""
  return dataclasses.replace(
    epilogue, fn=in_kernel(epilogue.fn), derivative=in_kernel(epilogue.derivative)
  )


def unlowerable(fn, where: str) -> str | None:
  """Why Mosaic GPU cannot lower `fn` (applied to a float32 tile) in a kernel, or None."""
  jaxpr = jax.make_jaxpr(in_kernel(fn))(jax.ShapeDtypeStruct((64, 64), jnp.float32))
  missing = primitives(jaxpr.jaxpr) - _lowerable_primitives()
  if missing:
    return f"Mosaic GPU does not lower {', '.join(sorted(missing))} (in the {where})"
  return None


def epilogue_unsupported(epilogue: Epilogue) -> str | None:
  """Why Mosaic GPU cannot lower `epilogue.fn` in the kernel, or None."""
  return unlowerable(epilogue.fn, "activation")


def transforms(cols: int, dtype) -> tuple[Any, ...]:
  """Shared-memory layout of a tile with `cols` columns: 8-row tiling and the widest swizzle."""
  itemsize = np.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def write_tile(z, values, outs, out_smem, epi_n: int | None = None) -> None:
  """Write ``values(z[sub])`` (one array for each gmem ref of `outs`) by TMA, sub-tile by
  sub-tile through `out_smem` (``(len(outs), 2, epi_m, out_n)``, or one ``(2, epi_m, out_n)``
  ref an output: two slots an output), keeping one store group in flight while the next sub-tile
  is computed. `z` may be a tuple of arrays of one shape: then ``values(*(v[sub] for v in z))``.

  Sub-tiles of z are ``epi_m x epi_n`` (`epi_n` defaults to the first output's ``out_n``); an
  output of ``out_n = epi_n / per`` columns (derivative codes packed ``per`` to a byte) takes
  ``epi_m x out_n`` values, written at column ``en * out_n``."""
  zs = z if isinstance(z, tuple) else (z,)
  rows, cols = zs[0].shape
  if not isinstance(out_smem, (tuple, list)):
    out_smem = [out_smem.at[o] for o in range(out_smem.shape[0])]
  epi_m = out_smem[0].shape[-2]
  epi_n = epi_n or out_smem[0].shape[-1]
  # The previous tile's stores must have read out_smem before it is overwritten.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for em in range(rows // epi_m):
    for en in range(cols // epi_n):
      sub = (slice(em * epi_m, (em + 1) * epi_m), slice(en * epi_n, (en + 1) * epi_n))
      slot = (em * (cols // epi_n) + en) % 2
      vals = values(*(v[sub] for v in zs))
      # The slot written now was read by the store two sub-tiles ago.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      for smem, v in zip(out_smem, vals, strict=True):
        smem[slot] = v.astype(smem.dtype)
      plgpu.commit_smem()
      for smem, ref in zip(out_smem, outs, strict=True):
        out_n = smem.shape[-1]
        plgpu.copy_smem_to_gmem(
          smem.at[slot],
          ref.at[pl.ds(em * epi_m, epi_m), pl.ds(en * out_n, out_n)],
          commit_group=False,
        )
      plgpu.commit_smem_to_gmem_group()


def code_transforms(cols: int, swizzle: int | None = None) -> tuple[Any, ...]:
  """Shared-memory layout of a tile of `cols` bytes (packed codes): swizzled when a row fills a
  32-byte span (Mosaic GPU swizzles 32, 64 or 128 bytes), else plain rows."""
  if swizzle is None and cols < 32:
    return ()
  return transforms(cols, jnp.uint8) if swizzle is None else swizzled(swizzle, jnp.uint8)


def swizzled(swizzle: int, dtype) -> tuple[Any, ...]:
  """8-row tiling at a given swizzle (bytes): wgmma needs both operands at one swizzle."""
  itemsize = np.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def span(cols: int, dtype) -> int:
  """The swizzle :func:`transforms` gives a tile of `cols` columns of `dtype`."""
  return plgpu.find_swizzle(cols * np.dtype(dtype).itemsize * 8)


# ------------------------------------------------------------------- packing codes with wgmma
#
# A byte of 4- or 2-bit codes gathers ``per`` neighbouring columns, which the wgmma accumulator's
# layout spreads over threads. Packing is linear in the codes, ``packed = codes @ P`` with
# ``P[c, c // per] = 2 ** (c % per * bits)``, and so is spreading bytes back over their columns,
# ``bytes @ S`` with ``S[c // per, c] = 1``: both run on the tensor cores, exactly (integers below
# 256 are exact in bfloat16 and in the float32 accumulator), and move nothing between threads.


def packing_matrix(code, cols: int, layout) -> jax.Array:
  """``P`` (``cols x cols // per``, bfloat16) of ``codes @ P`` = the packed bytes."""
  per = code.per_byte()
  shape = (cols, cols // per)
  c = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
  q = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
  weight = lax.shift_left(jnp.int32(1), (c % per) * code.bits)
  return jnp.where(c // per == q, weight, 0).astype(jnp.bfloat16)


def spreading_matrix_t(code, cols: int, layout) -> jax.Array:
  """``S.T`` (``cols x cols // per``, bfloat16), where ``bytes @ S`` = each byte under its codes:
  transposed, for a layout of 64-row tiles."""
  per = code.per_byte()
  shape = (cols, cols // per)
  c = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
  q = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
  return jnp.where(c // per == q, 1.0, 0.0).astype(jnp.bfloat16)


def tensor_core_product(a, a_smem, b_smem) -> jax.Array:
  """``a @ b`` in float32 on the tensor cores: the bfloat16 tile `a` is staged in `a_smem` (wgmma
  takes its left operand from shared memory in Mosaic GPU's interpreter too), `b_smem` holds
  ``b``. Waits for every wgmma of the warpgroup, this one included."""
  a_smem[...] = a
  plgpu.commit_smem()  # the generic-proxy writes, visible to wgmma (async proxy)

  def scope(acc):
    plgpu.wgmma(acc, a_smem, b_smem)
    plgpu.wgmma_wait(0)
    return acc[...]

  return pl.run_scoped(scope, plgpu.ACC((a_smem.shape[0], b_smem.shape[1]), jnp.float32))


# -------------------------------------------------- the dense kernels' x @ w pipeline, shared


def xw_pipeline(t, k_iters: int, dtype):
  """``pipeline(body, compute_context)`` of the kernels that compute ``x @ w`` tiles
  (:mod:`pallas_kernels.dense_mosaic`'s forward, :mod:`pallas_kernels.lce_mosaic` and
  :mod:`pallas_kernels.lce_mosaic_bwd`): a memory warpgroup streams a ``tile_m x tile_k`` tile of
  ``x`` and a ``tile_k x 2 tile_n`` tile of ``w`` a step through ``t.stages`` shared-memory
  buffers (TMA) to two compute warpgroups, for the ``k_iters`` steps of the contraction."""
  operand_transforms = transforms(t.tile_k, dtype)

  def spec(block, index):
    return plgpu.BlockSpec(block, index, transforms=operand_transforms, memory_space=plgpu.SMEM)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
        spec((t.tile_m, t.tile_k), lambda s: (0, s)),
        spec((t.tile_k, 2 * t.tile_n), lambda s: (s, 0)),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=t.stages,
      compute_context=compute_context,
    )

  return pipeline


def pipeline_allocations(pipeline, *operands):
  """The shared-memory buffers of `pipeline` for these gmem operands, allocated once outside the
  tile loop (the pipeline's body and context are not traced for this)."""

  def ignore(*_, **__):
    return None

  return pipeline(ignore, ignore).get_allocations(*operands)


def half_tile_mma(wg, tile_n: int):
  """The pipeline body of compute warpgroup `wg`: its ``tile_n`` columns of the step's ``w`` tile
  into its accumulator."""

  def mma(_, x_smem, w_smem, acc_ref):
    plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * tile_n, tile_n)])
    plgpu.wgmma_wait(0)
    return acc_ref

  return mma


def launch(
  body,
  out_type,
  *,
  interpret,
  num_sms: int | None = None,
  grid: tuple[int, ...] | None = None,
  grid_names: tuple[str, ...] = ("sm",),
  compute_wgs: int = 2,
):
  """``plgpu.kernel`` of `body` as every Hopper kernel here launches it: warpgroup lowering
  semantics, `compute_wgs` compute warpgroups and one producer (``thread_name="wg"``), and either
  a persistent grid of `num_sms` CTAs (one in the interpreter) or the given `grid`. `interpret`:
  False, True (Mosaic GPU's interpreter with its defaults) or a ``plgpu.InterpretGPUParams``."""
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  if grid is None:
    grid = (1 if interpret else num_sms,)
  return plgpu.kernel(
    body,
    out_type=out_type,
    grid=grid,
    grid_names=grid_names,
    num_threads=compute_wgs + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret or None,
  )
