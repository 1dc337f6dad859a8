"""What the few-bit derivative codes' GPU section checks and times, built where tests reach it.

``python -m benchmarks gpu --sections codes`` (``benchmarks/gpu/codes.py``) prints the
tables and times what this module builds; ``tests/codes/test_gpu_codes_section.py`` runs the same
checks on CPU (the kernels in interpret mode) at small shapes and lowers every timed function for an
abstract H100, so that the section a GPU session runs has run before. It holds

* the check of one fused layer with a code through a kernel path against ``"xla"``
  (:func:`check`): the inputs are small multiples of powers of two (:func:`exact_dense`,
  :func:`exact_conv`), so that the pre-activation is exact in bfloat16 and both paths encode the
  same ``z`` (XLA's forward rounds its matmul to bfloat16 before encoding, the kernels encode their
  float32 accumulator): the kept codes must agree, not be close;
* the convolution epilogue kernels alone (:func:`epilogue_passes`): forward ``y`` and the kept
  residual from ``z`` and ``b``, backward ``dz`` and ``db`` from ``g`` and the residual, each with
  XLA's fusion of the same pass and the bytes it moves (:func:`bytes_moved`);
* the Hopper forward alone (:func:`hopper_forward`) and one layer's training step
  (:func:`layer_fn`).

``bits=None`` throughout is the exact residual (gelu and silu keep ``z``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxact
from jaxact._src.activations import api as activations
from jaxact._src.activations import resolve
from pallas_kernels import Epilogue
from support import param_defaults

BITS = (None, 8, 4, 2)
NAMES = ("gelu", "silu")
_NHWC = ("NHWC", "HWIO", "NHWC")
# ‖got - xla‖ / ‖xla‖ of dx, dw, db: the same codes give the same dz, so the gradients differ by
# the matmuls' summation order and roundings only.
GRAD_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}


def label(bits: int | None) -> str:
  return "exact (z)" if bits is None else f"{bits}-bit"


def activation(name: str, bits: int | None):
  """The activation as a user passes it: its name, or ``partial(jaxact.<name>, residual_bits=)``."""
  return name if bits is None else functools.partial(getattr(jaxact, name), residual_bits=bits)


def rule(name: str, bits: int | None):
  """jaxact's rule for `name` (default parameters) keeping the `bits`-bit code (None: z)."""
  spec = jaxact.get_spec(name)
  z = jax.ShapeDtypeStruct((), jnp.float32)
  r, _ = activations._split_params(spec, z, param_defaults(spec))
  return activations.with_code(r, bits)


def code_epilogue(name: str, bits: int | None) -> Epilogue:
  """The kernels' epilogue, as the fused ops build it."""
  return resolve.epilogue(rule(name, bits))


# ----------------------------------------------------------------------------- correctness


def _exact(shape, scale: float, key) -> jax.Array:
  return jax.random.randint(key, shape, -2, 3).astype(jnp.float32) * scale


def exact_dense(shape, dtype, seed: int):
  """x (..., K) in halves, w (K, N) in quarters, b in halves, g normal: z = x @ w + b is a
  multiple of 1/8 (exact in bfloat16 while below 32 in size: :func:`check` verifies it)."""
  *batch, k, n = shape
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x, w, b = _exact((*batch, k), 0.5, kx), _exact((k, n), 0.25, kw), _exact((n,), 0.5, kb)
  g = jax.random.normal(kg, (*batch, n), jnp.float32)
  return tuple(v.astype(dtype) for v in (x, w, b, g))


def exact_conv(x_shape, w_shape, dtype, seed: int):
  """As :func:`exact_dense`, for a 3x3 SAME convolution (NHWC, HWIO)."""
  kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x, w, b = _exact(x_shape, 0.5, kx), _exact(w_shape, 0.25, kw), _exact(w_shape[-1:], 0.5, kb)
  g = jax.random.normal(kg, (*x_shape[:-1], w_shape[-1]), jnp.float32)
  return tuple(v.astype(dtype) for v in (x, w, b, g))


def conv_op(x, w, b, **kw):
  return jaxact.conv_bias_act(x, w, b, padding="SAME", **kw)


OPS = {"dense": jaxact.dense_bias_act, "conv": conv_op}


def _preactivation(op: str, x, w, b) -> np.ndarray:
  """z in float64 (the convolution's in float32: small multiples of 1/8 add up exactly)."""
  x, w, b = (np.asarray(v, np.float64) for v in (x, w, b))
  if op == "dense":
    return x @ w + b
  x32, w32 = (jnp.asarray(v, jnp.float32) for v in (x, w))
  z = lax.conv_general_dilated(
    x32, w32, (1, 1), "SAME", dimension_numbers=_NHWC, precision=lax.Precision.HIGHEST
  )
  return np.asarray(z, np.float64) + b


def run_layer(op: str, impl, act, x, w, b, g):
  """y, the uint8 arrays the pullback keeps, and (dx, dw, db) at cotangent `g`."""

  @jax.jit
  def f(x, w, b, g):
    y, pull = jax.vjp(lambda *a: OPS[op](*a, activation=act, implementation=impl), x, w, b)
    kept = [v for v in jax.tree.leaves(pull) if v.dtype == jnp.uint8]
    return y, kept, pull(g)

  return f(x, w, b, g)


def _rel(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(got)):
    return math.inf
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@dataclasses.dataclass
class Check:
  """One layer through `impl` against ``"xla"``, the same code kept.

  Attributes:
    y_diff: elements of y that differ from XLA's; y_ulps: the largest difference, in units of
      the dtype's epsilon times ``|y_xla|``.
    code_diff: codes (unpacked) that differ from XLA's; code_step: the largest difference in code
      units (4 and 2 bits compare the same exact z with the same boundaries: 0; 8 bits round
      ``act'(z)``, which a GPU's ``exp``/``tanh`` may give an ulp apart: at most 1).
    errs: ``‖got - xla‖ / ‖xla‖`` of dx, dw, db.
  """

  op: str
  impl: str
  name: str
  bits: int
  shape: tuple
  dtype: str
  y_diff: int = 0
  y_ulps: float = 0.0
  code_diff: int = 0
  code_step: int = 0
  code_count: int = 0
  errs: tuple[float, ...] = ()
  error: str | None = None

  @property
  def ok(self) -> bool:
    if self.error is not None:
      return False
    code_ok = self.code_step <= (1 if self.bits == 8 else 0)
    tol = GRAD_TOL[self.dtype]
    return self.y_ulps <= 1.0 and code_ok and all(e <= tol for e in self.errs)


def check(op: str, impl: str, name: str, bits: int, args, shape=None) -> Check:
  """`impl`'s layer (``op``: "dense" or "conv") with `name`'s `bits`-bit code against XLA's, on
  :func:`exact_dense` / :func:`exact_conv` inputs `args` ``(x, w, b, g)``; `shape` labels it
  (default: x's and w's shapes)."""
  x, w, b, g = args
  dtype = np.dtype(x.dtype).name
  out = Check(op, impl, name, bits, shape or (tuple(x.shape), tuple(w.shape)), dtype)
  z = _preactivation(op, x, w, b)
  if not np.array_equal(z, np.asarray(z.astype(jnp.dtype(dtype)), np.float64)):
    raise ValueError(f"{op} {out.shape}: the pre-activation is not exact in {dtype}; smaller K")
  act = activation(name, bits)
  y_x, kept_x, grads_x = run_layer(op, "xla", act, x, w, b, g)
  try:
    y, kept, grads = run_layer(op, impl, act, x, w, b, g)
  except Exception as e:  # a kernel that fails to run is a failed check, said in the table
    out.error = f"{type(e).__name__}: {e}"
    return out
  code = rule(name, bits).code
  if len(kept) != 1 or kept[0].shape != kept_x[0].shape:
    out.error = f"kept {[k.shape for k in kept]}, XLA {[k.shape for k in kept_x]}"
    return out
  unpacked = (np.asarray(code.unpack(k[0], y.shape), np.int32) for k in (kept, kept_x))
  step = np.abs(np.subtract(*unpacked))
  out.code_diff, out.code_step, out.code_count = int(np.sum(step > 0)), int(step.max()), step.size
  yf, yx = np.asarray(y, np.float64), np.asarray(y_x, np.float64)
  eps, tiny = float(jnp.finfo(y.dtype).eps), float(jnp.finfo(y.dtype).tiny)
  out.y_diff = int(np.sum(yf != yx))
  out.y_ulps = float(np.max(np.abs(yf - yx) / (eps * np.maximum(np.abs(yx), tiny))))
  out.errs = tuple(_rel(a, r) for a, r in zip(grads, grads_x, strict=True))
  return out


# ------------------------------------------------------------------ the epilogue kernels alone


@dataclasses.dataclass(frozen=True)
class Pass:
  """One elementwise pass, as a Pallas kernel and as XLA's fusion, on arguments of `args`'s
  shapes; `bytes` and `xla_bytes`: what each reads and writes in device memory."""

  name: str
  kernel: Callable[..., Any]
  xla: Callable[..., Any]
  args: tuple[jax.ShapeDtypeStruct, ...]
  bytes: int
  xla_bytes: int


def _nbytes(tree) -> int:
  return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(tree))


def bytes_moved(fn: Callable[..., Any], args, extra: int = 0) -> int:
  """The bytes `fn` reads and writes once each: its arguments and results (abstractly evaluated),
  plus `extra` (what a kernel writes and reads back beside them)."""
  return _nbytes(args) + _nbytes(jax.eval_shape(fn, *args)) + extra


def db_partials_bytes(rows: int, c: int, dtype) -> int:
  """The float32 rows of per-program db sums ``bias_act_bwd`` writes at its default tiles, and its
  XLA reduction reads back."""
  from pallas_kernels import default_tiles

  t = default_tiles((rows, c), dtype)
  return 2 * -(-rows // (t.rows * t.steps)) * c * 4


def epilogue_passes(
  name: str, bits: int | None, rows: int, c: int, dtype=jnp.bfloat16, interpret: bool = False
) -> tuple[Pass, Pass]:
  """The conv epilogue's forward (``z, b -> y, kept``) and backward (``g, kept -> dz, db``)
  kernels (``pallas_kernels.bias_act_triton``, not in place) for `name`'s `bits`-bit code, and XLA's
  fusion of each: the kept residual is ``z + b`` in `dtype` (exact) or the packed code."""
  from pallas_kernels import bias_act_triton

  ep, r = code_epilogue(name, bits), rule(name, bits)
  spec, params = r.spec, dict(r.static_params)

  def fwd(z, b):
    return bias_act_triton.bias_act_fwd(z, b, epilogue=ep, in_place=False, interpret=interpret)

  def xla_fwd(z, b):
    v = z.astype(jnp.float32) + b.astype(jnp.float32)
    y = spec.fn(v, **params).astype(z.dtype)
    return y, (v.astype(z.dtype) if bits is None else activations.encode(r, v))

  def bwd(g, kept):
    return bias_act_triton.bias_act_bwd(
      g, kept, epilogue=ep, has_bias=True, in_place=False, interpret=interpret
    )

  def xla_bwd(g, kept):
    if bits is None:
      d = spec.derivative_from_input(kept.astype(jnp.float32), **params)
    else:
      d = r.code.unpack(kept, g.shape, lambda q: r.code.decode(q, jnp.float32))
    dz = g.astype(jnp.float32) * d
    return dz.astype(g.dtype), jnp.sum(dz, axis=0)

  z = jax.ShapeDtypeStruct((rows, c), dtype)
  b = jax.ShapeDtypeStruct((c,), dtype)
  kept = jax.ShapeDtypeStruct(ep.kept_shape((rows, c)), ep.kept_dtype(dtype))
  fa, ba = (z, b), (z, kept)
  return (
    Pass(f"fwd {label(bits)}", fwd, xla_fwd, fa, bytes_moved(fwd, fa), bytes_moved(xla_fwd, fa)),
    Pass(
      f"bwd {label(bits)}",
      bwd,
      xla_bwd,
      ba,
      bytes_moved(bwd, ba, db_partials_bytes(rows, c, dtype)),
      bytes_moved(xla_bwd, ba),
    ),
  )


def random_args(shapes, seed: int) -> list[jax.Array]:
  """Arguments of `shapes`: floats normal, uint8 uniform bytes (any code is a valid code)."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  out = []
  for k, s in zip(keys, shapes, strict=True):
    if s.dtype == jnp.uint8:
      out.append(jax.random.bits(k, s.shape, jnp.uint8))
    else:
      out.append(jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype))
  return out


# ------------------------------------------------------------------ the Hopper forward, layers


def hopper_forward(name: str, bits: int | None, num_sms: int, interpret: bool = False):
  """``(x, w, b) -> (y, kept)`` by the Mosaic GPU forward (``pallas_kernels.dense_mosaic``)."""
  from pallas_kernels.dense_mosaic import hopper_dense_bias_act_fwd

  ep = code_epilogue(name, bits)

  def f(x, w, b):
    return hopper_dense_bias_act_fwd(x, w, b, epilogue=ep, num_sms=num_sms, interpret=interpret)

  return f


def hopper_unsupported(name: str, bits: int | None, shape, dtype=jnp.bfloat16) -> str | None:
  from pallas_kernels.dense_mosaic import hopper_unsupported

  return hopper_unsupported(shape, dtype, dtype, code_epilogue(name, bits))


def layer_fn(op: str, name: str, bits: int | None, impl):
  """``(x, w, b) -> y`` of one fused layer (dense, or the 3x3 SAME convolution) through `impl`."""

  def f(x, w, b):
    return OPS[op](x, w, b, activation=activation(name, bits), implementation=impl)

  return f
