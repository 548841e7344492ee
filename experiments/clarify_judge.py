"""ClarifyDelphi: can a sharper judge be trained at this scale?

The defeasibility reward is a divergence between two judge distributions, so it can point no
further than its judge knows. The configs of record let one multi-task model play the judge;
on its held-out silver labels it is no better than the majority class (bench/RESULTS.md).
This trains the judge as a model of its own (`dedicated_roles` with "judge", as the config
names it: experiments/clarify_table4.py then reuses the run) from the same base, keeps
`evaluations` checkpoints along the way, and measures each on the silver labels its training
held out (one pair in 10, by hash): accuracy against the majority class's (the null, a paired
interval over examples), mean entropy and top probability. When the config's WORKDIR already
holds a multi-task model, its judge is measured beside it on the same examples.

  python experiments/clarify_judge.py --gin_file=configs/experiments/clarify_judge_cpu.gin \\
      --gin.INIT_CHECKPOINT="'/work/runs/pretrain_mini_200'"

Writes `<RESULTS_DIR>/<NAME>.md`, `.json` and `.png`; the judge run goes under WORKDIR.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Mapping

import gin
import numpy as np

import experiment_lib as common  # puts the project root on sys.path
import clarify_reward_probe  # reads the bindings of clarify_table4's configurable
import clarify_table4  # registers that configurable (the config binds it)

logger = logging.getLogger("clarify_judge")

CLAIM = ("a judge trained as a model of its own is right on its held-out silver labels more "
         "often than their majority class")


@gin.configurable(module="clarify_judge")
def run_experiment(*, name: str, results_dir: str, evaluations: int = 6,
                   num_resamples: int = 1000, command: str = "") -> dict[str, Any]:
  """Trains the dedicated judge, measures its saved checkpoints; writes and returns the results.

  Args:
    name: Name of the result files (NAME).
    results_dir: Where `<name>.md/.json/.png` go.
    evaluations: Checkpoints measured, evenly spaced, the last at the end of training.
    num_resamples: Bootstrap resamples.
    command: The command line (written into the report).

  Raises:
    ValueError: The config trains no judge of its own (`dedicated_roles` lacks "judge").
  """
  # pylint: disable=import-outside-toplevel
  from jaxmoral import run_dirs
  from jaxmoral.clarify import formats
  from jaxmoral.clarify import models
  from jaxmoral.clarify import training
  # pylint: enable=import-outside-toplevel
  bound = clarify_reward_probe._bound  # pylint: disable=protected-access
  dedicated = dict(bound("dedicated_roles") or {})
  if "judge" not in dedicated:
    raise ValueError("clarify_judge: clarify_table4.run_experiment.dedicated_roles has no "
                     "'judge'; use configs/experiments/clarify_judge_cpu.gin or add one")
  steps = int(dedicated["judge"])
  if bound("max_stage_steps") is not None:
    steps = min(steps, int(bound("max_stage_steps")))
  workdir, reward_config = bound("workdir"), bound("reward_config")
  data_dir, seed = bound("data_dir", "../shared/data"), bound("seed", 0)
  lengths = dict(bound("feature_lengths") or {"inputs": 128, "targets": 32})
  classes = reward_config.judge_classes
  started = time.time()
  judge_dir = clarify_table4.model_dir(workdir, "judge")
  every = common.checkpoint_every(steps, saves=evaluations)
  stage = common.train_stage(judge_dir, steps, lambda: training.train_clarify_model(
      which="judge", model_dir=judge_dir, model_config=bound("model_config"),
      optimizer=bound("optimizer"), train_steps=steps, batch_size=bound("batch_size", 32),
      feature_lengths=lengths, source=data_dir, split="train", judge_classes=classes,
      checkpoint_every=every, keep_checkpoints=evaluations,
      log_every=bound("log_every", 50), seed=seed, init_checkpoint=bound("init_checkpoint")))
  examples = clarify_table4.heldout_judge_examples(data_dir, judge_classes=classes)
  inputs = [formats.judge_input(s) for s, _ in examples]
  labels = [label for _, label in examples]

  def quality(run_dir: str, step: Any = None) -> dict[str, Any]:
    model = models.load_model(run_dir, step=step, input_length=lengths["inputs"],
                              batch_size=reward_config.batch_size)
    return clarify_table4.judge_quality(
        model.label_distribution(inputs, classes, require_single_token=True), labels,
        num_resamples=num_resamples, seed=seed)

  curve = {int(step): quality(judge_dir, int(step)) for step in run_dirs.saved_steps(judge_dir)}
  multitask_dir = clarify_table4.model_dir(workdir, "multitask")
  multitask = quality(multitask_dir) if common.fileio.isdir(multitask_dir) else None
  last = curve[max(curve)]
  parts = [common.ClaimPart(f"dedicated judge accuracy minus the majority class's, step "
                            f"{max(curve)}", last["accuracy_minus_majority"],
                            null="majority class")]
  word, why = common.claim_verdict(parts)
  results = {"command": command, "machine": common.machine(),
             "timings": {"train_s": stage["seconds"], "total_s": time.time() - started},
             "setup": {"workdir": workdir, "judge_dir": judge_dir, "data_dir": data_dir,
                       "steps": steps, "batch_size": bound("batch_size", 32),
                       "init_checkpoint": bound("init_checkpoint"), "classes": list(classes),
                       "num_resamples": num_resamples, "seed": seed},
             "curve": curve, "multitask": multitask, "verdict": word, "verdict_why": why}
  return common.write_results(results, results_dir=results_dir, name=name,
                              title=f"ClarifyDelphi judge of its own ({name})", plot=plot,
                              report=report)


def report(results: Mapping[str, Any], *, name: str) -> str:
  """The Markdown section for bench/RESULTS.md."""
  s = results["setup"]
  rows = [f"| {step} | {q['accuracy']:.3f} | {q['majority_class_accuracy']:.3f} | "
          f"{common.fmt(q['accuracy_minus_majority'])} | {q['mean_entropy_nats']:.3f} | "
          f"{q['mean_top_probability']:.3f} |" for step, q in sorted(
              ((int(k), v) for k, v in results["curve"].items()))]
  multitask = results["multitask"]
  return "\n".join([
      *common.report_head(results, name=name),
      f"Setup: a judge of its own trained {s['steps']} steps (batch {s['batch_size']}) from "
      f"`{s['init_checkpoint']}` on the silver judge pairs; each saved checkpoint scored on "
      f"the pairs its training held out (entropy in nats, uniform "
      f"{np.log(len(s['classes'])):.3f}); 95 % bootstrap intervals over examples "
      f"({s['num_resamples']} resamples).", "",
      "| step | accuracy | majority class | accuracy − majority (paired) | mean entropy | "
      "mean top probability |", "|---|---|---|---|---|---|", *rows, "",
      ("The same WORKDIR's multi-task judge: " + clarify_table4.judge_line(multitask)
       if multitask else "No multi-task model in WORKDIR: its judge is not measured here."),
      "", f"Claim: {CLAIM}.", "", common.VERDICT_RULE, "",
      f"This run: **{results['verdict']}** ({results['verdict_why']}).", "",
      "Seconds: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in results["timings"].items())
      + ".", "", f"Plot: `{results['plot']}`."])


def plot(results: Mapping[str, Any], path: str, *, title: str) -> str:
  """Held-out accuracy with its interval against the steps, beside the majority class's."""
  from jaxmoral import pictures  # pylint: disable=import-outside-toplevel
  plt = pictures.pyplot()
  curve = sorted((int(k), v) for k, v in results["curve"].items())
  steps = np.array([k for k, _ in curve])
  acc = np.array([v["accuracy"] for _, v in curve])
  diff = [v["accuracy_minus_majority"] or {} for _, v in curve]
  low = np.array([a - (d["estimate"] - d["low"]) if d else a for a, d in zip(acc, diff)])
  high = np.array([a + (d["high"] - d["estimate"]) if d else a for a, d in zip(acc, diff)])
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, acc, "o-", color="tab:blue", label="dedicated judge")
  ax.fill_between(steps, low, high, color="tab:blue", alpha=0.2)
  ax.axhline(curve[-1][1]["majority_class_accuracy"], color="k", ls="--", lw=0.8,
             label="majority class")
  if results["multitask"]:
    ax.axhline(results["multitask"]["accuracy"], color="tab:gray", ls=":", label="multi-task")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out accuracy")
  ax.legend(fontsize=8)
  fig.suptitle(title)
  return pictures.save_figure(fig, path, dpi=110)


if __name__ == "__main__":
  sys.exit(common.main(run_experiment))
