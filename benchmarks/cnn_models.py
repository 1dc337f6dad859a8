"""The convolutional models of `python -m benchmarks cnn`, each in the ways it can be trained.

* ResNet-50 as Flax's ImageNet example defines it (``examples/imagenet/models.py`` of
  google/flax, Apache-2.0: ``BottleneckResNetBlock`` of conv -> ``nn.BatchNorm`` -> relu units,
  the last BatchNorm's scale initialised to zero, a 1x1 ``conv_proj`` / ``norm_proj`` where the
  shape changes; a 7x7 stride-2 stem, max pooling, stages of 3, 4, 6 and 3 blocks, global average
  pooling, a dense head), written here with the unit swappable:

  - ``flax``: ``nn.Conv(use_bias=False)`` -> ``nn.BatchNorm`` -> ``nn.relu``, the example itself;
  - ``flax-remat``: the same with ``nn.remat`` around each block;
  - ``flax-dots``: ``nn.remat(policy=jax.checkpoint_policies.dots_saveable)`` around each block
    (the convolutions' and the head's outputs kept, the norms and activations recomputed);
  - ``jaxact-bn``: ``nn.BatchNorm`` + relu swapped for ``jaxact.linen.BatchNorm(activation=
    "relu")`` (the drop-in: the same variables), the block's closing relu ``jaxact.relu``;
  - ``jaxact-cna``: each conv -> norm -> activation one ``jaxact.linen.ConvNormAct``;
  - ``jaxact-bn-remat``, ``jaxact-bn-dots``: the drop-in with ``nn.remat`` around each block,
    without a policy and with ``dots_saveable``.

* A diffusion U-Net's residual block, as diffusion models write it (``h = conv(silu(GroupNorm(32)
  (x)))`` twice, then ``x + h``), stacked:

  - ``flax``: ``nn.GroupNorm`` -> ``nn.silu`` -> ``nn.Conv``;
  - ``flax-remat``, ``flax-dots``: each block under ``nn.remat``, without a policy and with
    ``dots_saveable``;
  - ``jaxact-gn``: ``jaxact.linen.GroupNorm(activation="silu")`` -> ``nn.Conv``;
  - ``jaxact-cna``: the first norm as ``jaxact-gn``, then the first conv, the second norm and
    its silu as one ``jaxact.linen.ConvNormAct(norm="group")``, then the second conv;
  - ``jaxact-gn-remat``, ``jaxact-gn-dots``: the drop-in's blocks under ``nn.remat`` as above;
  - ``jaxact-nac``: each norm -> silu -> conv one ``jaxact.linen.NormActConv(norm="group")``
    (keeping each conv's normalized input alone), and ``jaxact-nac-remat`` under ``nn.remat``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxact
import jaxact.linen as jnn

RESNET50_STAGES = (3, 4, 6, 3)
RESNETS = (
  "flax",
  "flax-remat",
  "flax-dots",
  "jaxact-bn",
  "jaxact-cna",
  "jaxact-bn-remat",
  "jaxact-bn-dots",
)
UNETS = (
  "flax",
  "flax-remat",
  "flax-dots",
  "jaxact-gn",
  "jaxact-cna",
  "jaxact-gn-remat",
  "jaxact-gn-dots",
  "jaxact-nac",
  "jaxact-nac-remat",
)
# a variant's suffix: the remat policy around each block (None: save nothing but its input)
REMATS = {"-remat": None, "-dots": jax.checkpoint_policies.dots_saveable}


def blocked(block: type[nn.Module], variant: str) -> tuple[type[nn.Module], str]:
  """``(the block class, the variant inside it)``: `block` under ``nn.remat`` with the policy
  that `variant`'s suffix names, or `block` itself."""
  for suffix, policy in REMATS.items():
    if variant.endswith(suffix):
      return nn.remat(block, policy=policy), variant.removesuffix(suffix)
  return block, variant


class Unit(nn.Module):
  """conv (no bias) -> BatchNorm -> activation, written the way `variant` trains it."""

  features: int
  kernel_size: tuple[int, int]
  strides: tuple[int, int] = (1, 1)
  padding: object = "SAME"
  act: bool = True  # relu after the norm, else none
  zero_scale: bool = False  # the block's last norm
  variant: str = "flax"
  train: bool = True
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    norm_kw = dict(use_running_average=not self.train, momentum=0.9, epsilon=1e-5)
    if self.zero_scale:
      norm_kw["scale_init"] = nn.initializers.zeros_init()
    conv_kw = dict(strides=self.strides, padding=self.padding)
    if self.variant == "jaxact-cna":
      activation = "relu" if self.act else "identity"
      return jnn.ConvNormAct(
        self.features,
        self.kernel_size,
        **conv_kw,
        activation=activation,
        **norm_kw,
        dtype=self.dtype,
      )(x)
    conv_kw["dtype"] = norm_kw["dtype"] = self.dtype
    x = nn.Conv(self.features, self.kernel_size, use_bias=False, **conv_kw)(x)
    if self.variant == "jaxact-bn":
      return jnn.BatchNorm(activation="relu" if self.act else "identity", **norm_kw)(x)
    x = nn.BatchNorm(**norm_kw)(x)
    return nn.relu(x) if self.act else x


class Bottleneck(nn.Module):
  filters: int
  strides: tuple[int, int] = (1, 1)
  variant: str = "flax"
  train: bool = True
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    unit = functools.partial(Unit, variant=self.variant, train=self.train, dtype=self.dtype)
    y = unit(self.filters, (1, 1))(x)
    y = unit(self.filters, (3, 3), self.strides)(y)
    y = unit(self.filters * 4, (1, 1), act=False, zero_scale=True)(y)
    residual = x
    if residual.shape != y.shape:
      residual = unit(self.filters * 4, (1, 1), self.strides, act=False)(x)
    # jaxact's relu keeps its output, which the next block keeps anyway (its input)
    relu = jaxact.relu if self.variant.startswith("jaxact") else nn.relu
    return relu(residual + y)


class ResNet(nn.Module):
  stage_sizes: tuple[int, ...] = RESNET50_STAGES
  num_classes: int = 1000
  num_filters: int = 64
  variant: str = "flax"
  train: bool = True
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    block, inner = blocked(Bottleneck, self.variant)  # the stem unit as the blocks' units
    unit = functools.partial(Unit, variant=inner, train=self.train, dtype=self.dtype)
    x = unit(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)])(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = block(self.num_filters * 2**i, strides, inner, self.train, self.dtype)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x)


class UNetBlock(nn.Module):
  """``x + conv(silu(GN(conv(silu(GN(x))))))``, channels kept."""

  variant: str = "flax"
  groups: int = 32
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    c = x.shape[-1]
    conv = functools.partial(nn.Conv, c, (3, 3), dtype=self.dtype)
    gn = dict(num_groups=self.groups, dtype=self.dtype)
    if self.variant == "flax":
      h = conv()(nn.silu(nn.GroupNorm(**gn)(x)))
      h = conv()(nn.silu(nn.GroupNorm(**gn)(h)))
    elif self.variant == "jaxact-gn":
      h = conv()(jnn.GroupNorm(activation="silu", **gn)(x))
      h = conv()(jnn.GroupNorm(activation="silu", **gn)(h))
    elif self.variant == "jaxact-nac":
      nac = functools.partial(jnn.NormActConv, c, (3, 3), norm="group", activation="silu", **gn)
      h = nac()(x)
      h = nac()(h)
    else:
      h = jnn.GroupNorm(activation="silu", **gn)(x)
      h = jnn.ConvNormAct(c, (3, 3), norm="group", activation="silu", conv_use_bias=True, **gn)(h)
      h = conv()(h)
    return x + h


class UNetStack(nn.Module):
  blocks: int = 4
  variant: str = "flax"
  dtype: object = jnp.float32
  # a 1x1 conv in front: the first block's input is then made in the step, as in a whole U-Net,
  # not the step's argument (which Flax's first GroupNorm keeps at no cost in temp)
  stem: bool = False
  # the blocks under nn.scan (how large models are built: XLA fuses nothing across the loop, so
  # each block keeps what its layers' backward passes keep)
  scan: bool = False

  @nn.compact
  def __call__(self, x):
    if self.stem:
      x = nn.Conv(x.shape[-1], (1, 1), dtype=self.dtype)(x)
    block, inner = blocked(UNetBlock, self.variant)
    if self.scan:
      body = nn.scan(
        lambda module, carry, _: (module(carry), None),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=self.blocks,
      )
      return body(block(inner, dtype=self.dtype, name="blocks"), x, None)[0]
    for _ in range(self.blocks):
      x = block(inner, dtype=self.dtype)(x)
    return x


def resnet_step(variant: str, shape: tuple[int, ...], dtype=jnp.float32, classes: int = 1000):
  """``(step, (params, batch_stats, images, labels) shapes)``: one training step's
  ``value_and_grad`` of the cross-entropy, with the updated batch statistics."""
  model = ResNet(variant=variant, num_classes=classes, dtype=dtype)
  images = jax.ShapeDtypeStruct(shape, dtype)
  labels = jax.ShapeDtypeStruct(shape[:1], jnp.int32)
  variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), images)

  def loss(params, batch_stats, x, y):
    logits, new = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1)), new

  def step(params, batch_stats, x, y):
    return jax.value_and_grad(loss, has_aux=True)(params, batch_stats, x, y)

  return step, (variables["params"], variables["batch_stats"], images, labels)


def unet_step(
  variant: str,
  shape: tuple[int, ...],
  blocks: int,
  dtype=jnp.float32,
  stem: bool = False,
  scan: bool = False,
):
  """``(step, (params, x) shapes)``: ``value_and_grad`` of a squared error through the stack."""
  model = UNetStack(blocks, variant, dtype, stem, scan)
  x = jax.ShapeDtypeStruct(shape, dtype)
  variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x)

  def loss(params, x):
    y = model.apply({"params": params}, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32) - x.astype(jnp.float32)))

  def step(params, x):
    return jax.value_and_grad(loss)(params, x)

  return step, (variables["params"], x)
