"""The static plan of one MoE call: the activation, the dtypes, the routing's sizes; what every
module of the family reads."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from jaxact._src.activations.resolve import Act
from jaxact._src.core.dispatch import Decision

Score = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True)
class MoEPlan:
  """Everything static about one :func:`jaxact.moe_mlp` call."""

  act: Act
  precision: Any
  acc_dtype: np.dtype  # router logits, activation and accumulation dtype
  out_dtype: np.dtype  # of the kept a, b and of y
  tokens: int  # T: the input's rows, its leading dimensions flattened
  experts: int  # E
  top_k: int  # k: the experts each token goes to
  score: Score = "softmax"
  normalize_top_k: bool = True
  capacity: int | None = (
    None  # per expert (and sequence, with capacity_per_sequence); None: dropless
  )
  capacity_per_sequence: bool = False  # each sequence's tokens queue for their own capacity
  expert_groups: int = 1  # the experts split into this many equal groups (DeepSeek-V3's n_group)
  top_k_groups: int = 1  # the best groups a token may draw its experts from (its topk_group)
  balance_loss: str = "switch"  # or "deepseek_v3": the sequence-wise L_Bal
  sequences: int = 1  # the sequences in the tokens: x's leading dimensions but the last
  decision: Decision = dataclasses.field(default_factory=Decision)  # the grouped products'
