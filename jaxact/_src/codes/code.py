"""Few-bit derivative codes: what an input-residual activation keeps instead of its input.

gelu, gelu_quick, silu, mish and hard_silu cannot be differentiated from their output, so by
default they keep their input ``x``. The backward pass needs only ``f'(x)``, a bounded function of
one variable, and ``residual_bits`` keeps that instead, in 8, 4 or 2 bits an element:

* 8 bits: ``f'(x)`` quantized uniformly over its exact range ``[lo, hi]`` (255 steps; the error is
  at most half a step), ``f'`` evaluated by the spec's ``d_code`` (one exponential, within 2e-6).
* 4 and 2 bits: the optimal piecewise-constant approximation of ``f'`` with ``2**bits`` pieces
  (Few-Bit Backward, Novikov et al., ICML 2023): boundaries on ``x`` and one level per interval,
  chosen to minimise ``E[(f'(x) - q(x))^2]`` for a standard normal ``x``. The code of ``x`` is the
  number of boundaries below it.

Codes are packed 8 / bits to a byte along the last axis (flattened when that axis does not fill
bytes). The tables are derived from the spec table's derivatives
(:func:`jaxact._src.codes.derive.derive`) and stored in ``table.py`` (``python -m
jaxact._src.codes.derive`` regenerates it; a test re-derives and checks optimality).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxact._src.core.spec import SPECS, ActivationSpec

BITS = (8, 4, 2)
# The activations a code serves: the elementwise ones that keep their input.
CODED: tuple[str, ...] = tuple(s.name for s in SPECS if s.elementwise and s.residual == "input")


def param_combinations(spec: ActivationSpec) -> list[tuple[tuple[str, Any], ...]]:
  """Every value combination of the static parameters (gelu's ``approximate``) the table covers."""
  combos: list[tuple[tuple[str, Any], ...]] = [()]
  for p in spec.params:
    if not p.static or not isinstance(p.default, bool):
      raise NotImplementedError(f"no code table for {spec.name}'s parameter {p.name}")
    combos = [(*c, (p.name, v)) for c in combos for v in (True, False)]
  return combos


@dataclasses.dataclass(frozen=True)
class Code:
  """One activation's code at one bit width (hashable: it is part of the jit-static rule).

  ``bits == 8``: ``levels == (lo, hi)``, the range of ``f'``, and no boundaries. Otherwise
  ``len(boundaries) == 2**bits - 1`` ascending thresholds on ``x`` and ``len(levels) == 2**bits``.
  """

  bits: int
  boundaries: tuple[float, ...]
  levels: tuple[float, ...]

  @property
  def max_error(self) -> float | None:
    """The 8-bit code's bound on ``|f'(x) - decoded|`` (half a step); None for 4 and 2 bits."""
    if self.bits != 8:
      return None
    lo, hi = self.levels
    return (hi - lo) / 255 / 2

  def encode(self, x: Array, derivative: Callable[[Array], Array]) -> Array:
    """uint8 codes of `x` (compute dtype), unpacked, of x's shape."""
    if self.bits == 8:
      lo, hi = self.levels
      q = jnp.round((derivative(x) - lo) * (255.0 / (hi - lo)))
      # A NaN derivative (NaN x) gives code 0: the value y is NaN there already.
      return jnp.clip(jnp.where(q == q, q, 0.0), 0, 255).astype(jnp.uint8)
    # A branchless binary search, each step's boundary picked by a select tree on the bits
    # found so far: `bits` compares and 2**bits - 1 - bits selects, all elementwise, so XLA fuses
    # them into the forward's loop (a compare per boundary took twice as long at 4 bits).
    found: list[Array] = []  # the code's bits, most significant first
    for k in reversed(range(self.bits)):
      step = 1 << k
      candidates = [jnp.asarray(t, x.dtype) for t in self.boundaries[step - 1 :: 2 * step]]
      found.append(x > _select_tree(found, candidates))
    code = jnp.zeros(x.shape, jnp.uint8)
    for k, bit in zip(reversed(range(self.bits)), found, strict=True):
      code = code | (bit.astype(jnp.uint8) << jnp.uint8(k))
    return code

  def decode(self, codes: Array, dtype) -> Array:
    """``f'`` as the code gives it, in `dtype`, from unpacked codes."""
    if self.bits == 8:
      lo, hi = self.levels
      return lo + codes.astype(dtype) * ((hi - lo) / 255.0)
    # A select tree on the code's bits (2**bits - 1 selects, elementwise; a gather from a table
    # is not fused on CPU, and a compare per level took twice as long at 4 bits).
    bits = [(codes >> jnp.uint8(k)) & jnp.uint8(1) == 1 for k in reversed(range(self.bits))]
    return _select_tree(bits, [jnp.asarray(v, dtype) for v in self.levels])

  # ------------------------------------------------------------------------------- packing

  def per_byte(self) -> int:
    return 8 // self.bits

  def pack(self, codes: Array) -> Array:
    """Codes packed ``8 // bits`` to a byte: along the last axis when its length is a multiple,
    else flattened (zero-padded to whole bytes)."""
    per = self.per_byte()
    if per == 1:
      return codes
    if codes.ndim and codes.shape[-1] % per == 0:
      groups = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    else:
      flat = codes.reshape(-1)
      flat = jnp.pad(flat, (0, -flat.size % per))
      groups = flat.reshape(-1, per)
    packed = groups[..., 0]
    for j in range(1, per):
      packed = packed | (groups[..., j] << jnp.uint8(j * self.bits))
    return packed

  def unpack(self, packed: Array, shape: tuple[int, ...], fn=None) -> Array:
    """The unpacked codes of an array of `shape` from :meth:`Code.pack`'s bytes, or `fn` of them.

    `fn` (elementwise, e.g. the decoding) is applied before the groups of a byte are laid out
    in a row: XLA then fuses the whole into one loop, where unpacking first materializes them.
    """
    fn = fn or (lambda codes: codes)
    per = self.per_byte()
    if per == 1:
      return fn(packed)
    mask = jnp.uint8((1 << self.bits) - 1)
    shifts = jnp.arange(per, dtype=jnp.uint8) * jnp.uint8(self.bits)
    values = fn((packed[..., None] >> shifts) & mask)
    if len(shape) and shape[-1] % per == 0:
      return values.reshape(shape)
    return values.reshape(-1)[: math.prod(shape)].reshape(shape)

  def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    per = self.per_byte()
    if per == 1:
      return shape
    if len(shape) and shape[-1] % per == 0:
      return (*shape[:-1], shape[-1] // per)
    return (-(-math.prod(shape) // per),)


def _select_tree(bits: list[Array], values: list[Array]) -> Array:
  """``values[i]``, ``i`` the number the predicates `bits` spell (most significant first);
  ``len(values) == 2 ** len(bits)``."""
  for bit in reversed(bits):  # least significant first: neighbours pair up
    values = [jnp.where(bit, hi, lo) for lo, hi in zip(values[::2], values[1::2], strict=True)]
  (value,) = values
  return value


def get_code(name: str, params: tuple[tuple[str, Any], ...], bits: int) -> Code:
  """The stored code of activation `name` with static `params` at `bits`."""
  from jaxact._src.codes.table import TABLE

  boundaries, levels = TABLE[(name, tuple(params), bits)]
  return Code(bits, tuple(boundaries), tuple(levels))


def check_bits(fn_name: str, spec_name: str, bits) -> int | None:
  """`residual_bits` validated for activation `spec_name`: None, 8, 4 or 2."""
  if bits is None:
    return None
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BITS:
    raise ValueError(
      f"jaxact.{fn_name}: `residual_bits` must be None (keep the input), 8, 4 or 2; got {bits!r}"
    )
  if spec_name not in CODED:
    raise ValueError(
      f"jaxact.{fn_name}: `residual_bits` applies to the activations that keep their input "
      f"({', '.join(CODED)}); jaxact.{spec_name} keeps its output or nothing, which a derivative "
      "code cannot undercut, so residual_bits must be None for it"
    )
  return int(bits)
