"""jaxact.moe_mlp on the inputs a program hands it besides one batch of unit-sized tokens: tokens
of huge, tiny and zero values in every dtype (``tests/input_cases.py``), no tokens at all, and
``jax.vmap`` over a batch axis (each mapped element its own call: its own routing, capacity and
auxiliary losses, as a Python loop over the axis gives them).

Against the op's formula written here in float64 (every expert on every token, masked by the
routing) and JAX's autodiff of it, looped over the mapped axis: values, auxiliary losses, the
gradients of every operand under ``vmap(grad)`` (each element's own) and ``grad(vmap)`` (summed
where the operand is shared); nested maps, traced activation parameters, the Triton kernels in
interpret mode, a scanned remat stack of vmapped blocks.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxact
from input_cases import DTYPE_IDS, DTYPES, assert_like_formula, rows
from jaxact._src.moe.rules import FAMILY

from cases import backends

B, T, D, F, E = 3, 6, 5, 7, 4


def operands(dtype=jnp.float64, lead=(B, T), seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  shapes = [(*lead, D), (D, E), (E, D, F), (E, D, F), (E, F, D)]
  scales = [1.0, 1.0, D**-0.5, D**-0.5, F**-0.5]
  return [
    (s * jax.random.normal(k, shape, jnp.float64)).astype(dtype)
    for k, shape, s in zip(ks, shapes, scales, strict=True)
  ]


def formula(
  x, router, w_gate, w_up, w_down, *, top_k, score="softmax", capacity_factor=None, act=jax.nn.silu
):
  """``(y, aux)`` of one call on (T, D) tokens, as docs/moe.md defines them: the experts chosen
  in the order of the scores (by the log-scores, which do not tie where the scores underflow), the
  normalized weights a softmax of the chosen log-scores."""
  t, e = x.shape[0], router.shape[1]
  z = x @ router
  log_s = z if score == "softmax" else jax.nn.log_sigmoid(z)
  _, idx = lax.top_k(lax.stop_gradient(log_s), top_k)
  w = jax.nn.softmax(jnp.take_along_axis(log_s, idx, -1), -1)
  chosen = jax.nn.one_hot(idx, e, dtype=x.dtype)  # (T, k, E)
  gates = jnp.einsum("tk,tke->te", w, chosen)
  routed = jnp.sum(chosen, 1)
  if capacity_factor is not None:  # the later tokens beyond an expert's capacity skip it
    capacity = math.ceil(capacity_factor * t * top_k / e)
    gates = jnp.where(jnp.cumsum(routed, 0) <= capacity, gates, 0)
  h = act(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
  y = jnp.einsum("te,tef,efo->to", gates, h, w_down)
  p = jax.nn.softmax(log_s, -1)  # for sigmoid scores, the scores normalized per token
  balance = e * jnp.sum(jnp.mean(routed, 0) * jnp.mean(p, 0))
  z_loss = jnp.mean(jax.nn.logsumexp(z, -1) ** 2)
  return y, {"load_balancing_loss": balance, "router_z_loss": z_loss}


def scalar(f, **kw):
  """A scalar of every output of one call, for its gradients."""

  def run(*args):
    y, aux = f(*args, **kw)
    return jnp.sum(jnp.sin(y)) + 0.3 * aux["load_balancing_loss"] + 0.1 * aux["router_z_loss"]

  return run


def ours(*args, **kw):
  return jaxact.moe_mlp(*args, **kw)


def looped(f, in_axes, args):
  """``f`` called on each element of the mapped axis, stacked: what ``jax.vmap`` promises (one
  jitted program of the calls)."""
  size = next(a.shape[0] for a, ax in zip(args, in_axes, strict=True) if ax == 0)

  def run(*args):
    outs = [
      f(*(a[i] if ax == 0 else a for a, ax in zip(args, in_axes, strict=True))) for i in range(size)
    ]
    return jax.tree.map(lambda *v: jnp.stack(v), *outs)

  return jax.jit(run)(*args)


def mapped_operands(in_axes, dtype=jnp.float64):
  """The operands, each mapped one given a batch of distinct values (x: (B, T, D))."""
  args = operands(dtype)
  single = operands(dtype, lead=(T,))
  out = []
  for i, ax in enumerate(in_axes):
    if ax is None:
      out.append(single[i] if i == 0 else args[i])
    elif i == 0:
      out.append(args[0])
    else:
      out.append(jnp.stack([args[i] * (1 + 0.25 * j) for j in range(B)]))
  return out


def assert_close(got, want, atol, what):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    assert g.shape == w.shape, (what, i, g.shape, w.shape)
    np.testing.assert_allclose(
      np.asarray(g, np.float64),
      np.asarray(w, np.float64),
      atol=atol,
      rtol=atol,
      err_msg=f"{what} [{i}]",
    )


# -------------------------------------------------------------------------- huge and tiny tokens

ROUTINGS = {
  "softmax_top2": dict(top_k=2),
  "sigmoid_top2": dict(top_k=2, score="sigmoid"),
  "capacity_top1": dict(top_k=1, capacity_factor=1.0),
}
EXTREME = list(itertools.product(ROUTINGS, DTYPES))
EXTREME_IDS = [f"{r}-{DTYPE_IDS[DTYPES.index(dt)]}" for r, dt in EXTREME]


@pytest.mark.sample(1, "pallas-sigmoid_top2-float16")
@pytest.mark.parametrize("routing,dtype", EXTREME, ids=EXTREME_IDS)
@pytest.mark.parametrize("implementation", backends(FAMILY))
def test_huge_tiny_and_zero_tokens(implementation, routing, dtype):
  """y, both auxiliary losses and every gradient."""
  kw = ROUTINGS[routing]
  x = rows(jax.random.key(3), (12, D), dtype, squared=True)
  args = [x, *operands(lead=(T,))[1:]]

  def ours_all(*a):
    y, aux = ours(*a, implementation=implementation, **kw)
    return y, aux["load_balancing_loss"], aux["router_z_loss"]

  def formula_all(*a):
    y, aux = formula(*a, **kw)
    return y, aux["load_balancing_loss"], aux["router_z_loss"]

  assert_like_formula(ours_all, formula_all, args, dtype)


# ------------------------------------------------------------------------------------ no tokens


@pytest.mark.parametrize("implementation", [None, "pallas"])
@pytest.mark.parametrize("lead", [(0,), (3, 0)], ids=["0", "3x0"])
def test_no_tokens_give_an_empty_output_zero_losses_and_zero_gradients(lead, implementation):
  """Zero tokens raised ZeroDivisionError (`integer modulo by zero`) from inside JAX."""
  args = operands(jnp.float32, lead=lead)
  kw = dict(top_k=2, implementation=implementation, capacity_factor=1.0)
  y, aux = jax.jit(functools.partial(ours, **kw))(*args)
  assert y.shape == (*lead, D) and y.dtype == jnp.float32
  assert aux == {"load_balancing_loss": 0.0, "router_z_loss": 0.0}
  grads = jax.grad(scalar(ours, **kw), argnums=range(5))(*args)
  for g, a in zip(grads, args, strict=True):
    assert g.shape == a.shape and not np.asarray(g).any()


def test_vmap_over_an_empty_axis_gives_empty_outputs():
  """A mapped axis of size 0 (vmap runs the rule with no element), value and gradients."""
  x, *ws = operands(lead=(0, T))
  y, aux = jax.vmap(functools.partial(ours, top_k=2), (0, None, None, None, None))(x, *ws)
  assert y.shape == (0, T, D) and aux["router_z_loss"].shape == (0,)

  def mapped_sum(x, *ws):
    return jnp.sum(jax.vmap(scalar(ours, top_k=2), (0, None, None, None, None))(x, *ws))

  grads = jax.grad(mapped_sum, argnums=range(5))(x, *ws)
  assert grads[0].shape == x.shape and not any(np.asarray(g).any() for g in grads[1:])


# --------------------------------------------------------------------------------------- vmap

KWS = {
  "softmax_top2": dict(top_k=2),
  "capacity_top1": dict(top_k=1, capacity_factor=0.5),  # each element's own capacity: 1 token
  "sigmoid_top3": dict(top_k=3, score="sigmoid"),
}
AXES = {
  "x": (0, None, None, None, None),
  "x_and_w_gate": (0, None, 0, None, None),
  "experts": (None, None, 0, 0, 0),
  "all": (0, 0, 0, 0, 0),
}
# The default suite: each element's own capacity, with a mapped expert weight beside x.
DEFAULT = {("capacity_top1", "x_and_w_gate")}
VMAP_CASES = [
  pytest.param(k, a, marks=[] if (k, a) in DEFAULT else [pytest.mark.exhaustive])
  for k, a in itertools.product(KWS, AXES)
]


@pytest.mark.parametrize("kw_name,axes_name", VMAP_CASES)
def test_vmap_is_a_loop_of_independent_calls(kw_name, axes_name):
  """``jax.vmap(moe_mlp)`` raised ragged_dot's NotImplementedError; now each element is its own
  call (its routing, capacity and losses): value, ``vmap(grad)`` and ``grad(vmap)``."""
  kw, in_axes = KWS[kw_name], AXES[axes_name]
  args = mapped_operands(in_axes)
  grad_ours = jax.grad(scalar(ours, **kw), argnums=range(5))

  def mapped_sum(*args):
    return jnp.sum(jax.vmap(scalar(ours, **kw), in_axes)(*args))

  def run(*args):
    value = jax.vmap(functools.partial(ours, **kw), in_axes)(*args)
    summed = jax.grad(mapped_sum, argnums=range(5))(*args)
    return value, jax.vmap(grad_ours, in_axes)(*args), summed

  value, grads, summed = jax.jit(run)(*args)
  grad_formula = jax.grad(scalar(formula, **kw), argnums=range(5))
  want, want_grads = looped(lambda *a: (formula(*a, **kw), grad_formula(*a)), in_axes, args)
  assert_close(value, want, 1e-12, "value")
  assert_close(grads, want_grads, 1e-12, "vmap(grad)")
  want_summed = [g if ax == 0 else jnp.sum(g, 0) for g, ax in zip(want_grads, in_axes, strict=True)]
  assert_close(summed, want_summed, 1e-12, "grad(vmap)")


@pytest.mark.exhaustive  # by default test_vmap_is_a_loop_of_independent_calls maps each argument
def test_nested_vmap_and_the_cotangents_mapped_alone():
  """vmap of vmap (the outer over x, the inner over x and the experts' weights, or x alone), and a
  jacobian's rows (``vmap`` of the pullback: only the cotangent mapped)."""
  x = operands(lead=(2, B, T))[0]
  _, router, w_gate, w_up, w_down = operands()
  w_gates = jnp.stack([w_gate * (1 + 0.5 * j) for j in range(B)])
  cts = jax.random.normal(jax.random.key(1), (4, T, D), jnp.float64)

  def grads(f):
    return lambda x, w_gate: jax.grad(scalar(f, top_k=2), (0, 1))(x, router, w_gate, w_up, w_down)

  def pullback(f):
    return jax.vjp(lambda x, g: f(x, router, g, w_up, w_down, top_k=2)[0], x[0, 0], w_gate)[1]

  def run(x, w_gates, cts):
    nested = jax.vmap(jax.vmap(grads(ours), (0, 0)), (0, None))(x, w_gates)
    shared = jax.vmap(jax.vmap(grads(ours), (0, None)), (0, None))(x, w_gate)
    return nested, shared, jax.vmap(pullback(ours))(cts)

  nested, shared, rows = jax.jit(run)(x, w_gates, cts)
  want = looped(lambda x: looped(grads(formula), (0, 0), (x, w_gates)), (0,), (x,))
  assert_close(nested, want, 1e-12, "vmap(vmap(grad))")
  want = looped(lambda x: looped(grads(formula), (0, None), (x, w_gate)), (0,), (x,))
  assert_close(shared, want, 1e-12, "vmap(vmap(grad)), shared experts")
  assert_close(rows, looped(pullback(formula), (0,), (cts,)), 1e-12, "vmap(vjp)")


def test_vmap_over_a_traced_activation_parameter():
  """A traced leaky_relu slope, mapped with x (the elements run one after another) and shared."""
  args = operands()
  slopes = jnp.array([0.1, 0.5, 2.0], jnp.float64)

  def f(fn, x, slope):
    act = functools.partial(jaxact.leaky_relu, negative_slope=slope)
    kw = dict(activation=act) if fn is ours else dict(act=act)
    return scalar(fn, top_k=2, **kw)(x, *args[1:])

  def run(x, slopes):
    g = jax.grad(functools.partial(f, ours), (0, 1))
    return jax.vmap(g, (0, 0))(x, slopes), jax.vmap(g, (0, None))(x, slopes[1])

  mapped, shared = jax.jit(run)(args[0], slopes)
  g = jax.grad(functools.partial(f, formula), (0, 1))
  assert_close(mapped, looped(g, (0, 0), (args[0], slopes)), 1e-12, "mapped")
  assert_close(shared, looped(g, (0, None), (args[0], slopes[1])), 1e-12, "shared")


@pytest.mark.exhaustive
def test_vmap_with_the_triton_kernels_in_float32():
  in_axes = AXES["x_and_w_gate"]
  args = mapped_operands(in_axes, jnp.float32)
  kw = dict(top_k=2, implementation="pallas")
  got = jax.jit(jax.vmap(jax.grad(scalar(ours, **kw), argnums=range(5)), in_axes))(*args)
  args64 = [a.astype(jnp.float64) for a in args]
  want = looped(jax.grad(scalar(formula, top_k=2), argnums=range(5)), in_axes, args64)
  assert_close(got, want, 2e-5, "pallas vmap(grad)")


@pytest.mark.exhaustive
def test_vmapped_blocks_in_a_scanned_remat_stack():
  """``x + vmap(moe)(x)`` blocks under ``lax.scan`` and ``jax.checkpoint`` keeping a and b."""
  x, router, w_gate, w_up, w_down = operands()
  policy = jax.checkpoint_policies.save_only_these_names(*jaxact.MOE_CHECKPOINT_NAMES)
  stacked = [jnp.stack([w, 0.5 * w]) for w in (w_gate, w_up, w_down)]

  def stack(f, remat):
    def block(c, ws):
      y = jax.vmap(lambda c: f(c, router, *ws, top_k=2)[0])(c)
      return c + y, None

    block = jax.checkpoint(block, policy=policy) if remat else block
    return lambda x, ws: jnp.sum(jnp.sin(lax.scan(block, x, ws)[0]))

  want = jax.grad(stack(formula, False), (0, 1))(x, stacked)
  got = jax.jit(jax.grad(stack(ours, True), (0, 1)))(x, stacked)
  assert_close(got, want, 1e-12, "scan")
