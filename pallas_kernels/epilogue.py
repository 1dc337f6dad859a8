"""The activation as every kernel takes it: forward and derivative functions, and the residual;
and a gated unit's products of it, as the gated kernels form them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax.numpy as jnp
from jax import Array, lax

Residual = Literal["output", "input", "none", "code"]


@dataclasses.dataclass(frozen=True)
class DerivativeCode:
  """A few-bit code of ``act'(z)``, kept instead of ``z``, as the kernels write and read it.

  ``bits == 8``: ``levels == (lo, hi)`` and the code is ``act'(z)`` rounded (half to even) onto
  255 uniform steps of ``[lo, hi]``. 4 and 2 bits: ``2**bits - 1`` ascending ``boundaries`` on
  ``z``, the code is the number of them below ``z`` and decodes to ``levels[code]``. Codes are
  packed ``8 // bits`` to a byte along the last axis, code ``j`` of a group at bits ``j * bits``;
  the kernels need that axis (the features) to be a multiple of :meth:`DerivativeCode.per_byte`.

  Every operation below is elementwise or a reshape of a tile, written so that the Triton backend
  lowers it and gives exactly the bytes and values of the same formulas evaluated by XLA.
  """

  bits: int
  boundaries: tuple[float, ...]
  levels: tuple[float, ...]

  def per_byte(self) -> int:
    return 8 // self.bits

  def packed_cols(self, cols: int) -> int:
    """Bytes a row of `cols` codes takes (`cols` a multiple of :meth:`DerivativeCode.per_byte`)."""
    return cols // self.per_byte()

  def unsupported(self, features: int) -> str | None:
    """Why the kernels cannot keep this code for rows of `features` values, or None."""
    per = self.per_byte()
    if features % per:
      return (
        f"{self.bits}-bit codes are packed {per} to a byte along the features, and {features} "
        f"features are not a multiple of {per}"
      )
    return None

  def encode(
    self, z: Array, derivative: Callable[[Array], Array], *, native_round: bool = False
  ) -> Array:
    """int32 codes of a float32 tile `z`; `native_round`: round with ``jnp.round`` (Mosaic GPU
    lowers it, Triton does not), else from ``floor`` (Triton lowers it, Mosaic GPU does not)."""
    if self.bits == 8:
      lo, hi = self.levels
      v = (derivative(z) - lo) * (255.0 / (hi - lo))
      v = jnp.where(v == v, v, 0.0)  # NaN gives code 0
      v = jnp.minimum(jnp.maximum(v, 0.0), 255.0)
      if native_round:
        return jnp.round(v).astype(jnp.int32)
      # Round half to even, as jnp.round: exact here, since v is in [0, 255] and so is its floor.
      r = jnp.floor(v)
      frac = v - r
      odd = r - 2.0 * jnp.floor(0.5 * r)
      r = jnp.where((frac > 0.5) | ((frac == 0.5) & (odd == 1.0)), r + 1.0, r)
      return r.astype(jnp.int32)
    code = jnp.zeros(z.shape, jnp.int32)
    for t in self.boundaries:
      code = code + (z > t).astype(jnp.int32)
    return code

  def decode(self, codes: Array) -> Array:
    """float32 ``act'`` of an integer tile of codes."""
    if self.bits == 8:
      lo, hi = self.levels
      return lo + codes.astype(jnp.float32) * ((hi - lo) / 255.0)
    out = jnp.full(codes.shape, self.levels[0], jnp.float32)
    for i, level in enumerate(self.levels[1:], 1):
      out = jnp.where(codes == i, jnp.float32(level), out)
    return out

  def pack(self, codes: Array) -> Array:
    """A ``(rows, cols)`` int32 tile of codes as ``(rows, cols // per_byte)`` bytes (int32)."""
    per = self.per_byte()
    if per == 1:
      return codes
    rows, cols = codes.shape
    shift = (lax.broadcasted_iota(jnp.int32, (cols,), 0) & (per - 1)) * self.bits
    groups = (codes << shift[None, :]).reshape(rows, cols // per, per)
    return jnp.sum(groups, axis=2, dtype=jnp.int32)  # disjoint fields: the sum is their or

  def unpack(self, packed: Array) -> Array:
    """The int32 ``(rows, cols)`` codes of a ``(rows, cols // per_byte)`` tile of bytes."""
    packed = packed.astype(jnp.int32)
    per = self.per_byte()
    if per == 1:
      return packed
    rows, groups = packed.shape
    shift = lax.broadcasted_iota(jnp.int32, (per,), 0) * self.bits
    fields = (packed[:, :, None] >> shift[None, None, :]) & ((1 << self.bits) - 1)
    return fields.reshape(rows, groups * per)


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """The activation, as the kernels apply it (always to float32 values).

  Attributes:
    fn: ``y = fn(z)``, elementwise.
    derivative: ``act'`` from the residual: ``derivative(y)`` for ``residual="output"``,
      ``derivative(z)`` for ``"input"`` and ``"code"`` (which the forward encodes); ignored (may be
      None) for ``"none"`` (identity).
    residual: what the forward keeps for the backward pass: ``"output"`` (``y``), ``"input"``
      (``z``, stored by the forward kernel as a second output), ``"code"`` (``code``'s packed
      bytes of ``act'(z)``, a second uint8 output) or ``"none"``.
    code: the derivative code of ``residual="code"``, else None.
    unbounded: whether ``fn`` overflows float32 for some finite input (selu; leaky_relu with a
      slope beyond 1; celu with a negative alpha): :func:`times_act` then forms ``fn(z) * q``
      where ``fn(z)`` is infinite from the derivative.
  """

  fn: Callable[[Array], Array]
  derivative: Callable[[Array], Array] | None
  residual: Residual
  code: DerivativeCode | None = None
  unbounded: bool = False

  def __post_init__(self):
    if (self.residual == "code") != (self.code is not None):
      raise ValueError(
        f"Epilogue: `code` is given exactly when residual == 'code'; got residual="
        f"{self.residual!r} with code={self.code!r}"
      )

  def kept_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of what the forward keeps for an output of `shape`."""
    if self.residual == "code":
      return (*shape[:-1], self.code.packed_cols(shape[-1]))
    return tuple(shape)

  def kept_dtype(self, dtype):
    return jnp.uint8 if self.residual == "code" else dtype


# ------------------------------------------------------------ a gated unit's products, in-kernel
# As jaxact's numerics and gating: written with the operations every backend lowers (compares,
# selects, products), on float32 tiles.


def safe_mul(p: Array, q: Array) -> Array:
  """``p * q``, but 0 where one factor is 0 and the other infinite (NaN factors give NaN)."""
  zero_inf = ((p == 0) & (jnp.abs(q) == jnp.inf)) | ((jnp.abs(p) == jnp.inf) & (q == 0))
  return jnp.where(zero_inf, 0.0, p * q)


def may_overflow(epilogue: Epilogue) -> bool:
  """Whether ``act(z)`` may overflow float32 for some finite ``z`` and the kernel has the
  derivative to form :func:`times_act`'s product from. Static: the kernels of the others form no
  derivative for it (silu's, gelu's, mish's gated kernels have no registers to spare)."""
  return epilogue.unbounded and epilogue.derivative is not None and epilogue.residual != "none"


def times_act(
  epilogue: Epilogue, y: Array, z: Array, q: Array, slope: Array | None = None, plain=False
) -> Array:
  """``act(z) * q`` from ``y = act(z)``: :func:`safe_mul`, and where ``y`` overflowed for a finite
  ``z`` and ``q != 0``, ``(q z) act'(z)``, finite where the product is, as jaxact's gated path
  forms it. (The table's activations overflow only on a piece linear through 0, where
  ``act(z) = act'(z) z`` and ``|act'(z)| > 1``, so ``q z`` overflows only where the product does;
  or grow as fast as their derivative, which overflows too.) `slope`: ``act'(z)``, where the
  caller has it. `plain`: ``y * q`` alone for an activation that cannot overflow."""
  if not may_overflow(epilogue):
    return y * q if plain else safe_mul(y, q)
  if slope is None:
    slope = epilogue.derivative(y if epilogue.residual == "output" else z)
  over = (jnp.abs(y) == jnp.inf) & (jnp.abs(z) < jnp.inf) & (q != 0)
  return jnp.where(over, (q * z) * slope, safe_mul(y, q))
