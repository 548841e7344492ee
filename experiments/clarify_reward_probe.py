"""What each stage of ClarifyDelphi's defeasibility reward does on held-out situations.

A near-zero reward (average JSD) can come from any stage: NLI filtering every answer, answers
that do not differ between weakener and strengthener, a fusion model that returns the
situation unchanged, or a judge whose verdict does not move. This runs the reward pipeline of
a trained experiment (its model directories) on the supervised generator's questions and
reports each stage, with a few examples:

  python experiments/clarify_reward_probe.py --gin_file=configs/experiments/clarify_table4_cpu.gin \\
      --gin.INIT_CHECKPOINT="'/work/runs/pretrain_mini'"

It reads the runs under the config's WORKDIR: the multi-task model and any role the config
trains alone (`separate_models`, `dedicated_roles`), as experiments/clarify_table4.py lays them out.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import gin
import numpy as np

import experiment_lib as common  # puts the project root on sys.path

def stage_summary(result: Any) -> dict[str, float]:
  """Numbers per stage from one `reward.RewardResult`."""
  base, p_w, p_s = (np.asarray(a, np.float64) for a in (
      result.base_distribution, result.weakened_distribution, result.strengthened_distribution))
  entropy = lambda p: float(np.mean(-np.sum(p * np.log(np.maximum(p, 1e-12)), -1)))  # noqa: E731
  same = lambda a, b: float(np.mean([x.strip() == y.strip() for x, y in zip(a, b)]))  # noqa: E731
  return {
      "situations": int(len(result.scores)),
      "judge_base_max_prob": float(base.max(-1).mean()),
      "judge_base_entropy_nats": entropy(base),
      "judge_base_verdicts": {j: float(np.mean([v == j for v in result.judgment]))
                              for j in sorted(set(result.judgment))},
      "answers_weakener_equals_strengthener": same(result.weakener, result.strengthener),
      "weakener_filtered_pct": 100.0 * float(np.mean(result.weakener_filtered)),
      "strengthener_filtered_pct": 100.0 * float(np.mean(result.strengthener_filtered)),
      "fusions_weakened_equals_strengthened": same(result.weakened_situation,
                                                   result.strengthened_situation),
      "judge_total_variation_w_vs_s": float(0.5 * np.abs(p_w - p_s).sum(-1).mean()),
      "judge_total_variation_base_vs_w": float(0.5 * np.abs(base - p_w).sum(-1).mean()),
      "jsd_unfiltered_mean": float(np.mean(result.jsd)),
      "reward_mean": float(np.mean(result.scores)),
  }


def probe(*, command: str = "") -> dict[str, Any]:
  """Probes the reward of the experiment that the parsed clarify_table4 config describes."""
  workdir, reward_config = _bound("workdir"), _bound("reward_config")
  data_dir, seed = _bound("data_dir", "../shared/data"), _bound("seed", 0)
  eval_split = _bound("eval_split", "dev")
  max_eval_situations = _bound("max_eval_situations", 300)
  question_length = _bound("question_length", 32)
  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import baselines
  from jaxmoral.clarify import data as data_lib
  from jaxmoral.clarify import models
  from jaxmoral.clarify import reward as reward_lib
  import clarify_table4
  # pylint: enable=import-outside-toplevel
  role_dir = clarify_table4.trained_role_dirs(workdir, clarify_table4.supervised_models(
      separate_models=_bound("separate_models", False),
      dedicated_roles=_bound("dedicated_roles"), train_steps=_bound("train_steps", 1000)),
      reader="the probe")
  reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=role_dir["answer"], fusion_model_dir=role_dir["fusion"],
      judge_model_dir=role_dir["judge"], nli_model_dir=role_dir["nli"], config=reward_config)
  situations = data_lib.situations(data_dir, split=eval_split)[:max_eval_situations]
  question_model = models.load_model(role_dir["question"],
                                     input_length=reward_config.input_length,
                                     batch_size=reward_config.batch_size)
  questions = baselines.sampled_generator(question_model, max_length=question_length,
                                          seed=seed)(situations)
  result = reward.score_questions(situations, questions)
  summary = stage_summary(result)
  examples = [result.row(i) for i in range(min(5, len(situations)))]
  out = {"command": command, "machine": common.machine(), "model_dirs": role_dir,
         "summary": summary,
         "examples": examples}
  print(json.dumps(out, indent=1, default=str))
  return out


def _bound(name: str, default: Any = None) -> Any:
  """The value the config binds to `clarify_table4.run_experiment.<name>` (macros and
  `@configurable()` references evaluated, as gin would when calling the experiment)."""
  try:
    value = gin.query_parameter(f"clarify_table4.run_experiment.{name}")
  except ValueError:  # Not bound: the experiment's default.
    return default
  if isinstance(value, gin.config.ConfigurableReference):
    return value.scoped_configurable_fn() if value.evaluate else value.scoped_configurable_fn
  return value


if __name__ == "__main__":
  importlib.import_module("clarify_table4")  # registers the configurable the config binds
  sys.exit(common.main(probe))
