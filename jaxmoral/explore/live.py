"""The live-input boxes: a typed input through the library's own functions.

Models load on first use and stay loaded (one per folder and role); calls are serialised so
that two browser tabs never load the same model twice. Nothing here writes a file.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Optional, Sequence

from jaxmoral.explore import security

_LOCK = threading.Lock()


def _capped(lines: list[str], what: str) -> list[str]:
  if len(lines) > security.MAX_LINES:
    raise ValueError(f"at most {security.MAX_LINES} {what} (got {len(lines)})")
  return lines


def _lines(text: str, what: str) -> list[str]:
  return _capped([line.strip() for line in (text or "").splitlines() if line.strip()], what)


def parse_classes(text: str) -> tuple[str, ...]:
  """Judge classes typed as "bad,ok,good" (at most `security.MAX_CLASSES`)."""
  classes = tuple(c.strip() for c in (text or "").split(",") if c.strip())
  if len(classes) > security.MAX_CLASSES:
    raise ValueError(f"the judge takes 3 classes (bad, ok, good); got {len(classes)}")
  return classes


# Which models (by `model_traits`) can do each live box's job.
JOBS = {"npov": lambda t: not t["prompt"], "generator": lambda t: t["prompt"],
        "clarify": lambda t: not t["prompt"] and t["kind"] != "clarify_ppo_policy",
        "question": lambda t: not t["prompt"], "nli": lambda t: not t["prompt"],
        "diamante": lambda t: t["scalar_head"]}
_JOB_WORDS = {"npov": ("npov", "base"), "generator": ("generator",),
              "clarify": ("multitask", "judge", "clarify"), "question": ("ppo", "question"),
              "nli": ("nli", "multitask"), "diamante": ("diamante",)}


@functools.lru_cache(maxsize=256)
def _traits(model_dir: str, stamp: float) -> Optional[dict[str, Any]]:
  del stamp  # The cache key: a retrained model's folder is read again.
  from jaxmoral import model_dirs  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import judge  # pylint: disable=import-outside-toplevel
  try:
    info = model_dirs.inspect(model_dir)
  except Exception:  # pylint: disable=broad-except  (not loadable: offered for no job)
    return None
  try:
    classes: Optional[tuple[str, ...]] = judge.fitting_classes(info.vocabulary)
  except Exception:  # pylint: disable=broad-except  (not a judge: the form says so on use)
    classes = None
  names = list(info.param_shapes or ())
  model = (info.settings or {}).get("model") if isinstance(info.settings, dict) else None
  return {"prompt": any(n.split("/")[0] == "prompt" for n in names),
          "scalar_head": any(n.split("/")[0] == "scalar_head" for n in names),
          "kind": model.get("kind") if isinstance(model, dict) else None, "classes": classes}


def model_traits(model_dir: str) -> Optional[dict[str, Any]]:
  """What a model folder is (no weights read): {"prompt": a prompt-tuning run, "scalar_head":
  Diamante's preference head, "kind": its settings' model kind, "classes": its judge classes};
  None if no loader reads it."""
  try:
    return _traits(model_dir, os.stat(model_dir).st_mtime)
  except OSError:
    return None


def choices_for_jobs(models: Sequence[tuple[str, str, str]]) -> dict[str, list[dict[str, str]]]:
  """{job: [{"value", "label"}]} of `models` ((value, label, folder) each) that can do the
  job (`JOBS`), those whose path names the job first (the default)."""
  traits = [(value, label, model_traits(folder)) for value, label, folder in models]
  out = {}
  for job, can in JOBS.items():
    usable = [(value, label) for value, label, t in traits if t is not None and can(t)]
    usable.sort(key=lambda m: not any(w in m[1].lower() for w in _JOB_WORDS[job]))
    out[job] = [{"value": value, "label": label} for value, label in usable]
  return out


def model_judge_classes(model_dir: Optional[str]) -> Optional[tuple[str, ...]]:
  """The judge classes (bad, ok, good) the model's training chose
  (`clarify.judge.fitting_classes`); None when it cannot be read."""
  traits = model_traits(model_dir) if model_dir else None
  return traits["classes"] if traits else None


@functools.lru_cache(maxsize=4)
def _salience_detector(base_dir: str, generator_dir: Optional[str]) -> Any:
  from jaxmoral.npov import detect  # pylint: disable=import-outside-toplevel
  return detect.build_detector("salience", base_dir=base_dir, generator_dir=generator_dir)


def npov_salience(*, base_dir: str, query: str, pro: str, con: str, response: str,
                  generator_dir: Optional[str] = None) -> dict[str, Any]:
  """Salience of a typed response (`SalienceDetector`), as `Detection.to_json()`.

  Args:
    base_dir: The base model's folder (any format `model_dirs.load` reads).
    query, response: The user query and the response to explain.
    pro, con: The pro and the con arguments, one a line.
    generator_dir: The generator's prompt folder (None: the base model alone).
  """
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  example = task.NpovExample(id="live", topic="live", query=query.strip(),
                             pro=tuple(_lines(pro, "pro arguments")),
                             con=tuple(_lines(con, "con arguments")),
                             response=response.strip())
  if not example.response:
    raise ValueError("type a response to explain")
  with _LOCK:
    detector = _salience_detector(base_dir, generator_dir)
    detection = detector.detect_from_map(detector.word_map(example))
  return detection.to_json()


@functools.lru_cache(maxsize=2)
def _reward(answer_dir: str, fusion_dir: str, judge_dir: str, nli_dir: Optional[str],
            judge_classes: tuple[str, ...]) -> Any:
  from jaxmoral.clarify import reward as reward_lib  # pylint: disable=import-outside-toplevel
  config = reward_lib.RewardConfig(judge_classes=judge_classes, use_nli=nli_dir is not None,
                                   batch_size=1)
  return reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=answer_dir, fusion_model_dir=fusion_dir, judge_model_dir=judge_dir,
      nli_model_dir=nli_dir, config=config)


@functools.lru_cache(maxsize=2)
def _question_model(question_dir: str) -> Any:
  from jaxmoral.clarify import models  # pylint: disable=import-outside-toplevel
  return models.load_model(question_dir, batch_size=1)


def clarify_question(*, situation: str, question: str, question_dir: Optional[str],
                     answer_dir: str, fusion_dir: str, judge_dir: str,
                     nli_dir: Optional[str] = None,
                     judge_classes: Sequence[str] = ()) -> dict[str, Any]:
  """A clarification question (typed, or the question model's greedy one) through the reward
  pipeline (`DefeasibilityReward.score_questions`), as `RewardResult.row(0)` with "situation"
  and "question".

  Args:
    judge_classes: The judge's strings for bad, ok, good (empty: the judge model's own).
  """
  from jaxmoral.clarify import formats  # pylint: disable=import-outside-toplevel
  situation = situation.strip()
  if not situation:
    raise ValueError("type a situation")
  classes = tuple(judge_classes) or model_judge_classes(judge_dir) or formats.T5_JUDGE_CLASSES
  if len(classes) != 3:
    raise ValueError(f"type the judge's three classes, for bad, ok and good, separated by "
                     f"commas (got {len(classes)})")
  with _LOCK:
    question = question.strip()
    if not question:
      if not question_dir:
        raise ValueError("type a question, or choose a question model")
      question = _question_model(question_dir).predict(
          [formats.question_input(situation)], max_decode_length=32, greedy=True).texts[0][0]
    try:
      reward = _reward(answer_dir, fusion_dir, judge_dir, nli_dir, classes)
    except ValueError as error:
      if "ONE token" not in str(error):
        raise
      own = model_judge_classes(judge_dir)
      raise ValueError(
          f"the judge model cannot score the classes {', '.join(classes)}: each must be one "
          "token of its vocabulary" + (f"; this model's are {', '.join(own)}" if own else "")
      ) from None
    row = reward.score_questions([situation], [question]).row(0)
  return {"situation": situation, "question": question, **row}


@functools.lru_cache(maxsize=2)
def _bundle(model_dir: str) -> Any:
  from jaxmoral.diamante import bundle as bundle_lib  # pylint: disable=import-outside-toplevel
  return bundle_lib.load(model_dir)


def diamante_rank(*, model_dir: str, context: Sequence[str],
                  responses: Sequence[str]) -> dict[str, Any]:
  """Responses to a context ranked by the preference score, as `sources.ranked`, beside their
  generation log-probabilities, total and per token (EOS included, as evaluation divides).

  Args:
    model_dir: A Diamante run or export.
    context: The earlier utterances, oldest first.
    responses: The responses to rank, the human one first (marked, its ranking measured).
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxmoral.diamante import data  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import inference  # pylint: disable=import-outside-toplevel
  from jaxmoral.explore import sources  # pylint: disable=import-outside-toplevel
  context = _capped([c for c in context if c.strip()], "context utterances")
  responses = _capped([r for r in responses if r.strip()], "responses")
  if not context or not responses:
    raise ValueError("type a context (one utterance a line) and at least one response")
  with _LOCK:
    bundle = _bundle(model_dir)
    scores, logprobs = inference.rank_texts(bundle, context, responses)
  lengths = [int(np.sum(data.encode_response(bundle.vocabulary, r, bundle.features) > 0))
             for r in responses]
  return sources.ranked(list(responses), scores.tolist(), logprobs.tolist(), lengths, 0)
