"""The static plan of one gated call: the activation, the dtypes, which projections and biases
there are, the dropout, the shardings and the backends; what every module of the family reads."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxact._src.activations.resolve import Act
from jaxact._src.core.dispatch import Decision
from jaxact._src.core.dropout import Dropout


@dataclasses.dataclass(frozen=True)
class GatedPlan:
  """Everything static about one gated call."""

  act: Act
  precision: Any
  acc_dtype: np.dtype  # accumulation and activation dtype
  out_dtype: np.dtype  # of a, b, h and y
  has_gate_bias: bool
  has_up_bias: bool
  has_down: bool  # gated_mlp (a down projection) or gated_dense
  has_down_bias: bool = False
  dropout: Dropout | None = None  # of h, before the down projection (gated_mlp only)
  decision: Decision = dataclasses.field(default_factory=Decision)
  # Explicit mesh axes: the output shardings of the two projections (a, b and h) and of the down
  # projection (jnp.dot's `out_sharding`, None where jax infers one); the specs x and h are
  # resharded to before their products (shardings.product_input; None: as they are); the specs
  # of the primal arguments, which their cotangents take.
  hidden_sharding: Any = None
  out_sharding: Any = None
  x_gather: Any = None
  h_gather: Any = None
  shardings: tuple = (None,) * 7
  # Rows (tokens) a block of the XLA backward (rules.backward_rows): its (tokens, hidden)
  # temporaries (h, gh, da, db) a block at a time; None: the whole array at once.
  backward_rows: int | None = None
  # What the op keeps between the passes: "projections" (x, a and b) or "input" (x alone: a and b
  # are recomputed in the backward pass, a block of rows at a time where it runs in blocks).
  residuals: str = "projections"
