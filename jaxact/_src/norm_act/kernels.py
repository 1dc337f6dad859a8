"""The norm + activation kernel calls: the normalize-and-activate forward and the two-pass
backward (:mod:`pallas_kernels.norm_act_triton`), behind the platform switch.

The kernels see x channels-last as ``(samples, rows, C)``: a batch norm is one sample, a group norm
one sample per example, its groups' statistics repeated over their channels (``(samples, C)``
float32 arrays, a few KiB). The statistics, and the small sums that turn the kernels' per-(sample,
channel) sums into the statistics' and parameters' cotangents, are XLA's. ``pallas_kernels`` is
imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from jaxact._src.core import moments, pallas_sharding, platform, shardings
from jaxact._src.norm_act import rules

if TYPE_CHECKING:
  from jaxact._src.norm_act.plan import NormActPlan


def _view(plan: NormActPlan, shape) -> tuple[int, int, int]:
  """x's ``(samples, rows, C)``."""
  samples = shape[0] if plan.groups else 1
  return samples, math.prod(shape[:-1]) // samples, shape[-1]


def _per_sample(plan: NormActPlan, stat, samples: int, c: int):
  """A statistic as the view keeps it (size-1 axes) as a ``(samples, C)`` float32 array."""
  stat = stat.astype(jnp.float32)
  if not plan.groups:
    return stat.reshape(1, c)
  return jnp.repeat(stat.reshape(samples, plan.groups), c // plan.groups, axis=1)


def _group_mean(plan: NormActPlan, v, count: int):
  """``(samples, C)`` per-channel sums as each statistic's mean, repeated over its channels."""
  if not plan.groups:
    return v / count
  samples, c = v.shape
  m = jnp.sum(v.reshape(samples, plan.groups, c // plan.groups), axis=2) / count
  return jnp.repeat(m, c // plan.groups, axis=1)


def _like(ct, primal):
  return None if primal is None else ct.reshape(primal.shape).astype(primal.dtype)


def _on_mesh(kernel: Callable[..., Any], like: tuple[int, ...]) -> Callable[..., Any]:
  """`kernel` under ``shard_map`` when its operands are typed over an Explicit mesh (a
  ``pallas_call`` takes no operands typed over Explicit axes), as it is otherwise. The rules
  decline operands split over a mesh, so each device's block is the whole array (replicated, or
  typed over axes of one device); output `i` is typed as argument ``like[i]``."""

  def run(*arrays, **static):
    mesh = shardings.explicit_mesh(*arrays)
    if mesh is None:
      return kernel(*arrays, **static)
    specs = [None if a is None else shardings.spec_of(a) for a in arrays]
    outs = tuple(() if specs[i] is None else specs[i] for i in like)  # None: no cotangent
    return pallas_sharding.per_shard(kernel, arrays, specs, outs, mesh=mesh, **static)

  return run


def forward(
  plan: NormActPlan, x, inv, mean, r, scale, bias, xla: Callable[..., Any], *, keep: bool
):
  """``(y, x_hat)`` of x normalized as ``(x * inv - mean) * r`` (the view's statistics, size-1
  axes kept), as `xla` returns them; x_hat None without `keep` (no gradient to come)."""
  from pallas_kernels import norm_act_triton

  ep = rules.epilogue(plan)

  def triton(x, inv, mean, r, scale, bias, *, interpret):
    samples, rows, c = _view(plan, x.shape)
    y, x_hat = norm_act_triton.norm_act_fwd(
      x.reshape(samples, rows, c),
      _per_sample(plan, mean, samples, c),
      _per_sample(plan, r, samples, c),
      scale,
      bias,
      epilogue=ep,
      out_dtype=plan.out_dtype,
      keep_x_hat=keep,
      x_scale=_per_sample(plan, jnp.broadcast_to(inv, mean.shape), samples, c),
      interpret=interpret,
    )
    return y.reshape(x.shape), None if x_hat is None else x_hat.reshape(x.shape)

  def fallback(*args):
    y, x_hat = xla(*args)
    return y, x_hat if keep else None

  args = (x, inv, mean, r, scale, bias)
  return platform.switch(args, _on_mesh(triton, (0, 0)), fallback, plan.decision, False)


def train_backward(plan: NormActPlan, x_hat, sigma, scale, bias, g, g_mean, g_var, xla):
  """``(dx, d_scale, d_bias)`` of a norm by batch statistics, as `xla` returns them: the sums
  pass, the statistics' means (XLA, ``(samples, C)``), then the dx pass."""
  from pallas_kernels import norm_act_triton

  ep, dz_dtype = rules.epilogue(plan), plan.dz_dtype

  def triton(x_hat, sigma, scale, bias, g, g_mean, g_var, *, interpret):
    samples, rows, c = _view(plan, x_hat.shape)
    xh, g3 = x_hat.reshape(samples, rows, c), g.reshape(samples, rows, c)
    run = lambda **kw: norm_act_triton.norm_act_bwd(
      xh, g3, scale, bias, epilogue=ep, dz_dtype=dz_dtype, interpret=interpret, **kw
    )
    _, (s_dz, s_dz_xh) = run()
    gamma = 1.0 if scale is None else scale.astype(jnp.float32)
    count = rows * (c // plan.groups if plan.groups else 1)  # elements a statistic
    m1, m2 = (_group_mean(plan, v * gamma, count) for v in (s_dz, s_dz_xh))
    sd = _per_sample(plan, sigma, samples, c)
    rr, q = moments.reciprocal(sd)
    gm, gv = _per_sample(plan, g_mean, samples, c), _per_sample(plan, g_var, samples, c)
    # dx = (dxh - m1 - x_hat m2) / sigma + (g_mean + 2 g_var x_hat sigma) / count, with dxh = dz
    # scale and 1 / sigma = rr q (q a power of two: the kernel's last product)
    a = rr * m1 - gm / count / q
    b = rr * m2 - gv * (sd * (2.0 / count)) / q
    dx, _ = run(sums=False, dx=(rr * gamma, a, b), dx_scale=q, dx_dtype=plan.x_dtype)
    d_scale = _like(jnp.sum(s_dz_xh, axis=0), scale)
    return dx.reshape(x_hat.shape), d_scale, _like(jnp.sum(s_dz, axis=0), bias)

  args = (x_hat, sigma, scale, bias, g, g_mean, g_var)
  return platform.switch(args, _on_mesh(triton, (0, 2, 3)), xla, plan.decision, False)


def infer_backward(plan: NormActPlan, x_hat, sigma, scale, bias, mean, var, g, xla):
  """``(dx, d_scale, d_bias, d_mean, d_var)`` of a norm by given statistics, as `xla` returns
  them: one pass writes dx and the sums."""
  from pallas_kernels import norm_act_triton

  ep, dz_dtype = rules.epilogue(plan), plan.dz_dtype

  def triton(x_hat, sigma, scale, bias, mean, var, g, *, interpret):
    samples, rows, c = _view(plan, x_hat.shape)
    rr = 1 / _per_sample(plan, sigma, samples, c)  # normal: the given statistics' sigma < 2^63
    gamma = 1.0 if scale is None else scale.astype(jnp.float32)
    dx, (s_dz, s_dz_xh) = norm_act_triton.norm_act_bwd(
      x_hat.reshape(samples, rows, c),
      g.reshape(samples, rows, c),
      scale,
      bias,
      epilogue=ep,
      dx=(rr * gamma, None, None),
      dx_dtype=plan.x_dtype,
      dz_dtype=dz_dtype,
      interpret=interpret,
    )
    # x_hat = (x - mean) r with r = (var + eps)^-1/2: d x_hat / d mean = -r and
    # d x_hat / d var = -x_hat r^2 / 2
    d_mean = _like(-gamma * s_dz * rr, mean)
    d_var = _like(-0.5 * rr * gamma * s_dz_xh * rr, var)
    return (dx.reshape(x_hat.shape), _like(s_dz_xh, scale), _like(s_dz, bias), d_mean, d_var)

  args = (x_hat, sigma, scale, bias, mean, var, g)
  return platform.switch(args, _on_mesh(triton, (0, 2, 3, 4, 5)), xla, plan.decision, False)
