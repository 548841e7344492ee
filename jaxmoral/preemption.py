"""Stop requests by signal: a single-process `train` saves at the next step boundary and stops.

SIGTERM (what a scheduler, Kubernetes or Cloud TPU sends before maintenance or a spot
preemption) and SIGINT (Ctrl-C) set a flag that the training loop reads after each step: it
saves that step, releases MODEL_DIR's lock and raises `Stopped`, which the command line prints
as one line before exiting with `EXIT_STATUS` (128 + the signal's number, as a shell reports
it). Running the same command again resumes. A second signal acts as without this module.

A multi-process job leaves SIGTERM to JAX's preemption service (`jax.distributed`), which all
processes consult at the same step (Orbax's `reached_preemption`), so every host saves the
same step; a flag of one process alone could not be agreed on.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Optional

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STATUS: dict[int, int] = {signum: 128 + signum for signum in SIGNALS}


class Stopped(Exception):
  """Training stopped at signal `signum` after saving `step` (not an error: rerun to resume);
  the command line exits with `exit_status`."""

  def __init__(self, signum: int, *, step: int, where: str):
    self.signum, self.step = signum, step
    self.exit_status = EXIT_STATUS.get(signum, 128 + signum)
    super().__init__(f"stopped by {signal.Signals(signum).name}: saved step {step} to {where}; "
                     f"run the same command again to resume (exit status {self.exit_status})")


_active: list[StopRequests] = []  # The innermost `with StopRequests()` last.


def pending_signal() -> Optional[int]:
  """The stop signal received in the innermost active `StopRequests`, or None."""
  return _active[-1].signum if _active else None


def requested() -> bool:
  """Whether a stop was requested (the training loop asks at each step boundary)."""
  return pending_signal() is not None


class StopRequests:
  """Within `with`: SIGTERM and SIGINT are stop requests (`signum`) instead of ending the
  process. Installed only in one-process jobs and in the main thread (signal handlers can be
  set nowhere else); otherwise it does nothing."""

  def __init__(self) -> None:
    self.signum: Optional[int] = None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
    del frame
    if self.signum is None:
      self.signum = signum
      # The next signal does what it did before: a user who must stop now still can.
      for number, handler in self._previous.items():
        signal.signal(number, handler)
      self._previous = {}
      logger.warning("%s received: saving at the end of this step, then stopping (send it "
                     "again to stop at once, unsaved)", signal.Signals(signum).name)

  def __enter__(self) -> StopRequests:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for number in SIGNALS:
        self._previous[number] = signal.signal(number, self._handle)
    _active.append(self)
    return self

  def __exit__(self, *exc: Any) -> None:
    if self in _active:
      _active.remove(self)
    for number, handler in self._previous.items():
      signal.signal(number, handler)
    self._previous = {}
