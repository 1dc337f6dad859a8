"""What :func:`jaxact.linen.intercept` and :func:`jaxact.nnx.swap` took and what they left."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Call:
  """One call (or, for nnx, one module instance) seen.

  Attributes:
    where: the module's path in the model (``"Block_0/Dense_1"``), or ``""`` for a function.
    what: what the model wrote (``"flax.linen.Dense"``, ``"jax.nn.gelu"``).
    ran: what ran instead (``"jaxact.dense_bias_act(gelu)"``), or None where Flax's or jax's own
      code ran.
    why: for a call left to Flax or jax, the reason; empty for one taken.
  """

  where: str
  what: str
  ran: str | None
  why: str = ""

  @property
  def taken(self) -> bool:
    return self.ran is not None


@dataclasses.dataclass
class Report:
  """Every call seen, in order (a call traced twice, e.g. by ``init`` then ``apply``, twice)."""

  calls: list[Call] = dataclasses.field(default_factory=list)

  def add(self, where: str, what: str, ran: str | None, why: str = "") -> None:
    self.calls.append(Call(where, what, ran, why))

  @property
  def taken(self) -> list[Call]:
    return [c for c in self.calls if c.taken]

  @property
  def left(self) -> list[Call]:
    return [c for c in self.calls if not c.taken]

  def summary(self) -> dict[tuple[str, str | None, str], int]:
    """``(what, ran, why)`` to how many calls, in first-seen order."""
    return dict(collections.Counter((c.what, c.ran, c.why) for c in self.calls))

  def __str__(self) -> str:
    if not self.calls:
      return "no call of a Flax module or activation was seen"
    lines = [f"{len(self.taken)} taken, {len(self.left)} left"]
    for (what, ran, why), n in self.summary().items():
      lines.append(f"  {n:4d} x {what} -> {ran}" if ran else f"  {n:4d} x {what} left: {why}")
    return "\n".join(lines)
