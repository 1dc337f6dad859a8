"""Fused ``activation(x @ w + b)`` and ``activation(conv(x, w) + b)`` that keep only the output.

A layer written as ``jax.nn.relu(x @ w + b)`` leaves the backward pass to autodiff, which keeps the
pre-activation and, depending on what XLA fuses, more. The ops here are one ``custom_vjp`` each:
the forward is the matmul or convolution, the bias and the activation; the backward computes
``dz = g * act'(.)`` once, the bias gradient as a sum of ``dz`` and the input and kernel gradients
from the transposes of the same matmul or convolution. What is kept for the backward pass:

* ``"output"`` activations (relu, tanh, elu, ... with valid, concrete parameters): the output ``y``
  plus ``x`` and ``w``, which the transposes need anyway. ``y`` is the next layer's input, so a deep
  network keeps one activation-sized array per layer.
* ``"input"`` activations (gelu, silu, ... and output ones with traced or invalid parameters): the
  pre-activation ``z`` plus ``x`` and ``w``.
* ``"none"`` (identity): ``x`` and ``w`` only.
* any other callable: ``z``, ``x``, ``w`` and the arrays the callable closes over; its derivative
  comes from JAX's autodiff of the callable, re-run from ``z`` in the backward pass.

Half precision (float16/bfloat16) accumulates and evaluates the activation in float32 and returns,
and keeps, its own dtype. ``implementation`` picks the backend at one dispatch point
(:func:`_select_implementation`); this module is the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike, DTypeLike

from jaxact._src import activations, pallas_sharding, validation
from jaxact._src import pallas as kernel_dispatch
from jaxact._src.spec import ActivationSpec

Implementation = Literal["xla", "pallas", "mosaic"]
_IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas", "mosaic")

# ------------------------------------------------------------------------ activation resolution


@functools.cache
def _jaxact_functions() -> dict[Callable[..., Array], str]:
  """Every public jaxact activation function (aliases are the same object) to its spec name."""
  return {activations.get_activation(name): name for name in activations.ACTIVATIONS}


def _jaxact_name(f) -> str | None:
  """The spec name of `f` if it is a public jaxact activation function, else None."""
  try:
    return _jaxact_functions().get(f)
  except TypeError:  # unhashable callable objects are not jaxact functions
    return None


@dataclasses.dataclass(frozen=True)
class _Act:
  """Static (hashable) description of the activation of one fused call.

  Either ``rule`` (a spec-table activation; its array parameters travel as primal arguments) or
  ``fn``, a closure-converted callable whose hoisted arrays travel as primal arguments.
  """

  rule: Any = None  # activations._Rule
  fn: Callable[..., Any] | None = None

  @property
  def residual(self) -> str:
    return self.rule.residual if self.rule is not None else "input"


def _describe(activation) -> str:
  if isinstance(activation, functools.partial):
    return f"functools.partial({getattr(activation.func, '__name__', activation.func)!r}, ...)"
  return getattr(activation, "__name__", type(activation).__name__)


def _spec_and_values(
  fn_name: str, activation
) -> tuple[ActivationSpec, dict[str, Any]] | Callable[..., Any]:
  """The spec row and parameter values `activation` stands for, or a callable to autodiff.

  Names and jaxact functions give their spec row with default parameters; a ``functools.partial``
  of a jaxact function with keyword arguments only gives the row with those parameters. Anything
  else callable, and glu/softmax/log_softmax (not elementwise: their output shape or a whole-axis
  normalisation does not fit the one-``dz`` rule), is returned as a callable.
  """
  if isinstance(activation, str):
    try:
      func = activations.get_activation(activation)
    except ValueError as e:
      raise ValueError(f"jaxact.{fn_name}: {e}") from None
    keywords: dict[str, Any] = {}
  elif isinstance(activation, functools.partial) and _jaxact_name(activation.func) is not None:
    func, keywords = activation.func, dict(activation.keywords)
    if activation.args:  # partial(f, a)(z) is f(a, z): not a parametrised activation
      return activation
  elif callable(activation):
    if _jaxact_name(activation) is None:
      return activation
    func, keywords = activation, {}
  else:
    raise TypeError(
      f"jaxact.{fn_name}: `activation` must be an activation name (e.g. 'relu'), a jaxact "
      "activation function, a functools.partial of one with keyword parameters, or a callable; "
      f"got {type(activation).__name__} {activation!r}"
    )
  spec = activations.get_spec(_jaxact_name(func))
  if not spec.elementwise:
    return functools.partial(func, **keywords) if keywords else func
  known = {p.name: p.default for p in spec.params}
  unknown = sorted(set(keywords) - set(known))
  if unknown:
    accepted = ", ".join(known) or "none"
    raise TypeError(
      f"jaxact.{fn_name}: `activation` {_describe(activation)} sets {', '.join(unknown)}, which "
      f"jaxact.{spec.name} does not take; its parameters: {accepted}"
    )
  return spec, known | keywords


def _resolve_activation(fn_name: str, activation, z: jax.ShapeDtypeStruct, arg_dtype):
  """`activation` as a static :class:`_Act` and the arrays that go through the ``custom_vjp``.

  `z` is the pre-activation (shape, compute dtype); `arg_dtype` the dtype a plain callable is
  given. The residual decision is :func:`activations._split_params`'s: Python-number parameters
  are static, traced array parameters (whose gradient is then computed) and parameters for which
  the output does not determine the derivative make the pre-activation the residual.
  """
  resolved = _spec_and_values(fn_name, activation)
  if callable(resolved):
    try:
      fn, consts = jax.closure_convert(resolved, jax.ShapeDtypeStruct(z.shape, arg_dtype))
    except TypeError as e:
      raise TypeError(
        f"jaxact.{fn_name}: calling `activation` {_describe(resolved)} failed: {e}"
      ) from e
    return _Act(fn=fn), list(consts)
  spec, values = resolved
  for p in spec.params:
    v = values[p.name]
    if not p.static and validation.is_arraylike(v) and not isinstance(v, (int, float)):
      shape = np.shape(v)
      try:
        ok = np.broadcast_shapes(shape, z.shape) == z.shape
      except ValueError:
        ok = False
      if not ok:
        raise ValueError(
          f"jaxact.{fn_name}: activation parameter `{p.name}` of jaxact.{spec.name} has shape "
          f"{shape}, which does not broadcast to the pre-activation shape {z.shape}"
        )
  rule, dynamic = activations._split_params(spec, z, values)
  return _Act(rule=rule), dynamic


# ---------------------------------------------------------------------------- the linear ops


@dataclasses.dataclass(frozen=True)
class _Dense:
  precision: Any

  def __call__(self, x: Array, w: Array, acc_dtype) -> Array:
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(x, w, dims, self.precision, preferred_element_type=acc_dtype)

  def feature_axis(self, ndim: int) -> int:
    return ndim - 1


@dataclasses.dataclass(frozen=True)
class _Conv:
  window_strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  dimension_numbers: lax.ConvDimensionNumbers
  feature_group_count: int
  precision: Any

  def __call__(self, x: Array, w: Array, acc_dtype) -> Array:
    return lax.conv_general_dilated(
      x,
      w,
      self.window_strides,
      self.padding,
      self.lhs_dilation,
      self.rhs_dilation,
      self.dimension_numbers,
      self.feature_group_count,
      precision=self.precision,
      preferred_element_type=acc_dtype,
    )

  def feature_axis(self, ndim: int) -> int:
    return self.dimension_numbers.out_spec[1]


# ------------------------------------------------------------------------- the custom_vjp rule


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one fused call."""

  linear: _Dense | _Conv
  act: _Act
  acc_dtype: np.dtype  # accumulation and activation dtype
  out_dtype: np.dtype
  has_bias: bool
  # "xla"; "auto": the Pallas kernels when lowered for CUDA, XLA elsewhere; "pallas": the kernels
  # everywhere (interpret mode off CUDA). Only for calls the kernels support (see _src.pallas).
  implementation: str = "xla"
  # Which kernels "auto"/"pallas" run: "triton" (pallas_kernels.dense / bias_act, any CUDA GPU of
  # compute capability >= 8.0) or "mosaic" (pallas_kernels.hopper: the Mosaic GPU kernels for
  # Hopper; under "auto" with the backward HOPPER_BACKWARD names).
  kernels: str = "triton"
  # b's sharding when its type carries one (Explicit mesh axes): db, summed from dz, is sharded like
  # the output's features and must be resharded to match b (a replicated b with column-sharded w).
  bias_sharding: Any = None

  def bias_shape(self, ndim: int, features: int) -> tuple[int, ...]:
    shape = [1] * ndim
    shape[self.linear.feature_axis(ndim)] = features
    return tuple(shape)


def _forward_matmul_dtype(plan: _Plan, operands) -> np.dtype:
  """The result dtype of the forward matmul/convolution (accumulation is float32 either way).

  bfloat16 operands give a bfloat16 result, as XLA's GPU GEMMs write it: a float32 result would be
  one more activation-sized float32 array written and read back before the epilogue (measured on
  an H100: the forward 15% slower than jax.nn). bfloat16 has float32's range, so nothing the
  epilogue could bring back into range overflows. float16 keeps a float32 result: its range ends at
  65504, where a saturating activation of a larger pre-activation is still finite.
  """
  return np.dtype(operands) if np.dtype(operands) == jnp.bfloat16 else plan.acc_dtype


def _backward_matmul_dtype(plan: _Plan, operands) -> np.dtype:
  """The dtype of dz in the backward matmuls: the operands' dtype when it is 16-bit.

  dz = g * act'(.) is formed in the accumulation dtype and rounded to 16-bit operands before the
  dx and dw products (db sums the same rounded dz, in float32), which is what autodiff of
  ``act(x @ w + b)`` in 16-bit does and what the Pallas kernels do. A float32 dz would turn both
  products into float32 matmuls (measured on an H100: the backward 3x slower than jax.nn).
  """
  return np.dtype(operands) if np.dtype(operands).itemsize == 2 else plan.acc_dtype


def _preactivation(plan: _Plan, x: Array, w: Array, b: Array | None) -> Array:
  z = plan.linear(x, w, _forward_matmul_dtype(plan, x.dtype)).astype(plan.acc_dtype)
  if b is not None:
    z = z + b.astype(plan.acc_dtype).reshape(plan.bias_shape(z.ndim, b.shape[0]))
  return z


def _xla_forward(plan: _Plan, x: Array, w: Array, b: Array | None, *dynamic: Array):
  """``(y, z)``, z in the output dtype and only where the backward reads it (input residuals)."""
  z = _preactivation(plan, x, w, b)
  act = plan.act
  if act.fn is not None:
    z = z.astype(plan.out_dtype)  # a plain callable sees what `act(x @ w + b)` would give it
    y = act.fn(z, *dynamic)
  else:
    spec, params = act.rule.spec, act.rule.params(dynamic)
    y = spec.fn(z, **params).astype(plan.out_dtype)
  return y, (z.astype(plan.out_dtype) if act.residual == "input" else None)


def _fused_fwd(plan: _Plan, x: Array, w: Array, b: Array | None, *dynamic: Array):
  act = plan.act
  if plan.implementation == "xla":
    y, z = _xla_forward(plan, x, w, b, *dynamic)
  else:  # only calls without array parameters get here: `dynamic` is empty
    y, z = kernel_dispatch.forward(
      plan,
      plan.implementation,
      x,
      w,
      b,
      functools.partial(_xla_forward, plan),
      lambda x, w: plan.linear(x, w, _forward_matmul_dtype(plan, x.dtype)),
    )
  # The barrier hides the residual's origin from XLA (see activations.barrier_residual): without it
  # XLA recomputes y from z in the backward pass (keeping z alive as well) or shares the backward's
  # intermediates with the forward's, and the saving this rule exists for is lost.
  y, kept = activations.barrier_residual(act.residual, y, z)
  return y, (x, w, kept, dynamic)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan: _Plan, x: Array, w: Array, b: Array | None, *dynamic: Array):
  return _fused_fwd(plan, x, w, b, *dynamic)[0]


def _batch_chunks(plan: _Plan, x: Array, dz: Array) -> int:
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


def _kernel_grad(plan: _Plan, x: Array, w: Array, dz: Array) -> Array:
  """The kernel gradient: the transpose, in w, of the matmul or convolution of x, at dz."""

  def transpose(x, dz):
    (dw,) = jax.linear_transpose(lambda w_: plan.linear(x, w_, dz.dtype), w)(dz)
    return dw

  # Without the barrier XLA (on CPU) copies each layer's input to the layout of its kernel-gradient
  # convolution as soon as the input exists, in the forward pass, and keeps the copy next to it
  # until the backward pass (2L buffers instead of L). Tying x to dz keeps the copy in the backward.
  x, dz = lax.optimization_barrier((x, dz))
  chunks = 1
  # Under Explicit mesh axes the sharding is in the types, which cannot express a strided slice of
  # a sharded batch: there the kernel gradient stays one convolution (each device's is local).
  if isinstance(plan.linear, _Conv) and not any(pallas_sharding.spec_of(x)):
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


def _fused_bwd(plan: _Plan, res, g):
  dx, dw, db, *rest = _fused_bwd_unsharded(plan, res, g)
  if db is not None and plan.bias_sharding is not None:
    db = jax.sharding.reshard(db, plan.bias_sharding)
  return (dx, dw, db, *rest)


def _fused_bwd_unsharded(plan: _Plan, res, g):
  # None's Hopper path takes XLA's backward: cuBLAS's wgmma matmuls around one dz fusion measured
  # fastest there (see _src.pallas.HOPPER_BACKWARD); "mosaic" runs the Mosaic GPU backward kernels.
  hopper_xla = plan.kernels == "mosaic" and plan.implementation == "auto"
  if plan.implementation == "xla" or (hopper_xla and kernel_dispatch.HOPPER_BACKWARD == "xla"):
    return _xla_bwd(plan, res, g)
  x, w, kept, _ = res

  def xla(x, w, kept, g):
    return _xla_bwd(plan, (x, w, kept, ()), g)

  return kernel_dispatch.backward(
    plan,
    plan.implementation,
    x,
    w,
    kept,
    g,
    xla,
    functools.partial(_transposes, plan),
    _backward_matmul_dtype(plan, x.dtype),
  )


def _xla_bwd(plan: _Plan, res, g):
  x, w, kept, dynamic = res
  act, acc = plan.act, plan.acc_dtype
  d_dynamic: Sequence[Any]
  if act.fn is not None:
    _, pull = jax.vjp(act.fn, kept, *dynamic)
    dz, *d_dynamic = pull(g)
    dz = dz.astype(acc)
  else:
    dz, d_dynamic = activations.rule_cotangents(act.rule, kept, g, dynamic, acc)
  # In 16-bit, db sums the rounded dz that the products use (as autodiff does): then dz is one
  # 16-bit array, where a float32 dz read by the bias reduction would be one more, twice the size
  # (measured on an H100: 256 MiB of step temp against jax.nn's 96 for an 8192 x 4096 layer).
  dz = dz.astype(_backward_matmul_dtype(plan, x.dtype))
  if act.residual == "input" and dz.dtype != acc:
    # With an expensive derivative (gelu's tanh, silu's exp), XLA:GPU will not repeat it in two
    # consumers, so it wrote float32 dz once for the rounding and the bias sum to read: 128 MiB
    # for an 8192 x 4096 layer (step temp 192 MiB against jax.nn's 96, H100, 2026-11-22). The
    # barrier makes the 16-bit dz the one array both the sum and the matmuls read.
    dz = lax.optimization_barrier(dz)
  db = None
  if plan.has_bias:
    feature = plan.linear.feature_axis(dz.ndim)
    db = jnp.sum(dz, tuple(a for a in range(dz.ndim) if a != feature), dtype=acc).astype(x.dtype)
  dx, dw = _transposes(plan, x, w, dz)
  return (dx, dw, db, *d_dynamic)


def _transposes(plan: _Plan, x: Array, w: Array, dz: Array) -> tuple[Array, Array]:
  """``(dx, dw)`` from dz (in the backward matmul dtype): the linear op's two transposes."""
  dw = _kernel_grad(plan, x, w, dz)
  # dx waits for the kernel gradient, whose operand copies would otherwise be alive next to it.
  dz, w, _ = lax.optimization_barrier((dz, w, dw))
  (dx,) = jax.linear_transpose(lambda x_: plan.linear(x_, w, dz.dtype), x)(dz)
  return dx, dw


_fused.defvjp(_fused_fwd, _fused_bwd)
_fused_jit = jax.jit(_fused, static_argnums=0)


# --------------------------------------------------------------------------- argument checks


def _select_implementation(fn_name: str, implementation) -> str:
  """The one dispatch point: which backend runs this call ("auto" for None; see `_run`)."""
  if implementation is None:
    return "auto"
  if not isinstance(implementation, str) or implementation not in _IMPLEMENTATIONS:
    raise ValueError(
      f"jaxact.{fn_name}: `implementation` {implementation!r} is not known; choose one of: "
      f"None (best available), {', '.join(repr(i) for i in _IMPLEMENTATIONS)}"
    )
  return implementation


def _as_float_array(fn_name: str, v, arg: str) -> Array:
  v = validation.as_real_array(fn_name, v, arg)
  if not validation.is_floating(v.dtype):
    raise TypeError(
      f"jaxact.{fn_name}: `{arg}` has dtype {v.dtype}; accepted: floating-point dtypes "
      "(float16, bfloat16, float32, float64)"
    )
  return v


def _prepare(fn_name, x, w, b, preferred_element_type):
  """Arrays of one common float dtype (as ``x @ w + b`` promotes), accumulation and out dtypes."""
  x = _as_float_array(fn_name, x, "x")
  w = _as_float_array(fn_name, w, "w")
  if b is not None:
    b = _as_float_array(fn_name, b, "b")
  dtype = jnp.result_type(*(v for v in (x, w, b) if v is not None))
  # Convert only what differs: outside jit, astype to the same dtype still makes a new array, and
  # jax.vjp's pullback would then hold that copy of x next to the caller's x.
  x, w = (v if v.dtype == dtype else v.astype(dtype) for v in (x, w))
  if b is not None and b.dtype != dtype:
    b = b.astype(dtype)
  out_dtype = dtype
  if preferred_element_type is not None:
    try:
      out_dtype = jax.dtypes.canonicalize_dtype(np.dtype(preferred_element_type))
    except TypeError:
      out_dtype = None
    if out_dtype is None or not validation.is_floating(out_dtype):
      raise TypeError(
        f"jaxact.{fn_name}: `preferred_element_type` {preferred_element_type!r} is not a "
        "floating-point dtype; accepted: None (the inputs' dtype), float16, bfloat16, float32, "
        "float64"
      )
  acc_dtype = jnp.promote_types(
    validation.compute_dtype(dtype), validation.compute_dtype(out_dtype)
  )
  return x, w, b, np.dtype(acc_dtype), np.dtype(out_dtype)


def _check_bias(fn_name: str, b: Array | None, features: int, w: Array) -> None:
  if b is not None and b.shape != (features,):
    raise ValueError(
      f"jaxact.{fn_name}: `b` has shape {b.shape} but the output has {features} features "
      f"(w.shape={w.shape}); accepted: shape ({features},) or None"
    )


def _run(fn_name, linear, x, w, b, activation, acc_dtype, out_dtype, implementation="xla"):
  z = jax.eval_shape(functools.partial(linear, acc_dtype=acc_dtype), x, w)
  act, dynamic = _resolve_activation(fn_name, activation, z, out_dtype)
  plan = _Plan(linear, act, acc_dtype, out_dtype, b is not None)
  if b is not None and pallas_sharding.typed_sharding(b) is not None:
    plan = dataclasses.replace(plan, bias_sharding=pallas_sharding.typed_sharding(b))
  if implementation != "xla":
    plan = _kernel_plan(fn_name, plan, isinstance(linear, _Dense), x, w, implementation)
  # A closure-converted callable is a new object on every call; jit would retrace each time.
  run = _fused_jit if act.fn is None else _fused
  return run(plan, x, w, b, *dynamic)


def _kernel_plan(fn_name, plan: _Plan, dense: bool, x, w, implementation: str) -> _Plan:
  """The kernels' half of the dispatch: "pallas"/"mosaic" raise for what their kernels do not
  support; None ("auto") picks the Hopper kernels on Hopper targets where they apply, the Triton
  kernels on other CUDA GPUs (compute capability >= 8.0), and XLA otherwise, silently."""
  if implementation == "mosaic":
    why = kernel_dispatch.hopper_unsupported(plan, dense, x, w, backward=True)
    if why is not None:
      raise NotImplementedError(
        f"jaxact.{fn_name}: implementation='mosaic' does not support this call: {why}; use "
        "implementation='xla' or None"
      )
    return dataclasses.replace(plan, implementation="pallas", kernels="mosaic")
  if (
    implementation == "auto"
    and kernel_dispatch.targets_hopper()
    and kernel_dispatch.hopper_unsupported(plan, dense, x, w) is None
  ):
    return dataclasses.replace(plan, implementation="auto", kernels="mosaic")
  why = kernel_dispatch.unsupported(plan, dense, x, w)
  if why is not None and implementation == "pallas":
    raise NotImplementedError(
      f"jaxact.{fn_name}: implementation='pallas' does not support this call: {why}; use "
      "implementation='xla' or None"
    )
  if implementation == "auto" and why is None:
    why = kernel_dispatch.auto_prefers_xla(dense)
  if why is None and (implementation == "pallas" or kernel_dispatch.cuda_capable()):
    return dataclasses.replace(plan, implementation=implementation)
  return plan


def _hashable_precision(precision):
  # The precision is part of the jit-static plan; lax accepts a list of two as well as a tuple.
  return tuple(precision) if isinstance(precision, list) else precision


def _dense(fn_name, x, w, b, activation, precision, acc_dtype, out_dtype, impl="xla") -> Array:
  if x.ndim < 1 or w.ndim != 2:
    raise ValueError(
      f"jaxact.{fn_name}: `x` must have rank >= 1 and `w` rank 2 (in, out); got "
      f"x.shape={x.shape}, w.shape={w.shape}"
    )
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
      f"jaxact.{fn_name}: `x` has {x.shape[-1]} features but `w` expects {w.shape[0]} "
      f"(x.shape={x.shape}, w.shape={w.shape})"
    )
  _check_bias(fn_name, b, w.shape[1], w)
  linear = _Dense(_hashable_precision(precision))
  return _run(fn_name, linear, x, w, b, activation, acc_dtype, out_dtype, impl)


# ------------------------------------------------------------------------- public functions


def dense_bias_act(
  x: ArrayLike,
  w: ArrayLike,
  b: ArrayLike | None = None,
  *,
  activation: str | Callable[..., Array],
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  implementation: Implementation | None = None,
) -> Array:
  r"""Dense layer with bias and activation, keeping only the output for the backward pass.

  Computes

  .. math::
    y = \mathrm{activation}(x W + b)

  as one op whose gradient rule computes :math:`\bar z = \bar y \odot \mathrm{act}'` once, then
  :math:`\bar b = \sum \bar z` over every axis but the last, :math:`\bar x = \bar z W^\top` and
  :math:`\bar W = x^\top \bar z`.

  Saved residual: the output ``y`` (plus ``x`` and ``w``, which :math:`\bar W` and :math:`\bar x`
  need anyway) for activations whose derivative the output determines (relu, tanh, sigmoid, elu,
  softplus, ...); the pre-activation :math:`z = xW + b` instead for the others (gelu, silu, mish,
  ...) and for output ones whose parameters are traced or make the output insufficient (e.g.
  ``leaky_relu`` with a slope <= 0); nothing beyond ``x`` and ``w`` for identity. Derivatives at
  kinks follow the jaxact activation's convention (see its docstring).

  ``activation`` is a name (``"relu"``), a jaxact function (``jaxact.elu``), or a
  ``functools.partial`` of one with keyword parameters (``partial(jaxact.leaky_relu,
  negative_slope=0.2)``); jaxact's own derivative rule is used. Any other callable (``jax.nn.relu``,
  a lambda, and glu/softmax/log_softmax, which are not elementwise) is applied to the
  pre-activation in the output dtype; the pre-activation is then kept and the callable's gradient
  comes from JAX's autodiff of it, re-run in the backward pass.

  Inputs of different dtypes are promoted as ``x @ w + b`` promotes them. Half precision
  (float16/bfloat16) accumulates in float32, applies the activation in float32 and returns (and
  keeps) its own dtype.

  Args:
    x: input of shape ``(..., in)``, floating point.
    w: kernel of shape ``(in, out)``.
    b: bias of shape ``(out,)``, or None for no bias.
    activation: the activation (see above).
    precision: passed to :func:`jax.lax.dot_general` in the forward and backward passes.
    preferred_element_type: dtype of the result; accumulation is at least float32 and at least
      this wide. Default: the (promoted) input dtype.
    implementation: ``None`` (the best available: when lowered for a Hopper GPU, the Mosaic GPU
      forward kernel with XLA's backward for the calls it supports; on other CUDA GPUs the Triton
      kernels for the calls they support; XLA otherwise), ``"xla"``, ``"pallas"`` (the Triton
      kernels) or ``"mosaic"`` (the Hopper kernels, forward and backward: bfloat16/float16, ``M``
      a multiple of 128, ``N`` of 256, ``K`` of 64). Kernels run in interpret mode off CUDA;
      calls they do not support raise ``NotImplementedError``.

  Returns:
    ``activation(x @ w + b)``, of shape ``(..., out)``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.array([[1.0, -2.0], [0.5, 1.0]])
    >>> w = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    >>> jaxact.dense_bias_act(x, w, jnp.array([0.5, 0.0]), activation="relu").tolist()
    [[0.0, 0.0], [2.0, 1.0]]
  """
  fn_name = "dense_bias_act"
  with jax.named_scope(f"jaxact.{fn_name}"):
    impl = _select_implementation(fn_name, implementation)
    x, w, b, acc, out = _prepare(fn_name, x, w, b, preferred_element_type)
    return _dense(fn_name, x, w, b, activation, precision, acc, out, impl)


def _channels_last(ndim: int) -> lax.ConvDimensionNumbers:
  """Flax's layout for any number of spatial dims: NWC/WIO, NHWC/HWIO, NDHWC/DHWIO, ..."""
  spatial = tuple(range(1, ndim - 1))
  return lax.ConvDimensionNumbers(
    lhs_spec=(0, ndim - 1, *spatial),
    rhs_spec=(ndim - 1, ndim - 2, *range(ndim - 2)),
    out_spec=(0, ndim - 1, *spatial),
  )


def _int_tuple(fn_name: str, arg: str, value, n: int) -> tuple[int, ...]:
  values = (value,) * n if isinstance(value, (int, np.integer)) else value
  try:
    values = tuple(values)
  except TypeError:
    values = None
  if (
    values is None
    or len(values) != n
    or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in values)
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `{arg}` must be a positive int or a sequence of {n} positive ints (one "
      f"per spatial dimension); got {value!r}"
    )
  return tuple(int(v) for v in values)


def _padding(fn_name: str, padding, spatial, kernel, strides, lhs_dil, rhs_dil):
  """`padding` as one (low, high) pair per spatial dimension, strings resolved as lax does."""
  n = len(spatial)
  accepted = (
    f'"SAME", "SAME_LOWER", "VALID", an int, a sequence of {n} ints or of {n} (low, high) pairs'
  )
  if isinstance(padding, str):
    kind = padding.upper()
    if kind not in ("SAME", "SAME_LOWER", "VALID"):
      raise ValueError(
        f"jaxact.{fn_name}: `padding` {padding!r} is not known; accepted: {accepted}"
      )
    if kind == "VALID":
      return ((0, 0),) * n
    if lhs_dil != (1,) * n:
      # lax.conv_general_dilated refuses this too: which size should SAME preserve?
      raise ValueError(
        f"jaxact.{fn_name}: `padding` {padding!r} with lhs_dilation={lhs_dil} is ambiguous; give "
        "explicit (low, high) pairs"
      )
    dilated = [(k - 1) * r + 1 for k, r in zip(kernel, rhs_dil, strict=True)]
    return tuple(tuple(map(int, p)) for p in lax.padtype_to_pads(spatial, dilated, strides, kind))

  def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

  if is_int(padding):
    return ((int(padding), int(padding)),) * n
  try:
    pads = tuple(padding)
    if len(pads) == n and all(is_int(p) for p in pads):
      return tuple((int(p), int(p)) for p in pads)
    pairs = tuple(tuple(p) for p in pads)
    if len(pairs) == n and all(len(p) == 2 and all(map(is_int, p)) for p in pairs):
      return tuple((int(lo), int(hi)) for lo, hi in pairs)
  except TypeError:
    pass
  raise ValueError(f"jaxact.{fn_name}: `padding` must be {accepted}; got {padding!r}")


def conv_bias_act(
  x: ArrayLike,
  w: ArrayLike,
  b: ArrayLike | None = None,
  *,
  activation: str | Callable[..., Array],
  window_strides: int | Sequence[int] = 1,
  padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = "SAME",
  lhs_dilation: int | Sequence[int] = 1,
  rhs_dilation: int | Sequence[int] = 1,
  feature_group_count: int = 1,
  dimension_numbers: lax.ConvGeneralDilatedDimensionNumbers | None = None,
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  implementation: Implementation | None = None,
) -> Array:
  r"""Convolution with bias and activation, keeping only the output for the backward pass.

  Computes

  .. math::
    y = \mathrm{activation}(\mathrm{conv}(x, W) + b)

  with :func:`jax.lax.conv_general_dilated`'s meaning for every argument, as one op whose gradient
  rule computes :math:`\bar z = \bar y \odot \mathrm{act}'` once, :math:`\bar b` as the sum of
  :math:`\bar z` over every axis but the output-feature one, and :math:`\bar x`, :math:`\bar W` from
  the transposes of the convolution. A 1x1 kernel with unit strides, no input dilation, one
  feature group and no padding takes :func:`dense_bias_act`'s path (a matmul).

  Saved residual, ``activation``, dtypes: as :func:`dense_bias_act` (the output ``y`` plus ``x``
  and ``w`` for output-residual activations; the pre-activation for the others).

  Args:
    x: input, channels-last by default: ``(N, W, C)``, ``(N, H, W, C)``, ``(N, D, H, W, C)``.
    w: kernel, by default ``(W, C // feature_group_count, O)``, ``(H, W, ..., O)``, ...
    b: bias of shape ``(O,)``, or None for no bias.
    activation: a name, a jaxact function, a ``functools.partial`` of one, or a callable.
    window_strides: an int or one int per spatial dimension.
    padding: ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``, an int (the same on both sides of every
      spatial dimension), one int per spatial dimension, or one ``(low, high)`` pair per spatial
      dimension.
    lhs_dilation: input dilation, an int or one per spatial dimension.
    rhs_dilation: kernel dilation, an int or one per spatial dimension.
    feature_group_count: number of feature groups (``C`` and ``O`` must be multiples of it).
    dimension_numbers: as :func:`jax.lax.conv_general_dilated`; default: Flax's channels-last
      layouts (NWC/WIO, NHWC/HWIO, NDHWC/DHWIO). The bias is added along the output's feature dim.
    precision: passed to the convolution in the forward and backward passes.
    preferred_element_type: dtype of the result; accumulation is at least float32.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"mosaic"``: with the Pallas kernels,
      the convolution and its transposes stay with XLA and the bias + activation epilogue and its
      backward (dz and db in one pass) are kernels; channels-last outputs only. ``"mosaic"`` (the
      Hopper dense kernels) applies to 1x1 unit-stride convolutions only, which are dense layers.

  Returns:
    ``activation(conv(x, w) + b)``.

  Examples:
    >>> import jax.numpy as jnp, jaxact
    >>> x = jnp.arange(4.0).reshape(1, 4, 1)  # (N, W, C)
    >>> w = jnp.array([1.0, -1.0]).reshape(2, 1, 1)  # (W, C, O)
    >>> y = jaxact.conv_bias_act(x, w, jnp.array([0.5]), activation="relu", padding="VALID")
    >>> y[0, :, 0].tolist()
    [0.0, 0.0, 0.0]
    >>> y = jaxact.conv_bias_act(x, -w, jnp.array([0.5]), activation="relu", padding="VALID")
    >>> y[0, :, 0].tolist()
    [1.5, 1.5, 1.5]
  """
  fn_name = "conv_bias_act"
  with jax.named_scope(f"jaxact.{fn_name}"):
    impl = _select_implementation(fn_name, implementation)
    x, w, b, acc, out = _prepare(fn_name, x, w, b, preferred_element_type)
    if x.ndim != w.ndim or x.ndim < 3:
      raise ValueError(
        f"jaxact.{fn_name}: `x` and `w` must have the same rank, at least 3 (batch, spatial..., "
        f"features); got x.shape={x.shape} (rank {x.ndim}), w.shape={w.shape} (rank {w.ndim})"
      )
    n = x.ndim - 2
    if dimension_numbers is None:
      dn = _channels_last(x.ndim)
    else:
      try:
        dn = lax.conv_dimension_numbers(x.shape, w.shape, dimension_numbers)
      except (TypeError, ValueError) as e:
        raise ValueError(
          f"jaxact.{fn_name}: `dimension_numbers` {dimension_numbers!r} does not fit "
          f"x.shape={x.shape}, w.shape={w.shape}: {e}"
        ) from None
    strides = _int_tuple(fn_name, "window_strides", window_strides, n)
    lhs_dil = _int_tuple(fn_name, "lhs_dilation", lhs_dilation, n)
    rhs_dil = _int_tuple(fn_name, "rhs_dilation", rhs_dilation, n)
    spatial = tuple(x.shape[d] for d in dn.lhs_spec[2:])
    kernel = tuple(w.shape[d] for d in dn.rhs_spec[2:])
    pads = _padding(fn_name, padding, spatial, kernel, strides, lhs_dil, rhs_dil)
    groups = feature_group_count
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
      raise ValueError(
        f"jaxact.{fn_name}: `feature_group_count` must be a positive int; got {groups!r}"
      )
    groups = int(groups)
    c_in, w_in, w_out = x.shape[dn.lhs_spec[1]], w.shape[dn.rhs_spec[1]], w.shape[dn.rhs_spec[0]]
    if c_in != w_in * groups:
      raise ValueError(
        f"jaxact.{fn_name}: `x` has {c_in} features but `w` expects {w_in * groups} "
        f"({w_in} per group x feature_group_count={groups}) (x.shape={x.shape}, w.shape={w.shape})"
      )
    if w_out % groups:
      raise ValueError(
        f"jaxact.{fn_name}: `w` has {w_out} output features, which feature_group_count={groups} "
        f"does not divide (w.shape={w.shape})"
      )
    _check_bias(fn_name, b, w_out, w)
    if (
      dn == _channels_last(x.ndim)
      and kernel == (1,) * n
      and pads == ((0, 0),) * n
      and strides == (1,) * n
      and lhs_dil == (1,) * n
      and groups == 1
    ):
      # A 1x1 kernel is a matmul over the channels; rhs_dilation of a size-1 window is a no-op.
      w2 = w.reshape(w.shape[-2], w.shape[-1])
      return _dense(fn_name, x, w2, b, activation, precision, acc, out, impl)
    linear = _Conv(strides, pads, lhs_dil, rhs_dil, dn, groups, _hashable_precision(precision))
    return _run(fn_name, linear, x, w, b, activation, acc, out, impl)
