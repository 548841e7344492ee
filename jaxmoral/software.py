"""What software a process runs: jaxmoral's version and commit, and the libraries' versions.

For `jaxmoral --version`, the record each start of training appends to MODEL_DIR/software.jsonl
(which code trained a checkpoint, across resumes), and the fingerprint the processes of a
multi-host job compare (`partitioning.initialize_distributed`).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
from typing import Any, Optional

from jaxmoral import fileio
from jaxmoral import run_layout

# The libraries whose versions decide what programs jaxmoral builds and how it saves them.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def _version(distribution: str) -> Optional[str]:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git(package_dir: pathlib.Path, *args: str) -> Optional[str]:
  try:
    result = subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True,
                            text=True, timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return result.stdout.strip() if result.returncode == 0 else None


def source_commit(package_dir: pathlib.Path = PACKAGE_DIR) -> tuple[Optional[str], bool]:
  """`(commit, whether tracked files differ from it)` of the git checkout tracking the
  package's sources, or `(None, False)` for an installed copy (no checkout tracks them)."""
  if _git(package_dir, "ls-files", "--error-unmatch", "__init__.py") is None:
    return None, False
  commit = _git(package_dir, "rev-parse", "HEAD")
  status = _git(package_dir, "status", "--porcelain", "--untracked-files=no")
  return commit, bool(status)


def versions() -> dict[str, Optional[str]]:
  """`{distribution: version}` for jaxmoral and `LIBRARIES` (None: not installed)."""
  return {name: _version(name) for name in ("jaxmoral", *LIBRARIES)}


def _this_process() -> dict[str, Any]:
  commit, modified = source_commit()
  return {"commit": commit, "modified": modified, "versions": versions()}


def describe(record: Optional[dict[str, Any]] = None) -> str:
  """One line: 'jaxmoral 0.1.0 (commit 1a2b3c4d5e6f, modified), jax 0.10.2, ...', of this
  process or of a `record_start` record."""
  record = record or _this_process()
  found, commit, modified = record["versions"], record["commit"], record["modified"]
  where = f" (commit {commit[:12]}{', modified' if modified else ''})" if commit else ""
  parts = [f"jaxmoral {found.get('jaxmoral') or 'unknown'}{where}"]
  parts += [f"{name} {found.get(name) or 'not installed'}" for name in LIBRARIES]
  return ", ".join(parts)


def fingerprint() -> str:
  """What every process of a job must share: the libraries' versions and a digest of
  jaxmoral's own sources (a host at another commit, or with an edit, differs)."""
  digest = hashlib.sha256()
  for path in sorted([*PACKAGE_DIR.rglob("*.py"), *PACKAGE_DIR.rglob("*.cc")]):
    digest.update(str(path.relative_to(PACKAGE_DIR)).encode() + b"\0" + path.read_bytes())
  found = versions()
  return " ".join([*(f"{name}=={found[name]}" for name in LIBRARIES),
                   f"jaxmoral-sources={digest.hexdigest()}"])


def record_start(model_dir: str | os.PathLike[str], *, step: int) -> dict[str, Any]:
  """Appends (and returns) the record of a start of training at `step` to
  `model_dir/software.jsonl`: the time, the commit and the versions (`describe`)."""
  record = {"step": step,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **_this_process()}
  fileio.append_text(fileio.join(model_dir, run_layout.SOFTWARE_FILE),
                     json.dumps(record, sort_keys=True) + "\n")
  return record


def read_records(model_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """The records `record_start` wrote, oldest first ([] when there are none)."""
  path = fileio.join(model_dir, run_layout.SOFTWARE_FILE)
  lines = fileio.read_text(path).splitlines() if fileio.isfile(path) else []
  return [json.loads(line) for line in lines if line]
