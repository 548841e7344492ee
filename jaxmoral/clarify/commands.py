"""`jaxmoral clarify <action> [--name=value ...]`: gin-bound library calls.

Each action is one keyword-only `@gin.configurable` function; `--name=value` after the action
binds that function's argument (same as `--gin.<module>.<function>.<name>=value`), and gin
files / bindings work as for every command (a flag overrides a gin file)::

  jaxmoral clarify train-model --which=question --model_dir=/tmp/q --source=demo
  jaxmoral clarify train-model --gin_file=configs/clarify/tiny_cpu.gin --which=multitask \\
      --model_dir=/tmp/clarify/multitask
  jaxmoral clarify train-ppo --gin_file=configs/clarify/tiny_cpu.gin --model_dir=/tmp/ppo \\
      --question_model_dir=/tmp/q --answer_model_dir=/tmp/a --fusion_model_dir=/tmp/f \\
      --judge_model_dir=/tmp/j [--nli_model_dir=/tmp/n]
  jaxmoral clarify evaluate --question_model_dir=/tmp/q --answer_model_dir=/tmp/a \\
      --fusion_model_dir=/tmp/f --judge_model_dir=/tmp/j --ppo_model_dir=/tmp/ppo \\
      --split=dev --output_path=evaluation.json
  jaxmoral clarify chat --question_model_dir=/tmp/q --fusion_model_dir=/tmp/f \\
      --judge_model_dir=/tmp/j --judge_classes=wrong,okay,good --transcript_path=chat.jsonl
  jaxmoral clarify chat-file --input_jsonl=in.jsonl --output_jsonl=out.jsonl \\
      --question_model_dir=/tmp/q --fusion_model_dir=/tmp/f --judge_model_dir=/tmp/j \\
      [--answer_model_dir=/tmp/a]
  jaxmoral clarify demo --workdir=demo_out/clarify

Without a gin file, `train-model` trains a tiny T5 with AdamW (`--learning_rate`, default
1e-3; `--model_size=small`...) and `train-ppo` uses `PPOConfig()`, the original ClarifyDelphi
recipe, and its Adam (1e-5 decaying linearly over the run); with
configs/clarify/*.gin, the rates are the gin macros (`--gin.LEARNING_RATE=...`,
`--gin.PPO_LEARNING_RATE=...`). A comma list given to a sequence flag is a tuple of strings
(`--judge_classes=bad,ok,good` is `--judge_classes="('bad','ok','good')"`); train-ppo's
judge classes are the reward's: `--gin.reward.RewardConfig.judge_classes=bad,ok,good` is not
split, so write the tuple there.

`jaxmoral clarify <action> --help` lists the action's flags (read from its function's
signature and docstring) without loading any model. What an action will write is checked to
be writable before it starts (`OUTPUTS`). The dispatch is `jaxmoral.action_commands`.
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
