"""transformers' MoE blocks on jaxact: jaxact.moe_params_from_transformers of a block's state dict,
given to jaxact.moe_mlp, against transformers' forward written here in float64 numpy on the
transformers-layout weights (Mixtral's ``MixtralSparseMoeBlock``, Qwen2/3-MoE's sparse blocks,
DeepSeek-V3's ``DeepseekV3MoE`` with one expert group); both layouts (transformers 5's fused
``experts.gate_up_proj`` / ``experts.down_proj``, the older per-expert ``Linear`` weights); the
errors.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxact

T, H, N, E = 10, 6, 8, 5  # tokens, hidden_size, intermediate size (I), experts


def _silu(v):
  return v / (1 + np.exp(-v))


def transformers_block(x, sd, prefix, *, top_k, score, normalize, scaling=1.0):
  """transformers' MoE block forward, float64: the router on ``gate.weight`` (softmax: Mixtral,
  Qwen; sigmoid with ``e_score_correction_bias`` for the choice: DeepSeek-V3, ``n_group=1``), then
  each chosen expert's SwiGLU, from either layout, as ``F.linear`` computes it (``x @ W.T``)."""
  logits = x @ sd[prefix + "gate.weight"].T
  if score == "softmax":
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choice = probs
  else:
    probs = 1 / (1 + np.exp(-logits))
    choice = probs + sd[prefix + "gate.e_score_correction_bias"]
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    top = np.argsort(-choice[t], kind="stable")[:top_k]
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


def state_dict(layout, prefix, bias, seed=0):
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
