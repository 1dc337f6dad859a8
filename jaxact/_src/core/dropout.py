"""Dropout inside a fused op, with the mask drawn again in the backward pass instead of kept.

``nn.Dense -> activation -> nn.Dropout -> nn.Dense``: the second Dense keeps the dropped output
for its weight gradient, and autodiff of the dropout keeps its mask (or the undropped output) as
well. Inside :func:`jaxact.dense_bias_act` the dropout is the op's last step: the op keeps what it
keeps without dropout (the dropped output itself, for output-residual activations: the undropped
``y`` is ``y_d * keep`` wherever the mask is set, and nothing flows back elsewhere) and the key,
and the backward pass draws the same mask from the key (as fused attention kernels do).

The mask is ``jax.random.bernoulli(key, 1 - rate, shape)``, broadcast over `broadcast_dims`, and
the dropped output ``select(mask, y / (1 - rate), 0)``: exactly ``flax.linen.Dropout``'s and
``flax.nnx.Dropout``'s formula, so with the same key the values equal theirs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.extend.random as jax_random
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

# Elements of one block of the mask, drawn and applied in a loop: XLA:CPU materializes threefry's
# counters and outputs, 12-16 bytes an element, which for a whole (tokens x features) output is
# several activations' worth of temp at the backward pass's peak (benchmarks/results/dropin.md).
_BLOCK_ELEMENTS = 1 << 16


def _threefry_mask(data: Array, keep: float, rows: int, cols: int, start) -> Array:
  """Rows ``[start, start + rows)`` of ``jax.random.bernoulli(key, keep, (M, cols))`` for the
  threefry key `data` (see :func:`keep_from_index`)."""
  index = (lax.iota(np.uint32, rows)[:, None] + jnp.asarray(start, np.uint32)) * np.uint32(cols)
  return keep_from_index(data, keep, index + lax.iota(np.uint32, cols)[None, :])


def keep_from_index(data: Array, keep: float, index: Array) -> Array:
  """The elements at linear indices `index` (uint32) of ``jax.random.bernoulli(key, keep,
  shape)`` for the threefry key `data`, `keep` a Python float as ``nn.Dropout`` passes it
  (float32, or float64 under ``jax_enable_x64``): bit for bit jax's partitionable threefry (the
  default), which draws each element from its linear index, so any block is drawn without the
  rest."""
  k1, k2 = data[..., 0], data[..., 1]
  bits1, bits2 = jax_random.threefry2x32_p.bind(k1, k2, jnp.zeros_like(index), index)
  # jax.random.uniform's floats from random bits: the mantissa's bits in [1, 2), minus 1.
  if jax.config.jax_enable_x64:
    u64 = np.uint64
    bits = bits1.astype(u64) << u64(32) | bits2.astype(u64)
    floats = lax.bitcast_convert_type(bits >> u64(12) | u64(0x3FF0000000000000), np.float64)
    return floats - np.float64(1) < np.float64(keep)
  mantissa = (bits1 ^ bits2) >> np.uint32(9) | np.uint32(0x3F800000)
  floats = lax.bitcast_convert_type(mantissa, np.float32)
  return floats - np.float32(1) < np.float32(keep)


@dataclasses.dataclass(frozen=True)
class Dropout:
  """Static description of one dropout: its rate, shared-mask dims and key type.

  ``impl`` is the PRNG implementation of a typed key (``jax.random.key``), None for a raw
  ``uint32`` key (``jax.random.PRNGKey``); the key travels as its raw data, so that it can go
  through ``custom_vjp`` and optimization barriers.
  """

  rate: float
  broadcast_dims: tuple[int, ...] = ()
  impl: Any = None

  @property
  def keep(self) -> float:
    return 1.0 - self.rate

  @property
  def threefry(self) -> bool:
    return self.impl is None or str(self.impl) == "threefry2x32"

  def mask(self, data: Array, shape: tuple[int, ...]) -> Array:
    """The boolean keep mask of an output of `shape`, drawn from the key `data`: the mask
    ``nn.Dropout`` draws with this key."""
    drawn = tuple(1 if d in self.broadcast_dims else n for d, n in enumerate(shape))
    if self.threefry and math.prod(drawn) < 2**32:
      cols = drawn[-1] if drawn else 1
      flat = _threefry_mask(data, self.keep, math.prod(drawn) // max(cols, 1), cols, 0)
      m = flat.reshape(drawn)
    else:
      key = data if self.impl is None else jax.random.wrap_key_data(data, impl=self.impl)
      m = jax.random.bernoulli(key, p=self.keep, shape=drawn)
    return jnp.broadcast_to(m, shape)

  def apply(self, mask: Array, y: Array) -> Array:
    """Flax's dropout of `y` by `mask` (scaled by ``1 / keep``, in `y`'s dtype)."""
    return lax.select(mask, y / jnp.asarray(self.keep, y.dtype), jnp.zeros_like(y))

  def by_blocks(
    self, data: Array, arrays, fn, out_dtype, *, blocked: bool = True, reuse: int | None = None
  ) -> Array:
    """``fn(mask, *arrays)`` for arrays of the output's shape, in blocks of rows when the mask
    can be drawn a block at a time (a threefry key, no shared-mask dims, `blocked`), else whole.

    `fn` is elementwise; the result has `out_dtype` and, in blocks, is written over
    ``arrays[reuse]`` where that array has `out_dtype` (an array the caller does not need after:
    no second output-sized buffer). Both passes of an op go through here, so the blocks and the
    whole draw the very same mask.
    """
    shape = arrays[0].shape
    cols = shape[-1] if shape else 1
    rows = math.prod(shape) // max(cols, 1)
    block = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    whole = not (blocked and self.threefry and not self.broadcast_dims)
    if whole or rows <= block or rows * cols >= 2**32:
      return fn(self.mask(data, shape), *arrays).astype(out_dtype)
    flat = [a.reshape(rows, cols) for a in arrays]

    def apply(start, size, out, flat):
      chunks = [lax.dynamic_slice_in_dim(a, start, size) for a in flat]
      mask = _threefry_mask(data, self.keep, size, cols, start)
      return lax.dynamic_update_slice_in_dim(out, fn(mask, *chunks).astype(out_dtype), start, 0)

    carried = reuse is not None and flat[reuse].dtype == out_dtype
    out = flat[reuse] if carried else jnp.zeros((rows, cols), out_dtype)

    def current(out):  # in place, the block is read from the carry before it is overwritten
      return [out if carried and j == reuse else a for j, a in enumerate(flat)]

    n, tail = divmod(rows, block)
    out = lax.fori_loop(0, n, lambda i, out: apply(i * block, block, out, current(out)), out)
    if tail:  # the last rows, a shorter block
      out = apply(n * block, tail, out, current(out))
    return out.reshape(shape)


def check(fn_name: str, rate, rng, broadcast_dims, ndim: int) -> tuple[Dropout | None, Any]:
  """``(Dropout or None, the key's raw data or None)`` from the public arguments, checked.

  A rate of 0 is no dropout (the key is not needed, as in Flax); a rate of 1 drops everything.
  """
  if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate <= 1.0:
    raise ValueError(
      f"jaxact.{fn_name}: `dropout_rate` must be a Python float in [0, 1] (the probability of "
      f"dropping an element); got {rate!r}"
    )
  try:
    dims = tuple(int(d) for d in broadcast_dims)
  except TypeError:
    dims = None
  if dims is None or any(not -ndim <= d < ndim for d in dims):
    raise ValueError(
      f"jaxact.{fn_name}: `dropout_broadcast_dims` must be a sequence of axes of the {ndim}-d "
      f"output (from {-ndim} to {ndim - 1}), the axes that share one mask; got {broadcast_dims!r}"
    )
  if rate == 0:
    return None, None
  if rng is None:
    raise ValueError(
      f"jaxact.{fn_name}: `dropout_rng` is required when dropout_rate > 0 (got rate {rate}): a "
      "key from jax.random.key (or jax.random.PRNGKey)"
    )
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and rng.ndim == 0:
    impl, data = jax.random.key_impl(rng), jax.random.key_data(rng)
  elif dtype is not None and np.dtype(dtype) == np.uint32 and rng.ndim == 1:
    impl, data = None, rng
  else:
    raise TypeError(
      f"jaxact.{fn_name}: `dropout_rng` must be one PRNG key (jax.random.key(...), or a raw "
      f"uint32 jax.random.PRNGKey(...)); got {type(rng).__name__} of dtype {dtype} and shape "
      f"{getattr(rng, 'shape', None)}"
    )
  return Dropout(float(rate), tuple(sorted({d % ndim for d in dims})), impl), data
