"""A run directory (MODEL_DIR): its lock and its run files. Its layout is `run_layout`'s."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import pathlib
import socket
import sys
import threading
import uuid
from typing import Any, Mapping, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmoral import checkpoints
from jaxmoral import fileio
from jaxmoral import integrity
from jaxmoral import run_layout
from jaxmoral.models.config import T5Config

logger = logging.getLogger(__name__)


def make_run_dir(model_dir: str | os.PathLike) -> str:
  """Creates a run directory (MODEL_DIR: a local path or gs://bucket/run) and returns it.

  Raises:
    OSError: Nothing can be written there: one line naming MODEL_DIR and the cause
      (`fileio.check_writable`), before any work starts.
  """
  model_dir = os.fspath(model_dir)
  checkpoints.require_checkpoint_storage(model_dir, "MODEL_DIR")
  fileio.check_writable(model_dir, directory=True, what="MODEL_DIR")
  fileio.makedirs(model_dir)
  return model_dir


def checkpoints_dir(model_dir: str | os.PathLike) -> str:
  """The CheckpointManager directory of a run directory (MODEL_DIR/checkpoints)."""
  return fileio.join(os.fspath(model_dir), run_layout.CHECKPOINTS_DIR)


def vocabulary_build_dir(model_dir: str | os.PathLike) -> str:
  """Where a run's vocabulary is built: MODEL_DIR/vocab, or for a bucket run the process's
  local folder for that run (SentencePiece writes local files; `save_run_files` copies the
  model into the bucket), never one shared by bucket runs trained on different data."""
  model_dir = os.fspath(model_dir)
  if fileio.is_url(model_dir):
    return fileio.local_folder_for(model_dir, "_vocab")
  return os.path.join(model_dir, run_layout.VOCAB_DIR)


def saved_steps(model_dir: str | os.PathLike) -> list[int]:
  """The steps of a run's checkpoint folders, ascending (none: []): where a run resumes."""
  return integrity.step_folders(checkpoints_dir(model_dir))


def save_vocabulary(directory: str | os.PathLike, vocabulary: Any) -> pathlib.Path:
  """Copies a SentencePiece vocabulary into `directory/vocab/` (model + extra ids)."""
  vocab_dir = fileio.path(directory) / run_layout.VOCAB_DIR
  vocab_dir.mkdir(parents=True, exist_ok=True)
  target = vocab_dir / run_layout.SPIECE_FILE
  source = vocabulary.sentencepiece_model_file
  if fileio.is_url(target) or pathlib.Path(source).resolve() != pathlib.Path(target).resolve():
    fileio.write_bytes(target, fileio.read_bytes(source))
  (vocab_dir / run_layout.EXTRA_IDS_FILE).write_text(str(vocabulary.extra_ids))
  return target


def save_run_files(model_dir: str | os.PathLike, *, config: T5Config, vocabulary: Any,
                   settings: Optional[Mapping[str, Any]] = None) -> None:
  """Writes the run files (`run_layout.RUN_FILES`) under the run's integrity manifest."""
  model_dir = fileio.path(model_dir)
  model_dir.mkdir(parents=True, exist_ok=True)
  # The old manifest would describe the files about to be replaced.
  (model_dir / integrity.INTEGRITY_FILE).unlink(missing_ok=True)
  (model_dir / run_layout.MODEL_CONFIG_FILE).write_text(config.to_json())
  save_vocabulary(model_dir, vocabulary)
  if settings:
    write_settings(model_dir, settings)
  # Recorded: a deleted manifest is refused, not loaded unverified.
  integrity.write_integrity_manifest(
      model_dir, [name for name in run_layout.RUN_FILES if (model_dir / name).exists()])
  integrity.record_checksummed(checkpoints_dir(model_dir), run_files=True)


def verify_run_files(model_dir: str | os.PathLike) -> bool:
  """Checks a run's files (`run_layout.RUN_FILES`) against its manifest before any of them is read.

  A run without the manifest loads with a warning only if it never wrote one
  (`integrity.run_files_checksummed`): then False is returned, else True.

  Raises:
    integrity.CheckpointIntegrityError: A file differs, is missing or the manifest is.
  """
  model_dir = fileio.abspath(model_dir)
  checksummed = integrity.run_files_checksummed(checkpoints_dir(model_dir))
  required = [name for name in run_layout.RUN_FILES
              if name != run_layout.VOCAB_DIR and fileio.exists(fileio.join(model_dir, name))]
  return integrity.verify_integrity(model_dir, what=f"{model_dir}: the run's files", full=True,
                                    required=required, unverified_ok=not checksummed)


def write_settings(directory: str | os.PathLike, settings: Mapping[str, Any]) -> None:
  (fileio.path(directory) / run_layout.SETTINGS_FILE).write_text(
      json.dumps(dict(settings), indent=2, sort_keys=True) + "\n")


def read_settings(directory: str | os.PathLike) -> dict[str, Any]:
  path = fileio.path(directory) / run_layout.SETTINGS_FILE
  return fileio.read_json(path) if path.is_file() else {}


# A holder refreshes its lock's time this often; a lock of another host left unrefreshed for
# LOCK_STALE_AFTER_S is stale (its pid cannot be checked from here: a preempted VM's job
# restarted elsewhere would otherwise be locked out for good).
LOCK_HEARTBEAT_S = 60.0
LOCK_STALE_AFTER_S = 900.0
# A bucket run whose storage has not answered the lock's heartbeat for this long stops
# (`_storage_lost`): its clients would retry its saves for ever. Well above brief outages.
STORAGE_DEADLINE_S = 240.0
_held_locks: dict[str, _HeldLock] = {}
_held_locks_guard = threading.Lock()


class RunDirLockedError(ValueError):
  """Another run holds MODEL_DIR's lock (a ValueError: the CLI prints it as one line)."""


def _storage_lost(model_dir: str, silent_s: float, error: Optional[BaseException]) -> None:
  """Ends the process from here: the run's storage is gone, and its threads are blocked in
  the storage clients' retries, which nothing can interrupt."""
  from jaxmoral import preemption  # pylint: disable=g-import-not-at-top
  step = checkpoints.committed_steps.get(fileio.abspath(checkpoints_dir(model_dir)))
  committed = (f"the last committed step is {step} (a rerun resumes from it)" if step is not None
               else "no step was committed")
  cause = f" ({fileio.describe_storage_error(error, model_dir)})" if error is not None else ""
  signum = preemption.pending_signal()
  if signum is not None:
    import signal  # pylint: disable=g-import-not-at-top
    status = preemption.EXIT_STATUS.get(signum, 128 + signum)
    line = (f"jaxmoral train: stopped by {signal.Signals(signum).name}: could not save to "
            f"{model_dir}: its storage has not answered for {silent_s:.0f} s{cause}; "
            f"{committed} (exit status {status})")
  else:
    status = 1
    line = (f"jaxmoral train: error: {model_dir}: its storage has not answered for "
            f"{silent_s:.0f} s{cause}; {committed}; stopping")
  print(line, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status)  # pylint: disable=protected-access


class _HeldLock:
  """A lock file this process holds, or (`owner` False) one process 0 holds for this job: its
  token, nesting depth and heartbeat. On a bucket the heartbeat also checks on every process
  that the storage answers (`STORAGE_DEADLINE_S`): a host blocked in the clients' retries
  never reaches the collective that would tell it process 0 ended, so it ends itself."""

  def __init__(self, path: str, token: str, *, owner: bool = True):
    self.path, self.token, self.owner, self.depth = path, token, owner, 1
    self.stop = threading.Event()
    self.answered = datetime.datetime.now().timestamp()
    self.error: Optional[BaseException] = None
    if owner or fileio.is_url(path):
      threading.Thread(target=self._beat, daemon=True, name="jaxmoral-lock-heartbeat").start()
    if fileio.is_url(path):
      threading.Thread(target=self._watch, daemon=True, name="jaxmoral-storage-watch").start()

  def _beat(self) -> None:
    while not self.stop.wait(LOCK_HEARTBEAT_S):
      try:
        if fileio.is_url(self.path):  # An object's time changes only when it is rewritten.
          content = fileio.read_bytes(self.path)  # Other hosts only read: the store answered.
          if self.owner and json.loads(content).get("token") == self.token:
            fileio.write_bytes(self.path, content)
        else:
          os.utime(self.path)  # Tells other hosts the holder is alive.
        self.answered, self.error = datetime.datetime.now().timestamp(), None
      except Exception as e:  # pylint: disable=broad-except
        self.error = e  # OSError, ValueError, or a storage client's own (aiohttp, google.auth).

  def _watch(self) -> None:
    while not self.stop.wait(min(5.0, STORAGE_DEADLINE_S / 4)):
      silent = datetime.datetime.now().timestamp() - self.answered
      if silent > STORAGE_DEADLINE_S and not self.stop.is_set():
        _storage_lost(self.path.rsplit("/", 1)[0], silent, self.error)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except PermissionError:  # Someone else's live process.
    return True
  except (ProcessLookupError, OverflowError, ValueError):
    return False
  return True


class RunDirLock:
  """`MODEL_DIR/train.lock`: one training run at a time in a run directory.

  The file (JSON: host, pid, start time) is created exclusively (`fileio.create_exclusive`),
  so of two runs starting together exactly one gets it. A lock whose holder is gone is taken
  over with a warning: same host and a dead pid (or this very pid, left by an earlier process,
  as in a restarted container), or another host's lock not refreshed for
  `LOCK_STALE_AFTER_S`. Re-entrant within a process (a run's setup and its loop both take it).
  Multi-host: process 0 takes it; all learn whether it did.

  On gs:// a holder's liveness is the object's update time (the heartbeat rewrites it); a
  stale lock is deleted only in the generation judged stale, so of two takers one deletes it,
  and a lock refreshed or retaken meanwhile is kept.
  """

  def __init__(self, model_dir: str | os.PathLike):
    self.path = fileio.join(fileio.abspath(model_dir), run_layout.LOCK_FILE)
    self._token = uuid.uuid4().hex
    self._depth = 0  # acquire() calls of this object not yet released.

  def _create(self) -> bool:
    content = {"host": socket.gethostname(), "pid": os.getpid(), "token": self._token,
               "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    return fileio.create_exclusive(self.path, json.dumps(content).encode())

  def _read(self) -> Optional[dict[str, Any]]:
    try:
      holder = json.loads(fileio.read_text(self.path))
      return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}

  @staticmethod
  def _describe(holder: Mapping[str, Any]) -> str:
    if not holder.get("host"):
      return "an unknown process (unreadable lock file)"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started "
            f"{holder.get('started', '?')}")

  def _stale_reason(self, holder: Mapping[str, Any]) -> Optional[str]:
    """Why the holder is gone, or None while it may be alive."""
    host, pid = holder.get("host"), holder.get("pid")
    if host == socket.gethostname() and isinstance(pid, int):
      if pid == os.getpid():
        return "this process's pid, left by an earlier process"  # Not held here (see acquire).
      return None if _pid_alive(pid) else f"pid {pid} is not running"
    try:
      age = datetime.datetime.now().timestamp() - fileio.getmtime(self.path)
    except OSError:
      return None
    return f"not refreshed for {age:.0f} s" if age > LOCK_STALE_AFTER_S else None

  def _take_over(self, holder: Mapping[str, Any]) -> bool:
    """Removes the stale lock `holder` read; False if someone else replaced it meanwhile."""
    if fileio.is_url(self.path):
      stale_generation = fileio.generation(self.path)
      if (self._read() or {}).get("token") != holder.get("token"):
        return False  # Refreshed or retaken since it was judged stale.
      try:
        fileio.remove(self.path, if_generation=stale_generation)
      except FileNotFoundError:
        return False  # Another taker was first, or the holder rewrote it: look again.
      return self._create()
    aside = f"{self.path}.stale.{self._token}"
    try:
      os.rename(self.path, aside)  # Atomic: of two takers, one gets the stale file.
    except FileNotFoundError:
      return self._create()
    try:
      now = json.loads(fileio.read_text(aside))
    except ValueError:
      now = {}
    if isinstance(now, dict) and now.get("token") != holder.get("token"):
      os.rename(aside, self.path)  # A fresh lock taken in between: give it back.
      return False
    os.remove(aside)
    return self._create()

  def _acquire_file(self) -> Optional[str]:
    """Takes the file; returns None, or the refusal message."""
    if os.path.isdir(self.path) or (os.path.lexists(self.path) and not os.path.isfile(self.path)):
      kind = "a folder" if os.path.isdir(self.path) else "not a regular file"
      return (f"{self.path}: the run's lock path is {kind}, not a lock file; move it away "
              "(no run removes it for you)")
    for _ in range(3):  # A lock released or replaced between our reads: look again.
      if self._create():
        return None
      holder = self._read()
      if holder is None:
        continue
      reason = self._stale_reason(holder)
      if reason is None:
        return (f"{os.path.dirname(self.path)} is in use by another training run "
                f"({self._describe(holder)}; lock {self.path}); wait for it to end, or delete "
                "the lock if that run is gone")
      logger.warning("taking over the stale lock %s of %s (%s)", self.path,
                     self._describe(holder), reason)
      if self._take_over(holder):
        return None
    return f"{self.path}: could not take the lock (it keeps changing); another run is starting"

  def acquire(self) -> RunDirLock:
    """Takes the lock (or raises `RunDirLockedError` naming the holder)."""
    error = None
    owner = jax.process_index() == 0
    with _held_locks_guard:
      held = _held_locks.get(self.path)
      if held is not None:  # This process holds it already (an outer call).
        held.depth += 1
      elif owner:
        error = self._acquire_file()
        if error is None:
          held = _held_locks[self.path] = _HeldLock(self.path, self._token)
    if jax.process_count() > 1:  # Every process refuses together; none waits in a collective.
      refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
      if refused and error is None:
        error = f"{os.path.dirname(self.path)} is in use by another training run (see process 0)"
    if error is not None:
      raise RunDirLockedError(error)
    if held is None:  # Process 0 holds the file: this process watches its own storage by it.
      with _held_locks_guard:
        held = _held_locks.get(self.path)
        if held is None:
          _held_locks[self.path] = _HeldLock(self.path, self._token, owner=False)
        else:
          held.depth += 1
    self._depth += 1
    return self

  def release(self) -> None:
    """Gives the lock back; the file goes when this process's outermost holder releases."""
    if not self._depth:
      return
    self._depth -= 1
    with _held_locks_guard:
      held = _held_locks.get(self.path)
      if held is None:
        return
      held.depth -= 1
      if held.depth:
        return
      del _held_locks[self.path]
      held.stop.set()
      if not held.owner:
        return
      holder = self._read()
      if holder and holder.get("token") == held.token:  # Never remove someone else's lock.
        with contextlib.suppress(FileNotFoundError):
          fileio.remove(self.path)

  def __enter__(self) -> RunDirLock:
    return self.acquire()

  def __exit__(self, *exc: Any) -> None:
    self.release()

