"""``jaxact.linen.LMHead``: ``nn.Dense`` whose call with labels returns the fused loss; and
:func:`attend_cross_entropy`, the fused loss of a head tied to an ``nn.Embed``."""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp
from flax import linen as nn
from flax.typing import Array
from jax import lax

from jaxact._src.lce import api as lce
from jaxact._src.lce.api_checks import check_tied_options


class LMHead(nn.Dense):
  """A language model's output layer: ``nn.Dense`` that, given labels, returns the loss instead.

  Exactly ``flax.linen.Dense`` (it subclasses it: the same attributes, defaults and parameters,
  ``kernel`` of shape ``(in, features)`` and ``bias``, so checkpoints load both ways), with the
  options of :func:`jaxact.linear_cross_entropy` as attributes. Called without labels it returns
  the logits as ``nn.Dense`` does; called with labels (and optionally ``where``) it returns
  ``linear_cross_entropy(inputs, kernel, labels, bias=bias, ...)``, which never builds the logits
  and keeps two numbers a token for the backward pass.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from jaxact.linen import LMHead
    >>> head = LMHead(features=11)
    >>> x, labels = jnp.ones((2, 5, 4)), jnp.zeros((2, 5), jnp.int32)
    >>> params = head.init(jax.random.key(0), x)
    >>> head.apply(params, x).shape  # the logits, as nn.Dense(11)
    (2, 5, 11)
    >>> head.apply(params, x, labels).shape  # the mean loss
    ()

  Attributes:
    features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init, promote_dtype,
      dot_general, dot_general_cls: as ``nn.Dense``. A custom ``dot_general`` /
      ``dot_general_cls`` cannot be fused with the loss: called with labels, such a head raises.
    reduction, label_smoothing, label_smoothing_style, z_loss, logit_soft_cap,
      return_predictions, implementation: as :func:`jaxact.linear_cross_entropy` (with
      ``return_predictions`` the call with labels returns ``(loss, predictions)``).
  """

  reduction: Literal["mean", "sum", "none"] = "mean"
  label_smoothing: float = 0.0
  label_smoothing_style: Literal["optax", "t5x"] = "optax"
  z_loss: float = 0.0
  logit_soft_cap: float | None = None
  return_predictions: bool = False
  implementation: str | None = None

  @nn.compact
  def __call__(
    self, inputs: Array, labels: Array | None = None, *, where=None, weights=None
  ) -> Array | tuple[Array, Array]:
    """The logits ``inputs @ kernel + bias`` (no labels), or the loss against `labels`.

    Args:
      inputs: ``(..., in)``.
      labels: None, or integer class indices of shape ``inputs.shape[:-1]``.
      where: with labels, the tokens that count (bool, broadcastable to the labels' shape).
      weights: with labels, each token's weight (see :func:`jaxact.linear_cross_entropy`).
    """
    if labels is None:
      if where is not None or weights is not None:
        raise ValueError("jaxact.linen.LMHead: `where` / `weights` given without `labels`")
      return super().__call__(inputs)
    if self.dot_general not in (None, lax.dot_general) or self.dot_general_cls is not None:
      raise NotImplementedError(
        "jaxact.linen.LMHead: a custom `dot_general` / `dot_general_cls` cannot be fused with "
        "the loss; call the head without labels for the logits and compute the loss from them"
      )
    # As nn.Dense creates them: kernel, then bias.
    kernel = self.param(
      "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
    )
    bias = (
      self.param("bias", self.bias_init, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
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
  embed: nn.Embed, query: Array, labels: Array, **options: Any
) -> Array | tuple[Array, Array]:
  """The loss of the logits ``embed.attend(query)`` against `labels`, without the logits.

  A tied head: ``nn.Embed.attend`` is ``query @ embedding.T``, the token embedding table
  ``(num_embeddings, features)`` used as the output layer. This is
  ``linear_cross_entropy(query, embedding, labels, w_layout="vd", **options)`` after
  ``nn.Embed``'s own dtype promotion: the loop reads the table by rows, so neither the logits nor a
  transposed copy of the table exists, and the table's gradient comes back in its own layout.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jaxact.linen as jnn
    >>> embed = nn.Embed(11, 4)
    >>> params = embed.init(jax.random.key(0), jnp.zeros((2,), jnp.int32))
    >>> query, labels = jnp.ones((2, 4)), jnp.array([3, 7])
    >>> loss = jnn.attend_cross_entropy(embed.bind(params), query, labels)
    >>> logits = embed.apply(params, query, method=nn.Embed.attend)  # what it never builds
    >>> picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1)
    >>> bool(jnp.allclose(loss, -picked.mean()))
    True

  Args:
    embed: a bound ``nn.Embed`` (a submodule inside the model's ``__call__``, or ``embed.bind``).
    query: ``(..., features)``, the final norm's output.
    labels: integer class indices of shape ``query.shape[:-1]``.
    **options: :func:`jaxact.linear_cross_entropy`'s keyword arguments (``where``, ``weights``,
      ``reduction``, ``label_smoothing``, ``z_loss``, ``logit_soft_cap``,
      ``return_predictions``, ...), but ``w_layout``.
  """
  fn = "jaxact.linen.attend_cross_entropy"
  if not isinstance(embed, nn.Embed):
    raise TypeError(f"{fn}: `embed` must be a flax.linen.Embed; got {type(embed).__name__}")
  check_tied_options(fn, options)
  query, embedding = embed.promote_dtype(query, embed.embedding, dtype=embed.dtype)
  return lce.linear_cross_entropy(query, embedding, labels, w_layout="vd", **options)
