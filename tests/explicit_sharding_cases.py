"""jaxact's ops sharded as Flax's Gemma example shards them, on 8 virtual CPU devices.

Imported by ``tests/sharding_cases.py`` (which runs every case in one subprocess with 8 devices):
:data:`CASES` run by default, :data:`EXHAUSTIVE` only when named (``-m exhaustive``).

A decoder written twice, with jaxact's ops and as the plain composition the Gemma example writes
(``jnp.dot`` / ``jnp.einsum`` with ``out_sharding``, ``jax.nn``): per block an RMS norm with Gemma's
``1 + scale``, attention (grouped-query, causal, sliding window, soft cap), a GeGLU MLP; then a
layer norm, a Megatron column / row pair of dense layers, and the tied-embedding head with T5X
label smoothing, per-token weights, a soft cap and the predictions. The parameters and activations
are sharded as ``ShardingConfig.fsdp_tp_sharding`` shards them: weights' model dimension over
"fsdp" (FSDP) and their heads / hidden / vocabulary over "tensor" (Megatron), activations
``act_btd = P("fsdp", None, "tensor")`` (batch, and features over the tensor axis), on the
example's meshes (fsdp x tensor: 1x1, 2x1, 1x2, 4x2; Explicit axes, and Auto). Each case reports,
against the plain composition on one device, the relative error of the loss, of every gradient and
whether the predictions agree; the shardings of the gradients; and, against the plain composition
under the same mesh, the collectives of the compiled training step (bytes a device) and its temp.
"""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxact

B, T, D, F, N, K, H, V = 8, 32, 32, 128, 4, 2, 8, 256
WINDOW, ATTN_CAP, FINAL_CAP, SMOOTHING = 12, 20.0, 10.0, 0.1
LAYERS = 2
FSDP, TP = "fsdp", "tensor"
ACT_BTD = P(FSDP, None, TP)
ACT_BTF = P(FSDP, None, TP)
ACT_BTNH = P(FSDP, None, TP, None)
SPECS = {  # fsdp_tp_sharding's, per parameter
  "emb": P(TP, FSDP),  # emb_vd
  "norm": P(TP),  # rms_norm_weight
  "wq": P(FSDP, TP, None),  # q_weight_ndh, written (D, N, H)
  "wkv": P(None, FSDP, TP, None),  # kv_weight_cndh, written (2, D, K, H)
  "wo": P(TP, None, FSDP),  # o_weight_nhd
  "w_gate": P(FSDP, TP),  # ffw_weight_df
  "w_up": P(FSDP, TP),
  "w_down": P(TP, FSDP),  # ffw_weight_fd
  "ln_scale": P(TP),
  "ln_bias": P(None),
  "w_col": P(FSDP, TP),  # Megatron's column-parallel layer, FSDP over its rows
  "b_col": P(TP),
  "w_row": P(TP, FSDP),  # and its row-parallel partner
  "b_row": P(None),
}
COLLECTIVE = re.compile(
  r"= (.*?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\("
)
SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8, "bf16": 2}


def collectives(compiled) -> dict:
  """The bytes a device's collectives produce in the compiled program (each counted once, as
  written: ``in_loops`` counts those inside a loop body, which run once an iteration), the
  largest one's, and their kinds."""
  total, largest, kinds, in_loops = 0, 0, set(), 0
  for line in compiled.as_text().splitlines():
    found = COLLECTIVE.search(line)
    if found is None:
      continue
    produced, kind = found.groups()
    kinds.add(kind)
    in_loops += "/while/body/" in line
    for dtype, dims in SHAPE.findall(produced):
      size = BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      total += size
      largest = max(largest, size)
  return dict(bytes=total, largest=largest, kinds=sorted(kinds), in_loops=in_loops)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def parameters():
  keys = iter(jax.random.split(jax.random.key(7), 32))

  def normal(shape, scale):
    return np.asarray(jax.random.normal(next(keys), shape, jnp.float32)) * scale

  block = lambda: {
    "norm": normal((D,), 0.1),
    "wq": normal((D, N, H), D**-0.5),
    "wkv": normal((2, D, K, H), D**-0.5),
    "wo": normal((N, H, D), (N * H) ** -0.5),
    "ffw_norm": normal((D,), 0.1),
    "w_gate": normal((D, F), D**-0.5),
    "w_up": normal((D, F), D**-0.5),
    "w_down": normal((F, D), F**-0.5),
  }
  return {
    "emb": normal((V, D), 1.0),
    "blocks": [block() for _ in range(LAYERS)],
    "ln_scale": 1 + normal((D,), 0.1),
    "ln_bias": normal((D,), 0.1),
    "w_col": normal((D, F), D**-0.5),
    "b_col": normal((F,), 0.1),
    "w_row": normal((F, D), F**-0.5),
    "b_row": normal((D,), 0.1),
  }


def param_specs(params):
  def spec(path, _):
    name = path[-1].key
    return SPECS["norm" if name == "ffw_norm" else name]

  return jax.tree_util.tree_map_with_path(spec, params)


def batch():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  labels = rng.integers(0, V, (B, T)).astype(np.int32)
  weights = (rng.random((B, T)) > 0.2).astype(np.float32)
  return x, labels, weights


# ----------------------------------------------------------------------------------- models


def _window_mask():
  t = np.arange(T)
  return (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - WINDOW)  # keys t - W + 1 .. t


def _projections(p, h, explicit):
  kw = (lambda s: {"out_sharding": s}) if explicit else (lambda s: {})
  q = jnp.einsum("BTD,DNH->BTNH", h, p["wq"], **kw(ACT_BTNH))
  k, v = jnp.einsum("BTD,CDKH->CBTKH", h, p["wkv"], **kw(P(None, *ACT_BTNH)))
  return q, k, v


def plain_model(params, x, labels, weights, explicit=True):
  """The Gemma example's composition: einsums and dots with out_sharding, jax.nn, T5X's loss."""
  kw = (lambda s: {"out_sharding": s}) if explicit else (lambda s: {})
  for p in params["blocks"]:
    h = _gemma_norm(x, p["norm"])
    q, k, v = _projections(p, h, explicit)
    qg = q.reshape(B, T, K, N // K, H) * H**-0.5
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", qg, k)
    logits = ATTN_CAP * jnp.tanh(logits / ATTN_CAP)
    logits = jnp.where(_window_mask()[None, :, None, None, :], logits, -2.3819763e38)
    o = jnp.einsum("BTKGS,BSKH->BTKGH", jax.nn.softmax(logits, -1), v).reshape(B, T, N, H)
    x = x + jnp.einsum("BTNH,NHD->BTD", o, p["wo"], **kw(ACT_BTD))
    h = _gemma_norm(x, p["ffw_norm"])
    a = jnp.dot(h, p["w_gate"], **kw(ACT_BTF))
    hidden = jax.nn.gelu(a) * jnp.dot(h, p["w_up"], **kw(ACT_BTF))
    x = x + jnp.dot(hidden, p["w_down"], **kw(ACT_BTD))
  mean = jnp.mean(x, -1, keepdims=True)
  xc = x - mean
  x = xc * jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + 1e-6)
  x = x * params["ln_scale"] + params["ln_bias"]
  h = jax.nn.gelu(jnp.dot(x, params["w_col"], **kw(ACT_BTF)) + params["b_col"])
  x = x + jnp.tanh(jnp.dot(h, params["w_row"], **kw(ACT_BTD)) + params["b_row"])
  logits = jnp.dot(x, params["emb"].T, **kw(ACT_BTD))
  logits = FINAL_CAP * jnp.tanh(logits / FINAL_CAP)
  return _t5x_loss(logits, labels, weights), jnp.argmax(logits, -1)


def _gemma_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + scale)


def _t5x_loss(logits, labels, weights):
  confidence, low = 1 - SMOOTHING, SMOOTHING / (V - 1)
  constant = -(confidence * math.log(confidence) + (V - 1) * low * math.log(low + 1e-20))
  targets = jax.nn.one_hot(labels, V) * (confidence - low) + low
  loss = -jnp.sum(targets * jax.nn.log_softmax(logits), -1) - constant
  return jnp.sum(loss * weights) / jnp.sum(weights)


def jaxact_model(params, x, labels, weights, explicit=True):
  """The same model with jaxact's ops, each given the out_sharding its einsum had (under Auto
  axes, a sharding constraint)."""
  out = lambda s: s
  for p in params["blocks"]:
    h = jaxact.rms_norm(x, p["norm"], scale_offset=1.0)
    q, k, v = _projections(p, h, explicit)
    o = jaxact.dot_product_attention(
      q,
      k,
      v,
      is_causal=True,
      local_window_size=(WINDOW - 1, 0),
      logits_soft_cap=ATTN_CAP,
      out_sharding=out(ACT_BTNH),
    )
    x = x + jnp.einsum(
      "BTNH,NHD->BTD", o, p["wo"], **({"out_sharding": ACT_BTD} if explicit else {})
    )
    h = jaxact.rms_norm(x, p["ffw_norm"], scale_offset=1.0)
    mlp = jaxact.gated_mlp(
      h, p["w_gate"], p["w_up"], p["w_down"], activation="gelu", out_sharding=out(ACT_BTD)
    )
    x = x + mlp
  x = jaxact.layer_norm(x, params["ln_scale"], params["ln_bias"])
  h = jaxact.dense_bias_act(
    x, params["w_col"], params["b_col"], activation="gelu", out_sharding=out(ACT_BTF)
  )
  row = jaxact.dense_bias_act(
    h, params["w_row"], params["b_row"], activation="tanh", out_sharding=out(ACT_BTD)
  )
  return jaxact.linear_cross_entropy(
    x + row,
    params["emb"],
    labels,
    w_layout="vd",
    weights=weights,
    label_smoothing=SMOOTHING,
    label_smoothing_style="t5x",
    logit_soft_cap=FINAL_CAP,
    return_predictions=True,
  )


# ------------------------------------------------------------------------------------ cases


def step(model, **kw):
  return jax.jit(jax.value_and_grad(lambda *a: model(*a, **kw), has_aux=True))


def decoder_case(name: str, shape: tuple[int, int], axis_type=AxisType.Explicit) -> None:
  """The decoder on an fsdp x tensor mesh of `shape`, against the plain model on one device and
  under the same mesh."""
  explicit = axis_type == AxisType.Explicit
  params, (x, labels, weights) = parameters(), batch()
  (loss1, pred1), grads1 = step(plain_model, explicit=False)(params, x, labels, weights)
  devices = jax.devices()[: math.prod(shape)]
  mesh = jax.make_mesh(shape, (FSDP, TP), (axis_type, axis_type), devices=devices)
  specs = param_specs(params)
  with jax.set_mesh(mesh):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    sharded = jax.tree.map(put, params, specs)
    data = (put(x, ACT_BTD), put(labels, P(FSDP)), put(weights, P(FSDP)))
    run = step(jaxact_model, explicit=explicit)
    (loss, pred), grads = run(sharded, *data)
    compiled = run.lower(sharded, *data).compile()
    plain = step(plain_model, explicit=explicit).lower(sharded, *data).compile()
  report(name, (loss, grads, pred), (loss1, grads1, pred1), sharded, compiled, plain, explicit)


def report(name, got, want, sharded, compiled, plain, explicit) -> None:
  """One JSON line: `got` (loss, gradients, predictions or None) against `want` (one device), the
  gradients' shardings against the parameters', `compiled` against `plain` (the same mesh)."""
  (loss, grads, pred), (loss1, grads1, pred1) = got, want
  grad_specs = jax.tree.map(lambda g: str(g.sharding.spec), grads)
  want_specs = jax.tree.map(lambda a: str(a.sharding.spec), sharded)
  result = dict(
    case=name,
    devices=jax.device_count(),
    loss_err=rel_err(loss, loss1),
    grad_err=max(
      rel_err(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1), strict=True)
    ),
    predictions_equal=pred is None or bool(np.array_equal(pred, pred1)),
    grad_specs_equal=grad_specs == want_specs if explicit else True,
    collectives=collectives(compiled),
    plain_collectives=collectives(plain),
    temp=compiled.memory_analysis().temp_size_in_bytes,
    plain_temp=plain.memory_analysis().temp_size_in_bytes,
  )
  print(json.dumps(result), flush=True)


CONV = {"c1": P(None, None, FSDP, TP), "b1": P(TP), "c2": P(None, None, TP, FSDP), "b2": P(None)}
CONV_OUT = (P(FSDP, None, None, TP), P(FSDP, None, None, None))


def conv_model(params, x, use_jaxact=True, explicit=True):
  """Two convolutions as a column / row pair, FSDP over their input channels."""
  for i, act in ((1, "relu"), (2, "tanh")):
    w, b, out = params[f"c{i}"], params[f"b{i}"], CONV_OUT[i - 1] if explicit else None
    if use_jaxact:
      x = jaxact.conv_bias_act(x, w, b, activation=act, out_sharding=out)
    else:
      dn = ("NHWC", "HWIO", "NHWC")
      z = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn, out_sharding=out)
      x = jax.nn.relu(z + b) if act == "relu" else jnp.tanh(z + b)
  return jnp.mean(x * x), None


def conv_case(name: str, shape: tuple[int, int]) -> None:
  rng = np.random.default_rng(5)
  params = {
    "c1": rng.standard_normal((3, 3, 8, 16)).astype(np.float32) * 0.2,
    "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
    "c2": rng.standard_normal((3, 3, 16, 8)).astype(np.float32) * 0.1,
    "b2": rng.standard_normal(8).astype(np.float32) * 0.1,
  }
  x = rng.standard_normal((8, 6, 6, 8)).astype(np.float32)
  plain_step = step(conv_model, use_jaxact=False)
  (loss1, _), grads1 = step(conv_model, use_jaxact=False, explicit=False)(params, x)
  mesh = jax.make_mesh(shape, (FSDP, TP), devices=jax.devices()[: math.prod(shape)])
  with jax.set_mesh(mesh):
    sharded = {k: jax.device_put(v, CONV[k]) for k, v in params.items()}
    xs = jax.device_put(x, P(FSDP))
    run = step(conv_model)
    (loss, _), grads = run(sharded, xs)
    compiled = run.lower(sharded, xs).compile()
    plain = plain_step.lower(sharded, xs).compile()
  report(name, (loss, grads, None), (loss1, grads1, None), sharded, compiled, plain, True)


def norm_bug_case(name: str) -> None:
  """The rms_norm bug of issue 33: x feature-sharded, its scale replicated, on a 1 x 1 mesh (the
  backward's scale gradient came out feature-sharded: "Custom VJP bwd rule ... must produce an
  output with the same type")."""
  mesh = jax.make_mesh((1, 1), (FSDP, TP), devices=jax.devices()[:1])
  x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
  scale = np.linspace(-0.5, 0.5, 8, dtype=np.float32)

  def loss(x, s, norm):
    return jnp.sum(jnp.sin(norm(x, s)))

  want = jax.grad(loss, (0, 1))(x, scale, _gemma_norm)  # one device, no mesh
  with jax.set_mesh(mesh):
    xs, ss = jax.device_put(x, ACT_BTD), jax.device_put(scale, P())
    norm = lambda x, s: jaxact.rms_norm(x, s, scale_offset=1.0)
    got = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(xs, ss, norm)
  result = dict(
    case=name,
    devices=jax.device_count(),
    grad_err=max(rel_err(a, b) for a, b in zip(got, want, strict=True)),
    grad_specs=[str(g.sharding.spec) for g in got],
  )
  print(json.dumps(result), flush=True)


CASES = {
  "gemma_4x2": lambda: decoder_case("gemma_4x2", (4, 2)),
  "gemma_4x2_auto": lambda: decoder_case("gemma_4x2_auto", (4, 2), AxisType.Auto),
  "conv_4x2": lambda: conv_case("conv_4x2", (4, 2)),
  "norm_bug_1x1": lambda: norm_bug_case("norm_bug_1x1"),
}
EXHAUSTIVE = {
  "gemma_1x1": lambda: decoder_case("gemma_1x1", (1, 1)),
  "gemma_2x1": lambda: decoder_case("gemma_2x1", (2, 1)),
  "gemma_1x2": lambda: decoder_case("gemma_1x2", (1, 2)),
}
