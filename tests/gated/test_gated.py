"""Tests of jaxact.gated_dense and jaxact.gated_mlp (the XLA path).

Each op is compared with JAX's autodiff of the plain composition ``act(x @ w_g + b_g) * (x @ w_u +
b_u)`` (then ``@ w_d + b_d``) written with jax.nn: values and the gradients of every argument for a
random cotangent, in float64 (where the two differ only by rounding), float32 and the half
precisions; what the pullback keeps; transformations; NaN safety; the errors; the op keeping its
input alone (``residuals="input"``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxact
from jaxact._src.gated.reference import composition, reference_activation

from cases import representatives

ELEMENTWISE = tuple(n for n in jaxact.ACTIVATIONS if jaxact.get_spec(n).elementwise)
D, F, O = 8, 12, 6  # noqa: E741 (in, hidden, out)
BATCH = (3, 5)

TOL = {
  jnp.float64: dict(atol=1e-12, rtol=1e-12),
  jnp.float32: dict(atol=3e-5, rtol=3e-5),
  jnp.bfloat16: dict(atol=8e-2, rtol=4e-2),
  jnp.float16: dict(atol=1e-2, rtol=5e-3),
}


def ours(activation, mlp: bool, **kw):
  def f(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    if mlp:
      return jaxact.gated_mlp(
        x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation=activation, **kw
      )
    return jaxact.gated_dense(x, w_gate, w_up, b_gate, b_up, activation=activation, **kw)

  return f


def operands(dtype=jnp.float64, seed=0):
  ks = jax.random.split(jax.random.key(seed), 7)
  shapes = [(*BATCH, D), (D, F), (D, F), (F, O), (F,), (F,), (O,)]
  scales = [1.0, D**-0.5 * 2, D**-0.5, F**-0.5, 0.5, 0.5, 0.5]
  return tuple(
    (s * jax.random.normal(k, shape, jnp.float64)).astype(dtype)
    for k, shape, s in zip(ks, shapes, scales, strict=True)
  )


def value_and_grads(f, args, ct):
  y, pull = jax.vjp(f, *args)
  return y, pull(ct.astype(y.dtype))


def assert_close(got, want, dtype, what):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    np.testing.assert_allclose(
      np.asarray(g, np.float64), np.asarray(w, np.float64), err_msg=f"{what} [{i}]", **TOL[dtype]
    )


ACTIVATIONS = [(name, mlp) for name in ELEMENTWISE for mlp in (False, True)]
DEFAULT = {"silu-mlp", "gelu-mlp", "gelu-dense", "relu-mlp", "sigmoid-dense", "gelu_quick-dense"}


@pytest.mark.sample(2)
@pytest.mark.parametrize(
  "name, mlp",
  representatives(ACTIVATIONS, DEFAULT, [f"{n}-{'mlp' if m else 'dense'}" for n, m in ACTIVATIONS]),
)
def test_float64_matches_autodiff_of_the_composition(name, mlp):
  args = operands()
  ref = composition(reference_activation(name), mlp)
  y_ref, _ = jax.eval_shape(ref, *args), None
  ct = jax.random.normal(jax.random.key(9), y_ref.shape, jnp.float64)
  got = value_and_grads(jax.jit(ours(name, mlp)), args, ct)
  want = value_and_grads(ref, args, ct)
  assert_close(got, want, jnp.float64, f"{name} mlp={mlp}")


def test_gelu_exact_form_and_parametrised_activations(mlp=True):
  args = operands()
  ct = jnp.ones((*BATCH, O if mlp else F), jnp.float64)
  for act, ref in (
    (
      functools.partial(jaxact.gelu, approximate=False),
      reference_activation("gelu", approximate=False),
    ),
    (
      functools.partial(jaxact.leaky_relu, negative_slope=0.2),
      reference_activation("leaky_relu", negative_slope=0.2),
    ),
    (jaxact.elu, reference_activation("elu")),
  ):
    got = value_and_grads(ours(act, mlp), args, ct)
    want = value_and_grads(composition(ref, mlp), args, ct)
    assert_close(got, want, jnp.float64, f"{act}")


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "dtype",
  representatives(
    [jnp.float32, jnp.bfloat16, jnp.float16],
    {"float32", "bfloat16"},
    ["float32", "bfloat16", "float16"],
  ),
)
def test_lower_precisions_match_the_composition_in_float32(dtype):
  """Half precision accumulates and evaluates the gate in float32, keeping a and b rounded."""
  args = operands(dtype)
  up = tuple(a.astype(jnp.float32) for a in args)
  ct = jax.random.normal(jax.random.key(3), (*BATCH, O), jnp.float32)
  for name in ("gelu",):
    y, grads = value_and_grads(ours(name, True), args, ct.astype(dtype))
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    want = value_and_grads(composition(reference_activation(name), True), up, ct)
    assert_close((y, grads), want, dtype, f"{name} {dtype}")


@pytest.mark.parametrize(
  "act, mlp",
  representatives(
    [("silu", True), (functools.partial(jaxact.gelu, approximate=False), False)],
    {"silu-mlp"},
    ["silu-mlp", "gelu_exact-dense"],
  ),
)
def test_second_order_gradients(act, mlp):
  # Small operands: check_grads differentiates numerically along random directions.
  args = tuple(a[:1, :2] if a.ndim == 3 else a for a in operands())
  check_grads(ours(act, mlp), args, order=2, modes=["rev"])


def test_a_callable_activation_goes_through_autodiff():
  args = operands()
  ct = jnp.ones((*BATCH, O), jnp.float64)

  def act(z):
    return z * jnp.tanh(z)

  got = value_and_grads(ours(act, True), args, ct)
  want = value_and_grads(composition(act, True), args, ct)
  assert_close(got, want, jnp.float64, "callable")


def test_a_traced_activation_parameter_gets_its_gradient():
  x, w_gate, w_up, w_down, *_ = operands()

  def loss(slope, act_fn):
    return jnp.sum(jnp.sin(jnp.asarray(act_fn(slope)(x, w_gate, w_up, w_down))))

  def mine(slope):
    return lambda *a: jaxact.gated_mlp(
      *a, activation=functools.partial(jaxact.leaky_relu, negative_slope=slope)
    )

  def ref(slope):
    return lambda x, wg, wu, wd: (jax.nn.leaky_relu(x @ wg, slope) * (x @ wu)) @ wd

  slope = jnp.asarray(0.3, jnp.float64)
  got = jax.jit(jax.grad(lambda s: loss(s, mine)))(slope)
  want = jax.grad(lambda s: loss(s, ref))(slope)
  np.testing.assert_allclose(got, want, rtol=1e-12)


# ------------------------------------------------------------------------------ what is kept


def _hidden_sized(pull, n_rows):
  return [leaf for leaf in jax.tree.leaves(pull) if leaf.shape == (*BATCH, n_rows)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_gated_mlp_keeps_exactly_x_a_and_b(dtype):
  x, w_gate, w_up, w_down, b_gate, b_up, b_down = operands(dtype)
  _, pull = jax.vjp(
    lambda *a: jaxact.gated_mlp(*a, activation="gelu"),
    x,
    w_gate,
    w_up,
    w_down,
    b_gate,
    b_up,
    b_down,
  )
  leaves = jax.tree.leaves(pull)
  big = [leaf for leaf in leaves if leaf.size >= x.size]
  assert len(big) == 3, [leaf.shape for leaf in big]  # x, a and b: no h, no act(a)
  kept_x = [leaf for leaf in big if leaf.shape == x.shape]
  assert len(kept_x) == 1 and np.array_equal(kept_x[0], x)
  a, b = _hidden_sized(pull, F)
  f32 = jnp.float32
  a_want = (x.astype(f32) @ w_gate.astype(f32) + b_gate.astype(f32)).astype(dtype)
  b_want = (x.astype(f32) @ w_up.astype(f32) + b_up.astype(f32)).astype(dtype)
  tol = TOL[dtype]
  assert a.dtype == dtype and b.dtype == dtype
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(a_want, np.float32), **tol)
  np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(b_want, np.float32), **tol)
  # The rest is the weights (and the biases' absence of residuals: their gradients are sums).
  small = {leaf.shape for leaf in leaves if leaf.size < x.size}
  assert small <= {w_gate.shape, w_down.shape, (), (F,), (O,)}, small


def test_gated_dense_keeps_x_a_and_b():
  x, w_gate, w_up, *_ = operands()
  h, pull = jax.vjp(lambda *a: jaxact.gated_dense(*a), x, w_gate, w_up)
  big = [leaf.shape for leaf in jax.tree.leaves(pull) if leaf.size >= x.size]
  assert sorted(big) == sorted([x.shape, h.shape, h.shape]), big


# ---------------------------------------------------------------------------- transformations


def test_vmap_remat_and_scan_match_the_composition():
  args = operands()
  x, w_gate, w_up, w_down = args[:4]
  ref = composition(jax.nn.silu, True)
  zeros = (jnp.zeros(F), jnp.zeros(F), jnp.zeros(O))
  # vmap over a leading axis of x (and of the weights).
  got = jax.vmap(lambda x: jaxact.gated_mlp(x, w_gate, w_up, w_down))(x)
  np.testing.assert_allclose(got, ref(x, w_gate, w_up, w_down, *zeros), rtol=1e-12)
  w_down = jax.random.normal(jax.random.key(4), (F, D), jnp.float64) / 4  # residual: out = in
  zeros = (jnp.zeros(F), jnp.zeros(F), jnp.zeros(D))
  ws = jnp.stack([w_gate, 2 * w_gate]), jnp.stack([w_up, w_up]), jnp.stack([w_down, -w_down])
  got = jax.vmap(lambda g, u, d: jaxact.gated_mlp(x, g, u, d))(*ws)
  want = jax.vmap(lambda g, u, d: ref(x, g, u, d, *zeros))(*ws)
  np.testing.assert_allclose(got, want, rtol=1e-12)

  # A residual stack of blocks, scanned, under remat, differentiated.
  def stack(block):
    def loss(ws, x):
      def body(c, w):
        return c + block(c, *w), None

      c, _ = jax.lax.scan(body, x, ws)
      return jnp.sum(jnp.sin(c))

    return loss

  def mine(x, g, u, d):
    return jaxact.gated_mlp(x, g, u, d)

  def plain(x, g, u, d):
    return ref(x, g, u, d, *zeros)

  ws = tuple(w / 4 for w in ws)
  want = jax.grad(stack(plain), argnums=(0, 1))(ws, x)
  for block in (mine, jax.checkpoint(mine)):
    got = jax.jit(jax.grad(stack(block), argnums=(0, 1)))(ws, x)
    assert_close(got, want, jnp.float64, "scan")


# ------------------------------------------------------------------------------------ numerics


def test_an_overflowing_factor_times_zero_gives_zero_not_nan():
  """h = act(a) * b and da = gh * act'(a) * b are 0 where b = 0, also when the other factor
  overflows float32 (the composition's forward gives inf * 0 = NaN there)."""
  big = jnp.float32(3.3e38)
  x = jnp.array([[1.0, 1.0]], jnp.float32)
  w_up = jnp.array([[0.0], [0.0]], jnp.float32)  # b = 0
  w_gate = jnp.array([[big], [0.0]], jnp.float32)  # a = 3.3e38: selu(a) = inf
  h = jaxact.gated_dense(x, w_gate, w_up, activation="selu")
  assert np.isnan(jax.nn.selu(x @ w_gate) * (x @ w_up)).all()  # what autodiff's forward gives
  np.testing.assert_array_equal(h, 0.0)
  # a = 0.5: selu(a) = 0.53 and selu'(a) = 1.05, so gh * selu'(a) overflows and gh * selu(a) not.
  w_gate = jnp.array([[0.5], [0.0]], jnp.float32)
  h, pull = jax.vjp(lambda *a: jaxact.gated_dense(*a, activation="selu"), x, w_gate, w_up)
  dx, dw_gate, dw_up = pull(jnp.full_like(h, big))
  np.testing.assert_array_equal(dx, 0.0)
  np.testing.assert_array_equal(dw_gate, 0.0)
  np.testing.assert_allclose(dw_up, big * jax.nn.selu(0.5), rtol=1e-6)
  # b = 1e-3: gh * selu'(a) overflows, gh * selu'(a) * b = 3.5e35 does not (XLA's path: was inf).
  w_up = jnp.array([[1e-3], [0.0]], jnp.float32)
  h, pull = jax.vjp(lambda *a: jaxact.gated_dense(*a, activation="selu"), x, w_gate, w_up)
  dx, dw_gate, dw_up = pull(jnp.full_like(h, big))
  da = float(big) * 1.0507009873554805 * 1e-3  # selu'(0.5) = scale
  db = float(big) * float(jax.nn.selu(jnp.float64(0.5)))
  np.testing.assert_allclose(dw_gate, [[da], [da]], rtol=1e-6)
  np.testing.assert_allclose(dx, [[da * 0.5 + db * 1e-3, 0.0]], rtol=1e-6)


def test_biases_over_batch_axes_promote_no_rank():
  """gated_dense and gated_mlp with every bias over two batch axes, with and without dropout,
  traced under jax.numpy_rank_promotion("raise"): each (F,) bias was added to the (..., F)
  projection by implicit rank promotion."""
  x, w_gate, w_up, w_down, b_gate, b_up, b_down = operands(jnp.float32)
  drop = dict(dropout_rate=0.5, dropout_rng=jax.random.key(0))
  with jax.numpy_rank_promotion("raise"):
    for f in (
      lambda x: jaxact.gated_dense(x, w_gate, w_up, b_gate, b_up),
      lambda x: jaxact.gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down),
      lambda x: jaxact.gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, **drop),
    ):
      jax.make_jaxpr(jax.grad(lambda x, f=f: jnp.sum(f(x))))(x)


def test_nan_propagates():
  args = list(operands(jnp.float32))
  args[0] = args[0].at[0, 0, 0].set(jnp.nan)
  y, grads = value_and_grads(ours("silu", True), args, jnp.ones((*BATCH, O), jnp.float32))
  assert np.isnan(y[0, 0]).all() and np.isfinite(y[1:]).all()
  assert np.isnan(grads[1]).any()  # the weight gradients see the NaN example


def test_finite_for_large_finite_inputs_in_half_precision():
  args = operands(jnp.float16)
  x = args[0] * 3000  # a, b far beyond float16's range before rounding: inf, as the composition
  for name in ("silu", "relu"):
    y, grads = value_and_grads(ours(name, False), (x, *args[1:]), jnp.ones((*BATCH, F)))
    want = composition(reference_activation(name), False)(
      *(a.astype(jnp.float32) for a in (x, *args[1:]))
    )
    # Where the float32 result is in float16's range, so is ours; nowhere a NaN.
    in_range = np.abs(np.asarray(want)) < 60000
    assert np.isfinite(np.asarray(y, np.float32)[in_range]).all(), name
    assert not any(np.isnan(np.asarray(g, np.float32)).any() for g in (y, *grads)), name


# -------------------------------------------------------------------------------------- errors


def _call(fn="gated_mlp", **over):
  x, w_gate, w_up, w_down, *_ = operands(jnp.float32)
  kw = dict(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down) | over
  if fn == "gated_dense":
    kw.pop("w_down")
  return getattr(jaxact, fn)(**kw)


@pytest.mark.parametrize(
  "over, exc, match",
  [
    (dict(w_up=jnp.ones((D, F + 1))), ValueError, r"`w_up` must have the shape of `w_gate`"),
    (dict(w_down=jnp.ones((F + 1, O))), ValueError, r"`w_down` takes 13 features but the hidden"),
    (dict(w_gate=jnp.ones((D + 1, F))), ValueError, r"`x` has 8 features but `w_gate` expects 9"),
    (dict(w_gate=jnp.ones((D, F, 1))), ValueError, r"`w_gate` must have rank 2"),
    (dict(b_gate=jnp.ones((F + 1,))), ValueError, r"`b_gate` has shape \(13,\); accepted: shape"),
    (dict(b_up=jnp.ones((1, F))), ValueError, r"`b_up` has shape \(1, 12\)"),
    (
      dict(b_down=jnp.ones((F,))),
      ValueError,
      r"`b_down` has shape \(12,\); accepted: shape \(6,\)",
    ),
    (dict(x=jnp.ones((2, D), jnp.int32)), TypeError, r"`x` has dtype int32; accepted"),
    (dict(w_down=jnp.ones((F, O), jnp.complex64)), TypeError, r"`w_down`"),
    (dict(activation="relux"), ValueError, r"'relux' is not known"),
    (dict(activation=jaxact.glu), ValueError, r"must keep the gate's shape"),
    (dict(activation=3), TypeError, r"`activation` must be"),
    (
      dict(activation=functools.partial(jaxact.gelu, residual_bits=4)),
      ValueError,
      r"asks for residual_bits=4, but the gated ops keep",
    ),
    (dict(implementation="cuda"), ValueError, r"`implementation` 'cuda' is not known"),
    (dict(preferred_element_type=jnp.int8), TypeError, r"`preferred_element_type`"),
  ],
  ids=lambda v: None if isinstance(v, dict) else "",
)
def test_bad_input_raises_naming_the_argument(over, exc, match):
  with pytest.raises(exc, match=match):
    _call(**over)


def test_gated_dense_errors_name_its_function():
  with pytest.raises(ValueError, match=r"jaxact.gated_dense: `w_up` must have the shape"):
    _call("gated_dense", w_up=jnp.ones((D, F - 1)))


def test_named_residuals_let_a_remat_block_keep_only_its_input_a_and_b():
  """Under ``jax.checkpoint(policy=save_only_these_names(*GATED_CHECKPOINT_NAMES))`` a block
  ``x + gated_mlp(norm(x))`` keeps a and b (and its input), not the normed input; the gradients
  are the plain block's."""
  x, w_gate, w_up, w_down = operands(jnp.float32)[:4]
  w_down = jnp.ones((F, D), jnp.float32) / F

  def block(x, w_gate, w_up, w_down):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jaxact.gated_mlp(h, w_gate, w_up, w_down)

  policy = jax.checkpoint_policies.save_only_these_names(*jaxact.GATED_CHECKPOINT_NAMES)
  args = (x, w_gate, w_up, w_down)
  ct = jnp.ones_like(x)
  _, pull = jax.vjp(jax.checkpoint(block, policy=policy), *args)
  kept = sorted(leaf.shape for leaf in jax.tree.leaves(pull) if leaf.size >= x.size)
  assert kept == sorted([x.shape, (*BATCH, F), (*BATCH, F)]), kept
  _, plain = jax.vjp(block, *args)
  assert len([leaf for leaf in jax.tree.leaves(plain) if leaf.shape == x.shape]) == 2  # x, h
  assert_close(pull(ct), plain(ct), jnp.float32, "remat")


def test_a_scanned_stack_hoists_no_hidden_sized_array_out_of_its_loop():
  """Nothing of a block that depends on no loop input is computed once outside a scanned stack:
  an array of zeros made inside the op (the zero of ``safe_mul``) would be hoisted out of the
  loop as a whole (tokens, hidden) float32 buffer."""
  x, w_gate, w_up = operands(jnp.float32)[:3]
  w_down = jnp.ones((F, D), jnp.float32) / F  # a residual block: out features = in features
  ws = tuple(jnp.stack([w, w]) for w in (w_gate, w_up, w_down))

  def loss(ws, x):
    def block(x, w):
      return x + jaxact.gated_mlp(x, *w), None

    return jnp.sum(jax.lax.scan(block, x, ws)[0] ** 2)

  outer = jax.make_jaxpr(jax.grad(loss))(ws, x).jaxpr.eqns
  hoisted = [
    (e.primitive.name, v.aval.shape)
    for e in outer
    if e.primitive.name != "scan"
    for v in e.outvars
    if F in getattr(v.aval, "shape", ())
  ]
  assert hoisted == []


@pytest.mark.sample(1, "float32-dense")
@pytest.mark.parametrize("mlp", [True, False], ids=["mlp", "dense"])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_the_backward_in_blocks_of_tokens_equals_autodiff(monkeypatch, mlp, dtype):
  """The XLA backward a block of rows at a time (rules.backward_rows; 1024 rows by default, 4 here,
  so that the 15 tokens make four blocks, the last moved back over rows of the third): values and
  gradients of every argument as autodiff of the composition."""
  from jaxact._src.gated import rules

  monkeypatch.setattr(rules, "BACKWARD_ROWS", 4)
  args = operands(dtype)
  if not mlp:
    args = (*args[:3], None, *args[4:6], None)
  f = ours("gelu", mlp)
  keep = [a for a in args if a is not None]

  def call(*keep):
    full = iter(keep)
    return f(*(None if a is None else next(full) for a in args))

  ref = composition(reference_activation("gelu"), mlp)

  def call_ref(*keep):
    full = iter(keep)
    return ref(*(None if a is None else next(full) for a in args))

  wide = [a.astype(jnp.float64) for a in keep]
  ct = jnp.cos(jnp.arange(np.prod(BATCH) * (O if mlp else F))).reshape(*BATCH, -1)
  got = value_and_grads(call, keep, ct.astype(dtype))
  want = value_and_grads(call_ref, wide, ct)
  assert_close(got, want, dtype, "blocked")
  plan_rows = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(call(*a).astype(jnp.float32))))(*keep)
  assert "while" in str(plan_rows) or "scan" in str(plan_rows)  # the blocks' loop ran


def test_16_bit_weights_take_one_pass_over_every_token(monkeypatch):
  """No blocks for bfloat16 weights: their float32 gradient sums would cost more than the blocks
  save (rules.backward_rows); float32 weights of the same call run in blocks."""
  from jaxact._src.gated import rules

  monkeypatch.setattr(rules, "BACKWARD_ROWS", 4)

  def loops(dtype):
    args = operands(dtype)[:4]
    grad = jax.grad(lambda *a: jnp.sum(jaxact.gated_mlp(*a).astype(jnp.float32)), (0, 1, 2, 3))
    text = str(jax.make_jaxpr(grad)(*args))
    return "while" in text or "scan" in text

  assert loops(jnp.float32) and not loops(jnp.bfloat16)


# ------------------------------------------------------ residuals="input": the input kept alone


def call(mlp, activation="silu", **kw):
  return ours(activation, mlp, **kw)


@pytest.mark.sample(1, "dense-float64-blocks", "mlp-bfloat16-whole")
@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("mlp", [True, False], ids=["mlp", "dense"])
def test_keeping_the_input_gives_the_gradients_of_the_composition(monkeypatch, mlp, dtype, blocks):
  """Values and every gradient as autodiff of the composition (float64), and equal to the default's
  to rounding; `blocks`: the backward in blocks of 4 rows (the 15 tokens make four, the last
  moved back), each block's a and b recomputed from its rows of x (float64; 16-bit weights take
  one pass)."""
  from jaxact._src.gated import rules

  if blocks:
    monkeypatch.setattr(rules, "BACKWARD_ROWS", 4)
  args = operands(dtype)
  ct = jnp.cos(jnp.arange(np.prod(BATCH) * (O if mlp else F))).reshape(*BATCH, -1)
  got = value_and_grads(call(mlp, activation="gelu", residuals="input"), args, ct)
  wide = [a.astype(jnp.float64) for a in args]
  want = value_and_grads(composition(reference_activation("gelu"), mlp), wide, ct)
  assert_close(got, want, dtype, "against autodiff")
  kept = value_and_grads(call(mlp, activation="gelu"), args, ct)
  for g, k in zip(jax.tree.leaves(got), jax.tree.leaves(kept), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(k, np.float64), rtol=1e-2)


def test_keeping_the_input_with_dropout_and_a_traced_parameter():
  """The dropout's mask drawn again from the key and a traced activation parameter's gradient:
  equal to the default, which keeps a and b."""
  args = operands(jnp.float64)
  key = jax.random.key(3)

  def f(residuals):
    def loss(slope, *a):
      act = lambda z: jax.nn.leaky_relu(z, slope)
      y = jaxact.gated_mlp(
        *a, activation=act, dropout_rate=0.3, dropout_rng=key, residuals=residuals
      )
      return jnp.sum(jnp.sin(y))

    return jax.grad(loss, argnums=tuple(range(8)))(jnp.float64(0.2), *args)

  assert_close(f("input"), f("projections"), jnp.float64, "dropout")


def test_the_pullback_keeps_the_input_and_the_weights_only():
  x, w_gate, w_up, w_down, b_gate, b_up, b_down = operands(jnp.float32)
  _, pull = jax.vjp(call(True, residuals="input"), x, w_gate, w_up, w_down, b_gate, b_up, b_down)
  big = [leaf for leaf in jax.tree.leaves(pull) if leaf.size >= x.size]
  assert len(big) == 1 and np.array_equal(big[0], x), [leaf.shape for leaf in big]
  assert not [leaf for leaf in jax.tree.leaves(pull) if leaf.shape == (*BATCH, F)]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_a_stack_compiles_to_its_blocks_projections_less(scan):
  """A 4-block residual stack ``x + gated_mlp(norm(x))`` under jit(grad): keeping the input
  compiles to at least two and a half blocks' a and b less temp than keeping them (the last
  block's are read at once either way; the backward's recomputed projections are not merged with
  the forward's, which would keep them alive)."""
  tokens, d, f, n = 256, 32, 96, 4

  def temp(residuals):
    def block(x, w):
      h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
      return x + jaxact.gated_mlp(h, *w, residuals=residuals)

    def loss(ws, x):
      if scan:
        x = jax.lax.scan(lambda c, w: (block(c, w), None), x, ws)[0]
      else:
        for i in range(n):
          x = block(x, [w[i] for w in ws])
      return jnp.sum(x**2)

    shape = jax.ShapeDtypeStruct
    ws = [shape((n, d, f), jnp.float32)] * 2 + [shape((n, f, d), jnp.float32)]
    compiled = jax.jit(jax.grad(loss)).lower(ws, shape((tokens, d), jnp.float32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  a_and_b = 2 * tokens * f * 4
  kept, recomputed = temp("projections"), temp("input")
  assert recomputed <= kept - 2.5 * a_and_b, (kept, recomputed)


def test_an_unknown_residuals_value_is_refused():
  args = operands(jnp.float32)
  with pytest.raises(ValueError, match=r"jaxact.gated_mlp: `residuals` 'x' is not known; choose"):
    call(True, residuals="x")(*args)
  with pytest.raises(ValueError, match=r"jaxact.gated_dense: `residuals` 'a' is not known"):
    call(False, residuals="a")(*args)


def test_the_flax_layers_take_the_option():
  """linen and nnx GatedMLP(residuals="input"): the default layers' gradients."""
  from flax import nnx

  import jaxact.linen as jlinen
  import jaxact.nnx as jnnx

  x = operands(jnp.float32)[0]
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  mine, plain = (jlinen.GatedMLP(F, residuals=r) for r in ("input", "projections"))
  params = plain.init(jax.random.key(0), x)
  grads = [jax.grad(lambda p, m=m: jnp.sum(jnp.sin(m.apply(p, x))))(params) for m in (mine, plain)]
  jax.tree.map(close, *grads)

  def nnx_grads(residuals):
    layer = jnnx.GatedMLP(D, F, rngs=nnx.Rngs(0), residuals=residuals)
    return nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)

  jax.tree.map(close, nnx_grads("input"), nnx_grads("projections"))
