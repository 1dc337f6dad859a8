"""The activation epilogue at a Triton tile: the ``dz`` tile formed from the cotangent and the
kept residual (``g * act'(r)``, a code's derivative decoded from its bytes), what the forward keeps
of a tile, and the check that a code's bytes fill the features. Shared by the dense and the
convolution-epilogue kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels._triton import iota, load_tile, store_tile
from pallas_kernels.epilogue import Epilogue


def _packed_col(c0, code) -> Array:
  """The byte column where the codes of column `c0` (a multiple of the code's group) start."""
  c0 = jnp.asarray(c0)
  return lax.div(c0, jnp.asarray(code.per_byte(), c0.dtype))


def dz_tile(g_ref, r_ref, r0, c0, rows: int, cols: int, epilogue: Epilogue) -> Array:
  """The float32 ``(rows, cols)`` tile of ``dz = g * act'(r)``, formed in registers."""
  g = load_tile(g_ref, r0, c0, rows, cols).astype(jnp.float32)
  if epilogue.residual == "none":
    return g  # out-of-range entries loaded as 0 already
  n_rows, n_cols = g_ref.shape
  inside = ((r0 + iota(rows)) < n_rows)[:, None] & ((c0 + iota(cols)) < n_cols)[None, :]
  if epilogue.residual == "code":
    code = epilogue.code
    packed = load_tile(r_ref, r0, _packed_col(c0, code), rows, code.packed_cols(cols))
    return jnp.where(inside, g * code.decode(code.unpack(packed)), 0.0)
  r = load_tile(r_ref, r0, c0, rows, cols).astype(jnp.float32)
  return jnp.where(inside, g * epilogue.derivative(r), 0.0)


def store_kept(ref, r0, c0, z: Array, epilogue: Epilogue) -> None:
  """Store what the backward pass reads of the float32 tile `z`: z itself, or its code's bytes."""
  if epilogue.residual == "code":
    code = epilogue.code
    store_tile(ref, r0, _packed_col(c0, code), code.pack(code.encode(z, epilogue.derivative)))
  else:
    store_tile(ref, r0, c0, z)


def check_code(where: str, epilogue: Epilogue, features: int) -> None:
  """Raise ValueError when a ``"code"`` epilogue cannot pack rows of `features` codes."""
  if epilogue.residual == "code":
    why = epilogue.code.unsupported(features)
    if why is not None:
      raise ValueError(f"pallas_kernels.{where}: {why}")
