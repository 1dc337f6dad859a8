"""Activations as ``jax.custom_vjp`` functions that keep their output (or input) for backward.

The public functions are generated from the spec table (``spec.py``): one rule serves every
elementwise activation, and glu / softmax / log_softmax have rules of their own at the bottom.

Residual policy (decided at trace time, per call):

* ``"output"``: the spec's ``d_output`` is valid for these parameters, so only ``y`` is kept. The
  output is the array the next layer reads anyway, so the backward pass adds nothing to memory.
* ``"input"``: only ``x`` is kept; input-residual activations, and output-residual ones whose
  parameters are traced (their gradient is then also computed) or make ``d_output`` invalid.
* ``"none"``: identity keeps nothing.

Half precision (float16/bfloat16) is computed in float32 and returned, and kept, in its own dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from jaxact._src import validation
from jaxact._src.spec import (
  ALIASES,
  SPEC_BY_NAME,
  SPECS,
  ActivationSpec,
  Param,
  Residual,
  _sigmoid,
  _sigmoid_pair,
)

# jax.nn's own functions, bound now: integer and boolean inputs are handed to them, and a program
# may install jaxact's functions into jax.nn (to swap the activations of third-party model code),
# after which looking them up in jax.nn at call time would call jaxact again, forever.
_JAX_NN: dict[str, Callable[..., Array]] = {
  s.name: getattr(jax.nn, s.name) for s in SPECS if s.jax_nn
}

# ------------------------------------------------------------------ the elementwise custom_vjp rule


@dataclasses.dataclass(frozen=True)
class _Rule:
  """Static (hashable) description of one elementwise call: which spec, which residual, params."""

  name: str
  residual: Residual
  static_params: tuple[tuple[str, Any], ...]  # Python numbers/bools, baked into the trace
  dynamic_names: tuple[str, ...]  # array parameters, passed as primal arguments

  @property
  def spec(self) -> ActivationSpec:
    return SPEC_BY_NAME[self.name]

  def params(self, dynamic) -> dict[str, Any]:
    return dict(self.static_params) | dict(zip(self.dynamic_names, dynamic, strict=True))


def _forward(rule: _Rule, x: Array, dynamic) -> Array:
  cdt = validation.compute_dtype(x.dtype)
  return rule.spec.fn(x.astype(cdt), **rule.params(dynamic)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _elementwise(rule: _Rule, x: Array, *dynamic: Array) -> Array:
  return _forward(rule, x, dynamic)


def barrier_residual(residual: Residual, y: Array, x: Array) -> tuple[Array, Array | None]:
  """``(y, kept)``: the output and the residual the backward reads, behind one barrier.

  Shared by every op built on a rule (the elementwise op here and the fused layers).
  """
  if residual == "none":
    return y, None
  # The barrier hides the residual's origin from XLA. Without it XLA (a) fuses a cheap forward
  # formula into the backward's consumers, recomputing y from x and so keeping x alive too, and
  # (b) CSEs the backward's intermediates (exp, sigmoid of x) with the forward's, keeping those
  # alive as extra activation-sized buffers. Either way the saving this rule exists for is lost.
  # y goes through the barrier with the residual: the residual must be the very array returned
  # (a second buffer would double what the pullback holds), and an unbarriered forward lets XLA's
  # CPU reduction fusions pull the formula in and materialise its broadcast constants.
  if residual == "output":
    y = jax.lax.optimization_barrier(y)
    return y, y
  return jax.lax.optimization_barrier((y, x))


def _elementwise_fwd(rule: _Rule, x: Array, *dynamic: Array):
  y, kept = barrier_residual(rule.residual, _forward(rule, x, dynamic), x)
  return y, (kept, dynamic)


def _after_cotangent(kept, g):
  """Tie the residual to the incoming cotangent, so no part of the derivative runs before it.

  Otherwise XLA's scheduler may compute the g-independent part of the derivative (say exp(x) in
  mish') as soon as the residual exists, in the forward pass, and keep it alive until the backward
  pass: extra activation-sized buffers per layer.
  """
  return jax.lax.optimization_barrier((kept, g))[0], g


def rule_cotangents(
  rule: _Rule, kept: Array | None, g: Array, dynamic, compute_dtype
) -> tuple[Array, list]:
  """``g * f'(x)`` from the kept residual, and the array parameters' cotangents (None if zero).

  `kept` and `g` come in their storage dtype and are converted to `compute_dtype` only after the
  barrier that ties them together: a barrier on the converted arrays makes XLA materialize them,
  two activation-sized float32 arrays per 16-bit layer (measured on an H100: 2 GiB of temp for a
  2**28-element bfloat16 activation, 256 MiB for an 8192 x 4096 fused layer). Shared by every op
  built on a rule (this module's elementwise op and the fused layers), so the backward formula
  exists once.
  """
  if rule.residual == "none":
    return g.astype(compute_dtype), [None] * len(dynamic)
  kept, g = _after_cotangent(kept, g)
  kept, g = kept.astype(compute_dtype), g.astype(compute_dtype)
  spec, params = rule.spec, rule.params(dynamic)
  if rule.residual == "output":
    # Output mode is chosen only for concrete parameters, which have no cotangent consumer.
    return g * spec.d_output(kept, **params), [None] * len(dynamic)
  dx = g * spec.derivative_from_input(kept, **params)
  if not dynamic:
    return dx, []

  # Parameter gradients (traced alpha, slope, b) come from autodiff of the forward formula.
  def fn_of_params(*p):
    return spec.fn(kept, **rule.params(p))

  return dx, list(jax.vjp(fn_of_params, *dynamic)[1](g))


def _elementwise_bwd(rule: _Rule, res, g: Array):
  kept, dynamic = res
  dx, d_dynamic = rule_cotangents(rule, kept, g, dynamic, validation.compute_dtype(g.dtype))
  return (dx.astype(g.dtype), *d_dynamic)


_elementwise.defvjp(_elementwise_fwd, _elementwise_bwd)
_elementwise_jit = jax.jit(_elementwise, static_argnums=0)


def _split_params(spec: ActivationSpec, x: Array, values: dict[str, Any]):
  """Sort parameters into static Python values and array values; validate; pick the residual."""
  static, dynamic, names = [], [], []
  traced = False
  cdt = validation.compute_dtype(x.dtype)
  for p in spec.params:
    v = values[p.name]
    if not p.static:
      if not validation.is_arraylike(v) or isinstance(v, (bool, np.bool_)):
        raise TypeError(
          f"jaxact.{spec.name}: `{p.name}` must be a real number or array, got "
          f"{type(v).__name__} {v!r}"
        )
      dtype = np.result_type(v) if not isinstance(v, jax.Array) else v.dtype
      if not (validation.is_floating(dtype) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"jaxact.{spec.name}: `{p.name}` must be real-valued, got dtype {dtype}")
    if p.static and isinstance(v, jax.core.Tracer):
      # jax.nn raises TracerBoolConversionError here; say which argument and what to do.
      raise jax.errors.ConcretizationTypeError(
        v,
        f"jaxact.{spec.name}: `{p.name}` selects the formula when the function is traced, so it "
        "must be a concrete value, not a traced array: pass a Python bool, or mark the argument "
        "static (jax.jit(..., static_argnames=...)).",
      )
    if p.check is not None and not isinstance(v, jax.core.Tracer):
      msg = p.check(v)
      if msg is not None:
        raise (TypeError if p.static else ValueError)(
          f"jaxact.{spec.name}: `{p.name}` {msg}; got {v!r}"
        )
    if p.static or isinstance(v, (int, float)):
      static.append((p.name, p.convert(v) if p.convert is not None else v))
      continue
    arr = jnp.asarray(v)
    validation.check_broadcasts_to(spec.name, p.name, arr.shape, x.shape)
    traced |= isinstance(v, jax.core.Tracer)
    names.append(p.name)
    dynamic.append(arr.astype(cdt))
  residual = spec.residual
  if residual == "output":
    if traced:
      residual = "input"
    elif spec.output_ok is not None:
      concrete = {p.name: values[p.name] for p in spec.params}
      if not spec.output_ok(**concrete):
        residual = "input"
  return _Rule(spec.name, residual, tuple(static), tuple(names)), dynamic


def _apply_elementwise(spec: ActivationSpec, x: ArrayLike, values: dict[str, Any]) -> Array:
  x = validation.as_real_array(spec.name, x)
  if not validation.is_floating(x.dtype):
    if spec.jax_nn:  # integer and bool inputs behave exactly as jax.nn's (some cast, some raise)
      return _JAX_NN[spec.name](x, **values)
    x = x.astype(jnp.result_type(float))
  # Array parameters promote as in jax.nn's formulas: a bfloat16 x with a float32 `alpha` array
  # gives float32 (Python numbers are weakly typed and leave x's dtype alone).
  arrays = [values[p.name] for p in spec.params if not p.static]
  dtype = jnp.result_type(x, *(v for v in arrays if validation.is_arraylike(v)))
  if dtype != x.dtype and validation.is_floating(dtype):
    x = x.astype(dtype)
  rule, dynamic = _split_params(spec, x, values)
  with jax.named_scope(f"jaxact.{spec.name}"):
    return _elementwise_jit(rule, x, *dynamic)


# ------------------------------------------------------------------------------ glu, softmaxes


# The custom_vjp functions below call plain `_impl` functions from their fwd rules, never
# themselves: under forward-over-reverse (jax.hessian) the fwd rule is differentiated by jvp,
# which a nested custom_vjp call would refuse.


def _glu_impl(axis: int, x: Array) -> Array:
  cdt = validation.compute_dtype(x.dtype)
  a, b = jnp.split(x.astype(cdt), 2, axis)
  return (a * _sigmoid(b)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _glu(axis: int, x: Array) -> Array:
  return _glu_impl(axis, x)


def _glu_fwd(axis, x):
  y, x = jax.lax.optimization_barrier((_glu_impl(axis, x), x))  # see _elementwise_fwd
  return y, x


def _glu_bwd(axis, x, g):
  x, g = _after_cotangent(x, g)
  cdt = validation.compute_dtype(x.dtype)
  a, b = jnp.split(x.astype(cdt), 2, axis)
  g32 = g.astype(cdt)
  s, s_neg = _sigmoid_pair(b)
  da = g32 * s
  db = g32 * a * s * s_neg
  return (jnp.concatenate([da, db], axis).astype(x.dtype),)


_glu.defvjp(_glu_fwd, _glu_bwd)
_glu_jit = jax.jit(_glu, static_argnums=0)


def _shifted(x: Array, axes: tuple[int, ...], where: Array | None) -> Array:
  """x minus its max over `axes`, with rows that have no finite max handled without NaN.

  All -inf (or all masked) rows stay -inf everywhere, so they sum to 0. Rows containing +inf put 0
  at the +inf entries and -inf elsewhere: the +inf entries share the mass (the limit as they grow
  together). NaN anywhere in a row propagates.
  """
  if where is not None:
    x = jnp.where(where, x, -jnp.inf)
  x_max = jnp.max(x, axes, keepdims=True)
  finite_shift = x - jnp.where(x_max == -jnp.inf, 0.0, x_max)
  return jnp.where(x_max == jnp.inf, jnp.where(x == jnp.inf, 0.0, -jnp.inf), finite_shift)


def _softmax_impl(log: bool, axes: tuple[int, ...], x: Array, where: Array | None) -> Array:
  cdt = validation.compute_dtype(x.dtype)
  shifted = _shifted(x.astype(cdt), axes, where)
  e = jnp.exp(shifted)
  total = jnp.sum(e, axes, keepdims=True)
  total = jnp.where(total == 0, 1.0, total)  # empty rows: 0 / 1 (softmax), -inf - 0 (log_softmax)
  y = shifted - jnp.log(total) if log else e / total
  return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _softmax(log: bool, axes: tuple[int, ...], x: Array, where: Array | None) -> Array:
  return _softmax_impl(log, axes, x, where)


def _softmax_fwd(log, axes, x, where):
  y = jax.lax.optimization_barrier(_softmax_impl(log, axes, x, where))  # see _elementwise_fwd
  return y, (y, where)


def _softmax_bwd(log, axes, res, g):
  y, where = res
  y, g = _after_cotangent(y, g)
  cdt = validation.compute_dtype(y.dtype)
  y32, g32 = y.astype(cdt), g.astype(cdt)
  if not log:
    # Masked entries and empty rows have y == 0, so they get 0 without a mask. The barrier keeps
    # the row sum a fusion of its own: fused with the product that reads g again, it made XLA
    # materialize a cotangent computed elementwise from the output (a loss's, say 2y or -t/y) as
    # one more activation-sized buffer, where two fusions each recompute it.
    dot = jax.lax.optimization_barrier(jnp.sum(g32 * y32, axes, keepdims=True))
    dx = y32 * (g32 - dot)
  else:
    mask = jnp.ones(y.shape, bool) if where is None else jnp.broadcast_to(where, y.shape)
    g_sum = jnp.sum(jnp.where(mask, g32, 0.0), axes, keepdims=True)
    dx = g32 - jnp.exp(y32) * g_sum
    empty = jnp.max(y32, axes, keepdims=True) == -jnp.inf
    dx = jnp.where(mask & ~empty, dx, 0.0)
  return dx.astype(y.dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)
_softmax_jit = jax.jit(_softmax, static_argnums=(0, 1))


def _apply_glu(x: ArrayLike, axis: int) -> Array:
  x = validation.as_real_array("glu", x)
  if not validation.is_floating(x.dtype):
    return _JAX_NN["glu"](x, axis=axis)
  (ax,) = validation.normalize_axes("glu", axis, x.ndim)
  if x.shape[ax] % 2:
    raise ValueError(
      f"jaxact.glu: `x` has size {x.shape[ax]} along axis {axis} (shape {x.shape}); glu splits "
      "that axis in two halves, so its size must be even"
    )
  with jax.named_scope("jaxact.glu"):
    return _glu_jit(ax, x)


def _apply_softmax(name: str, x: ArrayLike, axis, where) -> Array:
  x = validation.as_real_array(name, x)
  if not validation.is_floating(x.dtype):
    return _JAX_NN[name](x, axis=axis, where=where)
  axes = validation.normalize_axes(name, axis, x.ndim)
  if where is not None:
    where = validation.as_real_array(name, where, arg="where")
    if where.dtype != jnp.bool_:
      raise TypeError(f"jaxact.{name}: `where` must be a boolean array, got dtype {where.dtype}")
    validation.check_broadcasts_to(name, "where", where.shape, x.shape)
  if (
    x.size == 0
  ):  # nothing to normalize (a zero-length axis has no max): the empty array, as jax.nn
    return jnp.zeros_like(x)
  with jax.named_scope(f"jaxact.{name}"):
    return _softmax_jit(name == "log_softmax", axes, x, where)


# ------------------------------------------------------------------------- public functions


def _docstring(spec: ActivationSpec) -> str:
  residual = {
    "output": "the output ``y`` (nothing else is kept for the backward pass)",
    "input": "the input ``x``",
    "none": "nothing",
  }[spec.residual]
  lines = [spec.summary, "", "Computes", "", ".. math::", f"  {spec.formula}", ""]
  if spec.derivative:
    lines += ["and differentiates as", "", ".. math::", f"  {spec.derivative}", ""]
  if spec.notes:
    lines += [spec.notes, ""]
  lines += [f"Saved residual: {residual}."]
  if spec.fallback:
    lines += [f"The input is kept instead when {spec.fallback}."]
  if spec.kinks:
    kinks = ", ".join(f"f'({k:g}) = {v:g}" for k, v in spec.kinks.items())
    lines += [f"Derivative at kinks: {kinks}."]
  lines += ["", "Args:", "  x: input array."]
  lines += [f"  {p.name}: {p.doc}." for p in spec.params]
  lines += ["", "Returns:", "  An array of the dtype of ``x``.", ""]
  if spec.example[0]:
    lines += [
      "Examples:",
      "  >>> import jax.numpy as jnp, jaxact",
      f"  >>> jaxact.{spec.name}({spec.example[0]}).tolist()",
      f"  {spec.example[1]}",
    ]
  return "\n".join(lines)


def _signature(spec: ActivationSpec) -> inspect.Signature:
  kinds = inspect.Parameter.POSITIONAL_OR_KEYWORD
  params = [inspect.Parameter("x", kinds, annotation="ArrayLike")]
  params += [inspect.Parameter(p.name, kinds, default=p.default) for p in spec.params]
  return inspect.Signature(params, return_annotation="Array")


def _make_public(spec: ActivationSpec) -> Callable[..., Array]:
  sig = _signature(spec)

  if spec.name == "glu":

    def impl(x, axis=-1):
      return _apply_glu(x, axis)
  elif spec.name in ("softmax", "log_softmax"):

    def impl(x, axis=-1, where=None):
      return _apply_softmax(spec.name, x, axis, where)
  else:

    def impl(*args, **kwargs):
      try:
        bound = sig.bind(*args, **kwargs)
      except TypeError as e:
        raise TypeError(f"jaxact.{spec.name}{sig}: {e}") from None
      bound.apply_defaults()
      values = dict(bound.arguments)
      return _apply_elementwise(spec, values.pop("x"), values)

  impl.__name__ = impl.__qualname__ = spec.name
  impl.__module__ = "jaxact"
  impl.__doc__ = _docstring(spec)
  impl.__signature__ = sig  # type: ignore[attr-defined]
  return impl


_PUBLIC: dict[str, Callable[..., Array]] = {s.name: _make_public(s) for s in SPECS}

identity = _PUBLIC["identity"]
sigmoid = _PUBLIC["sigmoid"]
tanh = _PUBLIC["tanh"]
relu = _PUBLIC["relu"]
relu6 = _PUBLIC["relu6"]
leaky_relu = _PUBLIC["leaky_relu"]
elu = _PUBLIC["elu"]
selu = _PUBLIC["selu"]
celu = _PUBLIC["celu"]
softplus = _PUBLIC["softplus"]
log_sigmoid = _PUBLIC["log_sigmoid"]
soft_sign = _PUBLIC["soft_sign"]
squareplus = _PUBLIC["squareplus"]
sparse_plus = _PUBLIC["sparse_plus"]
sparse_sigmoid = _PUBLIC["sparse_sigmoid"]
hard_tanh = _PUBLIC["hard_tanh"]
hard_sigmoid = _PUBLIC["hard_sigmoid"]
hard_silu = _PUBLIC["hard_silu"]
hard_swish = hard_silu
gelu = _PUBLIC["gelu"]
gelu_quick = _PUBLIC["gelu_quick"]
silu = _PUBLIC["silu"]
swish = silu
mish = _PUBLIC["mish"]
glu = _PUBLIC["glu"]
softmax = _PUBLIC["softmax"]
log_softmax = _PUBLIC["log_softmax"]


def get_activation(name: str) -> Callable[..., Array]:
  """The jaxact activation called `name` (aliases such as ``"swish"`` included).

  Raises:
    ValueError: `name` is not an activation; the message lists the known names.
  """
  if not isinstance(name, str):
    raise TypeError(f"jaxact.get_activation: `name` must be a str, got {type(name).__name__}")
  canonical = ALIASES.get(name, name)
  if canonical not in _PUBLIC:
    raise validation.unknown_name("activation", name, [*_PUBLIC, *ALIASES])
  return _PUBLIC[canonical]


def get_spec(name: str) -> ActivationSpec:
  """The spec-table row of activation `name` (aliases accepted)."""
  get_activation(name)  # validates
  return SPEC_BY_NAME[ALIASES.get(name, name)]


ACTIVATIONS: tuple[str, ...] = tuple(s.name for s in SPECS)

__all__ = [
  "ACTIVATIONS",
  "Param",
  "get_activation",
  "get_spec",
  *ACTIVATIONS,
  "hard_swish",
  "swish",
]
