"""Few-bit derivative codes (``residual_bits``): the stored codes are optimal, encode and pack as a
float64 NumPy reference says, and the gradients are the code's, with nothing but the code kept."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.codes import code as codes
from jaxact._src.codes import derive
from jaxact._src.core.spec import SPEC_BY_NAME

from cases import representatives

CASES = [
  (name, params, bits)
  for name in codes.CODED
  for params in codes.param_combinations(SPEC_BY_NAME[name])
  for bits in codes.BITS
]


def case_id(name, params, bits):
  return f"{name}{''.join(f'-{k}={v}' for k, v in params)}-{bits}"


IDS = [case_id(*c) for c in CASES]
FEW = [c for c in CASES if c[2] != 8]


def derivative(name, params):
  return derive._derivative_fn(SPEC_BY_NAME[name], params)


# ------------------------------------------------------------------------- the codes are optimal


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "name, params, bits",
  representatives(
    FEW, {"gelu-approximate=True-4", "silu-2", "hard_silu-4"}, [case_id(*c) for c in FEW]
  ),
)
def test_few_bit_codes_meet_the_optimality_conditions(name, params, bits):
  """Each level is the conditional mean of f' on its interval (for a standard normal x), and at a
  boundary where f' is continuous f' is halfway between the levels on either side; moving any
  boundary either way makes the expected squared error larger."""
  code, d = codes.get_code(name, params, bits), derivative(name, params)
  assert len(code.levels) == 2**bits and len(code.boundaries) == 2**bits - 1
  assert np.all(np.diff(code.boundaries) > 0)
  grid = np.linspace(-10.0, 10.0, 400_001)
  means = derive._conditional_means(d, np.asarray(code.boundaries), grid)
  np.testing.assert_allclose(code.levels, means, atol=1e-9)
  for k, t in enumerate(code.boundaries):
    left, right = d(np.array([t - 1e-3, t + 1e-3]))
    if abs(left - right) < 1e-2:  # continuous here (hard_silu jumps at -3 and 3)
      # To the derivation's grid (spacing 5e-5 on x).
      assert abs(d(np.array([t]))[0] - 0.5 * (code.levels[k] + code.levels[k + 1])) < 5e-5
  best = derive.expected_error(d, code.boundaries, code.levels, grid)
  for k in range(len(code.boundaries)):
    for step in (-0.02, 0.02):
      moved = np.array(code.boundaries)
      moved[k] += step
      if np.all(np.diff(moved) > 0):
        levels = derive._conditional_means(d, moved, grid)
        assert derive.expected_error(d, moved, levels, grid) >= best - 1e-12, (k, step)


@pytest.mark.parametrize(
  "name, params, bits",
  representatives(FEW, {"gelu-approximate=True-4", "silu-2"}, [case_id(*c) for c in FEW]),
)
def test_few_bit_codes_are_the_global_optimum_on_a_grid(name, params, bits):
  """No split of a fine grid into 2**bits runs (exact dynamic programming) beats the stored code."""
  code, d = codes.get_code(name, params, bits), derivative(name, params)
  grid = np.linspace(-10.0, 10.0, 1601)
  cuts = derive._segment(d(grid), derive._normal_pdf(grid), 2**bits)
  boundaries = np.asarray([(grid[c - 1] + grid[c]) / 2 for c in cuts])
  fine = np.linspace(-10.0, 10.0, 400_001)
  dp = derive.expected_error(d, boundaries, derive._conditional_means(d, boundaries, fine), fine)
  assert derive.expected_error(d, code.boundaries, code.levels, fine) <= dp * (1 + 1e-9)


@pytest.mark.sample(2)
@pytest.mark.parametrize("name, params", [(n, p) for n, p, b in CASES if b == 8])
def test_eight_bit_range_is_the_derivative_range(name, params):
  lo, hi = codes.get_code(name, params, 8).levels
  v = derivative(name, params)(np.linspace(-60.0, 60.0, 600_001))
  # The range covers every value (a value outside would be clipped), and no more than the grid's
  # resolution beyond (hard_silu's infimum -0.5 is a limit, not attained).
  assert lo <= v.min() and hi >= v.max()
  assert v.min() - lo < 1e-4 and hi - v.max() < 1e-4


@pytest.mark.sample(1)
@pytest.mark.parametrize("name, params", [(n, p) for n, p, b in CASES if b == 8])
def test_what_the_eight_bit_code_quantizes_is_the_derivative(name, params):
  """The spec's ``d_code`` (fewer transcendentals than ``d_input``), evaluated in float32, is
  within 2e-6 of the float64 derivative, far below the code's half step, at every input."""
  x = np.concatenate([np.linspace(-100.0, 100.0, 400_001), [0.0, -1e4, 1e4, -1e30, 1e30]])
  x = np.concatenate([x, -np.finfo(np.float32).max * np.array([1.0, -1.0]), [20.0, -88.0, -104.0]])
  x = x.astype(np.float32)
  spec = SPEC_BY_NAME[name]
  got = jax.jit(lambda v: spec.derivative_for_code(v, **dict(params)))(x)
  assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
  err = np.max(np.abs(np.asarray(got, np.float64) - derivative(name, params)(x.astype(np.float64))))
  assert err < 2e-6 < codes.get_code(name, params, 8).max_error / 100


# ------------------------------------------------------------------- encoding, packing, dtypes

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64]
gelu_d = SPEC_BY_NAME["gelu"].derivative_from_input


def _inputs(dtype, shape, code):
  """Normal samples plus every boundary and its float neighbours in `dtype`."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal(int(np.prod(shape))) * 3
  edges = np.asarray(code.boundaries, np.float64)
  special = np.concatenate([edges, np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf)])
  special = np.concatenate([special, [0.0, -60.0, 60.0, 1e30, -1e30]])[: x.size]
  x[: special.size] = special
  return jnp.asarray(x.reshape(shape)).astype(dtype)


ENCODE = [(bits, dtype) for bits in codes.BITS for dtype in DTYPES]


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "bits, dtype",
  representatives(
    ENCODE,
    {"8-float16", "4-bfloat16", "2-float32", "4-float64"},
    [f"{b}-{np.dtype(d).name}" for b, d in ENCODE],
  ),
)
def test_encode_and_pack_match_a_numpy_reference(bits, dtype):
  code = codes.get_code("gelu", (("approximate", True),), bits)
  d = derivative("gelu", (("approximate", True),))
  for shape in ((3, 5), (4, 6), (2, 8), (7,)):  # ragged, flattened, last-axis packing
    x = _inputs(dtype, shape, code)
    cdt = jnp.float64 if dtype == jnp.float64 else jnp.float32
    xc = np.asarray(x.astype(cdt))
    d_fn = functools.partial(gelu_d, approximate=True)
    got = jax.jit(lambda v, d_fn=d_fn: code.encode(v, d_fn))(x.astype(cdt))
    if bits == 8:
      lo, hi = code.levels
      want = np.clip(np.round((d(xc.astype(np.float64)) - lo) * (255 / (hi - lo))), 0, 255)
      assert np.max(np.abs(np.asarray(got, np.int32) - want)) <= 1  # f' rounded in float32
    else:
      t = np.asarray(code.boundaries).astype(xc.dtype)  # compared in the compute dtype
      want = np.searchsorted(t, xc, side="left")
      np.testing.assert_array_equal(got, want)
    want = np.asarray(got, np.uint8)
    packed = jax.jit(code.pack)(got)
    assert packed.dtype == jnp.uint8 and packed.shape == code.packed_shape(shape)
    per = 8 // bits
    assert packed.size == -(-int(np.prod(shape)) // per) or shape[-1] % per == 0
    flat = want.reshape(-1) if shape[-1] % per else want.reshape(*shape[:-1], -1, per)
    if shape[-1] % per:
      flat = np.pad(flat, (0, -flat.size % per)).reshape(-1, per)
    ref = np.zeros(flat.shape[:-1], np.int64)
    for j in range(per):
      ref |= flat[..., j].astype(np.int64) << (j * bits)
    np.testing.assert_array_equal(np.asarray(packed).reshape(ref.shape), ref)
    unpack = jax.jit(code.unpack, static_argnums=1)
    np.testing.assert_array_equal(unpack(packed, shape), want)


GRADIENT = [(*c, dtype) for c in CASES for dtype in DTYPES]
GRADIENT_DEFAULT = {
  "gelu-approximate=True-4-bfloat16",
  "silu-8-float32",
  "mish-2-float16",
  "hard_silu-4-float64",
  "gelu_quick-2-float32",
}


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "name, params, bits, dtype",
  representatives(
    GRADIENT, GRADIENT_DEFAULT, [f"{case_id(*c[:3])}-{np.dtype(c[3]).name}" for c in GRADIENT]
  ),
)
def test_gradient_is_the_codes(name, params, bits, dtype):
  """``g * q(x)`` with q the code's f' (exactly, for 4 and 2 bits; within half a step of f' for 8
  bits), the value unchanged (to two ulps: the coded program and the plain one are compiled apart,
  and XLA may round gelu's erf differently in each), and only the packed code kept."""
  fn = functools.partial(jaxact.get_activation(name), **dict(params), residual_bits=bits)
  exact = functools.partial(jaxact.get_activation(name), **dict(params))
  code = codes.get_code(name, params, bits)
  x = _inputs(dtype, (6, 10), code)
  g = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2.0, x.shape)).astype(dtype)
  y, pull = jax.vjp(fn, x)
  np.testing.assert_allclose(y, exact(x), rtol=2 * float(jnp.finfo(dtype).eps), atol=0)
  kept = jax.tree.leaves(pull)
  assert [(k.dtype, k.shape) for k in kept] == [(jnp.uint8, code.packed_shape(x.shape))]
  (dx,) = pull(g)
  assert dx.dtype == dtype
  cdt = np.float64 if dtype == jnp.float64 else np.float32
  xc = np.asarray(x.astype(cdt))
  d = derivative(name, params)
  if bits == 8:
    want = np.asarray(g, np.float64) * d(xc.astype(np.float64))
    bound = np.abs(np.asarray(g, np.float64)) * (code.max_error + 1e-6)
    rounding = np.abs(want) * float(jnp.finfo(dtype).eps) + float(jnp.finfo(dtype).tiny)
    assert np.all(np.abs(np.asarray(dx, np.float64) - want) <= bound + rounding)
  else:
    t = np.asarray(code.boundaries).astype(cdt)
    q = np.asarray(code.levels, cdt)[np.searchsorted(t, xc, side="left")]
    want = (np.asarray(g, cdt) * q).astype(np.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(dx), want)


def test_fused_layers_keep_the_code_not_the_preactivation():
  x = jax.random.normal(jax.random.key(0), (16, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (8, 12), jnp.float32)
  b = jnp.zeros(12, jnp.float32)
  for bits, size in ((4, 16 * 6), (2, 16 * 3)):  # 8 bits: one byte an element, unpacked
    act = functools.partial(jaxact.silu, residual_bits=bits)
    layer = functools.partial(jaxact.dense_bias_act, activation=act)
    y, pull = jax.vjp(layer, x, w, b)
    kept = sorted((k.dtype.name, k.size) for k in jax.tree.leaves(pull))
    assert kept == sorted([("float32", x.size), ("float32", w.size), ("uint8", size)]), kept
    # Gradients: the composition's with the code's derivative in place of silu'.
    z = x @ w + b
    q = jnp.asarray(
      derive.decoded(
        codes.get_code("silu", (), bits), np.asarray(z, np.float64), derivative("silu", ())
      ),
      jnp.float32,
    )
    g = jnp.ones_like(y)
    dx, dw, db = pull(g)
    np.testing.assert_allclose(dw, x.T @ (g * q), rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(db, jnp.sum(g * q, 0), rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(dx, (g * q) @ w.T, rtol=2e-5, atol=1e-5)
  img = jax.random.normal(jax.random.key(2), (2, 6, 6, 3), jnp.float32)
  k = jax.random.normal(jax.random.key(3), (3, 3, 3, 4), jnp.float32)
  act = functools.partial(jaxact.gelu, residual_bits=2)
  _, pull = jax.vjp(lambda i, k: jaxact.conv_bias_act(i, k, activation=act), img, k)
  assert [k_.dtype.name for k_ in jax.tree.leaves(pull)].count("uint8") == 1
  assert all(
    leaf.size < 2 * 6 * 6 * 4 or leaf.dtype == jnp.uint8 or leaf.shape == img.shape
    for leaf in jax.tree.leaves(pull)
  )


def test_transformations_use_the_code():
  x = jax.random.normal(jax.random.key(0), (4, 6), jnp.float32)
  f = functools.partial(jaxact.gelu, residual_bits=4)
  want = jax.grad(lambda v: jnp.sum(f(v) * v))(x)
  for got in (
    jax.jit(jax.grad(lambda v: jnp.sum(f(v) * v)))(x),
    jax.vmap(jax.grad(lambda v: jnp.sum(f(v) * v)))(x),
    jax.grad(lambda v: jnp.sum(jax.checkpoint(f)(v) * v))(x),
  ):
    np.testing.assert_allclose(got, want, rtol=1e-6)

  def scanned(v):
    out, _ = jax.lax.scan(lambda c, row: (c + jnp.sum(f(row) * row), None), 0.0, v)
    return out

  np.testing.assert_allclose(jax.grad(scanned)(x), want, rtol=1e-6)


@pytest.mark.parametrize(
  "call, exc, match",
  [
    (
      lambda x: jaxact.gelu(x, residual_bits=3),
      ValueError,
      r"`residual_bits` must be None .* 8, 4 or 2; got 3",
    ),
    (lambda x: jaxact.silu(x, residual_bits=True), ValueError, r"got True"),
    (lambda x: jaxact.mish(x, residual_bits="4"), ValueError, r"got '4'"),
    (
      lambda x: jaxact.relu(x, residual_bits=4),
      ValueError,
      r"jaxact.relu keeps its output or nothing",
    ),
    (lambda x: jaxact.tanh(x, residual_bits=8), ValueError, r"derivative code cannot undercut"),
    (
      lambda x: jaxact.dense_bias_act(
        x, x, activation=functools.partial(jaxact.elu, residual_bits=2)
      ),
      ValueError,
      r"jaxact.dense_bias_act: `residual_bits` applies to the activations that keep their input",
    ),
    (
      lambda x: jaxact.dense_bias_act(
        x,
        x[:, :3],
        activation=functools.partial(jaxact.gelu, residual_bits=4),
        implementation="pallas",
      ),
      NotImplementedError,
      r"residual_bits=4: 4-bit codes are packed 2 to a byte along the features, and 3 features",
    ),
  ],
  ids=["bits-3", "bits-bool", "bits-str", "relu", "tanh", "fused-elu", "fused-pallas"],
)
def test_bad_residual_bits_raise_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call(jnp.ones((4, 4), jnp.float32))


def test_signatures_add_only_a_keyword_only_parameter():
  import inspect

  for name in codes.CODED:
    params = inspect.signature(jaxact.get_activation(name)).parameters
    assert params["residual_bits"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["residual_bits"].default is None
  assert "residual_bits" not in inspect.signature(jaxact.relu).parameters


def test_flax_layers_take_residual_bits():
  """``residual_bits=`` on DenseAct / ConvAct / LinearAct / nnx.ConvAct is the fused op with
  ``partial(act, residual_bits=...)``: same values and gradients, the code kept."""
  import flax.linen as nn
  from flax import nnx

  import jaxact.linen as jlinen
  import jaxact.nnx as jnnx

  x = jax.random.normal(jax.random.key(0), (8, 6), jnp.float32)
  layer = jlinen.DenseAct(10, activation="silu", residual_bits=4)
  params = layer.init(jax.random.key(1), x)
  k, b = params["params"]["kernel"], params["params"]["bias"]
  act = functools.partial(jaxact.silu, residual_bits=4)
  y, pull = jax.vjp(lambda p, x: layer.apply(p, x), params, x)
  y_op, pull_op = jax.vjp(lambda k, b, x: jaxact.dense_bias_act(x, k, b, activation=act), k, b, x)
  np.testing.assert_array_equal(y, y_op)
  g = jnp.ones_like(y)
  (dp, dx), (dk, db, dx_op) = pull(g), pull_op(g)
  np.testing.assert_array_equal(dp["params"]["bias"], db)
  np.testing.assert_array_equal(dp["params"]["kernel"], dk)
  np.testing.assert_array_equal(dx, dx_op)
  assert [leaf.dtype for leaf in jax.tree.leaves(pull)].count(jnp.uint8) == 1
  img = jnp.ones((1, 5, 5, 2), jnp.float32)
  conv = jlinen.ConvAct(3, (3, 3), activation="gelu", residual_bits=2)
  _, pull = jax.vjp(lambda p: conv.apply(p, img), conv.init(jax.random.key(2), img))
  assert [leaf.dtype for leaf in jax.tree.leaves(pull)].count(jnp.uint8) == 1
  linear = jnnx.LinearAct(6, 10, activation="mish", residual_bits=8, rngs=nnx.Rngs(0))
  _, pull = jax.vjp(lambda x: linear(x), x)
  assert [leaf.dtype for leaf in jax.tree.leaves(pull)].count(jnp.uint8) == 1
  with pytest.raises(ValueError, match=r"jaxact.linen.DenseAct: `residual_bits` applies to"):
    jlinen.DenseAct(4, activation="relu", residual_bits=4).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"jaxact.nnx.ConvAct: `residual_bits` applies to jaxact"):
    jnnx.ConvAct(2, 3, (3,), activation=nn.gelu, residual_bits=4, rngs=nnx.Rngs(0))
