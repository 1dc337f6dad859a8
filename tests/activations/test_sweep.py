"""The bit-pattern sweep (support.sweep) at a size the suite can afford: the
parameter corners of issue 19 over every 65537th float32 bit pattern and every bfloat16 and float16
value. The full sweep (every float32 pattern, every activation): ``python -m benchmarks sweep``."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from support import sweep

import cases

_CASES = [(name, p) for name, p in sweep.CASES if p]  # the corners: b = 0, alpha < 0, slopes <= 0


@pytest.mark.sample(2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name, params", _CASES, ids=lambda v: str(v) if isinstance(v, dict) else v)
def test_no_nan_and_gradients_within_a_few_ulps(name, params, dtype):
  row = sweep.sweep(name, params, dtype, stride=65537 if dtype == "float32" else 1)
  assert row.inputs > 60000
  assert row.nan == 0 and row.nonfinite_grad == 0, row
  # celu with alpha < 0 grows like exp(x / alpha): rounding x costs |x / alpha| ulps there.
  ill = 100.0 if name == "celu" and dtype == "float32" else 1.0
  assert row.grad_ulps <= ill * cases.GRAD_ULPS[getattr(jnp, dtype)], row
  # ... and near finfo.max its alpha * expm1(x / alpha) overflows early (docs/numerics.md).
  assert row.value_ulps <= (math.inf if ill > 1 else 4.0), row
