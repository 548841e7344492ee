"""`jaxmoral diamante <action> [--name=value ...]`: gin-bound library calls.

Each action is one keyword-only `@gin.configurable` function; `--name=value` after the action
binds that function's argument (same as `--gin.<function>.<name>=value`), and gin files /
bindings work as for every command::

  jaxmoral diamante train --gin_file=configs/diamante/tiny_cpu.gin --gin.MODEL_DIR=/tmp/dm
  jaxmoral diamante train --gin_file=configs/diamante/generator_tiny_cpu.gin --gin.MODEL_DIR=/tmp/g
  jaxmoral diamante eval --model_dir=/tmp/dm --test_path=test.jsonl
  jaxmoral diamante chat --model_dir=/tmp/dm --transcript_path=/tmp/chat.jsonl
  jaxmoral diamante self_chat --model_dir=/tmp/dm --opening="Hi!" --num_rounds=6 \\
      --transcript_path=/tmp/self.jsonl
  jaxmoral diamante demo --workdir=demo_out/diamante

`jaxmoral diamante <action> --help` lists the action's flags (read from its function's
signature and docstring). What an action will write is checked to be writable before it
starts (`OUTPUTS`).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Sequence

from jaxmoral import gin_utils

ACTIONS: dict[str, tuple[str, str]] = {
    # The core run with gin/runs/diamante.gin (joint model) or generator_tiny_cpu.gin.
    "train": ("jaxmoral.runs", "train_run"),
    "candidates": ("jaxmoral.diamante.candidates", "generate_candidates"),
    "eval": ("jaxmoral.diamante.evaluate", "evaluate"),
    "chat": ("jaxmoral.diamante.chat", "chat"),
    "self_chat": ("jaxmoral.diamante.chat", "self_chat"),
    "demo": ("jaxmoral.diamante.demo", "run_demo"),
}
# Parameters of an action's function that name what it writes: {name: is a directory}.
# `train` is left out: runs.train_run checks its own MODEL_DIR.
OUTPUTS: dict[str, dict[str, bool]] = {
    "candidates": {"output_path": False},
    "eval": {"output_path": False},
    "chat": {"transcript_path": False},
    "self_chat": {"transcript_path": False},
    "demo": {"workdir": True},
}
HELP_FLAGS = ("-h", "--help")


def usage(action: str) -> str:
  """The `--help` text of an action: its function's flags."""
  module, function = ACTIONS[action]
  return gin_utils.function_usage(module, function, prog=f"jaxmoral diamante {action}")


def flag_bindings(function: str, flags: Sequence[str]) -> list[str]:
  """`--name=value` flags -> gin bindings of `function.name` (bare words become strings)."""
  gin_args, rest = gin_utils.split_gin_args([f"--gin.{function}.{flag[2:]}" for flag in flags
                                             if flag.startswith("--") and "=" in flag])
  bad = [f for f in flags if not (f.startswith("--") and "=" in f)]
  if bad or rest:
    raise ValueError(f"diamante: expected --name=value flags, got {bad or rest}")
  return list(gin_args.bindings)


def main(action: str, rest: Sequence[str], gin_args: gin_utils.GinArgs) -> int:
  """Runs one action; prints its result as JSON."""
  if action not in ACTIONS:
    raise ValueError(f"diamante: unknown action {action!r}; known: {sorted(ACTIONS)}")
  module, function = ACTIONS[action]
  if any(arg in HELP_FLAGS for arg in rest):
    print(usage(action))
    return 0
  fn = getattr(importlib.import_module(module), function)
  gin_utils.parse_gin(gin_args, extra_bindings=flag_bindings(f"{module}.{function}", rest))
  gin_utils.check_required()
  for name, directory in OUTPUTS.get(action, {}).items():
    path = gin_utils.bound_value(f"{module}.{function}", name)
    if isinstance(path, (str, os.PathLike)):
      gin_utils.check_writable(path, directory=directory)
  result = fn()
  if action not in ("chat", "self_chat"):
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
  return 0
