"""Question generators: the fine-tuned / PPO θQ and the paper's baselines.

A generator maps situations to one question each: `fn(situations) -> list[str]`.
`all_generators` gives every system the given models allow.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jaxmoral.clarify import formats
from jaxmoral.clarify import models
from jaxmoral.clarify import reward as reward_lib

Generator = Callable[[Sequence[str]], list[str]]


def select_best(candidates: Sequence[Sequence[str]], scores: np.ndarray) -> list[str]:
  """Per situation the candidate with the highest score (first one on ties)."""
  return [list(c)[int(np.argmax(s))] for c, s in zip(candidates, np.asarray(scores), strict=True)]


def sampled_generator(question_model: models.ClarifyModel, *, top_p: float = 0.6,
                      temperature: float = 1.0, max_length: int = 32, seed: int = 0,
                      greedy: bool = False) -> Generator:
  """θQ alone (nucleus sampling by default)."""
  def generate(situations: Sequence[str]) -> list[str]:
    inputs = [formats.question_input(s) for s in situations]
    out = question_model.predict(inputs, max_decode_length=max_length, greedy=greedy,
                                 top_p=top_p, temperature=temperature,
                                 rng=jax.random.PRNGKey(seed)).decoded
    return [o[0] for o in out]
  return generate


def wh_candidates(question_model: models.ClarifyModel, situations: Sequence[str], *,
                  wh_words: Sequence[str] = formats.PIPELINE_WH_WORDS,
                  max_length: int = 32) -> list[list[str]]:
  """One greedy wh-conditioned question per (situation, wh-word)."""
  inputs = [formats.question_input(s, w) for s in situations for w in wh_words]
  out = question_model.predict(inputs, max_decode_length=max_length, greedy=True).decoded
  k = len(wh_words)
  return [[o[0] for o in out[i * k:(i + 1) * k]] for i in range(len(situations))]


def pipeline_generators(question_model: models.ClarifyModel,
                        reward: reward_lib.DefeasibilityReward, *,
                        wh_words: Sequence[str] = formats.PIPELINE_WH_WORDS,
                        max_length: int = 32) -> dict[str, Generator]:
  """The wh-conditioned questions ranked by the defeasibility reward with the NLI filter
  ("pipeline") and without it ("pipeline_no_nli"), from one candidate set and one scoring.

  The filter zeroes a filtered question's reward but changes neither its answers nor its
  fusions, so the unfiltered JSD (`RewardResult.jsd`) of the NLI pipeline's scoring is the
  no-NLI pipeline's reward: one pass serves both. The scoring of the last situations asked
  for is kept for the other system (answers are greedy by default, so a fresh scoring of the
  same situations would repeat it).
  """
  last: dict[str, object] = {}

  def scored(situations: Sequence[str]):
    if last.get("situations") != list(situations):
      candidates = wh_candidates(question_model, situations, wh_words=wh_words,
                                 max_length=max_length)
      flat_s = [s for s, c in zip(situations, candidates, strict=True) for _ in c]
      flat_q = [q for c in candidates for q in c]
      result = reward.score_questions(flat_s, flat_q, use_nli=True)
      last.update(situations=list(situations), candidates=candidates, result=result)
    return last["candidates"], last["result"]

  def ranked_by(field: str) -> Generator:
    def generate(situations: Sequence[str]) -> list[str]:
      candidates, result = scored(situations)
      scores = np.asarray(getattr(result, field)).reshape(len(situations), len(wh_words))
      return select_best(candidates, scores)
    return generate

  return {"pipeline": ranked_by("scores"), "pipeline_no_nli": ranked_by("jsd")}


def why_generator() -> Generator:
  return lambda situations: [formats.why_question(s) for s in situations]


def discriminator_generator(question_model: models.ClarifyModel,
                            relevance_model: models.ClarifyModel, *, num_candidates: int = 8,
                            top_p: float = 0.6, max_length: int = 32, seed: int = 0,
                            labels: Sequence[str] = formats.RELEVANCE_LABELS) -> Generator:
  """Sampled θQ candidates; the relevance classifier picks the most relevant."""
  def generate(situations: Sequence[str]) -> list[str]:
    inputs = [formats.question_input(s) for s in situations]
    candidates = question_model.predict(inputs, max_decode_length=max_length,
                                        num_samples=num_candidates, greedy=False, top_p=top_p,
                                        rng=jax.random.PRNGKey(seed)).decoded
    pairs = [formats.relevance_input(situation=s, question=q)
             for s, c in zip(situations, candidates, strict=True) for q in c]
    scores = relevance_model.label_distribution(pairs, labels)[:, 0]  # P(relevant)
    return select_best(candidates, scores.reshape(len(situations), num_candidates))
  return generate


def all_generators(*, question_model: models.ClarifyModel,
                   reward: reward_lib.DefeasibilityReward,
                   relevance_model: Optional[models.ClarifyModel] = None,
                   ppo_model: Optional[models.ClarifyModel] = None,
                   wh_words: Sequence[str] = formats.PIPELINE_WH_WORDS) -> dict[str, Generator]:
  """The systems of the paper's comparison that the given models allow."""
  systems = {"why": why_generator(), "finetuned": sampled_generator(question_model),
             **pipeline_generators(question_model, reward, wh_words=wh_words)}
  if reward.nli is None:  # Without a filter the two pipelines are one system.
    del systems["pipeline_no_nli"]
  if relevance_model is not None:
    systems["discriminator"] = discriminator_generator(question_model, relevance_model)
  if ppo_model is not None:
    systems["ppo"] = sampled_generator(ppo_model)
  return systems
