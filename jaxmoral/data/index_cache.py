"""A Task's preprocessed rows on disk, read by index: resume at any step without replay.

seqio (TensorFlow) preprocesses a Task's split once (tokenise, pack or pad) and the rows are
written here as one NumPy `.npy` file per feature, with `meta.json` (row count, the key it was
built for and a SHA-256 of the rows). Reading needs NumPy only: the files are memory-mapped,
and a batch is a gather of rows (`pipeline.BatchSource`), so batch `k` costs the same for
every `k` and an accelerator host reads the cache without importing TensorFlow.

A cache is written under a temporary name and renamed into place whole, so a killed build
leaves nothing that looks complete, and processes that build the same cache at once do not
see each other's halves.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterable, Mapping, Optional

import numpy as np

META = "meta.json"
CACHE_ENV = "JAXMORAL_DATA_CACHE"


def default_root() -> str:
  """`$JAXMORAL_DATA_CACHE`, else `~/.cache/jaxmoral/data`."""
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                   "jaxmoral", "data")


def key_of(identity: Mapping[str, Any]) -> str:
  """A short stable name for what a cache holds (a JSON-able description)."""
  text = json.dumps(identity, sort_keys=True, default=str)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def _digest(features: Mapping[str, np.ndarray]) -> str:
  sha = hashlib.sha256()
  for name in sorted(features):
    array = np.ascontiguousarray(features[name])
    sha.update(f"{name}{array.dtype.str}{array.shape}".encode())
    sha.update(array.data.cast("B"))
  return sha.hexdigest()


def read(directory: str) -> Optional[tuple[dict[str, np.ndarray], dict[str, Any]]]:
  """`(features memory-mapped read-only, meta)` of a complete cache, or None if there is none."""
  meta_path = os.path.join(directory, META)
  if not os.path.isfile(meta_path):
    return None
  with open(meta_path, encoding="utf-8") as f:
    meta = json.load(f)
  features = {name: np.load(os.path.join(directory, f"{name}.npy"), mmap_mode="r")
              for name in meta["features"]}
  return features, meta


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
  meta = {"features": sorted(features), "rows": rows.pop(), "sha256": _digest(features),
          "identity": dict(identity)}
  parent = os.path.dirname(os.path.abspath(directory))
  os.makedirs(parent, exist_ok=True)
  temporary = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp.", dir=parent)
  try:
    try:
      for name, array in features.items():
        np.save(os.path.join(temporary, f"{name}.npy"), array)
      with open(os.path.join(temporary, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, default=str)
    except OSError as e:  # A full disk or a file size limit: one line naming the folder.
      raise OSError(e.errno, f"data cache {directory} could not be written "
                             f"({e.strerror or e}); free space in that folder") from None
    try:
      os.rename(temporary, directory)
    except OSError:
      if read(directory) is None:  # Not a finished twin: a real failure.
        raise
  finally:
    shutil.rmtree(temporary, ignore_errors=True)
  del features
  found = read(directory)
  assert found is not None
  return found
