"""jaxact.linen / jaxact.nnx NormActConv against Flax's norm, activation and conv written out:
variables, outputs, gradients (parameters and input), updated batch statistics (once a step under
nn.scan); what the pullback of a stack keeps; the compiled temp of a stack's jit(grad), unrolled
and scanned, against Flax's composition and against ConvNormAct's arrangement of the same stack."""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
import jaxact.linen as jnn
import jaxact.nnx as jnnx
from conv_cases import close, grads, inputs, nnx_grads, perturbed, scanned, stack

from cases import representatives

ACTS = {"identity": lambda z: z, "relu": jax.nn.relu, "silu": jax.nn.silu, "gelu": jax.nn.gelu}


class FlaxNormActConv(nn.Module):
  """What a Flax user writes: nn.BatchNorm or nn.GroupNorm, the activation, nn.Conv."""

  features: int
  norm: str = "group"
  activation: str = "silu"
  strides: int = 1
  kw: tuple = ()
  dtype: object = None

  @nn.compact
  def __call__(self, x, use_running_average=False):
    if self.norm == "batch":
      kw = dict(use_running_average=use_running_average, dtype=self.dtype, **dict(self.kw))
      x = nn.BatchNorm(**kw)(x)
    else:
      x = nn.GroupNorm(dtype=self.dtype, **dict(self.kw))(x)
    conv = nn.Conv(self.features, (3, 3), self.strides, dtype=self.dtype)
    return conv(ACTS[self.activation](x))


CASES = {
  "group-silu-f64": (dict(norm="group", activation="silu", kw=(("num_groups", 2),)), jnp.float64),
  "batch-relu-stride2-f64": (
    dict(norm="batch", activation="relu", strides=2, kw=(("momentum", 0.8),)),
    jnp.float64,
  ),
  "batch-gelu-f32": (dict(norm="batch", activation="gelu"), jnp.float32),
  "group-identity-f32": (
    dict(norm="group", activation="identity", kw=(("num_groups", 4),)),
    jnp.float32,
  ),
}


_LINEN = [(c, True) for c in CASES] + [(c, False) for c in CASES if "batch" in c]
# The default suite: a group norm and a strided batch norm training (float64), a batch norm at
# inference (float32); the rest under `pytest -m exhaustive`.
_LINEN_DEFAULT = {"group-silu-f64-True", "batch-relu-stride2-f64-True", "batch-gelu-f32-False"}


@pytest.mark.parametrize(
  ("case", "train"), representatives(_LINEN, _LINEN_DEFAULT, ids=[f"{c}-{t}" for c, t in _LINEN])
)
def test_linen_equals_flax_norm_activation_conv(case, train):
  """train=False with a batch norm: normalized by the (perturbed) running averages."""
  spec, dtype = CASES[case]
  x = inputs(dtype, (4, 6, 6, 4))
  batch = spec["norm"] == "batch"
  kw = dict(spec.get("kw", ()))
  theirs = FlaxNormActConv(8, **spec)
  ours = jnn.NormActConv(
    8, (3, 3), spec.get("strides", 1), norm=spec["norm"], activation=spec["activation"], **kw
  )
  call = dict(use_running_average=not train) if batch else {}
  variables = theirs.init(jax.random.key(2), x, **call)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(2), x, **call)) == jax.tree.map(
    jnp.shape, variables
  )
  close(ours.init(jax.random.key(2), x, **call), variables, jnp.float32)
  variables = perturbed(jax.tree.map(lambda v: v.astype(dtype), variables))
  mutable = ["batch_stats"] if batch and train else False

  close(grads(ours, variables, x, call, mutable), grads(theirs, variables, x, call, mutable), dtype)


def test_bfloat16_is_as_close_to_float32_as_flax_is():
  """bfloat16 output, and values and gradients no further from the float32 composition than
  Flax's own bfloat16 composition is (twice its error, plus one rounding)."""
  x = inputs(jnp.float32, (4, 8, 8, 8))
  exact = FlaxNormActConv(8, kw=(("num_groups", 4),))
  theirs = exact.clone(dtype=jnp.bfloat16)
  ours = jnn.NormActConv(8, (3, 3), norm="group", num_groups=4, activation="silu")
  ours = ours.clone(dtype=jnp.bfloat16)
  variables = perturbed(exact.init(jax.random.key(0), x))

  def run(module, x):
    def loss(params, x):
      y = module.apply({"params": params}, x)
      return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    return jax.grad(loss, (0, 1), has_aux=True)(variables["params"], x)

  want = run(exact, x)
  (g_ours, y_ours), (g_theirs, y_theirs) = (run(m, x.astype(jnp.bfloat16)) for m in (ours, theirs))
  assert y_ours.dtype == y_theirs.dtype == jnp.bfloat16
  leaves = [jax.tree.leaves(t) for t in ((g_ours, y_ours), (g_theirs, y_theirs), want)]
  for a, b, w in zip(*leaves, strict=True):
    a, b, w = (np.asarray(v, np.float64) for v in (a, b, w))
    e_ours, e_flax = np.max(np.abs(a - w)), np.max(np.abs(b - w))
    assert e_ours <= 2 * e_flax + 2**-8 * np.abs(w).max(), (e_ours, e_flax)


def test_batch_statistics_update_once_a_step_under_scan():
  x = inputs(jnp.float32, (4, 6, 6, 8))
  kw = dict(activation="relu", use_running_average=False)
  ours = scanned(lambda name: jnn.NormActConv(8, (3, 3), **kw, name=name))
  # jaxact's variance is the two-pass one whatever use_fast_variance: Flax's two-pass one agrees to
  # float32 rounding (its default E[x^2] - E[x]^2 is 40x further from float64 here)
  fast = (("use_fast_variance", False),)
  theirs = scanned(lambda name: FlaxNormActConv(8, "batch", "relu", kw=fast, name=name))
  variables = perturbed(theirs.init(jax.random.key(0), x))

  def step(module):
    def loss(params):
      y, new = module.apply({**variables, "params": params}, x, mutable=["batch_stats"])
      return jnp.sum(jnp.sin(y)), new

    return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])

  # One scale for every leaf: the convolutions' biases before a batch norm have no gradient but
  # float32 cancellation noise, small against the gradients around them.
  ours, theirs = step(ours), step(theirs)
  scale = max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(theirs))
  for u, v in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-5 * scale)


def test_the_pullback_of_a_stack_keeps_one_array_a_layer():
  x = inputs(jnp.float32, (4, 6, 6, 8))
  layers = stack(lambda name: jnn.NormActConv(8, (3, 3), norm="group", num_groups=4, name=name))
  variables = layers.init(jax.random.key(0), x)
  _, pull = jax.vjp(lambda p, x: layers.apply({"params": p}, x), variables["params"], x)
  kept = [a for a in jax.tree.leaves(pull) if a.size >= x.size]
  assert len(kept) == 3, [a.shape for a in kept]  # each layer's normalized input


class FlaxUNetBlock(nn.Module):
  """A diffusion U-Net residual block as Flax users write it."""

  ours: str = "flax"

  @nn.compact
  def __call__(self, x):
    c, gn = x.shape[-1], dict(num_groups=4)
    if self.ours == "flax":
      h = nn.Conv(c, (3, 3))(nn.silu(nn.GroupNorm(**gn)(x)))
      h = nn.Conv(c, (3, 3))(nn.silu(nn.GroupNorm(**gn)(h)))
    elif self.ours == "conv-norm-act":  # ConvNormAct's arrangement of the same block
      h = jnn.GroupNorm(activation="silu", **gn)(x)
      h = jnn.ConvNormAct(c, (3, 3), norm="group", activation="silu", conv_use_bias=True, **gn)(h)
      h = nn.Conv(c, (3, 3))(h)
    else:
      h = jnn.NormActConv(c, (3, 3), norm="group", activation="silu", **gn)(x)
      h = jnn.NormActConv(c, (3, 3), norm="group", activation="silu", **gn)(h)
    return x + h


def _temp(module, x):
  variables = module.init(jax.random.key(0), x)

  def loss(params):
    return jnp.sum(jnp.square(module.apply({"params": params}, x)))

  compiled = jax.jit(jax.grad(loss)).lower(variables["params"]).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# Scanned: test_conv_norm_act.py's stack under nn.scan runs it by default.
@pytest.mark.parametrize("how", representatives(["unrolled", "scan"], {"unrolled"}))
def test_a_unet_stack_keeps_less_than_flax_and_conv_norm_act(how):
  x = inputs(jnp.float32, (8, 16, 16, 16))
  build = stack if how == "unrolled" else scanned
  temps = {
    k: _temp(build(lambda name, k=k: FlaxUNetBlock(k, name=name), 4), x)
    for k in ("flax", "conv-norm-act", "norm-act-conv")
  }
  ours, layer = temps["norm-act-conv"], x.size * 4
  # measured (arrays of x's size): 14 against ConvNormAct's 16 and Flax's 35 unrolled
  assert ours < 0.5 * temps["flax"], temps
  assert ours < temps["conv-norm-act"] - 1.5 * layer, (temps, layer)


class FlaxNNX(nnx.Module):
  def __init__(self, norm, rngs):
    if norm == "batch":
      self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    else:
      self.norm = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.conv = nnx.Conv(4, 8, (3, 3), rngs=rngs)

  def __call__(self, x, use_running_average=None):
    call = {} if use_running_average is None else dict(use_running_average=use_running_average)
    return self.conv(jax.nn.silu(self.norm(x, **call)))


# The batch norm: test_conv_norm_act.py's nnx test runs it by default (ConvNormAct).
@pytest.mark.parametrize("norm", representatives(["batch", "group"], {"group"}))
def test_nnx_equals_flax_norm_activation_conv(norm):
  x = inputs(jnp.float32, (4, 6, 6, 4))
  ct = jax.random.normal(jax.random.key(1), (4, 6, 6, 8), jnp.float32)
  kw = dict(momentum=0.9) if norm == "batch" else dict(num_groups=2)
  ours = jnnx.NormActConv(4, 8, (3, 3), norm=norm, activation="silu", rngs=nnx.Rngs(0), **kw)
  theirs = FlaxNNX(norm, nnx.Rngs(0))
  close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), jnp.float32)
  nnx.update(theirs.norm, jax.tree.map(lambda v: v * 1.5 - 0.2, nnx.state(theirs.norm, nnx.Param)))
  nnx.update(ours.norm, nnx.state(theirs.norm, nnx.Param))

  close(nnx_grads(ours, x, ct), nnx_grads(theirs, x, ct), jnp.float32)
  if norm == "batch":  # inference, with the running averages just updated
    close(ours(x, use_running_average=True), theirs(x, use_running_average=True), jnp.float32)


def test_errors_name_the_layer():
  x = inputs(jnp.float32, (4, 6, 6, 4))
  with pytest.raises(ValueError, match=r"jaxact\.linen\.NormActConv: `norm` 'layer' is not"):
    jnn.NormActConv(8, (3, 3), norm="layer").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"jaxact\.nnx\.NormActConv: `norm` 'layer' is not"):
    jnnx.NormActConv(4, 8, (3, 3), norm="layer", rngs=nnx.Rngs(0))


# gelu_quick: a table activation by name, as sparse_sigmoid is; under `pytest -m exhaustive`.
@pytest.mark.parametrize(
  "activation",
  representatives(
    ["sparse_sigmoid", "gelu_quick", "leaky_relu-traced"], {"sparse_sigmoid", "leaky_relu-traced"}
  ),
)
def test_activations_beyond_jax_nn_follow_the_drop_in(activation):
  """The table's derivative where jax.nn's autodiff differs at a kink (sparse_sigmoid at +-1),
  where jax.nn has no such function (gelu_quick), and a traced parameter's gradient: equal to the
  drop-in norm followed by Flax's conv, float64, with pre-activations on the kinks."""
  x = inputs(jnp.float64, (4, 6, 6, 4))
  slope = jnp.asarray(0.3, jnp.float64)

  def model(ours, slope):
    act = (
      activation
      if activation != "leaky_relu-traced"
      else functools.partial(jaxact.leaky_relu, negative_slope=slope)
    )
    kw = dict(norm="group", num_groups=2, activation=act, param_dtype=jnp.float64)
    if ours:
      return jnn.NormActConv(8, (3, 3), **kw)

    class DropIn(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = jnn.GroupNorm(num_groups=2, activation=act, param_dtype=jnp.float64)(x)
        return nn.Conv(8, (3, 3), param_dtype=jnp.float64)(h)

    return DropIn()

  variables = model(False, slope).init(jax.random.key(1), x)
  # scale 0 and bias 1 on one channel: its pre-activation is 1, sparse_sigmoid's kink
  p = jax.tree.map(lambda v: v, variables["params"])
  norm = p["GroupNorm_0"]
  norm["scale"], norm["bias"] = norm["scale"].at[0].set(0.0), norm["bias"].at[0].set(1.0)

  def run(ours):
    def loss(params, x, slope):
      y = model(ours, slope).apply({"params": params}, x)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    return jax.grad(loss, (0, 1, 2))(p, x, slope)

  close(run(True), run(False), jnp.float64)
