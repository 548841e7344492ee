"""Progress lines for long loops outside the training loop (detection, sampling, scoring).

`salience: 120/834 (14 %) 2.05/s ETA 0:05:48`, so an hour of detection is not silent. The
training loop writes its own richer line (`train._progress_line`) with the same time format.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from typing import Optional

logger = logging.getLogger(__name__)


def format_seconds(seconds: float) -> str:
  """`H:MM:SS`, or "?" when unknown (no rate yet)."""
  if not math.isfinite(seconds):
    return "?"
  return str(datetime.timedelta(seconds=int(seconds)))


class ProgressLog:
  """Logs `label: done/total (pct) rate/s ETA` as work advances.

  At most one line every `every_s` seconds, and always the last one, unless the whole work
  took less than `min_total_s`: for a loop that is long only sometimes (a reward over 4,000
  questions, not over one PPO batch).
  """

  def __init__(self, label: str, total: int, *, every_s: float = 30.0,
               min_total_s: float = 0.0, log: Optional[logging.Logger] = None):
    if total < 0:
      raise ValueError(f"ProgressLog({label!r}): total must be >= 0, got {total}")
    self.label, self.total, self.every_s = label, int(total), float(every_s)
    self.min_total_s = float(min_total_s)
    self._log = log or logger
    self._start = self._last = time.monotonic()

  def update(self, done: int) -> Optional[str]:
    """Records that `done` units are finished; returns the line when one was logged."""
    now = time.monotonic()
    elapsed = now - self._start
    if elapsed < self.min_total_s or (done < self.total and now - self._last < self.every_s):
      return None
    self._last = now
    rate = done / elapsed if elapsed > 0 and done else float("nan")
    eta = (self.total - done) / rate if math.isfinite(rate) else float("nan")
    share = f" ({100 * done / self.total:.0f} %)" if self.total else ""
    line = f"{self.label}: {done}/{self.total}{share} {rate:.3g}/s ETA {format_seconds(eta)}"
    self._log.info(line)
    return line
