"""The folders the explorer shows: paths confined to them, and what each folder holds.

A browser's path is relative to one of the given folders (by index); an absolute path, a `..`
component or a link leading outside is refused (`Forbidden`, HTTP 403). Discovery classifies
files by name and first bytes, never by loading a model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import stat
from typing import Any, Iterator, Optional, Sequence

from jaxmoral import run_layout

# Folders never worth walking into: an Orbax step's array shards, vocabularies, caches.
_SKIP_DIRS = frozenset({
    run_layout.CHECKPOINTS_DIR, run_layout.EXPORT_PARAMS_DIR, run_layout.VOCAB_DIR,
    run_layout.PROMPT_DIR, "state", "__pycache__", ".git", "heatmaps"})
_MAX_DEPTH = 6
_MAX_FILES = 20000


class Forbidden(ValueError):
  """A path from the browser outside the given folders."""


@dataclasses.dataclass(frozen=True)
class Found:
  """One thing the explorer can show.

  Attributes:
    kind: "npov" (a folder of score files or results), "npov_scores", "npov_results",
      "clarify_evaluation", "clarify_chat", "reward_curve", "diamante_dialogues",
      "diamante_metrics", "diamante_chat", "run", "experiment", "model".
    root: Index of the given folder it is in.
    path: Its path relative to that folder ("" for the folder itself), with "/".
  """
  kind: str
  root: int
  path: str


class Roots:
  """The given folders, and the one way a browser path becomes a file path (`resolve`)."""

  def __init__(self, folders: Sequence[str | os.PathLike[str]]):
    if not folders:
      raise ValueError("give at least one folder")
    for folder in folders:
      if not pathlib.Path(folder).expanduser().is_dir():
        raise ValueError(f"{folder} is not a folder")
    self.folders: tuple[pathlib.Path, ...] = tuple(
        pathlib.Path(folder).expanduser().resolve() for folder in folders)

  def label(self, root: int) -> str:
    """How pages name a given folder: its name, with its index where names repeat."""
    name = self.folders[root].name or str(self.folders[root])
    same = [i for i, f in enumerate(self.folders) if f.name == self.folders[root].name]
    return name if len(same) == 1 else f"{name} [{root}]"

  def resolve(self, root: Any, relative: Optional[str]) -> pathlib.Path:
    """The file a browser's (root index, relative path) names.

    Raises:
      Forbidden: A bad root index, an absolute path, a `..` component, or a path whose
        real location (links followed) is outside the folder.
    """
    try:
      index = int(root)
    except (TypeError, ValueError):
      raise Forbidden(f"no folder {root!r}") from None
    if not 0 <= index < len(self.folders):
      raise Forbidden(f"no folder {root!r}")
    relative = relative or ""
    if problem := unsafe(relative):
      raise Forbidden(f"{problem} {relative!r}")
    base = self.folders[index]
    path = (base / relative).resolve()
    if path != base and base not in path.parents:
      raise Forbidden(f"{relative!r} leads outside {self.label(index)}")
    try:
      mode = path.stat().st_mode
    except OSError:
      return path  # Missing: the page says so.
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
      # A FIFO or a device would block or never end a read.
      raise Forbidden(f"{relative!r} is not a regular file")
    return path

  def relative(self, root: int, path: pathlib.Path) -> str:
    return path.relative_to(self.folders[root]).as_posix() if path != self.folders[root] else ""

  def walk(self) -> Iterator[tuple[int, pathlib.Path, list[str], list[str]]]:
    """(root index, folder, sub-folder names, file names) of every folder, bounded."""
    seen = 0
    for index, base in enumerate(self.folders):
      for folder, dirs, files in os.walk(base):
        depth = len(pathlib.Path(folder).relative_to(base).parts)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")
                         and depth < _MAX_DEPTH)
        seen += len(files)
        yield index, pathlib.Path(folder), dirs, sorted(
            f for f in files if is_regular_inside(pathlib.Path(folder) / f, base))
        if seen > _MAX_FILES:
          break


def unsafe(relative: str) -> Optional[str]:
  """What makes a relative path from outside (a browser's, a manifest's) leave its folder
  before links are followed: "absolute path" or "'..' in path"; None for neither."""
  if "\x00" in relative or relative.startswith(("/", "\\")) or os.path.isabs(relative) or (
      len(relative) > 1 and relative[1] == ":"):
    return "absolute path"
  return "'..' in path" if ".." in relative.replace("\\", "/").split("/") else None


def is_regular_inside(path: pathlib.Path, base: pathlib.Path) -> bool:
  """Whether `path` is a regular file (links followed) really inside `base`: what a page may
  open (a FIFO would block the reader, a link to /dev/zero never end, a link out leak)."""
  try:
    real = path.resolve(strict=True)
    if base not in real.parents:
      return False
    return stat.S_ISREG(real.stat().st_mode)
  except (OSError, RuntimeError):  # Dangling or looping links.
    return False


def regular_files(folder: pathlib.Path, pattern: str) -> list[pathlib.Path]:
  """`folder.glob(pattern)`, sorted, keeping only regular files inside `folder`."""
  base = folder.resolve()
  return [p for p in sorted(folder.glob(pattern)) if is_regular_inside(p, base)]


def _first_json(path: pathlib.Path, limit: int = 1 << 16) -> Any:
  """The first JSON line of a JSONL file (None when it is not one)."""
  try:
    with open(path, "rb") as f:
      line = f.readline(limit)
    return json.loads(line)
  except (OSError, ValueError):
    return None


def _json_keys(path: pathlib.Path, limit: int = 1 << 22) -> Any:
  """A JSON file's top object (None when over `limit` bytes, whatever size the file claims,
  or not JSON)."""
  try:
    with open(path, "rb") as f:
      data = f.read(limit + 1)
    if len(data) > limit:
      return None
    return json.loads(data.decode("utf-8"))
  except (OSError, ValueError):
    return None


def classify_file(path: pathlib.Path) -> Optional[str]:
  """The kind of one file, from its name and first bytes (None: nothing to show)."""
  name = path.name
  if name.endswith(".jsonl"):
    if name == run_layout.SOFTWARE_FILE:
      return None
    if name.startswith("scores"):
      # A detector's output; one that is not JSON still gets a page (that says so).
      return "npov_scores"
    first = _first_json(path)
    if not isinstance(first, dict):
      return None
    # A ClarifyDelphi transcript's turns carry their conversation's index ("conversation":
    # 0); a Diamante dialogue file's lines the conversation itself (a list of utterances).
    if "fused_situation" in first or ("situation" in first and "question" in first):
      return "clarify_chat"
    if isinstance(first.get("conversation"), list):
      return "diamante_dialogues"
    if "speaker" in first and "text" in first:
      return "diamante_chat"
    return None
  if not name.endswith(".json"):
    return None
  if name == run_layout.REWARD_CURVE_FILE:
    return "reward_curve"
  data = _json_keys(path)
  if not isinstance(data, dict) or not data:
    return "npov_results" if name == "results.json" else None
  if "machine" in data and "command" in data:
    return "experiment"
  if "preference/p@1" in data:
    return "diamante_metrics"
  values = list(data.values())
  if all(isinstance(v, dict) and "per_situation" in v for v in values):
    return "clarify_evaluation"
  if name == "results.json" or all(
      isinstance(v, dict) and all(isinstance(d, dict) and "hallucination" in d
                                  for d in v.values()) for v in values):
    return "npov_results"
  return None


def discover(roots: Roots) -> list[Found]:
  """Everything the folders hold that a view shows, in folder order."""
  found: list[Found] = []
  for index, folder, _, files in roots.walk():
    rel = roots.relative(index, folder)
    # Never walked into (`_SKIP_DIRS`).
    checkpoints = (folder / run_layout.CHECKPOINTS_DIR).is_dir()
    # A run: checkpoints, its operative config or TensorBoard events (not its train/ eval/).
    if checkpoints or run_layout.CONFIG_FILE in files or (
        any("tfevents" in f for f in files) and folder.name not in run_layout.TENSORBOARD_DIRS):
      found.append(Found("run", index, rel))
    # What `model_dirs.load` reads: an export or Hugging Face folder, or a run.
    if checkpoints or run_layout.EXPORT_CONFIG_FILE in files:
      found.append(Found("model", index, rel))
    for name in files:
      kind = classify_file(folder / name)
      if kind:
        found.append(Found(kind, index, f"{rel}/{name}" if rel else name))
  return found
