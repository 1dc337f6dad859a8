"""``jaxact.linen.intercept``: calls of Flax's own linen modules run jaxact's layers' code with the
modules' own variables, and jax.nn / Flax activations run jaxact's.

Under ``flax.linen.intercept_methods``, a call of exactly ``nn.Dense``, ``nn.Conv``,
``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.BatchNorm``, ``nn.GroupNorm`` (a subclass runs its own
code) runs the call of jaxact's subclass of that layer (``jaxact.linen.DenseAct``, ...) on the
Flax module itself, seen through a view that adds jaxact's attributes at their defaults: the
same ``self.param`` / ``self.variable`` calls, so the same names, shapes, dtypes, initializers and
``batch_stats`` updates. ``nn.MultiHeadDotProductAttention`` (and ``nn.SelfAttention``) with
Flax's default ``attention_fn`` computes it with jaxact's. What jaxact's layer cannot take (a
custom ``dot_general``, statistics over devices in a norm, a mask) runs Flax's own call, and the
report says so.

Dense, Conv, BatchNorm and GroupNorm offer their output for fusion (``activations.offer``): an
activation applied straight to it reruns the same layer call with that activation (the view then
replays the variables recorded by the first call) as one op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes as flax_dtypes
from jax import lax

from jaxact._src.attention import linen as attention_linen
from jaxact._src.fused import linen as fused_linen
from jaxact._src.norm_act import api as norm_act_api
from jaxact._src.norm_act import linen as norm_act_linen
from jaxact._src.norms import api as norms_api
from jaxact._src.norms import linen as norms_linen
from jaxact._src.swap import activations, attention, from_x_hat
from jaxact._src.swap.report import Report


class _Frozen:
  """A variable seen again by a replayed call: its recorded value; writes are dropped (the first
  call made them)."""

  def __init__(self, value):
    self._value = value

  @property
  def value(self):
    return self._value

  @value.setter
  def value(self, _):
    pass


class _View:
  """A Flax module seen as jaxact's subclass of its layer: the module's attributes and methods,
  jaxact's own attributes (`extra`) on top. Recording: `param` / `variable` go to the module and
  their values are kept; replaying (`replay` given): they return the kept values."""

  def __init__(self, module: nn.Module, extra: dict[str, Any], replay: dict | None = None):
    self._module, self._extra, self._replay = module, extra, replay
    self.recorded: dict[tuple[str, str], Any] = {}
    self._initializing = module.is_initializing() if replay is None else replay["initializing"]

  def __getattr__(self, name: str):
    if name in self._extra:
      return self._extra[name]
    return getattr(self._module, name)

  def param(self, name, *args, **kwargs):
    if self._replay is not None:
      return self._replay["params", name]
    value = self._module.param(name, *args, **kwargs)
    self.recorded["params", name] = value
    return value

  def variable(self, collection, name, *args, **kwargs):
    if self._replay is not None:
      return _Frozen(self._replay[collection, name])
    v = self._module.variable(collection, name, *args, **kwargs)
    self.recorded[collection, name] = v.value
    return v

  def is_initializing(self) -> bool:
    return self._initializing

  def is_mutable_collection(self, collection) -> bool:
    return True if self._replay is not None else self._module.is_mutable_collection(collection)

  def replay(self, **extra) -> _View:
    return _View(
      self._module, self._extra | extra, self.recorded | {"initializing": self._initializing}
    )


@dataclasses.dataclass(frozen=True)
class _Layer:
  """How a Flax layer is taken: jaxact's subclass, and the jaxact op that computes it."""

  jaxact: type
  op: str
  refuse: Any = None  # (module, args, kwargs) -> why Flax's call runs instead, or None
  fuses: bool = False  # offers its output for an activation
  drops: bool = False  # the op can end with nn.Dropout's dropout

  @functools.cached_property
  def call(self):
    return self.jaxact.__call__.__wrapped__  # the layer's own function, not Flax's wrapper

  @functools.cached_property
  def extra(self) -> dict[str, Any]:
    flax_fields = {f.name for f in dataclasses.fields(self.jaxact.__mro__[1])}
    return {f.name: f.default for f in dataclasses.fields(self.jaxact) if f.name not in flax_fields}


def _not_float(m, args, kwargs) -> str | None:
  """Why the fused op would not compute a Dense / Conv as Flax does: dtypes it would not
  promote to a real float (jaxact's layer would then run Flax's computation itself)."""
  x = args[0] if args else kwargs.get("inputs")
  dtype = m.dtype if m.dtype is not None else jnp.result_type(x, m.param_dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or not jnp.issubdtype(m.param_dtype, jnp.floating):
    return f"dtype {jnp.dtype(dtype)}, param_dtype {jnp.dtype(m.param_dtype)}: not real floats"
  return None


def _custom_dot(m, args, kwargs):
  if m.dot_general not in (None, lax.dot_general) or m.dot_general_cls is not None:
    return "a custom dot_general / dot_general_cls"
  return _not_float(m, args, kwargs)


def _custom_conv(m, args, kwargs):
  if m.conv_general_dilated not in (None, lax.conv_general_dilated):
    return "a custom conv_general_dilated"
  if m.conv_general_dilated_cls is not None:
    return "a custom conv_general_dilated_cls"
  return _not_float(m, args, kwargs)


def _norm_refused(m, args, kwargs):
  x = args[0] if args else kwargs.get("x")
  try:
    norms_api.check_supported(type(m).__name__, m, x, kwargs.get("mask"))
  except ValueError as e:
    return str(e)
  return None


def _masked(m, args, kwargs):
  return "a mask" if kwargs.get("mask") is not None else None


LAYERS: dict[type, _Layer] = {
  nn.Dense: _Layer(fused_linen.DenseAct, "dense_bias_act", _custom_dot, fuses=True, drops=True),
  nn.Conv: _Layer(fused_linen.ConvAct, "conv_bias_act", _custom_conv, fuses=True),
  nn.LayerNorm: _Layer(norms_linen.LayerNorm, "layer_norm", _norm_refused),
  nn.RMSNorm: _Layer(norms_linen.RMSNorm, "rms_norm", _norm_refused),
  nn.BatchNorm: _Layer(norm_act_linen.BatchNorm, "batch_norm_act", _masked, fuses=True),
  nn.GroupNorm: _Layer(norm_act_linen.GroupNorm, "group_norm_act", _masked, fuses=True),
}
ATTENTION = (nn.MultiHeadDotProductAttention, nn.SelfAttention)


def _where(module: nn.Module) -> str:
  return "/".join(module.scope.path) if module.scope is not None else type(module).__name__


def _what(module: nn.Module) -> str:
  cls = type(module)
  return f"flax.linen.{cls.__name__}" if cls.__module__.startswith("flax.linen") else cls.__name__


def _layer(layer: _Layer, module, next_fun, args, kwargs, report: Report):
  where, what = _where(module), _what(module)
  if layer.refuse is not None and (why := layer.refuse(module, args, kwargs)):
    report.add(where, what, None, why)
    return next_fun(*args, **kwargs)
  view = _View(module, layer.extra)
  with activations.inside():
    y = layer.call(view, *args, **kwargs)
  if not layer.fuses:
    report.add(where, what, f"jaxact.{layer.op}")
    return y
  source = None
  if layer.op in _TAKES_NORMALIZED and not view.is_initializing():
    source = activations.normalized(args[0] if args else kwargs.get("inputs"))
  if source is not None:  # a norm's output: made again from its x_hat (the first y is unused)
    remade = _from_normalized(layer, view, source, args, kwargs)
    y = remade({})

  def fuse(activation, dropout=None):
    extra = {"activation": "identity" if activation is None else activation}
    rng = {}
    if dropout is not None:
      rate, key, dims = dropout
      extra |= {"dropout_rate": rate, "dropout_broadcast_dims": dims, "deterministic": False}
      rng = {"rng": key}
    if source is not None:
      return remade(extra, rng)
    return layer.call(view.replay(**extra), *args, **kwargs, **rng)

  split = _split(layer, module, view, args, kwargs) if layer.op in _NORMS else None
  note = from_x_hat.NOTE if source is not None else ""
  activations.offer(
    y, where=where, what=what, op=layer.op, fuse=fuse, drops=layer.drops, split=split, note=note
  )
  return y


_TAKES_NORMALIZED = frozenset({"dense_bias_act", "conv_bias_act"})  # from_x_hat's layers
_NORMS = frozenset({"batch_norm_act", "group_norm_act"})


def _split(layer: _Layer, module, view: _View, args, kwargs):
  """A norm's ``split`` (``from_x_hat.split``): x_hat by its call without scale, bias or
  activation (the statistics as recorded), its output in the dtype Flax's would have."""
  x = args[0] if args else kwargs.get("x")
  name = f"jaxact.linen.{layer.jaxact.__name__}"
  if layer.op == "batch_norm_act":
    axes = norm_act_api.canonical_axes(name, module.axis, jnp.ndim(x))
  else:
    axes = (jnp.ndim(x) - 1,)
  scale, bias = view.recorded.get(("params", "scale")), view.recorded.get(("params", "bias"))
  given = [a for a in (x, scale, bias) if a is not None]
  out = flax_dtypes.canonicalize_dtype(*given, dtype=module.dtype)

  def run():
    plain = view.replay(activation="identity", use_scale=False, use_bias=False, dtype=None)
    with activations.inside():
      return layer.call(plain, *args, **kwargs), scale, bias

  return from_x_hat.split(name, axes, run, out)


def _from_normalized(layer: _Layer, view: _View, source, args, kwargs):
  """``call(extra, rng) -> the layer's call`` (with jaxact attributes `extra`, and ``rng=`` a
  dropout's key) on the norm's output made from its x_hat under ``jax.checkpoint``: the backward
  pass keeps x_hat and the layer's variables, and makes the norm's scale, bias and activation
  again (elementwise) for the layer's weight gradient."""
  x_hat, scale, bias, tail = source.split()
  activation = source.activation
  names = list(view.recorded)
  rest, kw = args[1:], {k: v for k, v in kwargs.items() if k != "inputs"}

  def call(extra, rng=None):
    def run(x_hat, scale, bias, values, rng):
      z = tail(x_hat, scale, bias, activation)
      replay = dict(zip(names, values, strict=True)) | {"initializing": False}
      with activations.inside():
        return layer.call(_View(view._module, view._extra | extra, replay), z, *rest, **kw, **rng)

    values = [view.recorded[n] for n in names]
    return jax.checkpoint(run)(x_hat, scale, bias, values, rng or {})

  return call


def _dropout(module, next_fun, args, kwargs):
  """``nn.Dropout`` of an offered op's output: the op ends with it (Flax's key and formula: the
  same bits), keeping no mask; any other dropout is Flax's."""
  x = args[0] if args else kwargs.get("inputs")
  deterministic = args[1] if len(args) > 1 else kwargs.get("deterministic")
  rng = args[2] if len(args) > 2 else kwargs.get("rng")
  deterministic = nn.merge_param("deterministic", module.deterministic, deterministic)
  if deterministic or not 0 < module.rate < 1:
    return next_fun(*args, **kwargs)
  offered = activations.offered(x)
  if offered is None:
    return next_fun(*args, **kwargs)
  key = rng if rng is not None else module.make_rng(module.rng_collection)
  return activations.dropped(x, module.rate, key, module.broadcast_dims, "flax.linen.Dropout")


def _attention(module, next_fun, args, kwargs, report: Report):
  where, what = _where(module), _what(module)
  flax_fn = module.attention_fn
  if getattr(flax_fn, "_jaxact_routed", False):  # SelfAttention's call, then its parent's
    return next_fun(*args, **kwargs)
  if flax_fn is not nn.dot_product_attention:
    report.add(where, what, None, "a custom attention_fn")
    return next_fun(*args, **kwargs)

  @functools.wraps(attention_linen.linen_dot_product_attention)
  def routed(query, key, value, *a, **k):
    try:
      with activations.inside():
        out = attention_linen.linen_dot_product_attention(query, key, value, *a, **k)
    except NotImplementedError as e:
      report.add(where, what, None, str(e))
      return flax_fn(query, key, value, *a, **k)
    report.add(where, what, "jaxact.dot_product_attention")
    return attention.keyless_rows_as_flax(out, value, k.get("mask"))

  routed._jaxact_routed = True  # type: ignore[attr-defined]
  object.__setattr__(module, "attention_fn", routed)  # for this call only
  try:
    return next_fun(*args, **kwargs)
  finally:
    object.__setattr__(module, "attention_fn", flax_fn)


def _interceptor(report: Report):
  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or activations.current() is None:
      return next_fun(*args, **kwargs)
    layer = LAYERS.get(type(module))
    if layer is not None:
      return _layer(layer, module, next_fun, args, kwargs, report)
    if type(module) in ATTENTION:
      return _attention(module, next_fun, args, kwargs, report)
    if type(module) is nn.Dropout:
      return _dropout(module, next_fun, args, kwargs)  # reported by the routing
    if isinstance(module, (*LAYERS, *ATTENTION)) and not _is_jaxact(module):
      flax = next(c for c in type(module).__mro__ if c in LAYERS or c in ATTENTION)
      why = f"a subclass of flax.linen.{flax.__name__}: its own call runs"
      report.add(_where(module), _what(module), None, why)
    with _routed_fields(module):
      return next_fun(*args, **kwargs)

  return intercept


@contextlib.contextmanager
def _routed_fields(module: nn.Module):
  """An attribute holding an activation function (``act: Callable = nn.relu``, bound when the
  class was written, before any routing), or a list or tuple of them among other things
  (``nn.Sequential``'s layers), routed for this call, and given back after it."""
  swapped = []
  for field in dataclasses.fields(module):
    if field.name in ("parent", "name"):
      continue
    value = getattr(module, field.name, None)
    if isinstance(value, (list, tuple)):  # nn.Sequential's layers: functions among modules
      items = [activations.routed(v) or v for v in value]
      changed = any(a is not b for a, b in zip(items, value, strict=True))
      r = (list(items) if isinstance(value, list) else tuple(items)) if changed else None
    else:
      r = activations.routed(value)
    if r is not None:
      swapped.append((field.name, value))
      object.__setattr__(module, field.name, r)
  try:
    yield
  finally:
    for name, value in swapped:
      object.__setattr__(module, name, value)


def _is_jaxact(module) -> bool:
  return type(module).__module__.startswith("jaxact.")


class intercept(contextlib.ContextDecorator):
  """Run Flax's linen modules and jax.nn's activations as jaxact's ops, the model unchanged.

  ``with jaxact.linen.intercept(): ...`` around ``init`` / ``apply`` (or ``@intercept()`` on the
  function that ``jax.jit`` traces: the routing acts while a step is traced, so a step traced
  before, and cached by ``jit``, keeps what it traced). Entering gives the
  :class:`~jaxact._src.swap.report.Report` of every call taken and left; ``report=True`` also
  prints it at the end.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jaxact.linen as jnn
    >>> layer = nn.Dense(4)
    >>> x = jnp.ones((2, 3))
    >>> params = layer.init(jax.random.key(0), x)
    >>> with jnn.intercept() as report:
    ...   y = nn.gelu(layer.apply(params, x))
    >>> print(report)
    1 taken, 0 left
         1 x flax.linen.Dense + flax.linen.gelu -> jaxact.dense_bias_act(gelu)
  """

  def __init__(self, *, report: bool = False):
    if not isinstance(report, bool):
      raise TypeError(
        f"jaxact.linen.intercept: `report` must be True or False; got {type(report).__name__} "
        f"{report!r}"
      )
    self._print = report
    self._stack: list[contextlib.ExitStack] = []

  def __enter__(self) -> Report:
    report = Report()
    stack = contextlib.ExitStack()
    stack.callback(lambda: print(report) if self._print else None)  # last: after the routing's
    stack.enter_context(activations.routing(report))
    stack.enter_context(nn.intercept_methods(_interceptor(report)))
    self._stack.append(stack)
    return report

  def __exit__(self, *exc) -> bool:
    self._stack.pop().close()
    return False
