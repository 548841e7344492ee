"""ClarifyDelphi: does the defeasibility reward point somewhere that generalises? And how sharp
is its judge?

Two measurements on the runs of a clarify_table4 experiment (its WORKDIR, read as
experiments/clarify_table4.py lays them out), with no PPO:

1. Best-of-n imitation (one round). The supervised question generator (SFT) samples
   `samples_per_situation` questions for each of `num_train_situations` train situations, as
   PPO's rollouts decode (the PPOConfig's temperature, untruncated); the reward scores them;
   a copy of SFT is fine-tuned on the best question of each situation. SFT and the copy then
   ask `eval_samples` questions each about the same held-out situations, scored by the same
   reward: per situation the mean reward of each, and the paired 95 % interval of copy minus
   SFT. The null is a second copy fine-tuned the same way on a random one of the same n
   samples: fine-tuning on its own samples alone sharpens a generator, whatever the reward
   says, so the reward's direction is what the best-of-n copy gains over the random-pick copy.
   If that gain holds on held-out situations, the reward has a direction a policy can learn
   (PPO should find it); if not, the limit is the judge and the generator at this scale.
2. The judge's quality: its accuracy on the silver judge labels that its training held out
   (the pairs `jaxmoral.data.pairs.split_pairs` holds out by hash, one in 10), its mean
   entropy and top probability there, and the spread of the reward over step 1's samples
   (how often it is exactly 0, its quantiles, the spread within a situation).

  python experiments/clarify_best_of_n.py \\
      --gin_file=configs/experiments/clarify_best_of_n_cpu.gin \\
      --gin.INIT_CHECKPOINT="'/work/runs/pretrain_mini_200'"

It needs the supervised models of the clarify_table4 config it includes (run that first).
Writes `<RESULTS_DIR>/<NAME>.md`, `.json` and `.png`; the fine-tuned copy goes under WORKDIR.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Mapping, Sequence

import gin
import numpy as np

import experiment_lib as common  # puts the project root on sys.path
import clarify_reward_probe  # reads the bindings of clarify_table4's configurable
import clarify_table4  # registers that configurable (the config binds it)

logger = logging.getLogger("clarify_best_of_n")

PAPER = ("the reward has a direction that generalises: a copy of the supervised generator "
         "fine-tuned on its best-of-n questions scores above it, and above a copy fine-tuned "
         "on a random one of the same samples, on held-out situations")


def reward_spread(scores: np.ndarray) -> dict[str, float]:
  """How much the reward varies over (S, n) scores of n questions for each of S situations."""
  scores = np.asarray(scores, np.float64)
  flat = scores.reshape(-1)
  return {
      "mean": float(flat.mean()), "std": float(flat.std()),
      "zero_pct": 100.0 * float(np.mean(flat == 0.0)),
      "p50": float(np.quantile(flat, 0.5)), "p90": float(np.quantile(flat, 0.9)),
      "p99": float(np.quantile(flat, 0.99)), "max": float(flat.max()),
      # Within a situation: what picking the best of n buys over a random one.
      "within_situation_std": float(scores.std(axis=1).mean()),
      "best_minus_mean": float((scores.max(axis=1) - scores.mean(axis=1)).mean()),
      "situations_all_zero_pct": 100.0 * float(np.mean((scores == 0.0).all(axis=1))),
  }


@gin.configurable(module="clarify_best_of_n")
def run_experiment(*, name: str, results_dir: str, num_train_situations: int = 256,
                   samples_per_situation: int = 8, finetune_steps: int = 200,
                   finetune_batch_size: int = 32, eval_samples: int = 4,
                   num_resamples: int = 1000, command: str = "") -> dict[str, Any]:
  """Runs both measurements; writes and returns the results.

  Args:
    name: Name of the result files (NAME).
    results_dir: Where `<name>.md/.json/.png` go.
    num_train_situations: Train situations sampled for best-of-n.
    samples_per_situation: n, questions sampled per train situation.
    finetune_steps: Steps of the copy's fine-tuning on the best questions.
    finetune_batch_size: Its batch size.
    eval_samples: Questions each model asks per held-out situation.
    num_resamples: Bootstrap resamples.
    command: The command line (written into the report).

  Returns:
    Every number of the report (also in `<results_dir>/<name>.json`).
  """
  # pylint: disable=import-outside-toplevel
  import jax

  from jaxmoral import model_dirs
  from jaxmoral import runs
  from jaxmoral.clarify import data as data_lib
  from jaxmoral.clarify import formats
  from jaxmoral.clarify import models
  from jaxmoral.clarify import reward as reward_lib
  from jaxmoral.models import trainable
  # pylint: enable=import-outside-toplevel
  bound = clarify_reward_probe._bound  # pylint: disable=protected-access
  workdir, reward_config, ppo_config = bound("workdir"), bound("reward_config"), bound(
      "ppo_config")
  data_dir, seed = bound("data_dir", "../shared/data"), bound("seed", 0)
  eval_split = bound("eval_split", "dev")
  max_eval_situations = bound("max_eval_situations", 300)
  question_length = bound("question_length", 32)
  lengths = dict(bound("feature_lengths") or {"inputs": 128, "targets": 32})
  role_dir = clarify_table4.trained_role_dirs(workdir, clarify_table4.supervised_models(
      separate_models=bound("separate_models", False),
      dedicated_roles=bound("dedicated_roles"), train_steps=bound("train_steps", 1000)),
      reader="best-of-n")
  started, timings = time.time(), {}
  reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=role_dir["answer"], fusion_model_dir=role_dir["fusion"],
      judge_model_dir=role_dir["judge"], nli_model_dir=role_dir["nli"], config=reward_config)
  shapes = dict(input_length=lengths["inputs"], batch_size=reward_config.batch_size)
  decoding = dict(max_decode_length=question_length, greedy=False,
                  temperature=ppo_config.temperature)

  def sample_and_score(model, situations, n, key):
    texts = model.predict([formats.question_input(s) for s in situations],
                          num_samples=n, rng=jax.random.PRNGKey(key), **decoding).texts
    flat_s = [s for s in situations for _ in range(n)]
    flat_q = [q for qs in texts for q in qs]
    scores = reward.score_questions(flat_s, flat_q).scores
    return texts, np.asarray(scores, np.float64).reshape(len(situations), n)

  # 1. Best-of-n on train situations, then a copy of SFT fine-tuned on the best.
  tick = time.time()
  sft = models.load_model(role_dir["question"], **shapes)
  train = data_lib.situations(data_dir, split="train")[:num_train_situations]
  candidates, train_scores = sample_and_score(sft, train, samples_per_situation, seed)
  best = [qs[int(np.argmax(s))] for qs, s in zip(candidates, train_scores, strict=True)]
  # The null's picks: one of the same n samples each, blind to the reward.
  random_picks = np.random.default_rng(seed).integers(samples_per_situation, size=len(train))
  randomly_picked = [qs[int(i)] for qs, i in zip(candidates, random_picks, strict=True)]
  timings["best_of_n_s"] = time.time() - tick
  sft_info = model_dirs.inspect(role_dir["question"])

  def finetuned_copy(questions: Sequence[str], kind: str) -> str:
    """A copy of SFT fine-tuned on one question per train situation; its run folder."""
    run_dir = os.path.join(workdir, f"{kind}_of_{samples_per_situation}_question")
    pairs = [(formats.question_input(s), q) for s, q in zip(train, questions, strict=True)]
    common.train_stage(run_dir, finetune_steps, lambda: runs.train_run(
        model_dir=run_dir, model=trainable.Seq2SeqModel(config=sft_info.config),
        data=runs.Seq2SeqData(train_file=data_lib.write_pairs(
            pairs, os.path.join(run_dir, "data", f"{kind}_questions.jsonl"))),
        train_steps=finetune_steps, batch_size=finetune_batch_size, feature_lengths=lengths,
        optimizer=bound("optimizer"), seed=seed, init_checkpoint=role_dir["question"],
        checkpoint_every=finetune_steps, log_every=max(1, finetune_steps // 10)))
    return run_dir

  tick = time.time()
  copy_dir = finetuned_copy(best, "best")
  random_copy_dir = finetuned_copy(randomly_picked, "random")
  timings["finetune_s"] = time.time() - tick

  # 2. SFT and the copy on the same held-out situations, the same keys.
  tick = time.time()
  held_out = data_lib.situations(data_dir, split=eval_split)[:max_eval_situations]
  _, sft_scores = sample_and_score(sft, held_out, eval_samples, seed + 1)
  copy_questions, copy_scores = sample_and_score(models.load_model(copy_dir, **shapes),
                                                 held_out, eval_samples, seed + 1)
  _, random_scores = sample_and_score(models.load_model(random_copy_dir, **shapes),
                                      held_out, eval_samples, seed + 1)
  sft_mean, copy_mean = sft_scores.mean(axis=1), copy_scores.mean(axis=1)
  random_mean = random_scores.mean(axis=1)
  ci = lambda v: common.ci_dict(common.mean_ci(v, num_resamples=num_resamples,  # noqa: E731
                                               seed=seed))
  paired = lambda a, b: common.ci_dict(common.paired_diff_ci(  # noqa: E731
      a, b, num_resamples=num_resamples, seed=seed))
  diff, diff_random = paired(copy_mean, sft_mean), paired(copy_mean, random_mean)
  timings["evaluate_s"] = time.time() - tick

  # 3. The judge on its held-out silver labels.
  tick = time.time()
  judge = clarify_table4.measure_judge(reward, data_dir=data_dir,
                                       judge_classes=reward_config.judge_classes,
                                       num_resamples=num_resamples, seed=seed)
  timings["judge_s"] = time.time() - tick
  timings["total_s"] = time.time() - started
  parts = [common.ClaimPart("best-of-n copy minus SFT, avg JSD on held-out situations", diff,
                            digits=4, null="SFT"),
           common.ClaimPart("best-of-n copy minus the random-pick copy, avg JSD on held-out "
                            "situations", diff_random, digits=4, null="random-pick copy")]
  word, why = common.claim_verdict(parts)
  results = {
      "command": command, "machine": common.machine(), "timings": timings,
      "setup": {"workdir": workdir, "data_dir": data_dir, "model_dirs": role_dir,
                "copy_dir": copy_dir, "random_copy_dir": random_copy_dir,
                "num_train_situations": len(train),
                "samples_per_situation": samples_per_situation,
                "finetune_steps": finetune_steps, "finetune_batch_size": finetune_batch_size,
                "eval_split": eval_split, "eval_situations": len(held_out),
                "eval_samples": eval_samples, "temperature": ppo_config.temperature,
                "num_resamples": num_resamples, "seed": seed},
      "best_of_n": {"train_reward_spread": reward_spread(train_scores),
                    "best_reward_mean": float(train_scores.max(axis=1).mean()),
                    "examples": [{"situation": s, "best": b, "candidates": list(c),
                                  "scores": list(map(float, sc))}
                                 for s, b, c, sc in list(zip(train, best, candidates,
                                                             train_scores, strict=True))[:5]]},
      "evaluation": {"sft": ci(sft_mean), "copy": ci(copy_mean), "random_copy": ci(random_mean),
                     "copy - sft": diff, "copy - random_copy": diff_random,
                     "random_copy - sft": paired(random_mean, sft_mean),
                     "per_situation": {"sft": sft_mean.tolist(), "copy": copy_mean.tolist(),
                                       "random_copy": random_mean.tolist()},
                     "copy_questions": [list(q) for q in copy_questions[:5]],
                     "eval_reward_spread_sft": reward_spread(sft_scores)},
      "judge": judge, "verdict": word, "verdict_why": why}
  return common.write_results(results, results_dir=results_dir, name=name,
                              title=f"ClarifyDelphi best-of-n and judge ({name})", plot=plot,
                              report=report)


def report(results: Mapping[str, Any], *, name: str) -> str:
  """The Markdown section for bench/RESULTS.md."""
  s, t = results["setup"], results["timings"]
  spread, ev, judge = (results["best_of_n"]["train_reward_spread"], results["evaluation"],
                       results["judge"])
  return "\n".join([
      *common.report_head(results, name=name),
      f"Setup: the supervised question generator of `{s['workdir']}` samples "
      f"{s['samples_per_situation']} questions (temperature {s['temperature']}, untruncated) "
      f"for each of {s['num_train_situations']} train situations; a copy fine-tuned "
      f"{s['finetune_steps']} steps (batch {s['finetune_batch_size']}) on the best of each, "
      f"and the null, a copy fine-tuned the same way on a random one of each situation's "
      f"samples; the three ask {s['eval_samples']} questions about each of "
      f"{s['eval_situations']} "
      f"`{s['eval_split']}` situations (the same keys), per situation the mean reward. 95 % "
      f"bootstrap intervals over situations ({s['num_resamples']} resamples).", "",
      "| | avg JSD |", "|---|---|",
      f"| SFT | {common.fmt(ev['sft'], 4)} |", f"| best-of-n copy | {common.fmt(ev['copy'], 4)} |",
      f"| random-pick copy (the null) | {common.fmt(ev['random_copy'], 4)} |",
      f"| best-of-n copy − SFT (paired) | {common.fmt(ev['copy - sft'], 4)} |",
      f"| best-of-n copy − random-pick copy (paired) | "
      f"{common.fmt(ev['copy - random_copy'], 4)} |",
      f"| random-pick copy − SFT (paired) | {common.fmt(ev['random_copy - sft'], 4)} |", "",
      f"Reward over the {s['num_train_situations']} x {s['samples_per_situation']} train "
      f"samples: mean {spread['mean']:.4f}, std {spread['std']:.4f}, exactly 0 for "
      f"{spread['zero_pct']:.1f} %, median {spread['p50']:.4f}, 90th percentile "
      f"{spread['p90']:.4f}, max {spread['max']:.4f}; within a situation std "
      f"{spread['within_situation_std']:.4f}, best minus mean {spread['best_minus_mean']:.4f}; "
      f"all {s['samples_per_situation']} zero for {spread['situations_all_zero_pct']:.1f} % of "
      f"situations.", "",
      clarify_table4.judge_line(judge), "",
      f"Claim: {PAPER}.", "", common.VERDICT_RULE, "",
      f"This run: **{results['verdict']}** ({results['verdict_why']}).", "",
      "Seconds: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in t.items()) + ".", "",
      f"Plot: `{results['plot']}`."])


def plot(results: Mapping[str, Any], path: str, *, title: str) -> str:
  """SFT, the best-of-n copy and the random-pick copy with intervals; the per-situation
  differences of the best-of-n copy."""
  from jaxmoral import pictures  # pylint: disable=import-outside-toplevel
  plt = pictures.pyplot()
  ev = results["evaluation"]
  fig, (ax_bar, ax_hist) = plt.subplots(1, 2, figsize=(10, 3.5))
  rows = [("SFT", ev["sft"]), ("best-of-n copy", ev["copy"]),
          ("random-pick copy", ev["random_copy"])]
  est = np.array([r["estimate"] for _, r in rows])
  err = np.array([[r["estimate"] - r["low"] for _, r in rows],
                  [r["high"] - r["estimate"] for _, r in rows]])
  ax_bar.bar(np.arange(3), est, yerr=err, capsize=4, color=["tab:blue", "tab:red", "tab:gray"])
  ax_bar.set_xticks(np.arange(3))
  ax_bar.set_xticklabels([n for n, _ in rows])
  ax_bar.set_title("avg JSD on held-out situations (95 % CI)")
  per = ev["per_situation"]
  ax_hist.hist(np.asarray(per["copy"]) - np.asarray(per["sft"]), bins=30, color="tab:gray")
  ax_hist.axvline(0.0, color="k", lw=0.8)
  ax_hist.set_title("copy − SFT per situation")
  fig.suptitle(title)
  return pictures.save_figure(fig, path, dpi=110)


if __name__ == "__main__":
  sys.exit(common.main(run_experiment))
