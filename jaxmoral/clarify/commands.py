"""`jaxmoral clarify <action>`: thin flag parsing around the library calls.

Actions::

  train-model --which question|answer|fusion|judge|nli|relevance|multitask --model_dir D
              [--source demo|DATA_DIR] [--split train] [--train_steps N] [--batch_size B]
              [--vocabulary_path SPM] [--size tiny] [--judge_classes bad,ok,good]
  train-ppo   --model_dir D --question_model_dir Q --answer_model_dir A --fusion_model_dir F
              --judge_model_dir J [--nli_model_dir N] [--num_iterations I] [--source demo]
              [--batch_size B] [--judge_classes ...]
  evaluate    --question_model_dir Q --answer_model_dir A --fusion_model_dir F
              --judge_model_dir J [--nli_model_dir N] [--relevance_model_dir R]
              [--ppo_model_dir P] [--source demo|DATA_DIR] [--split dev]
              [--max_situations 100] [--output evaluation.json]
  chat        --question_model_dir Q --fusion_model_dir F --judge_model_dir J
              [--max_turns 3] [--transcript chat.jsonl]
  chat-file   --input in.jsonl --output out.jsonl --question_model_dir Q --fusion_model_dir F
              --judge_model_dir J [--answer_model_dir A] [--max_turns 3]
  demo        [--workdir clarify_demo] [--train_steps 300] [--ppo_iterations 4]

Gin files / bindings (`--gin_file`, `--gin.NAME=VALUE`) are parsed first; a flag given on the
command line overrides them, and `train-model` / `train-ppo` with only gin (e.g.
`configs/clarify/gpu.gin`) call the gin-bound entry points as they are configured.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

from jaxmoral import gin_utils

ACTIONS = ("train-model", "train-ppo", "evaluate", "chat", "chat-file", "demo")


def _classes(text: Optional[str]) -> Optional[tuple[str, ...]]:
  return tuple(c.strip() for c in text.split(",")) if text else None


def _parser(action: str) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=f"jaxmoral clarify {action}")
  models = ("question", "answer", "fusion", "judge", "nli", "relevance", "ppo")
  if action == "train-model":
    parser.add_argument("--which", required=True,
                        choices=["question", "answer", "fusion", "judge", "nli", "relevance",
                                 "multitask"])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--source", default=None, help="'demo' or a δ-Clarify data folder")
    parser.add_argument("--split", default=None)
    parser.add_argument("--train_steps", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--vocabulary_path", default=None)
    parser.add_argument("--size", default=None, help="T5 size when no gin MODEL_CONFIG")
    parser.add_argument("--learning_rate", type=float, default=None,
                        help="the gin macro LEARNING_RATE; default 1e-3 without a gin optimizer")
  elif action == "train-ppo":
    parser.add_argument("--model_dir", required=True)
    for m in models[:5]:
      parser.add_argument(f"--{m}_model_dir", default=None)
    parser.add_argument("--num_iterations", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--source", default=None)
    parser.add_argument("--learning_rate", type=float, default=None,
                        help="the gin macro PPO_LEARNING_RATE; default 1e-5 without a gin "
                             "optimizer")
  elif action == "evaluate":
    for m in models:
      parser.add_argument(f"--{m}_model_dir", default=None)
    parser.add_argument("--source", default="demo")
    parser.add_argument("--split", default="dev",
                        help="demo: train|dev; a folder: any delta_clarify/<split>.tsv it has")
    parser.add_argument("--max_situations", type=int, default=100)
    parser.add_argument("--output", default="clarify_evaluation.json")
    parser.add_argument("--no_nli", action="store_true", help="disable the NLI filter")
  elif action in ("chat", "chat-file"):
    for m in ("question", "fusion", "judge"):
      parser.add_argument(f"--{m}_model_dir", required=True)
    parser.add_argument("--max_turns", type=int, default=3)
    if action == "chat":
      parser.add_argument("--transcript", default="clarify_chat.jsonl")
    else:
      parser.add_argument("--input", required=True)
      parser.add_argument("--output", required=True)
      parser.add_argument("--answer_model_dir", default=None)
  elif action == "demo":
    parser.add_argument("--workdir", default="clarify_demo")
    parser.add_argument("--train_steps", type=int, default=300)
    parser.add_argument("--ppo_iterations", type=int, default=4)
    parser.add_argument("--separate_models", action="store_true")
  if action != "demo":
    parser.add_argument("--judge_classes", default=None,
                        help="comma list for bad,ok,good (each one vocabulary token)")
  return parser


# The flags naming what an action writes: {action: {flag: is a directory}}.
OUTPUTS: dict[str, dict[str, bool]] = {
    "train-model": {"model_dir": True},
    "train-ppo": {"model_dir": True},
    "evaluate": {"output": False},
    "chat": {"transcript": False},
    "chat-file": {"output": False},
    "demo": {"workdir": True},
}


def _check_outputs(action: str, args: argparse.Namespace) -> None:
  """Raises the OSError writing an output would meet, before any model loads or trains."""
  for flag, directory in OUTPUTS.get(action, {}).items():
    path = getattr(args, flag, None)
    if path:
      gin_utils.check_writable(path, directory=directory)


def _set(kwargs: dict[str, Any], **values: Any) -> dict[str, Any]:
  """Adds the flags that were given (None = leave it to gin / the default)."""
  kwargs.update({k: v for k, v in values.items() if v is not None})
  return kwargs


def main(action: str, rest: Sequence[str], gin_args: Any) -> int:
  """Runs one action; returns the exit code."""
  if action not in ACTIONS:
    raise ValueError(f"jaxmoral clarify: unknown action {action!r}; choose from {ACTIONS}")
  args = _parser(action).parse_args(list(rest))
  _check_outputs(action, args)
  gin_utils.parse_gin(gin_args)
  learning_rate = getattr(args, "learning_rate", None)
  if action == "train-model":
    learning_rate = _learning_rate_flag(learning_rate, "LEARNING_RATE", "train_clarify_model",
                                        default=1e-3)
  elif action == "train-ppo":
    learning_rate = _learning_rate_flag(learning_rate, "PPO_LEARNING_RATE", "train_clarify_ppo",
                                        default=1e-5)
  classes = _classes(getattr(args, "judge_classes", None))
  if action == "train-model":
    from jaxmoral import optimizers
    from jaxmoral.clarify import training
    from jaxmoral.models import config as config_lib
    kwargs = _set({}, which=args.which, model_dir=args.model_dir, source=args.source,
                  split=args.split, train_steps=args.train_steps, batch_size=args.batch_size,
                  vocabulary_path=args.vocabulary_path, judge_classes=classes)
    if args.size is not None:
      kwargs["model_config"] = config_lib.t5_config(size=args.size)
    _defaults_unless_gin(kwargs, "train_clarify_model", {
        "model_config": lambda: config_lib.t5_config(size="tiny"),
        "optimizer": lambda: optimizers.make_optimizer(name="adamw",
                                                       learning_rate=learning_rate),
        "train_steps": lambda: 1000, "batch_size": lambda: 32,
        "feature_lengths": lambda: {"inputs": 128, "targets": 32}})
    gin_utils.check_required()
    training.train_clarify_model(**kwargs)
  elif action == "train-ppo":
    from jaxmoral import optimizers
    from jaxmoral.clarify import reward as reward_lib
    from jaxmoral.clarify import training
    from jaxmoral.rl import ppo_trainer
    kwargs = _set({}, model_dir=args.model_dir, question_model_dir=args.question_model_dir,
                  answer_model_dir=args.answer_model_dir, fusion_model_dir=args.fusion_model_dir,
                  judge_model_dir=args.judge_model_dir, nli_model_dir=args.nli_model_dir,
                  num_iterations=args.num_iterations, source=args.source)
    if classes:
      kwargs["reward_config"] = reward_lib.RewardConfig(judge_classes=classes)
    if args.batch_size:
      kwargs["ppo_config"] = ppo_trainer.PPOConfig(batch_size=args.batch_size)
    _defaults_unless_gin(kwargs, "train_clarify_ppo", {
        "ppo_config": ppo_trainer.PPOConfig,
        "optimizer": lambda: optimizers.make_optimizer(name="adamw",
                                                       learning_rate=learning_rate),
        "num_iterations": lambda: 100})
    _require(kwargs, "train_clarify_ppo", [f"{m}_model_dir" for m in
                                           ("question", "answer", "fusion", "judge")])
    gin_utils.check_required()
    result = training.train_clarify_ppo(**kwargs)
    print({k: v for k, v in result.items() if k != "reward_curve_values"})
  elif action == "evaluate":
    _evaluate(args, classes)
  elif action == "chat":
    from jaxmoral.clarify import chat
    chat.chat(question_model_dir=args.question_model_dir,
              fusion_model_dir=args.fusion_model_dir, judge_model_dir=args.judge_model_dir,
              max_turns=args.max_turns, transcript_path=args.transcript,
              **({"judge_classes": classes} if classes else {}))
  elif action == "chat-file":
    from jaxmoral.clarify import chat
    chat.chat_from_file(input_jsonl=args.input, output_jsonl=args.output,
                        question_model_dir=args.question_model_dir,
                        fusion_model_dir=args.fusion_model_dir,
                        judge_model_dir=args.judge_model_dir,
                        answer_model_dir=args.answer_model_dir, max_turns=args.max_turns,
                        **({"judge_classes": classes} if classes else {}))
  else:
    from jaxmoral.clarify import demo
    demo.run_demo(workdir=args.workdir, train_steps=args.train_steps,
                  ppo_iterations=args.ppo_iterations, separate_models=args.separate_models)
  return 0


def _learning_rate_flag(flag: Optional[float], macro: str, function: str, *,
                        default: float) -> float:
  """The rate of the flag-built optimizer; a given flag also sets the gin `macro`.

  A gin-bound optimizer reads its rate from `macro` (configs/clarify/*.gin do), so the flag
  rebinds it. Raises if gin binds an optimizer that does not use the macro: the flag would
  otherwise be ignored.
  """
  import gin
  if flag is None:
    return default
  try:
    gin.query_parameter(f"{function}.optimizer")
  except ValueError:
    return flag  # No gin optimizer: the flag-built one uses the rate.
  try:
    gin.query_parameter(f"%{macro}")
  except ValueError:
    raise ValueError(f"jaxmoral clarify: --learning_rate sets the gin macro {macro}, which "
                     f"this config's {function}.optimizer does not use; set the rate in gin "
                     f"or bind {macro}") from None
  gin.parse_config(f"{macro} = {flag!r}")
  return flag


def _defaults_unless_gin(kwargs: dict[str, Any], function: str, defaults: dict[str, Any]) -> None:
  """Fills keyword defaults that neither a flag nor a gin binding provides."""
  import gin
  for name, make in defaults.items():
    if name in kwargs:
      continue
    try:
      gin.query_parameter(f"{function}.{name}")
    except ValueError:
      kwargs[name] = make()


def _require(kwargs: dict[str, Any], function: str, names: Sequence[str]) -> None:
  import gin
  for name in names:
    if name in kwargs:
      continue
    try:
      gin.query_parameter(f"{function}.{name}")
    except ValueError:
      raise ValueError(f"jaxmoral clarify: --{name} is required (or bind "
                       f"{function}.{name} in gin)") from None


def _evaluate(args: argparse.Namespace, classes: Optional[tuple[str, ...]]) -> None:
  from jaxmoral.clarify import baselines
  from jaxmoral.clarify import data as data_lib
  from jaxmoral.clarify import evaluate
  from jaxmoral.clarify import models
  from jaxmoral.clarify import reward as reward_lib
  for name in ("question", "answer", "fusion", "judge"):
    if not getattr(args, f"{name}_model_dir"):
      raise ValueError(f"jaxmoral clarify evaluate: --{name}_model_dir is required")
  # --source / --split first: any split whose file the folder has; a missing one fails
  # (listing those present) before any model loads.
  situations = data_lib.situations(args.source, split=args.split)[:args.max_situations]
  config = reward_lib.RewardConfig(use_nli=not args.no_nli,
                                   **({"judge_classes": classes} if classes else {}))
  reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=args.answer_model_dir, fusion_model_dir=args.fusion_model_dir,
      judge_model_dir=args.judge_model_dir, nli_model_dir=args.nli_model_dir, config=config)
  optional = lambda d: models.load_model(d) if d else None  # noqa: E731
  systems = baselines.all_generators(
      question_model=models.load_model(args.question_model_dir), reward=reward,
      relevance_model=optional(args.relevance_model_dir), ppo_model=optional(args.ppo_model_dir))
  evaluate.compare(systems, situations, reward, output_json=args.output)
  print(f"wrote {args.output}")
