"""jax.nn's and Flax's activation functions routed to jaxact's while a routing is active, and a
layer fused with the activation its output goes straight into.

While :func:`routing` is active (on this thread), the activation functions of ``jax.nn``,
``flax.linen`` and ``flax.nnx`` that jaxact's spec table computes with the same parameters
(``resolve.FOREIGN_NAMESPACES``) run jaxact's function of the same name. The namespaces' attributes
are replaced while any routing is active on any thread; on a thread without one, and inside
jaxact's own code (which calls jax.nn), the replacement calls the function it replaced. A call
jaxact refuses (an integer input, an argument it lacks) runs the original and is reported.

A routed layer (:func:`offer`) registers its output with a ``fuse(activation)`` that computes
``activation(layer(x))`` as one jaxact op. An activation called on exactly that array (the same
object: nothing between them) returns the fused op's output instead; under ``jax.jit`` the layer's
own output, then unused, is removed by XLA, so the step keeps what the fused op keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp

from jaxact._src.activations import api as activations
from jaxact._src.activations import resolve
from jaxact._src.core.spec import ALIASES
from jaxact._src.swap.report import Call, Report

# Not elementwise: routed, never fused into a layer's epilogue.
_NOT_FUSED = frozenset({"glu", "softmax", "log_softmax"})


@dataclasses.dataclass
class _Offer:
  y: Any  # the layer's output (kept to compare identity: an id alone could be reused)
  where: str
  what: str
  op: str
  fuse: Callable[..., Any]  # (activation, dropout=None) -> the fused op's output
  fused: bool = False
  activation: Any = None  # the activation fused already: only a dropout may follow
  drops: bool = False  # the op can end with a dropout
  line: int | None = None  # the report's line of the activation fused already
  # A norm's: () -> (x_hat, scale, bias, tail), tail(x_hat, scale, bias, activation) making the
  # norm's output again from its normalized input, for a layer that takes that output (`normalized`)
  split: Callable[[], tuple] | None = None
  note: str = ""  # after the op's name in the report


@dataclasses.dataclass
class Routing:
  """One active routing: its report and the layers' outputs offered for fusion."""

  report: Report
  offers: dict[int, _Offer] = dataclasses.field(default_factory=dict)

  def activation(self, what: str, name: str, original, args, kwargs):
    x = args[0] if args else kwargs.get("x")
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      why = f"input {type(x).__name__} of dtype {dtype}: not a float array"
      self.report.add("", what, None, why)
      return original(*args, **kwargs)
    function = activations.get_activation(name)
    offer = self.offers.get(id(x))
    if offer is not None and offer.y is x and offer.activation is None and name not in _NOT_FUSED:
      try:
        bound = inspect.signature(function).bind(*args, **kwargs)
        params = {k: v for k, v in bound.arguments.items() if k != "x"}
        act = functools.partial(function, **params) if params else name
        with inside():
          out = offer.fuse(act)
      except (TypeError, ValueError, NotImplementedError) as e:
        self.report.add(offer.where, f"{offer.what} + {what}", None, f"not fused: {e}")
      else:
        offer.fused = True
        ran = f"jaxact.{offer.op}({name}){offer.note}"
        self.report.add(offer.where, f"{offer.what} + {what}", ran)
        if offer.drops or offer.split:  # a dropout (or a layer on the norm's output) may follow
          self.offers[id(out)] = dataclasses.replace(
            offer,
            y=out,
            what=f"{offer.what} + {what}",
            activation=act,
            line=len(self.report.calls) - 1,
          )
        return out
    try:
      with inside():
        out = function(*args, **kwargs)
    except (TypeError, ValueError, NotImplementedError) as e:
      self.report.add("", what, None, str(e))
      return original(*args, **kwargs)
    self.report.add("", what, f"jaxact.{name}")
    return out

  def close(self) -> None:
    for offer in self.offers.values():
      if not offer.fused:
        self.report.add(offer.where, offer.what, f"jaxact.{offer.op}{offer.note}")
    self.offers.clear()


class _Local(threading.local):
  def __init__(self):
    self.stack: list[Routing] = []
    self.inside = 0


_local = _Local()
_lock = threading.Lock()
_active = 0  # routings active on every thread: the namespaces are patched while it is positive
_replaced: list[tuple[Any, str, Any]] = []  # (namespace, name, original)
_wrappers: dict[Any, Any] = {}  # original function -> its routed wrapper (the first namespace's)


def current() -> Routing | None:
  """This thread's innermost routing, or None (none active, or inside jaxact's own code)."""
  return _local.stack[-1] if _local.stack and not _local.inside else None


@contextlib.contextmanager
def inside() -> Iterator[None]:
  """jaxact's own code runs: the namespaces' functions are the originals again."""
  _local.inside += 1
  try:
    yield
  finally:
    _local.inside -= 1


def offer(
  y,
  *,
  where: str,
  what: str,
  op: str,
  fuse: Callable[..., Any],
  drops: bool = False,
  split: Callable[[], tuple] | None = None,
  note: str = "",
) -> None:
  """Register `y`, the output of layer `what` at `where` computed by jaxact's `op`, with
  ``fuse(activation, dropout=None) -> activation(layer(x))`` as one op (`drops`: then dropped by
  ``dropout = (rate, key, broadcast_dims)``, Flax's formula); reported at the routing's end as
  taken unfused unless an activation fused it. A norm gives `split` (see `_Offer`): a layer called
  on its output, or on its fused activation's, may make that output again from the norm's
  normalized input (:func:`normalized`)."""
  if (r := current()) is not None:
    r.offers[id(y)] = _Offer(y, where, what, op, fuse, drops=drops, split=split, note=note)


def normalized(x) -> _Offer | None:
  """The offer of a norm that gave `x` (exactly that array), its activation fused or not, or
  None: ``offer.split()`` then gives what makes `x` again from the norm's normalized input."""
  r = current()
  offer = None if r is None else r.offers.get(id(x))
  return offer if offer is not None and offer.y is x and offer.split is not None else None


def offered(x) -> _Offer | None:
  """The offer of an op that gave `x` (exactly that array) and can end with a dropout, or None."""
  r = current()
  offer = None if r is None else r.offers.get(id(x))
  return offer if offer is not None and offer.y is x and offer.drops else None


def dropped(x, rate: float, key, broadcast_dims, what: str):
  """The offered op that gave `x` (exactly that array) ending with the dropout, or None where no
  offered op that can end with one gave it."""
  r, offer = current(), offered(x)
  if r is None or offer is None:
    return None
  with inside():
    out = offer.fuse(offer.activation, (rate, key, tuple(broadcast_dims)))
  name = offer.activation if isinstance(offer.activation, str) else "identity"
  if isinstance(offer.activation, functools.partial):
    name = offer.activation.func.__name__
  call = Call(offer.where, f"{offer.what} + {what}", f"jaxact.{offer.op}({name}, dropout)")
  if offer.line is not None:  # one op: its line replaces the activation's
    r.report.calls[offer.line] = call
  else:
    r.report.calls.append(call)
  offer.fused = True
  return out


def _routed(namespace: str, attr: str, name: str, original):
  what = f"{namespace}.{attr}"

  @functools.wraps(original)
  def routed(*args, **kwargs):
    r = current()
    if r is None:
      return original(*args, **kwargs)
    return r.activation(what, name, original, args, kwargs)

  setattr(routed, resolve.ROUTED_ORIGINAL, original)
  return routed


def _patch() -> None:
  names = [n for n in (*activations.ACTIVATIONS, *ALIASES) if n != "identity"]
  for namespace in resolve.FOREIGN_NAMESPACES:
    module = sys.modules.get(namespace)
    if module is None:
      continue
    known = resolve._foreign_functions((namespace,))
    for attr in names:
      f = getattr(module, attr, None)
      if f is not None and not hasattr(f, resolve.ROUTED_ORIGINAL) and f in known:
        _replaced.append((module, attr, f))
        setattr(module, attr, wrapper := _routed(namespace, attr, known[f], f))
        _wrappers.setdefault(f, wrapper)


def routed(value):
  """The routed version of `value` when it is an activation function the namespaces hold (or a
  ``functools.partial`` of one), as a module attribute such as ``act: Callable = nn.relu`` holds
  it; else None."""
  try:
    if isinstance(value, functools.partial) and value.func in _wrappers:
      return functools.partial(_wrappers[value.func], *value.args, **value.keywords)
    return _wrappers.get(value)
  except TypeError:  # unhashable
    return None


def _unpatch() -> None:
  _wrappers.clear()
  while _replaced:
    module, attr, f = _replaced.pop()
    setattr(module, attr, f)


@contextlib.contextmanager
def routing(report: Report) -> Iterator[Routing]:
  """Route the activation functions (and fuse offered layers) until the block ends."""
  global _active
  r = Routing(report)
  with _lock:
    if _active == 0:
      _patch()
    _active += 1
  _local.stack.append(r)
  try:
    yield r
  finally:
    _local.stack.pop()
    r.close()
    with _lock:
      _active -= 1
      if _active == 0:
        _unpatch()
