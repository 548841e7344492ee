"""Orbax checkpoints: the training-run manager, params-only export, restore onto any mesh.

On-disk layouts (orbax-checkpoint 0.12):

Training run (`CheckpointManager`)::

  <directory>/<step>/state/   the whole state pytree (PyTreeCheckpointHandler, OCDBT/Zarr);
                              e.g. a flax TrainState: step, params, opt_state (static fields
                              such as `apply_fn`/`tx` are not saved; they come from `target`)
  <directory>/<step>/extra/   a JSON dict (reward normalisation, data position, ...)

The state is one item so a save is one atomic step; `restore_params_from_run` reads only the
`params` subtree of it (orbax partial restore driven by the saved metadata), so fine-tuning from
another run does not need to know that run's optimizer.

Exported params (`export_params`)::

  <directory>/params/         the unboxed parameter tree (PyTreeCheckpointHandler)
  <directory>/config.json     optional model config dict (e.g. `T5Config.to_dict()`)

Every restore takes the target shardings from the caller, so a checkpoint written from one mesh
restores onto any other (orbax reads each shard's slice from the stored global arrays).

Integrity: every step (and every export) carries `_INTEGRITY.json`, the size and sha256 of each
of its files, written once Orbax has finalised the files (temp name, then rename). Every
restore, export and load checks it before reading any array, so a damaged or incomplete
checkpoint is a `CheckpointIntegrityError` naming the step and the file, never NaN parameters
or a TensorStore traceback. `<directory>/_CHECKSUMMED.json`, written before the first save,
records that every later step carries a manifest: a step without one (still being finalised,
or its manifest deleted) is never loaded, and readers take the newest finalised step. Only
checkpoints written before manifests existed load without one, with a warning. A full disk
while saving is one OSError naming the directory and the last complete step.

A training run holds `MODEL_DIR/train.lock` (`RunDirLock`) while it runs, so two runs never
write into one folder.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import threading
import uuid
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import Sharding

from jaxmoral import fileio
from jaxmoral import validation

PyTree = Any
STATE_ITEM = "state"
EXTRA_ITEM = "extra"
PARAMS_DIR = "params"
CONFIG_FILE = "config.json"


# -- integrity ----------------------------------------------------------------------------------
INTEGRITY_FILE = "_INTEGRITY.json"
_HASH_CHUNK = 1 << 20  # Streamed: a file is never read into memory whole.
_HASH_THREADS = 8  # hashlib releases the GIL on large buffers: files hash in parallel.
logger = logging.getLogger(__name__)
_warned_unverified: set[str] = set()


class CheckpointIntegrityError(ValueError):
  """A checkpoint is damaged or incomplete; nothing of it was loaded.

  A ValueError, so the CLI prints it as one line.

  Attributes:
    step: The damaged step (None for an export).
    files: The damaged or missing files, relative to the step (or export) directory.
  """

  def __init__(self, message: str, *, step: Optional[int] = None,
               files: Sequence[str] = ()):
    super().__init__(message)
    self.step = step
    self.files = tuple(files)


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with fileio.open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _hash_all(root: str, relative: Sequence[str]) -> dict[str, str]:
  if len(relative) <= 1:
    return {rel: _sha256(fileio.join(root, rel)) for rel in relative}
  with concurrent.futures.ThreadPoolExecutor(min(_HASH_THREADS, len(relative))) as pool:
    digests = pool.map(lambda rel: _sha256(fileio.join(root, rel)), relative)
    return dict(zip(relative, digests, strict=True))


def _files_of(root: str, entries: Iterable[str]) -> list[str]:
  """Files (relative '/'-joined paths, sorted) of `entries` (files or folders) under root."""
  out = []
  for entry in entries:
    path = fileio.join(root, entry)
    if fileio.isfile(path):
      out.append(entry)
      continue
    out.extend(f"{entry.rstrip('/')}/{rel}" for rel in fileio.walk_files(path))
  return sorted(rel for rel in out if rel != INTEGRITY_FILE)


def write_integrity_manifest(root: str | os.PathLike, entries: Optional[Iterable[str]] = None
                             ) -> str:
  """Writes `root/_INTEGRITY.json`: size and sha256 of every file under `root` (or `entries`).

  Written whole (a local temporary file renamed over; one object upload on a store), so a
  manifest is complete or absent.

  Args:
    root: A finished checkpoint step or export directory.
    entries: Files or folders (relative to `root`) to cover; default: everything in `root`.

  Returns:
    The manifest's path.
  """
  root = os.fspath(root)
  relative = _files_of(root, sorted(fileio.listdir(root)) if entries is None else entries)
  digests = _hash_all(root, relative)
  manifest = {"version": 1, "algorithm": "sha256",
              "files": {rel: {"size": fileio.getsize(fileio.join(root, rel)),
                              "sha256": digests[rel]} for rel in relative}}
  path = fileio.join(root, INTEGRITY_FILE)
  fileio.write_text(path, json.dumps(manifest, indent=1, sort_keys=True), durable=True)
  return path


# Digests already compared in this process, by (directory, manifest digest): {file: version}
# of the files that matched, so a step verified once (every page of the explorer, an eval's
# repeated loads) is hashed again only when a file was rewritten since.
_verified: dict[tuple[str, str], dict[str, Any]] = {}
_verified_guard = threading.Lock()


def _refuse_entries_outside(root: str, files: Mapping[str, Any], *, what: str,
                            step: Optional[int]) -> None:
  """Refuses a manifest that names anything outside its folder: an absolute path or URL, a
  `..` component, or (locally) a link out of the folder. Otherwise verifying it would report
  the size and digest of any file the reader can open."""
  real_root = None if fileio.is_url(root) else os.path.realpath(root)
  for rel in files:
    parts = str(rel).replace("\\", "/").split("/")
    outside = (not isinstance(rel, str) or not rel or rel.startswith(("/", "\\"))
               or "://" in rel or os.path.isabs(rel) or ".." in parts)
    if not outside and real_root is not None:
      resolved = os.path.realpath(os.path.join(root, rel))
      outside = os.path.commonpath([real_root, resolved]) != real_root
    if outside:
      raise CheckpointIntegrityError(
          f"{what} is damaged: its {INTEGRITY_FILE} names {str(rel)[:200]!r}, which is outside "
          "its folder (an absolute path, '..' or a link out of it); nothing was read",
          step=step, files=[INTEGRITY_FILE])


def _listing(files: Sequence[str]) -> str:
  shown = ", ".join(files[:3])
  return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def verify_integrity(root: str | os.PathLike, *, what: str, full: bool | Sequence[str] = True,
                     step: Optional[int] = None, required: Sequence[str] = (),
                     shared: bool = False, unverified_ok: bool = True) -> bool:
  """Checks a checkpoint directory against its `_INTEGRITY.json` before anything is read.

  Args:
    root: A checkpoint step or export directory.
    what: How messages name it (e.g. "/run/checkpoints: checkpoint step 7").
    full: Also compare sha256 digests (streamed); False checks presence and sizes only (for
      metadata reads, which touch no array data); a sequence of files or folders (relative
      to `root`) compares the digests of those only (the small files a metadata read parses).
    step: The step, for the error's attribute.
    required: Files that must exist even without a manifest (older checkpoints).
    shared: Every process of a multi-process job calls this for the same files (a
      collective): each hashes its share of them and all learn every share's result, so a
      pod restore reads each file once, not once per host.
    unverified_ok: Whether a missing manifest means "written before manifests existed"
      (loaded with a warning); False where the writer is known to write one (a step of a run
      that records it checksums every step), so a missing manifest is a step still being
      finalised or a deleted manifest: refused.

  Returns:
    True if verified against a manifest; False if there is none (a checkpoint written before
    manifests existed: a warning is logged, once per directory).

  Raises:
    CheckpointIntegrityError: A file is missing, has another size, or another digest.
  """
  root = os.fspath(root)
  if shared and jax.process_count() > 1:
    # Every process must take the same path into the gathering below: none may look before
    # process 0 has finished writing a manifest it saved a moment ago (it joins its writer
    # before verifying), or one would find no manifest and skip the collective.
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices("jaxmoral_verify_integrity")
  missing_required = [rel for rel in required if not fileio.isfile(fileio.join(root, rel))]
  if missing_required:
    raise CheckpointIntegrityError(f"{what} is incomplete (missing {_listing(missing_required)})"
                                   "; nothing was loaded", step=step, files=missing_required)
  path = fileio.join(root, INTEGRITY_FILE)
  if not fileio.isfile(path):
    if not unverified_ok:
      raise CheckpointIntegrityError(
          f"{what} has no {INTEGRITY_FILE} although its writer checksums everything it writes "
          "(still being written, or the manifest was deleted); nothing was loaded", step=step,
          files=[INTEGRITY_FILE])
    if root not in _warned_unverified:
      _warned_unverified.add(root)
      logger.warning("%s has no %s (saved before checkpoints carried checksums, or killed "
                     "before it was written): loading it unverified", what, INTEGRITY_FILE)
    return False
  try:
    manifest_bytes = fileio.read_bytes(path)
    files = json.loads(manifest_bytes)["files"]
    saved_sizes = {rel: int(entry["size"]) for rel, entry in files.items()}
    saved_digests = {rel: str(entry["sha256"]) for rel, entry in files.items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointIntegrityError(f"{what} is damaged: its {INTEGRITY_FILE} is unreadable "
                                   f"({type(e).__name__}); nothing was loaded", step=step,
                                   files=[INTEGRITY_FILE]) from None
  _refuse_entries_outside(root, files, what=what, step=step)
  uncovered = [rel for rel in required if rel not in files]
  if uncovered:  # An emptied or edited manifest would otherwise vouch for nothing.
    raise CheckpointIntegrityError(f"{what} is damaged: its {INTEGRITY_FILE} does not cover "
                                   f"{_listing(uncovered)}; nothing was loaded", step=step,
                                   files=[INTEGRITY_FILE])
  # A bucket: one listing, not a request per file.
  versions = fileio.file_versions(root, files)
  present = {rel: size for rel, (size, _) in versions.items()}
  missing = [rel for rel in sorted(files) if rel not in present]
  if missing:
    raise CheckpointIntegrityError(f"{what} is incomplete (missing {_listing(missing)}); "
                                   "nothing was loaded", step=step, files=missing)
  sizes = {rel: present[rel] for rel in sorted(files)}
  resized = [(rel, sizes[rel], saved_sizes[rel]) for rel in sizes
             if sizes[rel] != saved_sizes[rel]]
  if resized:
    rel, size, saved = resized[0]
    more = f" (and {len(resized) - 1} more files)" if len(resized) > 1 else ""
    raise CheckpointIntegrityError(
        f"{what} is damaged: {rel} is {size} bytes, {saved} when saved (truncated or "
        f"overwritten){more}; nothing was loaded", step=step, files=[r[0] for r in resized])
  if full:
    hashed = sorted(files) if full is True else [
        rel for rel in sorted(files)
        if any(rel == entry or rel.startswith(entry.rstrip("/") + "/") for entry in full)]
    collective = shared and jax.process_count() > 1  # Every process must hash its share.
    key = (root, hashlib.sha256(manifest_bytes).hexdigest())
    with _verified_guard:
      known = dict(_verified.get(key, {})) if not collective else {}
    hashed = [rel for rel in hashed if known.get(rel) != versions[rel]]
    changed, unreadable = _compare_digests(root, hashed, saved_digests, shared=shared)
    if not changed and not unreadable and not collective:
      with _verified_guard:
        _verified.setdefault(key, {}).update({rel: versions[rel] for rel in hashed})
    if unreadable:
      rel, reason = unreadable
      raise CheckpointIntegrityError(f"{what} is damaged: {rel} cannot be read ({reason})"
                                     "; nothing was loaded", step=step, files=[rel])
    if changed:
      more = f" (and {len(changed) - 1} more files)" if len(changed) > 1 else ""
      raise CheckpointIntegrityError(
          f"{what} is damaged: {changed[0]} differs from its checksum at save time{more}; "
          "nothing was loaded", step=step, files=changed)
  return True


def _compare_digests(root: str, hashed: Sequence[str], saved: Mapping[str, str], *,
                     shared: bool) -> tuple[list[str], Optional[tuple[str, str]]]:
  """(files whose digest differs, (first unreadable file, why) or None).

  With `shared` in a multi-process job, process i hashes files i, i + n, ... and the
  per-file verdicts are gathered from all processes (every process must call this).
  """
  count = jax.process_count() if shared else 1
  mine = list(hashed)[jax.process_index()::count] if count > 1 else list(hashed)
  changed, unreadable = [], None
  try:
    digests = _hash_all(root, mine)
    changed = [rel for rel in mine if digests[rel] != saved[rel]]
  except OSError as e:  # Gone or unreadable while being read.
    unreadable = (os.path.relpath(e.filename or root, root).replace(os.sep, "/"),
                  e.strerror or type(e).__name__)
  if count == 1:
    return changed, unreadable
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  index = {rel: k for k, rel in enumerate(hashed)}
  verdict = np.zeros(len(hashed) + 1, np.int32)  # 1: differs, 2: unreadable; last: unknown
  for rel in changed:
    verdict[index[rel]] = 1
  if unreadable:
    verdict[index.get(unreadable[0], len(hashed))] = 2
  everywhere = np.asarray(multihost_utils.process_allgather(verdict)).reshape(
      count, -1).max(axis=0)
  changed = [hashed[int(k)] for k in np.flatnonzero(everywhere[:-1] == 1)]
  if unreadable is None and (everywhere == 2).any():
    k = int(np.flatnonzero(everywhere == 2)[0])
    unreadable = (hashed[k] if k < len(hashed) else "a file", "unreadable on another process")
  return changed, unreadable


def _state_required() -> tuple[str, ...]:
  """What a step needs whatever wrote it: the state's tree metadata (Orbax lists a step
  whose _METADATA is gone, and then finds 'no params' in it)."""
  return (f"{STATE_ITEM}/_METADATA",)


# In a `CheckpointManager` directory: written before its first save, it records that every
# step saved from then on carries a manifest (and which older steps do not), so a step whose
# manifest is missing is refused, not loaded unverified.
CHECKSUMMED_FILE = "_CHECKSUMMED.json"


def _checksummed_record(directory: str | os.PathLike) -> Optional[dict[str, Any]]:
  path = fileio.join(os.fspath(directory), CHECKSUMMED_FILE)
  try:
    record = json.loads(fileio.read_text(path))
    record["unverified_steps"] = {int(step) for step in record["unverified_steps"]}
    record["run_files"] = bool(record.get("run_files", False))
    return record
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointIntegrityError(f"{path} is unreadable ({type(e).__name__}); nothing was "
                                   "loaded", files=[CHECKSUMMED_FILE]) from None


def unverified_steps(directory: str | os.PathLike) -> Optional[set[int]]:
  """Steps of a checkpoint directory that may load without a manifest: None (all of them)
  for a directory written before manifests existed, else those its record lists."""
  record = _checksummed_record(directory)
  return None if record is None else record["unverified_steps"]


def run_files_checksummed(directory: str | os.PathLike) -> bool:
  """Whether the run whose checkpoint directory this is wrote a manifest of its own files
  (`record_checksummed(run_files=True)`), which then may not go missing."""
  record = _checksummed_record(directory)
  return record is not None and record["run_files"]


def _write_json_atomically(path: str, value: Any) -> None:
  fileio.write_text(path, json.dumps(value, indent=1, sort_keys=True), durable=True)


def record_checksummed(directory: str | os.PathLike, *, run_files: bool = False) -> None:
  """Writes `CHECKSUMMED_FILE` into a checkpoint directory unless it has one: steps saved from
  now on carry manifests; the steps already there without one stay loadable (with a warning).

  Args:
    directory: A `CheckpointManager` directory (MODEL_DIR/checkpoints of a run).
    run_files: Also record that the run's own files have a manifest from now on.
  """
  directory = os.fspath(directory)
  record = _checksummed_record(directory)
  if record is not None and (record["run_files"] or not run_files):
    return
  if record is None:
    fileio.makedirs(directory)
    older = [step for step in _step_folders(directory)
             if not fileio.isfile(fileio.join(directory, str(step), INTEGRITY_FILE))]
  else:
    older = sorted(record["unverified_steps"])
  _write_json_atomically(fileio.join(directory, CHECKSUMMED_FILE),
                         {"version": 1, "unverified_steps": older, "run_files": run_files})


def _step_folders(directory: str) -> list[int]:
  try:
    names = fileio.listdir(directory)
  except OSError:
    return []
  return sorted(int(name) for name in names if name.isdigit())


def is_finalised(directory: str | os.PathLike, step: int) -> bool:
  """Whether a step is complete for readers: its manifest is written (the last thing a save
  writes), or it is a step saved before manifests existed."""
  directory = os.fspath(directory)
  if fileio.isfile(fileio.join(directory, str(int(step)), INTEGRITY_FILE)):
    return True
  allowed = unverified_steps(directory)
  return allowed is None or int(step) in allowed


def verify_step(directory: str | os.PathLike, step: int, *, full: bool = True,
                shared: bool = False) -> bool:
  """`verify_integrity` of `directory/<step>` (a `CheckpointManager` directory's step)."""
  directory = os.fspath(directory)
  allowed = unverified_steps(directory)
  return verify_integrity(fileio.join(directory, str(int(step))),
                          what=f"{directory}: checkpoint step {int(step)}", full=full,
                          step=int(step), required=_state_required(), shared=shared,
                          unverified_ok=allowed is None or int(step) in allowed)


_DISK_FULL = {errno.ENOSPC: ("No space left on device", "os_error_code='28'"),
              errno.EFBIG: ("File too large", "os_error_code='27'"),
              errno.EDQUOT: ("Disk quota exceeded", "os_error_code='122'")}


def _drop_closed_loop_callbacks() -> None:
  """Silences the late completions of an aborted save's writes.

  When one write of a step fails (a full disk), Orbax closes that save's event loop while
  TensorStore's other writes are still in flight; each one's completion then finds the loop
  closed and is reported as an unraisable "Event loop is closed" traceback, dozens per save,
  before the failure itself reaches the caller. The failure is raised and reported anyway, so
  exactly those reports are dropped, from the first manager on; every other unraisable still
  reaches the hook that was installed before.
  """
  previous = sys.unraisablehook
  if getattr(previous, "drops_closed_loop_callbacks", False):
    return

  def hook(unraisable: Any) -> None:
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
      previous(unraisable)

  hook.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook


class _DropUnretrievedDiskFullTasks(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" reports of a full disk.

  The other writer tasks of an aborted save fail with the same full disk; nothing awaits them
  once the first failure has aborted the save, and asyncio logs each one, traceback included,
  when it is garbage-collected (at any later time, or at exit, after the one-line error). The
  failure itself is raised and reported once (`CheckpointManager._disk_full_is_one_line`);
  every other asyncio report still goes through.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith("Task exception was never retrieved")
                and error is not None and disk_full_errno(error) is not None)


def _drop_unretrieved_disk_full_tasks() -> None:
  """Installs `_DropUnretrievedDiskFullTasks` on asyncio's logger once."""
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropUnretrievedDiskFullTasks) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_DropUnretrievedDiskFullTasks())


def disk_full_errno(error: BaseException) -> Optional[int]:
  """ENOSPC, EFBIG or EDQUOT where `error` (or what it wraps: TensorStore's messages, Orbax's
  thread errors) is a full disk, a file size limit or a quota; else None."""
  seen = 0
  while error is not None and seen < 16:
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
      return error.errno
    text = str(error)
    for code, markers in _DISK_FULL.items():
      if any(marker in text for marker in markers):
        return code
    error = error.__cause__ or error.__context__
    seen += 1
  return None


def _item_handlers() -> dict[str, Any]:
  return {STATE_ITEM: ocp.PyTreeCheckpointHandler(), EXTRA_ITEM: ocp.JsonCheckpointHandler()}


def _to_json(value: Any, where: str) -> Any:
  """JSON-ready copy of `value` (numpy/jax scalars and arrays become numbers and lists)."""
  if isinstance(value, Mapping):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise TypeError(f"extra{where}: JSON keys must be str, got {key!r}")
      out[key] = _to_json(item, f"{where}[{key!r}]")
    return out
  if isinstance(value, (list, tuple)):
    return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(value).tolist()
  raise TypeError(f"extra{where}: {type(value).__name__} is not JSON-serialisable")


def _restore_args(target: PyTree) -> PyTree:
  return ocp.checkpoint_utils.construct_restore_args(target)


RUN_CHECKPOINTS_SUBDIR = "checkpoints"


# Where Orbax (TensorStore's OCDBT layout) reads and writes checkpoints: local or mounted
# folders and gs:// (its S3 driver is not wired into OCDBT checkpoints). jaxmoral's own files
# may also be on s3:// (`fileio`); its checkpoints, exports and runs may not.
ORBAX_SCHEMES = (None, "gs")


def require_checkpoint_storage(location: str | os.PathLike, what: str) -> None:
  """Raises a one-line ValueError, before any work, when Orbax cannot keep checkpoints at
  `location` (`what` names it: "MODEL_DIR", "export --output", ...)."""
  kind = fileio.scheme(location)
  if kind not in ORBAX_SCHEMES:
    raise ValueError(
        f"{what} {os.fspath(location)}: Orbax {ocp.__version__} keeps checkpoints in local or "
        f"mounted folders and on gs:// only, not on {kind}://; put the run or export there (data "
        f"files, Hugging Face folders and reports may stay on {kind}://)")


def make_run_dir(model_dir: str | os.PathLike) -> str:
  """Creates a run directory (MODEL_DIR: a local path or gs://bucket/run) and returns it.

  Raises:
    OSError: Nothing can be written there, in one line naming MODEL_DIR and the cause (for a
      bucket URL: no bucket, no permission, no credentials or an unreachable endpoint), told
      before any work starts.
  """
  model_dir = os.fspath(model_dir)
  require_checkpoint_storage(model_dir, "MODEL_DIR")
  fileio.check_writable(model_dir, directory=True, what="MODEL_DIR")
  fileio.makedirs(model_dir)
  return model_dir


def run_checkpoints_dir(model_dir: str | os.PathLike) -> str:
  """The CheckpointManager directory of a run directory (MODEL_DIR/checkpoints)."""
  return fileio.join(os.fspath(model_dir), RUN_CHECKPOINTS_SUBDIR)


def saved_steps(model_dir: str | os.PathLike) -> list[int]:
  """The steps a run directory has checkpoint folders of, ascending ([] for none), without
  opening a CheckpointManager: whether a run would resume, and from where."""
  return _step_folders(run_checkpoints_dir(model_dir))


# -- run directory lock -------------------------------------------------------------------------
LOCK_FILE = "train.lock"
# A holder refreshes its lock's time this often; a lock of another host left unrefreshed for
# LOCK_STALE_AFTER_S is stale (its pid cannot be checked from here: a preempted VM's job
# restarted elsewhere would otherwise be locked out for good).
LOCK_HEARTBEAT_S = 60.0
LOCK_STALE_AFTER_S = 900.0
_held_locks: dict[str, _HeldLock] = {}
_held_locks_guard = threading.Lock()


class RunDirLockedError(ValueError):
  """Another run holds MODEL_DIR's lock (a ValueError: the CLI prints it as one line)."""


# A run in a bucket whose storage has not answered the lock's heartbeat for this long stops
# (one line naming the bucket and the last committed step): its saves cannot complete, and
# the storage clients would retry them for ever. Well above a store's brief outages.
STORAGE_DEADLINE_S = 240.0
# The last step each checkpoint directory committed in this process (saved and manifested,
# or restored): what a run that cannot reach its storage any more can be resumed from.
_committed: dict[str, int] = {}


def _storage_lost(model_dir: str, silent_s: float, error: Optional[BaseException]) -> None:
  """Ends the process: the run's storage is gone. Its threads are blocked in the storage
  clients' retries, which nothing can interrupt, so the process exits from here."""
  from jaxmoral import preemption  # pylint: disable=g-import-not-at-top
  step = _committed.get(fileio.abspath(run_checkpoints_dir(model_dir)))
  committed = (f"the last committed step is {step} (a rerun resumes from it)" if step is not None
               else "no step was committed")
  cause = f" ({fileio.describe_storage_error(error, model_dir)})" if error is not None else ""
  signum = preemption.pending_signal()
  if signum is not None:
    import signal  # pylint: disable=g-import-not-at-top
    name = signal.Signals(signum).name
    status = preemption.EXIT_STATUS.get(signum, 128 + signum)
    line = (f"jaxmoral train: stopped by {name}: could not save to {model_dir}: its storage "
            f"has not answered for {silent_s:.0f} s{cause}; {committed} (exit status {status})")
  else:
    status = 1
    line = (f"jaxmoral train: error: {model_dir}: its storage has not answered for "
            f"{silent_s:.0f} s{cause}; {committed}; stopping")
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(status)  # pylint: disable=protected-access


class _HeldLock:
  """A lock file this process holds: its token, nesting depth and heartbeat (on a bucket
  also the run's liveness check of its storage: `STORAGE_DEADLINE_S`)."""

  def __init__(self, path: str, token: str):
    self.path, self.token, self.depth = path, token, 1
    self.stop = threading.Event()
    self.answered = datetime.datetime.now().timestamp()
    self.error: Optional[BaseException] = None
    threading.Thread(target=self._beat, daemon=True, name="jaxmoral-lock-heartbeat").start()
    if fileio.is_url(path):
      threading.Thread(target=self._watch, daemon=True, name="jaxmoral-storage-watch").start()

  def _beat(self) -> None:
    while not self.stop.wait(LOCK_HEARTBEAT_S):
      try:
        if fileio.is_url(self.path):  # An object's time changes only when it is rewritten.
          content = fileio.read_bytes(self.path)
          if json.loads(content).get("token") == self.token:
            fileio.write_bytes(self.path, content)
        else:
          os.utime(self.path)  # Tells other hosts the holder is alive.
        self.answered, self.error = datetime.datetime.now().timestamp(), None
      except (OSError, ValueError, AttributeError) as e:
        self.error = e
      except Exception as e:  # pylint: disable=broad-except
        self.error = e  # A storage client's own error type (aiohttp, google.auth).

  def _watch(self) -> None:
    while not self.stop.wait(min(5.0, STORAGE_DEADLINE_S / 4)):
      silent = datetime.datetime.now().timestamp() - self.answered
      if silent > STORAGE_DEADLINE_S and not self.stop.is_set():
        _storage_lost(self.path.rsplit("/", 1)[0], silent, self.error)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Someone else's live process.
    return True
  except (OverflowError, ValueError):
    return False
  return True


class RunDirLock:
  """`MODEL_DIR/train.lock`: one training run at a time in a run directory.

  The file (JSON: host, pid, start time) is created with O_CREAT | O_EXCL (on gs://, an
  upload with the precondition ifGenerationMatch=0), so of two runs starting together exactly
  one gets it. A lock whose holder is gone is taken over with a
  warning: same host and a dead pid (or this very pid, left by an earlier process that had it,
  as in a restarted container), or another host's lock not refreshed for
  `LOCK_STALE_AFTER_S`. Re-entrant within a process (a run's setup and its loop may both take
  it). Multi-host: only process 0 takes it; all processes learn whether it got it.

  On gs:// a holder's liveness is the object's update time (the heartbeat rewrites it); a
  stale lock is deleted with the precondition ifGenerationMatch=<the generation judged
  stale>, so of two takers only one deletes it, and a lock refreshed or retaken meanwhile is
  kept; the taker then creates its own lock as above. (A run directory is never on s3://:
  `require_checkpoint_storage`.)

  Use as a context manager, or `acquire()` / `release()`.
  """

  def __init__(self, model_dir: str | os.PathLike):
    self.path = fileio.join(fileio.abspath(model_dir), LOCK_FILE)
    self._token = uuid.uuid4().hex
    self._depth = 0  # acquire() calls of this object not yet released.

  def _content(self) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "token": self._token,
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}

  def _create(self) -> bool:
    return fileio.create_exclusive(self.path, json.dumps(self._content()).encode())

  def _read(self) -> Optional[dict[str, Any]]:
    try:
      with fileio.open(self.path) as f:
        holder = json.load(f)
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
      if not _pid_alive(pid):
        return f"pid {pid} is not running"
      return None
    try:
      age = datetime.datetime.now().timestamp() - fileio.getmtime(self.path)
    except OSError:
      return None
    if age > LOCK_STALE_AFTER_S:
      return f"not refreshed for {age:.0f} s"
    return None

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
    with open(aside) as f:
      text = f.read()
    try:
      now = json.loads(text)
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
    if jax.process_index() == 0:
      with _held_locks_guard:
        held = _held_locks.get(self.path)
        if held is not None:  # This process holds it already (an outer call).
          held.depth += 1
        else:
          error = self._acquire_file()
          if error is None:
            held = _HeldLock(self.path, self._token)
            _held_locks[self.path] = held
    if jax.process_count() > 1:  # Every process refuses together; none waits in a collective.
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
      if refused and error is None:
        error = f"{os.path.dirname(self.path)} is in use by another training run (see process 0)"
    if error is not None:
      raise RunDirLockedError(error)
    self._depth += 1
    return self

  def release(self) -> None:
    """Gives the lock back; the file goes when this process's outermost holder releases."""
    if not self._depth:
      return
    self._depth -= 1
    if jax.process_index() != 0:
      return
    with _held_locks_guard:
      held = _held_locks.get(self.path)
      if held is None:
        return
      held.depth -= 1
      if held.depth:
        return
      del _held_locks[self.path]
      held.stop.set()
      holder = self._read()
      if holder and holder.get("token") == held.token:  # Never remove someone else's lock.
        try:
          fileio.remove(self.path)
        except FileNotFoundError:
          pass

  def __enter__(self) -> RunDirLock:
    return self.acquire()

  def __exit__(self, *exc: Any) -> None:
    self.release()


@gin.configurable(module="checkpoints")
class CheckpointManager:
  """Saves and restores a training state (any pytree) plus a JSON `extra` dict.

  Args:
    directory: Run directory; step checkpoints go in `<directory>/<step>/`.
    save_interval_steps: `save` writes only when `step % save_interval_steps == 0`, on
      `force`, or when the job is being preempted (orbax's preemption signal).
    max_to_keep: Newest checkpoints kept; older ones are deleted (None keeps all).
    async_save: Write in a background thread (`save` returns once arrays are copied off the
      device); call `wait()` (or `close()`) before reading the files or exiting.
  """

  def __init__(self, directory: str | os.PathLike, *, save_interval_steps: int = 1000,
               max_to_keep: Optional[int] = 3, async_save: bool = True):
    validation.positive_int(save_interval_steps, "CheckpointManager: save_interval_steps")
    if max_to_keep is not None:
      validation.positive_int(max_to_keep, "CheckpointManager: max_to_keep (or None)")
    require_checkpoint_storage(directory, "checkpoint directory")
    self.directory = fileio.abspath(directory)
    # Explicit policy: orbax's default also saves the first step offered, whatever it is.
    policy = ocp.checkpoint_managers.AnySavePolicy([
        ocp.checkpoint_managers.FixedIntervalPolicy(save_interval_steps),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
    ])
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
        save_decision_policy=policy)
    _drop_closed_loop_callbacks()
    _drop_unretrieved_disk_full_tasks()
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=_item_handlers())
    # The integrity manifest of the latest save is written once Orbax has finalised the step:
    # in this thread (sync saves) or in `_manifest_thread` (async saves).
    self._manifest_thread: Optional[threading.Thread] = None
    self._recorded = False
    self._pending_step: Optional[int] = None  # The step an async save may still be writing.

  @contextlib.contextmanager
  def _disk_full_is_one_line(self):
    """A full disk (or file size limit) while saving is an OSError naming the folder and the
    last complete step, whatever Orbax's threads wrapped it in; the partial step goes."""
    try:
      yield
    except Exception as error:  # pylint: disable=broad-except
      code = disk_full_errno(error)
      if code is None:
        raise
      step = self._pending_step
      # Orbax's other writers of that step may still be running (the error came from one of
      # its threads): they stop first, or they would write into the folder removed below.
      with contextlib.suppress(Exception):
        self._manager.wait_until_finished()
      if jax.process_index() == 0 and step is not None:
        for name in os.listdir(self.directory):  # Orbax's temporary folder of that step.
          if name.startswith(f"{step}.orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      complete = [s for s in self.all_steps() if is_finalised(self.directory, s)]
      raise OSError(code, os.strerror(code), (
          f"{self.directory} (step {step} was not saved; the last complete checkpoint is "
          f"{complete[-1] if complete else 'none'}; free space and run again to resume)")
      ) from None

  def save(self, step: int, state: PyTree, *, extra: Optional[Mapping[str, Any]] = None,
           force: bool = False) -> bool:
    """Saves `state` (and `extra`) at `step` when the interval (or `force`) says so.

    Args:
      step: Training step (the checkpoint's name).
      state: Any pytree of arrays (unboxed), e.g. a flax TrainState.
      extra: JSON-serialisable dict saved alongside (numpy/jax scalars and arrays allowed).
      force: Save even off the interval.

    Returns:
      True if a checkpoint was (or is being, with async) written; False if skipped
      (off-interval, or `step` already saved).
    """
    step = int(step)
    if step in self._manager.all_steps():
      logging.info("checkpoint step %d already in %s; not saving again", step, self.directory)
      return False
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeSave(state),
        EXTRA_ITEM: ocp.args.JsonSave(_to_json(dict(extra or {}), "")),
    })
    # Orbax waits for the previous save anyway; its manifest must be on disk before this
    # save's finalisation may delete old steps (max_to_keep).
    self._join_manifest()
    if jax.process_index() == 0 and not self._recorded:
      record_checksummed(self.directory)  # Before the step: a reader must never trust its absence.
      self._recorded = True
    with self._disk_full_is_one_line():
      saved = bool(self._manager.save(step, args=args, force=force))
    if saved:
      self._pending_step = step
    if saved:
      if self._manager.is_saving_in_progress():
        self._manifest_thread = threading.Thread(
            target=self._manifest_after_finalize, args=(step,), daemon=True,
            name=f"jaxmoral-integrity-{step}")
        self._manifest_thread.start()
      else:
        self._write_manifest(step)
    return saved

  def _manifest_after_finalize(self, step: int) -> None:
    try:
      self._manager.wait_until_finished()
    except BaseException:  # pylint: disable=broad-except  (the caller's wait() re-raises it)
      return
    self._write_manifest(step)

  def _write_manifest(self, step: int) -> None:
    """`_INTEGRITY.json` of a finalised step (process 0; the step folder is shared)."""
    if jax.process_index() != 0:
      return
    step_dir = fileio.join(self.directory, str(step))
    try:
      write_integrity_manifest(step_dir)
      _committed[fileio.abspath(self.directory)] = int(step)
    except OSError as e:  # Without it the step is never loaded (see record_checksummed).
      logger.warning("%s: could not write the integrity manifest of step %d (%s); that step "
                     "will not be loaded", self.directory, step, e)

  def _join_manifest(self) -> None:
    thread, self._manifest_thread = self._manifest_thread, None
    if thread is not None:
      thread.join()

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def reached_preemption(self, step: int) -> bool:
    """True when the job was told to stop (e.g. TPU maintenance): save now and exit."""
    return self._manager.reached_preemption(step)

  def restore(self, step: Optional[int] = None, *, target: PyTree) -> tuple[PyTree, dict]:
    """Restores `(state, extra)`.

    Args:
      step: Step to restore (default: the latest).
      target: Pytree with the saved state's structure whose leaves are
        `jax.ShapeDtypeStruct`s with `.sharding` (or real arrays): values are read straight
        into those shardings and dtypes, so another mesh than the saving one works.
        `ShapeDtypeStruct`s without a sharding come back as numpy arrays.

    Returns:
      The state (structure of `target`, static fields from `target`) and the extra dict.

    Raises:
      CheckpointIntegrityError: The step is damaged or incomplete (checked before any read).
    """
    step = self._resolve_step(step)
    self.verify(step, shared=True)  # Every process restores: each hashes its share.
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeRestore(target, restore_args=_restore_args(target)),
        EXTRA_ITEM: ocp.args.JsonRestore(),
    })
    try:
      restored = self._manager.restore(step, args=args)
    except (ValueError, KeyError, TypeError) as e:
      # Orbax's own text advises `strict=False` (restoring part of the arrays): never the
      # fix for a run of another model; the first differing entry says what differs.
      raise ValueError(f"{self.directory}/{step}: cannot restore into the given target "
                       f"(structure, shapes or dtypes differ from the saved state: "
                       f"{self._first_difference(step, target) or type(e).__name__})") from None
    _committed.setdefault(fileio.abspath(self.directory), int(step))
    return restored[STATE_ITEM], dict(restored[EXTRA_ITEM] or {})

  def _first_difference(self, step: int, target: PyTree) -> Optional[str]:
    """The first entry whose shape differs between the saved state and `target`, or that
    only one of them has."""
    try:
      saved = self._manager.item_metadata(step)[STATE_ITEM]
      saved = getattr(saved, "tree", saved)
      flat_saved = {_path_str(p): tuple(getattr(m, "shape", ()) or ())
                    for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
      flat_target = {_path_str(p): tuple(getattr(t, "shape", ()) or ())
                     for p, t in jax.tree_util.tree_flatten_with_path(target)[0]}
    except Exception:  # pylint: disable=broad-except
      return None
    for key in sorted(set(flat_saved) | set(flat_target)):
      if key not in flat_target:
        return f"{key} is saved, not in this run's state"
      if key not in flat_saved:
        return f"{key} is not saved"
      if flat_saved[key] != flat_target[key]:
        return f"{key} is {flat_saved[key]} saved, {flat_target[key]} here"
    return None

  def state_metadata(self, step: Optional[int] = None) -> PyTree:
    """Saved state tree with `ArrayMetadata` leaves (shape, dtype) at `step` (default latest)."""
    step = self._resolve_step(step)
    self.verify(step, full=False)  # Sizes only: no array is read here.
    metadata = self._manager.item_metadata(step)[STATE_ITEM]
    return getattr(metadata, "tree", metadata)

  def verify(self, step: int, *, full: bool = True, shared: bool = False) -> bool:
    """Checks step `step` against its integrity manifest (see `verify_integrity`, `shared`
    included: then every process must call it).

    Returns:
      True if verified, False for a step saved without a manifest (a warning is logged).

    Raises:
      CheckpointIntegrityError: The step is damaged or incomplete.
    """
    self._join_manifest()
    return verify_step(self.directory, step, full=full, shared=shared)

  def move_aside(self, step: int) -> str:
    """Renames a (damaged) step to `<step>.damaged` so it is no step any more.

    Its data is kept for a post-mortem, and the run can save that step again. Process 0
    renames; every process then sees the step gone.

    Returns:
      The new path.
    """
    self._join_manifest()
    source = fileio.join(self.directory, str(int(step)))
    target = f"{source}.damaged"
    index = 1
    while fileio.exists(target):
      index += 1
      target = f"{source}.damaged.{index}"
    if jax.process_count() > 1:  # No process may still be checking the step's files.
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices(f"jaxmoral_move_aside_{step}_start")
    if jax.process_index() == 0:
      fileio.rename(source, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxmoral_move_aside_{step}_done")
    self._manager.reload()
    return target

  def _resolve_step(self, step: Optional[int]) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"{self.directory}: no checkpoints")
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint for step {step}; have {steps}")
    return int(step)

  def wait(self) -> None:
    """Blocks until pending async saves (and their integrity manifests) are on disk.

    Raises:
      OSError: ENOSPC or EFBIG: the disk is full (see `_disk_full_is_one_line`).
    """
    with self._disk_full_is_one_line():
      self._manager.wait_until_finished()
    self._join_manifest()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def default_sharding() -> Sharding:
  """Where restored params go without explicit shardings: device 0, or replicated multi-host."""
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def _path_str(path: tuple[Any, ...]) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def _cast_dtype(saved: Any, dtype: Optional[Any]) -> Any:
  saved = np.dtype(saved)
  if dtype is None or not jnp.issubdtype(saved, jnp.floating):
    return saved
  return jnp.dtype(dtype)


def _target_from_metadata(metadata_tree: PyTree, shardings: Any, dtype: Optional[Any],
                          where: str) -> PyTree:
  """`ShapeDtypeStruct` target for saved arrays, with shardings matched by key path."""
  if shardings is None or isinstance(shardings, Sharding):
    by_path = None
  else:
    flat = jax.tree_util.tree_leaves_with_path(
        shardings, is_leaf=lambda x: isinstance(x, Sharding))
    by_path = {_path_str(p): s for p, s in flat}

  def one(path: tuple[Any, ...], meta: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(meta, "shape"):
      raise ValueError(f"{where}: saved leaf {_path_str(path)} is not an array ({meta!r})")
    if by_path is None:
      sharding = shardings or default_sharding()
    else:
      key = _path_str(path)
      if key not in by_path:
        raise ValueError(f"{where}: no sharding given for saved parameter {key}")
      sharding = by_path[key]
    return jax.ShapeDtypeStruct(tuple(meta.shape), _cast_dtype(meta.dtype, dtype),
                                sharding=sharding)

  target = jax.tree_util.tree_map_with_path(one, metadata_tree)
  if by_path is not None:
    extra = set(by_path) - {_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    if extra:
      raise ValueError(f"{where}: shardings given for parameters not in the checkpoint: "
                       f"{sorted(extra)[:5]}")
  return target


@gin.configurable(module="checkpoints")
def export_params(params: PyTree, directory: str | os.PathLike, *, dtype: Optional[Any] = None,
                  config: Optional[Mapping[str, Any]] = None, overwrite: bool = False,
                  write_extra: Optional[Callable[[str], Sequence[str]]] = None) -> str:
  """Writes a params-only checkpoint (`<directory>/params`) and `<directory>/config.json`.

  Args:
    params: Parameter tree (boxed or not; boxes are removed).
    directory: Export directory.
    dtype: Cast floating-point leaves to this dtype first (e.g. "bfloat16"); None keeps them.
    config: Model config dict (e.g. `T5Config.to_dict()`), written as config.json.
    overwrite: Replace an existing export; otherwise an existing one is an error.
    write_extra: Called (process 0) with the directory once the parameters are saved; writes
      further files and returns their names, which the integrity manifest covers too.

  Returns:
    The absolute export directory.
  """
  require_checkpoint_storage(directory, "export directory")
  directory = fileio.abspath(directory)
  params_dir = fileio.join(directory, PARAMS_DIR)
  if fileio.exists(params_dir) and not overwrite:
    raise FileExistsError(f"{params_dir} exists; export with --overwrite (overwrite=True) to "
                          "replace it")
  params = nn.meta.unbox(params)
  if dtype is not None:
    target = jnp.dtype(dtype)
    params = jax.tree_util.tree_map(
        lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  manifest = fileio.join(directory, INTEGRITY_FILE)
  if jax.process_index() == 0 and fileio.exists(manifest):
    fileio.remove(manifest)  # The old export's: it would describe files about to be replaced.
  ocp.PyTreeCheckpointer().save(params_dir, params, force=overwrite)
  if jax.process_index() == 0:
    if config is not None:
      with fileio.open(fileio.join(directory, CONFIG_FILE), "w") as f:
        json.dump(_to_json(dict(config), "(config)"), f, indent=2, sort_keys=True)
    covered = [PARAMS_DIR] + ([CONFIG_FILE] if fileio.isfile(
        fileio.join(directory, CONFIG_FILE)) else [])
    if write_extra is not None:
      covered += list(write_extra(directory))
    write_integrity_manifest(directory, covered)
  return directory


def verify_export(directory: str | os.PathLike, *, full: bool | Sequence[str] = True,
                  shared: bool = False) -> bool:
  """`verify_integrity` of an `export_params` directory (params/, config.json and what else
  its manifest covers)."""
  directory = fileio.abspath(directory)
  return verify_integrity(directory, what=f"{directory}: the export", full=full,
                          required=(f"{PARAMS_DIR}/_METADATA",), shared=shared)


def load_exported(directory: str | os.PathLike, *, shardings: Any = None,
                  dtype: Optional[Any] = None) -> tuple[PyTree, Optional[dict]]:
  """Loads `export_params` output: `(params, config dict or None)`.

  Args:
    directory: Export directory.
    shardings: Tree of `Sharding`s with the params' structure (e.g.
      `partitioner.sharding_for(boxed_params)`), one `Sharding` for all, or None (device 0;
      replicated on multi-host).
    dtype: Cast floating-point params to this dtype while reading; None keeps the saved one.

  Raises:
    CheckpointIntegrityError: The export is damaged or incomplete (checked before any read).
  """
  require_checkpoint_storage(directory, "export directory")
  directory = fileio.abspath(directory)
  params_dir = fileio.join(directory, PARAMS_DIR)
  if not fileio.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir}: no exported params (expected export_params output)")
  verify_export(directory, shared=True)  # Every process loads: each hashes its share.
  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(params_dir).item_metadata
  target = _target_from_metadata(getattr(metadata, "tree", metadata), shardings, dtype,
                                 params_dir)
  params = checkpointer.restore(
      params_dir, args=ocp.args.PyTreeRestore(target, restore_args=_restore_args(target)))
  config = None
  config_path = fileio.join(directory, CONFIG_FILE)
  if fileio.exists(config_path):
    with fileio.open(config_path) as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}:{e.lineno}: invalid JSON: {e.msg}") from e
  return params, config


def load_params(directory: str | os.PathLike, *, shardings: Any = None,
                dtype: Optional[Any] = None) -> PyTree:
  """The params of an `export_params` directory (see `load_exported` for the arguments)."""
  return load_exported(directory, shardings=shardings, dtype=dtype)[0]


@contextlib.contextmanager
def _without_read_only_notice():
  """Drops Orbax's 'Given directory is read only' warning: opening a run read-only to load
  its parameters is what we asked for, not something to warn a user about."""
  absl_logger = logging.getLogger("absl")

  def notice_filter(record: logging.LogRecord) -> bool:
    return "Given directory is read only" not in record.getMessage()

  absl_logger.addFilter(notice_filter)
  try:
    yield
  finally:
    absl_logger.removeFilter(notice_filter)


def _run_manager(model_dir: str) -> ocp.CheckpointManager:
  """A read-only Orbax manager of a run's checkpoint directory."""
  require_checkpoint_storage(model_dir, "run directory")
  if not fileio.isdir(model_dir):
    raise FileNotFoundError(f"{model_dir}: no such run directory")
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
  with _without_read_only_notice():
    return ocp.CheckpointManager(model_dir, options=options, item_handlers=_item_handlers())


def _params_subtree(tree: Any, where: str) -> tuple[str, ...]:
  """Where a saved state keeps the model parameters: `params` (a TrainState), or
  `policy/params` (a PPO state: the tuned policy)."""
  if isinstance(tree, Mapping) and PARAMS_DIR in tree:
    return (PARAMS_DIR,)
  if (isinstance(tree, Mapping) and isinstance(tree.get("policy"), Mapping)
      and PARAMS_DIR in tree["policy"]):
    return ("policy", PARAMS_DIR)
  keys = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
  raise ValueError(f"{where}: saved state has no 'params' entry (has {keys})")


_warned_skipped: set[tuple[str, int]] = set()


def _warn_skipped_unfinalised(model_dir: str, skipped: Sequence[int], used: int) -> None:
  """Says which newer steps a reader passes over, as a resume does: quietly only while a run
  holds the lock (it is still writing them)."""
  if not skipped or (model_dir, skipped[-1]) in _warned_skipped:
    return
  run_dir = model_dir.rstrip("/").rsplit("/", 1)[0] if fileio.is_url(model_dir) else (
      os.path.dirname(model_dir.rstrip(os.sep)))
  if fileio.basename(model_dir) == RUN_CHECKPOINTS_SUBDIR and fileio.exists(
      fileio.join(run_dir, LOCK_FILE)):
    return
  _warned_skipped.add((model_dir, skipped[-1]))
  listed = ", ".join(str(s) for s in skipped)
  logger.warning("%s: checkpoint step%s %s %s no %s and no run holds the lock (killed while "
                 "saving?): reading step %d, the newest complete one", model_dir,
                 "s" if len(skipped) > 1 else "", listed, "have" if len(skipped) > 1 else "has",
                 INTEGRITY_FILE, used)


def _resolve_run_step(manager: Any, model_dir: str, step: Optional[int]) -> int:
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f"{model_dir}: no checkpoints")
  if step is None:
    # The newest finalised step: one a running `train` is still finalising (no manifest yet)
    # is not read.
    finalised = [s for s in steps if is_finalised(model_dir, s)]
    if not finalised:
      return steps[-1]  # verify says why.
    _warn_skipped_unfinalised(model_dir, [s for s in steps if s > finalised[-1]],
                              finalised[-1])
    return finalised[-1]
  step = int(step)
  if step not in steps:
    raise FileNotFoundError(f"{model_dir}: no checkpoint for step {step}; have {steps}")
  return step


def run_params_metadata(model_dir: str | os.PathLike, *, step: Optional[int] = None
                        ) -> tuple[int, tuple[tuple[str, ...], PyTree]]:
  """(step, (where the params sit in the state, their metadata tree)) of a run's checkpoint."""
  model_dir = fileio.abspath(model_dir)
  with _run_manager(model_dir) as manager:
    step = _resolve_run_step(manager, model_dir, step)
    verify_step(model_dir, step, full=False)  # Sizes only: no array is read here.
    metadata = manager.item_metadata(step)[STATE_ITEM]
  tree = getattr(metadata, "tree", metadata)
  subtree = _params_subtree(tree, f"{model_dir}/{step}/{STATE_ITEM}")
  node = tree
  for key in subtree:
    node = node[key]
  return step, (subtree, node)


def restore_params_from_run(model_dir: str | os.PathLike, *, step: Optional[int] = None,
                            shardings: Any = None, dtype: Optional[Any] = None) -> PyTree:
  """Only the model parameters of a training run's checkpoint (optimizer state is not read).

  A `TrainState` keeps them in `params`; a PPO state in `policy/params` (the tuned policy).

  Args:
    model_dir: The run's checkpoint directory (a `CheckpointManager` directory).
    step: Step to read (default: the latest).
    shardings: As in `load_exported`.
    dtype: As in `load_exported`.

  Returns:
    The parameter tree.

  Raises:
    CheckpointIntegrityError: The step is damaged or incomplete (checked before any read).
  """
  model_dir = fileio.abspath(model_dir)
  with _run_manager(model_dir) as manager:
    step = _resolve_run_step(manager, model_dir, step)
    verify_step(model_dir, step, shared=True)  # Every process loads: each hashes its share.
    metadata = manager.item_metadata(step)[STATE_ITEM]
    tree = getattr(metadata, "tree", metadata)
    where = f"{model_dir}/{step}/{STATE_ITEM}"
    subtree = _params_subtree(tree, where)
    node = tree
    for key in subtree:
      node = node[key]
    target: Any = _target_from_metadata(node, shardings, dtype, where)
    for key in reversed(subtree):
      target = {key: target}
    restored = manager.restore(step, args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeRestore(target, restore_args=_restore_args(target),
                                           partial_restore=True)}))
  out = restored[STATE_ITEM]
  for key in subtree:
    out = out[key]
  return out


def exported_metadata(directory: str | os.PathLike) -> PyTree:
  """The saved parameter tree of an `export_params` directory, `ArrayMetadata` leaves."""
  require_checkpoint_storage(directory, "export directory")
  params_dir = fileio.join(fileio.abspath(directory), PARAMS_DIR)
  if not fileio.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir}: no exported params (expected export_params output)")
  # Sizes of everything; digests of the small files read next (config, vocabulary, settings).
  verify_export(directory, full=[name for name in fileio.listdir(directory) if name != PARAMS_DIR])
  metadata = ocp.PyTreeCheckpointer().metadata(params_dir).item_metadata
  return getattr(metadata, "tree", metadata)


def restore_subtree(item_dir: str | os.PathLike, prefix: tuple[str, ...], target: PyTree
                    ) -> PyTree:
  """The subtree at `prefix` of an Orbax PyTree checkpoint, read into `target`'s shardings
  and dtypes (a tree of `ShapeDtypeStruct`s); nothing else of the checkpoint is read."""
  wrapped: Any = target
  for key in reversed(prefix):
    wrapped = {key: wrapped}
  restored = ocp.PyTreeCheckpointer().restore(
      os.fspath(item_dir), args=ocp.args.PyTreeRestore(
          wrapped, restore_args=_restore_args(wrapped), partial_restore=True))
  for key in prefix:
    restored = restored[key]
  return restored
