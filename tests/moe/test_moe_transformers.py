"""transformers' MoE blocks on jaxact, against transformers' code written here in float64.

jaxact.moe_params_from_transformers of a block's state dict, given to jaxact.moe_mlp, against
transformers' forward on the transformers-layout weights (Mixtral's ``MixtralSparseMoeBlock``,
Qwen2/3-MoE's sparse blocks, DeepSeek-V3's ``DeepseekV3MoE``, its group-limited routing too),
both layouts (transformers 5's fused ``experts.gate_up_proj`` / ``experts.down_proj``, the older
per-expert ``Linear`` weights). Two layers' ``return_stats`` pooled against transformers'
``load_balancing_loss_func`` of their concatenated router logits, with and without its
attention_mask (value and router gradients); ``token_mask``: padding takes no capacity and gets no
output. The errors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxact

T, H, N, E = 10, 6, 8, 5  # tokens, hidden_size, intermediate size (I), experts


def _silu(v):
  return v / (1 + np.exp(-v))


def deepseek_v3_topk_indices(scores, bias, top_k, n_group, topk_group):
  """``DeepseekV3TopkRouter.get_topk_indices``, float64: the scores plus the bias; each of the
  ``n_group`` groups (consecutive experts) scored by the sum of its two highest; the experts
  outside the ``topk_group`` best groups filled with 0.0; the top-k of the rest."""
  choice = scores + bias
  t, e = choice.shape
  group_scores = np.sort(choice.reshape(t, n_group, e // n_group), -1)[..., -2:].sum(-1)
  group_idx = np.argsort(-group_scores, -1, kind="stable")[:, :topk_group]
  group_mask = np.zeros_like(group_scores)
  np.put_along_axis(group_mask, group_idx, 1.0, -1)
  score_mask = np.repeat(group_mask, e // n_group, -1).astype(bool)
  choice = np.where(score_mask, choice, 0.0)
  return np.argsort(-choice, -1, kind="stable")[:, :top_k]


def transformers_block(
  x, sd, prefix, *, top_k, score, normalize, scaling=1.0, n_group=1, topk_group=1
):
  """transformers' MoE block forward, float64: the router on ``gate.weight`` (softmax: Mixtral,
  Qwen; sigmoid with ``e_score_correction_bias`` and the group limit for the choice:
  DeepSeek-V3), then each chosen expert's SwiGLU, from either layout, as ``F.linear`` computes
  it (``x @ W.T``)."""
  logits = x @ sd[prefix + "gate.weight"].T
  if score == "softmax":
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    tops = np.argsort(-probs, -1, kind="stable")[:, :top_k]
  else:
    probs = 1 / (1 + np.exp(-logits))
    bias = sd[prefix + "gate.e_score_correction_bias"]
    tops = deepseek_v3_topk_indices(probs, bias, top_k, n_group, topk_group)
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    top = tops[t]
    w = probs[t, top]
    if normalize:
      w = w / (w.sum() + (1e-20 if score == "sigmoid" else 0.0))
    for e, we in zip(top, w * scaling, strict=True):
      if prefix + "experts.gate_up_proj" in sd:  # transformers 5
        gate, up = np.split(sd[prefix + "experts.gate_up_proj"][e] @ x[t], 2)
        down = sd[prefix + "experts.down_proj"][e]
      else:
        names = (
          ("w1", "w3", "w2")
          if prefix + "experts.0.w1.weight" in sd
          else ("gate_proj", "up_proj", "down_proj")
        )
        g, u, d = (sd[f"{prefix}experts.{e}.{n}.weight"] for n in names)
        gate, up, down = g @ x[t], u @ x[t], d
      y[t] += we * (down @ (_silu(gate) * up))
  return y


def state_dict(layout, prefix, bias, seed=0, E=E):
  """A block's weights in transformers' layout, plus another layer's and shared experts' keys
  (which the loader must ignore)."""
  rng = np.random.default_rng(seed)
  sd = {prefix + "gate.weight": rng.normal(size=(E, H))}
  if layout == "fused":
    sd[prefix + "experts.gate_up_proj"] = rng.normal(size=(E, 2 * N, H)) * H**-0.5
    sd[prefix + "experts.down_proj"] = rng.normal(size=(E, H, N)) * N**-0.5
  else:
    for e in range(E):
      gate, up, down = layout
      sd[f"{prefix}experts.{e}.{gate}.weight"] = rng.normal(size=(N, H)) * H**-0.5
      sd[f"{prefix}experts.{e}.{up}.weight"] = rng.normal(size=(N, H)) * H**-0.5
      sd[f"{prefix}experts.{e}.{down}.weight"] = rng.normal(size=(H, N)) * N**-0.5
  if bias:
    sd[prefix + "gate.e_score_correction_bias"] = rng.normal(size=(E,)) * 0.3
  sd[prefix + "shared_experts.gate_proj.weight"] = rng.normal(size=(N, H))
  sd["model.layers.9.mlp.gate.weight"] = rng.normal(size=(E, H))
  return sd


MIXTRAL = ("w1", "w3", "w2")
QWEN = ("gate_proj", "up_proj", "down_proj")
# (layout, prefix, moe_mlp's options, routed_scaling_factor)
MODELS = {
  "mixtral-per-expert": (MIXTRAL, "model.layers.0.block_sparse_moe.", dict(top_k=2), 1.0),
  "deepseek-v3-fused": ("fused", "model.layers.3.mlp", dict(top_k=3, score="sigmoid"), 2.5),
  "mixtral-fused": ("fused", "model.layers.0.mlp.", dict(top_k=2), 1.0),
  "qwen3-moe-per-expert": (QWEN, "model.layers.1.mlp.", dict(top_k=3), 1.0),
  "qwen2-moe-unnormalized": (QWEN, "mlp.", dict(top_k=2, normalize_top_k=False), 1.0),
  "deepseek-v3-per-expert": (QWEN, "model.layers.3.mlp.", dict(top_k=3, score="sigmoid"), 2.5),
}
DEFAULT = {"mixtral-per-expert", "deepseek-v3-fused"}


@pytest.mark.parametrize(
  "model",
  [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.exhaustive) for m in MODELS],
)
def test_converted_block_equals_transformers_forward(model):
  layout, prefix, kw, scaling = MODELS[model]
  sigmoid = kw.get("score") == "sigmoid"
  sd = state_dict(layout, prefix if prefix.endswith(".") else prefix + ".", bias=sigmoid)
  x = np.random.default_rng(1).normal(size=(T, H))
  full = prefix if prefix.endswith(".") else prefix + "."
  want = transformers_block(
    x,
    sd,
    full,
    top_k=kw["top_k"],
    score=kw.get("score", "softmax"),
    normalize=kw.get("normalize_top_k", True),
    scaling=scaling,
  )
  params = jaxact.moe_params_from_transformers(sd, prefix=prefix)
  assert sorted(params) == sorted(
    ["router", "w_gate", "w_up", "w_down"] + ["router_bias"] * sigmoid
  )
  assert params["w_gate"].shape == (E, H, N) and params["w_down"].shape == (E, N, H)
  y, _ = jaxact.moe_mlp(jnp.asarray(x), **params, **kw)
  np.testing.assert_allclose(scaling * np.asarray(y), want, rtol=1e-12, atol=1e-12)


def test_group_limited_routing_equals_deepseek_v3_router():
  """DeepSeek-V3's n_group 8, topk_group 4, top-8 of 256 experts, scaled down: 4 groups of 4, the
  2 best groups, top-4; ``expert_groups``, ``top_k_groups`` against transformers' rule."""
  prefix, kw = "model.layers.3.mlp.", dict(top_k=4, score="sigmoid")
  sd = state_dict("fused", prefix, bias=True, E=16)
  # Every score above 0, where transformers' 0.0 fill of the other groups and the op's exclusion
  # of them agree (a test below takes the other case).
  sd[prefix + "gate.e_score_correction_bias"] = np.abs(sd[prefix + "gate.e_score_correction_bias"])
  x = np.random.default_rng(1).normal(size=(64, H))
  groups = dict(n_group=4, topk_group=2)
  want = transformers_block(x, sd, prefix, **kw, normalize=True, scaling=2.5, **groups)
  params = jaxact.moe_params_from_transformers(sd, prefix=prefix)
  y, _ = jaxact.moe_mlp(jnp.asarray(x), **params, **kw, expert_groups=4, top_k_groups=2)
  np.testing.assert_allclose(2.5 * np.asarray(y), want, rtol=1e-12, atol=1e-12)
  # The limit decides: without it many tokens go to other experts.
  plain = transformers_block(x, sd, prefix, **kw, normalize=True, scaling=2.5)
  assert np.sum(np.abs(plain - want).max(-1) > 1e-6) >= 10
  y_all, _ = jaxact.moe_mlp(jnp.asarray(x), **params, **kw, expert_groups=4)  # every group
  np.testing.assert_allclose(2.5 * np.asarray(y_all), plain, rtol=1e-12, atol=1e-12)


@pytest.mark.exhaustive
@pytest.mark.parametrize(
  "experts, groups, top_groups, top_k", [(8, 2, 1, 2), (16, 8, 4, 8), (12, 3, 2, 5), (16, 4, 4, 4)]
)
def test_group_limited_routing_survey(experts, groups, top_groups, top_k):
  prefix, kw = "mlp.", dict(top_k=top_k, score="sigmoid")
  sd = state_dict(QWEN, prefix, bias=True, seed=experts + top_k, E=experts)
  # Every score above 0: transformers' 0.0 fill of the other groups picks none of them.
  sd[prefix + "gate.e_score_correction_bias"] = np.abs(sd[prefix + "gate.e_score_correction_bias"])
  x = np.random.default_rng(2).normal(size=(48, H))
  limit = dict(n_group=groups, topk_group=top_groups)
  want = transformers_block(x, sd, prefix, **kw, normalize=True, **limit)
  params = jaxact.moe_params_from_transformers(sd, prefix=prefix)
  y, _ = jaxact.moe_mlp(
    jnp.asarray(x), **params, **kw, expert_groups=groups, top_k_groups=top_groups
  )
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)


def test_group_limit_excludes_the_other_groups_below_zero():
  """The experts outside the best groups are never chosen, as DeepSeek's inference code masks
  them (-inf); transformers' 0.0 fill would pick them here, every eligible score being negative."""
  x = jnp.ones((3, H), jnp.float64)
  router = jnp.zeros((H, 4), jnp.float64)  # every score 0.5
  bias = jnp.array([-0.6, -0.7, -0.9, -0.95])  # group 0 scores -0.3, group 1 -0.85
  w = jnp.ones((4, H, N), jnp.float64)
  _, aux = jaxact.moe_mlp(
    x, router, w, w, jnp.ones((4, N, H)), top_k=2, score="sigmoid", router_bias=bias,
    expert_groups=2, top_k_groups=1, return_stats=True,
  )  # fmt: skip
  np.testing.assert_array_equal(aux["expert_counts"], [3, 3, 0, 0])
  tops = deepseek_v3_topk_indices(np.full((3, 4), 0.5), np.asarray(bias), 2, 2, 1)
  assert set(tops[0]) == {2, 3}  # transformers' rule, which the op departs from here


def test_errors_name_what_is_missing_or_wrong():
  fn = jaxact.moe_params_from_transformers
  sd = state_dict(MIXTRAL, "m.", bias=False)
  with pytest.raises(ValueError, match=r"no router 'x\.gate\.weight'"):
    fn(sd, prefix="x")
  del sd["m.experts.3.w2.weight"]
  with pytest.raises(ValueError, match=r"the down weights of experts \[3\] are missing"):
    fn(sd, prefix="m.")
  fused = state_dict("fused", "m.", bias=False)
  fused["m.experts.down_proj"] = fused["m.experts.down_proj"].swapaxes(1, 2)
  with pytest.raises(ValueError, match=r"`experts.down_proj` must be \(5, 6, 8\); got \(5, 8, 6\)"):
    fn(fused, prefix="m")
  fused["m.experts.gate_up_proj_bias"] = np.zeros((E, 2 * N))
  with pytest.raises(ValueError, match="gpt-oss"):
    fn(fused, prefix="m")
  with pytest.raises(TypeError, match="`state_dict` must be a mapping"):
    fn([("m.gate.weight", np.zeros((E, H)))])


def load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask=None):
  """transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2/3-MoE), in jnp (float64, so that
  JAX differentiates it): every layer's router logits concatenated, one loss of them all."""
  logits = jnp.concatenate(gate_logits, axis=0)
  routing_weights = jax.nn.softmax(logits, axis=-1)
  _, selected = jax.lax.top_k(routing_weights, top_k)
  expert_mask = jax.nn.one_hot(selected, num_experts, dtype=logits.dtype)  # (L*B*S, k, E)
  if attention_mask is None:
    tokens_per_expert = jnp.mean(expert_mask, axis=0)
    router_prob_per_expert = jnp.mean(routing_weights, axis=0)
  else:
    b, s = attention_mask.shape
    layers = logits.shape[0] // (b * s)
    m = jnp.broadcast_to(attention_mask[None, :, :, None, None], (layers, b, s, top_k, num_experts))
    m = m.reshape(-1, top_k, num_experts).astype(logits.dtype)
    tokens_per_expert = jnp.sum(expert_mask * m, axis=0) / jnp.sum(m, axis=0)
    m = jnp.broadcast_to(attention_mask[None, :, :, None], (layers, b, s, num_experts))
    m = m.reshape(-1, num_experts).astype(logits.dtype)
    router_prob_per_expert = jnp.sum(routing_weights * m, axis=0) / jnp.sum(m, axis=0)
  return num_experts * jnp.sum(tokens_per_expert * router_prob_per_expert[None])


def _layers(n=2, b=2, s=5, seed=3):
  """`n` layers' inputs (b, s, H) and moe_mlp parameters, float64."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    x = rng.normal(size=(b, s, H))
    params = (
      rng.normal(size=(H, E)),
      rng.normal(size=(E, H, N)) * H**-0.5,
      rng.normal(size=(E, H, N)) * H**-0.5,
      rng.normal(size=(E, N, H)) * N**-0.5,
    )
    out.append((jnp.asarray(x), tuple(map(jnp.asarray, params))))
  return out


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "attention-mask"])
def test_pooled_statistics_reproduce_transformers_pooled_balance_loss(masked):
  """Two layers' returned statistics, added, give transformers' pooled loss of their concatenated
  router logits, with and without its attention_mask (left padding); value and gradients of the
  two routers."""
  layers = _layers()
  mask = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]) if masked else None
  k = 2

  def ours(routers):
    stats = [
      jaxact.moe_mlp(x, r, *p[1:], top_k=k, token_mask=mask, return_stats=True)[1]
      for (x, p), r in zip(layers, routers, strict=True)
    ]
    c, ps, n = (
      sum(a[key] for a in stats) for key in ("expert_counts", "router_prob_sums", "tokens")
    )
    return E * jnp.sum(c * ps) / n**2, stats

  def theirs(routers):
    logits = tuple(x.reshape(-1, H) @ r for (x, _), r in zip(layers, routers, strict=True))
    return load_balancing_loss_func(logits, E, k, mask)

  routers = tuple(p[0] for _, p in layers)
  (got, stats), grad = jax.value_and_grad(ours, has_aux=True)(routers)
  want, want_grad = jax.value_and_grad(theirs)(routers)
  np.testing.assert_allclose(got, want, rtol=1e-13)
  jax.tree.map(
    lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-13), grad, want_grad
  )
  # One layer's own balance loss is transformers' of that layer alone, the padding left out.
  one = load_balancing_loss_func((layers[0][0].reshape(-1, H) @ routers[0],), E, k, mask)
  np.testing.assert_allclose(stats[0]["load_balancing_loss"], one, rtol=1e-13)
  assert float(stats[0]["tokens"]) == (8 if masked else 10)
  # Pooling is not averaging the layers' losses: the test tells them apart.
  mean = (stats[0]["load_balancing_loss"] + stats[1]["load_balancing_loss"]) / 2
  assert abs(float(mean) - float(want)) > 1e-6


def padded_reference(x, router, w_gate, w_up, w_down, mask, top_k, capacity_factor):
  """moe_mlp's formula with padding, float64 numpy: softmax top-k renormalized; a padding row
  goes to no expert; each expert admits the first ceil(c * T * k / E) of the real tokens routed
  to it (T counting every row), in token order."""
  t, e = x.shape[0], router.shape[1]
  capacity = math.inf if capacity_factor is None else math.ceil(capacity_factor * t * top_k / e)
  z = x @ router
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  used, y = np.zeros(e, int), np.zeros((t, w_down.shape[2]))
  for i in range(t):
    if not mask[i]:
      continue
    top = np.argsort(-p[i], kind="stable")[:top_k]
    for j, w in zip(top, p[i, top] / p[i, top].sum(), strict=True):
      if used[j] < capacity:
        used[j] += 1
        y[i] += w * ((_silu(x[i] @ w_gate[j]) * (x[i] @ w_up[j])) @ w_down[j])
  return y


def test_padding_takes_no_capacity_and_gets_no_output():
  """Left padding under a capacity: the real tokens keep every slot, the padding rows get zeros
  and no gradient, and the z-loss is the mean over the real tokens."""
  ((x, params),) = _layers(n=1, b=1, s=10, seed=4)
  x = x.reshape(10, H)
  mask = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1], bool)  # left padding: four rows first
  kw = dict(top_k=2, capacity_factor=0.6)  # 3 rows an expert: padding would crowd real tokens
  run = jax.jit(lambda x, mask: jaxact.moe_mlp(x, *params, token_mask=mask, **kw))
  y, aux = run(x, mask)
  xs = [np.asarray(a) for a in (x, *params)]
  want = padded_reference(*xs, mask, **kw)
  np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
  z = xs[0] @ xs[1]
  lse = np.log(np.exp(z).sum(-1))
  np.testing.assert_allclose(aux["router_z_loss"], np.mean(lse[mask] ** 2), rtol=1e-13)
  unmasked = np.asarray(run(x, np.ones(10, bool))[0])
  assert not np.allclose(unmasked[mask], want[mask])  # the padding would have taken capacity
  dx = jax.grad(lambda x: jnp.sum(run(x, mask)[0] ** 2))(x)
  np.testing.assert_array_equal(dx[~mask], 0)
  dropless, _ = jaxact.moe_mlp(x, *params, top_k=2, token_mask=mask)
  want = padded_reference(*xs, mask, top_k=2, capacity_factor=None)
  np.testing.assert_allclose(dropless, want, rtol=1e-12, atol=1e-12)


def test_mask_and_stats_errors_name_the_argument():
  ((x, params),) = _layers(n=1)
  with pytest.raises(TypeError, match=r"`token_mask` has dtype float64; accepted: bool or integer"):
    jaxact.moe_mlp(x, *params, top_k=2, token_mask=jnp.ones((2, 5)))
  with pytest.raises(ValueError, match=r"`token_mask` has shape \(10,\); accepted: x's leading"):
    jaxact.moe_mlp(x, *params, top_k=2, token_mask=jnp.ones((10,), bool))
  with pytest.raises(TypeError, match="`return_stats` must be a bool; got int"):
    jaxact.moe_mlp(x, *params, top_k=2, return_stats=1)
  mesh = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):  # the experts split over a mesh axis, even of one device
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    split = [put(params[0])] + [put(w, "expert") for w in params[1:]]
    with pytest.raises(NotImplementedError, match="`token_mask` with the experts split"):
      jaxact.moe_mlp(put(x, "expert"), *split, top_k=2, token_mask=jnp.ones((2, 5), bool))
