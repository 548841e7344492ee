"""The live-input boxes: a typed input through the library's own functions.

Models load on first use and stay loaded (one per folder and role); calls are serialised so
that two browser tabs never load the same model twice. Nothing here writes a file.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional, Sequence

_LOCK = threading.Lock()


def _lines(text: str) -> list[str]:
  return [line.strip() for line in (text or "").splitlines() if line.strip()]


@functools.lru_cache(maxsize=4)
def _salience_detector(base_dir: str, generator_dir: Optional[str]) -> Any:
  from jaxmoral.npov import detect  # pylint: disable=import-outside-toplevel
  return detect.build_detector("salience", base_dir=base_dir, generator_dir=generator_dir)


def npov_salience(*, base_dir: str, query: str, pro: str, con: str, response: str,
                  generator_dir: Optional[str] = None) -> dict[str, Any]:
  """Salience of a typed response (`SalienceDetector.word_map` and `detect_from_map`).

  Args:
    base_dir: The base model's folder (any format `model_dirs.load` reads).
    query: The user query.
    pro: Pro arguments, one a line.
    con: Con arguments, one a line.
    response: The response to explain.
    generator_dir: The generator's prompt folder (None: the base model alone).

  Returns:
    `Detection.to_json()`: example scores and every content word's score.
  """
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  example = task.NpovExample(id="live", topic="live", query=query.strip(),
                             pro=tuple(_lines(pro)), con=tuple(_lines(con)),
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


def clarify_question(*, situation: str, question: str, question_dir: Optional[str],
                     answer_dir: str, fusion_dir: str, judge_dir: str,
                     nli_dir: Optional[str] = None,
                     judge_classes: Sequence[str] = ("bad", "okay", "good")) -> dict[str, Any]:
  """A clarification question (typed, or the question model's greedy one) and its reward
  pipeline (`DefeasibilityReward.score_questions`: answers, NLI filter, fusion, judge, JSD).

  Returns:
    `RewardResult.row(0)` with "situation" and "question".
  """
  from jaxmoral.clarify import formats  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import models  # pylint: disable=import-outside-toplevel
  situation = situation.strip()
  if not situation:
    raise ValueError("type a situation")
  with _LOCK:
    question = question.strip()
    if not question:
      if not question_dir:
        raise ValueError("type a question, or choose a question model")
      model = models.load_model(question_dir, batch_size=1)
      question = models.generate(model, [formats.question_input(situation)],
                                 greedy=True)[0][0]
    reward = _reward(answer_dir, fusion_dir, judge_dir, nli_dir, tuple(judge_classes))
    row = reward.score_questions([situation], [question]).row(0)
  return {"situation": situation, "question": question, **row}


@functools.lru_cache(maxsize=2)
def _bundle(model_dir: str) -> Any:
  from jaxmoral.diamante import bundle as bundle_lib  # pylint: disable=import-outside-toplevel
  return bundle_lib.load(model_dir)


def diamante_rank(*, model_dir: str, context: Sequence[str], responses: Sequence[str],
                  human_first: bool = True) -> dict[str, Any]:
  """Responses to a context ranked by the preference score (`inference.rank_texts`), beside
  their generation log-probabilities, total and per token (EOS included, as evaluation's
  `generation_per_token` ranker divides).

  Args:
    model_dir: A Diamante run or export.
    context: The earlier utterances, oldest first.
    responses: The responses to rank.
    human_first: The first response is the human one (marked, and its ranking measured).

  Returns:
    `sources.ranked(...)`: rows best first, and the human response's ranking metrics.
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxmoral.diamante import data  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import inference  # pylint: disable=import-outside-toplevel
  from jaxmoral.explore import sources  # pylint: disable=import-outside-toplevel
  context = [c for c in context if c.strip()]
  responses = [r for r in responses if r.strip()]
  if not context or not responses:
    raise ValueError("type a context (one utterance a line) and at least one response")
  with _LOCK:
    bundle = _bundle(model_dir)
    scores, logprobs = inference.rank_texts(bundle, context, responses)
  lengths = [int(np.sum(data.encode_response(bundle.vocab, r, bundle.features) > 0))
             for r in responses]
  return sources.ranked(list(responses), scores.tolist(), logprobs.tolist(), lengths,
                        0 if human_first else None)
