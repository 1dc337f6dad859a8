"""The LM head's plain formulas, as a JAX user writes them without jaxact: the full (tokens,
vocabulary) logits ``x @ w + b``, Gemma 2's soft cap, a sampling temperature, and
:func:`jax.nn.log_softmax`. The tests compare jaxact's ops and their gradients (JAX's autodiff of
these) against them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _log_softmax(x, w, *, bias=None, temperature=1.0, logit_soft_cap=None, w_layout="dv"):
  """``log_softmax(c tanh((x @ w + b) / c) / T)`` over the whole vocabulary, in float32 (float64
  for float64 inputs); -inf logits (a bias of -inf) stay -inf under the cap."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  z = jnp.matmul(x, w if w_layout == "dv" else w.T, preferred_element_type=acc)
  if bias is not None:
    z = z + bias.astype(acc)
  if logit_soft_cap is not None:
    z = jnp.where(z == -jnp.inf, z, logit_soft_cap * jnp.tanh(z / logit_soft_cap))
  return jax.nn.log_softmax(z / temperature, axis=-1)


def log_probs_reference(x, w, tokens, *, where=None, **options):
  """``log p(token | x)`` of each position: the token's entry of :func:`jax.nn.log_softmax` of the
  full logits (0 where `where` is False); `options` as :func:`jaxact.linear_log_probs` takes them
  (``bias``, ``temperature``, ``logit_soft_cap``, ``w_layout``)."""
  logp = _log_softmax(x, w, **options)
  picked = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked if where is None else jnp.where(where, picked, 0)


def entropy_reference(x, w, *, where=None, **options):
  """The entropy ``-Σ p log p`` of each position's softmax over the full logits (0 where `where`
  is False), a masked entry (probability 0, log-probability -inf) counting 0: its log is replaced
  by 0 before the product, so that neither the value nor JAX's gradient meets ``0 · -inf``."""
  logp = _log_softmax(x, w, **options)
  finite = jnp.where(jnp.isfinite(logp), logp, 0)
  h = -jnp.sum(jnp.exp(logp) * finite, axis=-1)
  return h if where is None else jnp.where(where, h, 0)
