"""Which backend runs an attention call: the attention rows of the one decision point.

``implementation="xla"`` is the blocked ``custom_vjp`` (:mod:`jaxact._src.attention.xla`) on every
platform; ``"cudnn"`` hands the call to ``jax.nn.dot_product_attention(implementation="cudnn")``
(cuDNN's fused kernels, which keep O and their statistics too) and raises ``NotImplementedError``
for what cuDNN cannot run; ``"pallas"`` runs the Triton kernels (:mod:`.kernels`), raising for what
they cannot run; ``"splash"`` runs jax's splash attention kernels (Mosaic TPU, :mod:`.kernels`),
raising for what they cannot run; ``"mosaic"`` raises: there is no Hopper attention kernel yet.
``None`` takes the first row of :data:`ATTENTION_AUTO_RULES` that holds: splash attention where the
program is lowered for a TPU and splash takes the call, XLA everywhere else.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax import Array

from jaxact._src.attention import kernels
from jaxact._src.attention.plan import Call
from jaxact._src.core import dispatch
from jaxact._src.core.dispatch import Backends, Decision, Family, Rule, Target
from jaxact._src.core.dispatch import check_implementation as dispatch_check
from jaxact._src.core.dispatch import decide as dispatch_decide


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the rules read about one call: its lowering target."""

  target: Target


def declined(call: Call, sharding) -> str | None:
  """Why ``None`` cannot take a kernel for this call: on a TPU target, why splash attention
  cannot run it; elsewhere the rules say."""
  return kernels.splash_unsupported(*call) if dispatch.target().tpu else None


# implementation=None's rows (the docs' dispatch table lists them with the other ops').
ATTENTION_AUTO_RULES: tuple[Rule, ...] = (
  Rule(
    "`dot_product_attention`: TPU target, a call splash attention takes (a causal mask or none, "
    "soft cap, GQA; T and S multiples of 128; float32, bfloat16)",
    lambda f: f.target.tpu,
    "splash",
    "splash",
    "compiled for a TPU v5p (bf16, causal, B 4 x T 2048, 16 / 4 heads of 128, with and without a "
    "soft cap), the blocked XLA path's step is estimated 3.4x splash attention's: XLA writes each "
    "block's logits and probabilities to HBM, splash keeps them on chip; wrapped in jaxact's "
    "custom_vjp it keeps the same q, k, v, O and one number a row",
    "results/tpu.md: Attention step: splash attention against XLA's",
  ),
  Rule(
    "`dot_product_attention`: every other target",
    lambda f: True,
    "xla",
    "xla",
    "the blocked XLA path keeps q, k, v, O and two numbers a row on every platform and runs "
    "every option; cuDNN (bf16/fp16, no soft cap) is not measured against it on a GPU yet",
  ),
)


def cudnn_unsupported(plan, q: Array, aux) -> str | None:
  """Why ``jax.nn.dot_product_attention(implementation="cudnn")`` cannot take this call, or None
  (what jaxact knows before cuDNN is asked; cuDNN may still refuse a head size)."""
  if plan.soft_cap is not None:
    return "`logits_soft_cap` (cuDNN has no soft cap)"
  if plan.dropout is not None:
    return "dropout (jax.nn's cuDNN path takes none)"
  if aux.q_segments is not None:
    return "segment ids (jax.nn takes none)"
  if np.dtype(q.dtype).name not in ("bfloat16", "float16"):
    return f"dtype {np.dtype(q.dtype).name} (cuDNN's fused attention takes bfloat16 and float16)"
  if plan.window is not None and plan.window[1] != 0 and not plan.causal:
    return f"local_window_size={plan.window} (cuDNN takes a left window only, or a causal one)"
  if plan.precision is not None:
    return f"precision={plan.precision!r}"
  return None


FAMILY = Family(
  implementations={
    "xla": Backends(),
    "cudnn": Backends("cudnn", "cudnn", lambda c, s: cudnn_unsupported(c.plan, c.q, c.aux)),
    "pallas": Backends("triton", "triton", lambda c, s: kernels.triton_unsupported(*c)),
    "splash": Backends(
      "splash", "splash", lambda c, s: kernels.splash_unsupported(*c), instead=("xla", "pallas")
    ),
    "mosaic": Backends(
      missing="has no kernel: jaxact has no Mosaic GPU (Hopper) attention kernel yet; use "
      "implementation='pallas' (Triton, which Hopper runs), 'xla', 'cudnn' or None"
    ),
  },
  rules=ATTENTION_AUTO_RULES,
  declined=declined,
  facts=lambda call, sharding: Facts(dispatch.target()),
)
IMPLEMENTATIONS = tuple(FAMILY.implementations)


def check_implementation(fn_name: str, implementation) -> None:
  """``ValueError`` unless `implementation` is None or one of :data:`IMPLEMENTATIONS`."""
  dispatch_check(fn_name, implementation, IMPLEMENTATIONS)


def decide(fn_name: str, implementation: str | None, call: Call) -> Decision:
  """The backends of one attention call (:func:`jaxact._src.core.dispatch.decide` of
  :data:`FAMILY`; see the module docstring)."""
  return dispatch_decide(FAMILY, fn_name, implementation, call)
