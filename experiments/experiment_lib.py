"""What the fidelity experiments share: gin flags, bootstrap intervals, the verdict rule, the
machine, reports.

Each experiment (`experiments/<name>.py`) is one keyword-only `@gin.configurable` function run
by `main(...)` below with T5X's flags (`--gin_file=`, `--gin.NAME=VALUE`), as the `jaxmoral`
command line runs library functions. It writes `<results_dir>/<name>.md` (the table),
`<name>.json` (every number) and `<name>.png` (the plot).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import pathlib
import platform
import re
import shlex
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import gin
import numpy as np

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # `python experiments/x.py` from a clone, not installed
  sys.path.insert(0, str(PROJECT_ROOT))

# Before JAX is imported: no TPU runtime start-up noise where libtpu is installed without a TPU.
from jaxmoral import runtime  # noqa: E402  pylint: disable=wrong-import-position
runtime.platforms_without_absent_tpu()
from jaxmoral import cli  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import checkpoints  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import fileio  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import gin_files  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import gin_utils  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import integrity  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import metrics as metrics_lib  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import preemption  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import run_dirs  # noqa: E402  pylint: disable=wrong-import-position
from jaxmoral import run_layout  # noqa: E402  pylint: disable=wrong-import-position



def _results_in_workdir(gin_args: gin_utils.GinArgs) -> None:
  """Where the report goes unless the command line binds RESULTS_DIR: the run's own WORKDIR,
  not the checked-in experiments/results/ (a record is written there on purpose, with
  --gin.RESULTS_DIR="'experiments/results'"). A config without both macros is left alone."""
  if any(re.match(r"\s*RESULTS_DIR\s*=", b) for b in gin_args.bindings):
    return
  config = gin.config._CONFIG  # pylint: disable=protected-access
  workdir = config.get(("WORKDIR", "gin.macro"), {}).get("value")
  if workdir is not None and ("RESULTS_DIR", "gin.macro") in config:
    gin.bind_parameter(("RESULTS_DIR", "gin.macro", "value"), workdir)

logger = logging.getLogger(__name__)


def _quote(arg: str) -> str:
  """A shell word, `--gin.X="'value'"` style for gin string values."""
  name, sep, value = arg.partition("=")
  if sep and name.startswith("--") and re.fullmatch(r"[\w./:,'{} -]*", value) and \
      shlex.quote(value) != value:
    return f'{name}="{value}"'
  return shlex.quote(arg)


def command_line(argv: Sequence[str]) -> str:
  """The command as a user would type it again (from the project root)."""
  script = os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd())
  return " ".join(["python", shlex.quote(script), *(_quote(a) for a in argv)])


def main(run: Callable[..., dict[str, Any]], argv: Optional[Sequence[str]] = None) -> int:
  """Parses gin flags, then calls the experiment's gin-bound `run(command=...)`.

  Args:
    run: The experiment's `@gin.configurable` entry function (takes `command`).
    argv: Arguments without the program name (default `sys.argv[1:]`).

  Returns:
    The exit status.
  """
  from jaxmoral import compilation_cache  # pylint: disable=import-outside-toplevel
  argv = list(sys.argv[1:] if argv is None else argv)
  gin_args, rest = gin_utils.split_gin_args(argv)
  if rest or not gin_args.files:
    problem = f"unexpected arguments: {rest}" if rest else "no --gin_file given"
    print(f"usage: {command_line([])} --gin_file=configs/experiments/<name>.gin "
          f"[--gin.NAME=VALUE ...]\nerror: {problem}", file=sys.stderr)
    return 2
  cli.quiet_logs(force=True)
  runtime.tensorflow_for_input_pipelines_only()
  cache_dir = compilation_cache.resolve_cache_dir(None)
  if cache_dir is not None:
    compilation_cache.enable(cache_dir)
  command = command_line(argv)
  try:
    gin_utils.parse_gin(gin_args)
    _results_in_workdir(gin_args)
    gin_utils.check_required()
    print(f"command: {command}", flush=True)
    run(command=command)
  except (ValueError, OSError, TypeError) as error:
    # A user's mistake (a data folder that is not there, a bad value) is one line, as on the
    # command line; a bug keeps its traceback.
    message = cli.user_error_message(error)
    if message is None:
      raise
    print(f"error: {message}", file=sys.stderr)
    return 2
  except preemption.Stopped as stopped:  # SIGTERM / SIGINT in a stage: saved, rerun resumes.
    print(cli.error_message(stopped), file=sys.stderr)
    return stopped.exit_status
  print(f"command: {command}", flush=True)
  return 0


# -- intervals ------------------------------------------------------------------------------


STAGE_FILE = "experiment_stage.json"


def checkpoint_every(steps: int, *, saves: int) -> int:
  """The save period that gives a stage of `steps` steps `saves` checkpoints, the last at its
  end: a stopped experiment resumes near where it stopped, not from the stage's start.

  Raises:
    ValueError: `steps` or `saves` below 1.
  """
  if int(steps) < 1 or int(saves) < 1:
    raise ValueError(f"checkpoint_every: steps and saves must be >= 1, got {steps}, {saves}")
  return -(-int(steps) // int(saves))


def changed_bindings(model_dir: str) -> list[str]:
  """The gin bindings that differ between the run `model_dir` was trained under (its
  config.gin) and this process's: "- saved" and "+ now" lines ([] without a config.gin)."""
  import gin  # pylint: disable=import-outside-toplevel
  path = fileio.join(model_dir, run_layout.CONFIG_FILE)
  if not fileio.isfile(path):
    return []
  saved = fileio.read_text(path)
  try:
    return gin_files.binding_changes(saved, gin.config_str())
  except ValueError as error:
    return [f"? {path}: {error}"]


def warn_changed_bindings(model_dir: str, what: str) -> None:
  """Says which bindings a reused or resumed run was trained under otherwise: a changed
  OPTIMIZER does not retrain a finished stage of the same WORKDIR, and must not pass
  unnoticed. (A warning, not an error: a new PPO setting or evaluation binding reuses the
  supervised stages by design.)"""
  changed = changed_bindings(model_dir)
  if changed:
    logger.warning("%s: %s under other gin bindings than this run's (another WORKDIR trains "
                   "it anew):\n  %s", model_dir, what, "\n  ".join(changed))


def train_stage(model_dir: str, steps: int, train: Callable[[], Any]) -> dict[str, Any]:
  """Runs `train()`, which trains the run `model_dir` to `steps`, unless that run already has
  an intact checkpoint at `steps` (a rerun reuses finished stages; an unfinished one resumes
  from its last checkpoint inside `train`).

  Returns:
    {"seconds": the training's time (now, or when it first ran; of this invocation only when
    it resumed), "reused": whether it was reused, "resumed_from_step": the step an unfinished
    earlier invocation had saved (absent for a fresh start), "result": the numbers of
    `train()`'s result mapping}, kept in `STAGE_FILE`.
  """
  record_path = os.path.join(model_dir, STAGE_FILE)
  checkpoint_dir = run_dirs.checkpoints_dir(model_dir)
  earlier = [s for s in run_dirs.saved_steps(model_dir) if s < int(steps)]
  if fileio.isdir(os.path.join(checkpoint_dir, str(int(steps)))):
    try:
      checkpoints.verify_step(checkpoint_dir, int(steps), full=False)
    except integrity.CheckpointIntegrityError as e:
      logger.warning("%s; training again", e)
    else:
      logger.info("%s: reusing its finished run (step %d)", model_dir, steps)
      warn_changed_bindings(model_dir, "reused as it was trained")
      try:
        with fileio.open(record_path) as f:
          return {**json.load(f), "reused": True}
      except (OSError, ValueError):
        return {"seconds": float("nan"), "reused": True, "result": {}}
  if earlier:
    warn_changed_bindings(model_dir, f"resumed from step {earlier[-1]}, which was trained")
  tick = time.time()
  result = train()
  numbers = result if isinstance(result, Mapping) else {}  # Some stages return a path.
  record = {"seconds": time.time() - tick, "reused": False,
            **({"resumed_from_step": earlier[-1]} if earlier else {}),
            "result": {k: v for k, v in numbers.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}}
  fileio.write_text(record_path, json.dumps(record, indent=2))
  return record


def mean_ci(values: Any, *, num_resamples: int = 1000, seed: int = 0
            ) -> metrics_lib.BootstrapCI:
  """95 % percentile bootstrap interval of the mean of per-unit values (resampling units)."""
  values = np.asarray(values, np.float64)
  return metrics_lib.bootstrap_ci(lambda x: x.mean(axis=1), values, vectorized=True,
                                  num_resamples=num_resamples, seed=seed)


def paired_diff_ci(a: Any, b: Any, *, num_resamples: int = 1000, seed: int = 0
                   ) -> metrics_lib.BootstrapCI:
  """Interval of mean(a) - mean(b) over the same units, resampled together (paired)."""
  diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return mean_ci(diff, num_resamples=num_resamples, seed=seed)


def fmt_ci(ci: Any, digits: int = 3) -> str:
  """`0.113 [0.080, 0.150]`."""
  estimate, low, high = ci
  return f"{estimate:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def fmt(ci: Optional[dict[str, float]], digits: int = 3) -> str:
  """`fmt_ci` of a `ci_dict` ("—" for None)."""
  if ci is None:
    return "—"
  return fmt_ci((ci["estimate"], ci["low"], ci["high"]), digits)


def ci_dict(ci: metrics_lib.BootstrapCI) -> dict[str, float]:
  return {"estimate": ci.estimate, "low": ci.low, "high": ci.high,
          "num_resamples": ci.num_resamples, "num_skipped": ci.num_skipped}


# -- the verdict rule -----------------------------------------------------------------------

# Printed under every experiment's verdict: the one rule `claim_verdict` applies.
VERDICT_RULE = (
    "Rule: each part of the claim is a 95 % interval that must lie wholly above its baseline "
    "(chance, or 0 for a paired difference). A part is shown when the interval's low end is "
    "above the baseline, contradicted when its high end is below it, and not shown otherwise; "
    "a part this run has no interval for (a slice it did not measure, a model it did not "
    "train) is not measured. Every claim names its nulls, systems that know nothing of what "
    "the claim is about (an untrained model, the input's length, the model before the step "
    "the claim credits); a part against a null is the paired interval of the difference over "
    "the same units, measured in the same run. The verdict is \"agrees\" only when every "
    "measured part is shown, none is missing that the claim requires, and at least one was "
    "measured; \"disagrees\" when any part is contradicted; otherwise \"not shown\", naming "
    "the parts that are not.")

AGREES, DISAGREES, NOT_SHOWN = "agrees", "disagrees", "not shown"
SHOWN, CONTRADICTED, NOT_MEASURED = "shown", "contradicted", "not measured"


@dataclasses.dataclass(frozen=True)
class ClaimPart:
  """One part of a paper's claim: a 95 % interval that must lie wholly above `baseline`.

  Attributes:
    name: What the part asserts, e.g. "joint P@1 by preference above chance".
    interval: {"estimate", "low", "high"} (a `ci_dict`), or None where this run has none.
    baseline: The value the whole interval must exceed: chance (0.5 for a ROC AUC, 1/items
      for P@1) or 0 for a paired difference against another system.
    required: Whether the claim fails without it. False for parts a run may leave out by
      design (a test slice it did not build): unmeasured, they are named and skipped.
    digits: Decimals when the part is written out.
    null: The null the part's paired interval is against, named (e.g. "untrained model",
      "input length", "SFT"), or None for a part against chance or a rival system.
      `claim_verdict` refuses a claim none of whose parts names one.
  """
  name: str
  interval: Optional[Mapping[str, float]]
  baseline: float = 0.0
  required: bool = True
  digits: int = 3
  null: Optional[str] = None

  def __post_init__(self):
    if self.interval is not None:
      low, high = float(self.interval["low"]), float(self.interval["high"])
      if not low <= high:
        raise ValueError(f"ClaimPart {self.name!r}: interval low {low} > high {high}")

  @property
  def status(self) -> str:
    """SHOWN | CONTRADICTED | NOT_SHOWN | NOT_MEASURED, by the rule (`VERDICT_RULE`)."""
    if self.interval is None:
      return NOT_MEASURED
    if float(self.interval["low"]) > self.baseline:
      return SHOWN
    if float(self.interval["high"]) < self.baseline:
      return CONTRADICTED
    return NOT_SHOWN

  def describe(self) -> str:
    """`name: +0.077 [+0.050, +0.107] vs 0.067: not shown`."""
    if self.interval is None:
      return f"{self.name}: {NOT_MEASURED}"
    i, d = self.interval, self.digits
    return (f"{self.name}: {i['estimate']:+.{d}f} [{i['low']:+.{d}f}, {i['high']:+.{d}f}] vs "
            f"{self.baseline:g}: {self.status}")


def claim_verdict(parts: Sequence[ClaimPart]) -> tuple[str, str]:
  """The verdict on a claim made of `parts`, by `VERDICT_RULE`.

  Args:
    parts: (P,) the claim's parts, each an interval against its baseline.

  Returns:
    (verdict, why): verdict AGREES | DISAGREES | NOT_SHOWN; why names every part with its
    interval and status, the parts that keep it from agreeing first.

  Raises:
    ValueError: No part names a null (`ClaimPart.null`): a claim shown only against chance
      would be reached too by a system that knows nothing (an experiment's design error).
  """
  if parts and not any(p.null for p in parts):
    raise ValueError("claim_verdict: no part of the claim names its null (ClaimPart.null): "
                     f"{[p.name for p in parts]}")
  statuses = [p.status for p in parts]
  measured = [s for s in statuses if s != NOT_MEASURED]
  missing = [p for p, s in zip(parts, statuses) if s == NOT_MEASURED and p.required]
  if any(s == CONTRADICTED for s in statuses):
    verdict = DISAGREES
  elif measured and all(s == SHOWN for s in measured) and not missing:
    verdict = AGREES
  else:
    verdict = NOT_SHOWN
  failing = [s in (CONTRADICTED, NOT_SHOWN) or (s == NOT_MEASURED and p.required)
             for p, s in zip(parts, statuses)]
  ordered = ([p for p, f in zip(parts, failing) if f] +
             [p for p, f in zip(parts, failing) if not f])
  why = "; ".join(p.describe() for p in ordered)
  if not measured:
    why = f"no part measured{': ' if why else ''}{why}"
  return verdict, why


# -- the machine and the report -------------------------------------------------------------


def machine() -> dict[str, Any]:
  """Date, CPU, cores, load and JAX devices: where the numbers were measured."""
  import jax  # pylint: disable=import-outside-toplevel
  cpu = platform.processor() or platform.machine()
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    found = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    cpu = found.group(1).strip() if found else cpu
  except OSError:
    pass
  try:
    load = tuple(round(x, 2) for x in os.getloadavg())
  except OSError:
    load = None
  device = jax.devices()[0]
  return {"date": datetime.datetime.now().astimezone().strftime("%a %Y-%m-%d %H:%M:%S %Z"),
          "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "load_average": load,
          "jax": jax.__version__, "devices": f"{jax.device_count()} x {device.device_kind}",
          "platform": device.platform}


def machine_line(info: dict[str, Any]) -> str:
  return (f"{info['date']}; {info['cpu']}, {info['cores']} cores (load average at the end "
          f"{info['load_average']}); JAX {info['jax']} on {info['devices']}")


def report_head(results: Mapping[str, Any], *, name: str) -> list[str]:
  """The first lines of every experiment's Markdown report: its name and date, the machine
  (`machine_line`) and the command that produced it."""
  m = results["machine"]
  return [f"#### {name}: {m['date']}", "", f"Machine: {machine_line(m)}.", "", "Command:", "",
          f"    {results['command']}", ""]


def write_results(results: dict[str, Any], *, results_dir: str, name: str, title: str,
                  plot: Callable[..., str], report: Callable[..., str]) -> dict[str, Any]:
  """An experiment's outputs: `plot(results, path, title=title)` drawn into `<name>.png` (its
  path kept in `results["plot"]`), `report(results, name=name)` written to `<name>.md` and
  printed, every number in `<name>.json`.

  Returns:
    `results`, with "plot".
  """
  fileio.makedirs(results_dir)
  results["plot"] = plot(results, os.path.join(results_dir, f"{name}.png"), title=title)
  markdown = report(results, name=name)
  md_path = os.path.join(results_dir, f"{name}.md")
  json_path = os.path.join(results_dir, f"{name}.json")
  fileio.write_text(md_path, markdown + "\n")
  fileio.write_text(json_path, json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
  print(markdown)
  print(f"\nwrote {md_path}, {json_path}, {results['plot']}")
  return results
