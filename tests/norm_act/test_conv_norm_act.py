"""jaxact.linen / jaxact.nnx ConvNormAct against Flax's conv, norm and activation written out:
variables, outputs, gradients (parameters and input), updated batch statistics (once a step, under
nn.remat and nn.scan too); what the pullback of a stack keeps; the compiled temp of a stack's
jit(grad), unrolled and scanned, against Flax's composition."""

from __future__ import annotations

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import pytest

import jaxact.linen as jnn
import jaxact.nnx as jnnx
from conv_cases import close, grads, inputs, nnx_grads, perturbed, scanned, stack

from cases import representatives

ACTS = {"identity": lambda z: z, "relu": jax.nn.relu, "silu": jax.nn.silu}


class FlaxConvNormAct(nn.Module):
  """What a Flax user writes: nn.Conv without bias, nn.BatchNorm or nn.GroupNorm, activation."""

  features: int
  kernel_size: tuple = (3, 3)
  strides: int = 1
  norm: str = "batch"
  activation: str = "relu"
  kw: tuple = ()
  conv_bias: bool = False

  @nn.compact
  def __call__(self, x, use_running_average=False):
    x = nn.Conv(self.features, self.kernel_size, self.strides, use_bias=self.conv_bias)(x)
    if self.norm == "batch":
      x = nn.BatchNorm(use_running_average=use_running_average, **dict(self.kw))(x)
    else:
      x = nn.GroupNorm(**dict(self.kw))(x)
    return ACTS[self.activation](x)


LINEN_CASES = {
  "batch-relu-f32": (dict(norm="batch", activation="relu"), jnp.float32),
  "batch-silu-stride2-f64": (
    dict(norm="batch", activation="silu", strides=2, kw=(("momentum", 0.8),)),
    jnp.float64,
  ),
  "group-silu-f32": (dict(norm="group", activation="silu", kw=(("num_groups", 4),)), jnp.float32),
  "group-relu-f64": (dict(norm="group", activation="relu", kw=(("num_groups", 2),)), jnp.float64),
  "group-conv-bias-f32": (
    dict(norm="group", activation="silu", kw=(("num_groups", 2),), conv_bias=True),
    jnp.float32,
  ),
}


_LINEN = [(c, True) for c in LINEN_CASES] + [
  (c, False) for c in LINEN_CASES if c.startswith("batch")
]
# The default suite: a batch norm training (float64, strided) and at inference, a group norm after a
# conv with its bias; the rest under `pytest -m exhaustive`.
_LINEN_DEFAULT = {"batch-silu-stride2-f64-True", "batch-relu-f32-False", "group-conv-bias-f32-True"}


@pytest.mark.parametrize(
  ("case", "train"),
  representatives(_LINEN, _LINEN_DEFAULT, ids=[f"{c}-{t}" for c, t in _LINEN]),
)
def test_linen_equals_flax_conv_norm_activation(case, train):
  """train=False with a batch norm: normalized by the (perturbed) running averages."""
  spec, dtype = LINEN_CASES[case]
  x = inputs(dtype)
  batch = spec["norm"] == "batch"
  kw = dict(spec.get("kw", ()))
  theirs = FlaxConvNormAct(8, **spec)
  layer = dict(norm=spec["norm"], activation=spec["activation"], param_dtype=dtype, **kw)
  layer["conv_use_bias"] = spec.get("conv_bias", False)
  ours = jnn.ConvNormAct(8, (3, 3), spec.get("strides", 1), **layer)
  call = dict(use_running_average=not train) if batch else {}
  variables = theirs.init(jax.random.key(2), x, **call)
  variables = perturbed(jax.tree.map(lambda v: v.astype(dtype), variables))
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(2), x, **call)) == jax.tree.map(
    jnp.shape, variables
  )
  mutable = ["batch_stats"] if batch and train else False

  close(grads(ours, variables, x, call, mutable), grads(theirs, variables, x, call, mutable), dtype)


def test_linen_init_is_flax_init():
  x = inputs(jnp.float32)
  for norm in ("batch", "group"):
    ours = jnn.ConvNormAct(8, (3, 3), norm=norm, num_groups=4, use_running_average=False)
    kw = (("num_groups", 4),) if norm == "group" else ()
    theirs = FlaxConvNormAct(8, norm=norm, kw=kw)
    v1 = ours.init(jax.random.key(3), x)
    v2 = theirs.init(jax.random.key(3), x, use_running_average=False)
    close(v1, v2, jnp.float32)


@pytest.mark.parametrize("wrap", ["remat", "scan"])
def test_batch_statistics_update_once_a_step_under_remat_and_scan(wrap):
  """nn.remat around the layer, or nn.scan over a stack: the updated running averages are the
  plain composition's (not updated twice by the backward pass's recomputation)."""
  x = inputs(jnp.float32, (4, 6, 6, 8))
  kw = dict(activation="relu", use_running_average=False)
  ours = lambda name: jnn.ConvNormAct(8, (3, 3), **kw, name=name)
  theirs = lambda name: FlaxConvNormAct(8, name=name)
  if wrap == "remat":
    ours_stack = stack(lambda name: nn.remat(jnn.ConvNormAct)(8, (3, 3), **kw, name=name))
    theirs_stack = stack(theirs)
  else:
    ours_stack, theirs_stack = scanned(ours), scanned(theirs)
  variables = perturbed(theirs_stack.init(jax.random.key(0), x))

  def step(module):
    def loss(params):
      y, new = module.apply({**variables, "params": params}, x, mutable=["batch_stats"])
      return jnp.sum(jnp.sin(y)), new

    return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])

  close(step(ours_stack), step(theirs_stack), jnp.float32)


class FlaxNNX(nnx.Module):
  def __init__(self, norm, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
    if norm == "batch":
      self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    else:
      self.norm = nnx.GroupNorm(8, num_groups=4, rngs=rngs)

  def __call__(self, x):
    return jax.nn.silu(self.norm(self.conv(x)))


# The group norm: test_norm_act_conv.py's nnx test runs it by default (NormActConv).
@pytest.mark.parametrize("norm", representatives(["batch", "group"], {"batch"}))
def test_nnx_equals_flax_conv_norm_activation(norm):
  x = inputs(jnp.float32)
  ct = jax.random.normal(jax.random.key(1), (4, 6, 6, 8), jnp.float32)
  kw = dict(momentum=0.9) if norm == "batch" else dict(num_groups=4)
  ours = jnnx.ConvNormAct(3, 8, (3, 3), norm=norm, activation="silu", rngs=nnx.Rngs(0), **kw)
  theirs = FlaxNNX(norm, nnx.Rngs(0))
  close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), jnp.float32)
  nnx.update(theirs.norm, jax.tree.map(lambda v: v * 1.5, nnx.state(theirs.norm, nnx.Param)))
  nnx.update(ours.norm, nnx.state(theirs.norm, nnx.Param))

  close(nnx_grads(ours, x, ct), nnx_grads(theirs, x, ct), jnp.float32)
  if norm == "batch":  # inference, with the running averages just updated
    want = jax.nn.silu(theirs.norm(theirs.conv(x), use_running_average=True))
    close(ours(x, use_running_average=True), want, jnp.float32)


def _pullback_arrays(module, x):
  variables = module.init(jax.random.key(0), x)

  def f(params, x):
    return module.apply({**variables, "params": params}, x, mutable=["batch_stats"])

  _, pull, _ = jax.vjp(f, variables["params"], x, has_aux=True)
  return [a for a in jax.tree.leaves(pull) if a.size >= x.size]


def test_the_pullback_of_a_stack_keeps_one_array_a_layer():
  x = inputs(jnp.float32, (4, 6, 6, 8))
  kw = dict(activation="relu", use_running_average=False)
  ours = _pullback_arrays(stack(lambda name: jnn.ConvNormAct(8, (3, 3), **kw, name=name)), x)
  theirs = _pullback_arrays(stack(lambda name: FlaxConvNormAct(8, name=name)), x)
  assert len(ours) == 3, [a.shape for a in ours]  # each layer's input
  assert len(theirs) >= 6, [a.shape for a in theirs]


def _temp(module, x):
  variables = module.init(jax.random.key(0), x)

  def loss(params):
    y, _ = module.apply({**variables, "params": params}, x, mutable=["batch_stats"])
    return jnp.sum(y * y)

  compiled = jax.jit(jax.grad(loss)).lower(variables["params"]).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# Unrolled: test_norm_act_conv.py's U-Net stack runs it by default (NormActConv and ConvNormAct).
@pytest.mark.parametrize("how", representatives(["unrolled", "scan"], {"scan"}))
def test_compiled_temp_of_a_stack_is_below_flax(how):
  x = inputs(jnp.float32, (8, 16, 16, 16))
  kw = dict(activation="relu", use_running_average=False)
  ours = lambda name: jnn.ConvNormAct(16, (3, 3), **kw, name=name)
  theirs = lambda name: FlaxConvNormAct(16, name=name)
  build = stack if how == "unrolled" else scanned
  t_ours, t_theirs = _temp(build(ours, 4), x), _temp(build(theirs, 4), x)
  layer = x.size * 4
  # measured: 6 and 8 layer-sized arrays against Flax's 13 and 17
  assert t_ours < 0.5 * t_theirs and t_ours < t_theirs - 4 * layer, (t_ours, t_theirs, layer)


def test_a_lax_scan_of_the_nnx_layer_keeps_less_than_flax():
  x = inputs(jnp.float32, (8, 16, 16, 16))

  def temp(make):
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
      return make(nnx.Rngs(key))

    stack = create(jax.random.split(jax.random.key(0), 4))
    graph, params, rest = nnx.split(stack, nnx.Param, ...)

    def loss(params):
      def body(x, layer_state):
        layer = nnx.merge(graph, *layer_state)
        return layer(x), None

      y, _ = jax.lax.scan(body, x, (params, rest))
      return jnp.sum(y * y)

    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  ours = temp(lambda r: jnnx.ConvNormAct(16, 16, (3, 3), activation="relu", rngs=r))
  theirs = temp(lambda r: FlaxNNXStackLayer(r))
  assert ours < 0.5 * theirs, (ours, theirs)


class FlaxNNXStackLayer(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(16, 16, (3, 3), use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.norm(self.conv(x)))


def test_a_bad_norm_names_the_layer():
  x = inputs(jnp.float32)
  with pytest.raises(ValueError, match=r"jaxact\.linen\.ConvNormAct: `norm` 'layer' is not"):
    jnn.ConvNormAct(8, (3, 3), norm="layer").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"jaxact\.nnx\.ConvNormAct: `norm` 'layer' is not"):
    jnnx.ConvNormAct(3, 8, (3, 3), norm="layer", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layer", ["ConvNormAct", "NormActConv"])
def test_a_bare_use_bias_is_refused_and_the_norms_bias_is_norm_use_bias(layer):
  """``nn.Conv(use_bias=False)`` ported as it stands would have turned off the norm's bias (a
  checkpoint's BatchNorm bias then silently unused): refused, naming both attributes."""
  x = inputs(jnp.float32)
  match = (
    rf"jaxact\.(linen|nnx)\.{layer}: `use_bias` \(got False\) .*`conv_use_bias`.*`norm_use_bias`"
  )
  with pytest.raises(TypeError, match=match):
    getattr(jnn, layer)(8, (3, 3), use_bias=False)
  with pytest.raises(TypeError, match=match):
    getattr(jnnx, layer)(3, 8, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
  kw = dict(use_running_average=False, norm_use_bias=False)
  variables = getattr(jnn, layer)(8, (3, 3), **kw).init(jax.random.key(0), x)
  assert "bias" not in variables["params"]["BatchNorm_0"]
  assert getattr(jnnx, layer)(3, 8, (3, 3), norm_use_bias=False, rngs=nnx.Rngs(0)).norm.bias is None
