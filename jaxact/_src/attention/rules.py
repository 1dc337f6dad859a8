"""Which backend runs an attention call: the attention rows of the one decision point.

``implementation="xla"`` is the blocked ``custom_vjp`` (:mod:`jaxact._src.attention.xla`) on every
platform; ``"cudnn"`` hands the call to ``jax.nn.dot_product_attention(implementation="cudnn")``
(cuDNN's fused kernels, which keep O and their statistics too) and raises ``NotImplementedError``
for what cuDNN cannot run; ``"pallas"`` and ``"mosaic"`` name GPU kernels that do not exist yet and
raise. ``None`` takes the first row of :data:`ATTENTION_AUTO_RULES` that holds.
"""

from __future__ import annotations

import numpy as np
from jax import Array

from jaxact._src.attention import kernels
from jaxact._src.core.dispatch import Decision, Rule, auto, target

IMPLEMENTATIONS = ("xla", "cudnn", "pallas", "mosaic")

# implementation=None's rows (the docs' dispatch table lists them with the other ops').
ATTENTION_AUTO_RULES: tuple[Rule, ...] = (
  Rule(
    "`dot_product_attention`: every target",
    lambda f: True,
    "xla",
    "xla",
    "the blocked XLA path keeps q, k, v, O and two numbers a row on every platform and runs "
    "every option; cuDNN (bf16/fp16, no soft cap) is not measured against it on a GPU yet",
  ),
)


def check_implementation(fn_name: str, implementation) -> None:
  """``ValueError`` unless `implementation` is None or one of :data:`IMPLEMENTATIONS`."""
  if implementation is not None and (
    not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `implementation` {implementation!r} is not known; choose one of: "
      f"None (best available), {', '.join(repr(i) for i in IMPLEMENTATIONS)}"
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


def decide(fn_name: str, implementation: str | None, plan, q, k, v, bias, aux) -> Decision:
  """The backends of one attention call (see the module docstring)."""
  check_implementation(fn_name, implementation)
  match implementation:
    case "xla":
      return Decision()
    case "cudnn":
      why = cudnn_unsupported(plan, q, aux)
      if why is not None:
        raise NotImplementedError(
          f"jaxact.{fn_name}: implementation='cudnn' does not support this call: {why}; use "
          "implementation='xla' or None"
        )
      return Decision("cudnn", "cudnn", forced=True)
    case "pallas":
      why = kernels.triton_unsupported(plan, q, k, v, bias, aux)
      if why is not None:
        raise NotImplementedError(
          f"jaxact.{fn_name}: implementation='pallas' does not support this call: {why}; use "
          "implementation='xla' or None"
        )
      return Decision("triton", "triton", forced=True, target=target())
    case "mosaic":
      raise NotImplementedError(
        f"jaxact.{fn_name}: implementation='mosaic': jaxact has no Mosaic GPU (Hopper) attention "
        "kernel yet; use implementation='pallas' (Triton, which Hopper runs), 'xla', 'cudnn' or "
        "None"
      )
    case _:  # None
      return auto(None, ATTENTION_AUTO_RULES, lambda: None)
