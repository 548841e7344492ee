"""The ClarifyDelphi demo: everything tiny, trained from scratch on the bundled demo corpus.

`run_demo(workdir=...)` (part of `jaxmoral demo`, about 2-3 minutes on 2 CPU cores) builds the
demo vocabulary, trains ONE tiny multi-task T5 serving every role (T5's task prefixes tell them
apart; `separate_models=True` trains one run per role, slower), runs a few PPO iterations of θQ
against the defeasibility reward, evaluates every system on held-out situations and writes a
non-interactive chat transcript. The numbers are real but come from tiny models trained for
seconds: they show the plumbing, not the paper's results.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import gin

from jaxmoral import demo as demo_lib
from jaxmoral import optimizers
from jaxmoral.clarify import chat as chat_lib
from jaxmoral.clarify import data as data_lib
from jaxmoral.clarify import evaluate as evaluate_lib
from jaxmoral.clarify import formats
from jaxmoral.clarify import reward as reward_lib
from jaxmoral.clarify import training
from jaxmoral.data import readers
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.rl import ppo_trainer


@gin.configurable
def run_demo(*, workdir: str, train_steps: int = 300, batch_size: int = 32,
             ppo_iterations: int = 4, ppo_batch_size: int = 8, separate_models: bool = False,
             eval_situations: int = 6, learning_rate: float = 3e-3, seed: int = 0
             ) -> dict[str, Any]:
  """Trains, tunes, evaluates and chats; returns (and prints) what it measured.

  Args:
    workdir: Output folder (run directories, TensorBoard, table JSON, transcript, PNG).
    train_steps: Supervised steps (per model with `separate_models`).
    batch_size: Supervised batch size.
    ppo_batch_size: Situations per PPO iteration.
    separate_models: One run per role instead of one multi-task run.
    eval_situations: Held-out situations in the evaluation table.
    learning_rate: Peak supervised learning rate.

  Returns:
    {"model_dirs", "ppo", "evaluation", "transcript", "reward_curve", "seconds", ...}.
  """
  start = time.time()
  work = pathlib.Path(workdir)
  work.mkdir(parents=True, exist_ok=True)
  vocab_path = vocab_lib.build_demo_vocabulary(output_dir=work / "vocab")
  common = dict(model_config=config_lib.t5_config(size="tiny"), batch_size=batch_size,
                source="demo", vocabulary_path=vocab_path, judge_classes=formats.DEMO_JUDGE_CLASSES,
                feature_lengths={"inputs": 64, "targets": 32}, log_every=100, seed=seed,
                checkpoint_every=train_steps, optimizer=optimizers.make_optimizer(
                    name="adamw", weight_decay=0.01, grad_clip_norm=1.0,
                    learning_rate=optimizers.make_schedule(
                        name="warmup_linear_decay", base_learning_rate=learning_rate,
                        warmup_steps=max(train_steps // 10, 1), total_steps=train_steps)))
  dirs: dict[str, str] = {}
  timings: dict[str, float] = {}
  for which in (data_lib.WHICH if separate_models else ("multitask",)):
    tick = time.time()
    model_dir = str(work / f"{which}_model")
    training.train_clarify_model(which=which, model_dir=model_dir, train_steps=train_steps,
                                 **common)
    timings[f"train_{which}"] = time.time() - tick
    dirs[which] = model_dir
  role_dir = {r: dirs[r] if r in dirs else dirs["multitask"] for r in data_lib.WHICH}

  # Held-out situations for the evaluation; PPO trains on the others (its split "train").
  held_out = data_lib.situations("demo", split="dev")[:eval_situations]
  reward_config = reward_lib.RewardConfig(
      judge_classes=formats.DEMO_JUDGE_CLASSES, batch_size=32, input_length=64,
      max_answer_length=24, max_fusion_length=32)
  tick = time.time()
  # The original recipe (PPOConfig's defaults) at demo scale.
  ppo_config = ppo_trainer.PPOConfig(
      batch_size=ppo_batch_size, max_prompt_length=48, reward_norm_num_prompts=ppo_batch_size)
  ppo_dir = str(work / "ppo")
  ppo = training.train_clarify_ppo(
      model_dir=ppo_dir, question_model_dir=role_dir["question"],
      answer_model_dir=role_dir["answer"], fusion_model_dir=role_dir["fusion"],
      judge_model_dir=role_dir["judge"], nli_model_dir=role_dir["nli"], ppo_config=ppo_config,
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-4),
      num_iterations=ppo_iterations, reward_config=reward_config, log_every=1,
      sample_every=ppo_iterations, checkpoint_every=ppo_iterations, seed=seed,
      async_checkpoint=False)
  timings["ppo"] = time.time() - tick

  tick = time.time()
  systems, reward = evaluate_lib.systems_from_dirs(
      question_model_dir=role_dir["question"], answer_model_dir=role_dir["answer"],
      fusion_model_dir=role_dir["fusion"], judge_model_dir=role_dir["judge"],
      nli_model_dir=role_dir["nli"], relevance_model_dir=role_dir["relevance"],
      ppo_model_dir=ppo["policy_dir"], reward_config=reward_config, input_length=64,
      batch_size=32)
  table_path = work / "evaluation.json"
  evaluation = evaluate_lib.compare(systems, held_out, reward, output_json=table_path)
  timings["evaluate"] = time.time() - tick

  tick = time.time()
  chat_in = readers.write_jsonl(work / "chat_input.jsonl", [
      {"situation": held_out[0], "answers": ["I had a good reason.", "Nobody was hurt."]},
      {"situation": held_out[1], "update_type": "strengthener"}])
  transcript = work / "chat_transcript.jsonl"
  chat_lib.chat_from_file(input_jsonl=chat_in, output_jsonl=str(transcript),
                          question_model_dir=ppo["policy_dir"],
                          fusion_model_dir=role_dir["fusion"], judge_model_dir=role_dir["judge"],
                          answer_model_dir=role_dir["answer"],
                          judge_classes=formats.DEMO_JUDGE_CLASSES, max_turns=3)
  timings["chat"] = time.time() - tick
  seconds = time.time() - start

  print("\n== ClarifyDelphi demo ==")
  print("sample questions (PPO policy):")
  for s in evaluation.get("ppo", {}).get("samples", [])[:3]:
    print(f"  {s['situation']!r} -> {s['question']!r} (JSD {s['jsd']:.4f})")
  print("PPO raw reward per iteration: "
        + ", ".join(f"{x:.4f}" for x in ppo["reward_curve_values"]))
  truth = demo_lib.clarify_truth_lines(evaluation)  # printed once, by demo.run_all
  for folder in sorted(set(role_dir.values())):
    roles = [role for role, where in role_dir.items() if where == folder]
    print(f"model of the {', '.join(roles)} role{'s' if len(roles) > 1 else ''}: {folder}")
  print(f"PPO run (checkpoints, TensorBoard train/; loads as the tuned question generator):\n"
        f"  {ppo_dir}")
  print(f"reward curve: {ppo['reward_curve']}")
  print(f"table: {table_path}")
  print(f"transcript: {transcript}")
  print(f"done in {seconds:.0f}s ({', '.join(f'{k} {v:.0f}s' for k, v in timings.items())})")
  return {"model_dirs": role_dir, "ppo": dict(ppo),
          "evaluation": evaluation, "evaluation_json": str(table_path),
          "transcript": str(transcript), "reward_curve": ppo["reward_curve"],
          "timings": timings, "seconds": seconds, "truth": truth}


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import sys
  run_demo(workdir=sys.argv[1] if len(sys.argv) > 1 else "clarify_demo")
