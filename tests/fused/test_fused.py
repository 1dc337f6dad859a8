"""Tests of jaxact.dense_bias_act and jaxact.conv_bias_act (the XLA path).

Every op is compared with JAX's autodiff of the plain composition ``act(x @ w + b)`` /
``act(lax.conv_general_dilated(x, w) + b)`` written with jax.nn: values and the gradients of x, w
and b, for a random cotangent.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxprs_in_params
from jax.test_util import check_grads

import jaxact
from jaxact._src.fused.reference import conv_reference, dense_reference, reference_activation

from cases import representatives

# Values and gradients against the composition evaluated in float32 from the same (upcast) inputs.
# float32 differs only by summation order and by derivatives taken from y instead of x; half
# precision rounds the output, the kept residual and the gradients once each.
TOL = {
  jnp.float32: dict(atol=2e-5, rtol=2e-5),
  jnp.bfloat16: dict(atol=6e-2, rtol=3e-2),
  jnp.float16: dict(atol=8e-3, rtol=4e-3),
}

SLOPES = jnp.linspace(0.1, 0.6, 6, dtype=jnp.float32)  # per output feature

ELEMENTWISE = tuple(n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise)
NOT_ELEMENTWISE = tuple(n for n in jaxact.ACTIVATIONS if not jaxact.get_spec(n).elementwise)


def normal(key, shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def ones(shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


def dense_args(seed=0, x_shape=(2, 3, 5), out=6, dtype=jnp.float32):
  kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
  # Pre-activations spread over about [-6, 6], so every piece of every activation is exercised.
  w_scale = 2.5 / math.sqrt(x_shape[-1])
  return (
    normal(kx, x_shape, dtype),
    normal(kw, (x_shape[-1], out), dtype, w_scale),
    normal(kb, (out,), dtype),
  )


def assert_vjp_matches(fused, reference, args, dtype=jnp.float32, out_dtype=None):
  """Values and all gradients of `fused` equal the float32 autodiff of `reference`."""
  y, pull = jax.vjp(fused, *args)
  assert y.dtype == (out_dtype or dtype), (y.dtype, out_dtype or dtype)
  up = [a.astype(jnp.float32) for a in args]
  y_ref, pull_ref = jax.vjp(reference, *up)
  ct = normal(jax.random.key(7), y.shape, y.dtype)
  grads, grads_ref = pull(ct), pull_ref(ct.astype(jnp.float32))
  for g, a in zip(grads, args, strict=True):
    assert g.dtype == a.dtype and g.shape == a.shape
  as32 = lambda t: jax.tree.map(lambda v: v.astype(jnp.float32), t)
  tol = TOL[dtype]
  chex.assert_trees_all_close(as32(y), y_ref, **tol)
  # Gradients are sums over many products: compare relative to their overall size.
  for g, r in zip(grads, grads_ref, strict=True):
    scale = max(1.0, float(jnp.max(jnp.abs(r))))
    chex.assert_trees_all_close(as32(g) / scale, r / scale, **tol)
  return y


# ------------------------------------------------------------------------------ dense: values


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ELEMENTWISE + NOT_ELEMENTWISE)
def test_dense_every_activation_by_name(name):
  x, w, b = dense_args()
  fused = lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=name)
  assert_vjp_matches(fused, dense_reference(reference_activation(name)), (x, w, b))


@pytest.mark.sample(2, "partial-of-a-plain-function")
@pytest.mark.parametrize(
  "activation, reference",
  [
    (jaxact.elu, reference_activation("elu")),
    (jaxact.swish, reference_activation("silu")),  # an alias
    (
      functools.partial(jaxact.leaky_relu, negative_slope=0.2),
      functools.partial(jax.nn.leaky_relu, negative_slope=0.2),
    ),
    (
      functools.partial(jaxact.leaky_relu, negative_slope=-0.5),
      lambda z: jnp.where(z >= 0, z, -0.5 * z),
    ),
    (functools.partial(jaxact.elu, alpha=0.5), functools.partial(jax.nn.elu, alpha=0.5)),
    (functools.partial(jaxact.elu, alpha=-0.5), functools.partial(jax.nn.elu, alpha=-0.5)),
    (functools.partial(jaxact.celu, alpha=2.0), functools.partial(jax.nn.celu, alpha=2.0)),
    (functools.partial(jaxact.squareplus, b=1.0), functools.partial(jax.nn.squareplus, b=1.0)),
    (
      functools.partial(jaxact.gelu, approximate=False),
      functools.partial(jax.nn.gelu, approximate=False),
    ),
    (
      functools.partial(jaxact.leaky_relu, negative_slope=SLOPES),
      lambda z: jnp.where(z >= 0, z, SLOPES * z),
    ),
    (functools.partial(jaxact.softmax, axis=-2), functools.partial(jax.nn.softmax, axis=-2)),
    (jnp.sin, jnp.sin),
    (lambda z: z * jnp.tanh(z), lambda z: z * jnp.tanh(z)),
    (functools.partial(jaxact.tanh), jnp.tanh),
    (functools.partial(jnp.multiply, 3.0), lambda z: 3.0 * z),
  ],
  ids=[
    "function",
    "alias",
    "partial-slope",
    "partial-negative-slope",
    "partial-alpha",
    "partial-negative-alpha",
    "partial-celu",
    "partial-squareplus",
    "partial-gelu-exact",
    "partial-per-feature-slope",
    "partial-softmax-axis",
    "jnp.sin",
    "lambda",
    "partial-no-keywords",
    "partial-of-a-plain-function",
  ],
)
def test_dense_activation_forms(activation, reference):
  """Functions, aliases, partials with parameters (valid or not for the output residual, scalar
  or per-feature), non-elementwise jaxact functions and arbitrary callables."""
  x, w, b = dense_args(seed=1)
  fused = lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=activation)
  assert_vjp_matches(fused, dense_reference(reference), (x, w, b))


@pytest.mark.sample(1)
@pytest.mark.parametrize("x_shape", [(5,), (4, 5), (2, 3, 5), (2, 1, 3, 5)])
def test_dense_batch_dims(x_shape):
  x, w, b = dense_args(seed=2, x_shape=x_shape)
  fused = lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation="softplus")
  y = assert_vjp_matches(fused, dense_reference(jax.nn.softplus), (x, w, b))
  assert y.shape == (*x_shape[:-1], 6)


@pytest.mark.parametrize("name", ["relu", "gelu", "identity"])
def test_dense_without_bias(name):
  x, w, _ = dense_args(seed=3)
  fused = lambda x, w: jaxact.dense_bias_act(x, w, activation=name)
  assert_vjp_matches(fused, dense_reference(reference_activation(name)), (x, w))


@pytest.mark.sample(1)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["relu", "tanh", "elu", "gelu"])
def test_dense_half_precision(dtype, name):
  x, w, b = dense_args(seed=4, dtype=dtype)
  fused = lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=name)
  assert_vjp_matches(fused, dense_reference(reference_activation(name)), (x, w, b), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_half_precision_accumulates_in_float32(dtype):
  # 4096 ones summed in 16-bit stall at 256 (bfloat16) / 2048 (float16); in float32 they reach 4096.
  def grads(x, w, g):
    y, pull = jax.vjp(
      lambda x, w: jaxact.dense_bias_act(x, w, activation="identity", implementation="xla"), x, w
    )
    return y, *pull(g)

  ones = lambda *shape: jnp.ones(shape, dtype)
  y, _, _ = grads(ones(1, 4096), ones(4096, 1), ones(1, 1))  # forward: sum over K
  _, dx, _ = grads(ones(1, 1), ones(1, 4096), ones(1, 4096))  # dx: sum over N
  _, _, dw = grads(ones(4096, 1), ones(1, 1), ones(4096, 1))  # dw: sum over M
  assert float(y[0, 0]) == float(dx[0, 0]) == float(dw[0, 0]) == 4096.0


@pytest.mark.parametrize(
  "dtype, forward", [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float32)], ids=["bf16", "f16"]
)
def test_half_precision_matmuls_stay_16_bit(dtype, forward):
  # A float32 dz (or result) would make XLA run float32 matmuls: 3x slower on an H100, measured.
  x, w, b = dense_args(seed=5, dtype=dtype)
  closed = jax.make_jaxpr(
    lambda *a: jax.grad(
      lambda *a: (
        jaxact.dense_bias_act(*a, activation="tanh", implementation="xla").astype(jnp.float32).sum()
      ),
      (0, 1, 2),
    )(*a)
  )(x, w, b)
  dots = [e for e in all_eqns(closed.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 3  # forward, dx, dw
  for i, eqn in enumerate(dots):
    assert [v.aval.dtype for v in eqn.invars] == [dtype, dtype]
    assert eqn.params["preferred_element_type"] == (forward if i == 0 else dtype)


def all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jaxprs_in_params(eqn.params):
      yield from all_eqns(sub)


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "x_dtype, w_dtype, preferred, out",
  [
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32, None, jnp.float32),  # promoted as x @ w promotes
    (jnp.float16, jnp.float16, None, jnp.float16),
  ],
)
def test_dense_dtypes(x_dtype, w_dtype, preferred, out):
  x, w, b = dense_args(seed=6)
  x, w, b = x.astype(x_dtype), w.astype(w_dtype), b.astype(w_dtype)
  y = jaxact.dense_bias_act(x, w, b, activation="gelu", preferred_element_type=preferred)
  assert y.dtype == out
  ref = dense_reference(jax.nn.gelu)(*(a.astype(jnp.float32) for a in (x, w, b)))
  chex.assert_trees_all_close(y.astype(jnp.float32), ref, atol=5e-2, rtol=3e-2)
  gx, gw = jax.grad(
    lambda x, w: (
      jaxact.dense_bias_act(x, w, b, activation="gelu", preferred_element_type=preferred)
      .astype(jnp.float32)
      .sum()
    ),
    (0, 1),
  )(x, w)
  assert gx.dtype == x_dtype and gw.dtype == w_dtype


def test_precision_reaches_every_dot():
  x, w, b = dense_args(seed=7)
  # The XLA path; None also holds the Pallas branch for CUDA lowering
  # (tests/fused/test_dense_triton.py).
  loss = lambda x, w, b: jaxact.dense_bias_act(
    x, w, b, activation="tanh", precision=lax.Precision.HIGHEST, implementation="xla"
  ).sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, w, b))
  assert jaxpr.count("dot_general[") == 3  # forward, dx, dw
  assert jaxpr.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == 3
  # lax also takes a list of two; the plan that jit keys on must stay hashable.
  pair = [lax.Precision.HIGHEST, lax.Precision.HIGHEST]
  y = jaxact.dense_bias_act(x, w, b, activation="tanh", precision=pair)
  chex.assert_trees_all_close(y, jnp.tanh(x @ w + b), atol=1e-5, rtol=1e-5)


def test_named_scope_in_hlo():
  x, w, b = dense_args(seed=8)
  hlo = (
    jax.jit(lambda *a: jaxact.dense_bias_act(*a, activation="relu"))
    .lower(x, w, b)
    .as_text(debug_info=True)
  )
  assert "jaxact.dense_bias_act" in hlo
  xc, wc = ones((1, 4, 4, 2)), ones((3, 3, 2, 2))
  hlo = (
    jax.jit(lambda *a: jaxact.conv_bias_act(*a, activation="relu"))
    .lower(xc, wc)
    .as_text(debug_info=True)
  )
  assert "jaxact.conv_bias_act" in hlo


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_implementation_xla(implementation):
  x, w, b = dense_args(seed=9)
  y = jaxact.dense_bias_act(x, w, b, activation="relu", implementation=implementation)
  chex.assert_trees_all_close(y, jax.nn.relu(x @ w + b), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------- residuals


def activation_sized_residuals(fn, args, out_shape):
  _, pull = jax.vjp(fn, *args)
  return [leaf for leaf in jax.tree_util.tree_leaves(pull) if leaf.shape == out_shape]


@pytest.mark.sample(4)
@pytest.mark.parametrize(
  "activation, kept",
  [
    ("relu", "y"),
    ("tanh", "y"),
    ("elu", "y"),
    (functools.partial(jaxact.leaky_relu, negative_slope=0.2), "y"),
    (functools.partial(jaxact.leaky_relu, negative_slope=jnp.array(0.2)), "y"),  # concrete array
    ("gelu", "z"),
    ("silu", "z"),
    (functools.partial(jaxact.leaky_relu, negative_slope=-0.5), "z"),  # y does not determine x
    (jnp.sin, "z"),
    ("identity", None),
  ],
  ids=lambda v: getattr(v, "__name__", None) or str(v)[:40],
)
def test_dense_residual(activation, kept):
  # in != out, so x is never mistaken for an activation-sized residual.
  x, w, b = dense_args(seed=10, x_shape=(4, 5), out=6)
  fn = lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=activation)
  leaves = activation_sized_residuals(fn, (x, w, b), (4, 6))
  if kept is None:
    assert leaves == []
    return
  (leaf,) = leaves
  expected = fn(x, w, b) if kept == "y" else x @ w + b
  chex.assert_trees_all_close(leaf, expected, atol=1e-6, rtol=1e-6)


def test_traced_parameter_keeps_z_and_gets_its_gradient():
  x, w, b = dense_args(seed=11, x_shape=(4, 5), out=6)
  slope = jnp.float32(0.2)

  def fused(x, w, b, slope):
    return jaxact.dense_bias_act(
      x, w, b, activation=functools.partial(jaxact.leaky_relu, negative_slope=slope)
    )

  (leaf,) = activation_sized_residuals(fused, (x, w, b, slope), (4, 6))
  chex.assert_trees_all_close(leaf, x @ w + b, atol=1e-6, rtol=1e-6)
  assert_vjp_matches(
    fused, lambda x, w, b, s: jax.nn.leaky_relu(x @ w + b, negative_slope=s), (x, w, b, slope)
  )


def test_callable_closing_over_traced_array_gets_its_gradient():
  x, w, b = dense_args(seed=12, x_shape=(4, 5), out=6)
  scale = jnp.linspace(0.5, 1.5, 6, dtype=jnp.float32)

  def fused(x, w, b, scale):
    return jaxact.dense_bias_act(x, w, b, activation=lambda z: jnp.tanh(scale * z))

  assert_vjp_matches(fused, lambda x, w, b, s: jnp.tanh(s * (x @ w + b)), (x, w, b, scale))


def test_conv_residual_is_the_output():
  x = normal(jax.random.key(13), (2, 6, 6, 3))
  w = normal(jax.random.key(14), (3, 3, 3, 4))
  fn = lambda x, w: jaxact.conv_bias_act(x, w, activation="relu")
  (leaf,) = activation_sized_residuals(fn, (x, w), (2, 6, 6, 4))
  chex.assert_trees_all_close(leaf, fn(x, w))


# -------------------------------------------------------------------------------- conv layouts

CONV_CASES = {
  "1d-same": dict(n=1),
  "1d-valid-stride": dict(n=1, padding="VALID", window_strides=2),
  "2d-same": dict(n=2),
  "2d-same-lower": dict(n=2, padding="SAME_LOWER", window_strides=2),
  "2d-valid": dict(n=2, padding="VALID"),
  "2d-int-padding": dict(n=2, padding=1),
  "2d-pairs": dict(n=2, padding=((1, 0), (2, 1))),
  "2d-per-dim-strides": dict(n=2, window_strides=(2, 1)),
  "2d-lhs-dilation": dict(n=2, lhs_dilation=2, padding=((1, 1), (0, 1))),
  "2d-lhs-dilation-valid": dict(n=2, lhs_dilation=(2, 1), padding="VALID"),
  "2d-rhs-dilation": dict(n=2, rhs_dilation=(2, 1)),
  "2d-groups": dict(n=2, feature_group_count=2),
  "2d-depthwise": dict(n=2, feature_group_count=4),
  "2d-nchw": dict(n=2, dimension_numbers=("NCHW", "OIHW", "NCHW")),
  "3d-same": dict(n=3),
  "3d-stride-valid": dict(n=3, padding="VALID", window_strides=(1, 2, 1)),
}


def conv_args(case, seed=0, dtype=jnp.float32, c_in=4, c_out=4, k=3, size=7):
  n, groups = case["n"], case.get("feature_group_count", 1)
  kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
  if case.get("dimension_numbers"):  # NCHW / OIHW
    x_shape, w_shape = (2, c_in, *(size,) * n), (c_out, c_in // groups, *(k,) * n)
  else:
    x_shape, w_shape = (2, *(size,) * n, c_in), (*(k,) * n, c_in // groups, c_out)
  scale = 2.5 / math.sqrt(k**n * c_in / groups)
  return normal(kx, x_shape, dtype), normal(kw, w_shape, dtype, scale), normal(kb, (c_out,), dtype)


# Each convolution option once by default, with an output- or an input-residual activation in turn.
@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "case,name",
  representatives(
    [(c, n) for c in CONV_CASES.values() for n in ("relu", "gelu")],
    {f"{k}-{('relu', 'gelu')[i % 2]}" for i, k in enumerate(CONV_CASES)},
    ids=[f"{k}-{n}" for k in CONV_CASES for n in ("relu", "gelu")],
  ),
)
def test_conv_matches_composition(case, name):
  x, w, b = conv_args(case, seed=len(str(case)))
  kwargs = {k: v for k, v in case.items() if k != "n"}
  fused = lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation=name, **kwargs)
  assert_vjp_matches(fused, conv_reference(reference_activation(name), **case), (x, w, b))


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["tanh", "softplus", "identity", "leaky_relu"])
def test_conv_without_bias(name):
  case = CONV_CASES["2d-same"]
  x, w, _ = conv_args(case, seed=20)
  fused = lambda x, w: jaxact.conv_bias_act(x, w, activation=name)
  assert_vjp_matches(fused, conv_reference(reference_activation(name), **case), (x, w))


@pytest.mark.sample(1)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_conv_half_precision(dtype):
  case = CONV_CASES["2d-same"]
  x, w, b = conv_args(case, seed=21, dtype=dtype)
  fused = lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation="elu")
  assert_vjp_matches(fused, conv_reference(jax.nn.elu, **case), (x, w, b), dtype)


def primitives(fn, *args) -> str:
  return str(jax.make_jaxpr(jax.grad(lambda *a: fn(*a).sum(), range(len(args))))(*args))


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(padding="VALID"),
    dict(padding=0),
    dict(rhs_dilation=2),
    dict(window_strides=(1, 1)),
  ],
  ids=str,
)
def test_conv_1x1_takes_the_dense_path(kwargs):
  case = dict(n=2, **kwargs)
  x, w, b = conv_args(case, seed=22, k=1, c_out=6)
  fused = lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation="relu", **kwargs)
  jaxpr = primitives(fused, x, w, b)
  assert "dot_general" in jaxpr and "conv_general_dilated" not in jaxpr
  assert_vjp_matches(fused, conv_reference(jax.nn.relu, **case), (x, w, b))


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "kwargs",
  [
    dict(window_strides=2),
    dict(padding=1),
    dict(lhs_dilation=2, padding="VALID"),
    dict(feature_group_count=2),
  ],
  ids=str,
)
def test_conv_1x1_that_is_not_a_matmul_stays_a_conv(kwargs):
  case = dict(n=2, **kwargs)
  x, w, b = conv_args(case, seed=23, k=1)
  fused = lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation="relu", **kwargs)
  assert "conv_general_dilated" in primitives(fused, x, w, b)
  assert_vjp_matches(fused, conv_reference(jax.nn.relu, **case), (x, w, b))


# -------------------------------------------------------------------------------- transforms


def test_jit():
  x, w, b = dense_args(seed=30)
  fused = jax.jit(lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation="elu"))
  assert_vjp_matches(fused, dense_reference(jax.nn.elu), (x, w, b))
  case = CONV_CASES["2d-same"]
  x, w, b = conv_args(case, seed=31)
  fused = jax.jit(lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation="gelu"))
  assert_vjp_matches(fused, conv_reference(jax.nn.gelu, **case), (x, w, b))


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["tanh", "gelu"])
@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, 0), (0, 0, 0), (2, None, None)])
def test_vmap_dense(in_axes, name):
  x, w, b = dense_args(seed=32, x_shape=(3, 4, 5))
  w = jnp.stack([w, 2 * w, -w])
  b = jnp.stack([b, b, -b])
  x_in = x if in_axes[0] == 0 else jnp.moveaxis(x, 0, 2) if in_axes[0] == 2 else x[0]
  w_in = w if in_axes[1] == 0 else w[0]
  b_in = b if in_axes[2] == 0 else b[0]
  fused = jax.vmap(lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=name), in_axes)
  reference = jax.vmap(dense_reference(reference_activation(name)), in_axes)
  assert_vjp_matches(fused, reference, (x_in, w_in, b_in))


def test_vmap_conv():
  case = CONV_CASES["1d-same"]
  x, w, b = conv_args(case, seed=33)
  xs = jnp.stack([x, -x])
  fused = jax.vmap(lambda x: jaxact.conv_bias_act(x, w, b, activation="relu"))
  reference = jax.vmap(lambda x: conv_reference(jax.nn.relu, **case)(x, w, b))
  assert_vjp_matches(fused, reference, (xs,))


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "activation",
  ["tanh", "softplus", "gelu", "identity", functools.partial(jaxact.elu, alpha=0.5), jnp.sin],
  ids=["tanh", "softplus", "gelu", "identity", "elu_alpha0.5", "jnp.sin"],
)
def test_grad_of_grad_dense(activation):
  with jax.enable_x64(True):
    x, w, b = (a.astype(jnp.float64) for a in dense_args(seed=34, x_shape=(3, 4), out=2))
    f = lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=activation)
    check_grads(f, (x, w, b), order=2, modes=["rev"])


def test_grad_of_grad_conv():
  with jax.enable_x64(True):
    case = dict(n=2, window_strides=2)
    x, w, b = (a.astype(jnp.float64) for a in conv_args(case, seed=35, c_in=2, c_out=2, size=5))
    f = lambda x, w, b: jaxact.conv_bias_act(x, w, b, activation="softplus", window_strides=2)
    check_grads(f, (x, w, b), order=2, modes=["rev"])


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["tanh", "gelu"])
def test_hessian(name):
  """Forward over reverse: the fwd and bwd rules are plain, differentiable JAX."""
  x, w, b = dense_args(seed=40, x_shape=(3, 4), out=2)
  act = reference_activation(name)
  h = jax.hessian(lambda w: jaxact.dense_bias_act(x, w, b, activation=name).sum())(w)
  h_ref = jax.hessian(lambda w: act(x @ w + b).sum())(w)
  chex.assert_trees_all_close(h, h_ref, atol=1e-5, rtol=1e-5)


def mlp_params(seed, layers=3, width=5):
  keys = jax.random.split(jax.random.key(seed), 2 * layers)
  ws = jnp.stack([normal(k, (width, width), scale=1.5 / math.sqrt(width)) for k in keys[:layers]])
  bs = jnp.stack([normal(k, (width,)) for k in keys[layers:]])
  return ws, bs


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["relu", "gelu"])
def test_checkpoint(name):
  ws, bs = mlp_params(36)
  x = normal(jax.random.key(37), (4, 5))

  def net(layer):
    def f(x, ws, bs):
      for w, b in zip(ws, bs, strict=True):
        x = jax.checkpoint(layer)(x, w, b)
      return x

    return f

  fused = net(lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation=name))
  assert_vjp_matches(fused, net(dense_reference(reference_activation(name))), (x, ws, bs))


def test_scan():
  ws, bs = mlp_params(38)
  x = normal(jax.random.key(39), (4, 5))

  def net(layer):
    def f(x, ws, bs):
      return lax.scan(lambda x, wb: (layer(x, *wb), None), x, (ws, bs))[0]

    return f

  fused = net(lambda x, w, b: jaxact.dense_bias_act(x, w, b, activation="softplus"))
  assert_vjp_matches(fused, net(dense_reference(jax.nn.softplus)), (x, ws, bs))


# ------------------------------------------------------------------------------------ errors

X, W, B = ones((4, 3)), ones((3, 2)), ones((2,))


def dense(*args, **kwargs):
  return jaxact.dense_bias_act(*args, **{"activation": "relu", **kwargs})


def conv(*args, **kwargs):
  return jaxact.conv_bias_act(*args, **{"activation": "relu", **kwargs})


XC, WC = ones((1, 5, 5, 4)), ones((3, 3, 4, 6))


@pytest.mark.parametrize(
  "call, error, match",
  [
    (
      lambda: dense(ones((4, 3)), ones((5, 2))),
      ValueError,
      r"`x` has 3 features but `w` expects 5 \(x.shape=\(4, 3\), w.shape=\(5, 2\)\)",
    ),
    (lambda: dense(X, W, ones((3,))), ValueError, r"`b` has shape \(3,\) but the output has 2"),
    (lambda: dense(X, W, ones((1, 2))), ValueError, r"accepted: shape \(2,\) or None"),
    (lambda: dense(jnp.float32(1.0), W), ValueError, r"`x` must have rank >= 1 and `w` rank 2"),
    (lambda: dense(X, ones((3, 2, 1))), ValueError, r"w.shape=\(3, 2, 1\)"),
    (
      lambda: dense(X, W, activation="relux"),
      ValueError,
      r"dense_bias_act: activation 'relux' is not known; choose one of: .*relu",
    ),
    (lambda: dense(X, W, activation=3), TypeError, r"`activation` must be an activation name"),
    (
      lambda: dense(X, W, activation=functools.partial(jaxact.elu, slope=1.0)),
      TypeError,
      r"sets slope, which jaxact.elu does not take; its parameters: alpha",
    ),
    (
      lambda: dense(
        X, W, activation=functools.partial(jaxact.leaky_relu, negative_slope=jnp.ones(5))
      ),
      ValueError,
      r"`negative_slope` of jaxact.leaky_relu has shape \(5,\), which does not broadcast",
    ),
    (
      lambda: dense(X, W, activation=functools.partial(jaxact.celu, alpha=0.0)),
      ValueError,
      r"`alpha` must be nonzero",
    ),
    (
      lambda: dense(X.astype(jnp.int32), W),
      TypeError,
      r"`x` has dtype int32; accepted: floating-point dtypes",
    ),
    (lambda: dense(X, W.astype(bool)), TypeError, r"`w` has dtype bool"),
    (lambda: dense(X, W, B.astype(jnp.int32)), TypeError, r"`b` has dtype int32"),
    (lambda: dense(X.astype(jnp.complex64), W), TypeError, r"complex dtype"),
    (lambda: dense([[1.0, 2.0, 3.0]], W), TypeError, r"`x` must be a JAX/NumPy array"),
    (
      lambda: dense(X, W, preferred_element_type=jnp.int32),
      TypeError,
      r"`preferred_element_type` .* is not a floating-point dtype",
    ),
    (
      lambda: dense(X, W, activation=lambda z: jnp.maximum(z, 0), implementation="pallas"),
      NotImplementedError,
      r"implementation='pallas' does not support this call: the activation is a plain callable",
    ),
    (
      lambda: conv(
        ones((1, 3, 4, 4)),
        ones((2, 3, 3, 3)),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        implementation="pallas",
      ),
      NotImplementedError,
      r"implementation='pallas' does not support this call: the convolution's output is not "
      r"channels-last",
    ),
    (
      lambda: dense(X, W, implementation="cuda"),
      ValueError,
      r"`implementation` 'cuda' is not known; choose one of: None .*'xla', 'pallas'",
    ),
    (
      lambda: conv(XC, ones((3, 3, 5, 6))),
      ValueError,
      r"`x` has 4 features but `w` expects 5 .*x.shape=\(1, 5, 5, 4\), w.shape=\(3, 3, 5, 6\)",
    ),
    (
      lambda: conv(XC, ones((3, 3, 4, 6)), feature_group_count=2),
      ValueError,
      r"`x` has 4 features but `w` expects 8 \(4 per group x feature_group_count=2\)",
    ),
    (
      lambda: conv(XC, ones((3, 3, 1, 6)), feature_group_count=4),
      ValueError,
      r"`w` has 6 output features, which feature_group_count=4 does not divide",
    ),
    (
      lambda: conv(XC, WC, feature_group_count=0),
      ValueError,
      r"`feature_group_count` must be a positive",
    ),
    (lambda: conv(XC, ones((3, 4, 6))), ValueError, r"must have the same rank, at least 3"),
    (lambda: conv(ones((4, 3)), ones((3, 2))), ValueError, r"at least 3"),
    (lambda: conv(XC, WC, ones((4,))), ValueError, r"`b` has shape \(4,\) but the output has 6"),
    (lambda: conv(XC, WC, padding="FULL"), ValueError, r"`padding` 'FULL' is not known; accepted"),
    (
      lambda: conv(XC, WC, padding=((1, 1),)),
      ValueError,
      r"`padding` must be .* 2 \(low, high\) pairs",
    ),
    (
      lambda: conv(XC, WC, window_strides=(1, 1, 1)),
      ValueError,
      r"`window_strides` must be a positive int or a sequence of 2 positive ints",
    ),
    (lambda: conv(XC, WC, rhs_dilation=0), ValueError, r"`rhs_dilation` must be a positive int"),
    (lambda: conv(XC, WC, dimension_numbers=("NCHW", "OIHW")), ValueError, r"`dimension_numbers`"),
    (lambda: conv(XC.astype(jnp.int8), WC), TypeError, r"`x` has dtype int8"),
    (
      lambda: conv(XC.astype(jnp.float64), WC, implementation="pallas"),
      NotImplementedError,
      r"conv_bias_act: implementation='pallas' does not support this call: x dtype float64",
    ),
    (
      lambda: conv(XC, WC, lhs_dilation=2),
      ValueError,
      r"`padding` 'SAME' with lhs_dilation=\(2, 2\) is ambiguous; give explicit",
    ),
  ],
)
def test_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_errors_are_raised_under_jit():
  with pytest.raises(ValueError, match=r"`x` has 3 features but `w` expects 5"):
    jax.jit(lambda x, w: dense(x, w))(ones((4, 3)), ones((5, 2)))


def test_exports():
  assert "dense_bias_act" in jaxact.__all__ and "conv_bias_act" in jaxact.__all__
  assert np.isclose(float(dense(X, W, B)[0, 0]), 4.0)
