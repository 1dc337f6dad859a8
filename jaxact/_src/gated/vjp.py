"""The ``custom_vjp`` of the gated ops and their XLA path.

``gated_dense`` computes ``h = act(a) * b`` with ``a = x @ w_gate + b_gate`` and
``b = x @ w_up + b_up``; ``gated_mlp`` goes on to ``y = h @ w_down + b_down``. Both keep, beyond the
input ``x`` and the weights (which the weight gradients need anyway), only ``a`` and ``b``: the
gate's value and derivative, and for ``gated_mlp`` the hidden ``h`` that the down projection's
weight gradient reads, are recomputed elementwise from them in the backward pass. Autodiff of the
same composition keeps ``act(a)``, the activation's intermediates and ``h`` besides.

Products of three factors (``gh * act'(a) * b``) are formed so that an intermediate that overflows
to infinity times an exact zero gives 0, not NaN.

With a dropout of the hidden (``gated_mlp``'s ``dropout_rate``: between the gated product and the
down projection, T5 v1.1's and Gemma's place) the op keeps the key, not the mask: the forward
drops ``h`` before the down projection, and the backward draws the same mask again, twice (for the
down projection's weight gradient, which reads the dropped ``h``, and for ``gh``), in blocks of
rows (:meth:`jaxact._src.core.dropout.Dropout.by_blocks`). The kernels draw no masks: with dropout
the call takes XLA's path.

The plan's :class:`~jaxact._src.core.dispatch.Decision` says whether the gated projection (forward)
and the elementwise pass from ``gh`` to ``da``, ``db`` (and ``h``) (backward) run the Triton
kernels (:mod:`jaxact._src.gated.kernels`, :mod:`pallas_kernels.gated_triton`); the matmuls of the
backward pass and the down projection are XLA's either way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

from jaxact._src.activations import gating
from jaxact._src.core import barriers, shardings
from jaxact._src.gated import kernels
from jaxact._src.gated.plan import GatedPlan

# The names of the residuals a and b (jax.ad_checkpoint.checkpoint_name): under
# jax.checkpoint(policy=save_only_these_names(*CHECKPOINT_NAMES)) a block keeps a and b and its
# input, and recomputes the rest (its norm) in the backward pass.
CHECKPOINT_NAMES = ("jaxact.gated.a", "jaxact.gated.b")


def _matmul_dtype(plan: GatedPlan, operands) -> np.dtype:
  """The matmuls' result dtype: 16-bit operands give a 16-bit result (as XLA's GPU GEMMs write it,
  and as :mod:`jaxact._src.fused.vjp` does), float32 and float64 the accumulation dtype."""
  return np.dtype(operands) if np.dtype(operands).itemsize == 2 else plan.acc_dtype


def _dot(plan: GatedPlan, x: Array, w: Array, dtype, out_sharding=None) -> Array:
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  return lax.dot_general(
    x, w, dims, plan.precision, preferred_element_type=dtype, out_sharding=out_sharding
  )


def _project(plan: GatedPlan, x: Array, w: Array, bias: Array | None, out_sharding=None) -> Array:
  """``x @ w + bias`` in the output dtype (the array that is kept), accumulated in float32+."""
  z = _dot(plan, x, w, _matmul_dtype(plan, x.dtype), out_sharding).astype(plan.acc_dtype)
  if bias is not None:
    bias = bias.astype(plan.acc_dtype).reshape((1,) * (z.ndim - 1) + bias.shape)  # z's rank
    z = z + shardings.align(bias, z)
  return z.astype(plan.out_dtype)


def _projections(plan: GatedPlan, x, w_gate, w_up, b_gate, b_up, out_sharding=None):
  """``(a, b)``: the gate and up projections of `x`, each as :func:`_project` makes it."""
  a = _project(plan, x, w_gate, b_gate, out_sharding)
  return a, _project(plan, x, w_up, b_up, out_sharding)


def _down(plan: GatedPlan, h: Array, w_down: Array, b_down: Array | None) -> Array:
  """The down projection of (the dropped) h, gathered first where its product needs it."""
  h = shardings.to_spec(h, plan.h_gather) if plan.h_gather is not None else h
  return _project(plan, h, w_down, b_down, plan.out_sharding)


def hidden(plan: GatedPlan, a: Array, b: Array, dynamic) -> Array:
  """``h = act(a) * b`` in the output dtype, from the kept (rounded) a and b."""
  return gating.hidden(plan.act, a, b, dynamic, plan.acc_dtype, plan.out_dtype)


def gate_cotangents(plan: GatedPlan, a: Array, b: Array, gh: Array, dynamic):
  """``(da, db, d_dynamic)`` in the accumulation dtype from the cotangent of h."""
  return gating.gate_cotangents(plan.act, a, b, gh, dynamic, plan.acc_dtype)


# --------------------------------------------------------------------------------- the rules


def dropped(plan: GatedPlan, key, h: Array) -> Array:
  """Flax's dropout of `h` with the mask drawn from the raw `key` (`h` itself without dropout),
  written over `h` block by block."""
  if plan.dropout is None:
    return h
  return plan.dropout.by_blocks(key, [h], plan.dropout.apply, h.dtype, reuse=0)


def _forward(plan: GatedPlan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic):
  """``(out, a, b)``: out is h for gated_dense, y for gated_mlp (h dropped first, with a key)."""
  a, b = _projections(plan, x, w_gate, w_up, b_gate, b_up, plan.hidden_sharding)
  out = hidden(plan, a, b, dynamic)
  if plan.has_down:
    out = _down(plan, dropped(plan, key, out), w_down, b_down)
  return out, a, b


def _kernel_forward(plan: GatedPlan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, keep=True):
  """:func:`_forward` with the gated projection in the plan's kernel (the down projection is
  XLA's); only calls without array parameters get here. Without `keep` (no gradient to come)
  the kernel writes h alone, and a and b are None."""

  def xla(x, w_gate, w_up, b_gate, b_up):
    a, b = _projections(plan, x, w_gate, w_up, b_gate, b_up, plan.hidden_sharding)
    return (hidden(plan, a, b, ()), a, b) if keep else (hidden(plan, a, b, ()), None, None)

  args = (x, w_gate, w_up, b_gate, b_up)
  out, a, b = kernels.forward(plan, *args, xla, keep=keep)
  if plan.has_down:
    out = _down(plan, out, w_down, b_down)
  return out, a, b


def _gated_fwd(plan: GatedPlan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic):
  if plan.x_gather is not None:  # gathered once; the backward's weight gradients read it again
    x = shardings.to_spec(x, plan.x_gather)
  if plan.decision.forward == "xla":
    out, a, b = _forward(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic)
  else:  # never with dropout (dispatch: the kernels draw no masks)
    keep = plan.residuals != "input"
    out, a, b = _kernel_forward(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, keep)
  if plan.residuals == "input":  # a and b are recomputed from x (and the biases) in the backward
    return out, (x, w_gate, w_up, w_down, None, None, key, dynamic, (b_gate, b_up))
  # As barriers.barrier_residual: hide a and b's origin, so that XLA neither recomputes them in
  # the backward pass nor keeps the forward's act(a) or h alive to share with the backward's.
  out, a, b = lax.optimization_barrier((out, a, b))
  a, b = (checkpoint_name(v, n) for v, n in zip((a, b), CHECKPOINT_NAMES, strict=True))
  return out, (x, w_gate, w_up, w_down, a, b, key, dynamic, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated(plan: GatedPlan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic):
  if plan.decision.forward != "xla":  # no gradient: XLA drops a and b, a kernel must not write them
    return _kernel_forward(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, keep=False)[0]
  return _gated_fwd(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic)[0]


def _bias_grad(plan: GatedPlan, present: bool, dz: Array, dtype) -> Array | None:
  if not present:
    return None
  return jnp.sum(dz, tuple(range(dz.ndim - 1)), dtype=plan.acc_dtype).astype(dtype)


def _weight_grad(plan: GatedPlan, x: Array, w: Array, dz: Array, out_sharding=None) -> Array:
  """``x^T dz`` over every axis but the last, as the transpose in `w` of ``x @ w``.

  Transposes rather than a hand-written dot_general: under Explicit mesh axes the transpose rules
  give the result `w`'s sharding, where a contraction over a sharded batch would be ambiguous.
  """
  (dw,) = jax.linear_transpose(lambda w_: _dot(plan, x, w_, dz.dtype, out_sharding), w)(dz)
  return dw


def _input_grad(plan: GatedPlan, dz: Array, w: Array, x, out_sharding=None) -> Array:
  """``dz @ w^T``, the transpose in `x` of ``x @ w``, in x's dtype (and sharding: `x` may be a
  ``ShapeDtypeStruct`` of the sharding the result should take)."""
  (dx,) = jax.linear_transpose(lambda x_: _dot(plan, x_, w, dz.dtype, out_sharding), x)(dz)
  return dx


def _gated_bwd(plan: GatedPlan, res, g: Array):
  grads = _gated_bwd_rule(plan, res, g)
  return (*grads[:7], None, *grads[7:])  # None: the dropout key's (integer) cotangent


def _gated_bwd_rule(plan: GatedPlan, res, g: Array):
  x, w_gate, w_up, w_down, a, b, key, dynamic, biases = res
  acc, mm = plan.acc_dtype, _matmul_dtype(plan, x.dtype)
  # Nothing of the backward (h, act(a), the mask) may run before the cotangent exists: it would be
  # computed in the forward pass and kept alive until here (barriers.after_cotangent). Where a and
  # b are recomputed, x is tied to it: XLA would otherwise share the forward's projections (CSE)
  # and keep them alive until here. (Not otherwise: a scanned step would copy x's slice.)
  if a is None:
    (x, key), g = barriers.after_cotangent((x, key), g)
  else:
    (a, b, key), g = barriers.after_cotangent((a, b, key), g)
  blocked = plan.backward_rows is not None and not dynamic  # rules: XLA's backward alone
  if a is None and not blocked:
    a, b = _projections(plan, x, w_gate, w_up, *biases, plan.hidden_sharding)
  if plan.decision.backward != "xla":
    return _kernel_bwd(plan, x, w_gate, w_up, w_down, a, b, g)
  if blocked:
    return _blocked_bwd(plan, x, w_gate, w_up, w_down, a, b, g, biases)
  d_down = None, None
  if plan.has_down:
    h = dropped(plan, key, hidden(plan, a, b, dynamic))
    gy = g.astype(mm)
    d_down = (
      _down_weight_grad(plan, h, w_down, gy),
      _bias_grad(plan, plan.has_down_bias, gy, x.dtype),
    )
    gh = dropped(plan, key, _down_input_grad(plan, gy, w_down, a))  # Flax's dropout backward
  else:
    gh = g
  da, db, d_dynamic = gate_cotangents(plan, a, b, gh, dynamic)
  # 16-bit: the products read (and the bias sums add) the rounded da and db, as autodiff of the
  # 16-bit composition does; one 16-bit array each instead of a float32 one and its rounding.
  da, db = da.astype(mm), db.astype(mm)
  if mm != acc:
    da, db = lax.optimization_barrier((da, db))
  return _projection_grads(plan, x, w_gate, w_up, da, db, d_down, d_dynamic)


def _blocked_bwd(plan: GatedPlan, x, w_gate, w_up, w_down, a, b, g, biases=None):
  """The XLA backward a block of ``plan.backward_rows`` tokens at a time: each block's h, gh, da
  and db (its (rows, hidden) temporaries), its rows of dx, and its share of the weight and bias
  gradients summed in the accumulation dtype (one rounding at the end). One device, no dropout,
  no traced activation parameters (rules.backward_rows). The last block is moved back to end at
  the last token; the rows it shares with its predecessor count once in the sums. With `a` None
  (residuals="input") each block's a and b are recomputed from its rows of x and the `biases`."""
  acc, mm, rows = plan.acc_dtype, _matmul_dtype(plan, x.dtype), plan.backward_rows
  t = math.prod(x.shape[:-1])
  x2, g2 = (v.reshape(t, v.shape[-1]) for v in (x, g))
  kept = () if a is None else tuple(v.reshape(t, v.shape[-1]) for v in (a, b))
  n = -(-t // rows)

  def wsum(lhs, rhs):  # lhs^T rhs over the block's rows, in the accumulation dtype
    dims = (((0,), (0,)), ((), ()))
    return lax.dot_general(lhs, rhs, dims, plan.precision, preferred_element_type=acc)

  def body(i, carry):
    dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down = carry
    start = jnp.minimum(i * rows, t - rows)
    xi, gi, *kept_i = (lax.dynamic_slice_in_dim(v, start, rows, 0) for v in (x2, g2, *kept))
    if kept_i:
      ai, bi = kept_i
    else:
      ai, bi = _projections(plan, xi, w_gate, w_up, *biases)
    fresh = ((start + jnp.arange(rows)) >= i * rows)[:, None]
    if plan.has_down:
      gy = gi.astype(mm)
      gy_once = jnp.where(fresh, gy, jnp.zeros_like(gy))
      dw_down = dw_down + wsum(hidden(plan, ai, bi, ()), gy_once)
      db_down = db_down + jnp.sum(gy_once, 0, dtype=acc)
      gh = _input_grad(plan, gy, w_down, ai)
    else:
      gh = gi
    da, db, _ = gate_cotangents(plan, ai, bi, gh, ())
    da, db = da.astype(mm), db.astype(mm)
    dxi = _input_grad(plan, da, w_gate, xi).astype(acc)
    dxi = dxi + _input_grad(plan, db, w_up, xi).astype(acc)
    dx = lax.dynamic_update_slice_in_dim(dx, dxi.astype(dx.dtype), start, 0)
    da, db = (jnp.where(fresh, v, jnp.zeros_like(v)) for v in (da, db))
    dw_gate, dw_up = dw_gate + wsum(xi, da), dw_up + wsum(xi, db)
    db_gate, db_up = db_gate + jnp.sum(da, 0, dtype=acc), db_up + jnp.sum(db, 0, dtype=acc)
    return dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down

  f, o = w_gate.shape[1], (w_down.shape[1] if plan.has_down else 0)
  # The buffers made from the step's arrays (barriers.zeros_from), not hoisted out of a scan.
  init = (
    barriers.zeros_from(x2),
    *(barriers.zeros_from(w, acc) for w in (w_gate, w_up)),
    barriers.zeros_from(w_down, acc) if plan.has_down else jnp.zeros((), acc),
    jnp.zeros((f,), acc),
    jnp.zeros((f,), acc),
    jnp.zeros((o,), acc),
  )
  dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down = lax.fori_loop(0, n, body, init)

  def bias(present, v, like):
    return v.astype(like.dtype) if present else None

  grads = (
    dx.reshape(x.shape),
    dw_gate.astype(w_gate.dtype),
    dw_up.astype(w_up.dtype),
    dw_down.astype(w_down.dtype) if plan.has_down else None,
    bias(plan.has_gate_bias, db_gate, x),
    bias(plan.has_up_bias, db_up, x),
    bias(plan.has_down_bias, db_down, x),
  )
  return shardings.retype(grads, plan.shardings)


def _down_weight_grad(plan: GatedPlan, h: Array, w_down: Array, gy: Array) -> Array:
  h = shardings.to_spec(h, plan.h_gather) if plan.h_gather is not None else h
  return _weight_grad(plan, h, w_down, gy, plan.out_sharding)


def _down_input_grad(plan: GatedPlan, gy: Array, w_down: Array, like: Array) -> Array:
  """gh, shaped, typed and split as `like` (a: h's shape, dtype and sharding)."""
  return _input_grad(plan, gy, w_down, like, plan.out_sharding)


def _projection_grads(plan: GatedPlan, x, w_gate, w_up, da, db, d_down, d_dynamic):
  """The cotangents of the primal arguments from da and db (in the backward matmul dtype)."""
  acc, hs = plan.acc_dtype, plan.hidden_sharding
  d_gate_bias = _bias_grad(plan, plan.has_gate_bias, da, x.dtype)
  d_up_bias = _bias_grad(plan, plan.has_up_bias, db, x.dtype)
  dw_gate = _weight_grad(plan, x, w_gate, da, hs)
  dw_up = _weight_grad(plan, x, w_up, db, hs)
  # Against x's own type where the forward gathered it: dx comes out split as x is.
  x_type = x if plan.x_gather is None else shardings.struct(x, plan.shardings[0])
  dx = _input_grad(plan, da, w_gate, x_type, hs).astype(acc)
  dx = dx + _input_grad(plan, db, w_up, x_type, hs).astype(acc)
  dw_down, d_down_bias = d_down
  grads = (dx.astype(x.dtype), dw_gate, dw_up, dw_down, d_gate_bias, d_up_bias, d_down_bias)
  return (*shardings.retype(grads, plan.shardings), *d_dynamic)


def _kernel_bwd(plan: GatedPlan, x, w_gate, w_up, w_down, a, b, g):
  """:func:`_gated_bwd` with da, db (and h) from the plan's one-pass kernel, which also recomputes
  h for the down projection's weight gradient after gh exists (gh does not need it)."""
  mm = _matmul_dtype(plan, x.dtype)

  def xla(gh, a, b):
    da, db, _ = gate_cotangents(plan, a, b, gh, ())
    return da.astype(mm), db.astype(mm), hidden(plan, a, b, ()) if plan.has_down else None

  d_down = None, None
  if plan.has_down:
    gy = g.astype(mm)
    gh = _down_input_grad(plan, gy, w_down, a)  # a: of h's shape and dtype (h comes after)
    da, db, h = kernels.backward(plan, gh, a, b, xla, with_h=True, grad_dtype=mm)
    d_down = (
      _down_weight_grad(plan, h, w_down, gy),
      _bias_grad(plan, plan.has_down_bias, gy, x.dtype),
    )
  else:
    da, db, _ = kernels.backward(plan, g, a, b, xla, with_h=False, grad_dtype=mm)
  return _projection_grads(plan, x, w_gate, w_up, da, db, d_down, [])


_gated.defvjp(_gated_fwd, _gated_bwd)
_gated_jit = jax.jit(_gated, static_argnums=0)


def gated(
  plan: GatedPlan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key=None, *dynamic
) -> Array:
  """The gated op by `plan` (the hidden dropped out with the raw `key` when ``plan.dropout``),
  differentiated by the rule above."""
  # A closure-converted callable is a new object on every call; jit would retrace each time.
  run = _gated_jit if plan.act.fn is None else _gated
  return run(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, key, *dynamic)
