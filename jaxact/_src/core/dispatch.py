"""The decision machinery every op family shares: the target (a GPU or a TPU), a call's
:class:`Decision`, the
:class:`Rule` rows of ``implementation=None``, and the docs' table of them.

One procedure decides every call (:func:`decide`); each family's ``rules.py``
(``jaxact/_src/<family>/rules.py``) declares a :class:`Family`: its implementations with the
predicates that rule a backend out, its table of ``implementation=None`` rules, the facts they
read and how its sharding plan is derived. Every family's table is generated into the one dispatch
table of the docs (:func:`rules_table`, :mod:`jaxact._src.docs`).

The kernels (``pallas_kernels``) take tiles and an epilogue and know nothing of devices: the target
(a GPU or a TPU) is looked up here, once (:func:`target`). Rules that rest on a measurement cite the
page of ``benchmarks/results/`` and the section that decided them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import numpy as np
from jax import Array

Backend = Literal["xla", "triton", "mosaic", "cudnn", "splash"]
Implementation = Literal["xla", "pallas", "mosaic"]  # the public ops' `implementation=`
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
_KERNEL_DTYPES = ("float32", "bfloat16", "float16")
_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


# ----------------------------------------------------------------------------------- target


@dataclasses.dataclass(frozen=True)
class Target:
  """The GPU or TPU a program is being built for, as far as the trace can tell.

  Attributes:
    cuda: the trace is known to be for CUDA (an abstract mesh of CUDA devices, or a GPU default
      backend).
    device_kind: the abstract mesh's device kind, else the first CUDA (TPU) device's, else None.
    num_sms: streaming multiprocessors of that device, when known.
    compute_capability: the lowest of this process's CUDA devices, None without one.
    tpu: the trace is known to be for a TPU (an abstract mesh of TPU devices, or a TPU default
      backend).
  """

  cuda: bool = False
  device_kind: str | None = None
  num_sms: int | None = None
  compute_capability: float | None = None
  tpu: bool = False

  @property
  def accelerator(self) -> bool:
    """A GPU or a TPU: memory far from its cores, where the XLA paths take larger blocks than on
    a CPU."""
    return self.cuda or self.tpu

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
  """The lowering target: the abstract mesh's device when it is a CUDA or TPU one, else the
  devices of this process's default backend when it is a TPU, else the CUDA devices it sees."""
  device = getattr(context_mesh(), "abstract_device", None)
  if device is not None and device.platform in ("cuda", "gpu"):
    return Target(True, device.device_kind, getattr(device, "num_cores", None) or None)
  if device is not None and device.platform == "tpu":
    return Target(device_kind=device.device_kind, tpu=True)
  if device is None and jax.default_backend() == "tpu":
    return Target(device_kind=jax.devices()[0].device_kind, tpu=True)
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


def kernels_unsupported(plan, x: Array, *operands: Array, acc=None) -> str | None:
  """What no Triton kernel takes: the activation, dtypes and sizes of a call (its plan's ``act``,
  ``dropout`` and dtypes, its operands `x` and the others; `acc` the accumulation dtype where the
  plan does not name it ``acc_dtype``)."""
  acc = np.dtype(plan.acc_dtype if acc is None else acc)
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
  if acc != np.float32:
    return f"accumulation in {acc.name} (the kernels accumulate in float32)"
  if any(0 in a.shape for a in (x, *operands)):
    return "zero-size operands"
  return None


def unlowered(name: str, epilogue) -> str | None:
  """Why Pallas Triton cannot run activation `name`'s kernel epilogue (a
  :class:`pallas_kernels.Epilogue`): the primitives its function or derivative computes that
  Triton does not lower; None where it lowers them all."""
  from pallas_kernels import unlowered_primitives

  z = jax.ShapeDtypeStruct((), np.float32)
  parts = [f for f in (epilogue.fn, epilogue.derivative) if f is not None]
  missing = sorted({p for f in parts for p in unlowered_primitives(f, z)})
  if missing:
    return (
      f"the activation {name} computes {', '.join(missing)}, which Pallas Triton does not lower"
    )
  return None


# -------------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class Decision:
  """The backends of one call, and the sharding plan they run in.

  Attributes:
    forward, backward: what runs when the program is lowered for the kernels' platform (CUDA;
      a TPU for ``"splash"``).
    forced: the kernels were asked for by name: they run on every platform (interpret mode off
      theirs). Otherwise kernels run only when lowered for their platform and XLA runs elsewhere.
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


@dataclasses.dataclass(frozen=True)
class Backends:
  """One value of a family's ``implementation=``: the backends it runs and why they cannot run a
  call, or, where the family has no such kernel, what to use instead.

  Attributes:
    forward, backward: the backends run when asked for by name.
    unsupported: ``(call, sharding) -> str | None``: why these backends cannot run `call` in its
      sharding plan (``NotImplementedError`` when asked for by name), None when they can.
    instead: the implementations the error suggests instead (``None`` always ends the list).
    missing: the family has no kernel of this name: the ``NotImplementedError``'s reason.
  """

  forward: Backend = "xla"
  backward: Backend = "xla"
  unsupported: Callable[[Any, Any], str | None] | None = None
  instead: tuple[str, ...] = ("xla",)
  missing: str | None = None


@dataclasses.dataclass(frozen=True)
class Family:
  """What an op family declares to :func:`decide`: data and predicates, no procedure.

  Attributes:
    implementations: every value its ``implementation=`` takes besides None ("xla" first).
    rules: its ``implementation=None`` rows, tried in order (the docs' dispatch table lists them).
    declined: ``(call, sharding) -> str | None``: why no kernel can run `call` under None (XLA
      then, silently), before the rules are read.
    facts: ``(call, sharding) -> object``: what the rules' predicates read.
    sharding: ``call -> plan``: the call's sharding plan, derived once; the predicates read it and
      the kernels run in it.
    xla_sharded: the XLA path runs in the plan too (the LM head's loop): every decision carries
      ``place(plan)``, ``implementation="xla"`` included. Otherwise only kernel decisions carry it.
    place: the plan as decisions carry it (may raise for a plan no backend can run).
  """

  implementations: dict[str, Backends]
  rules: tuple[Rule, ...]
  declined: Callable[[Any, Any], str | None] | None = None
  facts: Callable[[Any, Any], Any] = lambda call, sharding: None
  sharding: Callable[[Any], Any] | None = None
  xla_sharded: bool = False
  place: Callable[[Any], Any] = lambda sharding: sharding


def check_implementation(fn_name: str, implementation, names=IMPLEMENTATIONS) -> None:
  """Raise ``ValueError`` unless `implementation` is None or one of `names`."""
  if implementation is not None and (
    not isinstance(implementation, str) or implementation not in names
  ):
    raise ValueError(
      f"jaxact.{fn_name}: `implementation` {implementation!r} is not known; choose one of: "
      f"None (best available), {', '.join(repr(i) for i in names)}"
    )


def decide(family: Family, fn_name: str, implementation: str | None, call: Any) -> Decision:
  """The backends of one call of `family`'s op `fn_name`, for every family alike.

  1. ``implementation`` is checked against the family's names (``ValueError``).
  2. A name runs its backends on every platform (interpret mode off theirs), or raises
     ``NotImplementedError`` with the reason where they cannot run the call (or do not exist).
  3. ``None``: XLA with the reason where :attr:`Family.declined` says no kernel can run the call,
     else the first of the family's rules that holds. Kernels chosen there run only where the
     program is lowered for their platform (CUDA; TPU for splash attention); lowered for anything
     else the call is XLA's (:mod:`jaxact._src.core.platform`).

  The sharding plan is derived once, here, and travels with the decision (:class:`Family`)."""
  names = tuple(family.implementations)
  check_implementation(fn_name, implementation, names)
  if implementation == "xla" and not family.xla_sharded:
    return Decision()
  sharding = None if family.sharding is None else family.sharding(call)
  if implementation is None:
    why = None if family.declined is None else family.declined(call, sharding)
    decision = auto(why, family.rules, lambda: family.facts(call, sharding))
  else:
    impl = family.implementations[implementation]
    if impl.missing is not None:
      raise NotImplementedError(
        f"jaxact.{fn_name}: implementation={implementation!r} {impl.missing}"
      )
    why = None if impl.unsupported is None else impl.unsupported(call, sharding)
    if why is not None:
      instead = ", ".join(repr(n) for n in impl.instead)
      raise NotImplementedError(
        f"jaxact.{fn_name}: implementation={implementation!r} does not support this call: "
        f"{why}; use implementation={instead} or None"
      )
    forced = implementation != "xla"
    decision = Decision(
      impl.forward, impl.backward, forced, target=target() if forced else Target()
    )
  kernels = not decision.forward == decision.backward == "xla"
  if family.xla_sharded or kernels:
    decision = dataclasses.replace(decision, sharding=family.place(sharding))
  return decision


def auto(why: str | None, rules, facts: Callable[[], Any]) -> Decision:
  """``implementation=None``: XLA with the reason when the kernels cannot run the call (`why`),
  else the first of `rules` that holds for the call's facts (built only then)."""
  if why is not None:
    return Decision(declined=why)
  found = facts()
  rule = next(r for r in rules if r.applies(found))
  if rule.forward == rule.backward == "xla":
    return Decision(declined=rule.why)
  return Decision(rule.forward, rule.backward, target=found.target)


def rules_table(*tables: tuple[Rule, ...]) -> str:
  """The `tables` (each family's ``implementation=None`` rules, in order) as one Markdown table (the
  docs' dispatch page), each rule's evidence a link to its section (the heading's anchor, as
  mkdocs and GitHub spell it)."""
  rows = [
    "| where (`implementation=None`) | forward | backward | why | measured in |",
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
