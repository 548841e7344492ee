"""Checksum manifests (`_INTEGRITY.json`: size and sha256 of each file), verified first.

Every checkpoint step, export and run's own files carry one, written once the files are
final; every restore and load checks it before reading any array, so a damaged or incomplete
checkpoint is a `CheckpointIntegrityError` naming the step and file, never NaN parameters.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmoral import fileio

INTEGRITY_FILE = "_INTEGRITY.json"
_HASH_CHUNK = 1 << 20  # Streamed: a file is never read into memory whole.
_HASH_THREADS = 8  # hashlib releases the GIL on large buffers: files hash in parallel.
logger = logging.getLogger(__name__)
_warned_unverified: set[str] = set()


class CheckpointIntegrityError(ValueError):
  """A checkpoint is damaged or incomplete; nothing of it was loaded (a ValueError: the CLI
  prints it as one line).

  Attributes:
    step: The damaged step (None for an export).
    files: The damaged or missing files, relative to the step (or export) directory.
  """

  def __init__(self, message: str, *, step: Optional[int] = None, files: Sequence[str] = ()):
    super().__init__(message)
    self.step = step
    self.files = tuple(files)


def file_sha256(path: str) -> str:
  """The sha256 of a file (local or URL), streamed."""
  digest = hashlib.sha256()
  with fileio.open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
      digest.update(chunk)
  return digest.hexdigest()


def hash_files(root: str, relative: Sequence[str]) -> dict[str, str]:
  """{relative path: sha256} of files under `root`, hashed in parallel."""
  if len(relative) <= 1:
    return {rel: file_sha256(fileio.join(root, rel)) for rel in relative}
  with concurrent.futures.ThreadPoolExecutor(min(_HASH_THREADS, len(relative))) as pool:
    digests = pool.map(lambda rel: file_sha256(fileio.join(root, rel)), relative)
    return dict(zip(relative, digests, strict=True))


def _files_of(root: str, entries: Iterable[str]) -> list[str]:
  """Files (relative '/'-joined paths, sorted) of `entries` (files or folders) under root."""
  out = []
  for entry in entries:
    path = fileio.join(root, entry)
    out += [entry] if fileio.isfile(path) else [
        f"{entry.rstrip('/')}/{rel}" for rel in fileio.walk_files(path)]
  return sorted(rel for rel in out if rel != INTEGRITY_FILE)


def write_integrity_manifest(root: str | os.PathLike, entries: Optional[Iterable[str]] = None
                             ) -> str:
  """Writes `root/_INTEGRITY.json` whole (`fileio.write_text`: complete or absent): size and
  sha256 of every file under `root`, or under `entries` (files or folders relative to it).
  Returns its path."""
  root = os.fspath(root)
  relative = _files_of(root, sorted(fileio.listdir(root)) if entries is None else entries)
  digests = hash_files(root, relative)
  manifest = {"version": 1, "algorithm": "sha256",
              "files": {rel: {"size": fileio.getsize(fileio.join(root, rel)),
                              "sha256": digests[rel]} for rel in relative}}
  path = fileio.join(root, INTEGRITY_FILE)
  fileio.write_text(path, json.dumps(manifest, indent=1, sort_keys=True), durable=True)
  return path


# {(directory, manifest digest): {file: version}} of the files that matched in this process:
# a step verified once (the explorer's pages, an eval's loads) is hashed again only when a
# file was rewritten since.
_verified: dict[tuple[str, str], dict[str, Any]] = {}
_verified_guard = threading.Lock()


def _refuse_entries_outside(root: str, files: Mapping[str, Any], *, what: str,
                            step: Optional[int]) -> None:
  """Refuses a manifest that names anything outside its folder (an absolute path or URL, a
  `..` component, a local link out of it): verifying it would report the size and digest of
  any file the reader can open."""
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


def _more(files: Sequence[Any]) -> str:
  return f" (and {len(files) - 1} more files)" if len(files) > 1 else ""


def _incomplete(what: str, missing: Sequence[str], step: Optional[int]
                ) -> CheckpointIntegrityError:
  return CheckpointIntegrityError(f"{what} is incomplete (missing {_listing(missing)}); "
                                  "nothing was loaded", step=step, files=missing)


def verify_integrity(root: str | os.PathLike, *, what: str, full: bool | Sequence[str] = True,
                     step: Optional[int] = None, required: Sequence[str] = (),
                     shared: bool = False, unverified_ok: bool = True) -> bool:
  """Checks a checkpoint directory against its `_INTEGRITY.json` before anything is read.

  Args:
    root: A checkpoint step or export directory.
    what: How messages name it (e.g. "/run/checkpoints: checkpoint step 7").
    full: Also compare sha256 digests; False checks presence and sizes only (for metadata
      reads); a sequence of files or folders (relative to `root`) compares those digests only
      (the small files a metadata read parses).
    step: The step, for the error's attribute.
    required: Files that must exist even without a manifest (older checkpoints).
    shared: Every process of a multi-process job calls this for the same files (a
      collective): each hashes its share and all learn every share's result, so a pod
      restore reads each file once, not once per host.
    unverified_ok: Whether a missing manifest means "written before manifests existed"
      (loaded with a warning); False where the writer is known to write one, so a missing
      manifest (a step still being finalised, or a deleted manifest) is refused.

  Returns:
    True if verified against a manifest; False if there is none (a warning is logged, once per
    directory).

  Raises:
    CheckpointIntegrityError: A file is missing, has another size, or another digest.
  """
  root = os.fspath(root)
  if shared and jax.process_count() > 1:
    # Every process must take the same path into the gathering below: none may look before
    # process 0 has finished writing a manifest it saved a moment ago (it joins its writer
    # before verifying), or one would find no manifest and skip the collective.
    multihost_utils.sync_global_devices("jaxmoral_verify_integrity")
  missing_required = [rel for rel in required if not fileio.isfile(fileio.join(root, rel))]
  if missing_required:
    raise _incomplete(what, missing_required, step)
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
  versions = fileio.file_versions(root, files)  # A bucket: one listing, not one per file.
  missing = [rel for rel in sorted(files) if rel not in versions]
  if missing:
    raise _incomplete(what, missing, step)
  resized = [(rel, versions[rel][0], saved_sizes[rel]) for rel in sorted(files)
             if versions[rel][0] != saved_sizes[rel]]
  if resized:
    rel, size, saved = resized[0]
    raise CheckpointIntegrityError(
        f"{what} is damaged: {rel} is {size} bytes, {saved} when saved (truncated or "
        f"overwritten){_more(resized)}; nothing was loaded", step=step,
        files=[r[0] for r in resized])
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
      raise CheckpointIntegrityError(
          f"{what} is damaged: {changed[0]} differs from its checksum at save time"
          f"{_more(changed)}; nothing was loaded", step=step, files=changed)
  return True


def _compare_digests(root: str, hashed: Sequence[str], saved: Mapping[str, str], *,
                     shared: bool) -> tuple[list[str], Optional[tuple[str, str]]]:
  """(files whose digest differs, (first unreadable file, why) or None). With `shared` in a
  multi-process job, process i hashes files i, i + n, ... and all gather every verdict."""
  count = jax.process_count() if shared else 1
  mine = list(hashed)[jax.process_index()::count] if count > 1 else list(hashed)
  changed, unreadable = [], None
  try:
    digests = hash_files(root, mine)
    changed = [rel for rel in mine if digests[rel] != saved[rel]]
  except OSError as e:  # Gone or unreadable while being read.
    unreadable = (os.path.relpath(e.filename or root, root).replace(os.sep, "/"),
                  e.strerror or type(e).__name__)
  if count == 1:
    return changed, unreadable
  index = {rel: k for k, rel in enumerate(hashed)}
  verdict = np.zeros(len(hashed) + 1, np.int32)  # 1: differs, 2: unreadable; last: unknown
  for rel in changed:
    verdict[index[rel]] = 1
  if unreadable:
    verdict[index.get(unreadable[0], len(hashed))] = 2
  everywhere = np.asarray(multihost_utils.process_allgather(verdict)).reshape(count, -1).max(0)
  changed = [hashed[int(k)] for k in np.flatnonzero(everywhere[:-1] == 1)]
  if unreadable is None and (everywhere == 2).any():
    k = int(np.flatnonzero(everywhere == 2)[0])
    unreadable = (hashed[k] if k < len(hashed) else "a file", "unreadable on another process")
  return changed, unreadable


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


def record_checksummed(directory: str | os.PathLike, *, run_files: bool = False) -> None:
  """Writes `CHECKSUMMED_FILE` into a `CheckpointManager` directory unless it has one: steps
  saved from now on carry manifests; those already there without one stay loadable (with a
  warning). `run_files`: also the run's own files have a manifest from now on."""
  directory = os.fspath(directory)
  record = _checksummed_record(directory)
  if record is not None and (record["run_files"] or not run_files):
    return
  if record is None:
    fileio.makedirs(directory)
    older = [step for step in step_folders(directory)
             if not fileio.isfile(fileio.join(directory, str(step), INTEGRITY_FILE))]
  else:
    older = sorted(record["unverified_steps"])
  record = {"version": 1, "unverified_steps": older, "run_files": run_files}
  fileio.write_text(fileio.join(directory, CHECKSUMMED_FILE),
                    json.dumps(record, indent=1, sort_keys=True), durable=True)


def step_folders(directory: str) -> list[int]:
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


