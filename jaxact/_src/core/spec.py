"""The activation spec table: one entry per activation, and everything else derives from it.

Each :class:`ActivationSpec` holds the forward formula, the derivative written from the output
(``d_output``, when the output determines it) or from the input (``d_input``), the parameters with
their defaults, the points where the derivative is a convention (``kinks``), and the text the
docstrings and the README table are built from. The ``custom_vjp`` rules in ``activations.py``, the
generated public functions, the README's residual-policy table and the test parametrization all read
this table, so adding an activation is adding one entry here (plus its re-export line).

Numerical conventions shared by every formula below:

* Formulas receive ``x`` already in the *compute dtype* (float32 for float16, bfloat16 and float32
  inputs, float64 for float64) and may assume parameters were validated.
* No branch of a ``jnp.where`` may produce NaN or inf for a finite input, even a branch that is
  discarded: JAX differentiates discarded branches too (second-order gradients go through these
  formulas), and ``0 * nan`` is ``nan``.
* ``x * something(x)`` forms clamp the multiplying ``x`` to ``[-_BIG, _BIG]`` wherever ``something``
  is exactly zero beyond that range, so that ``x = ±inf`` gives the limit instead of ``inf * 0``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

# Beyond |x| = _BIG every sigmoid/erfc/sech^2 factor used below is exactly 0 or 1 in float32 and
# float64 (sigmoid(-1e4) underflows even in float64, whose smallest subnormal is ~4.9e-324), so
# clamping a multiplying x to this range changes no finite result and turns inf * 0 into 0.
_BIG = 1e4

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_CUBIC = 0.044715
_GELU_QUICK_SCALE = 1.702

Residual = Literal["output", "input", "none", "code"]  # code: few-bit f' (jaxact._src.codes.code)


def _sigmoid(x: Array) -> Array:
  # XLA expands logistic to 1 / (1 + exp(-x)): relatively accurate on both sides (exp(-x) is large
  # exactly where the result is small), 0 and 1 at ∓inf, never NaN but for NaN input.
  return lax.logistic(x)


def _sigmoid_pair(x: Array) -> tuple[Array, Array]:
  """(sigmoid(x), sigmoid(-x)), each accurate in relative terms (1 - sigmoid(x) would not be).

  One exp serves both: with e = exp(-|x|) (in [0, 1], never overflowing) the smaller is
  e / (1 + e) and the larger 1 minus it (no cancellation: the smaller is at most 1/2), which also
  keeps their errors independent (1 / (1 + e) would share the rounding of 1 + e, and products such
  as silu's x s(x) s(-x) would add them up). NaN propagates."""
  e = jnp.exp(-jnp.abs(x))
  small = e / (1.0 + e)
  # (1 - small, small) for x >= 0, (small, 1 - small) below, picked by exact arithmetic (weights
  # 0 and ±1) rather than jnp.where: XLA:CPU does not fuse an exp into a consumer that selects
  # from it, and would write `small` to memory and read it back.
  p = jnp.where(x >= 0, 1.0, 0.0)
  sign = 1.0 - 2.0 * p
  return p + sign * small, (1.0 - p) - sign * small


def _softplus(x: Array) -> Array:
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _safe_sqrt(v: Array) -> Array:
  """sqrt that is 0 (with a finite derivative) for v <= 0, so grad-of-grad never sees 1/sqrt(0).

  NaN propagates (a NaN input must give a NaN gradient, as in jax.nn)."""
  flat = v <= 0
  return jnp.where(flat, 0.0, jnp.sqrt(jnp.where(flat, 1.0, v)))


def _clamp(x: Array) -> Array:
  return jnp.clip(x, -_BIG, _BIG)


@dataclasses.dataclass(frozen=True)
class Param:
  """A parameter of an activation: its name, default, and what values it accepts."""

  name: str
  default: Any
  doc: str
  # Returns an error message for a concrete value the activation cannot accept, else None.
  check: Callable[[Any], str | None] | None = None
  # Static parameters (a flag such as gelu's `approximate`) select a formula; they are never
  # arrays and never differentiated.
  static: bool = False
  # For static parameters: the accepted value in its canonical form (e.g. np.bool_ -> bool), after
  # `check` has passed.
  convert: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
  """One row of the activation table.

  Attributes:
    name: public name (``jaxact.<name>``), identical to ``jax.nn.<name>`` where jax.nn has it.
    fn: forward ``fn(x, **params)`` in the compute dtype.
    residual: what the custom_vjp keeps for the backward pass with default/valid parameters:
      ``"output"`` (only ``y``), ``"input"`` (only ``x``) or ``"none"``.
    d_output: ``f'(x)`` written from ``y = f(x)``: ``d_output(y, **params)``. Required when
      ``residual == "output"``.
    d_input: ``f'(x)`` written from ``x``: ``d_input(x, **params)``. Used for input-residual
      activations and as the fallback when the parameters make ``d_output`` invalid (or are traced).
      When omitted it is ``d_output(fn(x))``, valid whenever ``d_output`` is.
    d_code: ``f'(x)`` as the 8-bit derivative code quantizes it (``jaxact._src.codes.code``): within
      2e-6 of ``d_input`` in absolute terms, from fewer operations (``d_input`` spends some on
      relative accuracy in the tails, which a code of 255 steps cannot see). None: ``d_input``.
    output_ok: for concrete parameters, whether ``d_output`` is valid (e.g. leaky_relu needs
      ``negative_slope > 0``). ``None`` means always.
    unbounded: for concrete parameters, whether ``fn`` overflows its (float32 or wider) dtype for
      some finite input (selu; leaky_relu with a slope beyond 1; celu with a negative alpha), so
      that a product ``fn(a) * b`` must be formed as ``(a b) f'(a)`` where ``fn(a)`` is infinite.
      ``None`` means never. Tested against ``fn`` at the dtype's extremes.
    params: parameters after ``x``, in signature order.
    kinks: ``{x0: f'(x0)}`` for the points where the derivative is a convention, as jaxact
      computes it; ``jax_nn_kinks`` lists the points where jax.nn's autodiff gives another value.
    formula: LaTeX of the forward, for the docstring's ``.. math::`` block.
    derivative: LaTeX of the derivative the backward pass uses, in terms of ``y`` for output
      residuals (``\bar x`` / ``\bar y`` are cotangents where the rule is not elementwise).
    fallback: when an output-residual activation keeps the input instead (parameter conditions).
    summary: one-line docstring summary.
    jax_nn: whether ``jax.nn`` has a function of this name (gelu_quick is jaxact's own).
    elementwise: False for glu/softmax/log_softmax, whose rules are written in activations.py.
    example: (input expression, expected ``.tolist()`` to 4 decimals, taken from jax.nn) for
      the docstring's doctest.
    notes: extra docstring paragraphs (numerical limits, conventions).
  """

  name: str
  summary: str
  formula: str
  residual: Residual
  derivative: str = ""
  fallback: str = ""
  fn: Callable[..., Array] | None = None
  d_output: Callable[..., Array] | None = None
  d_input: Callable[..., Array] | None = None
  d_code: Callable[..., Array] | None = None
  output_ok: Callable[..., bool] | None = None
  unbounded: Callable[..., bool] | None = None
  params: tuple[Param, ...] = ()
  kinks: Mapping[float, float] = dataclasses.field(default_factory=dict)
  jax_nn_kinks: Mapping[float, float] = dataclasses.field(default_factory=dict)
  jax_nn: bool = True
  elementwise: bool = True
  example: tuple[str, str] = ("", "")
  notes: str = ""
  aliases: tuple[str, ...] = ()

  def derivative_from_input(self, x: Array, **params: Any) -> Array:
    if self.d_input is not None:
      return self.d_input(x, **params)
    assert self.d_output is not None and self.fn is not None  # enforced in __post_init__
    return self.d_output(self.fn(x, **params), **params)

  def derivative_for_code(self, x: Array, **params: Any) -> Array:
    """``f'(x)`` as the 8-bit code quantizes it (``d_code``, else ``d_input``)."""
    if self.d_code is not None:
      return self.d_code(x, **params)
    return self.derivative_from_input(x, **params)

  def __post_init__(self):
    if self.elementwise:
      if self.fn is None:
        raise TypeError(f"spec {self.name!r}: elementwise activations need `fn`")
      if self.residual == "output" and self.d_output is None:
        raise TypeError(f"spec {self.name!r}: output residual needs `d_output`")
      if self.residual == "input" and self.d_input is None:
        raise TypeError(f"spec {self.name!r}: input residual needs `d_input`")


# ----------------------------------------------------------------------------- parameter checks


# Checks run on concrete values only (Python numbers, NumPy arrays, non-traced jax arrays), with
# NumPy, so that they never stage operations into a surrounding trace.


def _nonzero(v) -> str | None:
  return "must be nonzero" if (np.asarray(v) == 0).any() else None


def _nonnegative(v) -> str | None:
  return "must be >= 0" if (np.asarray(v) < 0).any() else None


def _is_flag(v) -> str | None:
  # What jax.nn's `if approximate:` accepts without surprise: bools and the integers 0 and 1, as
  # Python or NumPy scalars or 0-d arrays.
  a = np.asarray(v) if isinstance(v, (bool, int, np.generic, np.ndarray, Array)) else None
  if a is not None and a.shape == () and a.dtype.kind in "biu" and a.item() in (0, 1):
    return None
  return f"must be a bool (True/False, a NumPy bool, or 0/1), got {type(v).__name__}"


def _all_positive(v) -> bool:
  return bool((np.asarray(v) > 0).all())


def _all_nonnegative(v) -> bool:
  return bool((np.asarray(v) >= 0).all())


# --------------------------------------------------------------------------------- the formulas


def _relu(x):
  return jnp.maximum(x, 0.0)


def _relu6(x):
  return jnp.minimum(jnp.maximum(x, 0.0), 6.0)


def _sign_bit(y: Array) -> Array:
  """``jnp.signbit(y)`` for floats, as a comparison of y's bits with zero: the same bit, in
  operations Mosaic GPU lowers (jnp.signbit converts an int32 to bool, which it does not)."""
  y = jnp.asarray(y)
  return (
    lax.bitcast_convert_type(y, {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[y.dtype.itemsize]) < 0
  )


def _leaky_relu(x, negative_slope):
  # x = -0.0 gives +0.0: the backward reads the output's sign bit, and jax.nn's slope at -0.0 is
  # 1 (x >= 0). NaN passes through.
  return jnp.where(x < 0, negative_slope * x, jnp.where(x == 0, 0.0, x))


def _elu(x, alpha):
  return jnp.where(x > 0, x, alpha * jnp.expm1(jnp.minimum(x, 0.0)))


# Past t = 87, e^t is within a factor 5 of float32's largest number, where XLA's float32 exp
# overflows a little early (e^88.72283 is 3.4028e38, below the largest, yet gives inf): there
# alpha * e^t is formed as (alpha * e^(t/2)) * e^(t/2), finite as long as the true value is, and
# the rounding of t = x / alpha is compensated (a relative error of 4e-6 there is what decides
# whether e^t, and the derivative y / alpha + 1, overflows at the edge).
_CELU_SPLIT = 87.0


def _split(v):
  """Dekker's split of v into a high part of half the significand's bits and the rest."""
  c = 4097.0 if v.dtype.itemsize <= 4 else 134217729.0  # 2^12 + 1 (float32), 2^27 + 1
  big = c * v
  hi = big - (big - v)
  return hi, v - hi


def _celu(x, alpha):
  xm = jnp.minimum(x, 0.0)
  t = xm / alpha  # > 0 only for alpha < 0
  # t_lo = (xm - t * alpha) / alpha, with t * alpha formed exactly (Dekker's product), for t up
  # to 128 (beyond, the value overflows anyway and the split itself would).
  alpha = jnp.asarray(alpha, t.dtype)
  far = t > 128.0
  tc = jnp.where(far, 128.0, t)
  xc = jnp.where(far, tc * alpha, xm)
  (th, tl), (ah, al) = _split(tc), _split(alpha)
  p = tc * alpha
  e = ((th * ah - p) + th * al + tl * ah) + tl * al
  t_lo = ((xc - p) - e) / alpha
  half = jnp.exp(0.5 * jnp.maximum(t, _CELU_SPLIT))
  large = (alpha * half) * (half * (1.0 + t_lo)) - alpha
  small = alpha * jnp.expm1(jnp.minimum(t, _CELU_SPLIT))
  return jnp.maximum(x, 0.0) + jnp.where(t > _CELU_SPLIT, large, small)


def _soft_sign(x):
  # x / (|x| + 1) is inf/inf at ±inf; the limit there is ±1.
  return jnp.where(jnp.isinf(x), jnp.sign(x), x / (jnp.abs(x) + 1.0))


def _squareplus(x, b):
  # (x + s) / 2 with s = sqrt(x^2 + b) equals max(x, 0) + (b/2) / (s + |x|) for either sign of x:
  # that form has no cancellation for x << 0, no overflow of x + s near finfo.max (the fraction
  # just goes to 0; XLA may re-associate 0.5x + 0.5s into 0.5(x + s), so halving first is not
  # enough) and no branch, so NaN propagates. s is taken as m sqrt((|x|/m)^2 + b/m^2) with
  # m = max(|x|, 1) (|x|/m is min(|x|, 1), which stays defined at |x| = inf) so x^2 never
  # overflows and d/db stays finite at b = 0 (hypot(x, sqrt(b))'s is not).
  ax = jnp.abs(x)
  m = jnp.maximum(ax, 1.0)
  s = m * jnp.sqrt(jnp.square(jnp.minimum(ax, 1.0)) + b / (m * m))
  den = s + ax
  return jnp.maximum(x, 0.0) + (0.5 * b) / jnp.where(den > 0, den, 1.0)


def _squareplus_d_output(y, b):
  # y = (x + s)/2 with s = sqrt(x^2+b) gives x = y - b/(4y) and f' = y/s = 1 / (1 + r^2) with
  # r = sqrt(b) / (2y). r, not b / (4 y^2): y^2 underflows for tiny y, which with b = 0 made 0/0;
  # r is 0 for b = 0 and +inf (f' = 0) where y is tiny and b > 0. y = 0 (x = -inf, or b = 0 and
  # x <= 0) is the flat side; NaN propagates.
  flat = y <= 0
  r = (0.5 * jnp.sqrt(jnp.asarray(b, y.dtype))) / jnp.where(flat, 1.0, y)
  return jnp.where(flat, 0.0, 1.0 / (1.0 + r * r))


def _sparse_plus(x):
  return jnp.where(x <= -1.0, 0.0, jnp.where(x >= 1.0, x, 0.25 * jnp.square(x + 1.0)))


def _gelu(x, approximate):
  if approximate:
    # 0.5 (1 + tanh(z)) == sigmoid(2 z): the sigmoid form keeps relative accuracy for x << 0,
    # where 1 + tanh(z) cancels to 0.
    z = _SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x)
    return jnp.maximum(x, -_BIG) * _sigmoid(2.0 * z)
  return 0.5 * jnp.maximum(x, -_BIG) * lax.erfc(-x * math.sqrt(0.5))


def _gelu_d_input(x, approximate):
  # Past |x| = _BIG every sigmoid/exp factor below is exactly 0 or 1, so the clamped x gives the
  # same derivative and no inf * 0.
  xc = _clamp(x)
  if approximate:
    # d/dx [x sigmoid(2z)] = sigmoid(2z) + x * 2 sigmoid(2z) sigmoid(-2z) * dz/dx
    z = _SQRT_2_OVER_PI * (xc + _GELU_CUBIC * xc * xc * xc)
    dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * xc * xc)
    s, s_neg = _sigmoid_pair(2.0 * z)
    return s + 2.0 * xc * s * s_neg * dz
  return 0.5 * lax.erfc(-x * math.sqrt(0.5)) + xc * _INV_SQRT_2PI * jnp.exp(-0.5 * xc * xc)


def _gelu_d_code(x, approximate=True):
  if not approximate:
    return _gelu_d_input(x, approximate)
  xc = _clamp(x)
  z = _SQRT_2_OVER_PI * (xc + _GELU_CUBIC * xc * xc * xc)
  dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * xc * xc)
  s = _sigmoid(2.0 * z)  # 1 - s: off by 6e-8 where s ~ 1, enough for a code
  return s + 2.0 * xc * s * (1.0 - s) * dz


def _swish_like(x, scale):
  return jnp.maximum(x, -_BIG) * _sigmoid(scale * x)


def _swish_like_d_input(x, scale):
  xc = _clamp(x)
  s, s_neg = _sigmoid_pair(scale * xc)
  return s + scale * xc * s * s_neg


def _swish_like_d_code(x, scale):
  xc = _clamp(x)
  s = _sigmoid(scale * xc)
  return s + scale * xc * s * (1.0 - s)


# tanh(softplus(x)) from one exp: with w = e^x it is n / (n + 2), n = w (w + 2), with relative
# accuracy for x << 0 (n ~ 2w). Past x = 20 it is 1 to float64 precision, so x is capped there and
# w never overflows.
_MISH_CAP = 20.0


def _mish(x):
  w = jnp.exp(jnp.minimum(x, _MISH_CAP))
  n = w * (w + 2.0)
  return jnp.maximum(x, -_BIG) * (n / (n + 2.0))


def _mish_d_input(x):
  # With w = e^x, tanh(softplus(x)) = n / (n + 2), n = w (w + 2), and its derivative is
  # 4 w (w + 1) / (n + 2)^2: one exp, relatively accurate for x << 0 (n ~ 2w) as for x >> 0 (no
  # 1 - tanh^2). The cap keeps (n + 2)^2 finite (float32 overflows past x = 22); beyond it the
  # second term is below half an ulp of 1 up to the clamp's |x| = 1e4, so the derivative is 1.
  xc = _clamp(x)
  cap = _MISH_CAP if xc.dtype.itemsize <= 4 else 2 * _MISH_CAP
  w = jnp.exp(jnp.minimum(xc, cap))
  n = w * (w + 2.0)
  d = n + 2.0
  return (n * d + xc * (4.0 * w * (w + 1.0))) / (d * d)  # t + x t', over one denominator


def _mish_d_code(x):
  # With w = e^x, tanh(softplus(x)) = n / (n + 2), n = w (w + 2), and its derivative is
  # 4 w (w + 1) / (n + 2)^2, as in d_input, without its float64 cap.
  xc = _clamp(x)
  w = jnp.exp(jnp.minimum(xc, _MISH_CAP))
  n = w * (w + 2.0)
  return n / (n + 2.0) + xc * (4.0 * w * (w + 1.0)) / ((n + 2.0) * (n + 2.0))


def _hard_sigmoid(x):
  return jnp.minimum(jnp.maximum(x + 3.0, 0.0), 6.0) / 6.0


def _hard_silu_d_input(x):
  return jnp.where(x <= -3.0, 0.0, jnp.where(x >= 3.0, 1.0, (2.0 * x + 3.0) / 6.0))


def _between(y, lo, hi, inside):
  return jnp.where((y > lo) & (y < hi), inside, 0.0)


# -------------------------------------------------------------------------------------- table

_FLAT_SIDE = (
  "At a kink the derivative is taken from the flat side (jax.nn's convention for relu and relu6), "
  "the only convention the output alone can express."
)

_X = "jnp.array([-2., -0.5, 0., 0.5, 2.])"

SPECS: tuple[ActivationSpec, ...] = (
  ActivationSpec(
    name="identity",
    summary="Identity activation function.",
    formula=r"\mathrm{identity}(x) = x",
    residual="none",
    fn=lambda x: x,
    d_output=lambda y: jnp.ones_like(y),
    example=(_X, "[-2.0, -0.5, 0.0, 0.5, 2.0]"),
  ),
  ActivationSpec(
    name="sigmoid",
    summary="Sigmoid activation function.",
    formula=r"\mathrm{sigmoid}(x) = \frac{1}{1 + e^{-x}}",
    derivative=r"y (1 - y)",
    residual="output",
    fn=_sigmoid,
    d_output=lambda y: y * (1.0 - y),
    notes="The gradient is computed from the output, so once ``y`` rounds to 1 (x >= 17 in "
    "float32, x >= 37 in float64) it is exactly 0 where the true value is below one ulp of 1.",
    example=(_X, "[0.1192, 0.3775, 0.5, 0.6225, 0.8808]"),
  ),
  ActivationSpec(
    name="tanh",
    summary="Hyperbolic tangent activation function.",
    formula=r"\tanh(x) = \frac{e^x - e^{-x}}{e^x + e^{-x}}",
    derivative=r"1 - y^2",
    residual="output",
    fn=jnp.tanh,
    d_output=lambda y: 1.0 - y * y,
    notes="The gradient comes from the output: 0 once ``|y|`` rounds to 1 (|x| >= 9 in float32).",
    example=(_X, "[-0.964, -0.4621, 0.0, 0.4621, 0.964]"),
  ),
  ActivationSpec(
    name="relu",
    summary="Rectified linear unit activation function.",
    formula=r"\mathrm{relu}(x) = \max(x, 0)",
    derivative=r"[y > 0]",
    residual="output",
    fn=_relu,
    d_output=lambda y: jnp.where(y > 0, 1.0, 0.0),
    kinks={0.0: 0.0},
    example=(_X, "[0.0, 0.0, 0.0, 0.5, 2.0]"),
  ),
  ActivationSpec(
    name="relu6",
    summary="Rectified linear unit 6 activation function.",
    formula=r"\mathrm{relu6}(x) = \min(\max(x, 0), 6)",
    derivative=r"[0 < y < 6]",
    residual="output",
    fn=_relu6,
    d_output=lambda y: _between(y, 0.0, 6.0, 1.0),
    kinks={0.0: 0.0, 6.0: 0.0},
    example=(_X, "[0.0, 0.0, 0.0, 0.5, 2.0]"),
  ),
  ActivationSpec(
    name="leaky_relu",
    summary="Leaky rectified linear unit activation function.",
    formula=r"\mathrm{leaky\_relu}(x) = \begin{cases} x, & x \ge 0\\ \alpha x, & x < 0 \end{cases}"
    r", \quad \alpha = \mathrm{negative\_slope}",
    derivative=r"1 \text{ if } y \ge 0 \text{ else } \alpha",
    residual="output",
    fn=_leaky_relu,
    # The sign bit, not y >= 0: slope * x underflows to -0.0 for tiny negative x (|x| < ~1e-36 in
    # float32 with flush-to-zero), and the sign survives the flush.
    d_output=lambda y, negative_slope: jnp.where(_sign_bit(y), negative_slope, 1.0),
    d_input=lambda x, negative_slope: jnp.where(x >= 0, 1.0, negative_slope),
    output_ok=lambda negative_slope: _all_positive(negative_slope),
    unbounded=lambda negative_slope: bool((np.abs(np.asarray(negative_slope)) > 1).any()),
    fallback="`negative_slope <= 0` or traced",
    params=(Param("negative_slope", 0.01, "scalar or array of slopes for x < 0 (default 0.01)"),),
    kinks={0.0: 1.0},
    example=(_X, "[-0.02, -0.005, 0.0, 0.5, 2.0]"),
  ),
  ActivationSpec(
    name="elu",
    summary="Exponential linear unit activation function.",
    formula=r"\mathrm{elu}(x) = \begin{cases} x, & x > 0\\ \alpha (e^x - 1), & x \le 0 "
    r"\end{cases}",
    derivative=r"1 \text{ if } y > 0 \text{ else } y + \alpha",
    residual="output",
    fn=_elu,
    d_output=lambda y, alpha: jnp.where(y > 0, 1.0, y + alpha),
    d_input=lambda x, alpha: jnp.where(x > 0, 1.0, alpha * jnp.exp(jnp.minimum(x, 0.0))),
    output_ok=lambda alpha: _all_nonnegative(alpha),
    fallback="`alpha < 0` or traced",
    params=(Param("alpha", 1.0, "scalar or array of alpha values (default 1.0)"),),
    kinks={0.0: 1.0},  # = alpha, the x <= 0 side, as jax.nn; 1.0 for the default alpha
    notes="At 0 the derivative is ``alpha`` (jax.nn's value). A traced ``alpha`` keeps the input "
    "so that its own gradient can be computed.",
    example=(_X, "[-0.8647, -0.3935, 0.0, 0.5, 2.0]"),
  ),
  ActivationSpec(
    name="selu",
    summary="Scaled exponential linear unit activation.",
    formula=r"\mathrm{selu}(x) = \lambda \begin{cases} x, & x > 0\\ \alpha e^x - \alpha, & x \le 0"
    r"\end{cases}",
    derivative=r"\lambda \text{ if } y > 0 \text{ else } y + \lambda\alpha",
    residual="output",
    fn=lambda x: _SELU_SCALE * _elu(x, _SELU_ALPHA),
    d_output=lambda y: jnp.where(y > 0, _SELU_SCALE, y + _SELU_SCALE * _SELU_ALPHA),
    unbounded=lambda: True,  # lambda x for x > 0, lambda > 1
    kinks={0.0: _SELU_SCALE * _SELU_ALPHA},
    notes=r"with :math:`\lambda = 1.0507009873554804934193349852946` and "
    r":math:`\alpha = 1.6732632423543772848170429916717`.",
    example=(_X, "[-1.5202, -0.6918, 0.0, 0.5254, 2.1014]"),
  ),
  ActivationSpec(
    name="celu",
    summary="Continuously-differentiable exponential linear unit activation.",
    formula=r"\mathrm{celu}(x) = \max(x, 0) + \alpha \left(e^{\min(x, 0) / \alpha} - 1\right)",
    derivative=r"1 \text{ if } y > 0 \text{ else } y / \alpha + 1",
    residual="output",
    fn=_celu,
    d_output=lambda y, alpha: jnp.where(y > 0, 1.0, y / alpha + 1.0),
    unbounded=lambda alpha: bool((np.asarray(alpha) < 0).any()),  # alpha e^{x / alpha}, x < 0
    fallback="`alpha` traced",
    params=(Param("alpha", 1.0, "array or scalar, nonzero (default 1.0)", check=_nonzero),),
    kinks={0.0: 1.0},
    example=(_X, "[-0.8647, -0.3935, 0.0, 0.5, 2.0]"),
  ),
  ActivationSpec(
    name="softplus",
    summary="Softplus activation function.",
    formula=r"\mathrm{softplus}(x) = \log(1 + e^x)",
    derivative=r"1 - e^{-y}",
    residual="output",
    fn=_softplus,
    d_output=lambda y: -jnp.expm1(-y),
    example=(_X, "[0.1269, 0.4741, 0.6931, 0.9741, 2.1269]"),
  ),
  ActivationSpec(
    name="log_sigmoid",
    summary="Log-sigmoid activation function.",
    formula=r"\mathrm{log\_sigmoid}(x) = -\log(1 + e^{-x})",
    derivative=r"1 - e^{y}",
    residual="output",
    fn=lambda x: -_softplus(-x),
    d_output=lambda y: -jnp.expm1(y),
    example=(_X, "[-2.1269, -0.9741, -0.6931, -0.4741, -0.1269]"),
  ),
  ActivationSpec(
    name="soft_sign",
    summary="Soft-sign activation function.",
    formula=r"\mathrm{soft\_sign}(x) = \frac{x}{\lvert x \rvert + 1}",
    derivative=r"(1 - \lvert y \rvert)^2",
    residual="output",
    fn=_soft_sign,
    d_output=lambda y: jnp.square(1.0 - jnp.abs(y)),
    example=(_X, "[-0.6667, -0.3333, 0.0, 0.3333, 0.6667]"),
  ),
  ActivationSpec(
    name="squareplus",
    summary="Squareplus activation function.",
    formula=r"\mathrm{squareplus}(x) = \frac{x + \sqrt{x^2 + b}}{2}",
    derivative=r"\frac{y^2}{y^2 + b/4}",
    residual="output",
    fn=_squareplus,
    d_output=_squareplus_d_output,
    fallback="`b` traced",
    params=(Param("b", 4, "smoothness parameter, >= 0 (default 4)", check=_nonnegative),),
    kinks={0.0: 0.5},  # b = 4; with b = 0 squareplus is relu and the kink's derivative is 0
    notes="Computed without overflow up to ``±finfo.max``.",
    example=(_X, "[0.4142, 0.7808, 1.0, 1.2808, 2.4142]"),
  ),
  ActivationSpec(
    name="sparse_plus",
    summary="Sparse plus function.",
    formula=r"\mathrm{sparse\_plus}(x) = \begin{cases} 0, & x \le -1\\ \frac{1}{4}(x+1)^2, & "
    r"-1 < x < 1\\ x, & 1 \le x \end{cases}",
    derivative=r"\sqrt{\min(y, 1)}",
    residual="output",
    fn=_sparse_plus,
    d_output=lambda y: _safe_sqrt(jnp.minimum(y, 1.0)),
    kinks={-1.0: 0.0, 1.0: 1.0},
    example=(_X, "[0.0, 0.0625, 0.25, 0.5625, 2.0]"),
  ),
  ActivationSpec(
    name="sparse_sigmoid",
    summary="Sparse sigmoid activation function.",
    formula=r"\mathrm{sparse\_sigmoid}(x) = \tfrac{1}{2}\,\mathrm{clip}(x + 1, 0, 2)",
    derivative=r"\tfrac{1}{2} [0 < y < 1]",
    residual="output",
    fn=lambda x: 0.5 * jnp.minimum(jnp.maximum(x + 1.0, 0.0), 2.0),
    d_output=lambda y: _between(y, 0.0, 1.0, 0.5),
    kinks={-1.0: 0.0, 1.0: 0.0},
    jax_nn_kinks={-1.0: 0.25, 1.0: 0.25},
    notes=_FLAT_SIDE + " jax.nn's autodiff gives 0.25 at ±1 (half of each side). One ulp below 1 "
    "the output rounds to 1, and the gradient there is the kink's 0.",
    example=(_X, "[0.0, 0.25, 0.5, 0.75, 1.0]"),
  ),
  ActivationSpec(
    name="hard_tanh",
    summary="Hard tanh activation function.",
    formula=r"\mathrm{hard\_tanh}(x) = \mathrm{clip}(x, -1, 1)",
    derivative=r"[\lvert y \rvert < 1]",
    residual="output",
    fn=lambda x: jnp.minimum(jnp.maximum(x, -1.0), 1.0),
    d_output=lambda y: jnp.where(jnp.abs(y) < 1.0, 1.0, 0.0),
    kinks={-1.0: 0.0, 1.0: 0.0},
    jax_nn_kinks={-1.0: 1.0, 1.0: 1.0},
    notes=_FLAT_SIDE + " jax.nn's autodiff gives 1 at ±1.",
    example=(_X, "[-1.0, -0.5, 0.0, 0.5, 1.0]"),
  ),
  ActivationSpec(
    name="hard_sigmoid",
    summary="Hard sigmoid activation function.",
    formula=r"\mathrm{hard\_sigmoid}(x) = \frac{\mathrm{relu6}(x + 3)}{6}",
    derivative=r"\tfrac{1}{6} [0 < y < 1]",
    residual="output",
    fn=_hard_sigmoid,
    d_output=lambda y: _between(y, 0.0, 1.0, 1.0 / 6.0),
    kinks={-3.0: 0.0, 3.0: 0.0},
    example=(_X, "[0.1667, 0.4167, 0.5, 0.5833, 0.8333]"),
  ),
  ActivationSpec(
    name="hard_silu",
    summary="Hard SiLU (swish) activation function.",
    formula=r"\mathrm{hard\_silu}(x) = x \cdot \mathrm{hard\_sigmoid}(x)",
    residual="input",
    fn=lambda x: jnp.maximum(x, -3.0) * _hard_sigmoid(x),
    d_input=_hard_silu_d_input,
    kinks={-3.0: 0.0, 3.0: 1.0},
    aliases=("hard_swish",),
    notes="Not monotonic on (-3, -1.5), so the output does not determine the input: the input is "
    "kept.",
    example=(_X, "[-0.3333, -0.2083, 0.0, 0.2917, 1.6667]"),
  ),
  ActivationSpec(
    name="gelu",
    summary="Gaussian error linear unit activation function.",
    formula=r"\mathrm{gelu}(x) = \frac{x}{2}\left(1 + \tanh\left(\sqrt{2/\pi}\,(x + 0.044715 x^3)"
    r"\right)\right) \text{ (approximate)}, \quad \frac{x}{2}\,\mathrm{erfc}(-x/\sqrt{2}) "
    r"\text{ (exact)}",
    residual="input",
    fn=_gelu,
    d_input=_gelu_d_input,
    d_code=_gelu_d_code,
    params=(
      Param(
        "approximate",
        True,
        "whether to use the tanh approximation (default) or the exact erf form",
        check=_is_flag,
        static=True,
        convert=bool,
      ),
    ),
    notes="Not monotonic, so the input is kept. The tanh form is evaluated as "
    ":math:`x\\,\\sigma(2z)`, which is equal and keeps its relative accuracy for x << 0; the "
    "gradient is finite for every finite x (jax.nn's is NaN for |x| >= 1e30 in float32).",
    example=(_X, "[-0.0454, -0.1543, 0.0, 0.3457, 1.9546]"),
  ),
  ActivationSpec(
    name="gelu_quick",
    summary="Quick GELU activation function.",
    formula=r"\mathrm{gelu\_quick}(x) = x \cdot \mathrm{sigmoid}(1.702 x)",
    residual="input",
    fn=lambda x: _swish_like(x, _GELU_QUICK_SCALE),
    d_input=lambda x: _swish_like_d_input(x, _GELU_QUICK_SCALE),
    d_code=lambda x: _swish_like_d_code(x, _GELU_QUICK_SCALE),
    jax_nn=False,
    notes="Not monotonic, so the input is kept.",
    example=(_X, "[-0.0643, -0.1496, 0.0, 0.3504, 1.9357]"),
  ),
  ActivationSpec(
    name="silu",
    summary="SiLU (aka swish) activation function.",
    formula=r"\mathrm{silu}(x) = x \cdot \mathrm{sigmoid}(x)",
    residual="input",
    fn=lambda x: _swish_like(x, 1.0),
    d_input=lambda x: _swish_like_d_input(x, 1.0),
    d_code=lambda x: _swish_like_d_code(x, 1.0),
    aliases=("swish",),
    notes="Not monotonic, so the input is kept.",
    example=(_X, "[-0.2384, -0.1888, 0.0, 0.3112, 1.7616]"),
  ),
  ActivationSpec(
    name="mish",
    summary="Mish activation function.",
    formula=r"\mathrm{mish}(x) = x \cdot \tanh(\mathrm{softplus}(x))",
    residual="input",
    fn=_mish,
    d_input=_mish_d_input,
    d_code=_mish_d_code,
    notes="Not monotonic, so the input is kept.",
    example=(_X, "[-0.2525, -0.2207, 0.0, 0.3752, 1.944]"),
  ),
  ActivationSpec(
    name="glu",
    summary="Gated linear unit activation function.",
    formula=r"\mathrm{glu}(x) = a \cdot \mathrm{sigmoid}(b), \quad [a, b] = "
    r"\mathrm{split}(x, 2, \mathrm{axis})",
    residual="input",
    elementwise=False,
    params=(Param("axis", -1, "the axis along which x is split in two (default -1)", static=True),),
    notes="The input is kept (the output alone cannot give both halves).",
    example=(
      "jnp.array([[1., 2., 0., -1.]])",
      "[[0.5, 0.5379]]",
    ),
  ),
  ActivationSpec(
    name="softmax",
    summary="Softmax function.",
    formula=r"\mathrm{softmax}(x)_i = \frac{e^{x_i}}{\sum_j e^{x_j}}",
    derivative=r"\bar x = y \odot (\bar y - \langle \bar y, y \rangle)",
    residual="output",
    elementwise=False,
    params=(
      Param("axis", -1, "axis or axes along which to normalize; int, tuple or None", static=True),
      Param("where", None, "boolean mask of the elements to include (default all)", static=True),
    ),
    notes="A row whose entries are all -inf (or all masked by ``where``) gives 0 with zero "
    "gradient. Entries equal to +inf share the row's mass equally (the limit as they grow "
    "together); jax.nn returns NaN for such rows.",
    example=(_X, "[0.0126, 0.0563, 0.0928, 0.1529, 0.6855]"),
  ),
  ActivationSpec(
    name="log_softmax",
    summary="Log-Softmax function.",
    formula=r"\mathrm{log\_softmax}(x)_i = x_i - \log \sum_j e^{x_j}",
    derivative=r"\bar x = \bar y - e^{y} \sum_j \bar y_j",
    residual="output",
    elementwise=False,
    params=(
      Param("axis", -1, "axis or axes along which to normalize; int, tuple or None", static=True),
      Param("where", None, "boolean mask of the elements to include (default all)", static=True),
    ),
    notes="Masked entries are -inf, as in jax.nn. A row whose entries are all -inf (or all "
    "masked) gives -inf (the log of softmax's 0) with zero gradient, never NaN.",
    example=(_X, "[-4.3777, -2.8777, -2.3777, -1.8777, -0.3777]"),
  ),
)

SPEC_BY_NAME: dict[str, ActivationSpec] = {s.name: s for s in SPECS}
ALIASES: dict[str, str] = {a: s.name for s in SPECS for a in s.aliases}

# jax.nn's own functions, bound now: integer and boolean inputs are handed to them, and a program
# may install jaxact's functions into jax.nn (to swap the activations of third-party model code),
# after which looking them up in jax.nn at call time would call jaxact again, forever.
JAX_NN: dict[str, Callable[..., Array]] = {
  s.name: getattr(jax.nn, s.name) for s in SPECS if s.jax_nn
}
