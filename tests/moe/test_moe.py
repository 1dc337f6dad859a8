"""Tests of jaxact.moe_mlp.

The op is compared with JAX's autodiff of the dense per-expert loop
(:func:`jaxact._src.moe.reference.moe_reference`: every expert on every token, masked by the
routing): values, the auxiliary losses and the gradients of x, the router and every expert weight,
in float64 (where the two differ only by rounding), float32 and bfloat16 (computed in float32);
routing corners (top_k 1 and E, ties, experts given no token, the capacity drop); what the pullback
keeps and the compiled memory of a scanned stack against the plain ragged composition; the errors.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxact
from jaxact._src.moe.reference import moe_reference, ragged_composition, reference_activation

from cases import representatives

T, D, F, E = 12, 6, 10, 4
TOL = {
  jnp.float64: dict(atol=1e-12, rtol=1e-12),
  jnp.float32: dict(atol=1e-5, rtol=1e-5),
  jnp.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


def operands(dtype=jnp.float64, seed=0, lead=(T,)):
  ks = jax.random.split(jax.random.key(seed), 5)
  shapes = [(*lead, D), (D, E), (E, D, F), (E, D, F), (E, F, D)]
  scales = [1.0, 1.0, D**-0.5, D**-0.5, F**-0.5]
  return tuple(
    (s * jax.random.normal(k, shape, jnp.float64)).astype(dtype)
    for k, shape, s in zip(ks, shapes, scales, strict=True)
  )


def loss(f, ct, **kw):
  """A scalar of every output: y against a fixed cotangent, plus the two aux losses weighted."""

  def run(*args):
    y, aux = f(*args, **kw)
    y = y.astype(ct.dtype)
    return jnp.sum(y * ct) + 0.3 * aux["load_balancing_loss"] + 0.1 * aux["router_z_loss"]

  return run


def ours(*args, **kw):
  return jaxact.moe_mlp(*args, **kw)


def reference(activation="silu"):
  act = reference_activation(activation)
  return lambda *args, activation=None, **kw: moe_reference(*args, act=act, **kw)


def value_and_grads(f, args, ct, **kw):
  """``(y, aux, grads)``, jitted (one compile costs less than the loop's eager dispatches)."""

  def run(args, ct):
    y, aux = f(*args, **kw)
    return y, aux, jax.grad(loss(f, ct, **kw), argnums=range(len(args)))(*args)

  return jax.jit(run)(args, ct)


def assert_close(got, want, dtype, what):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.all(np.isfinite(g)), f"{what} [{i}]"
    np.testing.assert_allclose(g, w, err_msg=f"{what} [{i}]", **TOL[dtype])


CASES = {
  "top2": dict(top_k=2),
  "top1-switch": dict(top_k=1, normalize_top_k=False),
  "top_k=E": dict(top_k=E),
  "sigmoid-bias": dict(top_k=2, score="sigmoid", router_bias=np.array([0.0, 0.3, -0.2, 0.1])),
  "softmax-bias": dict(top_k=2, router_bias=np.array([0.0, 0.3, -0.2, 0.1])),
  "softmax-unnormalized": dict(top_k=3, normalize_top_k=False),
  "capacity": dict(top_k=2, capacity_factor=0.75),
  "gelu": dict(top_k=2, activation="gelu"),
}


# softmax-bias (a router bias, as sigmoid-bias has) and the rest under `pytest -m exhaustive`.
@pytest.mark.parametrize("case", representatives(list(CASES), {"top2", "sigmoid-bias", "capacity"}))
def test_float64_matches_autodiff_of_the_dense_loop(case):
  kw = CASES[case]
  args = operands()
  ct = jax.random.normal(jax.random.key(9), (T, D), jnp.float64)
  got = value_and_grads(functools.partial(ours, **kw), args, ct)
  want = value_and_grads(reference(kw.get("activation", "silu")), args, ct, **kw)
  assert_close(got, want, jnp.float64, case)


def test_leading_dimensions_are_tokens():
  args = operands(lead=(3, 4))
  ct = jax.random.normal(jax.random.key(9), (3, 4, D), jnp.float64)
  got = value_and_grads(ours, args, ct, top_k=2)
  assert got[0].shape == (3, 4, D)
  assert_close(got, value_and_grads(reference(), args, ct, top_k=2), jnp.float64, "(3, 4, D)")


def test_shared_experts_as_moe_plus_gated_mlp_match_the_dense_loop():
  """DeepSeek's shared expert, an always-on gated MLP added to the routed output, composed from
  the public ops (docs/moe.md): float64 values and gradients of every weight, the shared ones
  included, against the dense loop plus the plain gated formula."""
  args = operands()
  ks = jax.random.split(jax.random.key(5), 3)
  shared = tuple(
    jax.random.normal(k, s, jnp.float64) * s[0] ** -0.5
    for k, s in zip(ks, [(D, 2 * F), (D, 2 * F), (2 * F, D)], strict=True)
  )
  ct = jax.random.normal(jax.random.key(9), (T, D), jnp.float64)

  def block(moe, gated):
    def f(x, router, wg, wu, wd, sg, su, sd, **kw):
      y, aux = moe(x, router, wg, wu, wd, **kw)
      return y + gated(x, sg, su, sd), aux

    return f

  ours_ = block(ours, jaxact.gated_mlp)
  dense = block(reference(), lambda x, g, u, d: (jax.nn.silu(x @ g) * (x @ u)) @ d)
  got = value_and_grads(ours_, (*args, *shared), ct, top_k=2)
  want = value_and_grads(dense, (*args, *shared), ct, top_k=2)
  assert_close(got, want, jnp.float64, "shared experts")


# float32 under `pytest -m exhaustive`: bfloat16 runs the same path, and rounds.
@pytest.mark.parametrize(
  "dtype",
  representatives([jnp.float32, jnp.bfloat16], {"bfloat16"}, ids=["float32", "bfloat16"]),
)
def test_lower_precisions_match_the_dense_loop_in_float32(dtype):
  """bfloat16 routes and accumulates in float32, keeping a and b rounded; y and the gradients come
  back in the input dtype."""
  args = operands(dtype)
  ct = jax.random.normal(jax.random.key(3), (T, D), jnp.float32)
  y, aux, grads = value_and_grads(ours, args, ct, top_k=2)
  assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
  assert aux["load_balancing_loss"].dtype == jnp.float32
  up = tuple(a.astype(jnp.float32) for a in args)
  want = value_and_grads(reference(), up, ct, top_k=2)
  assert_close((y, aux, grads), want, dtype, str(dtype))


# ------------------------------------------------------------------------------- routing corners


def test_ties_pick_the_lower_expert_and_match_the_dense_loop():
  """A zero router scores every expert alike: each token goes to experts 0..k-1, weighted 1/k."""
  x, _, w_gate, w_up, w_down = operands()
  router = jnp.zeros((D, E), jnp.float64)
  args = (x, router, w_gate, w_up, w_down)
  y, aux = jaxact.moe_mlp(*args, top_k=2)
  h = [jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e]) @ w_down[e] for e in (0, 1)]
  np.testing.assert_allclose(y, (h[0] + h[1]) / 2, rtol=1e-12)
  # f = (1, 1, 0, 0), P = 1/4 each: E * sum f P = 2.
  np.testing.assert_allclose(aux["load_balancing_loss"], 2.0, rtol=1e-12)
  ct = jnp.ones((T, D), jnp.float64)
  got = value_and_grads(ours, args, ct, top_k=2)
  assert_close(got, value_and_grads(reference(), args, ct, top_k=2), jnp.float64, "ties")


def test_experts_given_no_token_get_zero_gradients():
  x, router, w_gate, w_up, w_down = operands()
  router = router.at[:, 3].set(0).at[:, 1].set(0)  # logits 0 for experts 1 and 3 ...
  x = jnp.abs(x)
  router = router.at[:, 0].set(2.0).at[:, 2].set(1.0)  # ... well below 0's and 2's
  args = (x, router, w_gate, w_up, w_down)
  ct = jnp.ones((T, D), jnp.float64)
  y, aux, grads = value_and_grads(ours, args, ct, top_k=2)
  for g in grads[2:]:
    np.testing.assert_array_equal(g[1], 0.0)
    np.testing.assert_array_equal(g[3], 0.0)
    assert np.abs(np.asarray(g[0])).max() > 0
  assert_close((y, aux, grads), value_and_grads(reference(), args, ct, top_k=2), jnp.float64, "")


def test_the_capacity_drops_the_later_tokens_of_a_full_expert():
  """Every token prefers expert 0 (top-1): with capacity ceil(0.5 * 12 / 4) = 2 only tokens 0 and
  1 are computed; the others give 0 and no gradient to the weights."""
  x, router, w_gate, w_up, w_down = operands()
  x = jnp.abs(x) + 0.1
  router = jnp.zeros((D, E), jnp.float64).at[:, 0].set(1.0)
  args = (x, router, w_gate, w_up, w_down)
  y, _ = jaxact.moe_mlp(*args, top_k=1, capacity_factor=0.5)
  full, _ = jaxact.moe_mlp(*args, top_k=1)
  np.testing.assert_allclose(y[:2], full[:2], rtol=1e-12)
  np.testing.assert_array_equal(y[2:], 0.0)
  assert np.abs(np.asarray(full[2:])).min() > 0 or np.abs(np.asarray(full[2:])).max() > 0
  grads = jax.grad(lambda *a: jnp.sum(jaxact.moe_mlp(*a, top_k=1, capacity_factor=0.5)[0]), 0)
  dx = grads(*args)
  np.testing.assert_array_equal(dx[2:], 0.0)


def test_aux_losses_follow_their_formulas():
  x, router, *ws = operands()
  for score in ("softmax", "sigmoid"):
    _, aux = jaxact.moe_mlp(x, router, *ws, top_k=2, score=score)
    z = np.asarray(x @ router)
    s = np.exp(z) / np.exp(z).sum(-1, keepdims=True) if score == "softmax" else 1 / (1 + np.exp(-z))
    top = np.argsort(-s, axis=-1, kind="stable")[:, :2]
    f = np.array([(top == e).sum() for e in range(E)]) / T
    p = (s / s.sum(-1, keepdims=True)).mean(0)
    np.testing.assert_allclose(aux["load_balancing_loss"], E * (f * p).sum(), rtol=1e-12)
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(aux["router_z_loss"], (lse**2).mean(), rtol=1e-12)


def deepseek_v3_balance_loss(x, router, top, mask):
  """DeepSeek-V3's sequence-wise L_Bal (its report's eq. 17-20), float64, of sequences x[b]:
  f_i = N_r / (K_r T) sum_t 1(s_it in TopK(s_t, K_r)), with `top` the raw scores' top-k;
  P_i = 1/T sum_t s'_it, s' the scores normalized per token; sum_i f_i P_i, the mean over the
  sequences with a token."""
  losses = []
  for b in range(x.shape[0]):
    rows = np.flatnonzero(mask[b])
    if rows.size == 0:
      continue
    s = jax.nn.sigmoid(x[b, rows] @ router)
    n_r, k_r = s.shape[-1], top.shape[-1]
    hits = (top[b, rows][..., None] == np.arange(n_r)).sum((0, 1))
    f = n_r / (k_r * rows.size) * hits
    p = jnp.mean(s / jnp.sum(s, -1, keepdims=True), 0)
    losses.append(jnp.sum(f * p))
  return sum(losses) / len(losses)


def test_deepseek_v3_balance_loss_is_the_papers_l_bal():
  """balance_loss="deepseek_v3": L_Bal per sequence (x's last leading dimension), counting the
  raw top-k where the experts are chosen with a bias and a group limit; value and router
  gradient. The default is top_k times it for one sequence and a plain choice."""
  x, router, *ws = operands(lead=(3, 4))
  mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]], bool)  # the last one all padding
  bias = jnp.array([0.5, 0.0, -0.4, 0.2])  # changes the choice
  kw = dict(top_k=2, score="sigmoid", router_bias=bias, expert_groups=2, top_k_groups=1)

  def ours(router):
    aux = jaxact.moe_mlp(x, router, *ws, **kw, balance_loss="deepseek_v3", token_mask=mask)[1]
    return aux["load_balancing_loss"]

  s = np.asarray(jax.nn.sigmoid(x @ router))
  top = np.argsort(-s, -1, kind="stable")[..., :2]
  want = deepseek_v3_balance_loss(x, router, top, mask)
  np.testing.assert_allclose(ours(router), want, rtol=1e-12)
  want_grad = jax.grad(deepseek_v3_balance_loss, 1)(x, router, top, mask)
  np.testing.assert_allclose(jax.grad(ours)(router), want_grad, rtol=1e-10, atol=1e-14)
  stats = jaxact.moe_mlp(x, router, *ws, **kw, token_mask=mask, return_stats=True)[1]
  raw_counts = (top[mask][..., None] == np.arange(E)).sum((0, 1))
  assert not np.array_equal(stats["expert_counts"], raw_counts)  # the choice is not the raw top-k

  _, aux = jaxact.moe_mlp(x[0], router, *ws, top_k=2, score="sigmoid")
  want = deepseek_v3_balance_loss(x[:1], router, top[:1], np.ones((1, 4), bool))
  np.testing.assert_allclose(aux["load_balancing_loss"], 2 * want, rtol=1e-12)


def test_sigmoid_scores_that_underflow_weigh_as_their_ratio_without_nan():
  """Logits of -6000 and less: every sigmoid score is 0 in float32, their ratio is not (the
  normalized weights are a softmax of the log-scores): expert 0 weighs 1, expert 1 exp(-600)."""
  x, router, *ws = (a.astype(jnp.float32) for a in operands())
  router = jnp.full((D, E), -1e3, jnp.float32) * (1 + jnp.arange(E, dtype=jnp.float32) / 10)
  x = jnp.abs(x) + 1.0
  y, pull = jax.vjp(lambda *a: jaxact.moe_mlp(*a, top_k=2, score="sigmoid")[0], x, router, *ws)
  grads = pull(jnp.ones_like(y))
  w_gate, w_up, w_down = ws
  want = (jax.nn.silu(x @ w_gate[0]) * (x @ w_up[0])) @ w_down[0]
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_an_expert_whose_activation_overflows_gives_the_finite_product(implementation):
  """selu(a) = inf for a = 3.3e38 where selu(a) * b (b = 1e-3, and 0) and its gradients are
  finite: h was inf (and its weight gradient), dx NaN. One expert, so the token's weight is 1;
  against the formula in float64."""
  x = np.zeros((4, 2), np.float32)
  x[:, 1], x[0] = 0.5, (1.0, 0.0)  # token 0 reads the experts' first input row alone
  w_gate = np.array([[[3.3e38, 3.3e38], [0.3, -0.2]]], np.float32)  # a[0] = 3.3e38
  w_up = np.array([[[1e-3, 0.0], [0.4, 0.1]]], np.float32)  # b[0] = (1e-3, 0)
  w_down = np.array([[[0.01, -0.02], [0.03, 0.01]]], np.float32)
  args = [jnp.asarray(v) for v in (x, np.ones((2, 1), np.float32), w_gate, w_up, w_down)]
  gy = np.full((4, 2), 0.5, np.float32)

  def y_of(x, router, w_gate, w_up, w_down):
    return jaxact.moe_mlp(
      x, router, w_gate, w_up, w_down, top_k=1, activation="selu", implementation=implementation
    )[0]

  y, pull = jax.vjp(y_of, *args)
  got = [y, *pull(jnp.asarray(gy))]
  x, _, wg, wu, wd = (
    np.asarray(a, np.float64)[0] if a.ndim == 3 else np.asarray(a, np.float64) for a in args
  )
  a, b = x @ wg, x @ wu
  scale, alpha = 1.0507009873554805, 1.6732632423543772
  act = scale * np.where(a > 0, a, alpha * np.expm1(np.minimum(a, 0)))
  slope = scale * np.where(a > 0, 1.0, alpha * np.exp(np.minimum(a, 0)))
  gh = gy @ wd.T

  def products(h, da, db, x, wg, wu, wd, gy):
    return [h @ wd, da @ wg.T + db @ wu.T, (x.T @ da)[None], (x.T @ db)[None], (h.T @ gy)[None]]

  operands = (act * b, gh * slope * b, gh * act, x, wg, wu, wd, gy)
  want = products(*operands)
  sizes = products(*map(np.abs, operands))  # what each sum's rounding is relative to
  assert not np.asarray(got.pop(2)).any()  # the router's: its one expert weighs 1
  for i, (g, w, size) in enumerate(zip(got, want, sizes, strict=True)):
    g = np.asarray(g, np.float64)
    assert np.isfinite(g).all(), i
    assert (np.abs(g - w) <= 1e-5 * size + 1e-30).all(), (i, g, w)


# ------------------------------------------------------------------------------ what is kept


def test_the_pullback_keeps_x_a_b_and_the_small_routing():
  x, router, w_gate, w_up, w_down = operands(jnp.float32)
  k = 2
  _, pull = jax.vjp(lambda *a: jaxact.moe_mlp(*a, top_k=k)[0], x, router, w_gate, w_up, w_down)
  leaves = jax.tree.leaves(pull)
  hidden = sorted(leaf.shape for leaf in leaves if leaf.ndim == 2 and leaf.shape[1] == F)
  assert hidden == [(T * k, F), (T * k, F)], hidden  # a and b: no h, no act(a)
  token_rows = [leaf for leaf in leaves if leaf.shape[:1] in ((T,), (T * k,))]
  # x itself; the rest: a, b, the (T, k) weights, the (T, E) scores and logits (routing's
  # autodiff), and the (T*k,) integer permutations
  assert [leaf for leaf in token_rows if leaf.shape == x.shape and np.array_equal(leaf, x)]
  big = {leaf.shape for leaf in token_rows if leaf.size > T * E}
  assert big <= {x.shape, (T * k, F)}, big
  no_sorted_x = [leaf for leaf in leaves if leaf.shape == (T * k, D)]
  assert no_sorted_x == []


def _plain_ragged_block(k):
  """The same routing, ragged_dot and activation, differentiated by JAX."""
  return functools.partial(ragged_composition, top_k=k)


# Under `pytest -m exhaustive`: one layer's compiled temp against the same composition is
# test_one_layers_backward_holds_one_grouped_product_at_a_time, what a layer keeps
# test_the_pullback_keeps_x_a_b_and_the_small_routing (both default).
@pytest.mark.exhaustive
def test_a_scanned_stack_needs_less_memory_than_the_plain_ragged_composition():
  """jit(grad) of 8 residual MoE blocks under lax.scan (128 tokens, D 32, hidden 64, 4 experts,
  top-2, float32): compiled temp below 0.75x the plain composition's (measured 3.15 MiB against
  4.97 MiB). On CPU ragged_dot is a dense masked product whose (experts x rows) operands are a
  fixed cost of both; the per-layer residuals are ~0.3x."""
  t, d, f, e, k, layers = 128, 32, 64, 4, 2, 8
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (t, d), jnp.float32)
  shapes = [(layers, d, e), (layers, e, d, f), (layers, e, d, f), (layers, e, f, d)]
  ws = tuple(
    0.1 * jax.random.normal(kk, s, jnp.float32) for kk, s in zip(ks[1:], shapes, strict=True)
  )

  def stack(block):
    def run(ws, x):
      def body(c, w):
        return c + block(c, *w), None

      return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    return run

  def mine(*a):
    return jaxact.moe_mlp(*a, top_k=k)[0]

  plain = _plain_ragged_block(k)
  temp = {}
  for name, block in (("jaxact", mine), ("plain", plain)):
    compiled = jax.jit(jax.grad(stack(block), argnums=(0, 1))).lower(ws, x).compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes
  assert temp["jaxact"] < 0.75 * temp["plain"], temp
  got = jax.jit(jax.grad(stack(mine), argnums=(0, 1)))(ws, x)
  want = jax.grad(stack(plain), argnums=(0, 1))(ws, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4 * float(np.abs(w).max()))


def test_one_layers_backward_holds_one_grouped_product_at_a_time():
  """jit(grad) of one MoE layer (512 tokens, D 64, hidden 128, 8 experts, top-2, float32): XLA's
  ragged_dot is a dense product over a masked (experts x rows) operand, and the backward's six
  grouped products, chained, hold one such operand at a time: compiled temp below 0.9x the plain
  composition's (measured 11.8 against 14.3 MiB; 20.0 when XLA was free to overlap them)."""
  t, d, f, e, k = 512, 64, 128, 8, 2
  s = jax.ShapeDtypeStruct
  f32 = jnp.float32
  ws = (s((d, e), f32), s((e, d, f), f32), s((e, d, f), f32), s((e, f, d), f32))

  def temp(block):
    loss = lambda ws, x: jnp.sum(block(x, *ws) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(ws, s((t, d), f32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  mine, plain = temp(lambda *a: jaxact.moe_mlp(*a, top_k=k)[0]), temp(_plain_ragged_block(k))
  assert mine < 0.9 * plain, (mine, plain)


# -------------------------------------------------------------------------------------- errors


def _call(**over):
  x, router, w_gate, w_up, w_down = operands(jnp.float32)
  kw = dict(x=x, router=router, w_gate=w_gate, w_up=w_up, w_down=w_down, top_k=2) | over
  return jaxact.moe_mlp(**kw)


@pytest.mark.parametrize(
  "over, exc, match",
  [
    (dict(top_k=E + 1), ValueError, r"`top_k` is 5; accepted: 1 to the number of experts \(4\)"),
    (dict(top_k=0), ValueError, r"`top_k` is 0"),
    (dict(top_k=2.0), TypeError, r"`top_k` must be an int; got float"),
    (dict(router=jnp.ones((D + 1, E))), ValueError, r"`x` has 6 features but `router` expects 7"),
    (dict(router=jnp.ones((D,))), ValueError, r"`router` must have rank 2"),
    (dict(w_gate=jnp.ones((E, D, F, 1))), ValueError, r"`w_gate` must have rank 3"),
    (dict(w_gate=jnp.ones((E + 1, D, F))), ValueError, r"`w_gate` must have shape \(4, 6, hidden"),
    (dict(w_up=jnp.ones((E, D, F + 1))), ValueError, r"`w_up` must have the shape of `w_gate`"),
    (dict(w_down=jnp.ones((E, F + 1, D))), ValueError, r"`w_down` must have shape \(4, 10, out"),
    (dict(router_bias=jnp.ones((E + 1,))), ValueError, r"`router_bias` has shape \(5,\)"),
    (dict(x=jnp.ones((T, D), jnp.int32)), TypeError, r"`x` has dtype int32; accepted"),
    (dict(w_down=jnp.ones((E, F, D), jnp.complex64)), TypeError, r"`w_down`"),
    (dict(score="relu"), ValueError, r"`score` 'relu' is not known"),
    (dict(capacity_factor=0.0), ValueError, r"`capacity_factor` is 0.0; accepted: None"),
    (dict(activation="relux"), ValueError, r"'relux' is not known"),
    (dict(capacity_per_sequence=1), TypeError, r"`capacity_per_sequence` must be a bool"),
    (dict(balance_loss="deepseek"), ValueError, r"`balance_loss` 'deepseek' is not known"),
    (dict(expert_groups=3), ValueError, r"`expert_groups` is 3; accepted: an int dividing"),
    (dict(expert_groups=2.0), TypeError, r"`expert_groups` must be an int; got float"),
    (dict(expert_groups=2, top_k_groups=3), ValueError, r"`top_k_groups` is 3; accepted: None"),
    (dict(expert_groups=4, top_k_groups=2), ValueError, r"groups of 1 expert; a group is scored"),
    (
      dict(top_k=3, expert_groups=2, top_k_groups=1),
      ValueError,
      r"`top_k` is 3 but `top_k_groups`=1 groups of 2 experts hold only 2",
    ),
  ],
  ids=lambda v: None if isinstance(v, dict) else "",
)
def test_bad_input_raises_naming_the_argument(over, exc, match):
  with pytest.raises(exc, match=match):
    _call(**over)


def per_sequence_capacity_reference(x, router, w_gate, w_up, w_down, top_k, factor, mask):
  """float64 numpy: softmax top-k routing, normalized; each sequence x[b] its own capacity
  ceil(factor * S * k / E), each expert taking the sequence's (unmasked) tokens in order until it
  is full."""
  x, router, w_gate, w_up, w_down = (np.asarray(a) for a in (x, router, w_gate, w_up, w_down))
  b, s, _ = x.shape
  e = router.shape[1]
  capacity = math.ceil(factor * s * top_k / e)
  y = np.zeros((b, s, w_down.shape[2]))
  for i in range(b):
    taken = np.zeros(e, int)
    for t in np.flatnonzero(mask[i]):
      z = x[i, t] @ router
      p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
      top = np.argsort(-p, kind="stable")[:top_k]
      for ex, w in zip(top, p[top] / p[top].sum(), strict=True):
        taken[ex] += 1
        if taken[ex] <= capacity:
          g = x[i, t] @ w_gate[ex]
          y[i, t] += w * ((g / (1 + np.exp(-g)) * (x[i, t] @ w_up[ex])) @ w_down[ex])
  return y


def test_capacity_per_sequence_queues_each_sequence_alone():
  """Three sequences of 4 tokens, factor 0.5: 1 token an expert a sequence (3 over the batch);
  values with and without padding against the loop, gradients against the dense per-expert loop
  of each sequence."""
  x, router, *ws = operands(lead=(3, 4))
  kw = dict(top_k=2, capacity_factor=0.5)
  for mask in (np.ones((3, 4), bool), np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 0, 1]], bool)):
    y, _ = jaxact.moe_mlp(x, router, *ws, **kw, capacity_per_sequence=True, token_mask=mask)
    want = per_sequence_capacity_reference(x, router, *ws, 2, 0.5, mask)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
  y_batch, _ = jaxact.moe_mlp(x, router, *ws, **kw)
  assert not np.allclose(y_batch, want)  # the batch's queue drops other tokens

  ct = jax.random.normal(jax.random.key(7), x.shape, jnp.float64)

  def per_sequence(*args):
    ys = [moe_reference(args[0][b], *args[1:], **kw)[0] for b in range(3)]
    return jnp.sum(jnp.stack(ys) * ct)

  def op(*args):
    return jnp.sum(jaxact.moe_mlp(*args, **kw, capacity_per_sequence=True)[0] * ct)

  got = jax.grad(op, argnums=range(5))(x, router, *ws)
  want = jax.grad(per_sequence, argnums=range(5))(x, router, *ws)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_capacity_is_ceil_of_the_factor_times_the_even_share():
  # 12 tokens * top-2 / 4 experts = 6 a expert; factor 0.5: 3 each. All to experts 0 and 1.
  x, _, *ws = operands()
  router = jnp.zeros((D, E), jnp.float64).at[:, :2].set(1.0)
  y, _ = jaxact.moe_mlp(jnp.abs(x) + 0.1, router, *ws, top_k=2, capacity_factor=0.5)
  computed = np.abs(np.asarray(y)).sum(-1) > 0
  assert computed.sum() == math.ceil(0.5 * T * 2 / E)  # tokens 0..2: both experts; the rest none


def test_named_residuals_let_a_remat_block_keep_only_a_and_b():
  """Under ``jax.checkpoint(policy=save_only_these_names(*MOE_CHECKPOINT_NAMES))`` a block
  ``x + moe_mlp(norm(x))`` keeps a and b (and its input), not the normed input; same gradients."""
  x, router, w_gate, w_up, w_down = operands(jnp.float32)

  def block(x, *ws):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jaxact.moe_mlp(h, *ws, top_k=2)[0]

  policy = jax.checkpoint_policies.save_only_these_names(*jaxact.MOE_CHECKPOINT_NAMES)
  args = (x, router, w_gate, w_up, w_down)
  _, pull = jax.vjp(jax.checkpoint(block, policy=policy), *args)
  kept = sorted(leaf.shape for leaf in jax.tree.leaves(pull) if leaf.size >= x.size)
  weights = [w_gate.shape, w_up.shape, w_down.shape]
  assert kept == sorted([x.shape, (T * 2, F), (T * 2, F), *weights]), kept
  _, plain = jax.vjp(block, *args)
  ct = jnp.ones_like(x)
  for g, w in zip(pull(ct), plain(ct), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
