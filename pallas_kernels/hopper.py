"""Fused ``act(x @ w + b)`` forward for Hopper GPUs (H100/H200) with Pallas' Mosaic GPU backend.

The Triton kernels (:mod:`pallas_kernels.dense`) issue Ampere-style ``mma`` instructions and cannot
reach Hopper's tensor-core rate; this kernel is written for Hopper's own machinery:

* **wgmma**: the matrix products are warpgroup MMAs reading both operands from shared memory, with
  a float32 accumulator in registers.
* **TMA, warp-specialized**: a memory warpgroup streams ``x`` and ``w`` tiles into a ring of
  ``stages`` shared-memory buffers (``plgpu.emit_pipeline_warp_specialized``) while two compute
  warpgroups run the MMAs, each on half of the CTA's output tile.
* **Epilogue in registers**: each compute warpgroup's bias tile is brought into shared memory by TMA
  while its main loop runs; then ``z = acc + b`` and ``y = fn(z)`` are computed on the accumulator
  and written back through shared memory by TMA, in ``epi_m x epi_n`` sub-tiles, double-buffered.
  ``z`` is written too (same way) when the activation's derivative needs its input.
* **Persistent**: one CTA per SM walks the output tiles in a "planar snake" order that keeps the
  tiles running together on neighbouring rows/columns (L2 reuse).

Only what this layout handles is accepted (:func:`hopper_unsupported` says why not): 16-bit ``x``
and ``w`` of one dtype, an output of the same dtype, ``M`` a multiple of ``tile_m``, ``N`` of
``2 * tile_n``, ``K`` of ``tile_k``, and an epilogue whose operations Mosaic GPU lowers (the
kernels compute ``expm1`` and ``log1p``, which it does not, from ``exp`` and ``log``).

The backward (:func:`hopper_dense_bias_act_bwd`) is two more kernels, ``dx = dz @ w.T`` and
``dw = x.T @ dz``, warp-specialized the same way (one memory warpgroup, two compute warpgroups,
each on its own rows of dx or columns of dw), each forming ``dz = g * act'(residual)`` from the
tiles of ``g`` and the residual its pipeline brings in and writing it over ``g``'s shared-memory
tile before wgmma reads it: dz never reaches device memory, and while one compute warpgroup does
that arithmetic the other's wgmma runs; outputs leave through shared memory by TMA in
double-buffered sub-tiles.

``db`` is not summed in the ``dw`` kernel, although it forms the same dz: a Mosaic GPU row sum
(``jnp.sum`` over a warpgroup's tile in the WGMMA layout) adds across warps through a scratch
buffer that Pallas puts at the same shared-memory offset for every warpgroup, so two compute
warpgroups summing at once overwrite each other's partial sums (jax 0.11.2 and 0.12:
``_reduce_lowering_rule`` of ``jax/_src/pallas/mosaic_gpu/lowering.py`` refuses that only for the
strided layout). On an H100 that db was 33-92% off while dx and dw were right (run 8 in
``benchmarks/RESULTS.md``); Mosaic GPU's interpreter does not race. Nor is it XLA's reduction:
compiled for an H100, XLA materialises the float32 dz before summing it for some shapes ((4096,
1024): 16 MiB, twice the activation). It is :func:`pallas_kernels.bias_act.bias_grad`, one
Triton pass over ``g`` and the residual that writes only partial sums. jaxact runs them under
``implementation="mosaic"``; ``None`` keeps XLA's backward on Hopper, which an H100 ran 1.8x
(relu) to 4.7x (gelu) faster (run 9) (``jaxact/_src/pallas.py``, ``HOPPER_BACKWARD``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core as jax_core

from pallas_kernels import bias_act
from pallas_kernels.dense import Epilogue

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


# Shared memory a CTA may allocate on Hopper (227 KiB; the SM has 228).
HOPPER_SMEM = 227 * 1024


@dataclasses.dataclass(frozen=True)
class HopperTiles:
  """Tiling of the Hopper forward kernel.

  Attributes:
    tile_m, tile_n: the output tile of one compute warpgroup; a CTA's tile is
      ``tile_m x 2 * tile_n`` (two compute warpgroups side by side along N).
    tile_k: contraction step of one pipeline stage.
    stages: shared-memory pipeline depth (buffers of x and w tiles in flight).
    epi_m, epi_n: the sub-tile the epilogue writes through shared memory per TMA store.
    snake_width: tiles per band of the planar-snake walk over the output (L2 locality).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  epi_m: int = 64
  epi_n: int = 64
  snake_width: int = 8

  def smem_bytes(self, itemsize: int, outputs: int) -> int:
    """Shared memory the kernel allocates (pipeline ring, epilogue buffers, bias tiles)."""
    ring = self.stages * (self.tile_m + 2 * self.tile_n) * self.tile_k * itemsize
    epilogue = 2 * outputs * 2 * self.epi_m * self.epi_n * itemsize  # 2 warpgroups x 2 slots
    return ring + epilogue + 2 * self.tile_n * 4 + 1024  # bias tiles; barriers, alignment


def hopper_tiles(shape: tuple[int, int, int], outputs: int = 1) -> HopperTiles:
  """Tiles for an ``(M, K, N)`` layer writing `outputs` arrays (2 when z is kept).

  128 x 128 per compute warpgroup (a CTA computes 128 x 256): a float32 accumulator of 128
  registers a thread, and 128 x 256 x 64 is the CTA tile of the Triton sweep's fastest forward on
  the H100 (benchmarks/RESULTS.md). Its ring stage is (128 + 256) x 64 x 2 B = 48 KiB: four
  stages (192 KiB) fit Hopper's 227 KiB of shared memory beside y's epilogue buffers (32 KiB),
  three when z is written too (64 KiB of epilogue buffers). Lowering checks the budget (tests
  lower every case).
  """
  del shape
  four = HopperTiles(stages=4)
  return four if four.smem_bytes(2, outputs) <= HOPPER_SMEM else HopperTiles(stages=3)


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


def _primitives(jaxpr) -> set[str]:
  """Names of the primitives in `jaxpr` and in every jaxpr its equations hold (cond branches,
  jit/custom_jvp bodies, loop bodies), which are lowered too."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          names |= _primitives(sub)
  return names


def _expm1(x):
  """``expm1`` from ``exp`` and ``log`` (Kahan's: the rounding of ``u = exp(x)`` cancels in
  ``(u - 1) * x / log(u)``), within 4 ulps in float32 wherever the result is finite."""
  u = lax.optimization_barrier(jnp.exp(x))  # XLA (interpret mode) would fold log(exp(x)) to x
  um1 = u - 1
  r = um1 * (x / jnp.log(u))  # x / log(u) first: near 1, so large x cannot overflow the product
  r = jnp.where(u == 1, x, r)
  r = jnp.where(um1 == -1, -1.0, r)
  return jnp.where(u == jnp.inf, u, r)


def _log1p(x):
  """``log1p`` from ``log`` (Kahan's: ``log(u) * x / (u - 1)`` with ``u = 1 + x``), within 4
  ulps in float32 wherever the result is finite."""
  u = lax.optimization_barrier(1 + x)  # XLA (interpret mode) would fold (1 + x) - 1 to x
  r = jnp.log(u) * (x / (u - 1))
  r = jnp.where(u == 1, x, r)
  return jnp.where(u == jnp.inf, u, r)


# Operations Mosaic GPU does not lower (jax 0.11-0.12), and what kernels compute in their place.
_REWRITES = {"expm1": _expm1, "log1p": _log1p}


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


def _in_kernel(fn):
  """`fn` as the kernels compute it: `expm1` and `log1p` (which Mosaic GPU does not lower)
  replaced by :func:`_expm1` and :func:`_log1p`; `fn` itself when it uses neither."""
  if fn is None:
    return None

  @functools.wraps(fn)
  def rewritten(z):
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(z.shape, z.dtype))
    if not _primitives(closed.jaxpr) & _REWRITES.keys():
      return fn(z)
    (out,) = _eval_rewritten(closed.jaxpr, closed.consts, z)
    return out

  return rewritten


def _for_kernel(epilogue: Epilogue) -> Epilogue:
  """`epilogue` with its functions as the kernels compute them (:func:`_in_kernel`)."""
  return dataclasses.replace(
    epilogue, fn=_in_kernel(epilogue.fn), derivative=_in_kernel(epilogue.derivative)
  )


def _unlowerable(fn, where: str) -> str | None:
  """Why Mosaic GPU cannot lower `fn` (applied to a float32 tile) in a kernel, or None."""
  jaxpr = jax.make_jaxpr(_in_kernel(fn))(jax.ShapeDtypeStruct((64, 64), jnp.float32))
  missing = _primitives(jaxpr.jaxpr) - _lowerable_primitives()
  if missing:
    return f"Mosaic GPU does not lower {', '.join(sorted(missing))} (in the {where})"
  return None


def epilogue_unsupported(epilogue: Epilogue) -> str | None:
  """Why Mosaic GPU cannot lower `epilogue.fn` in the kernel, or None."""
  return _unlowerable(epilogue.fn, "activation")


def hopper_unsupported(
  shape: tuple[int, int, int],
  dtype,
  out_dtype,
  epilogue: Epilogue,
  tiles: HopperTiles | None = None,
) -> str | None:
  """Why the Hopper kernel cannot run an ``(M, K, N)`` layer, or None when it can."""
  m, k, n = shape
  t = tiles or hopper_tiles(shape)
  if np.dtype(dtype) not in _HALF:
    return f"operand dtype {np.dtype(dtype).name} (the Hopper kernel takes bfloat16 or float16)"
  if np.dtype(out_dtype) != np.dtype(dtype):
    return f"output dtype {np.dtype(out_dtype).name} differs from the operands' {np.dtype(dtype)}"
  for name, d, step in (("M", m, t.tile_m), ("N", n, 2 * t.tile_n), ("K", k, t.tile_k)):
    if d % step:
      return f"{name}={d} is not a multiple of {step} (the Hopper kernel's tile)"
  return epilogue_unsupported(epilogue)


def _transforms(cols: int, dtype) -> tuple[Any, ...]:
  """Shared-memory layout of a tile with `cols` columns: 8-row tiling and the widest swizzle."""
  itemsize = np.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _write_tile(z, values, outs, out_smem) -> None:
  """Write ``values(z[sub])`` (one array for each gmem ref of `outs`, each of z's shape) by TMA,
  sub-tile by sub-tile through `out_smem` (``(len(outs), 2, epi_m, epi_n)``: two slots an
  output), keeping one store group in flight while the next sub-tile is computed."""
  rows, cols = z.shape
  epi_m, epi_n = out_smem.shape[-2:]
  # The previous tile's stores must have read out_smem before it is overwritten.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for em in range(rows // epi_m):
    for en in range(cols // epi_n):
      sub = (slice(em * epi_m, (em + 1) * epi_m), slice(en * epi_n, (en + 1) * epi_n))
      slot = (em * (cols // epi_n) + en) % 2
      vals = values(z[sub])
      # The slot written now was read by the store two sub-tiles ago.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      for o, v in enumerate(vals):
        out_smem[o, slot] = v.astype(out_smem.dtype)
      plgpu.commit_smem()
      for o, ref in enumerate(outs):
        plgpu.copy_smem_to_gmem(
          out_smem.at[o, slot],
          ref.at[pl.ds(em * epi_m, epi_m), pl.ds(en * epi_n, epi_n)],
          commit_group=False,
        )
      plgpu.commit_smem_to_gmem_group()


def _fwd_kernel(x_gmem, w_gmem, b_gmem, y_gmem, z_gmem, *, epilogue: Epilogue, t: HopperTiles):
  m, k = x_gmem.shape
  n = w_gmem.shape[1]
  cta_n = 2 * t.tile_n
  m_iters, n_iters, k_iters = m // t.tile_m, n // cta_n, k // t.tile_k
  outs = (y_gmem,) if z_gmem is None else (y_gmem, z_gmem)
  out_dtype = y_gmem.dtype
  operand_transforms = _transforms(t.tile_k, x_gmem.dtype)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
        plgpu.BlockSpec(
          (t.tile_m, t.tile_k),
          lambda s: (0, s),
          transforms=operand_transforms,
          memory_space=plgpu.SMEM,
        ),
        plgpu.BlockSpec(
          (t.tile_k, cta_n),
          lambda s: (s, 0),
          transforms=operand_transforms,
          memory_space=plgpu.SMEM,
        ),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=t.stages,
      compute_context=compute_context,
    )

  def ignore(*_, **__):
    return None

  scratch = dict(
    pipeline_allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
    out_smem=plgpu.SMEM(
      (2, len(outs), 2, t.epi_m, t.epi_n), out_dtype, transforms=_transforms(t.epi_n, out_dtype)
    ),
    bias_smem=None if b_gmem is None else plgpu.SMEM((2, t.tile_n), b_gmem.dtype),
    bias_barrier=None if b_gmem is None else plgpu.Barrier(num_barriers=2),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(pipeline_allocs, out_smem, bias_smem, bias_barrier):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      mi, ni = plgpu.planar_snake(tile, (m_iters, n_iters), 1, min(t.snake_width, m_iters, n_iters))
      m_slice = pl.ds(mi * t.tile_m, t.tile_m)
      n_slice = pl.ds(ni * cta_n + wg * t.tile_n, t.tile_n)  # this warpgroup's columns

      def compute_context(run_pipeline):
        if b_gmem is not None:  # lands while the main loop runs
          plgpu.copy_gmem_to_smem(b_gmem.at[n_slice], bias_smem.at[wg], bias_barrier.at[wg])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          z = acc_ref[...]
          if b_gmem is not None:
            plgpu.barrier_wait(bias_barrier.at[wg])
            bias = plgpu.load(bias_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
            z = z + lax.broadcast_in_dim(bias.astype(jnp.float32), z.shape, [1])
          values = lambda z_sub: (epilogue.fn(z_sub), z_sub)[: len(outs)]
          _write_tile(z, values, [o.at[m_slice, n_slice] for o in outs], out_smem.at[wg])

      def mma(_, x_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * t.tile_n, t.tile_n)])
        plgpu.wgmma_wait(0)
        return acc_ref

      pipeline(mma, compute_context)(
        x_gmem.at[m_slice, :],
        w_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
        allocations=pipeline_allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# SMs of an H100 SXM, for a program traced for CUDA where no GPU says how many it has.
_DEFAULT_SMS = 132


def num_sms() -> int:
  """SMs of the target GPU (one persistent CTA each): the abstract mesh's device when it says,
  else the first CUDA device this process sees, else an H100 SXM's 132."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and getattr(device, "num_cores", None):
    return device.num_cores
  try:
    return jax.devices("cuda")[0].core_count
  except (RuntimeError, IndexError, AttributeError):
    return _DEFAULT_SMS


def hopper_dense_bias_act_fwd(
  x: Array,
  w: Array,
  b: Array | None,
  *,
  epilogue: Epilogue,
  tiles: HopperTiles | None = None,
  interpret: Any = False,
) -> tuple[Array, Array | None]:
  """``(y, z)`` as :func:`pallas_kernels.dense_bias_act_fwd` returns them, on Hopper.

  `x` is ``(..., K)`` with ``M`` rows in all, `w` ``(K, N)``, `b` ``(N,)`` or None; the output has
  x's dtype. Raises ValueError for a layer :func:`hopper_unsupported` rejects. `interpret`: False,
  True or a ``plgpu.InterpretGPUParams`` (Mosaic GPU's interpreter, for CPU tests).
  """
  batch, (k, n) = x.shape[:-1], w.shape
  if x.shape[-1] != k:
    raise ValueError(f"pallas_kernels.hopper: x.shape={x.shape} does not match w.shape={w.shape}")
  if b is not None and b.shape != (n,):
    raise ValueError(f"pallas_kernels.hopper: `b` must have shape ({n},); got {b.shape}")
  if x.dtype != w.dtype:
    raise TypeError(f"pallas_kernels.hopper: x and w dtypes differ ({x.dtype}, {w.dtype})")
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  keep_z = epilogue.residual == "input"
  t = tiles or hopper_tiles((m, k, n), 2 if keep_z else 1)
  why = hopper_unsupported((m, k, n), x.dtype, x.dtype, epilogue, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.hopper: {why}")
  epilogue = _for_kernel(epilogue)
  out = jax.ShapeDtypeStruct((m, n), x.dtype)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()

  def body(x_ref, w_ref, *refs):
    b_ref = refs[0] if b is not None else None
    y_ref, *z_ref = refs[1:] if b is not None else refs
    _fwd_kernel(x_ref, w_ref, b_ref, y_ref, z_ref[0] if keep_z else None, epilogue=epilogue, t=t)

  sms = 1 if interpret else num_sms()
  kernel = plgpu.kernel(
    body,
    out_type=(out, out) if keep_z else (out,),
    grid=(sms,),
    grid_names=("sm",),
    num_threads=3,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret or None,
  )
  outs = kernel(*(v for v in (x2, w, b) if v is not None))
  y = outs[0].reshape(*batch, n)
  return y, (outs[1].reshape(*batch, n) if keep_z else None)


# ---------------------------------------------------------------------------------- backward


@dataclasses.dataclass(frozen=True)
class HopperBwdTiles:
  """Tiling of the Hopper backward kernels.

  Each CTA has ``wgs`` compute warpgroups and one memory warpgroup streaming tiles by TMA into a
  ring of ``dx_stages`` or ``dw_stages`` buffers (``plgpu.emit_pipeline_warp_specialized``). Each
  compute warpgroup owns its part of the ``g`` and residual tiles, turns it into ``dz`` over
  ``g``'s shared-memory buffer and runs wgmma on it (against ``w``, or ``x``, read transposed
  from shared memory); with two, one warpgroup's dz arithmetic overlaps the other's wgmma.

  Attributes:
    dx_m, dx_k: the ``dx`` tile of one compute warpgroup (a CTA: ``wgs * dx_m`` rows, the
      warpgroups one above the other); its contraction runs over N in steps of ``dx_n``.
    dw_k, dw_n: the ``dw`` tile of one compute warpgroup (a CTA: ``wgs * dw_n`` columns, side by
      side); its contraction runs over M in steps of ``dw_m``.
    dx_stages, dw_stages: pipeline depth of each kernel.
    wgs: compute warpgroups per CTA (1 or 2).
    epi: the square sub-tile in which results go out through shared memory (double-buffered).
    delay: wgmma groups a compute warpgroup leaves running when it goes on to the next step (0 or
      1). With 1, the next step's dz arithmetic overlaps this step's wgmma inside one warpgroup;
      each ring slot is then released a step later, so a pipeline of ``stages`` prefetches
      ``stages - 2`` steps ahead instead of ``stages - 1``.
  """

  dx_m: int = 64
  dx_k: int = 256
  dx_n: int = 64
  dw_k: int = 128
  dw_n: int = 128
  dw_m: int = 64
  dx_stages: int = 3
  dw_stages: int = 2
  wgs: int = 2
  epi: int = 64
  delay: int = 0

  def smem_bytes(self, itemsize: int, residual: bool) -> tuple[int, int]:
    """Shared memory of the ``dx`` and ``dw`` kernels (ring, output sub-tiles, and 3 KiB for
    the pipeline's barriers and alignment: 2112 bytes at (dw_stages=4, wgs=2) by Mosaic GPU's
    count)."""
    inputs = 2 if residual else 1  # g and the residual
    out = self.wgs * 2 * self.epi * self.epi * itemsize
    dx = self.dx_stages * (inputs * self.wgs * self.dx_m + self.dx_k) * self.dx_n * itemsize
    dw = self.dw_stages * (self.dw_k + inputs * self.wgs * self.dw_n) * self.dw_m * itemsize
    return dx + out + 3072, dw + out + 3072


def hopper_bwd_tiles(shape: tuple[int, int, int], residual: bool = True) -> HopperBwdTiles:
  """Backward tiles for an ``(M, K, N)`` layer (`residual`: whether dz needs a residual tile).

  Two compute warpgroups a CTA, each holding a 64 x 256 (dx) or 128 x 128 (dw) float32
  accumulator, 128 registers a thread, beside the 64-column g and residual blocks it turns into
  dz (64 rows: a warpgroup's register layout; a 32-row step does not lower). dz is recomputed
  once per output tile it feeds (K / dx_k times for dx, K / dw_k for dw), so dx's tile is wide
  along K. Each kernel's pipeline is as deep as Hopper's shared memory holds, at most 4: with a
  residual, dx's ring stage (the CTA's 128 x 64 g and residual tiles, w's 256 x 64) is 64 KiB, 3
  stages; dw's (x's 64 x 128, the CTA's 64 x 256 g and residual tiles) 80 KiB, 2. Tiles narrow
  along K (to 128, then 64) for a K the wide ones do not divide, so every layer the forward
  kernel takes (K a multiple of 64) has a backward.
  """
  k = shape[1]
  dx_k = next(c for c in (256, 128, 64) if k % c == 0) if k % 64 == 0 else 256
  dw_k = 128 if k % 128 == 0 else 64
  return _deepest(HopperBwdTiles(dx_k=dx_k, dw_k=dw_k), residual)


def _deepest(t: HopperBwdTiles, residual: bool) -> HopperBwdTiles:
  """`t` with each kernel's pipeline as deep as fits Hopper's shared memory (4 at most, 2 at
  least)."""

  def stages(kernel: int) -> int:
    for depth in (4, 3):
      deep = dataclasses.replace(t, dx_stages=depth, dw_stages=depth)
      if deep.smem_bytes(2, residual)[kernel] <= HOPPER_SMEM:
        return depth
    return 2

  return dataclasses.replace(t, dx_stages=stages(0), dw_stages=stages(1))


def hopper_bwd_variants(
  shape: tuple[int, int, int], residual: bool = True
) -> dict[str, HopperBwdTiles]:
  """Tilings of the backward to time against each other on a GPU (``benchmarks.gpu_check``'s
  ``hopper-bwd`` section), each with its deepest pipeline: :func:`hopper_bwd_tiles`' choice; the
  same with each warpgroup's wgmma left running into the next step (``delay=1``); one compute
  warpgroup a CTA, overlapping its own dz arithmetic and wgmma that way (deeper pipelines); dw at 64
  columns a warpgroup (a smaller ring stage, 3 stages with a residual instead of 2); dx at 128
  columns (4 stages instead of 3, dz recomputed twice as often). Only those the shape divides."""
  base = hopper_bwd_tiles(shape, residual)
  variants = {
    "default": base,
    "overlapped wgmma": dataclasses.replace(base, delay=1),
    "one warpgroup": _deepest(dataclasses.replace(base, wgs=1, delay=1), residual),
    "dw 64 columns": _deepest(dataclasses.replace(base, dw_n=64), residual),
    "dx 128 columns": _deepest(dataclasses.replace(base, dx_k=min(base.dx_k, 128)), residual),
  }
  bf16, ep = jnp.bfloat16, Epilogue(fn=None, derivative=None, residual="none")
  return {
    name: t for name, t in variants.items() if hopper_bwd_unsupported(shape, bf16, ep, t) is None
  }


def hopper_bwd_unsupported(
  shape: tuple[int, int, int], dtype, epilogue: Epilogue, tiles: HopperBwdTiles | None = None
) -> str | None:
  """Why the Hopper backward kernels cannot run an ``(M, K, N)`` layer, or None when they can."""
  m, k, n = shape
  t = tiles or hopper_bwd_tiles(shape, epilogue.residual != "none")
  if np.dtype(dtype) not in _HALF:
    return f"operand dtype {np.dtype(dtype).name} (the Hopper kernels take bfloat16 or float16)"
  steps = (
    ("M", m, t.wgs * t.dx_m, t.dw_m),
    ("N", n, t.dx_n, t.wgs * t.dw_n),
    ("K", k, t.dx_k, t.dw_k),
  )
  for name, d, *tile in steps:
    step = math.lcm(*tile)
    if d % step:
      return f"{name}={d} is not a multiple of {step} (the Hopper backward kernels' tile)"
  if min(t.dx_stages, t.dw_stages) <= t.delay:
    return f"pipelines of {t.dx_stages} and {t.dw_stages} stages with delay {t.delay} (need more)"
  if epilogue.residual == "none":
    return None
  return _unlowerable(epilogue.derivative, "derivative")


def _dz_in_place(epilogue: Epilogue, g_smem, r_smem, part=None, chunk: int = 64):
  """Overwrite the shared-memory tile of ``g`` with ``dz = g * act'(r)`` (computed in float32),
  ready to be a wgmma operand; nothing to do for identity (``dz = g``).

  Column blocks of `chunk` (one swizzle span) at a time, so that a warpgroup holds at most two
  64 x 64-element float32 blocks beside its accumulator (64 registers a thread per 64 x 64 pair).
  `part`: ``(rows, first column, columns)`` of the tiles to work on (a warpgroup's own part), else
  all of them.
  """
  if r_smem is None:
    return
  rows, col0, cols = part or (slice(None), 0, g_smem.shape[1])
  for c in range(0, cols, chunk):
    block = (rows, pl.ds(col0 + c, min(chunk, cols - c)))
    g, r = g_smem.at[block], r_smem.at[block]
    dz = g[...].astype(jnp.float32) * epilogue.derivative(r[...].astype(jnp.float32))
    g[...] = dz.astype(g_smem.dtype)
  plgpu.commit_smem()  # the generic-proxy writes, visible to wgmma (async proxy)


def _bwd_kernel(
  body,
  operands,
  specs,
  out_gmem,
  out_tile,
  *,
  t: HopperBwdTiles,
  steps: int,
  stages: int,
):
  """The CTA of one backward kernel: a warp-specialized pipeline of `steps` steps over `operands`
  (gmem refs, `specs` their blocks), `body(wg, smem_refs, acc_ref)` run by each compute
  warpgroup, whose float32 accumulator then goes to its `out_tile(wg)` of `out_gmem`.
  """
  acc_shape = out_tile(0)[2]

  def pipeline(step_body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      step_body,
      grid=(steps,),
      memory_registers=40,
      in_specs=specs,
      wg_axis="wg",
      num_compute_wgs=t.wgs,
      max_concurrent_steps=stages,
      compute_context=compute_context,
    )

  def ignore(*_, **__):
    return None

  dtype = out_gmem.dtype
  scratch = dict(
    allocs=pipeline(ignore, ignore).get_allocations(*operands),
    out_smem=plgpu.SMEM((t.wgs, 1, 2, t.epi, t.epi), dtype, transforms=_transforms(t.epi, dtype)),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _(allocs, out_smem):
    wg = lax.axis_index("wg")

    def compute_context(run_pipeline):
      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(acc_shape, jnp.float32))
      def _(acc_ref):
        run_pipeline(acc_ref)
        plgpu.wgmma_wait(0)  # the last step's wgmma, with `delay`
        rows, cols, _ = out_tile(wg)
        _write_tile(acc_ref[...], lambda z: (z,), (out_gmem.at[rows, cols],), out_smem.at[wg])

    def step(_, *refs):
      *smem_refs, acc_ref = refs
      body(wg, smem_refs, acc_ref)
      # With delay 1, this step's wgmma still runs (its slot is released a step later) while the
      # next step's dz is formed.
      plgpu.wgmma_wait(t.delay)
      return acc_ref

    pipeline(step, compute_context)(*operands, allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dx_kernel(g_gmem, r_gmem, w_gmem, dx_gmem, *, epilogue: Epilogue, t: HopperBwdTiles):
  """``dx[mi, ki] = sum_n dz[mi, n] @ w[ki, n].T``, each compute warpgroup on its own rows."""
  n = g_gmem.shape[1]
  cta_m = t.wgs * t.dx_m
  cta_rows = pl.ds(lax.axis_index("m") * cta_m, cta_m)
  cols = pl.ds(lax.axis_index("k") * t.dx_k, t.dx_k)
  gr_transforms = _transforms(t.dx_n, g_gmem.dtype)
  gr_spec = plgpu.BlockSpec(
    (cta_m, t.dx_n),
    lambda s: (0, s),
    transforms=gr_transforms,
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  w_spec = plgpu.BlockSpec(
    (t.dx_k, t.dx_n),
    lambda s: (0, s),
    transforms=_transforms(t.dx_n, w_gmem.dtype),
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )

  def body(wg, refs, acc_ref):
    *gr_smem, w_smem = refs
    own = pl.ds(wg * t.dx_m, t.dx_m)
    r_smem = gr_smem[1] if r_gmem is not None else None
    _dz_in_place(epilogue, gr_smem[0], r_smem, part=(own, 0, t.dx_n))
    plgpu.wgmma(acc_ref, gr_smem[0].at[own], w_smem.transpose((1, 0)))

  operands = [g_gmem.at[cta_rows, :]] + ([] if r_gmem is None else [r_gmem.at[cta_rows, :]])
  specs = [gr_spec] * len(operands) + [w_spec]

  def out_tile(wg):
    rows = pl.ds(lax.axis_index("m") * cta_m + wg * t.dx_m, t.dx_m)
    return rows, cols, (t.dx_m, t.dx_k)

  operands.append(w_gmem.at[cols, :])
  _bwd_kernel(body, operands, specs, dx_gmem, out_tile, t=t, steps=n // t.dx_n, stages=t.dx_stages)


def _dw_kernel(x_gmem, g_gmem, r_gmem, dw_gmem, *, epilogue: Epilogue, t: HopperBwdTiles):
  """``dw[ki, ni] = sum_m x[m, ki].T @ dz[m, ni]``, each compute warpgroup on its own columns."""
  m = x_gmem.shape[0]
  cta_n = t.wgs * t.dw_n
  rows = pl.ds(lax.axis_index("k") * t.dw_k, t.dw_k)
  cta_cols = pl.ds(lax.axis_index("n") * cta_n, cta_n)
  x_spec = plgpu.BlockSpec(
    (t.dw_m, t.dw_k),
    lambda s: (s, 0),
    transforms=_transforms(t.dw_k, x_gmem.dtype),
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  gr_spec = plgpu.BlockSpec(
    (t.dw_m, cta_n),
    lambda s: (s, 0),
    transforms=_transforms(t.dw_n, g_gmem.dtype),
    memory_space=plgpu.SMEM,
    delay_release=t.delay,
  )
  operands = [x_gmem.at[:, rows], g_gmem.at[:, cta_cols]]
  operands += [] if r_gmem is None else [r_gmem.at[:, cta_cols]]
  specs = [x_spec] + [gr_spec] * (len(operands) - 1)

  def body(wg, refs, acc_ref):
    x_smem, *gr_smem = refs
    own = pl.ds(wg * t.dw_n, t.dw_n)
    r_smem = gr_smem[1] if r_gmem is not None else None
    _dz_in_place(epilogue, gr_smem[0], r_smem, part=(slice(None), wg * t.dw_n, t.dw_n))
    plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), gr_smem[0].at[:, own])

  def out_tile(wg):
    return rows, pl.ds(lax.axis_index("n") * cta_n + wg * t.dw_n, t.dw_n), (t.dw_k, t.dw_n)

  _bwd_kernel(body, operands, specs, dw_gmem, out_tile, t=t, steps=m // t.dw_m, stages=t.dw_stages)


def hopper_dense_bias_act_bwd(
  x: Array,
  w: Array,
  residual: Array | None,
  g: Array,
  *,
  epilogue: Epilogue,
  has_bias: bool,
  tiles: HopperBwdTiles | None = None,
  interpret: Any = False,
) -> tuple[Array, Array, Array | None]:
  """``(dx, dw, db)`` as :func:`pallas_kernels.dense_bias_act_bwd` returns them, on Hopper.

  Two Mosaic GPU kernels, ``dx = dz @ w.T`` and ``dw = x.T @ dz``, each forming
  ``dz = g * act'(residual)`` from tiles of `g` and `residual` on the fly: dz never reaches device
  memory. ``db = sum(dz, rows)`` is a third kernel's, :func:`pallas_kernels.bias_act.bias_grad`
  (Triton: one read of `g` and `residual`, float32 partial sums of dz before its rounding).
  """
  batch, (k, n) = x.shape[:-1], w.shape
  if g.shape != (*batch, n):
    raise ValueError(f"pallas_kernels.hopper: `g` must have shape {(*batch, n)}; got {g.shape}")
  needs_r = epilogue.residual != "none"
  if needs_r and (residual is None or residual.shape != g.shape):
    raise ValueError(
      f"pallas_kernels.hopper: a {epilogue.residual!r} epilogue needs the residual of shape "
      f"{g.shape}; got {None if residual is None else residual.shape}"
    )
  if not (x.dtype == w.dtype == g.dtype) or (needs_r and residual.dtype != x.dtype):
    raise TypeError(
      "pallas_kernels.hopper: x, w, g and the residual must share one dtype; got "
      f"{x.dtype}, {w.dtype}, {g.dtype}, {None if residual is None else residual.dtype}"
    )
  x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
  r2 = residual.reshape(-1, n) if needs_r else None
  m = x2.shape[0]
  t = tiles or hopper_bwd_tiles((m, k, n), needs_r)
  why = hopper_bwd_unsupported((m, k, n), x.dtype, epilogue, t)
  if why is not None:
    raise ValueError(f"pallas_kernels.hopper: {why}")
  db = None
  if has_bias:  # See the module's docstring for why not in the dw kernel.
    db = bias_act.bias_grad(g2, r2, epilogue=epilogue, interpret=bool(interpret))
    db = db.astype(x.dtype)
  epilogue = _for_kernel(epilogue)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  kernel = functools.partial(
    plgpu.kernel,
    num_threads=t.wgs + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret or None,
  )

  def dx_body(g_ref, *refs):
    *r_ref, w_ref, dx_ref = refs
    _dx_kernel(g_ref, r_ref[0] if r_ref else None, w_ref, dx_ref, epilogue=epilogue, t=t)

  def dw_body(x_ref, g_ref, *refs):
    *r_ref, dw_ref = refs
    _dw_kernel(x_ref, g_ref, r_ref[0] if r_ref else None, dw_ref, epilogue=epilogue, t=t)

  r_args = (r2,) if needs_r else ()
  dx = kernel(
    dx_body,
    out_type=jax.ShapeDtypeStruct((m, k), x.dtype),
    grid=(m // (t.wgs * t.dx_m), k // t.dx_k),
    grid_names=("m", "k"),
  )(g2, *r_args, w)
  dw = kernel(
    dw_body,
    out_type=jax.ShapeDtypeStruct((k, n), w.dtype),
    grid=(k // t.dw_k, n // (t.wgs * t.dw_n)),
    grid_names=("k", "n"),
  )(x2, g2, *r_args)
  return dx.reshape(*batch, k), dw, db
