"""Text formats of the ClarifyDelphi models (one place; data builders and inference share them).

Every model is a T5 text-to-text model; these functions build its input and target strings:

| model | input | target |
| --- | --- | --- |
| question generator θQ | `question: <situation>` | question |
| wh-conditioned θQ | `question: <situation> wh: <wh-word>` | question starting with it |
| answer generator θA | `judgment: <j> situation: <s> type: weakener|strengthener question: <q>` | answer |
| fusion | `SITUATION: <s> QUESTION: <q> ANSWER: <a>` | updated situation |
| judge | `judge: <situation>` | class text (one token each, e.g. `bad`/`okay`/`good`) |
| NLI filter | `nli premise: <s> hypothesis: <a>` | `entailment`/`neutral`/`contradiction` |
| relevance (discriminator) | `relevance situation: <s> question: <q>` | `relevant`/`irrelevant` |
"""  # noqa: E501 (a Markdown table row)

from __future__ import annotations

import re
from typing import Optional, Sequence

JUDGMENTS = ("bad", "ok", "good")
UPDATE_TYPES = ("weakener", "strengthener")
NLI_LABELS = ("entailment", "neutral", "contradiction")
RELEVANCE_LABELS = ("relevant", "irrelevant")
# The 14 starting words of the paper's wh-conditioned pipeline baseline.
PIPELINE_WH_WORDS = ("what", "how", "who", "do", "are", "did", "is", "where", "have", "was",
                     "when", "would", "why", "can")
# Judge class strings for bad, ok, good: each must be ONE token of the judge's vocabulary
# ("ok" is two pieces in T5's vocabulary, "bad" and "ok" are several in the demo one).
T5_JUDGE_CLASSES = ("bad", "okay", "good")
DEMO_JUDGE_CLASSES = ("wrong", "okay", "good")


def clean(text: str) -> str:
  """One line, single spaces (TSV/CSV-safe, and what the models see)."""
  return re.sub(r"\s+", " ", str(text)).strip()


def is_question(text: str) -> bool:
  """Whether an output is a question: it ends in "?" (what the evaluation's % questions and
  `RewardConfig.questions_only` count)."""
  return text.strip().endswith("?")


def question_input(situation: str, wh_word: str | None = None) -> str:
  """θQ input; with `wh_word` the wh-conditioned variant."""
  text = f"question: {clean(situation)}"
  return f"{text} wh: {wh_word.lower()}" if wh_word else text


def first_word(question: str) -> str:
  """Lower-cased first word of a question ("" for none)."""
  words = re.findall(r"[a-z']+", question.lower())
  return words[0] if words else ""


def answer_input(*, judgment: str, situation: str, update_type: str, question: str) -> str:
  """θA input."""
  if update_type not in UPDATE_TYPES:
    raise ValueError(f"update_type must be one of {UPDATE_TYPES}, got {update_type!r}")
  return (f"judgment: {clean(judgment)} situation: {clean(situation)} type: {update_type} "
          f"question: {clean(question)}")


def fusion_input(*, situation: str, question: str, answer: str) -> str:
  """Fusion-model input (the released fusion data's format)."""
  return f"SITUATION: {clean(situation)} QUESTION: {clean(question)} ANSWER: {clean(answer)}"


def judge_input(situation: str) -> str:
  return f"judge: {clean(situation)}"


def nli_input(*, premise: str, hypothesis: str) -> str:
  return f"nli premise: {clean(premise)} hypothesis: {clean(hypothesis)}"


def relevance_input(*, situation: str, question: str) -> str:
  return f"relevance situation: {clean(situation)} question: {clean(question)}"


def why_question(situation: str) -> str:
  """The why-baseline: "Why are you <situation>?" (a gerund situation reads naturally)."""
  s = clean(situation).rstrip(".!?")
  if s[:1].isupper() and not s.startswith("I "):
    s = s[0].lower() + s[1:]
  return f"Why are you {s}?"


def check_classes(classes: Sequence[str], *, field: str,
                  names: Optional[Sequence[str]] = None) -> tuple[str, ...]:
  """`classes` as a tuple of >= 2 distinct non-empty strings; with `names`, one per name."""
  classes = tuple(classes)
  if len(classes) < 2 or len(set(classes)) != len(classes) or not all(
      isinstance(c, str) and c.strip() for c in classes):
    raise ValueError(f"{field} must be >= 2 distinct non-empty strings, got {classes!r}")
  if names is not None and len(classes) != len(names):
    raise ValueError(f"{field} must be {len(names)} strings ({', '.join(names)}), got "
                     f"{classes!r}")
  return classes
