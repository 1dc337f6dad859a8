"""The decision machinery every op family shares: the target GPU, a call's :class:`Decision`, the
:class:`Rule` rows of ``implementation=None``, and the docs' table of them.

Each family decides its own calls in its ``rules.py`` (``jaxact/_src/<family>/rules.py``): the
support checks of its kernels, its table of ``implementation=None`` rules and its ``decide``, which
returns a :class:`Decision` built here. Every family's table is generated into the one dispatch
table of the docs (:func:`rules_table`, :mod:`jaxact._src.docs`), so the rules stay one decision
point whatever folder they live in.

The kernels (``pallas_kernels``) take tiles and an epilogue and know nothing of devices: the target
GPU is looked up here, once (:func:`target`). Rules that rest on a measurement cite the page of
``benchmarks/results/`` and the section that decided them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import numpy as np
from jax import Array

Backend = Literal["xla", "triton", "mosaic", "cudnn"]
Implementation = Literal["xla", "pallas", "mosaic"]  # the public ops' `implementation=`
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
_KERNEL_DTYPES = ("float32", "bfloat16", "float16")
_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


# ----------------------------------------------------------------------------------- target


@dataclasses.dataclass(frozen=True)
class Target:
  """The GPU a program is being built for, as far as the trace can tell.

  Attributes:
    cuda: the trace is known to be for CUDA (an abstract mesh of CUDA devices, or a GPU default
      backend).
    device_kind: the abstract mesh's device kind, else the first CUDA device's, else None.
    num_sms: streaming multiprocessors of that device, when known.
    compute_capability: the lowest of this process's CUDA devices, None without one.
  """

  cuda: bool = False
  device_kind: str | None = None
  num_sms: int | None = None
  compute_capability: float | None = None

  @property
  def hopper(self) -> bool:
    """A Hopper GPU (compute capability 9.x: wgmma, TMA, 228 KiB of shared memory)."""
    return self.device_kind is not None and any(k in self.device_kind for k in _HOPPER_KINDS)

  @property
  def sms(self) -> int:
    """SMs to launch one persistent CTA on each: an H100 SXM's 132 where the trace does not say."""
    return self.num_sms or 132

  @property
  def ampere_or_newer(self) -> bool:
    """The Triton kernels' requirement; a trace without a CUDA device (abstract devices) is
    trusted to target Ampere or newer."""
    return self.compute_capability is None or self.compute_capability >= 8.0


def context_mesh():
  """The mesh of the current ``jax.set_mesh`` / ``use_abstract_mesh`` context (an empty one
  without): the lowering target's device, and what a ``PartitionSpec`` ``out_sharding`` names."""
  return jax.sharding.get_abstract_mesh()


def target() -> Target:
  """The lowering target: the abstract mesh's device when it is a CUDA one, else the CUDA devices
  this process sees."""
  device = getattr(context_mesh(), "abstract_device", None)
  if device is not None and device.platform in ("cuda", "gpu"):
    return Target(True, device.device_kind, getattr(device, "num_cores", None) or None)
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    devices = []
  cuda = device is None and jax.default_backend() == "gpu"
  if not devices:
    return Target(cuda)
  capability = min(float(getattr(d, "compute_capability", "8.0")) for d in devices)
  sms = getattr(devices[0], "core_count", None)
  return Target(cuda, devices[0].device_kind, sms, capability)


# ---------------------------------------------------------------------------------- support


def kernels_unsupported(plan, x: Array, w: Array) -> str | None:
  """What no Triton kernel takes: the activation, dtypes and sizes of a fused or gated call (its
  plan's ``act``, ``dropout`` and dtypes, its operands `x` and `w`)."""
  if getattr(plan, "dropout", None) is not None:
    return "dropout inside the op (the kernels draw no masks; XLA's path applies it)"
  rule = plan.act.rule
  if rule is None:
    return "the activation is a plain callable, not a jaxact spec activation"
  if rule.dynamic_names:
    return f"activation parameters given as arrays ({', '.join(rule.dynamic_names)})"
  for name, dtype in (("x", x.dtype), ("output", plan.out_dtype)):
    if np.dtype(dtype).name not in _KERNEL_DTYPES:
      return f"{name} dtype {np.dtype(dtype).name} (supported: {', '.join(_KERNEL_DTYPES)})"
  if np.dtype(plan.acc_dtype) != np.float32:
    return f"accumulation in {np.dtype(plan.acc_dtype).name} (the kernels accumulate in float32)"
  if 0 in x.shape or 0 in w.shape:
    return "zero-size operands"
  return None


# -------------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class Decision:
  """The backends of one call, and the sharding plan they run in.

  Attributes:
    forward, backward: what runs when the program is lowered for CUDA.
    forced: the kernels were asked for by name: they run on every platform (interpret mode off
      CUDA). Otherwise kernels run only when lowered for CUDA and XLA runs elsewhere.
    declined: why ``implementation=None`` took XLA where it could have taken a kernel, or None.
    target: the lowering target the kernels are tiled for.
    sharding: the call's sharding plan, derived once from the operands' types where the backend
      is decided and handed down with it: the per-shard pattern its kernels (the LM head's XLA
      loop too) run in (a :class:`~jaxact._src.core.pallas_sharding.DensePattern`), None where
      they run on the arrays as they are.
  """

  forward: Backend = "xla"
  backward: Backend = "xla"
  forced: bool = False
  declined: str | None = None
  target: Target = Target()  # for the kernels' tiles and grid
  sharding: Any = None


@dataclasses.dataclass(frozen=True)
class Rule:
  """One row of a family's ``implementation=None`` table: where it applies, what it picks, and on
  what evidence."""

  where: str
  applies: Callable[[Any], bool]  # of the facts its family's decide gathers about one call
  forward: Backend
  backward: Backend
  why: str
  # What decided a measured rule: "results/<page>.md: <section heading>" under benchmarks/.
  evidence: str | None = None


def check_implementation(fn_name: str, implementation) -> None:
  """Raise ``ValueError`` unless `implementation` is None or one of :data:`IMPLEMENTATIONS`."""
  if implementation is not None and (
    not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `implementation` {implementation!r} is not known; choose one of: "
      f"None (best available), {', '.join(repr(i) for i in IMPLEMENTATIONS)}"
    )


def auto(why: str | None, rules, facts: Callable[[], Any], sharding: Any = None) -> Decision:
  """``implementation=None``: XLA with the reason when the kernels cannot run the call (`why`),
  else the first of `rules` that holds for the call's facts (built only then); kernels chosen run
  in the call's `sharding` plan."""
  if why is not None:
    return Decision(declined=why)
  found = facts()
  rule = next(r for r in rules if r.applies(found))
  if rule.forward == rule.backward == "xla":
    return Decision(declined=rule.why)
  return Decision(rule.forward, rule.backward, target=found.target, sharding=sharding)


def rules_table(*tables: tuple[Rule, ...]) -> str:
  """The `tables` (each family's ``implementation=None`` rules, in order) as one Markdown table (the
  docs' dispatch page), each rule's evidence a link to its section (the heading's anchor, as
  mkdocs and GitHub spell it)."""
  rows = [
    "| where (`implementation=None`, lowered for CUDA) | forward | backward | why | measured in |",
    "|---|---|---|---|---|",
  ]
  for r in (r for t in tables for r in t):
    evidence = ""
    if r.evidence:
      page, section = r.evidence.split(": ", 1)
      anchor = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", section).strip().lower())
      evidence = f"[{r.evidence}](benchmarks/{page}#{anchor})"
    rows.append(f"| {r.where} | {r.forward} | {r.backward} | {r.why} | {evidence} |")
  return "\n".join(rows) + "\n"
