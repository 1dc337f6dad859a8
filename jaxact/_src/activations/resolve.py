"""What the fused ops make of their `activation` argument: a spec row with its parameters (or a
callable), the static :class:`Act` their plans hold, and the kernels' epilogue of a spec row.

Every check raises at trace time with the argument named, the value received and what is accepted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import Array

from jaxact._src.activations import api as activations
from jaxact._src.codes import code as codes
from jaxact._src.core import validation
from jaxact._src.core.spec import ALIASES, ActivationSpec

# ------------------------------------------------------------------------- the static activation


@dataclasses.dataclass(frozen=True)
class Act:
  """Static (hashable) description of the activation of one fused call.

  Either ``rule`` (a spec-table activation; its array parameters travel as primal arguments) or
  ``fn``, a closure-converted callable whose hoisted arrays travel as primal arguments.
  """

  rule: activations._Rule | None = None
  fn: Callable[..., Any] | None = None

  @property
  def residual(self) -> str:
    return self.rule.residual if self.rule is not None else "input"

  @property
  def kept_z(self) -> bool:
    """Whether the backward reads the pre-activation (as itself or its code)."""
    return self.residual in ("input", "code")


# ------------------------------------------------------------------------ activation resolution


@functools.cache
def _jaxact_functions() -> dict[Callable[..., Array], str]:
  """Every public jaxact activation function (aliases are the same object) to its spec name."""
  return {activations.get_activation(name): name for name in activations.ACTIVATIONS}


# The namespaces whose functions of a spec row's name (or alias) compute that row's activation with
# the same parameters: jax.nn, and Flax's re-exports of it.
# Checked by tests/activations/test_activation_resolution.py against the functions' signatures and
# values.
FOREIGN_NAMESPACES = ("jax.nn", "flax.linen", "flax.nnx")
# The attribute by which a function put in those namespaces' place while jaxact.linen.intercept
# routes them (jaxact/_src/swap/activations.py) names the one it replaced.
ROUTED_ORIGINAL = "_jaxact_routed_original"


@functools.cache
def _foreign_functions(loaded: tuple[str, ...]) -> dict[Callable[..., Array], str]:
  """The functions of the `loaded` namespaces named as a spec row (or its alias), to its name."""
  names = [*activations.ACTIVATIONS, *ALIASES]
  found = {}
  for module in loaded:
    namespace = sys.modules[module]
    for name in names:
      # a name routed to jaxact (jaxact.linen.intercept) stands for the function it replaced
      f = getattr(getattr(namespace, name, None), ROUTED_ORIGINAL, getattr(namespace, name, None))
      if callable(f):
        with contextlib.suppress(TypeError):  # unhashable: not a function of the namespace's
          found.setdefault(f, activations.get_spec(name).name)
  return found


def _jaxact_name(f) -> str | None:
  """The spec name of `f` if it is a public jaxact activation function or one of jax.nn's (or
  Flax's re-export of it), else None."""
  try:
    f = getattr(f, ROUTED_ORIGINAL, f)
    name = _jaxact_functions().get(f)
    if name is None:
      loaded = tuple(m for m in FOREIGN_NAMESPACES if m in sys.modules)
      name = _foreign_functions(loaded).get(f)
    return name
  except TypeError:  # unhashable callable objects are not activation functions
    return None


def _describe(activation) -> str:
  if isinstance(activation, functools.partial):
    return f"functools.partial({getattr(activation.func, '__name__', activation.func)!r}, ...)"
  return getattr(activation, "__name__", type(activation).__name__)


def _spec_and_values(
  fn_name: str, activation
) -> tuple[ActivationSpec, dict[str, Any]] | Callable[..., Any]:
  """The spec row and parameter values `activation` stands for, or a callable to autodiff.

  Names, jaxact functions and jax.nn's (flax's re-exports included) give their spec row with
  default parameters; a ``functools.partial`` of one of these functions with keyword arguments only
  gives the row with those parameters. Anything
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
  if "residual_bits" in keywords:  # jaxact's own keyword: validated here, with the reason
    known["residual_bits"] = codes.check_bits(fn_name, spec.name, keywords["residual_bits"])
  unknown = sorted(set(keywords) - set(known))
  if unknown:
    accepted = ", ".join(known) or "none"
    raise TypeError(
      f"jaxact.{fn_name}: `activation` {_describe(activation)} sets {', '.join(unknown)}, which "
      f"jaxact.{spec.name} does not take; its parameters: {accepted}"
    )
  return spec, known | keywords


def resolve_activation(fn_name: str, activation, z: jax.ShapeDtypeStruct, arg_dtype):
  """`activation` as a static :class:`Act` and the arrays that go through the ``custom_vjp``.

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
    return Act(fn=fn), list(consts)
  spec, values = resolved
  bits = values.pop("residual_bits", None)
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
  return Act(rule=activations.with_code(rule, bits)), dynamic


# ------------------------------------------------------------------------ kernel epilogues


def epilogue(rule: activations._Rule):
  """The kernels' :class:`pallas_kernels.Epilogue` of a spec-table activation with static
  parameters."""
  from pallas_kernels import DerivativeCode, Epilogue

  spec, params = rule.spec, dict(rule.static_params)

  def fn(z):
    return spec.fn(z, **params)

  derivative: Callable[[Array], Array] | None = None
  if rule.residual == "output":

    def derivative(y):
      return spec.d_output(y, **params)

  elif rule.residual == "input":

    def derivative(z):
      return spec.derivative_from_input(z, **params)
  elif rule.residual == "code":  # what the code quantizes, as the XLA path's encoding

    def derivative(z):
      return spec.derivative_for_code(z, **params)

  code = None
  if rule.code is not None:  # the same tables, so kernels and XLA keep the same bytes
    code = DerivativeCode(rule.code.bits, rule.code.boundaries, rule.code.levels)
  unbounded = spec.unbounded is not None and spec.unbounded(**params)
  return Epilogue(
    fn=fn, derivative=derivative, residual=rule.residual, code=code, unbounded=unbounded
  )
