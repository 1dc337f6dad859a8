"""``jaxact.nnx.LMHead``: ``nnx.Linear`` whose call with labels returns the fused loss; and
:func:`attend_cross_entropy`, the fused loss of a head tied to an ``nnx.Embed``."""

from __future__ import annotations

from typing import Any, Literal

import jax
from flax import nnx
from jax import lax

from jaxact._src.lce import api as lce
from jaxact._src.lce.api_checks import check_tied_options


class LMHead(nnx.Linear):
  """A language model's output layer: ``nnx.Linear`` that, given labels, returns the loss instead.

  Exactly ``flax.nnx.Linear`` (it subclasses it: the same arguments, attributes and parameters,
  ``kernel`` ``(in_features, out_features)`` and ``bias``, drawn from ``rngs`` as ``nnx.Linear``
  draws them, sharding metadata included), with the options of
  :func:`jaxact.linear_cross_entropy` as keyword arguments. Called without labels it returns the
  logits as ``nnx.Linear`` does; with labels (and optionally ``where``) the loss, without ever
  building the logits.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxact.nnx import LMHead
    >>> head = LMHead(4, 11, rngs=nnx.Rngs(0))
    >>> x, labels = jnp.ones((2, 5, 4)), jnp.zeros((2, 5), jnp.int32)
    >>> head(x).shape, head(x, labels).shape
    ((2, 5, 11), ())

  Args:
    in_features, out_features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init,
      dot_general, promote_dtype, preferred_element_type, rngs, kernel_metadata, bias_metadata:
      as ``nnx.Linear``. A custom ``dot_general`` or a ``preferred_element_type`` cannot be fused
      with the loss: called with labels, such a head raises.
    reduction, label_smoothing, label_smoothing_style, z_loss, logit_soft_cap,
      return_predictions, implementation: as :func:`jaxact.linear_cross_entropy` (with
      ``return_predictions`` the call with labels returns ``(loss, predictions)``).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    reduction: Literal["mean", "sum", "none"] = "mean",
    label_smoothing: float = 0.0,
    label_smoothing_style: Literal["optax", "t5x"] = "optax",
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
    return_predictions: bool = False,
    implementation: str | None = None,
    **linear_kwargs,
  ):
    super().__init__(in_features, out_features, **linear_kwargs)
    self.reduction = reduction
    self.label_smoothing = label_smoothing
    self.label_smoothing_style = label_smoothing_style
    self.z_loss = z_loss
    self.logit_soft_cap = logit_soft_cap
    self.return_predictions = return_predictions
    self.implementation = implementation

  def __call__(
    self, inputs: jax.Array, labels=None, *, where=None, weights=None, out_sharding=None
  ):
    """The logits ``inputs @ kernel + bias`` (no labels), or the loss against `labels`.

    Args:
      inputs: ``(..., in_features)``.
      labels: None, or integer class indices of shape ``inputs.shape[:-1]``.
      where: with labels, the tokens that count (bool, broadcastable to the labels' shape).
      weights: with labels, each token's weight (see :func:`jaxact.linear_cross_entropy`).
      out_sharding: as ``nnx.Linear``, for the logits only.
    """
    if labels is None:
      if where is not None or weights is not None:
        raise ValueError("jaxact.nnx.LMHead: `where` / `weights` given without `labels`")
      return super().__call__(inputs, out_sharding=out_sharding)
    if self.dot_general is not lax.dot_general or self.preferred_element_type is not None:
      raise NotImplementedError(
        "jaxact.nnx.LMHead: a custom `dot_general` or a `preferred_element_type` cannot be fused "
        "with the loss; call the head without labels for the logits and compute the loss from them"
      )
    if out_sharding is not None:
      raise ValueError("jaxact.nnx.LMHead: `out_sharding` applies to the logits (no labels) only")
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    return lce.linear_cross_entropy(
      inputs,
      kernel,
      labels,
      bias=bias,
      where=where,
      weights=weights,
      reduction=self.reduction,
      label_smoothing=self.label_smoothing,
      label_smoothing_style=self.label_smoothing_style,
      z_loss=self.z_loss,
      logit_soft_cap=self.logit_soft_cap,
      return_predictions=self.return_predictions,
      precision=self.precision,
      implementation=self.implementation,
    )


def attend_cross_entropy(
  embed: nnx.Embed, query: jax.Array, labels: jax.Array, **options: Any
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """The loss of the logits ``embed.attend(query)`` against `labels`, without the logits.

  A tied head: ``nnx.Embed.attend`` is ``query @ embedding.T``, the token embedding table
  ``(num_embeddings, features)`` used as the output layer. This is
  ``linear_cross_entropy(query, embedding, labels, w_layout="vd", **options)`` after the
  embedding's own dtype promotion: the loop reads the table by rows, so neither the logits nor a
  transposed copy of the table exists, and the table's gradient comes back in its own layout.

  Example usage::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import jaxact.nnx as jnnx
    >>> embed = nnx.Embed(11, 4, rngs=nnx.Rngs(0))
    >>> query, labels = jnp.ones((2, 4)), jnp.array([3, 7])
    >>> loss, predictions = jnnx.attend_cross_entropy(
    ...   embed, query, labels, return_predictions=True
    ... )
    >>> bool((predictions == jnp.argmax(embed.attend(query), -1)).all())
    True

  Args:
    embed: an ``nnx.Embed``.
    query: ``(..., features)``, the final norm's output.
    labels: integer class indices of shape ``query.shape[:-1]``.
    **options: :func:`jaxact.linear_cross_entropy`'s keyword arguments (``where``, ``weights``,
      ``reduction``, ``label_smoothing``, ``z_loss``, ``logit_soft_cap``,
      ``return_predictions``, ...), but ``w_layout``.
  """
  fn = "jaxact.nnx.attend_cross_entropy"
  if not isinstance(embed, nnx.Embed):
    raise TypeError(f"{fn}: `embed` must be a flax.nnx.Embed; got {type(embed).__name__}")
  check_tied_options(fn, options)
  query, embedding = embed.promote_dtype((query, embed.embedding[...]), dtype=embed.dtype)
  return lce.linear_cross_entropy(query, embedding, labels, w_layout="vd", **options)
