"""What the Flax layer tests share: the activations given to the layers and their jax.nn
references, per-dtype tolerances, random parameters, a spy on the fused ops, and the digits task.

A layer test compares a jaxact layer with Flax's own layer followed by the jax.nn activation, from
the same parameters, for outputs and for the gradients of a random cotangent with respect to the
parameters and the input (Flax's own way of proving nnx against linen,
``tests/nnx/nn/linear_test.py::TestLinenConsistency``).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

import jaxact
from jaxact._src.fused import api as fused

# (what the layer is given, the jax.nn function it must equal). Every way `activation` can be
# given: a name with an output residual, a name with an input residual, a jaxact function, a
# functools.partial of one, and two callables jaxact differentiates by autodiff.
ACTIVATIONS = {
  "identity": ("identity", lambda z: z),
  "relu": ("relu", jax.nn.relu),
  "gelu": ("gelu", jax.nn.gelu),
  "jaxact.tanh": (jaxact.tanh, jax.nn.tanh),
  "partial(leaky_relu)": (
    functools.partial(jaxact.leaky_relu, negative_slope=0.2),
    functools.partial(jax.nn.leaky_relu, negative_slope=0.2),
  ),
  "jax.nn.silu": (jax.nn.silu, jax.nn.silu),
  "lambda": (lambda z: z * jnp.tanh(z), lambda z: z * jnp.tanh(z)),
}
ACTIVATION_IDS = tuple(ACTIVATIONS)

# Relative to max(1, max |reference|). float32: the same ops, summed in another order. Half
# precision: jaxact accumulates, adds the bias and applies the activation in float32 and rounds
# once, where Flax + jax.nn round after the matmul, after the bias and inside the activation.
TOL = {
  np.dtype(jnp.float64): 1e-12,
  np.dtype(jnp.float32): 2e-5,
  np.dtype(jnp.bfloat16): 4e-2,
}


def assert_close(got, want, what: str = "", tol_dtype=None) -> None:
  """Same dtype and shape; values within the tolerance of `tol_dtype` (default: their dtype)."""
  got, want = jnp.asarray(got), jnp.asarray(want)
  assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.max(np.abs(w), initial=0.0)))
  err = float(np.max(np.abs(g - w), initial=0.0))
  tol = max(TOL[np.dtype(d)] for d in (got.dtype, tol_dtype) if d is not None) * scale
  assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g} (dtype {got.dtype})"


def assert_trees_close(got, want, what: str = "", tol_dtype=None) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    assert_close(g, w, f"{what}{jax.tree_util.keystr(path)}", tol_dtype)


def assert_trees_identical(got, want) -> None:
  """Same structure (box types and metadata included), shapes, dtypes and values."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_trees_all_equal(got, want)


def random_like(tree, seed: int = 7):
  """Random values of each leaf's shape and dtype (arrays or ShapeDtypeStructs), from NumPy.

  Random rather than initialised parameters: the zero bias init would hide the bias. NumPy rather
  than jax.random: nothing to compile.
  """
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda v: jnp.asarray((0.5 * rng.standard_normal(v.shape)).astype(np.float32), v.dtype), tree
  )


def normal(shape, dtype=jnp.float32, seed: int = 1) -> jax.Array:
  """Standard normal values of that shape and dtype (NumPy's generator: nothing to compile)."""
  values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return jnp.asarray(values, dtype)


def count_fused_calls(monkeypatch) -> dict[str, int]:
  """Counts the calls of jaxact's fused ops made by the layers: {"dense": n, "conv": n}."""
  calls = {"dense": 0, "conv": 0}

  def spy(kind, op):
    def wrapped(*args, **kwargs):
      calls[kind] += 1
      return op(*args, **kwargs)

    return wrapped

  monkeypatch.setattr(fused, "dense_bias_act", spy("dense", fused.dense_bias_act))
  monkeypatch.setattr(fused, "conv_bias_act", spy("conv", fused.conv_bias_act))
  return calls


def vjp_all(fn, params, x, seed: int = 3):
  """fn(params, x) and the gradients, in params and in x, of <fn(params, x), g> for a random g."""
  y, pullback = jax.vjp(fn, params, x)
  g = normal(y.shape, y.dtype, seed)
  return y, pullback(g)


@functools.cache
def digits(seed: int = 0):
  """scikit-learn's bundled 8x8 digits (no download): train/test images in [0, 1] and labels."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  data = load_digits()
  images = (data.images / 16.0).astype(np.float32)[..., None]  # (N, 8, 8, 1)
  x_tr, x_te, y_tr, y_te = train_test_split(
    images, data.target.astype(np.int32), test_size=0.25, random_state=seed, stratify=data.target
  )
  return jnp.asarray(x_tr), jnp.asarray(y_tr), jnp.asarray(x_te), jnp.asarray(y_te)
