"""Activations as ``jax.custom_vjp`` functions that keep their output (or input) for backward.

The public functions are generated from the spec table (``spec.py``): one rule serves every
elementwise activation; glu / softmax / log_softmax have rules of their own (``softmax.py``).

Residual policy (decided at trace time, per call):

* ``"output"``: the spec's ``d_output`` is valid for these parameters, so only ``y`` is kept. The
  output is the array the next layer reads anyway, so the backward pass adds nothing to memory.
* ``"input"``: only ``x`` is kept; input-residual activations, and output-residual ones whose
  parameters are traced (their gradient is then also computed) or make ``d_output`` invalid.
* ``"none"``: identity keeps nothing.
* ``"code"``: asked for with ``residual_bits`` (gelu, gelu_quick, silu, mish, hard_silu): ``f'(x)``
  in 8, 4 or 2 bits an element (:mod:`jaxact._src.codes.code`) instead of ``x``.

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

from jaxact._src.activations.softmax import apply_glu, apply_softmax
from jaxact._src.codes import code as codes
from jaxact._src.core import validation
from jaxact._src.core.barriers import after_cotangent, barrier_residual
from jaxact._src.core.spec import (
  ALIASES,
  JAX_NN,
  SPEC_BY_NAME,
  SPECS,
  ActivationSpec,
  Param,
  Residual,
)

# ------------------------------------------------------------------ the elementwise custom_vjp rule


@dataclasses.dataclass(frozen=True)
class _Rule:
  """Static (hashable) description of one elementwise call: which spec, which residual, params."""

  name: str
  residual: Residual
  static_params: tuple[tuple[str, Any], ...]  # Python numbers/bools, baked into the trace
  dynamic_names: tuple[str, ...]  # array parameters, passed as primal arguments
  code: codes.Code | None = None  # residual "code": the few-bit derivative code kept instead of x

  @property
  def spec(self) -> ActivationSpec:
    return SPEC_BY_NAME[self.name]

  def params(self, dynamic) -> dict[str, Any]:
    return dict(self.static_params) | dict(zip(self.dynamic_names, dynamic, strict=True))


def with_code(rule: _Rule, bits: int | None) -> _Rule:
  """`rule` keeping the `bits`-bit derivative code instead of its input (None: unchanged)."""
  if bits is None:
    return rule
  code = codes.get_code(rule.name, rule.static_params, bits)
  return dataclasses.replace(rule, residual="code", code=code)


def encode(rule: _Rule, x: Array, dynamic=()) -> Array:
  """The packed code of `x` (in the compute dtype) that a ``"code"`` rule keeps."""
  params = rule.params(dynamic)
  codes_ = rule.code.encode(x, lambda v: rule.spec.derivative_for_code(v, **params))
  return rule.code.pack(codes_)


def _forward(rule: _Rule, x: Array, dynamic) -> Array:
  cdt = validation.compute_dtype(x.dtype)
  return rule.spec.fn(x.astype(cdt), **rule.params(dynamic)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _elementwise(rule: _Rule, x: Array, *dynamic: Array) -> Array:
  return _forward(rule, x, dynamic)


def _elementwise_fwd(rule: _Rule, x: Array, *dynamic: Array):
  y = _forward(rule, x, dynamic)
  if rule.residual == "code":
    x = encode(rule, x.astype(validation.compute_dtype(x.dtype)), dynamic)
  y, kept = barrier_residual(rule.residual, y, x)
  return y, (kept, dynamic)


def rule_cotangents(
  rule: _Rule, kept: Array | None, g: Array, dynamic, compute_dtype, *, tied: bool = False
) -> tuple[Array, list]:
  """``g * f'(x)`` from the kept residual, and the array parameters' cotangents (None if zero).

  `kept` and `g` come in their storage dtype and are converted to `compute_dtype` only after the
  barrier that ties them together: a barrier on the converted arrays makes XLA materialize them,
  two activation-sized float32 arrays per 16-bit layer (measured on an H100: 2 GiB of temp for a
  2**28-element bfloat16 activation, 256 MiB for an 8192 x 4096 fused layer). Shared by every op
  built on a rule (this module's elementwise op and the fused layers), so the backward formula
  exists once. `tied`: the caller has tied `kept` and `g` already (a fused op's dropout).
  """
  if rule.residual == "none":
    return g.astype(compute_dtype), [None] * len(dynamic)
  if not tied:
    kept, g = after_cotangent(kept, g)
  g = g.astype(compute_dtype)
  if rule.residual != "code":
    kept = kept.astype(compute_dtype)
  spec, params = rule.spec, rule.params(dynamic)
  if rule.residual == "output":
    # Output mode is chosen only for concrete parameters, which have no cotangent consumer.
    return g * spec.d_output(kept, **params), [None] * len(dynamic)
  if rule.residual == "code":  # coded activations have static parameters only
    decode = functools.partial(rule.code.decode, dtype=compute_dtype)
    return g * rule.code.unpack(kept, g.shape, decode), []
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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def apply_rule(rule: _Rule, x: Array, *dynamic: Array) -> Array:
  """`rule`'s activation of `x` (in x's dtype, no conversion), its derivative (kinks included)
  from the spec table, as a ``custom_jvp``: it keeps no residual of its own and fuses with its
  neighbours, for an op that makes the activation again under ``jax.checkpoint`` (where the
  elementwise op's ``custom_vjp`` would store its input, in float32 for 16-bit activations)."""
  return rule.spec.fn(x, **rule.params(dynamic))


@apply_rule.defjvp
def _apply_rule_jvp(rule: _Rule, primals, tangents):
  x, *dynamic = primals
  tx, *t_dynamic = tangents
  y = apply_rule(rule, x, *dynamic)
  dy = tx * rule.spec.derivative_from_input(x, **rule.params(dynamic))
  if dynamic:  # traced parameters: their tangents through the forward formula
    dy = dy + jax.jvp(lambda *p: rule.spec.fn(x, **rule.params(p)), dynamic, t_dynamic)[1]
  return y, dy


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


def _apply_elementwise(
  spec: ActivationSpec, x: ArrayLike, values: dict[str, Any], bits: int | None = None
) -> Array:
  x = validation.as_real_array(spec.name, x)
  if not validation.is_floating(x.dtype):
    if spec.jax_nn:  # integer and bool inputs behave exactly as jax.nn's (some cast, some raise)
      return JAX_NN[spec.name](x, **values)
    x = x.astype(jnp.result_type(float))
  # Array parameters promote as in jax.nn's formulas: a bfloat16 x with a float32 `alpha` array
  # gives float32 (Python numbers are weakly typed and leave x's dtype alone).
  arrays = [values[p.name] for p in spec.params if not p.static]
  dtype = jnp.result_type(x, *(v for v in arrays if validation.is_arraylike(v)))
  if dtype != x.dtype and validation.is_floating(dtype):
    x = x.astype(dtype)
  rule, dynamic = _split_params(spec, x, values)
  rule = with_code(rule, bits)
  with jax.named_scope(f"jaxact.{spec.name}"):
    return _elementwise_jit(rule, x, *dynamic)


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
  if spec.name in codes.CODED:
    lines += [
      "With ``residual_bits`` (8, 4 or 2) it keeps ``f'(x)`` coded in that many bits an element "
      "instead of ``x`` (see the residual-policy docs for each code's error).",
    ]
  lines += ["", "Args:", "  x: input array."]
  lines += [f"  {p.name}: {p.doc}." for p in spec.params]
  if spec.name in codes.CODED:
    lines += [
      "  residual_bits: keyword-only. None (default) keeps ``x``; 8 keeps ``f'(x)`` quantized "
      "uniformly over its range, 4 and 2 the optimal piecewise-constant code of ``f'`` for a "
      "standard normal ``x``."
    ]
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
  if spec.name in codes.CODED:  # jaxact's own, keyword-only: jax.nn's signature is unchanged
    params.append(inspect.Parameter("residual_bits", inspect.Parameter.KEYWORD_ONLY, default=None))
  return inspect.Signature(params, return_annotation="Array")


def _make_public(spec: ActivationSpec) -> Callable[..., Array]:
  sig = _signature(spec)

  if spec.name == "glu":

    def impl(x, axis=-1):
      return apply_glu(x, axis)
  elif spec.name in ("softmax", "log_softmax"):

    def impl(x, axis=-1, where=None):
      return apply_softmax(spec.name, x, axis, where)
  else:

    def impl(*args, **kwargs):
      if "residual_bits" in kwargs and spec.name not in codes.CODED:
        codes.check_bits(spec.name, spec.name, kwargs["residual_bits"])  # says why not
        kwargs.pop("residual_bits")
      try:
        bound = sig.bind(*args, **kwargs)
      except TypeError as e:
        raise TypeError(f"jaxact.{spec.name}{sig}: {e}") from None
      bound.apply_defaults()
      values = dict(bound.arguments)
      bits = codes.check_bits(spec.name, spec.name, values.pop("residual_bits", None))
      return _apply_elementwise(spec, values.pop("x"), values, bits)

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
