"""The ``custom_vjp`` of the fused ops and their XLA path.

One rule for ``activation(x @ w + b)`` and ``activation(conv(x, w) + b)``: the forward is the matmul
or convolution, the bias and the activation; the backward computes ``dz = g * act'(.)`` once, the
bias gradient as a sum of ``dz`` and the input and kernel gradients from the transposes of the same
matmul or convolution. What is kept for the backward pass:

* ``"output"`` activations (relu, tanh, elu, ... with valid, concrete parameters): the output ``y``
  plus ``x`` and ``w``, which the transposes need anyway. ``y`` is the next layer's input, so a deep
  network keeps one activation-sized array per layer.
* ``"input"`` activations (gelu, silu, ... and output ones with traced or invalid parameters): the
  pre-activation ``z`` plus ``x`` and ``w``.
* ``"none"`` (identity): ``x`` and ``w`` only.
* ``"code"`` (``residual_bits``): the derivative code of the pre-activation (8, 4 or 2 bits an
  element) plus ``x`` and ``w``.
* any other callable: ``z``, ``x``, ``w`` and the arrays the callable closes over; its derivative
  comes from JAX's autodiff of the callable, re-run from ``z`` in the backward pass.

With a dropout after the activation (:mod:`jaxact._src.core.dropout`) the op returns, and for output
activations keeps, the dropped output, plus the key: the backward draws the mask again.

Half precision (float16/bfloat16) accumulates and evaluates the activation in float32 and returns,
and keeps, its own dtype. The plan's :class:`~jaxact._src.core.dispatch.Decision` says which
passes run kernels (:mod:`jaxact._src.fused.kernels`); everything else here is the XLA path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.activations import api as activations
from jaxact._src.core import barriers, shardings
from jaxact._src.fused import kernels
from jaxact._src.fused.plan import Conv, Plan

# The names of what a layer keeps besides its input and weights (jax.ad_checkpoint.checkpoint_name):
# its output where the activation's derivative is read from it, else the pre-activation or its
# derivative code. Under jax.checkpoint(policy=save_only_these_names(*CHECKPOINT_NAMES)) a layer
# keeps it (and its input, as its policy says) and its backward runs without the forward.
CHECKPOINT_NAMES = ("jaxact.fused.y", "jaxact.fused.kept")

# ------------------------------------------------------------------------- the custom_vjp rule


def _forward_matmul_dtype(plan: Plan, operands) -> np.dtype:
  """The result dtype of the forward matmul/convolution (accumulation is float32 either way).

  bfloat16 operands give a bfloat16 result, as XLA's GPU GEMMs write it: a float32 result would be
  one more activation-sized float32 array written and read back before the epilogue (measured on
  an H100: the forward 15% slower than jax.nn). bfloat16 has float32's range, so nothing the
  epilogue could bring back into range overflows. float16 keeps a float32 result: its range ends at
  65504, where a saturating activation of a larger pre-activation is still finite.
  """
  return np.dtype(operands) if np.dtype(operands) == jnp.bfloat16 else plan.acc_dtype


def _backward_matmul_dtype(plan: Plan, operands) -> np.dtype:
  """The dtype of dz in the backward matmuls: the operands' dtype when it is 16-bit.

  dz = g * act'(.) is formed in the accumulation dtype and rounded to 16-bit operands before the
  dx and dw products (db sums the same rounded dz, in float32), which is what autodiff of
  ``act(x @ w + b)`` in 16-bit does and what the Pallas kernels do. A float32 dz would turn both
  products into float32 matmuls (measured on an H100: the backward 3x slower than jax.nn).
  """
  return np.dtype(operands) if np.dtype(operands).itemsize == 2 else plan.acc_dtype


def _preactivation(plan: Plan, x: Array, w: Array, b: Array | None) -> Array:
  z = plan.linear(x, w, _forward_matmul_dtype(plan, x.dtype)).astype(plan.acc_dtype)
  if b is not None:
    bias = b.astype(plan.acc_dtype).reshape(plan.bias_shape(z.ndim, b.shape[0]))
    z = z + shardings.align(bias, z)
  return z


def _xla_forward(plan: Plan, x: Array, w: Array, b: Array | None, *dynamic: Array, key=None):
  """``(y, kept)``: kept is z in the output dtype for input residuals, the packed derivative code
  for ``"code"`` ones, else None. With a dropout, y is dropped out (the mask drawn from `key`)."""
  act = plan.act

  def activate(z):
    if act.fn is not None:
      # a plain callable sees what `act(x @ w + b)` would give it
      return act.fn(z.astype(plan.out_dtype), *dynamic)
    return act.rule.spec.fn(z, **act.rule.params(dynamic)).astype(plan.out_dtype)

  if plan.dropout is None:
    z = _preactivation(plan, x, w, b)
    y = activate(z)
  else:
    # Without a kept pre-activation the bias is added block by block, so that the matmul's result
    # is the one output-sized array: the blocks overwrite it with the output where the dtypes
    # agree. A kept one is the residual, whole.
    drop = plan.dropout
    z = _preactivation(plan, x, w, b if act.kept_z else None)
    bias = None if act.kept_z or b is None else shardings.align(b.astype(plan.acc_dtype), z)

    def block(mask, z):  # z whole, or a (rows, features) block of it
      if bias is not None:
        z = z + lax.expand_dims(bias, range(z.ndim - 1))  # z's rank, explicitly
      return drop.apply(mask, activate(z))

    reuse = None if act.kept_z else 0
    y = drop.by_blocks(key, [z], block, plan.out_dtype, blocked=not dynamic, reuse=reuse)
  if act.fn is not None:
    z = z.astype(plan.out_dtype)
  if act.residual == "code":
    return y, activations.encode(act.rule, z, dynamic)
  return y, (z.astype(plan.out_dtype) if act.residual == "input" else None)


def _fused_fwd(plan: Plan, x: Array, w: Array, b: Array | None, key, *dynamic: Array):
  act = plan.act
  if plan.x_gather is not None:  # gathered once; the backward's dw reads it again
    x = shardings.to_spec(x, plan.x_gather)
  if plan.decision.forward == "xla":
    y, z = _xla_forward(plan, x, w, b, *dynamic, key=key)
  else:  # only calls without array parameters get here: `dynamic` is empty
    y, z = kernels.forward(
      plan,
      x,
      w,
      b,
      functools.partial(_xla_forward, plan),
      lambda x, w: plan.linear(x, w, _forward_matmul_dtype(plan, x.dtype)),
    )
  # The barrier hides the residual's origin from XLA (see barriers.barrier_residual): without it
  # XLA recomputes y from z in the backward pass (keeping z alive as well) or shares the backward's
  # intermediates with the forward's, and the saving this rule exists for is lost. With dropout,
  # an output residual is the dropped output, the array returned.
  y, kept = barriers.barrier_residual(act.residual, y, z)
  if act.residual == "output":
    y = kept = checkpoint_name(y, CHECKPOINT_NAMES[0])
  elif kept is not None:
    kept = checkpoint_name(kept, CHECKPOINT_NAMES[1])
  return y, (x, w, kept, key, dynamic)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan: Plan, x: Array, w: Array, b: Array | None, key, *dynamic: Array):
  return _fused_fwd(plan, x, w, b, key, *dynamic)[0]


def _batch_chunks(plan: Plan, x: Array, dz: Array) -> int:
  """How many batch chunks the kernel gradient of a convolution is summed over on CPU.

  XLA:CPU computes a convolution's kernel gradient from copies of x and dz in another layout. The
  copies of one chunk, ``(|x| + |dz|) / chunks``, should fit in the space of the dx that the
  backward pass allocates next, ``|x|``, so that the kernel gradient does not raise the peak: for
  equal sizes, two chunks. The count is a power of two (or the cap below): under data parallelism
  a strided chunk stays on each device only if the per-device batch is a multiple of it, and
  per-device batches are powers of two far more often than multiples of 3. Chunks may differ in
  size by one example; there are at most 16 (and at most one per example), since each is a
  convolution of its own.
  """
  dn = plan.linear.dimension_numbers
  n = x.shape[dn.lhs_spec[0]]
  x_bytes, dz_bytes = x.size * x.dtype.itemsize, dz.size * dz.dtype.itemsize
  most = min(n, 16)
  chunks = 1
  while chunks < most and -(-n // chunks) * (x_bytes + dz_bytes) > n * x_bytes:
    chunks = min(2 * chunks, most)
  return chunks


def _kernel_grad(plan: Plan, x: Array, w: Array, dz: Array) -> Array:
  """The kernel gradient: the transpose, in w, of the matmul or convolution of x, at dz."""

  def transpose(x, dz):
    (dw,) = jax.linear_transpose(lambda w_: plan.linear(x, w_, dz.dtype), w)(dz)
    return dw

  # Without the barrier XLA (on CPU) copies each layer's input to the layout of its kernel-gradient
  # convolution as soon as the input exists, in the forward pass, and keeps the copy next to it
  # until the backward pass (2L buffers instead of L). Tying x to dz keeps the copy in the backward.
  # Sharded, _transposes ties them for both products (see there).
  if not plan.sharded:
    x, dz = lax.optimization_barrier((x, dz))
  chunks = 1
  # Under Explicit mesh axes the sharding is in the types, which cannot express a strided slice of
  # a sharded batch: there the kernel gradient stays one convolution (each device's is local).
  if isinstance(plan.linear, Conv) and not any(shardings.spec_of(x)):
    chunks = _batch_chunks(plan, x, dz)
  if chunks == 1:
    return transpose(x, dz)

  def by_chunks(x, dz):
    # The examples are independent, so dw is the sum of the chunks' kernel gradients. Unrolled:
    # a convolution inside a while loop runs ~30x slower on XLA:CPU. The barriers order the chunks
    # one after another, so that one chunk's copies are alive at a time. Chunk i takes every
    # chunks-th example from i on, not a contiguous range: with the batch sharded over devices
    # (data parallelism), each device holds consecutive examples, so a strided chunk is a local
    # slice of every shard (when the per-device batch is a multiple of `chunks`), where a
    # contiguous half would move half of the activations between devices.
    dn = plan.linear.dimension_numbers
    n = x.shape[dn.lhs_spec[0]]
    dw = None
    for i in range(chunks):
      if dw is not None:
        x, dz, dw = lax.optimization_barrier((x, dz, dw))
      xi = lax.slice_in_dim(x, i, n, stride=chunks, axis=dn.lhs_spec[0])
      dzi = lax.slice_in_dim(dz, i, n, stride=chunks, axis=dn.out_spec[0])
      dwi = transpose(xi, dzi)
      dw = dwi if dw is None else dw + dwi
    return dw

  # The copies are XLA:CPU's; other backends keep the one convolution, fewer and larger kernels.
  return lax.platform_dependent(x, dz, cpu=by_chunks, default=transpose)


def _fused_bwd(plan: Plan, res, g):
  dx, dw, db, *rest = _fused_bwd_unsharded(plan, res, g)
  dx, dw, db = shardings.retype((dx, dw, db), plan.shardings)
  return (dx, dw, db, None, *rest)  # None: the dropout key's (integer) cotangent


def _fused_bwd_unsharded(plan: Plan, res, g):
  if plan.decision.backward == "xla":
    return _xla_bwd(plan, res, g)
  x, w, kept, _, _ = res

  def xla(x, w, kept, g):
    return _xla_bwd(plan, (x, w, kept, None, ()), g)

  return kernels.backward(
    plan,
    x,
    w,
    kept,
    g,
    xla,
    functools.partial(_transposes, plan),
    _backward_matmul_dtype(plan, x.dtype),
  )


def _xla_bwd(plan: Plan, res, g):
  x, w, kept, key, dynamic = res
  act, acc = plan.act, plan.acc_dtype
  d_dynamic: Sequence[Any]

  def cotangents(kept, g, tied=False):
    if act.fn is not None:
      _, pull = jax.vjp(act.fn, kept, *dynamic)
      dz, *d_dynamic = pull(g)
      return dz.astype(acc), d_dynamic
    return activations.rule_cotangents(act.rule, kept, g, dynamic, acc, tied=tied)

  if plan.dropout is None:
    dz, d_dynamic = cotangents(kept, g)
  else:
    dz_dtype = _backward_matmul_dtype(plan, x.dtype)
    dz, d_dynamic = _dropped_cotangents(plan, kept, key, g, dynamic, cotangents, dz_dtype)
  # In 16-bit, db sums the rounded dz that the products use (as autodiff does): then dz is one
  # 16-bit array, where a float32 dz read by the bias reduction would be one more, twice the size
  # (measured on an H100: 256 MiB of step temp against jax.nn's 96 for an 8192 x 4096 layer).
  dz = dz.astype(_backward_matmul_dtype(plan, x.dtype))
  if act.residual == "input" and dz.dtype != acc:
    # With an expensive derivative (gelu's tanh, silu's exp), XLA:GPU will not repeat it in two
    # consumers, so it wrote float32 dz once for the rounding and the bias sum to read: 128 MiB
    # for an 8192 x 4096 bfloat16 layer on an H100, where jax.nn keeps 96 MiB in all. The
    # barrier makes the 16-bit dz the one array both the sum and the matmuls read.
    dz = lax.optimization_barrier(dz)
  db = None
  if plan.has_bias:
    feature = plan.linear.feature_axis(dz.ndim)
    db = jnp.sum(dz, tuple(a for a in range(dz.ndim) if a != feature), dtype=acc).astype(x.dtype)
  dx, dw = _transposes(plan, x, w, dz)
  return (dx, dw, db, *d_dynamic)


def _dropped_cotangents(plan: Plan, kept, key, g, dynamic, cotangents, dz_dtype):
  """``(dz, array parameters' cotangents)`` through the dropout and the activation, the mask drawn
  again (in blocks of rows where it can be: see
  :meth:`jaxact._src.core.dropout.Dropout.by_blocks`)."""
  drop, acc = plan.dropout, plan.acc_dtype
  # Tied to the cotangent, so that XLA neither keeps the forward's mask nor draws this one early.
  (kept, key), g = barriers.after_cotangent((kept, key), g)
  d_dynamic = []

  def dz_of(mask, g, kept=None):
    g = drop.apply(mask, g)  # Flax's dropout backward
    if kept is not None and plan.act.residual == "output":
      kept = kept.astype(acc) * drop.keep  # y = y_d * keep where the mask keeps; dz 0 elsewhere
    dz, d = cotangents(kept, g, tied=True)
    d_dynamic[:] = d
    return jnp.where(mask, dz, 0)  # the dropped elements' derivative, at y = 0, may be anything

  if plan.act.residual == "code":
    # A packed code is not the output's shape: g is dropped in blocks (in place), then the code's
    # derivative (finite) multiplies it whole, 0 where the mask dropped.
    g = drop.by_blocks(key, [g], drop.apply, g.dtype, reuse=0)
    return cotangents(kept, g, tied=True)
  arrays = [g] if kept is None else [g, kept]
  dz = drop.by_blocks(key, arrays, dz_of, dz_dtype, blocked=not dynamic, reuse=0)
  return dz, d_dynamic


def _transposes(plan: Plan, x: Array, w: Array, dz: Array) -> tuple[Array, Array]:
  """``(dx, dw)`` from dz (in the backward matmul dtype): the linear op's two transposes."""
  if plan.sharded:
    # One barrier for both products: past a barrier XLA gathers again what a product gathers (dz's
    # features, a weight), so dw and dx read the same dz, as the plain composition's do.
    x, dz = lax.optimization_barrier((x, dz))
  dw = _kernel_grad(plan, x, w, dz)
  # dx waits for the kernel gradient, whose operand copies would otherwise be alive next to it
  # (sharded, not: see _kernel_grad).
  if not plan.sharded:
    dz, w, _ = lax.optimization_barrier((dz, w, dw))
  # Against x's own type where the forward gathered it: dx comes out split as x is (a
  # reduce-scatter where XLA would all-reduce then slice).
  x_type = x if plan.x_gather is None else shardings.struct(x, plan.shardings[0])
  (dx,) = jax.linear_transpose(lambda x_: plan.linear(x_, w, dz.dtype), x_type)(dz)
  return dx, dw


_fused.defvjp(_fused_fwd, _fused_bwd)
_fused_jit = jax.jit(_fused, static_argnums=0)


def fused(plan: Plan, x: Array, w: Array, b: Array | None, key, *dynamic: Array) -> Array:
  """``act(linear(x, w) + b)`` by `plan` (then its dropout, drawn from the raw `key`; None
  without), differentiated by the rule above."""
  # A closure-converted callable is a new object on every call; jit would retrace each time.
  run = _fused_jit if plan.act.fn is None else _fused
  return run(plan, x, w, b, key, *dynamic)
