""":func:`swap`: a Flax nnx model's own layers turned into jaxact's in place, and
:func:`route_activations`, the context under which its activation functions run jaxact's.

``swap`` walks the model's graph and changes the class of each instance whose type is exactly one
of Flax's (``nnx.Linear``, ``nnx.Conv``, ``nnx.LayerNorm``, ``nnx.RMSNorm``, ``nnx.BatchNorm``,
``nnx.GroupNorm``; ``nnx.Dropout``, which then joins a swapped Linear before it) to jaxact's
subclass of it, setting the attributes jaxact's ``__init__`` adds to
their defaults: the object and its Variables stay the same, so an ``nnx.Optimizer`` built on the
model, its state and checkpoints carry over. An ``nnx.MultiHeadAttention`` whose ``attention_fn``
is Flax's gets jaxact's. What jaxact's layer would not compute as Flax does (a custom
``dot_general``, statistics across devices, ...) and subclasses of Flax's layers (their own code)
are left, and the report says why.

The swapped classes below are jaxact's layers plus two things a user's code needs: a layer with
no activation offers its output to :func:`activations.offer`, so that under
:func:`route_activations` ``nnx.relu(self.linear(x))`` runs as one fused op; and a call jaxact's
op refuses (a norm's ``mask``) runs Flax's own call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import attention as flax_attention
from jax import lax

from jaxact._src.attention.nnx import nnx_dot_product_attention
from jaxact._src.fused import nnx as fused_nnx
from jaxact._src.norm_act import api as norm_act_api
from jaxact._src.norm_act import nnx as norm_act_nnx
from jaxact._src.norms import nnx as norms_nnx
from jaxact._src.swap import activations, attention, from_x_hat
from jaxact._src.swap.report import Report

_WHERE = "_jaxact_where"  # the swapped instance's path, named in the fusion's report


def _with(layer, call: tp.Callable[[], tp.Any], attributes: dict[str, tp.Any]):
  """`call()` (jaxact's layer call) with the layer's `attributes` (its activation, its dropout)
  set for this call only.

  The attributes are static and restored before returning, so nnx's transforms see no change."""
  saved = {name: getattr(layer, name) for name in attributes}
  for name, value in attributes.items():
    object.__setattr__(layer, name, value)
  try:
    return call()
  finally:
    for name, value in saved.items():
      object.__setattr__(layer, name, value)


def _with_activation(layer, call: tp.Callable[[], tp.Any], activation, dropout=None):
  """`call()` with the layer's activation `activation`; `dropout` ``(rate, key, broadcast_dims)``
  (a layer with jaxact's dropout attributes only): then `call(deterministic=False, rngs=key)`
  with that dropout."""
  attributes = {"activation": "identity" if activation is None else activation}
  if dropout is None:
    return _with(layer, call, attributes)
  rate, key, dims = dropout
  attributes |= {"dropout_rate": rate, "dropout_broadcast_dims": dims}
  return _with(layer, functools.partial(call, deterministic=False, rngs=key), attributes)


def _offer(layer, y, what: str, op: str, call, drops: bool = False, split=None, note="") -> None:
  """Offer `y` for fusion with the activation it goes into (only while a routing is active);
  `drops`: then with an ``nnx.Dropout`` after it; `split`: a norm's (``activations.offer``)."""
  if layer.activation == "identity" and activations.current() is not None:
    fuse = functools.partial(_with_activation, layer, call)
    where = getattr(layer, _WHERE, "")
    activations.offer(
      y, where=where, what=what, op=op, fuse=fuse, drops=drops, split=split, note=note
    )


class Linear(fused_nnx.LinearAct):
  """``flax.nnx.Linear`` swapped: :class:`jaxact.nnx.LinearAct` whose output, under
  :func:`route_activations`, fuses with the activation it goes straight into."""

  def __call__(self, inputs, out_sharding=None, **kwargs):
    y = super().__call__(inputs, out_sharding, **kwargs)
    if self.dropout_rate == 0:
      call = functools.partial(fused_nnx.LinearAct.__call__, self, inputs, out_sharding)
      source = from_x_hat.nnx_source(self, inputs, kwargs)
      if source is not None:
        call = from_x_hat.nnx_call(
          self, source, lambda m, z, **k: fused_nnx.LinearAct.__call__(m, z, out_sharding, **k)
        )
        y = call()
      note = from_x_hat.NOTE if source is not None else ""
      _offer(self, y, "flax.nnx.Linear", "dense_bias_act", call, drops=True, note=note)
    return y


class Conv(fused_nnx.ConvAct):
  """``flax.nnx.Conv`` swapped: :class:`jaxact.nnx.ConvAct`, offered for fusion as ``Linear``."""

  def __call__(self, inputs, out_sharding=None):
    y = super().__call__(inputs, out_sharding)
    call = functools.partial(fused_nnx.ConvAct.__call__, self, inputs, out_sharding)
    source = from_x_hat.nnx_source(self, inputs, {})
    if source is not None:
      call = from_x_hat.nnx_call(
        self, source, lambda m, z, **k: fused_nnx.ConvAct.__call__(m, z, out_sharding, **k)
      )
      y = call()
    note = from_x_hat.NOTE if source is not None else ""
    _offer(self, y, "flax.nnx.Conv", "conv_bias_act", call, note=note)
    return y


class LayerNorm(norms_nnx.LayerNorm):
  """``flax.nnx.LayerNorm`` swapped: :class:`jaxact.nnx.LayerNorm`; a `mask` runs Flax's call."""

  def __call__(self, x, *, mask=None, out_sharding=None):
    if mask is not None:  # one statistic over a masked row: jaxact's op has none
      return nnx.LayerNorm.__call__(self, x, mask=mask)
    return super().__call__(x, out_sharding=out_sharding)


class RMSNorm(norms_nnx.RMSNorm):
  """``flax.nnx.RMSNorm`` swapped: :class:`jaxact.nnx.RMSNorm`; a `mask` runs Flax's call."""

  def __call__(self, x, mask=None, *, out_sharding=None):
    if mask is not None:
      return nnx.RMSNorm.__call__(self, x, mask)
    return super().__call__(x, out_sharding=out_sharding)


class BatchNorm(norm_act_nnx.BatchNorm):
  """``flax.nnx.BatchNorm`` swapped: :class:`jaxact.nnx.BatchNorm`, offered for fusion with the
  activation after it (the batch statistics then updated once, by the fused call); a `mask` runs
  Flax's call."""

  def __call__(self, x, use_running_average=None, *, mask=None):
    if mask is not None:
      return nnx.BatchNorm.__call__(self, x, use_running_average, mask=mask)
    before = (self.mean[...], self.var[...])
    y = super().__call__(x, use_running_average)

    def from_before(call, keep: bool):
      """`call()` on the statistics as they were before this call: its updates kept (`keep`: the
      fused call's, which replaces this one), else the statistics given back as they are."""
      after = (self.mean[...], self.var[...])
      self.mean[...], self.var[...] = before
      try:
        out = call()
      except Exception:
        self.mean[...], self.var[...] = after
        raise
      if not keep:
        self.mean[...], self.var[...] = after
      return out

    fused = functools.partial(norm_act_nnx.BatchNorm.__call__, self, x, use_running_average)
    again = functools.partial(from_before, fused, True)
    plain = functools.partial(
      norm_act_nnx.BatchNorm._run, self, x, use_running_average, None, affine=False
    )
    normalized = functools.partial(from_before, plain, False)  # x_hat, scale, bias
    name = "jaxact.nnx.BatchNorm"
    axes = norm_act_api.canonical_axes(name, self.axis, x.ndim)
    split = from_x_hat.split(name, axes, normalized)
    _offer(self, y, "flax.nnx.BatchNorm", "batch_norm_act", again, split=split)
    return y


class GroupNorm(norm_act_nnx.GroupNorm):
  """``flax.nnx.GroupNorm`` swapped: :class:`jaxact.nnx.GroupNorm`, offered for fusion with the
  activation after it; a `mask` runs Flax's call."""

  def __call__(self, x, *, mask=None):
    if mask is not None:
      return nnx.GroupNorm.__call__(self, x, mask=mask)
    y = super().__call__(x)
    call = functools.partial(norm_act_nnx.GroupNorm.__call__, self, x)
    normalized = functools.partial(norm_act_nnx.GroupNorm._run, self, x, None, affine=False)
    split = from_x_hat.split("jaxact.nnx.GroupNorm", (x.ndim - 1,), normalized)
    _offer(self, y, "flax.nnx.GroupNorm", "group_norm_act", call, split=split)
    return y


class Dropout(nnx.Dropout):
  """``flax.nnx.Dropout`` swapped: under :func:`route_activations`, a dropout of exactly the output
  of a swapped ``nnx.Linear`` (or of its fused activation) joins that op, with the key nnx's call
  would draw and nnx's formula (the same bits), so that no mask is kept; any other call is
  ``nnx.Dropout``'s own."""

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
    decided = deterministic if deterministic is not None else self.deterministic
    stream = rngs if rngs is not None else self.rngs
    if decided is not False or not 0 < self.rate < 1 or activations.offered(inputs) is None:
      return nnx.Dropout.__call__(self, inputs, deterministic=deterministic, rngs=rngs)
    if isinstance(stream, nnx.Rngs):
      key = stream[self.rng_collection]()
    elif isinstance(stream, nnx.RngStream):
      key = stream()
    elif isinstance(stream, jax.Array):
      key = stream
    else:  # nnx's call raises its own error
      return nnx.Dropout.__call__(self, inputs, deterministic=deterministic, rngs=rngs)
    return activations.dropped(inputs, self.rate, key, self.broadcast_dims, "flax.nnx.Dropout")


# -------------------------------------------------------------------------- what swap takes


def _float_or_none(dtype) -> bool:
  return dtype is None or jnp.issubdtype(dtype, jnp.floating)


def _dense_refusal(layer, product: str) -> str:
  """Why jaxact's fused op would not compute `layer` (a Linear or Conv) as Flax does, or ""."""
  if getattr(layer, product) is not getattr(lax, product):
    return f"a custom {product} (jaxact's op computes lax.{product})"
  if not _float_or_none(layer.preferred_element_type):
    return f"preferred_element_type={layer.preferred_element_type!r}: not a float dtype"
  if not _float_or_none(layer.param_dtype) or not _float_or_none(layer.dtype):
    return f"param_dtype={layer.param_dtype!r}, dtype={layer.dtype!r}: not float dtypes"
  return ""


def _taken(layer) -> str:
  return ""


def _axes(axes) -> tuple:
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _norm_refusal(layer) -> str:
  if layer.axis_name is not None or layer.axis_index_groups is not None:
    return f"axis_name={layer.axis_name!r}: statistics across devices"
  if _axes(layer.feature_axes) != _axes(layer.reduction_axes):
    return (
      f"feature_axes={layer.feature_axes!r} is not reduction_axes={layer.reduction_axes!r} (one "
      "parameter per normalized element)"
    )
  return ""


@dataclasses.dataclass(frozen=True)
class _Kind:
  flax: type
  swapped: type
  ran: str
  added: dict[str, tp.Any]  # the attributes jaxact's __init__ sets, at its defaults
  refusal: tp.Callable[[tp.Any], str]


_KINDS = (
  _Kind(
    nnx.Linear,
    Linear,
    "jaxact.nnx.LinearAct",
    {
      "activation": "identity",
      "residual_bits": None,
      "dropout_rate": 0.0,
      "dropout_broadcast_dims": (),
      "deterministic": False,
      "rng_collection": "dropout",
      "rngs": nnx.data(None),
    },
    functools.partial(_dense_refusal, product="dot_general"),
  ),
  _Kind(
    nnx.Conv,
    Conv,
    "jaxact.nnx.ConvAct",
    {"activation": "identity", "residual_bits": None},
    functools.partial(_dense_refusal, product="conv_general_dilated"),
  ),
  _Kind(
    nnx.LayerNorm,
    LayerNorm,
    "jaxact.nnx.LayerNorm",
    {"residual": "output", "scale_offset": 0.0},
    _norm_refusal,
  ),
  _Kind(
    nnx.RMSNorm,
    RMSNorm,
    "jaxact.nnx.RMSNorm",
    {"residual": "output", "scale_offset": 0.0},
    _norm_refusal,
  ),
  _Kind(nnx.BatchNorm, BatchNorm, "jaxact.nnx.BatchNorm", {"activation": "identity"}, _taken),
  _Kind(nnx.Dropout, Dropout, "jaxact's dense op before it (route_activations)", {}, _taken),
  _Kind(nnx.GroupNorm, GroupNorm, "jaxact.nnx.GroupNorm", {"activation": "identity"}, _taken),
)
_BY_TYPE = {kind.flax: kind for kind in _KINDS}
_FLAX_ATTENTION = flax_attention.dot_product_attention


@functools.wraps(nnx_dot_product_attention)
def _attention_fn(query, key, value, *args, **kwargs):
  """jaxact's ``attention_fn`` with Flax's value for a row whose every key is masked."""
  out = nnx_dot_product_attention(query, key, value, *args, **kwargs)
  mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
  return attention.keyless_rows_as_flax(out, value, mask)


def _flax_name(cls: type) -> str:
  short = f"flax.nnx.{cls.__name__}"
  return short if getattr(nnx, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__name__}"


def _visit(node, where: str, report: Report) -> None:
  """Swap `node` (a module of the model at `where`) if it is one of Flax's that jaxact takes."""
  cls = type(node)
  if cls.__module__.startswith("jaxact."):
    return  # jaxact's already
  kind = _BY_TYPE.get(cls)
  if kind is not None:
    what = _flax_name(cls)
    why = kind.refusal(node)
    if why:
      report.add(where, what, None, why)
      return
    node.__class__ = kind.swapped
    for name, value in kind.added.items():
      setattr(node, name, value)
    setattr(node, _WHERE, where)
    report.add(where, what, kind.ran)
  elif cls is nnx.MultiHeadAttention:
    if node.attention_fn is _FLAX_ATTENTION:
      node.attention_fn = _attention_fn
    if node.attention_fn is _attention_fn:
      report.add(where, "flax.nnx.MultiHeadAttention", "jaxact.nnx.dot_product_attention")
    else:
      report.add(where, "flax.nnx.MultiHeadAttention", None, "a custom attention_fn")
  elif flax := next((k.flax for k in _KINDS if isinstance(node, k.flax)), None):
    why = f"a subclass of {_flax_name(flax)}: its own code is kept"
    report.add(where, f"{cls.__module__}.{cls.__qualname__}", None, why)
  elif cls.__module__.startswith("flax.nnx.nn."):
    report.add(where, _flax_name(cls), None, "jaxact has no layer for it")


def swap(model: nnx.Module, report: bool = False) -> Report:
  """Turn the Flax layers of an nnx `model` into jaxact's, in place; return what was taken and
  left.

  Every instance whose type is exactly ``nnx.Linear``, ``nnx.Conv``, ``nnx.LayerNorm``,
  ``nnx.RMSNorm``, ``nnx.BatchNorm`` or ``nnx.GroupNorm`` becomes jaxact's layer of that name
  (:class:`jaxact.nnx.LinearAct`, ... with no activation): the same object with the same
  Variables, so an ``nnx.Optimizer`` made before or after, its state and checkpoints carry over,
  and ``nnx.state(model)`` is unchanged (``nnx.graphdef(model)`` names jaxact's classes). An
  ``nnx.MultiHeadAttention`` whose ``attention_fn`` is Flax's gets
  :func:`jaxact.nnx.dot_product_attention`. Left, with the reason, and computed by Flax's code as
  before: a custom ``dot_general`` / ``conv_general_dilated`` / ``attention_fn``, non-float
  dtypes, a norm's statistics across devices (``axis_name``), a subclass of one of those layers
  (exact types only), and Flax layers jaxact has none for (``nnx.Embed``, ``nnx.LinearGeneral``,
  ...). A norm called with a ``mask`` runs Flax's call.

  A swapped ``nnx.Linear`` / ``nnx.Conv`` / ``nnx.BatchNorm`` / ``nnx.GroupNorm`` whose output goes
  straight into an activation function (``nnx.relu(self.linear(x))``) runs both as one jaxact op
  when the step is traced under :func:`route_activations`, and an ``nnx.Dropout`` (swapped too) of
  exactly a swapped Linear's output, or its fused activation's, joins that op with the key and
  bits nnx's call would draw.

  Examples:
    >>> from flax import nnx
    >>> from jaxact import nnx as jnnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs))
    >>> print(jnnx.swap(model))
    2 taken, 0 left
         1 x flax.nnx.Linear -> jaxact.nnx.LinearAct
         1 x flax.nnx.LayerNorm -> jaxact.nnx.LayerNorm

  Args:
    model: an ``nnx.Module``, changed in place (call it before tracing the step).
    report: also print the report.

  Returns:
    A :class:`jaxact._src.swap.report.Report`: one ``Call`` per module instance seen, ``where`` its
    path in the model joined by ``/``.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
      f"jaxact.nnx.swap: `model` must be a flax.nnx.Module; got {type(model).__name__} (a "
      "linen model runs under jaxact.linen.intercept instead)"
    )
  if not isinstance(report, bool):
    raise TypeError(f"jaxact.nnx.swap: `report` must be a bool; got {report!r}")
  found = Report()
  modules = [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Module)]
  for path, node in modules:
    _visit(node, "/".join(str(p) for p in path), found)
  if report:
    print(found)
  return found


class _RouteActivations(contextlib.ContextDecorator):
  def __init__(self):
    self.report = Report()
    self._active: list[contextlib.AbstractContextManager] = []

  def __enter__(self) -> Report:
    context = activations.routing(self.report)
    context.__enter__()
    self._active.append(context)
    return self.report

  def __exit__(self, *exc):
    return self._active.pop().__exit__(*exc)


def route_activations() -> _RouteActivations:
  """A context, and decorator, under which jax.nn's and Flax's activation functions run jaxact's,
  and an activation taking a swapped layer's output straight fuses with that layer.

  jit traces the step once: the routing must be active while it is traced, so decorate the
  function that ``nnx.jit`` (or ``jax.jit``) traces, under the jit::

    route = jnnx.route_activations()

    @nnx.jit
    @route
    def train_step(model, optimizer, x, y): ...

  ``route.report`` (also what ``with route as report:`` gives) lists what each trace ran: an
  activation not computed by jaxact (an integer input, an argument it lacks) is left to jax, with
  the reason. The routing holds on the thread that entered it.
  """
  return _RouteActivations()
