"""``jaxact.linen.LMHead``: ``nn.Dense`` whose call with labels returns the fused loss."""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from flax import linen as nn
from flax.typing import Array
from jax import lax

from jaxact._src import lce


class LMHead(nn.Dense):
  """A language model's output layer: ``nn.Dense`` that, given labels, returns the loss instead.

  Exactly ``flax.linen.Dense`` (it subclasses it: the same attributes, defaults and parameters,
  ``kernel`` of shape ``(in, features)`` and ``bias``, so checkpoints load both ways), with the
  options of :func:`jaxact.linear_cross_entropy` as attributes. Called without labels it returns
  the logits as ``nn.Dense`` does; called with labels (and optionally ``where``) it returns
  ``linear_cross_entropy(inputs, kernel, labels, bias=bias, ...)``, which never builds the logits
  and keeps one number a token for the backward pass.

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
    reduction, label_smoothing, z_loss, logit_soft_cap, implementation: as
      :func:`jaxact.linear_cross_entropy`.
  """

  reduction: Literal["mean", "sum", "none"] = "mean"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_soft_cap: float | None = None
  implementation: str | None = None

  @nn.compact
  def __call__(self, inputs: Array, labels: Array | None = None, *, where=None) -> Array:
    """The logits ``inputs @ kernel + bias`` (no labels), or the loss against `labels`.

    Args:
      inputs: ``(..., in)``.
      labels: None, or integer class indices of shape ``inputs.shape[:-1]``.
      where: with labels, the tokens that count (bool, broadcastable to the labels' shape).
    """
    if labels is None:
      if where is not None:
        raise ValueError("jaxact.linen.LMHead: `where` is given without `labels`")
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
      reduction=self.reduction,
      label_smoothing=self.label_smoothing,
      z_loss=self.z_loss,
      logit_soft_cap=self.logit_soft_cap,
      precision=self.precision,
      implementation=self.implementation,
    )
