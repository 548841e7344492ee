"""`jaxmoral diamante <action> [--name=value ...]`: gin-bound library calls (examples:
docs/methods.md); the tables that `jaxmoral.action_commands` dispatches on.
"""

from __future__ import annotations

from typing import Sequence

from jaxmoral import action_commands
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
# Actions that show their own output (a conversation) instead of a JSON result.
PRINTS_OWN_RESULT = ("chat", "self_chat", "candidates", "eval")


def main(action: str, rest: Sequence[str], gin_args: gin_utils.GinArgs) -> int:
  """Runs one action; prints its result as JSON."""
  return action_commands.run_action("diamante", ACTIONS, OUTPUTS, action, rest, gin_args,
                                    prints_own_result=PRINTS_OWN_RESULT)
