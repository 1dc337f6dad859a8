"""One progress bar over a job's measurements, and the seconds each of its sections took."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
  """One tqdm bar (stderr) over every measurement, and the seconds each section took: wall and
  process CPU (all of XLA's threads; on a shared machine the steadier of the two)."""

  def __init__(self, total: int):
    self.bar = tqdm(total=total, file=sys.stderr, unit="measurement", dynamic_ncols=True)
    self.seconds: dict[str, tuple[float, float]] = {}
    self.current: str | None = None
    self.start = (time.perf_counter(), time.process_time())

  def section(self, name: str | None) -> None:
    now = (time.perf_counter(), time.process_time())
    if self.current is not None:
      self.seconds[self.current] = (now[0] - self.start[0], now[1] - self.start[1])
    self.current, self.start = name, now
    if name is not None:
      self.bar.set_description(name)

  def step(self, label: str) -> None:
    self.bar.set_postfix_str(label, refresh=False)
    self.bar.update()

  def close(self) -> dict[str, tuple[float, float]]:
    self.section(None)
    self.bar.close()
    return self.seconds
