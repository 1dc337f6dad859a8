"""The attention's output projection without a second saved copy of O: :func:`project_heads`.

``o.reshape(B, T, N * H) @ w`` differentiated by JAX keeps the reshaped O for ``dw``; under
``lax.scan`` / ``nn.scan`` that is a second stacked copy of the O that
:func:`jaxact.dot_product_attention` keeps (a different array to the scan, though the same
numbers). Contracting O's (N, H) axes directly keeps O itself, the attention's array, once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import ArrayLike

_FN = "jaxact.project_heads"


def _kernel(w: Array, heads: int, head_dim: int) -> Array:
  return w.reshape(heads, head_dim, w.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project(o: Array, w: Array, precision) -> Array:
  k = _kernel(w, *o.shape[-2:])
  return jnp.einsum("...nh,nhd->...d", o, k, precision=precision)


def _project_fwd(o, w, precision):
  return _project(o, w, precision), (o, w)  # the caller's arrays: nothing new is kept


def _project_bwd(precision, res, g):
  o, w = res
  k = _kernel(w, *o.shape[-2:])
  do = jnp.einsum("...d,nhd->...nh", g, k, precision=precision).astype(o.dtype)
  dk = jnp.einsum("...nh,...d->nhd", o, g, precision=precision)
  return do, dk.reshape(w.shape).astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def project_heads(o: ArrayLike, w: ArrayLike, *, precision: lax.PrecisionLike = None) -> Array:
  r"""The attention's output projection: O's heads concatenated, times `w`.

  .. math::
    y_{\ldots d} = \sum_{n, h} o_{\ldots n h} \, w_{(n h) d}

  equal to ``o.reshape(*o.shape[:-2], N * H) @ w`` (or ``jnp.einsum("...nh,nhd->...d", o, w)``
  for a kernel laid out ``(N, H, D)``, as Flax's ``MultiHeadDotProductAttention`` and Gemma keep
  it), but its ``custom_vjp`` keeps only ``o`` and ``w``, the arrays the caller holds: in a stack
  built with ``lax.scan`` / ``nn.scan`` the reshape form keeps a second copy of the O that
  :func:`jaxact.dot_product_attention` keeps, one (B, T, N*H) array a layer.

  Args:
    o: the attention's output, ``(..., N, H)``.
    w: the projection, ``(N * H, D)`` or ``(N, H, D)``.
    precision: of the products, as :func:`jax.lax.dot_general` takes it.

  Returns:
    ``(..., D)`` in the dtype ``o @ w`` has.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxact
    >>> o = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))  # (B, T, N, H)
    >>> w = jax.random.normal(jax.random.key(1), (32, 16))  # (N * H, D)
    >>> y = jaxact.project_heads(o, w)
    >>> bool(jnp.allclose(y, o.reshape(2, 5, 32) @ w, atol=1e-5))
    True
  """
  o, w = jnp.asarray(o), jnp.asarray(w)
  if o.ndim < 2:
    raise ValueError(f"{_FN}: `o` has shape {o.shape}; accepted: (..., heads, head_dim)")
  heads, head_dim = o.shape[-2:]
  accepted = f"({heads * head_dim}, D) or ({heads}, {head_dim}, D) for `o` of shape {o.shape}"
  if w.ndim == 2:
    ok = w.shape[0] == heads * head_dim
  elif w.ndim == 3:
    ok = w.shape[:2] == (heads, head_dim)
  else:
    ok = False
  if not ok:
    raise ValueError(f"{_FN}: `w` has shape {w.shape}; accepted: {accepted}")
  for name, a in (("o", o), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"{_FN}: `{name}` has dtype {a.dtype}; accepted: a floating dtype")
  return _project(o, w, precision)
