"""The defeasibility reward of a clarification question (Pyatkin et al. 2023).

For a situation s and a question q:

1. the judge gives the default judgment j of s (argmax class);
2. θA answers q once as a weakener and once as a strengthener of j (greedy, or sampled);
3. the NLI filter drops an answer that s entails or contradicts; as in the paper, if either
   answer is filtered the question gets the minimum reward, 0;
4. the fusion model writes s ⊕ a for both answers;
5. the judge scores both updated situations;
6. r = JSD(P_judge(s ⊕ a_w) ‖ P_judge(s ⊕ a_s)) in base 2, in [0, 1].

Every model is loaded once and runs jitted in fixed-shape batches (`models`), on the PPO run's
mesh when given a partitioner. `DefeasibilityReward.__call__` is the PPO `reward_fn` of
`jaxmoral.rl.ppo_trainer` (which owns the μ0/σ0 normalisation); sampled answers are keyed by
the call's `RewardKey`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Optional, Sequence

import gin
import jax
import numpy as np

from jaxmoral import metrics
from jaxmoral import progress
from jaxmoral import validation
from jaxmoral.clarify import formats
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.clarify import models
from jaxmoral.clarify import nli as nli_lib

logger = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
  """Settings of the reward pipeline.

  Attributes:
    judge_classes: The judge's class strings for bad, ok, good (each ONE token of its vocab).
    nli_labels: NLI label strings for entailment, neutral, contradiction.
    use_nli: Apply the NLI filter (needs an NLI model).
    answer_greedy: Greedy answers (else sampled with `answer_top_p` / `answer_temperature`).
    answer_top_p, answer_temperature: Nucleus mass and temperature of sampled answers.
    max_answer_length, max_fusion_length: Tokens at most of an answer, of a fused situation.
    input_length: Encoder length of every auxiliary model.
    batch_size: Rows per compiled call.
    seed: Seed of sampled answers.
    questions_only: PPO's reward (`__call__`) is 0 for an output that is not a question
      (`formats.is_question`): a guard against a policy that games small reward models with
      fragments. Not in the paper; evaluation (`score_questions`) scores every output.
  """
  judge_classes: tuple[str, ...] = formats.T5_JUDGE_CLASSES
  nli_labels: tuple[str, ...] = formats.NLI_LABELS
  use_nli: bool = True
  answer_greedy: bool = True
  answer_top_p: float = 1.0
  answer_temperature: float = 1.0
  max_answer_length: int = 32
  max_fusion_length: int = 64
  input_length: int = 128
  batch_size: int = 32
  seed: int = 0
  questions_only: bool = False

  def __post_init__(self):
    object.__setattr__(self, "judge_classes", formats.check_classes(
        self.judge_classes, field="RewardConfig.judge_classes", names=formats.JUDGMENTS))
    object.__setattr__(self, "nli_labels", tuple(self.nli_labels))
    for name in ("max_answer_length", "max_fusion_length", "input_length", "batch_size"):
      validation.positive_int(getattr(self, name), f"RewardConfig.{name}")
    if not 0 < self.answer_top_p <= 1:
      raise ValueError(f"RewardConfig.answer_top_p must be in (0, 1], got {self.answer_top_p}")
    if not self.answer_temperature > 0:
      raise ValueError(f"RewardConfig.answer_temperature must be > 0, got "
                       f"{self.answer_temperature}")


@dataclasses.dataclass
class RewardResult:
  """Per-question outputs of the pipeline (N rows)."""
  scores: np.ndarray           # (N,) reward: JSD, 0 where filtered
  jsd: np.ndarray              # (N,) JSD without the filter
  filtered: np.ndarray         # (N,) bool: an answer was filtered
  flips: np.ndarray            # (N,) bool: argmax(P_w) != argmax(P_s) (and not filtered)
  judgment: list[str]          # default judgment of s (bad|ok|good)
  base_distribution: np.ndarray  # (N, 3)
  weakener: list[str]
  strengthener: list[str]
  weakened_situation: list[str]
  strengthened_situation: list[str]
  weakened_distribution: np.ndarray  # (N, 3)
  strengthened_distribution: np.ndarray  # (N, 3)
  weakener_filtered: np.ndarray
  strengthener_filtered: np.ndarray

  def row(self, i: int) -> dict[str, Any]:
    """One row as JSON-able values."""
    row = {f.name: getattr(self, f.name)[i] for f in dataclasses.fields(self)}
    return {k: v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v
            for k, v in row.items()}


def situation_of(prompt: str) -> str:
  """The situation inside a θQ prompt ("question: s" or "question: s wh: w"), else the text."""
  text = prompt.strip()
  if text.startswith("question:"):
    text = re.sub(r"\s+wh:\s*\S+$", "", text[len("question:"):].strip())
  return text


class DefeasibilityReward:
  """Answer, NLI, fusion and judge models loaded once; scores questions in batches."""

  def __init__(self, *, answer_model: models.ClarifyModel, fusion_model: models.ClarifyModel,
               judge_model: models.ClarifyModel,
               nli_model: Optional[models.ClarifyModel] = None,
               config: RewardConfig = RewardConfig()):
    shape = dict(input_length=config.input_length, batch_size=config.batch_size)
    self.config = config
    self.answer_model = answer_model.with_shapes(**shape)
    self.fusion_model = fusion_model.with_shapes(**shape)
    self.judge_model = judge_model.with_shapes(**shape)
    # Fails early, naming the class, when a class string is not one token.
    judge_lib.class_token_ids(self.judge_model.vocabulary, config.judge_classes)
    self.nli = (None if nli_model is None
                else nli_lib.NLIScorer(nli_model.with_shapes(**shape), config.nli_labels))
    if nli_model is None and config.use_nli:
      logger.warning("DefeasibilityReward: use_nli=True but no NLI model; answers unfiltered")
    # Sampled answers draw from a key of (seed, the call's RewardKey, weakener | strengthener).
    self._calls = 0
    self._call_key = jax.random.PRNGKey(config.seed)
    self._within_call = 0

  @classmethod
  def from_dirs(cls, *, answer_model_dir: str, fusion_model_dir: str, judge_model_dir: str,
                nli_model_dir: Optional[str] = None, config: RewardConfig = RewardConfig(),
                partitioner: Any = None) -> DefeasibilityReward:
    """Loads each model from a model directory (one serving several roles is loaded once), in
    `partitioner`'s shardings when given."""
    load = lambda d: models.load_model(d, input_length=config.input_length,  # noqa: E731
                                       batch_size=config.batch_size, partitioner=partitioner)
    return cls(answer_model=load(answer_model_dir), fusion_model=load(fusion_model_dir),
               judge_model=load(judge_model_dir),
               nli_model=load(nli_model_dir) if nli_model_dir else None, config=config)

  def judge(self, situations: Sequence[str]) -> np.ndarray:
    """(N, 3) judge distributions over (bad, ok, good)."""
    inputs = [formats.judge_input(s) for s in situations]
    return self.judge_model.label_distribution(inputs, self.config.judge_classes,
                                               require_single_token=True)

  def answers(self, situations: Sequence[str], questions: Sequence[str],
              judgments: Sequence[str], update_type: str) -> list[str]:
    cfg = self.config
    inputs = [formats.answer_input(judgment=j, situation=s, update_type=update_type, question=q)
              for s, q, j in zip(situations, questions, judgments, strict=True)]
    self._within_call += 1
    key = jax.random.fold_in(self._call_key, self._within_call)
    out = self.answer_model.predict(inputs, max_decode_length=cfg.max_answer_length,
                                    greedy=cfg.answer_greedy, top_p=cfg.answer_top_p,
                                    temperature=cfg.answer_temperature, rng=key).decoded
    return [o[0] for o in out]

  def fuse(self, situations: Sequence[str], questions: Sequence[str],
           answers: Sequence[str]) -> list[str]:
    inputs = [formats.fusion_input(situation=s, question=q, answer=a)
              for s, q, a in zip(situations, questions, answers, strict=True)]
    out = self.fusion_model.predict(inputs, max_decode_length=self.config.max_fusion_length,
                                    greedy=True).decoded
    return [o[0] for o in out]

  def score_questions(self, situations: Sequence[str], questions: Sequence[str], *,
                      use_nli: Optional[bool] = None,
                      key: Optional[tuple[str, int]] = None) -> RewardResult:
    """The whole pipeline for N (situation, question) pairs.

    Args:
      use_nli: Override `config.use_nli` (the pipeline baseline with / without NLI).
      key: (purpose, index) naming the call; keys the sampled answers (default: ("call", one
        more than the last unnamed call)).
    """
    if len(situations) != len(questions):
      raise ValueError(f"score_questions: {len(situations)} situations but {len(questions)} "
                       f"questions")
    if key is None:
      self._calls += 1
      key = ("call", self._calls)
    purpose, index = key
    purpose_id = int.from_bytes(purpose.encode()[:4].ljust(4, b"\0"), "little") % (2 ** 31)
    self._call_key = jax.random.fold_in(jax.random.fold_in(
        jax.random.PRNGKey(self.config.seed), purpose_id), int(index))
    self._within_call = 0
    n = len(situations)
    situations = [formats.clean(s) for s in situations]
    questions = [formats.clean(q) or "?" for q in questions]
    # An evaluation scores thousands of questions (minutes a stage), a PPO batch dozens.
    shown = progress.ProgressLog(f"reward stages ({n} questions)", 6, min_total_s=30.0)
    base = self.judge(situations)
    judgment = [formats.JUDGMENTS[i] for i in np.argmax(base, axis=-1)] if n else []
    shown.update(1)
    both_s = situations + situations
    answers = self.answers(situations, questions, judgment, "weakener")
    shown.update(2)
    answers += self.answers(situations, questions, judgment, "strengthener")
    shown.update(3)
    enabled = self.config.use_nli if use_nli is None else use_nli
    filtered = nli_lib.filter_answers(self.nli, both_s, answers, enabled=enabled)
    shown.update(4)
    fused = self.fuse(both_s, questions + questions, answers)
    shown.update(5)
    dists = self.judge(fused)
    shown.update(6)
    p_w, p_s = dists[:n], dists[n:]
    jsd = (np.asarray(metrics.jensen_shannon(p_w, p_s), np.float64).reshape(n) if n
           else np.zeros(0))
    any_filtered = filtered[:n] | filtered[n:]
    scores = np.where(any_filtered, 0.0, jsd).astype(np.float32)
    flips = (np.argmax(p_w, -1) != np.argmax(p_s, -1)) & ~any_filtered
    return RewardResult(
        scores=scores, jsd=jsd.astype(np.float32), filtered=any_filtered, flips=flips,
        judgment=judgment, base_distribution=base, weakener=answers[:n],
        strengthener=answers[n:], weakened_situation=fused[:n],
        strengthened_situation=fused[n:], weakened_distribution=p_w,
        strengthened_distribution=p_s, weakener_filtered=filtered[:n],
        strengthener_filtered=filtered[n:])

  def __call__(self, prompt_texts: Sequence[str], response_texts: Sequence[str], *,
               key: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
    """PPO `reward_fn`: prompts are θQ inputs, responses the sampled questions; `key` is the
    call's `ppo_trainer.RewardKey` (or a (purpose, index) pair)."""
    if key is not None and not isinstance(key, tuple):
      key = (key.purpose, key.index)
    result = self.score_questions([situation_of(p) for p in prompt_texts], response_texts,
                                  key=key)
    scores = result.scores
    if self.config.questions_only:
      asked = np.asarray([formats.is_question(r) for r in response_texts], bool)
      scores = np.where(asked, scores, 0.0).astype(np.float32)
    extras = {name: getattr(result, name) for name in (
        "jsd", "filtered", "flips", "weakener", "strengthener", "weakened_situation",
        "strengthened_situation", "weakened_distribution", "strengthened_distribution")}
    extras.update(filtered=result.filtered.astype(np.float32),
                  flips=result.flips.astype(np.float32))
    return scores, extras
