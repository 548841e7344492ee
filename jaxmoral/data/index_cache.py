"""A Task's preprocessed rows on disk, read by index: resume at any step without replay.

seqio (TensorFlow) preprocesses a Task's split once into one `.npy` file per feature, with
`meta.json` (row count, identity, each file's size and sha256). Reading needs NumPy only (the
files are memory-mapped; a batch is a gather of rows), so batch `k` costs the same for every
`k` and an accelerator host reads the cache without TensorFlow.

A cache is written under a temporary name and renamed into place whole, so a killed or
concurrent build leaves nothing that looks complete. `read` verifies it once per process
against `meta.json`; `meta["sha256"]`, the data fingerprint a checkpoint records, is computed
from the verified files' digests, never copied, so a resume over changed rows is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from jaxmoral import integrity

META = "meta.json"


def default_root() -> str:
  """`$JAXMORAL_DATA_CACHE`, else `~/.cache/jaxmoral/data`."""
  return os.environ.get("JAXMORAL_DATA_CACHE") or os.path.expanduser("~/.cache/jaxmoral/data")


def key_of(identity: Mapping[str, Any]) -> str:
  """A short stable name for what a cache holds (a JSON-able description)."""
  return fingerprint(identity)[:24]


def _digest(features: Mapping[str, np.ndarray]) -> str:
  sha = hashlib.sha256()
  for name in sorted(features):
    array = np.ascontiguousarray(features[name])
    sha.update(f"{name}{array.dtype.str}{array.shape}".encode())
    sha.update(array.data.cast("B"))
  return sha.hexdigest()


# Caches verified by this process: {folder: (meta text, {file: version})}; a cache is hashed
# again only when one of its files was rewritten since.
_verified: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = {}
_verified_guard = threading.Lock()


class CacheDamagedError(ValueError):
  """A data cache's file differs from what its `meta.json` records (one line, naming it)."""


def _version(path: str) -> tuple[int, ...]:
  st = os.stat(path)
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def fingerprint(value: Any) -> str:
  """The sha256 of `value` as sorted JSON; of the files' digests, what a checkpoint records."""
  text = json.dumps(value, sort_keys=True, default=str)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _damaged(path: str, why: str) -> CacheDamagedError:
  return CacheDamagedError(f"data cache file {path} is damaged: {why}; write the cache anew "
                           "(delete its folder, or `jaxmoral cache` for a DATA_CACHE)")


def _verify(directory: str, meta: Mapping[str, Any], meta_text: str) -> None:
  """Checks the `.npy` files of a cache against its meta (sizes, then sha256 in parallel)."""
  names = [f"{name}.npy" for name in meta["features"]]
  paths = {name: os.path.join(directory, name) for name in names}
  versions = {}
  for name, path in paths.items():
    try:
      versions[name] = _version(path)
    except OSError as e:
      raise _damaged(path, f"cannot be read ({e.strerror or type(e).__name__})") from None
  key = os.path.realpath(directory)
  with _verified_guard:
    if _verified.get(key) == (meta_text, versions):
      return
  recorded = meta.get("files")
  if recorded is None:  # Written before per-file digests: hash the rows themselves.
    features = _load(directory, meta)
    if _digest(features) != meta.get("sha256"):
      raise _damaged(os.path.join(directory, META), "its rows differ from the sha256 recorded "
                     "when the cache was written")
  else:
    for name in names:
      if name not in recorded:
        raise _damaged(os.path.join(directory, META), f"it records no digest of {name}")
      if versions[name][2] != int(recorded[name]["size"]):
        raise _damaged(paths[name], f"{versions[name][2]} bytes, {recorded[name]['size']} when "
                       "written (truncated or overwritten)")
    digests = integrity.hash_files(directory, names)
    for name in names:
      if digests[name] != recorded[name]["sha256"]:
        raise _damaged(paths[name], "its bytes differ from the sha256 recorded when the cache "
                       "was written")
    if fingerprint(digests) != meta.get("sha256"):
      raise _damaged(os.path.join(directory, META), "its fingerprint does not match its files")
  with _verified_guard:
    _verified[key] = (meta_text, versions)


def _load(directory: str, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
  features = {}
  for name in meta["features"]:
    path = os.path.join(directory, f"{name}.npy")
    try:
      array = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:  # A truncated or foreign file.
      raise _damaged(path, f"not a readable .npy ({str(e).splitlines()[0][:120]})") from None
    if len(array) != int(meta["rows"]):
      raise _damaged(path, f"{len(array)} rows, {meta['rows']} in {META}")
    features[name] = array
  return features


def read(directory: str) -> Optional[tuple[dict[str, np.ndarray], dict[str, Any]]]:
  """`(features memory-mapped read-only, meta)` of a complete cache, or None if there is none.

  Raises:
    CacheDamagedError: A file is missing, truncated, has other bytes or other rows than
      `meta.json` records (the message names it).
  """
  meta_path = os.path.join(directory, META)
  if not os.path.isfile(meta_path):
    return None
  with open(meta_path, encoding="utf-8") as f:
    meta_text = f.read()
  try:
    meta = json.loads(meta_text)
    list(meta["features"]), int(meta["rows"])
  except (ValueError, KeyError, TypeError) as e:
    raise _damaged(meta_path, f"not a cache's meta ({type(e).__name__})") from None
  _verify(directory, meta, meta_text)
  return _load(directory, meta), meta


def check_feature_lengths(features: Mapping[str, np.ndarray], lengths: Mapping[str, int], *,
                          where: str) -> None:
  """Refuses rows of another width than the run's feature lengths (seq2seq features:
  `encoder_*` are `inputs` long, `decoder_*` are `targets` long)."""
  for name, array in sorted(features.items()):
    key = "inputs" if name.startswith("encoder_") else (
        "targets" if name.startswith("decoder_") else name)
    if key not in lengths:
      continue
    if array.ndim < 2 or array.shape[1] != int(lengths[key]):
      width = array.shape[1] if array.ndim >= 2 else None
      raise ValueError(f"data cache file {os.path.join(where, name + '.npy')} holds rows of "
                       f"length {width}, this run's {key} length is {lengths[key]} "
                       "(TASK_FEATURE_LENGTHS); write the cache anew with `jaxmoral cache`")


def write(directory: str, chunks: Iterable[Mapping[str, np.ndarray]],
          identity: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Writes the rows of `chunks` (equal-keyed dicts of arrays) as the cache `directory`.

  Returns what `read` then returns. If another process completed the same cache first, its
  copy is kept (they hold the same rows).
  """
  parts: dict[str, list[np.ndarray]] = {}
  for chunk in chunks:
    for name, array in chunk.items():
      parts.setdefault(name, []).append(np.asarray(array))
  if not parts:
    raise ValueError(f"data cache {directory}: the data has no rows")
  features = {name: np.concatenate(arrays) for name, arrays in parts.items()}
  del parts
  rows = {len(v) for v in features.values()}
  if len(rows) != 1:
    raise ValueError(f"data cache {directory}: features differ in rows: "
                     f"{ {k: len(v) for k, v in features.items()} }")
  meta: dict[str, Any] = {"features": sorted(features), "rows": rows.pop(),
                          "identity": dict(identity)}
  parent = os.path.dirname(os.path.abspath(directory))
  os.makedirs(parent, exist_ok=True)
  temporary = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp.", dir=parent)
  try:
    try:
      files: dict[str, dict[str, Any]] = {}
      for name, array in features.items():
        path = os.path.join(temporary, f"{name}.npy")
        np.save(path, array)
        files[f"{name}.npy"] = {"size": os.path.getsize(path),
                                "sha256": integrity.file_sha256(path)}
      meta["files"] = files
      meta["sha256"] = fingerprint({n: f["sha256"] for n, f in files.items()})
      meta_text = json.dumps(meta, default=str)
      with open(os.path.join(temporary, META), "w", encoding="utf-8") as f:
        f.write(meta_text)
    except OSError as e:  # A full disk or a file size limit: one line naming the folder.
      raise OSError(e.errno, f"data cache {directory} could not be written "
                             f"({e.strerror or e}); free space in that folder") from None
    try:
      os.rename(temporary, directory)
    except OSError:
      if read(directory) is None:  # Not a finished twin: a real failure.
        raise
    else:  # Just hashed while written: this process need not hash the files again.
      versions = {name: _version(os.path.join(directory, name)) for name in files}
      with _verified_guard:
        _verified[os.path.realpath(directory)] = (meta_text, versions)
  finally:
    shutil.rmtree(temporary, ignore_errors=True)
  del features
  found = read(directory)
  assert found is not None
  return found
