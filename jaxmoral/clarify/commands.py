"""`jaxmoral clarify <action> [--name=value ...]`: gin-bound library calls.

Each action is one keyword-only `@gin.configurable` function (`ACTIONS`); `--name=value` after
the action binds that function's argument, and gin files / bindings work as for every command.
docs/methods.md shows every action's command line; the dispatch (`--help`, checks of `OUTPUTS`
before an action starts) is `jaxmoral.action_commands`.
"""

from __future__ import annotations

from typing import Sequence

from jaxmoral import action_commands
from jaxmoral import gin_utils

ACTIONS: dict[str, tuple[str, str]] = {
    "train-model": ("jaxmoral.clarify.training", "train_clarify_model"),
    "train-ppo": ("jaxmoral.clarify.training", "train_clarify_ppo"),
    "evaluate": ("jaxmoral.clarify.evaluate", "evaluate_model_dirs"),
    "chat": ("jaxmoral.clarify.chat", "chat"),
    "chat-file": ("jaxmoral.clarify.chat", "chat_from_file"),
    "demo": ("jaxmoral.clarify.demo", "run_demo"),
}
# Parameters of an action's function that name what it writes: {name: is a directory}.
OUTPUTS: dict[str, dict[str, bool]] = {
    "train-model": {"model_dir": True},
    "train-ppo": {"model_dir": True},
    "evaluate": {"output_path": False},
    "chat": {"transcript_path": False},
    "chat-file": {"output_jsonl": False},
    "demo": {"workdir": True},
}
# Actions that show their own output (a conversation, a table, the demo's report).
PRINTS_OWN_RESULT = ("evaluate", "chat", "chat-file", "demo")


def main(action: str, rest: Sequence[str], gin_args: gin_utils.GinArgs) -> int:
  """Runs one action; prints its result as JSON (unless it prints its own)."""
  return action_commands.run_action("clarify", ACTIONS, OUTPUTS, action, rest, gin_args,
                                    prints_own_result=PRINTS_OWN_RESULT)
