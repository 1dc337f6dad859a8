"""Flax's ``examples/gemma`` as the porting guide's test runs it: the model and ``train.py``'s
default step, written after the example's ``layers.py``, ``positional_embeddings.py``,
``modules.py``, ``transformer.py``, ``transformer_cfg.py``, ``sow_lib.py`` and ``train.py``
(github.com/google/flax, Apache-2.0, The Flax Authors), with what the port leaves alone left out:
parameter loading, the sampler, the input pipeline, the sow hooks' bodies (the default
``SowConfig()`` sows nothing).

The example's files are one module here. Where a file reads another's names (``layers.RMSNorm``,
``positional_embeddings.apply_rope``, ``modules.Block``, ``transformer_lib.make_causal_attn_mask``),
this module reads them through ``_File``, a view of its own namespace; so a block of the guide
executed in a fresh copy of this module (tests/repo/test_porting_guide.py) replaces a name for
every file, as the same block pasted into the example's file does there.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38  # the example's logit for a masked key


class _File:
  """``layers.X`` / ``modules.X`` / ...: this module's ``X``, looked up when read."""

  def __getattr__(self, name: str) -> Any:
    try:
      return globals()[name]
    except KeyError:  # an AttributeError, as for any module (doctest collection probes __wrapped__)
      raise AttributeError(name) from None


layers = positional_embeddings = modules = transformer_lib = sow_lib = _File()


# ------------------------------------------------------------------------- transformer_cfg.py


class AttentionType(enum.Enum):
  GLOBAL = 1
  LOCAL_SLIDING = 2


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """The example's ``ShardingConfig.no_sharding()``: no sharding metadata, no ``out_sharding``."""

  emb_vd: Any = None
  q_weight_ndh: Any = None
  kv_weight_cndh: Any = None
  qkv_weight_cndh: Any = None
  o_weight_nhd: Any = None
  ffw_weight_df: Any = None
  ffw_weight_fd: Any = None
  rms_norm_weight: Any = None
  act_btd: Any = None
  act_btf: Any = None
  act_btnh: Any = None
  act_sbtnh: Any = None
  fsdp_axis_name: str = "fsdp"


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  num_layers: int
  num_embed: int
  embed_dim: int
  hidden_dim: int
  num_heads: int
  head_dim: int
  num_kv_heads: int
  final_logit_softcap: float | None
  use_post_attn_norm: bool
  use_post_ffw_norm: bool
  attention_types: tuple
  query_pre_attn_scalar_value: float | None = None  # None: head_dim**-0.5, the default
  attn_logits_soft_cap: float | None = None
  use_qk_norm: bool = False
  sliding_window_size: int | None = None
  local_base_frequency: int = 10_000
  global_base_frequency: int = 10_000
  dtype: Any = jnp.float32
  weight_dtype: Any = jnp.float32
  dropout_rate: float = 0.0
  shd_config: ShardingConfig = ShardingConfig()

  def query_pre_attn_scalar(self) -> float:
    if self.query_pre_attn_scalar_value is not None:
      return self.query_pre_attn_scalar_value
    return self.head_dim**-0.5


@dataclasses.dataclass(frozen=True)
class SowConfig:
  """sow_lib.SowConfig's switches; sowing itself is left out (nothing is sown by default)."""

  attn_logits_topk: int = 0
  mlp_hidden_topk: int = 0

  def maybe_sow_attn_logits_topk(self, logits, module):
    pass

  def maybe_sow_mlp_hidden_topk(self, activations, module):
    pass

  def maybe_sow_rs_after_attention(self, x, module):
    pass

  def maybe_sow_rs_after_ffw(self, x, module):
    pass

  def maybe_sow_embeddings(self, x, module):
    pass


# ------------------------------------------------------------ layers.py, positional_embeddings.py


class RMSNorm(nnx.Module):
  def __init__(
    self,
    dim: int,
    *,
    scale_init=nnx.initializers.zeros_init(),  # noqa: B008 (the example's default)
    scale_metadata=None,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
    weight_dtype=jnp.float32,
  ):
    self.dtype, self.weight_dtype = dtype, weight_dtype
    self.scale = nnx.Param(scale_init(rngs.params(), dim, weight_dtype), **(scale_metadata or {}))

  def __call__(self, x):
    x = jnp.asarray(x, jnp.float32)
    mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed = jnp.asarray(x * jax.lax.rsqrt(mean2 + 1e-06), dtype=self.dtype)
    return normed * (1.0 + jnp.asarray(self.scale, self.dtype))


def apply_rope(inputs, positions, head_dim, max_wavelength=10_000, scale_factor=1.0):
  fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
  timescale = max_wavelength**fraction
  angle = (positions[..., None] / timescale[None, None, :])[..., None, :] / scale_factor
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = jnp.split(inputs, 2, axis=-1)
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return out.astype(inputs.dtype)


# ---------------------------------------------------------------------------------- modules.py


class ScaledEmbed(nnx.Embed):
  def __call__(self, x, out_sharding=None):
    x = super().__call__(x, out_sharding)
    return x * jnp.sqrt(x.shape[-1])


class Attention(nnx.Module):
  def __init__(
    self,
    num_heads,
    num_kv_heads,
    features,
    head_dim,
    query_pre_attn_scalar,
    attn_type,
    *,
    rngs,
    rope_base_frequency=10_000,
    rope_scale_factor=1.0,
    attn_logits_soft_cap=None,
    sliding_window_size=None,
    use_qk_norm=False,
    sow_config=SowConfig(),
    shd_config,
    dtype=jnp.float32,
    weight_dtype=jnp.float32,
    dropout_rate=0.0,
  ):
    self.shd_config, self.sow_config = shd_config, sow_config
    self.query_pre_attn_scalar = query_pre_attn_scalar
    self.attn_type, self.sliding_window_size = attn_type, sliding_window_size
    self.attn_logits_soft_cap = attn_logits_soft_cap
    self.rope_base_frequency, self.rope_scale_factor = rope_base_frequency, rope_scale_factor
    self.use_qk_norm = use_qk_norm
    einsum = lambda spec, shape, sharding: nnx.Einsum(
      einsum_str=spec,
      kernel_shape=shape,
      kernel_metadata={"out_sharding": sharding},
      dtype=dtype,
      param_dtype=weight_dtype,
      rngs=rngs,
    )
    self.attn_vec_einsum = einsum(
      "BTNH,NHD->BTD", (num_heads, head_dim, features), shd_config.o_weight_nhd
    )
    self.act_cbtkh_shd = None
    if num_heads == num_kv_heads:
      shape = (3, num_heads, features, head_dim)
      self.qkv_einsum = einsum("BTD,SNDH->SBTNH", shape, shd_config.qkv_weight_cndh)
    else:
      self.q_einsum = einsum(
        "BTD,NDH->BTNH", (num_heads, features, head_dim), shd_config.q_weight_ndh
      )
      shape = (2, num_kv_heads, features, head_dim)
      self.kv_einsum = einsum("BTD,CKDH->CBTKH", shape, shd_config.kv_weight_cndh)
    if use_qk_norm:
      norm = lambda: layers.RMSNorm(head_dim, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
      self._query_norm, self._key_norm = norm(), norm()
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, segment_pos, cache, attn_mask, rngs=None):
    seq_len = x.shape[1]
    if self.use_qkv_einsum:
      query_proj, key_proj, value_proj = self.qkv_einsum(x, out_sharding=self.shd_config.act_sbtnh)
    else:
      query_proj = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
      key_proj, value_proj = self.kv_einsum(x, out_sharding=self.act_cbtkh_shd)
    if self.use_qk_norm:
      query_proj, key_proj = self._query_norm(query_proj), self._key_norm(key_proj)
    rope = dict(
      head_dim=self.head_dim,
      max_wavelength=self.rope_base_frequency,
      scale_factor=self.rope_scale_factor,
    )
    query_proj = positional_embeddings.apply_rope(query_proj, segment_pos, **rope)
    query_scaled = query_proj * self.query_pre_attn_scalar
    key_proj = positional_embeddings.apply_rope(key_proj, segment_pos, **rope)
    if cache is not None:  # left aligned
      end_index = cache["end_index"][0]
      slice_indices = (0, end_index % cache["v"].shape[1], 0, 0)
      value_proj = jax.lax.dynamic_update_slice(cache["v"], value_proj, slice_indices)
      key_proj = jax.lax.dynamic_update_slice(cache["k"], key_proj, slice_indices)

    use_gqa = self.num_heads > self.num_kv_heads and self.num_kv_heads > 1
    b, t, _, h = query_scaled.shape
    if use_gqa:
      groups = self.num_heads // self.num_kv_heads
      query_scaled = query_scaled.reshape(b, t, self.num_kv_heads, groups, h)
      logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
      logits = logits.reshape(b, t, self.num_heads, -1)
    else:
      logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)
    if self.attn_logits_soft_cap is not None:
      logits = jnp.tanh(logits / self.attn_logits_soft_cap) * self.attn_logits_soft_cap
    if self.attn_type == AttentionType.LOCAL_SLIDING:
      all_ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
      w = self.sliding_window_size
      attn_mask = jnp.triu(all_ones, -1 * w + 1) * jnp.tril(all_ones, w - 1) * attn_mask
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    self.sow_config.maybe_sow_attn_logits_topk(padded_logits, self)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
    probs = self.dropout(probs, rngs=rngs)
    if use_gqa:
      probs = probs.reshape(b, t, self.num_kv_heads, groups, -1)
      encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
      encoded = encoded.reshape(b, t, self.num_heads, h)
    else:
      encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
    attn_output = self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)

    new_cache = None
    if cache is not None:
      new_cache = {"v": value_proj, "k": key_proj, "end_index": cache["end_index"] + seq_len}
    return new_cache, attn_output

  @property
  def head_dim(self):
    return self.attn_vec_einsum.kernel.shape[1]

  @property
  def num_heads(self):
    return self.qkv_einsum.kernel.shape[1] if self.use_qkv_einsum else self.q_einsum.kernel.shape[0]

  @property
  def num_kv_heads(self):
    kernel = self.qkv_einsum.kernel if self.use_qkv_einsum else self.kv_einsum.kernel
    return kernel.shape[1]

  @property
  def use_qkv_einsum(self):
    return hasattr(self, "qkv_einsum") and self.qkv_einsum is not None

  def init_cache(self, cache_size, batch_size, dtype=jnp.float32):
    shape = (batch_size, cache_size, self.num_kv_heads, self.head_dim)
    return {
      "v": jnp.zeros(shape, dtype),
      "k": jnp.zeros(shape, dtype),
      "end_index": jnp.zeros((batch_size,), jnp.int32),
    }


class FeedForward(nnx.Module):
  def __init__(
    self,
    features,
    hidden_dim,
    *,
    kernel_init=nnx.initializers.normal(),  # noqa: B008 (the example's default)
    rngs,
    sow_config=SowConfig(),
    shd_config,
    dtype=jnp.float32,
    weight_dtype=jnp.float32,
    dropout_rate=0.0,
  ):
    linear = lambda n_in, n_out, sharding: nnx.Linear(
      in_features=n_in,
      out_features=n_out,
      use_bias=False,
      rngs=rngs,
      kernel_init=kernel_init,
      kernel_metadata={"out_sharding": sharding},
      dtype=dtype,
      param_dtype=weight_dtype,
    )
    self.gate_proj = linear(features, hidden_dim, shd_config.ffw_weight_df)
    self.up_proj = linear(features, hidden_dim, shd_config.ffw_weight_df)
    self.down_proj = linear(hidden_dim, features, shd_config.ffw_weight_fd)
    self.dropout = nnx.Dropout(dropout_rate)
    self.sow_config, self.shd_config = sow_config, shd_config

  def __call__(self, x, rngs=None):
    gate_value = nnx.gelu(self.gate_proj(x, out_sharding=self.shd_config.act_btf))
    activations = gate_value * self.up_proj(x, out_sharding=self.shd_config.act_btf)
    self.sow_config.maybe_sow_mlp_hidden_topk(activations, self)
    activations = self.dropout(activations, rngs=rngs)
    return self.down_proj(activations, out_sharding=self.shd_config.act_btd)


class Block(nnx.Module):
  def __init__(self, config, attn_type, *, rngs, sow_config=SowConfig()):
    c = config
    norm = lambda: layers.RMSNorm(
      c.embed_dim,
      scale_metadata={"out_sharding": c.shd_config.rms_norm_weight},
      rngs=rngs,
      dtype=c.dtype,
      weight_dtype=c.weight_dtype,
    )
    local = attn_type == AttentionType.LOCAL_SLIDING
    self.pre_attention_norm = norm()
    self.attn = Attention(
      num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads,
      features=c.embed_dim,
      head_dim=c.head_dim,
      query_pre_attn_scalar=c.query_pre_attn_scalar(),
      attn_type=attn_type,
      rope_base_frequency=c.local_base_frequency if local else c.global_base_frequency,
      attn_logits_soft_cap=c.attn_logits_soft_cap,
      sliding_window_size=c.sliding_window_size,
      rngs=rngs,
      use_qk_norm=c.use_qk_norm,
      sow_config=sow_config,
      shd_config=c.shd_config,
      dtype=c.dtype,
      weight_dtype=c.weight_dtype,
      dropout_rate=c.dropout_rate,
    )
    self.post_attention_norm = norm() if c.use_post_attn_norm else None
    self.pre_ffw_norm = norm()
    self.mlp = FeedForward(
      features=c.embed_dim,
      hidden_dim=c.hidden_dim,
      rngs=rngs,
      sow_config=sow_config,
      shd_config=c.shd_config,
      dtype=c.dtype,
      weight_dtype=c.weight_dtype,
      dropout_rate=c.dropout_rate,
    )
    self.post_ffw_norm = norm() if c.use_post_ffw_norm else None
    self.dropout = nnx.Dropout(c.dropout_rate)
    self.sow_config = sow_config

  def __call__(self, x, segment_pos, cache, attn_mask, rngs=None):
    attn_inputs = self.pre_attention_norm(x)
    cache, attn_output = self.attn(attn_inputs, segment_pos, cache, attn_mask, rngs=rngs)
    if self.post_attention_norm is not None:
      attn_output = self.post_attention_norm(attn_output)
    x += attn_output
    self.sow_config.maybe_sow_rs_after_attention(x, self)
    ffw_outputs = self.mlp(self.pre_ffw_norm(x), rngs=rngs)
    if self.post_ffw_norm is not None:
      ffw_outputs = self.post_ffw_norm(ffw_outputs)
    x += ffw_outputs
    x = self.dropout(x, rngs=rngs)
    self.sow_config.maybe_sow_rs_after_ffw(x, self)
    return cache, x


# ------------------------------------------------------------------------------ transformer.py


class Transformer(nnx.Module):
  def __init__(self, config, *, rngs, sow_config=SowConfig()):
    self.embedder = modules.ScaledEmbed(
      config.num_embed,
      config.embed_dim,
      dtype=config.dtype,
      param_dtype=config.weight_dtype,
      rngs=rngs,
      embedding_metadata={"out_sharding": config.shd_config.emb_vd},
    )
    self.layers = nnx.List(
      [
        modules.Block(config=config, attn_type=kind, sow_config=sow_config, rngs=rngs)
        for _, kind in zip(range(config.num_layers), config.attention_types, strict=False)
      ]
    )
    self.final_norm = layers.RMSNorm(
      config.embed_dim,
      scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
      rngs=rngs,
      dtype=config.dtype,
      weight_dtype=config.weight_dtype,
    )
    self.final_dropout = nnx.Dropout(config.dropout_rate, deterministic=False)
    self.final_logits_softcap = config.final_logit_softcap
    self.config, self.sow_config, self.shd_config = config, sow_config, config.shd_config

  def __call__(self, last_tokens, positions, cache, attention_mask, rngs=None):
    new_cache = None if cache is None else {}
    x = self.embedder(last_tokens, out_sharding=self.shd_config.act_btd)
    self.sow_config.maybe_sow_embeddings(x, self)
    for i, layer in enumerate(self.layers):
      layer_name = f"layer_{i}"
      layer_cache = cache[layer_name] if cache else None
      layer_cache, x = layer(x, positions, layer_cache, attention_mask, rngs=rngs)
      if cache is not None:
        new_cache[layer_name] = layer_cache
    x = self.final_norm(x)
    x = self.final_dropout(x, rngs=rngs)
    logits = self.embedder.attend(x, out_sharding=self.shd_config.act_btd)
    if self.final_logits_softcap is not None:
      logits /= self.final_logits_softcap
      logits = jnp.tanh(logits) * self.final_logits_softcap
    return logits, new_cache

  def init_cache(self, cache_size, batch_size, dtype=jnp.float32):
    return {
      f"layer_{i}": layer.attn.init_cache(cache_size, batch_size, dtype)
      for i, layer in enumerate(self.layers)
    }


def make_causal_attn_mask(input_mask):
  seq_len = input_mask.shape[-1]
  attn_mask = input_mask[..., None, :]
  causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
  return attn_mask * causal_mask[None, ...]


def build_positions_from_mask(input_mask):
  positions = jnp.cumsum(input_mask, axis=-1)
  return positions - (positions >= 1)


# ------------------------------------------------------------------------------------ train.py


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(
    confidence * jnp.log(confidence)
    + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
  )
  soft_targets = (
    jax.nn.one_hot(targets, vocab_size) * (confidence - low_confidence) + low_confidence
  )
  loss = -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1) - normalizing_constant
  normalizing_factor = targets.size
  if weights is not None:
    loss, normalizing_factor = loss * weights, weights.sum()
  return loss.sum(axis=1) * len(loss) / normalizing_factor


def jax_train_step(
  model,
  optimizer,
  rngs,
  batch,
  train_metrics,
  label_smoothing=0.0,
  pad_id=0,
  with_capture=False,
):
  """train.py's step under its default ``use_nnx_transforms="no"``: ``jax.jit`` of this."""
  train_keys = ["inputs", "inputs_position", "inputs_segmentation", "targets"]
  inputs, inputs_positions, inputs_segmentation, targets = (batch.get(k) for k in train_keys)
  input_mask = inputs > pad_id
  weights = input_mask.astype(jnp.float32)
  attention_mask = transformer_lib.make_causal_attn_mask(input_mask)
  if inputs_segmentation is not None:
    mask = inputs_segmentation[:, :, None] == inputs_segmentation[:, None, :]
    attention_mask = jnp.logical_and(mask, attention_mask)
  graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, rngs):
    module = nnx.merge(graphdef, params, nondiff)
    forward = nnx.capture(module, nnx.Intermediate) if with_capture else module
    output = forward(
      inputs,
      positions=inputs_positions,
      attention_mask=attention_mask,
      cache=None,
      rngs=rngs,
    )
    if with_capture:
      (logits, _), intermediates = output
    else:
      (logits, _), intermediates = output, None
    loss_per_sample = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
    return loss_per_sample.mean(), (loss_per_sample, logits, intermediates)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (_, (loss_per_sample, logits, intermediates)), grads = grad_fn(params, rngs.fork())
  optimizer.update(model, grads)
  train_metrics.update(
    loss=loss_per_sample, logits=logits, labels=targets, mask={"accuracy": input_mask}
  )
  return nnx.state((model, optimizer, rngs, train_metrics)), intermediates


def nnx_train_step(
  model,
  optimizer,
  rngs,
  batch,
  train_metrics,
  label_smoothing=0.0,
  pad_id=0,
  with_capture=False,
):
  """train.py's step under ``use_nnx_transforms="all"``: ``nnx.jit`` of this."""
  train_keys = ["inputs", "inputs_position", "inputs_segmentation", "targets"]
  inputs, inputs_positions, inputs_segmentation, targets = (batch.get(k) for k in train_keys)
  input_mask = inputs > pad_id
  weights = input_mask.astype(jnp.float32)
  attention_mask = transformer_lib.make_causal_attn_mask(input_mask)
  if inputs_segmentation is not None:
    mask = inputs_segmentation[:, :, None] == inputs_segmentation[:, None, :]
    attention_mask = jnp.logical_and(mask, attention_mask)

  def loss_fn(model, rngs):
    forward = nnx.capture(model, nnx.Intermediate) if with_capture else model
    output = forward(
      inputs,
      positions=inputs_positions,
      attention_mask=attention_mask,
      cache=None,
      rngs=rngs,
    )
    if with_capture:
      (logits, _), intermediates = output
    else:
      (logits, _), intermediates = output, None
    loss_per_sample = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
    return loss_per_sample.mean(), (loss_per_sample, logits, intermediates)

  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (_, (loss_per_sample, logits, intermediates)), grads = grad_fn(model, rngs.fork())
  optimizer.update(model, grads)
  train_metrics.update(
    loss=loss_per_sample, logits=logits, labels=targets, mask={"accuracy": input_mask}
  )
  return intermediates
