"""The Flax MoEMLP layers (linen and nnx): Mixtral's parameter names and shapes, Flax Dense's
initializers per expert, and the same result and gradients as jaxact.moe_mlp of their parameters;
the two layers agree with each other's parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxact
import jaxact.linen
import jaxact.nnx

D, F, E, K = 8, 16, 4, 2


def _inputs(dtype=jnp.float32):
  return jax.random.normal(jax.random.key(1), (2, 5, D), jnp.float32).astype(dtype)


def _op(x, p, **kw):
  return jaxact.moe_mlp(x, p["gate"]["kernel"], p["w1"], p["w3"], p["w2"], top_k=K, **kw)


@pytest.mark.parametrize(
  "kw",  # the sigmoid router's options: the op's own tests (tests/moe/test_moe.py) by default
  [
    {},
    pytest.param(
      dict(score="sigmoid", normalize_top_k=False, features=6), marks=pytest.mark.exhaustive
    ),
  ],
)
def test_linen_layer_is_the_op_of_its_parameters(kw):
  layer = jaxact.linen.MoEMLP(num_experts=E, top_k=K, hidden_features=F, **kw)
  x = _inputs()
  # Jitted, here and below: one compile each, not the eager ops' hundreds.
  params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
  out = kw.get("features", D)
  shapes = jax.tree.map(jnp.shape, params)
  assert shapes == {"gate": {"kernel": (D, E)}, "w1": (E, D, F), "w3": (E, D, F), "w2": (E, F, out)}
  op_kw = {k: v for k, v in kw.items() if k != "features"}

  def layer_loss(p, x):
    y, aux = layer.apply({"params": p}, x)
    return jnp.sum(jnp.sin(y)) + aux["load_balancing_loss"] + aux["router_z_loss"]

  def op_loss(p, x):
    y, aux = _op(x, p, **op_kw)
    return jnp.sum(jnp.sin(y)) + aux["load_balancing_loss"] + aux["router_z_loss"]

  y, aux = jax.jit(layer.apply)({"params": params}, x)
  y_op, aux_op = jax.jit(lambda x, p: _op(x, p, **op_kw))(x, params)
  np.testing.assert_array_equal(y, y_op)
  np.testing.assert_array_equal(aux["router_z_loss"], aux_op["router_z_loss"])
  got = jax.jit(jax.grad(layer_loss, argnums=(0, 1)))(params, x)
  want = jax.jit(jax.grad(op_loss, argnums=(0, 1)))(params, x)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_initializers_are_dense_kernels_per_expert():
  """lecun normal: each expert's (in, out) kernel has variance 1 / in, not 1 / (experts * in)."""
  layer = jaxact.linen.MoEMLP(num_experts=8, top_k=2, hidden_features=128)
  params = jax.jit(layer.init)(jax.random.key(0), jnp.ones((1, 64), jnp.float32))["params"]
  for name, fan_in in (("w1", 64), ("w3", 64), ("w2", 128)):
    np.testing.assert_allclose(np.std(params[name]), fan_in**-0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(params["gate"]["kernel"]), 64**-0.5, rtol=0.1)
  assert params["w1"].dtype == jnp.float32


def test_nnx_layer_equals_the_linen_layer_with_its_parameters():
  layer = jaxact.nnx.MoEMLP(D, F, num_experts=E, top_k=K, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert layer.gate.kernel.shape == (D, E)
  assert (layer.w1.shape, layer.w3.shape, layer.w2.shape) == ((E, D, F), (E, D, F), (E, F, D))
  x = _inputs()  # float32, computed in bfloat16 (dtype)
  y, aux = layer(x)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape and layer.w1.dtype == jnp.float32
  params = {
    "gate": {"kernel": layer.gate.kernel[...]},
    "w1": layer.w1[...],
    "w3": layer.w3[...],
    "w2": layer.w2[...],
  }
  linen = jaxact.linen.MoEMLP(num_experts=E, top_k=K, hidden_features=F, dtype=jnp.bfloat16)
  y_linen, aux_linen = linen.apply({"params": params}, x)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_linen, np.float32))
  np.testing.assert_array_equal(aux["load_balancing_loss"], aux_linen["load_balancing_loss"])

  def loss(model, x):
    y, aux = model(x)
    return jnp.sum(y.astype(jnp.float32)) + aux["router_z_loss"]

  grads = nnx.grad(loss)(layer, x)
  assert grads.w1.shape == (E, D, F) and np.isfinite(np.asarray(grads.gate.kernel)).all()


def test_layer_errors_name_the_layer_and_attribute():
  with pytest.raises(ValueError, match=r"jaxact.linen.MoEMLP: `num_experts` must be a positive"):
    jaxact.linen.MoEMLP(num_experts=0, top_k=1, hidden_features=F).init(
      jax.random.key(0), _inputs()
    )
  with pytest.raises(ValueError, match=r"`top_k` is 5; accepted: 1 to the number of experts"):
    jaxact.nnx.MoEMLP(D, F, num_experts=E, top_k=5, rngs=nnx.Rngs(0))(_inputs())


def test_router_bias_is_routing_state_given_to_the_op():
  """DeepSeek-V3's balancing bias: a zero-initialized variable outside ``params`` (linen's
  ``routing`` collection, nnx's RouterBias), given to the op as its router_bias, no gradient."""
  bias = jnp.array([0.0, 0.6, -0.6, 0.3], jnp.float32)  # large enough to change the choice
  kw = dict(num_experts=E, top_k=K, score="sigmoid", use_router_bias=True)
  layer = jaxact.linen.MoEMLP(hidden_features=F, **kw)
  x = _inputs()
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  params = variables["params"]
  assert sorted(variables) == ["params", "routing"] and sorted(params) == ["gate", "w1", "w2", "w3"]
  np.testing.assert_array_equal(variables["routing"]["router_bias"], np.zeros(E, np.float32))
  y, _ = jax.jit(layer.apply)({"params": params, "routing": {"router_bias": bias}}, x)
  y_op, _ = jax.jit(lambda x, p: _op(x, p, score="sigmoid", router_bias=bias))(x, params)
  np.testing.assert_array_equal(y, y_op)
  y_unbiased, _ = jax.jit(lambda x, p: _op(x, p, score="sigmoid"))(x, params)
  assert not np.allclose(y, y_unbiased)  # the bias changed some token's experts

  model = jaxact.nnx.MoEMLP(D, F, **kw, rngs=nnx.Rngs(0))
  assert isinstance(model.router_bias, jaxact.nnx.RouterBias) and model.router_bias.shape == (E,)
  model.gate.kernel[...] = params["gate"]["kernel"]
  for name in ("w1", "w3", "w2"):
    getattr(model, name)[...] = params[name]
  model.router_bias[...] = bias
  y_nnx, _ = model(x)
  np.testing.assert_array_equal(y_nnx, y)
  grads = nnx.grad(lambda m, x: jnp.sum(m(x)[0]))(model, x)
  assert "router_bias" not in grads and "w1" in grads


def test_layers_pass_token_mask_and_return_stats_to_the_op():
  x = _inputs()
  mask = jnp.arange(5)[None, :] >= jnp.array([[0], [2]])  # the second row left-padded by 2
  layer = jaxact.linen.MoEMLP(num_experts=E, top_k=K, hidden_features=F, return_stats=True)
  params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
  y, aux = jax.jit(layer.apply)({"params": params}, x, mask)
  y_op, aux_op = jax.jit(lambda x, p: _op(x, p, token_mask=mask, return_stats=True))(x, params)
  np.testing.assert_array_equal(y, y_op)
  assert sorted(aux) == sorted(aux_op) and float(aux["tokens"]) == 8
  jax.tree.map(np.testing.assert_array_equal, aux, aux_op)
  model = jaxact.nnx.MoEMLP(D, F, num_experts=E, top_k=K, return_stats=True, rngs=nnx.Rngs(0))
  _, aux_nnx = model(x, mask)
  assert float(aux_nnx["tokens"]) == 8 and aux_nnx["expert_counts"].shape == (E,)


@pytest.mark.exhaustive  # the suite's time: each option's values are the op's tests'
def test_layers_pass_the_group_limit_balance_loss_and_capacity_to_the_op():
  """DeepSeek-V3's group-limited routing (``n_group``, ``topk_group``), its sequence-wise balance
  loss and the capacity per sequence as layer attributes."""
  x = _inputs()
  kw = dict(score="sigmoid", expert_groups=2, top_k_groups=1, balance_loss="deepseek_v3")
  kw |= dict(capacity_factor=0.5, capacity_per_sequence=True)
  layer = jaxact.linen.MoEMLP(num_experts=E, top_k=K, hidden_features=F, **kw)
  params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
  y, aux = jax.jit(layer.apply)({"params": params}, x)
  y_op, aux_op = jax.jit(lambda x, p: _op(x, p, **kw))(x, params)
  np.testing.assert_array_equal(y, y_op)
  np.testing.assert_array_equal(aux["load_balancing_loss"], aux_op["load_balancing_loss"])
  _, aux_switch = jax.jit(lambda x, p: _op(x, p, score="sigmoid"))(x, params)
  assert not np.allclose(aux["load_balancing_loss"], aux_switch["load_balancing_loss"])
  y_all, _ = jax.jit(lambda x, p: _op(x, p, score="sigmoid"))(x, params)
  assert not np.allclose(y, y_all)  # the limit changed some token's experts
  model = jaxact.nnx.MoEMLP(D, F, num_experts=E, top_k=K, **kw, rngs=nnx.Rngs(0))
  model.gate.kernel[...] = params["gate"]["kernel"]
  for name in ("w1", "w3", "w2"):
    getattr(model, name)[...] = params[name]
  np.testing.assert_array_equal(model(x)[0], y)
