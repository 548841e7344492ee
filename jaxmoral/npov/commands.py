"""`jaxmoral npov <action> [--name=value ...]`: gin-bound library calls (examples: docs/methods.md).

The tables that `jaxmoral.action_commands` dispatches on (`--help`, flags, output checks).
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
