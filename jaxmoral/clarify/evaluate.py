"""Evaluation of question generators (Table 4 of Pyatkin et al. 2023 plus diversity).

Per system on a split: the means of `per_situation_metrics` (JSD with and without the NLI
filter, % judgment flips, % filtered, % questions), distinct-1/2/3 and the shares of first
words and wh-words. `evaluate_model_dirs` (`jaxmoral clarify evaluate`) builds the systems from
model directories (`systems_from_dirs`) and the table across them (`compare`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Mapping, Optional, Sequence

import gin
import numpy as np

from jaxmoral import fileio
from jaxmoral import metrics
from jaxmoral import model_dirs
from jaxmoral import partitioning
from jaxmoral.clarify import baselines
from jaxmoral.clarify import data as data_lib
from jaxmoral.clarify import formats
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.clarify import models
from jaxmoral.clarify import reward as reward_lib


def per_situation_metrics(questions: Sequence[str], result: reward_lib.RewardResult
                          ) -> dict[str, np.ndarray]:
  """One system's measures per situation, in order: what means, bootstrap intervals and paired
  differences between systems (same situations) are computed from.

  Returns:
    `{"jsd": JSD after the NLI filter (the reward), "jsd_unfiltered", "flips_pct" and
    "filtered_pct" (0 or 100), "question_pct" (100 where the output ends in "?": a policy that
    games the reward stops asking), "wh_word" (first wh-word or "other", str)}`, each (N,).
  """
  return {
      "jsd": np.asarray(result.scores, np.float64),
      "jsd_unfiltered": np.asarray(result.jsd, np.float64),
      "flips_pct": 100.0 * np.asarray(result.flips, np.float64),
      "filtered_pct": 100.0 * np.asarray(result.filtered, np.float64),
      "question_pct": 100.0 * np.asarray([formats.is_question(q) for q in questions],
                                         np.float64),
      "wh_word": np.asarray([metrics.first_wh_word(q) for q in questions], dtype=object),
  }


MEAN_KEYS = ("jsd", "jsd_unfiltered", "flips_pct", "filtered_pct", "question_pct")


def question_metrics(questions: Sequence[str], result: reward_lib.RewardResult
                     ) -> dict[str, Any]:
  """Metrics of one system's questions and their reward-pipeline result: the means of
  `per_situation_metrics`, distinct-1/2/3 and the first-word (most frequent first) and
  wh-word shares."""
  per = per_situation_metrics(questions, result)
  first_words = collections.Counter(formats.first_word(q) or "<empty>" for q in questions)
  return {
      "num_questions": len(questions),
      **{key: float(np.mean(per[key])) if len(questions) else 0.0 for key in MEAN_KEYS},
      **{f"distinct_{n}": metrics.distinct_n(questions, n) for n in (1, 2, 3)},
      "first_word_pct": {w: 100 * (c / len(questions)) for w, c in first_words.most_common()},
      "wh_word_pct": {w: 100 * f for w, f in metrics.wh_word_distribution(questions).items()},
  }


def evaluate_generator(generator: baselines.Generator, situations: Sequence[str],
                       reward: reward_lib.DefeasibilityReward) -> dict[str, Any]:
  """`question_metrics` of one question per situation, with the questions, the intervals and
  every situation's measures (JSON)."""
  questions = generator(list(situations))
  result = reward.score_questions(list(situations), questions)
  per = per_situation_metrics(questions, result)
  out = question_metrics(questions, result)
  out["ci95"] = {key: _mean_ci(per[key]) for key in CI_KEYS}
  out["questions"] = list(questions)
  out["per_situation"] = {k: v.tolist() for k, v in per.items()}
  # Each question's whole reward pipeline (answers, NLI filter, fused situations, judge
  # distributions), for reading examples (`jaxmoral explore`).
  out["per_question"] = [{"situation": s, "question": q, **result.row(i)}
                         for i, (s, q) in enumerate(zip(situations, questions, strict=True))]
  out["samples"] = [{"situation": s, "question": q, "jsd": float(j)}
                    for s, q, j in list(zip(situations, questions, result.scores, strict=True))[:5]]
  return out


TABLE_COLUMNS = (*MEAN_KEYS, "distinct_1", "distinct_2", "distinct_3")
# Columns shown with a 95 % bootstrap interval of the mean over situations (the experiments'
# intervals, `metrics.bootstrap_ci`).
CI_KEYS = ("jsd", "flips_pct")


def _mean_ci(values: np.ndarray) -> Optional[list[float]]:
  """95 % percentile-bootstrap interval of the mean (None for fewer than 2 values)."""
  if len(values) < 2:
    return None
  ci = metrics.bootstrap_ci(lambda x: x.mean(axis=1), np.asarray(values, np.float64),
                            vectorized=True)
  return [float(ci.low), float(ci.high)]


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
  """A plain-text table: one row per system with its n (situations), each column's mean (with
  its 95 % bootstrap interval for `CI_KEYS`), and its three most common first words."""
  def cell(r: Mapping[str, Any], column: str) -> str:
    digits = 1 if column.endswith("_pct") else 4
    text = f"{r[column]:.{digits}f}"
    ci = (r.get("ci95") or {}).get(column)
    return text + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")

  rows = [["system", "n", *TABLE_COLUMNS, "top first words"]]
  for name, r in results.items():
    top = ", ".join(f"{w} {p:.0f}%" for w, p in list(r["first_word_pct"].items())[:3])
    rows.append([name, str(r["num_questions"]), *(cell(r, c) for c in TABLE_COLUMNS), top])
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row, widths, strict=False))).rstrip()
           for row in rows]
  lines.insert(1, "-" * len(lines[0]))
  return "\n".join(lines) + "\n(means over n situations; [95 % bootstrap interval])"


def compare(generators: Mapping[str, baselines.Generator], situations: Sequence[str],
            reward: reward_lib.DefeasibilityReward, *,
            output_json: Optional[str | os.PathLike] = None,
            print_table: bool = True) -> dict[str, dict[str, Any]]:
  """Evaluates every system on the same situations; prints the table, writes JSON."""
  if not situations:
    raise ValueError("compare: no situations")
  results = {name: evaluate_generator(g, situations, reward) for name, g in generators.items()}
  if print_table:
    print(format_table(results))
  if output_json:
    fileio.makedirs(os.path.dirname(fileio.abspath(output_json)))
    fileio.write_text(output_json, json.dumps(results, indent=2))
  return results


def systems_from_dirs(*, question_model_dir: str, answer_model_dir: str,
                      fusion_model_dir: str, judge_model_dir: str,
                      nli_model_dir: Optional[str] = None,
                      relevance_model_dir: Optional[str] = None,
                      ppo_model_dir: Optional[str] = None,
                      reward_config: reward_lib.RewardConfig, input_length: int = 128,
                      batch_size: int = 32, partitioner: Any = None
                      ) -> tuple[dict[str, baselines.Generator], reward_lib.DefeasibilityReward]:
  """The reward pipeline and every system the given model directories allow
  (`baselines.all_generators`), each model on `partitioner`'s mesh (default one device).

  Question models are read with `input_length` tokens in batches of `batch_size`.
  """
  partitioner = partitioning.inference_partitioner(partitioner)
  reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=answer_model_dir, fusion_model_dir=fusion_model_dir,
      judge_model_dir=judge_model_dir, nli_model_dir=nli_model_dir, config=reward_config,
      partitioner=partitioner)
  load = lambda d: (models.load_model(d, input_length=input_length,  # noqa: E731
                                      batch_size=batch_size, partitioner=partitioner)
                    if d else None)
  question_model = load(question_model_dir)
  assert question_model is not None  # question_model_dir is required.
  return baselines.all_generators(
      question_model=question_model, reward=reward,
      relevance_model=load(relevance_model_dir), ppo_model=load(ppo_model_dir)), reward


@gin.configurable
def evaluate_model_dirs(*, question_model_dir: str, answer_model_dir: str,
                        fusion_model_dir: str, judge_model_dir: str,
                        nli_model_dir: Optional[str] = None,
                        relevance_model_dir: Optional[str] = None,
                        ppo_model_dir: Optional[str] = None, source: str = "demo",
                        split: str = "dev", max_situations: Optional[int] = 100,
                        output_path: Optional[str] = "clarify_evaluation.json",
                        use_nli: bool = True,
                        judge_classes: Optional[Sequence[str]] = None,
                        partitioner: Any = None) -> dict[str, dict[str, Any]]:
  """Compares every question generator the given model directories allow
  (`systems_from_dirs`); returns `compare`'s `{system: metrics}`.

  Args:
    question_model_dir: The supervised question generator θQ.
    answer_model_dir, fusion_model_dir, judge_model_dir: θA, the fusion model and the judge
      of the reward.
    nli_model_dir: The NLI filter of answers (None: no filter).
    relevance_model_dir: The relevance discriminator (None: no "discriminator" system).
    ppo_model_dir: A PPO run, the tuned θQ (None: no "ppo" system).
    source: Situations: "demo" or a δ-Clarify data folder.
    split: demo: train|dev; a folder: any delta_clarify/<split>.tsv it has.
    max_situations: Evaluate on at most this many situations (None: all).
    output_path: JSON of every system's metrics (None: not written).
    use_nli: Apply the NLI filter in the reward.
    judge_classes: The judge's class strings for bad, ok, good (None: `RewardConfig`'s, as
      gin binds it, or the demo vocabulary's when the judge's vocabulary does not fit those:
      `judge.fitting_classes`).
    partitioner: The mesh the models are read onto and run on (the run's PARTITIONER, e.g.
      `--partitioner=%PARTITIONER` with a gin/partitioning fragment; None: one device).
  """
  # The data first: any split whose file the folder has; a missing one fails (listing those
  # present) before any model loads.
  situations = data_lib.situations(source, split=split)[:max_situations]
  classes: dict[str, Any] = {"judge_classes": judge_classes} if judge_classes else {}
  config = reward_lib.RewardConfig(use_nli=use_nli, **classes)
  if not judge_classes:
    # The configured classes, or the demo vocabulary's where the judge was trained on it.
    config = dataclasses.replace(config, judge_classes=judge_lib.fitting_classes(
        model_dirs.inspect(judge_model_dir).vocabulary, preferred=config.judge_classes))
  systems, reward = systems_from_dirs(
      question_model_dir=question_model_dir, answer_model_dir=answer_model_dir,
      fusion_model_dir=fusion_model_dir, judge_model_dir=judge_model_dir,
      nli_model_dir=nli_model_dir, relevance_model_dir=relevance_model_dir,
      ppo_model_dir=ppo_model_dir, reward_config=config, partitioner=partitioner)
  results = compare(systems, situations, reward, output_json=output_path)
  if output_path:
    print(f"wrote {output_path}")
  return results
