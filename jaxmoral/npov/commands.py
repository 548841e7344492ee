"""`jaxmoral npov <action> [--name=value ...]`: gin-bound library calls.

Each action is one keyword-only `@gin.configurable` function; `--name=value` after the action
binds that function's argument (same as `--gin.<module>.<function>.<name>=value`), and gin
files / bindings work as for every command::

  jaxmoral npov detect --input_path=responses.jsonl --output_path=scores.jsonl --detector=rouge
  jaxmoral npov detect --input_path=responses.jsonl --output_path=scores.jsonl \\
      --detector=salience --base_dir=BASE --generator_dir=PROMPT --heatmap_dir=heatmaps \\
      --roc_dir=roc
  jaxmoral npov detect --input_path=responses.jsonl --output_path=scores.jsonl \\
      --detector=classifier --base_dir=BASE --hallucination_dir=P1 --coverage_dir=P2
  jaxmoral npov evaluate --gin_file=configs/npov/eval_rouge_perspectrum.gin \\
      --output_dir=/tmp/npov_eval
  jaxmoral npov evaluate --kb_path=kb.jsonl --output_dir=/tmp/npov_eval --detectors=rouge
  jaxmoral npov train-classifier --base_dir=BASE --kb_path=kb.jsonl --error=hallucination \\
      --model_dir=P1
  jaxmoral npov demo --workdir=demo_out/npov

`jaxmoral npov <action> --help` lists the action's flags (read from its function's signature
and docstring) without loading any model code. What an action will write is checked to be
writable before it starts (`OUTPUTS`). The dispatch is `jaxmoral.action_commands`.
"""

from __future__ import annotations

from typing import Sequence

from jaxmoral import action_commands
from jaxmoral import gin_utils

ACTIONS: dict[str, tuple[str, str]] = {
    "detect": ("jaxmoral.npov.actions", "detect_file"),
    "evaluate": ("jaxmoral.npov.actions", "run"),
    "train-classifier": ("jaxmoral.npov.actions", "train_error_classifier"),
    "demo": ("jaxmoral.npov.demo", "run_demo"),
}
# Parameters of an action's function that name what it writes: {name: is a directory}.
OUTPUTS: dict[str, dict[str, bool]] = {
    "detect": {"output_path": False, "heatmap_dir": True, "roc_dir": True},
    "evaluate": {"output_dir": True},
    "train-classifier": {"model_dir": True},
    "demo": {"workdir": True},
}
# `detect` writes its scores (possibly thousands of records) and logs a summary instead.
PRINTS_OWN_RESULT = ("detect",)
# The detectors' configurables (RougeDetector, SalienceConfig, ...): the actions' modules
# import them only when they run one, after gin has parsed their bindings.
CONFIGURABLE_MODULES = ("jaxmoral.npov.detectors.rouge", "jaxmoral.npov.detectors.salience",
                        "jaxmoral.npov.detectors.classifier")


def main(action: str, rest: Sequence[str], gin_args: gin_utils.GinArgs) -> int:
  """Runs one action; prints its result as JSON (`detect`: a summary line on the log)."""
  return action_commands.run_action("npov", ACTIONS, OUTPUTS, action, rest, gin_args,
                                    prints_own_result=PRINTS_OWN_RESULT,
                                    configurable_modules=CONFIGURABLE_MODULES)
