"""ClarifyDelphi, Table 4 shape: does PPO on the defeasibility reward beat the supervised model?

Pyatkin et al. (ACL 2023), Table 4: the question generator tuned with PPO against the
defeasibility reward (JSD of the judge's verdicts for the situation updated by an imagined
weakener and strengthener answer) asks questions with a higher average JSD and more judgment
flips than the supervised generator and the baselines. Checked here on the shared δ-Clarify
data (train situations for the models and PPO, held-out `dev` situations for the table), from
a span-corruption-pretrained T5 (INIT_CHECKPOINT), with the library's own commands (what
`jaxmoral clarify demo` runs on the bundled corpus):

1. question, answer, fusion, judge, NLI and relevance models fine-tuned from INIT_CHECKPOINT
   (`training.train_clarify_model`; one multi-task model or one per role);
2. PPO of the question generator against the reward (`training.train_clarify_ppo`);
3. every system of the paper's comparison (`baselines.all_generators`: why, fine-tuned,
   pipeline with and without NLI, discriminator, PPO), plus the supervised and PPO generators
   decoded as PPO's rollouts decode (temperature and top-p of the PPOConfig) and greedily, on
   `max_eval_situations` held-out situations, all scored by the same reward pipeline: average
   JSD (0 for NLI-filtered answers, as the reward pays), JSD without the filter, % judgment
   flips, % filtered, distinct-1/2/3 and wh-word shares, with 95 % bootstrap intervals over
   situations and paired intervals of PPO minus the supervised generator.

  python experiments/clarify_table4.py --gin_file=configs/experiments/clarify_table4_cpu.gin \
      --gin.INIT_CHECKPOINT="'/work/runs/pretrain_mini'"

Writes `<RESULTS_DIR>/<NAME>.md`, `.json` and `.png`; runs go under WORKDIR (a rerun resumes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import gin
import numpy as np

import experiment_lib as common  # puts the project root on sys.path

logger = logging.getLogger("clarify_table4")

ROLES = ("question", "answer", "fusion", "judge", "nli", "relevance")
MEAN_METRICS = (("jsd", "avg JSD"), ("jsd_unfiltered", "JSD unfiltered"),
                ("flips_pct", "% flips"), ("filtered_pct", "% filtered"),
                # Questions that end in "?": a policy that games the reward stops asking.
                ("question_pct", "% questions"))
WH_SHOWN = ("what", "why", "how", "who", "other")
# A PPO policy whose share of questions falls by more than this (the whole interval) has
# gamed the reward; its JSD is then no evidence about clarification questions.
QUESTION_DROP_POINTS = 10.0
# Every system the table can hold: the paper's comparison, then the supervised and PPO
# generators decoded as the rollouts decode and greedily (diagnostics).
SYSTEMS = ("why", "finetuned", "pipeline", "pipeline_no_nli", "discriminator", "ppo",
           "finetuned@rollout", "ppo@rollout", "finetuned@greedy", "ppo@greedy")
PAPER = ("paper (Pyatkin et al. 2023, Table 4): PPO raises the average JSD and the % of "
         "judgment flips over the supervised question generator")
# The avg JSD of the paper's Table 4 systems: the reward's scale with its judge (Delphi).
PAPER_JSD_RANGE = (0.14, 0.19)
# The diagnosis's thresholds (`diagnosis`), at the conventions of trl's PPO logs: clipping
# above a fifth of the tokens or an approx-KL above 0.02 per epoch means steps too large for
# the trust region; a value head that explains under a tenth of the returns' variance gives
# advantages that are mostly noise; entropy halved or up by half is collapse or drift.
CLIPFRAC_HIGH = 0.2
APPROX_KL_HIGH = 0.02
EXPLAINED_VARIANCE_LOW = 0.1
ENTROPY_RATIO_BAND = (0.5, 1.5)
SETTINGS = "settings"
CAPACITY = "capacity"


def supervised_models(*, separate_models: bool,
                      dedicated_roles: Optional[Mapping[str, int]],
                      train_steps: int) -> dict[str, int]:
  """{supervised model ("multitask" or a role): its training steps}.

  Raises:
    ValueError: an unknown role, a step count below 1, or both `separate_models` and
      `dedicated_roles`.
  """
  dedicated = dict(dedicated_roles or {})
  if separate_models and dedicated:
    raise ValueError("separate_models already trains every role alone; drop dedicated_roles")
  unknown = sorted(set(dedicated) - set(ROLES))
  if unknown:
    raise ValueError(f"dedicated_roles: unknown role(s) {unknown}; roles are {list(ROLES)}")
  if any(int(n) < 1 for n in dedicated.values()):
    raise ValueError(f"dedicated_roles: steps must be >= 1, got {dedicated}")
  if separate_models:
    return {role: train_steps for role in ROLES}
  # The multi-task model is trained whenever a role is left to it.
  shared = {"multitask": train_steps} if set(ROLES) - set(dedicated) else {}
  return {**shared, **{role: int(dedicated[role]) for role in ROLES if role in dedicated}}


def packed_stages(pack: bool | Sequence[str], models_steps: Mapping[str, int]
                  ) -> frozenset[str]:
  """The supervised stages `run_experiment(pack=...)` packs: all, none, or those named.

  Raises:
    ValueError: a named stage that this experiment does not train.
  """
  if isinstance(pack, bool):
    return frozenset(models_steps) if pack else frozenset()
  names = [pack] if isinstance(pack, str) else list(pack)
  unknown = sorted(set(names) - set(models_steps))
  if unknown:
    raise ValueError(f"clarify_table4.run_experiment.pack: {unknown} not among the supervised "
                     f"stages {list(models_steps)}; give True, False or some of them")
  return frozenset(names)


def evaluated_systems(systems: Optional[Sequence[str]]) -> tuple[str, ...]:
  """The systems to evaluate, in `SYSTEMS` order (checked before any training).

  Raises:
    ValueError: an unknown or repeated name, or none.
  """
  if systems is None:
    return SYSTEMS
  if isinstance(systems, str):
    systems = (systems,)
  unknown = sorted(set(systems) - set(SYSTEMS))
  if unknown or not systems or len(set(systems)) != len(systems):
    raise ValueError(f"clarify_table4.run_experiment.systems: {list(systems)} (unknown: "
                     f"{unknown}); give distinct names of {list(SYSTEMS)}")
  return tuple(s for s in SYSTEMS if s in systems)


def model_dir(workdir: str, which: str) -> str:
  """The run directory of a supervised model ("multitask" or a role)."""
  return os.path.join(workdir, f"{which}_model")


def role_model_dirs(workdir: str, models_steps: Mapping[str, int]) -> dict[str, str]:
  """{role: the run directory that plays it} for the models of `supervised_models`."""
  return {role: model_dir(workdir, role if role in models_steps else "multitask")
          for role in ROLES}


def trained_role_dirs(workdir: str, models_steps: Mapping[str, int], *,
                      reader: str) -> dict[str, str]:
  """`role_model_dirs`, refused in one line naming the missing runs when this config's table
  run has not trained them yet (`reader`: who reads them, for the message)."""
  role_dir = role_model_dirs(workdir, models_steps)
  missing = sorted({d for d in role_dir.values() if not common.fileio.isdir(d)})
  if missing:
    raise FileNotFoundError(f"{', '.join(missing)}: run experiments/clarify_table4.py with "
                            f"this config first ({reader} reads its models)")
  return role_dir


def judge_quality(distributions: np.ndarray, labels: Sequence[int], *,
                  num_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
  """Accuracy, mean entropy (nats; log 3 = 1.099 is uniform) and mean top probability of
  (N, 3) judge distributions against the label indices (bad, ok, good), and the accuracy
  minus its null's, the majority class of these labels, a paired interval over examples."""
  p = np.asarray(distributions, np.float64)
  labels = np.asarray(labels, np.int64)
  entropy = -np.sum(p * np.log(np.maximum(p, 1e-12)), axis=-1)
  counts = np.bincount(labels, minlength=p.shape[1])
  right = (p.argmax(-1) == labels).astype(np.float64)
  majority = (labels == counts.argmax()).astype(np.float64)
  nan = float("nan")
  return {"examples": int(len(labels)),
          "accuracy": float(right.mean()) if len(labels) else nan,
          "majority_class_accuracy": float(majority.mean()) if len(labels) else nan,
          "accuracy_minus_majority": common.ci_dict(common.paired_diff_ci(
              right, majority, num_resamples=num_resamples, seed=seed))
          if len(labels) > 1 else None,
          "mean_entropy_nats": float(entropy.mean()) if len(labels) else nan,
          "uniform_entropy_nats": float(np.log(p.shape[1])),
          "mean_top_probability": float(p.max(-1).mean()) if len(labels) else nan}


def heldout_judge_examples(data_dir: str, *, judge_classes: Sequence[str],
                           split: str = "train") -> list[tuple[str, int]]:
  """(situation, label index in bad, ok, good) of the silver judge examples a judge run held
  out: the pairs (with the run's class strings as targets) that `split_pairs`' "hash" rule
  puts in validation, one in 10, whatever mixture trained the judge (the rule reads only a
  pair's text)."""
  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import data as data_lib
  from jaxmoral.clarify import formats
  from jaxmoral.data import pairs as pairs_lib
  # pylint: enable=import-outside-toplevel
  rows = data_lib.load_source(data_dir, split=split, which="judge", purpose="judge quality")
  examples = data_lib.judge_examples(answers=rows["answers"], judgments=rows["judgments"])
  pairs = data_lib.judge_pairs(examples, classes=judge_classes)
  held = set(pairs_lib.split_pairs(pairs, rule="hash")["validation"])
  return [(s, formats.JUDGMENTS.index(j)) for (s, j), pair in zip(examples, pairs, strict=True)
          if pair in held]


def measure_judge(reward: Any, *, data_dir: str, judge_classes: Sequence[str],
                  num_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
  """`judge_quality` of the reward's judge on the silver labels its training held out."""
  examples = heldout_judge_examples(data_dir, judge_classes=judge_classes)
  if not examples:
    logger.warning("no held-out silver judge examples in %s", data_dir)
  distributions = reward.judge([s for s, _ in examples]) if examples else np.zeros((0, 3))
  return judge_quality(distributions, [label for _, label in examples],
                       num_resamples=num_resamples, seed=seed)


def judge_line(judge: Optional[Mapping[str, Any]]) -> str:
  """The judge's quality in words ("" when not measured)."""
  if not judge or not judge.get("examples"):
    return ""
  versus = judge.get("accuracy_minus_majority")
  return (f"Judge on {judge['examples']} held-out silver labels: accuracy "
          f"{judge['accuracy']:.3f} (majority class {judge['majority_class_accuracy']:.3f}"
          + (f"; difference {common.fmt(versus)}" if versus else "") + "), mean entropy "
          f"{judge['mean_entropy_nats']:.3f} nats of a uniform "
          f"{judge['uniform_entropy_nats']:.3f}, mean top probability "
          f"{judge['mean_top_probability']:.3f}.")


def system_metrics(evaluated: Mapping[str, Any], *, num_resamples: int,
                   seed: int) -> dict[str, Any]:
  """One system's `clarify.evaluate.evaluate_generator` result with 95 % bootstrap intervals
  over situations for its means and wh-word shares."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  per = evaluated["per_situation"]
  ci = lambda v: common.ci_dict(common.mean_ci(np.asarray(v, np.float64),  # noqa: E731
                                               num_resamples=num_resamples, seed=seed))
  out: dict[str, Any] = {"per_situation": {key: list(per[key]) for key, _ in MEAN_METRICS},
                         "questions": list(evaluated["questions"])}
  for key, _ in MEAN_METRICS:
    out[key] = ci(per[key])
  # No interval for distinct-n: a resample with replacement repeats questions, which lowers
  # distinct-n by construction (its percentile interval would miss the estimate).
  for n in (1, 2, 3):
    out[f"distinct_{n}"] = evaluated[f"distinct_{n}"]
  out["wh_pct"] = {w: ci([100.0 * (first == w) for first in per["wh_word"]])
                   for w in metrics.WH_WORDS + ("other",)}
  return out


@gin.configurable(module="clarify_table4")
def run_experiment(*, workdir: str, results_dir: str, name: str, init_checkpoint: str,
                   model_config: Any, optimizer: Any, ppo_optimizer: Any, ppo_config: Any,
                   reward_config: Any, data_dir: str = "../shared/data",
                   separate_models: bool = False,
                   dedicated_roles: Optional[Mapping[str, int]] = None,
                   train_steps: int = 1000, max_stage_steps: Optional[int] = None,
                   batch_size: int = 32, feature_lengths: Optional[Mapping[str, int]] = None,
                   ppo_iterations: int = 40, max_ppo_prompts: Optional[int] = None,
                   eval_split: str = "dev", max_eval_situations: int = 300,
                   question_length: int = 32, num_resamples: int = 1000,
                   mixing_cap: Optional[int] = None, pack: bool | Sequence[str] = False,
                   ppo_run: str = "ppo",
                   systems: Optional[Sequence[str]] = None, log_every: int = 50,
                   checkpoints_per_stage: int = 10, seed: int = 0,
                   command: str = "") -> dict[str, Any]:
  """Runs the whole experiment; writes and returns the results.

  Args:
    workdir: Runs (WORKDIR).
    results_dir: Where `<name>.md/.json/.png` go (RESULTS_DIR).
    name: Name of the result files (NAME).
    init_checkpoint: The pretrained base (INIT_CHECKPOINT).
    model_config: Its T5Config (MODEL_CONFIG).
    optimizer: Supervised optimizer (OPTIMIZER).
    ppo_optimizer: PPO's policy and value optimizer.
    ppo_config: `ppo_trainer.PPOConfig` (rollout decoding too).
    reward_config: `reward.RewardConfig` (training reward and evaluation alike).
    data_dir: A folder laid out like ../shared/data (δ-Clarify, silver, fusion).
    separate_models: One run per role instead of one multi-task model.
    dedicated_roles: {role: supervised steps} of roles trained as a model of their own (from
      the same base); every other role comes from the multi-task model. For roles a small
      multi-task model confuses (the answer generator answering with a question).
    train_steps: Supervised steps (per model with `separate_models`).
    max_stage_steps: Supervised steps of any model at most, `dedicated_roles`' included
      (None: as given): the smoke config checks a config of any shape in seconds.
    batch_size: Supervised batch size.
    feature_lengths: Supervised input / target tokens (default 128 / 32).
    ppo_iterations: PPO iterations.
    max_ppo_prompts: PPO's train situations at most (None: all).
    eval_split: δ-Clarify split of the held-out situations.
    max_eval_situations: Held-out situations evaluated (the paper's table: its test set).
    question_length: Question tokens at most at evaluation.
    num_resamples: Bootstrap resamples.
    mixing_cap: Pairs per role at most in the multi-task mixture (T5's examples-proportional
      mixing with a limit; None: all pairs, question generation then about 87 % of them).
      Models of one role (`separate_models`, `dedicated_roles`) always train on all pairs.
    pack: Pack several pairs per row (T5X's fine-tuning default;
      `training.train_clarify_model`): True for every supervised stage, or the stages to pack
      by name ("multitask" or a role, of `supervised_models`); clarify_table4_cpu_packed.gin
      says how many pairs a row holds.
    ppo_run: PPO's folder under `workdir`: PPO settings of their own reuse the supervised
      models of the same workdir (a rerun with the same folder resumes it).
    systems: The systems evaluated, of `SYSTEMS` (None: all). The pipeline baselines score
      14 questions per situation, most of the evaluation's time.
    log_every: Training progress lines.
    checkpoints_per_stage: Checkpoints of each training stage, the last at its end (a
      stopped experiment resumes from the newest).
    seed: Seed of everything.
    command: The command line (written into the report).

  Returns:
    Every number of the report (also in `<results_dir>/<name>.json`).
  """
  # pylint: disable=import-outside-toplevel
  from jaxmoral import run_dirs
  from jaxmoral.clarify import baselines
  from jaxmoral.clarify import data as data_lib
  from jaxmoral.clarify import evaluate as evaluate_lib
  from jaxmoral.clarify import models
  from jaxmoral.clarify import training
  # pylint: enable=import-outside-toplevel
  evaluated = evaluated_systems(systems)
  started = time.time()
  common.fileio.makedirs(workdir)  # A local folder or a bucket URL.
  timings: dict[str, float] = {}
  lengths = dict(feature_lengths or {"inputs": 128, "targets": 32})
  eval_situations = data_lib.situations(data_dir, split=eval_split)[:max_eval_situations]
  if len(eval_situations) < max_eval_situations:
    logger.warning("only %d %s situations", len(eval_situations), eval_split)

  # 1. Supervised models.
  models_steps = supervised_models(separate_models=separate_models,
                                   dedicated_roles=dedicated_roles, train_steps=train_steps)
  if max_stage_steps is not None:
    models_steps = {which: min(steps, max_stage_steps) for which, steps in models_steps.items()}
  role_dir = role_model_dirs(workdir, models_steps)
  packed = packed_stages(pack, models_steps)
  for which, steps in models_steps.items():
    run_dir = model_dir(workdir, which)
    timings[f"train_{which}_s"] = common.train_stage(
        run_dir, steps, lambda w=which, d=run_dir, n=steps: training.train_clarify_model(
            which=w, model_dir=d, model_config=model_config, optimizer=optimizer,
            train_steps=n, batch_size=batch_size, feature_lengths=lengths,
            source=data_dir, split="train", judge_classes=reward_config.judge_classes,
            nli_labels=reward_config.nli_labels,
            checkpoint_every=common.checkpoint_every(n, saves=checkpoints_per_stage),
            log_every=log_every, seed=seed, init_checkpoint=init_checkpoint,
            # The cap balances a mixture; a model of one role keeps all its pairs.
            mixing_cap=mixing_cap if w == "multitask" else None,
            pack=w in packed))["seconds"]

  # 2. PPO on train situations.
  tick = time.time()
  ppo_dir = os.path.join(workdir, ppo_run)
  if run_dirs.saved_steps(ppo_dir):
    common.warn_changed_bindings(ppo_dir, "PPO goes on from (or reuses) a run trained")
  ppo = training.train_clarify_ppo(
      model_dir=ppo_dir, question_model_dir=role_dir["question"],
      answer_model_dir=role_dir["answer"], fusion_model_dir=role_dir["fusion"],
      judge_model_dir=role_dir["judge"], nli_model_dir=role_dir["nli"], ppo_config=ppo_config,
      optimizer=ppo_optimizer, num_iterations=ppo_iterations, reward_config=reward_config,
      source=data_dir, split="train", max_prompts=max_ppo_prompts,
      log_every=max(1, min(log_every, ppo_iterations // 10 or 1)),
      sample_every=ppo_iterations, seed=seed,
      checkpoint_every=common.checkpoint_every(ppo_iterations, saves=checkpoints_per_stage),
      async_checkpoint=False)
  timings["ppo_s"] = time.time() - tick

  # 3. Every system on the held-out situations, one reward pipeline.
  tick = time.time()
  shapes = dict(input_length=lengths["inputs"], batch_size=reward_config.batch_size)
  generators, reward = evaluate_lib.systems_from_dirs(
      question_model_dir=role_dir["question"], answer_model_dir=role_dir["answer"],
      fusion_model_dir=role_dir["fusion"], judge_model_dir=role_dir["judge"],
      nli_model_dir=role_dir["nli"], relevance_model_dir=role_dir["relevance"],
      ppo_model_dir=ppo["policy_dir"], reward_config=reward_config, **shapes)
  # Diagnostics: the two generators decoded as PPO's rollouts decode, and greedily (the same
  # cached models as the systems above).
  sft_model = models.load_model(role_dir["question"], **shapes)
  ppo_model = models.load_model(ppo["policy_dir"], **shapes)
  rollout = dict(top_p=ppo_config.top_p, temperature=ppo_config.temperature,
                 max_length=question_length, seed=seed)
  generators["finetuned@rollout"] = baselines.sampled_generator(sft_model, **rollout)
  generators["ppo@rollout"] = baselines.sampled_generator(ppo_model, **rollout)
  greedy = dict(greedy=True, max_length=question_length)
  generators["finetuned@greedy"] = baselines.sampled_generator(sft_model, **greedy)
  generators["ppo@greedy"] = baselines.sampled_generator(ppo_model, **greedy)
  table: dict[str, Any] = {}
  # The models given build every system (the reward has its NLI model, relevance is loaded).
  for system in evaluated:
    table[system] = system_metrics(
        evaluate_lib.evaluate_generator(generators[system], eval_situations, reward),
        num_resamples=num_resamples, seed=seed)
    logger.info("%s: avg JSD %.4f, flips %.1f %%", system, table[system]["jsd"]["estimate"],
                table[system]["flips_pct"]["estimate"])
  timings["evaluate_s"] = time.time() - tick
  tick = time.time()
  judge = measure_judge(reward, data_dir=data_dir, judge_classes=reward_config.judge_classes,
                        num_resamples=num_resamples, seed=seed)
  timings["judge_s"] = time.time() - tick
  differences = {}
  for a, b in (("ppo", "finetuned"), ("ppo@rollout", "finetuned@rollout"),
               ("ppo@greedy", "finetuned@greedy"), ("ppo@rollout", "ppo")):
    if a in table and b in table:
      differences[f"{a} - {b}"] = {key: common.ci_dict(common.paired_diff_ci(
          table[a]["per_situation"][key], table[b]["per_situation"][key],
          num_resamples=num_resamples, seed=seed))
          for key in ("jsd", "flips_pct", "question_pct")}
  timings["total_s"] = time.time() - started
  results: dict[str, Any] = {
      "table": table, "differences": differences, "command": command, "judge": judge,
      "machine": common.machine(), "timings": timings,
      "ppo_reward_curve": ppo.get("reward_curve_values", []),
      # Every iteration's learning-curve metrics (ppo_trainer.CURVE_METRICS) against episodes.
      "ppo_curves": ppo_curves(ppo_dir),
      # The last iteration's KL, its coefficient and the like: did the penalty hold?
      "ppo_final_metrics": {k: float(v) for k, v in ppo.items()
                            if isinstance(v, (int, float, np.number))},
      "setup": {"init_checkpoint": init_checkpoint, "data_dir": data_dir,
                "separate_models": separate_models, "mixing_cap": mixing_cap,
                "pack": sorted(packed),
                "supervised_models": models_steps,
                "train_steps": train_steps,
                "batch_size": batch_size, "feature_lengths": lengths,
                "ppo_iterations": ppo_iterations, "ppo_batch_size": ppo_config.batch_size,
                "ppo_run": ppo_run, "kl_control": ppo_config.kl_control,
                "init_kl_coef": ppo_config.init_kl_coef, "kl_target": ppo_config.kl_target,
                "kl_horizon": ppo_config.kl_horizon,
                "ppo_top_p": ppo_config.top_p, "ppo_temperature": ppo_config.temperature,
                "ppo_num_minibatches": ppo_config.num_minibatches,
                "ppo_num_epochs": ppo_config.num_ppo_epochs,
                "ppo_value_coef": ppo_config.value_coef,
                "ppo_whiten_rewards": ppo_config.whiten_rewards,
                "eval_split": eval_split, "eval_situations": len(eval_situations),
                "num_resamples": num_resamples, "seed": seed}}
  results["verdict"], results["verdict_why"] = verdict(differences)
  results["diagnosis"] = diagnosis(results)
  return common.write_results(results, results_dir=results_dir, name=name,
                              title=f"ClarifyDelphi Table 4 shape ({name})", plot=plot,
                              report=report)


def ppo_curves(ppo_dir: str) -> dict[str, Any]:
  """A PPO run's learning curves: {"iterations", "episodes", "metrics": {name: values}}."""
  from jaxmoral.rl import ppo_trainer  # pylint: disable=import-outside-toplevel
  curves = ppo_trainer.read_learning_curves(ppo_trainer.reward_curve_path(ppo_dir))
  rows, episodes = curves["rows"], curves["episodes"]
  steps = sorted(rows)
  names = [n for n in ppo_trainer.CURVE_METRICS if steps and all(n in rows[i] for i in steps)]
  return {"iterations": steps, "episodes": [episodes.get(i, i) for i in steps],
          "metrics": {n: [rows[i][n] for i in steps] for n in names}}


def curves_line(curves: Mapping[str, Any]) -> str:
  """The learning curves in words: reward and KL at the start, the end and their extremes."""
  m = curves.get("metrics") or {}
  if not curves.get("iterations") or "raw_score_mean" not in m:
    return ""
  reward, parts = m["raw_score_mean"], []
  parts.append(f"raw reward first {reward[0]:.4f}, last {reward[-1]:.4f}, max {max(reward):.4f}")
  for name, label in (("kl", "KL (sampled-token estimate)"),
                      ("kl_full_vocab", "KL (full vocabulary)"), ("kl_coef", "KL coefficient"),
                      ("rollout_entropy", "entropy per token"), ("distinct_2", "distinct-2"),
                      ("value_explained_variance", "value explained variance")):
    if name in m:
      parts.append(f"{label} first {m[name][0]:.3g}, last {m[name][-1]:.3g}")
  return (f"PPO learning curves over {curves['episodes'][-1]} episodes "
          f"({len(curves['iterations'])} iterations): " + "; ".join(parts) + ".")


def claim_parts(differences: Mapping[str, Any]) -> list[Any]:
  """The paper's claim as parts (`common.ClaimPart`): PPO minus the supervised generator, as
  the table decodes, paired over the same situations: avg JSD above 0 and % flips above 0."""
  d = differences.get("ppo - finetuned") or {}
  # The supervised generator is the null: the same model before the reward trains it.
  return [common.ClaimPart("PPO minus SFT avg JSD", d.get("jsd"), digits=4, null="SFT"),
          common.ClaimPart("PPO minus SFT % flips", d.get("flips_pct"), digits=1, null="SFT")]


def verdict(differences: Mapping[str, Any]) -> tuple[str, str]:
  """By `common.claim_verdict` on `claim_parts`; but NOT_SHOWN whatever the intervals when
  PPO stopped asking questions (then the table does not compare question generators)."""
  word, why = common.claim_verdict(claim_parts(differences))
  asked = (differences.get("ppo - finetuned") or {}).get("question_pct")
  if asked is not None and asked["high"] < -QUESTION_DROP_POINTS:
    # The reward was gamed: what PPO emits is no longer a question, so the table does not
    # compare question generators (seen at 120 iterations with KL coefficient 0.05).
    return common.NOT_SHOWN, (f"{why}; but PPO's outputs ending in '?' fell by "
                              f"{-asked['estimate']:.1f} points [{-asked['high']:.1f}, "
                              f"{-asked['low']:.1f}]: the policy stopped asking questions")
  return word, why


def models_line(setup: Mapping[str, Any]) -> str:
  """How the supervised models were trained, in words."""
  # Results written before `supervised_models` was recorded: derive it from the setup.
  models = setup.get("supervised_models") or supervised_models(
      separate_models=setup["separate_models"], dedicated_roles=None,
      train_steps=setup["train_steps"])
  cap = setup.get("mixing_cap")
  # "pack" is a bool in results written before stages could be packed one by one.
  packed = packed_stages(setup.get("pack", False), models)
  every = packed == set(models)
  steps = {m: f"({n} steps{', packed' if m in packed and not every else ''})"
           for m, n in models.items()}
  parts = []
  if "multitask" in models:
    shared = [r for r in ROLES if r not in models]
    parts.append(f"one multi-task model{' (at most %d pairs per role)' % cap if cap else ''}"
                 f" {steps['multitask']}"
                 f"{' for ' + ', '.join(shared) if len(shared) < len(ROLES) else ''}")
  article = {role: "an" if role[0] in "aeiou" else "a" for role in ROLES}
  parts += [f"{article[role]} {role} model of its own {steps[role]}" for role in ROLES
            if role in models]
  return "; ".join(parts) + (", every one on packed rows" if every else "")


def kl_line(setup: Mapping[str, Any]) -> str:
  """PPO's KL penalty in words (results written before it was recorded: "KL as configured")."""
  if "kl_control" not in setup:
    return "KL penalty as configured"
  if setup["kl_control"] == "fixed":
    return f"fixed KL coefficient {setup['init_kl_coef']}"
  return (f"adaptive KL coefficient from {setup['init_kl_coef']}, target {setup['kl_target']} "
          f"nats, horizon {setup['kl_horizon']:g} episodes")


def _quarters(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
  """The first and the last quarter of a learning curve (at least one iteration each)."""
  values = np.asarray(values, np.float64)
  k = max(1, len(values) // 4)
  return values[:k], values[-k:]


def _gain_ci(values: Sequence[float], *, num_resamples: int = 1000, seed: int = 0
             ) -> dict[str, float]:
  """The last quarter's mean minus the first quarter's, with a 95 % bootstrap interval that
  resamples the iterations of each quarter (an iteration's mean is one draw of the policy)."""
  first, last = _quarters(values)
  rng = np.random.default_rng(seed)
  draws = (rng.choice(last, (num_resamples, len(last))).mean(1)
           - rng.choice(first, (num_resamples, len(first))).mean(1))
  low, high = np.percentile(draws, [2.5, 97.5])
  return {"estimate": float(last.mean() - first.mean()), "low": float(low), "high": float(high)}


def diagnosis(results: Mapping[str, Any]) -> list[dict[str, str]]:
  """Why PPO did what it did, from this run's learning curves and table: findings, each
  {"finding": words with its numbers, "points_to": SETTINGS or CAPACITY}.

  Settings are what another PPO configuration could change (KL price, step size, value fit,
  entropy); capacity is what it could not (a reward too flat to rank questions, or a gain on
  the training situations that does not carry to held-out ones through this judge and
  generator). Results without learning curves (older runs) get the table's findings only.
  """
  found: list[dict[str, str]] = []

  def add(points_to: str, finding: str) -> None:
    found.append({"finding": finding, "points_to": points_to})

  m = (results.get("ppo_curves") or {}).get("metrics") or {}

  def late(name: str) -> float:  # A curve's mean over its last quarter of iterations.
    return float(np.mean(_quarters(m[name])[1]))

  table, differences = results.get("table") or {}, results.get("differences") or {}
  dev = (differences.get("ppo@rollout - finetuned@rollout") or {}).get("jsd")
  if len(m.get("raw_score_mean", ())) >= 2:
    train = _gain_ci(m["raw_score_mean"])
    text = (f"training reward, last quarter minus first: "
            f"{common.fmt(train, 4)}")
    if train["low"] <= 0:
      add(SETTINGS, f"PPO did not raise the reward it was trained on ({text}): the update, "
          "not the model, is what failed first")
    elif dev is not None and dev["low"] <= 0:
      add(CAPACITY, f"PPO raised its training reward ({text}) but not the held-out reward at "
          f"the same decoding (dev, PPO minus SFT at rollout decoding: {common.fmt(dev, 4)}): "
          "what this judge pays for does not generalise")
    elif dev is not None:
      add(SETTINGS, f"PPO raised the held-out reward at rollout decoding "
          f"({common.fmt(dev, 4)}) but not at the table's decoding: the evaluation's "
          "decoding hides it")
  if len(m.get("reward_mean", ())) >= 2 and m.get("non_score_reward"):
    gain = _gain_ci(m["reward_mean"])["estimate"]
    price = -late("non_score_reward")
    if price > max(gain, 0.0):
      add(SETTINGS, f"by the end the KL penalty ({price:.3f} per episode, normalised units) "
          f"outweighed the reward gain ({gain:+.3f}): the KL coefficient holds the policy")
  target = (results.get("setup") or {}).get("kl_target")
  if (results.get("setup") or {}).get("kl_control") == "adaptive" and m.get("kl") and target:
    kl = late("kl")
    if kl > 1.5 * target:
      add(SETTINGS, f"KL to the reference ended at {kl:.2f} nats, above 1.5x its target "
          f"{target:g}: the adaptive coefficient did not hold it")
  if m.get("clipfrac") and late("clipfrac") > CLIPFRAC_HIGH:
    add(SETTINGS, f"{100 * late('clipfrac'):.0f} % of tokens "
        "clipped in the last quarter: steps too large for the trust region (learning rate, "
        "epochs)")
  if m.get("approx_kl") and late("approx_kl") > APPROX_KL_HIGH:
    add(SETTINGS, f"approx-KL per update {late('approx_kl'):.3f} "
        f"in the last quarter, above {APPROX_KL_HIGH}: steps too large")
  if m.get("value_explained_variance"):
    ev = late("value_explained_variance")
    if ev < EXPLAINED_VARIANCE_LOW:
      add(SETTINGS, f"the value head explains {ev:.2f} of the returns' variance in the last "
          "quarter: the advantages are mostly noise (value coefficient, warm-up)")
  if len(m.get("rollout_entropy", ())) >= 2 and m["rollout_entropy"][0] > 0:
    first, last = (float(np.mean(q)) for q in _quarters(m["rollout_entropy"]))
    low, high = ENTROPY_RATIO_BAND
    if not low <= last / first <= high:
      add(SETTINGS, f"rollout entropy per token went from {first:.2f} to {last:.2f} "
          f"({'collapse' if last < low * first else 'drift'}): the KL price or the "
          "learning rate")
  judge = results.get("judge") or {}
  versus = judge.get("accuracy_minus_majority")
  if versus is not None and versus["low"] <= 0:
    add(CAPACITY, f"the judge is right on {100 * judge['accuracy']:.1f} % of its "
        f"{judge['examples']} held-out silver labels, not above its majority class's "
        f"{100 * judge['majority_class_accuracy']:.1f} % (difference {common.fmt(versus)}): "
        "the reward is the divergence of a judge that does not know the labels")
  sft = (table.get("finetuned") or {}).get("jsd")
  if sft is not None and sft["estimate"] < 0.1 * PAPER_JSD_RANGE[0]:
    add(CAPACITY, f"the reward is nearly flat: SFT's avg JSD {common.fmt(sft, 4)} against "
        f"the paper's {PAPER_JSD_RANGE[0]:g}-{PAPER_JSD_RANGE[1]:g} (its judge is Delphi): "
        "the judge barely tells the weakened situation from the strengthened one")
  return found


def verdict_lines(results: Mapping[str, Any]) -> list[str]:
  """The claim, the rule and this run's verdict (Markdown lines)."""
  return [f"Claim: {PAPER}.", "", common.VERDICT_RULE + " A policy whose share of questions "
          f"fell by more than {QUESTION_DROP_POINTS:g} points (the whole interval) is not shown "
          "whatever its intervals.", "",
          f"This run: **{results['verdict']}** ({results['verdict_why']})."
          ] + diagnosis_lines(results)


def diagnosis_lines(results: Mapping[str, Any]) -> list[str]:
  """The diagnosis in Markdown, when the claim is not shown: which findings point to the
  settings and which to capacity (none when the verdict agrees)."""
  if results.get("verdict") == common.AGREES:
    return []
  found = diagnosis(results)
  if not found:
    return ["", "Diagnosis: nothing this run measures points either way."]
  lines = ["", "Diagnosis (why the claim is not shown, from this run's curves and table):", ""]
  for points_to in (SETTINGS, CAPACITY):
    lines += [f"- {points_to}: {f['finding']}." for f in found if f["points_to"] == points_to]
  return lines


def report(results: Mapping[str, Any], *, name: str) -> str:
  """The Markdown section for bench/RESULTS.md."""
  s, t = results["setup"], results["timings"]
  curve = results["ppo_reward_curve"]
  lines = [*common.report_head(results, name=name),
           f"Setup: base `{s['init_checkpoint']}`; "
           f"{models_line(s)}, batch {s['batch_size']}, on `{s['data_dir']}` train; "
           f"PPO {s['ppo_iterations']} iterations of {s['ppo_batch_size']} train situations "
           f"(rollouts: top-p {s['ppo_top_p']}, temperature {s['ppo_temperature']}; "
           f"{kl_line(s)}); "
           f"evaluation on {s['eval_situations']} `{s['eval_split']}` situations, one question "
           f"each. 95 % bootstrap intervals over situations ({s['num_resamples']} resamples; "
           "none for distinct-n, which resampling with replacement lowers by repeating "
           "questions).",
           "", "| system | " + " | ".join(label for _, label in MEAN_METRICS)
           + " | distinct-1 | distinct-2 | distinct-3 | "
           + " | ".join(f"% {w}" for w in WH_SHOWN) + " |",
           "|---|" + "---|" * (len(MEAN_METRICS) + 3 + len(WH_SHOWN))]
  # The table's order (a stored JSON's keys come back sorted).
  order = [s for s in SYSTEMS if s in results["table"]]
  order += [s for s in results["table"] if s not in order]
  for system in order:
    row = results["table"][system]
    cells = [common.fmt(row[k], 4 if k.startswith("jsd") else 1) for k, _ in MEAN_METRICS]
    cells += [f"{row[f'distinct_{n}']:.3f}" for n in (1, 2, 3)]
    cells += [common.fmt(row["wh_pct"][w], 1) for w in WH_SHOWN]
    lines.append(f"| {system} | " + " | ".join(cells) + " |")
  lines += ["", "Paired differences (same situations):", "",
            "| difference | avg JSD | % flips | % questions |", "|---|---|---|---|"]
  for label, d in results["differences"].items():
    asked = common.fmt(d["question_pct"], 1) if "question_pct" in d else "—"
    lines.append(f"| {label} | {common.fmt(d['jsd'], 4)} | {common.fmt(d['flips_pct'], 1)} "
                 f"| {asked} |")
  curves_text = curves_line(results.get("ppo_curves") or {})
  if curves_text:
    lines += ["", curves_text]
  elif curve:
    lines += ["", f"PPO training reward (raw JSD of rollouts) per iteration: first "
              f"{curve[0]:.4f}, last {curve[-1]:.4f}, max {max(curve):.4f}."]
  judge_text = judge_line(results.get("judge"))
  if judge_text:
    lines += ["", judge_text]
  lines += ["", *verdict_lines(results),
            "", "Seconds: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in t.items()) + ".", "",
            f"Plot: `{results['plot']}`."]
  return "\n".join(lines)


def plot(results: Mapping[str, Any], path: str, *, title: str) -> str:
  """Average JSD and % flips per system with their intervals; beneath them PPO's reward and
  KL to the reference against episodes (when the run recorded them)."""
  from jaxmoral import pictures  # pylint: disable=import-outside-toplevel
  plt = pictures.pyplot()
  table = results["table"]
  systems = list(table)
  curves = results.get("ppo_curves") or {}
  metrics = curves.get("metrics") or {}
  with_curves = bool(curves.get("iterations")) and "raw_score_mean" in metrics
  fig, axes = plt.subplots(2 if with_curves else 1, 2, figsize=(12, 8 if with_curves else 4),
                           squeeze=False)
  for ax, (key, label) in zip(axes[0], (("jsd", "average JSD"),
                                        ("flips_pct", "% judgment flips"))):
    est = np.array([table[s][key]["estimate"] for s in systems])
    err = np.array([[table[s][key]["estimate"] - table[s][key]["low"] for s in systems],
                    [table[s][key]["high"] - table[s][key]["estimate"] for s in systems]])
    colors = ["tab:red" if s.startswith("ppo") else "tab:blue" if s.startswith("finetuned")
              else "tab:gray" for s in systems]
    ax.bar(np.arange(len(systems)), est, yerr=err, capsize=3, color=colors)
    ax.set_xticks(np.arange(len(systems)))
    ax.set_xticklabels(systems, rotation=35, ha="right", fontsize=8)
    ax.set_title(f"{label} (95 % CI)")
    ax.grid(axis="y", alpha=0.3)
  if with_curves:
    episodes = curves["episodes"]
    ax_r, ax_kl = axes[1]
    ax_r.plot(episodes, metrics["raw_score_mean"], marker=".", color="tab:red")
    ax_r.set_title("PPO rollout reward (raw JSD)")
    for name, label in (("kl", "sampled-token estimate"), ("kl_full_vocab", "full vocabulary")):
      if name in metrics:
        ax_kl.plot(episodes, metrics[name], marker=".", label=label)
    ax_kl.set_title("KL(policy || reference), nats per question")
    ax_kl.legend(fontsize=8)
    for ax in (ax_r, ax_kl):
      ax.set_xlabel("episodes")
      ax.grid(alpha=0.3)
  fig.suptitle(title)
  return pictures.save_figure(fig, path, dpi=110)


if __name__ == "__main__":
  sys.exit(common.main(run_experiment))
