"""Flax's ``examples/imagenet`` as the porting guide's test runs it: ``models.py``'s ResNets and
``train.py``'s step, written after the example (github.com/google/flax, Apache-2.0, The Flax
Authors), without the input pipeline, the checkpointing and the dynamic loss scale (off but for
float16 on GPU). ``train_step`` runs under ``jax.pmap(..., axis_name="batch")`` as ``train.py``
runs it; ``sgd`` stands in for ``TrainState.apply_gradients`` with ``optax.sgd(learning_rate,
momentum, nesterov=True)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

ModuleDef = Any
NUM_CLASSES = 1000


class ResNetBlock(nn.Module):
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class BottleneckResNetBlock(nn.Module):
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  conv: ModuleDef = nn.Conv

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = partial(self.conv, use_bias=False, dtype=self.dtype)
    norm = partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      dtype=self.dtype,
      axis_name="batch",
    )
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(
          self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act
        )(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, self.dtype)


ResNet18 = partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)
ResNet50 = partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)


def cross_entropy_loss(logits, labels):
  one_hot = jax.nn.one_hot(labels, logits.shape[-1])
  return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))


def train_step(apply_fn, params, batch_stats, momentum, batch, learning_rate=0.1):
  """train.py's ``train_step`` without a dynamic scale, under ``jax.pmap(axis_name="batch")``:
  the loss with weight decay, its gradient pmean'd, SGD with Nesterov momentum 0.9, the batch
  statistics pmean'd, the metrics."""

  def loss_fn(params):
    logits, new_model_state = apply_fn(
      {"params": params, "batch_stats": batch_stats}, batch["image"], mutable=["batch_stats"]
    )
    loss = cross_entropy_loss(logits, batch["label"])
    weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return loss + 0.0001 * 0.5 * weight_l2, (new_model_state, logits)

  aux, grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  grads = jax.lax.pmean(grads, axis_name="batch")
  new_model_state, logits = aux[1]
  metrics = jax.lax.pmean(
    {
      "loss": cross_entropy_loss(logits, batch["label"]),
      "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
    },
    axis_name="batch",
  )
  tx = optax.sgd(learning_rate, momentum=0.9, nesterov=True)
  updates, momentum = tx.update(grads, momentum, params)
  params = optax.apply_updates(params, updates)
  batch_stats = jax.lax.pmean(new_model_state["batch_stats"], "batch")
  return params, batch_stats, momentum, metrics
