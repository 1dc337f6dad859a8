"""The activations' plain formulas, for the tests: float64 references written from the math and
independent of jaxact's implementation, and :func:`jax_nn` (jax.nn's function of a name).

Tests compare jaxact against these, and against ``jax.grad`` / ``jax.hessian`` of these, so every
formula here is plain ``jax.numpy`` on float64 inputs. They are meant for moderate inputs
(|x| <= ~40); they make no attempt to be safe at the extremes (that is what is under test).

Where the textbook form loses most of its digits in float64 for the inputs the tests use, an exact
algebraic identity is used instead and named in a comment; nothing is clamped or special-cased.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import erfc

from jaxact._src.activations.api import get_spec

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _f64(x):
  x = jnp.asarray(x)
  assert x.dtype == jnp.float64, f"references take float64 inputs, got {x.dtype}"
  return x


def identity(x):
  return _f64(x)


def sigmoid(x):
  x = _f64(x)
  # 1 / (1 + e^-x) written as exp(-log(1 + e^-x)): equal, and its autodiff derivative has no
  # (1 + e^-x)^2, which overflows float64 for x < -355 (gelu's 2z reaches that at x = -17).
  return jnp.exp(-jnp.log1p(jnp.exp(-x)))


def tanh(x):
  x = _f64(x)
  # (e^x - e^-x) / (e^x + e^-x), in two equal forms: e / (e + 2) with e = e^2x - 1 near 0 (no
  # cancellation in the value) and 1 - 2 / (e^2x + 1) elsewhere (no cancellation in its
  # derivative, which autodiff of the first form loses for |x| >> 1; mish's gradient needs it).
  e = jnp.expm1(2.0 * x)
  return jnp.where(jnp.abs(x) < 0.5, e / (e + 2.0), 1.0 - 2.0 / (jnp.exp(2.0 * x) + 1.0))


def relu(x):
  x = _f64(x)
  return jnp.where(x > 0, x, 0.0)


def relu6(x):
  x = _f64(x)
  return jnp.where(x <= 0, 0.0, jnp.where(x >= 6, 6.0, x))


def leaky_relu(x, negative_slope=0.01):
  x = _f64(x)
  return jnp.where(x >= 0, x, negative_slope * x)


def elu(x, alpha=1.0):
  x = _f64(x)
  # alpha (e^x - 1), with e^x - 1 as expm1 so that it keeps its digits near 0.
  return jnp.where(x > 0, x, alpha * jnp.expm1(x))


def selu(x):
  x = _f64(x)
  return SELU_SCALE * jnp.where(x > 0, x, SELU_ALPHA * jnp.expm1(x))


def celu(x, alpha=1.0):
  x = _f64(x)
  return jnp.where(x > 0, x, alpha * jnp.expm1(x / alpha))


def softplus(x):
  x = _f64(x)
  return jnp.log1p(jnp.exp(x))


def log_sigmoid(x):
  x = _f64(x)
  return -jnp.log1p(jnp.exp(-x))


def soft_sign(x):
  x = _f64(x)
  return x / (jnp.abs(x) + 1.0)


def squareplus(x, b=4):
  x = _f64(x)
  s = jnp.sqrt(x * x + b)
  # (x + s) / 2 == b / (2 (s - x)) (multiply by the conjugate); the left form cancels for x < 0.
  # (min(x, 0) keeps the unused branch finite for x >= 0 and b = 0, so its gradient is not NaN.)
  return jnp.where(x >= 0, 0.5 * (x + s), b / (2.0 * (s - jnp.minimum(x, 0.0))))


def sparse_plus(x):
  x = _f64(x)
  return jnp.where(x <= -1, 0.0, jnp.where(x >= 1, x, 0.25 * (x + 1.0) ** 2))


def sparse_sigmoid(x):
  x = _f64(x)
  return jnp.where(x <= -1, 0.0, jnp.where(x >= 1, 1.0, 0.5 * (x + 1.0)))


def hard_tanh(x):
  x = _f64(x)
  return jnp.where(x <= -1, -1.0, jnp.where(x >= 1, 1.0, x))


def hard_sigmoid(x):
  x = _f64(x)
  return jnp.where(x <= -3, 0.0, jnp.where(x >= 3, 1.0, (x + 3.0) / 6.0))


def hard_silu(x):
  return x * hard_sigmoid(x)


def gelu(x, approximate=True):
  x = _f64(x)
  if approximate:
    z = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
    # 0.5 (1 + tanh z) == sigmoid(2z); the left form cancels to 0 for x << 0.
    return x * sigmoid(2.0 * z)
  return 0.5 * x * erfc(-x / math.sqrt(2.0))


def gelu_quick(x):
  return _f64(x) * sigmoid(1.702 * x)


def silu(x):
  return _f64(x) * sigmoid(x)


def mish(x):
  return _f64(x) * tanh(softplus(x))


def glu(x, axis=-1):
  a, b = jnp.split(_f64(x), 2, axis)
  return a * sigmoid(b)


def _masked(x, where):
  return x if where is None else jnp.where(where, x, -jnp.inf)


def softmax(x, axis=-1, where=None):
  x = _masked(_f64(x), where)
  e = jnp.exp(x - jnp.max(x, axis, keepdims=True))
  return e / jnp.sum(e, axis, keepdims=True)


def log_softmax(x, axis=-1, where=None):
  x = _masked(_f64(x), where)
  shifted = x - jnp.max(x, axis, keepdims=True)
  return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis, keepdims=True))


REFERENCES = {
  f.__name__: f
  for f in (
    identity,
    sigmoid,
    tanh,
    relu,
    relu6,
    leaky_relu,
    elu,
    selu,
    celu,
    softplus,
    log_sigmoid,
    soft_sign,
    squareplus,
    sparse_plus,
    sparse_sigmoid,
    hard_tanh,
    hard_sigmoid,
    hard_silu,
    gelu,
    gelu_quick,
    silu,
    mish,
    glu,
    softmax,
    log_softmax,
  )
}

# (f(-inf), f'(-inf), f(+inf), f'(+inf)) with default parameters: the limits of the math, written
# down rather than derived from the formulas above (which are not meant for infinite inputs).
INF = math.inf
LIMITS = {
  "identity": (-INF, 1.0, INF, 1.0),
  "sigmoid": (0.0, 0.0, 1.0, 0.0),
  "tanh": (-1.0, 0.0, 1.0, 0.0),
  "relu": (0.0, 0.0, INF, 1.0),
  "relu6": (0.0, 0.0, 6.0, 0.0),
  "leaky_relu": (-INF, 0.01, INF, 1.0),
  "elu": (-1.0, 0.0, INF, 1.0),
  "selu": (-SELU_SCALE * SELU_ALPHA, 0.0, INF, SELU_SCALE),
  "celu": (-1.0, 0.0, INF, 1.0),
  "softplus": (0.0, 0.0, INF, 1.0),
  "log_sigmoid": (-INF, 1.0, 0.0, 0.0),
  "soft_sign": (-1.0, 0.0, 1.0, 0.0),
  "squareplus": (0.0, 0.0, INF, 1.0),
  "sparse_plus": (0.0, 0.0, INF, 1.0),
  "sparse_sigmoid": (0.0, 0.0, 1.0, 0.0),
  "hard_tanh": (-1.0, 0.0, 1.0, 0.0),
  "hard_sigmoid": (0.0, 0.0, 1.0, 0.0),
  "hard_silu": (0.0, 0.0, INF, 1.0),
  "gelu": (0.0, 0.0, INF, 1.0),
  "gelu_quick": (0.0, 0.0, INF, 1.0),
  "silu": (0.0, 0.0, INF, 1.0),
  "mish": (0.0, 0.0, INF, 1.0),
}


def jax_nn(name: str, **params):
  """jax.nn's function of that name with `params` bound (the spec's formula for jaxact's own
  ``gelu_quick``, which jax.nn lacks): the activation the fused, gated and layer tests compose."""
  spec = get_spec(name)
  fn = getattr(jax.nn, spec.name) if spec.jax_nn else spec.fn
  return lambda z: fn(z, **params)
