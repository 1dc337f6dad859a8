"""The argument checks the LM head's public functions share (:func:`jaxact.linear_cross_entropy`,
:func:`jaxact.linear_log_probs` and the post-training losses on them): every error names the
function called, the argument as it calls it, the value and what is accepted. Each check takes
the public function's name `fn` (and, for the class indices, the argument's name: ``labels`` or
``tokens``)."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxact._src.core import dispatch, validation
from jaxact._src.lce.plan import default_block, kernel_block

W_LAYOUTS = ("dv", "vd")


def err(fn: str, msg: str) -> str:
  return f"jaxact.{fn}: {msg}"


def number(
  fn: str, name: str, value, *, low: float, high: float | None = None, low_open=False
) -> float:
  """A static Python number in ``[low, high]`` (``(low, ...`` when `low_open`), else an error."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Real, np.ndarray, Array)
  ):
    raise TypeError(
      err(fn, f"`{name}` must be a Python float; got {type(value).__name__} {value!r}")
    )
  try:
    v = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise TypeError(
      err(
        fn,
        f"`{name}` must be a static Python float (it shapes the computation), not a traced "
        "array; pass it as a number outside jit",
      )
    ) from None
  bad = (
    not math.isfinite(v) or v < low or (low_open and v == low) or (high is not None and v > high)
  )
  if bad:
    lo = f"({low}" if low_open else f"[{low}"
    hi = f"{high}]" if high is not None else "inf)"
    raise ValueError(err(fn, f"`{name}` is {value!r}; accepted: a finite number in {lo}, {hi}"))
  return v


def w_layout(fn: str, layout) -> str:
  if not isinstance(layout, str) or layout not in W_LAYOUTS:
    raise ValueError(
      err(
        fn,
        f"`w_layout` {layout!r} is not known; choose one of: 'dv' (w is (D, V)), 'vd' (w is "
        "(V, D), an embedding table)",
      )
    )
  return layout


def flag(fn: str, name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
      err(fn, f"`{name}` must be a Python bool; got {type(value).__name__} {value!r}")
    )
  return bool(value)


def check_shapes(
  fn: str, x: Array, w: Array, labels: Array, b: Array | None, layout: str, name: str = "labels"
) -> int:
  """The vocabulary size, after checking the shapes against each other (`labels` is the class
  indices' argument, called `name`)."""
  shapes = f"x.shape={x.shape}, w.shape={w.shape}, {name}.shape={labels.shape}"
  if x.ndim < 1:
    raise ValueError(err(fn, f"`x` must have rank >= 1 (..., features); got {shapes}"))
  axes = "(features, vocabulary)" if layout == "dv" else "(vocabulary, features): w_layout='vd'"
  if w.ndim != 2:
    raise ValueError(err(fn, f"`w` must have rank 2 {axes}; got {shapes}"))
  features, vocab = w.shape if layout == "dv" else w.shape[::-1]
  if x.shape[-1] != features:
    raise ValueError(
      err(fn, f"`x` has {x.shape[-1]} features but `w` expects {features} ({shapes}; w is {axes})")
    )
  if vocab == 0:
    raise ValueError(err(fn, f"`w` has an empty vocabulary ({shapes}); accepted: at least 1 class"))
  if labels.shape != x.shape[:-1]:
    raise ValueError(
      err(fn, f"`{name}` must have x's shape without its last axis, {x.shape[:-1]}; got {shapes}")
    )
  if b is not None and b.shape != (vocab,):
    raise ValueError(
      err(fn, f"`bias` has shape {b.shape}; accepted: ({vocab},) (w's vocabulary) or None")
    )
  return vocab


def as_labels(fn: str, labels, name: str = "labels") -> Array:
  labels = validation.as_real_array(fn, labels, name)
  if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.dtype == jnp.bool_:
    raise TypeError(
      err(
        fn,
        f"`{name}` has dtype {labels.dtype}; accepted: an integer dtype (class indices in "
        "[0, vocabulary))",
      )
    )
  return labels


def _broadcast(fn: str, name: str, a: Array, shape, of: str) -> Array:
  try:
    ok = np.broadcast_shapes(a.shape, shape) == shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
      err(fn, f"`{name}` has shape {a.shape}, which does not broadcast to {of}' shape {shape}")
    )
  return jnp.broadcast_to(a, shape)


def as_where(fn: str, where, shape, of: str = "labels", name: str = "where") -> Array | None:
  """`where` (the argument called `name`) as bool of `shape` (the shape of the argument named
  `of`), or None."""
  if where is None:
    return None
  where = validation.as_real_array(fn, where, name)
  if where.dtype != jnp.bool_:
    raise TypeError(err(fn, f"`{name}` has dtype {where.dtype}; accepted: bool (or None)"))
  return _broadcast(fn, name, where, shape, of)


def as_weights(fn: str, weights, shape, dtype) -> Array | None:
  if weights is None:
    return None
  weights = validation.as_real_array(fn, weights, "weights")
  if not (jnp.issubdtype(weights.dtype, jnp.number) or weights.dtype == jnp.bool_) or (
    jnp.issubdtype(weights.dtype, jnp.complexfloating)
  ):
    raise TypeError(
      err(fn, f"`weights` has dtype {weights.dtype}; accepted: a real (float, int or bool) dtype")
    )
  return _broadcast(fn, "weights", weights, shape, "labels").astype(dtype)


def labels_int32(labels: Array, vocab: int) -> Array:
  """`labels` as int32 with every value outside ``[0, V)`` mapped to -1 or V, whatever the
  dtype: converted before clipping where int32 holds every value of the dtype (so that -1 and V
  are not clipped in a dtype that cannot hold them: uint16, int8), clipped in the dtype itself
  where it is wider (int64, uint32, uint64 hold -1 where signed, and V)."""
  info = jnp.iinfo(labels.dtype)
  i32 = jnp.iinfo(jnp.int32)
  if i32.min <= info.min and info.max <= i32.max:
    return jnp.clip(labels.astype(jnp.int32), -1, vocab)
  low = jnp.asarray(max(info.min, -1), labels.dtype)
  return jnp.clip(labels, low, jnp.asarray(vocab, labels.dtype)).astype(jnp.int32)


def _concrete(a) -> bool:
  return a is None or not isinstance(a, jax.core.Tracer)


def check_label_range(
  fn: str,
  labels: Array,
  where: Array | None,
  weights: Array | None,
  vocab,
  name: str = "labels",
  infinite: str = "+inf",
  mask: str = "where",
) -> None:
  """ValueError for counted labels outside ``[0, V)``, when the labels (and `where`, `weights`)
  are concrete values; under ``jit`` they cannot be read and give the `infinite` value instead
  (documented). A token counts where `where` is True and its weight is not 0; `mask` is the name
  the public function gives `where` (its remedy), whose shape is the labels' unless the labels
  are `fn`'s ``teacher_indices`` (a mask of their tokens)."""
  if not (_concrete(labels) and _concrete(where) and _concrete(weights)) or labels.size == 0:
    return
  lab = np.asarray(labels)
  bad = (lab < 0) | (lab >= vocab)
  if where is not None:
    bad &= np.asarray(where)
  if weights is not None:
    bad &= np.asarray(weights) != 0
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      err(
        fn,
        f"`{name}` holds {int(bad.sum())} value(s) outside [0, {vocab}) where they count, e.g. "
        f"{name}[{', '.join(map(str, first))}] = {int(lab[first])}; {_remedy(name, mask)}",
      )
    )


def _remedy(name: str, mask: str) -> str:
  if name == "teacher_indices":  # K a token: `mask` drops whole positions
    return f"drop such positions with `{mask}`"
  return f"mask such tokens with `{mask}` (e.g. {mask}={name} >= 0 for padding of -100)"


def block_size(fn: str, vocab_block_size, tokens: int, vocab: int, implementation) -> int:
  """Columns a block of the vocabulary loop: `vocab_block_size` (at most V), or chosen from the
  sizes and the target (:func:`~jaxact._src.lce.plan.default_block`), whole blocks of the Hopper
  backward kernel's 256 columns for ``"mosaic"``."""
  if vocab_block_size is None:
    target = dispatch.target()
    platform = "gpu" if target.cuda else "tpu" if target.tpu else "cpu"
    block = default_block(tokens, vocab, platform, target.device_kind or "")
    return kernel_block(block, vocab) if implementation == "mosaic" else block
  if (
    isinstance(vocab_block_size, bool)
    or not isinstance(vocab_block_size, (int, np.integer))
    or vocab_block_size < 1
  ):
    raise ValueError(
      err(fn, f"`vocab_block_size` is {vocab_block_size!r}; accepted: a positive int or None")
    )
  return min(int(vocab_block_size), vocab)


def check_tied_options(fn: str, options: dict) -> None:
  """TypeError for options a tied embedding's loss fixes itself (`w_layout`)."""
  if "w_layout" in options:
    raise TypeError(f"{fn}: `w_layout` is the table's own, 'vd'; do not pass it")
