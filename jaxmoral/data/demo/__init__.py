"""The bundled demo corpus (written for jaxmoral, Apache-2.0; see README.md here).

Loaders return plain lists of dicts read with `jaxmoral.data.readers` (so a corrupted file
fails with its line number).
"""

from __future__ import annotations

import pathlib
from typing import Any

from jaxmoral.data import readers

DEMO_DIR = pathlib.Path(__file__).resolve().parent


def path(name: str) -> pathlib.Path:
  """Path of a demo file, e.g. `path("dialogues.jsonl")`."""
  p = DEMO_DIR / name
  if not p.is_file():
    raise FileNotFoundError(f"no demo file {name!r} in {DEMO_DIR}")
  return p


def clarify_questions() -> list[dict[str, str]]:
  """id, source, situation, question."""
  return readers.read_tsv(path("clarify_questions.tsv"),
                          columns=["id", "source", "situation", "question"])


def clarify_answers() -> list[dict[str, str]]:
  """situation, judgment, question, update_type (weakener | strengthener), answer, hypothesis."""
  return readers.read_tsv(path("clarify_answers.tsv"), columns=[
      "situation", "judgment", "question", "update_type", "answer", "hypothesis"])


def clarify_fusion() -> list[dict[str, str]]:
  """input ("SITUATION: s QUESTION: q ANSWER: a"), output (the fused situation)."""
  return readers.read_csv(path("clarify_fusion.csv"), columns=["input", "output"])


def clarify_judgments() -> list[dict[str, str]]:
  """situation, judgment (bad | ok | good)."""
  return readers.read_tsv(path("clarify_judgments.tsv"), columns=["situation", "judgment"])


def dialogues() -> list[dict[str, Any]]:
  """`{"conversation": [{"utterance", "response_candidates"}, ...]}` (Diamante format)."""
  return readers.read_jsonl(path("dialogues.jsonl"), required=["conversation"])


def npov_kb() -> list[dict[str, Any]]:
  """`{"query", "pro": [[argument, paraphrase...], ...], "con": [...]}` per topic."""
  return readers.read_jsonl(path("npov_kb.jsonl"), required=["query", "pro", "con"])


def npov_examples() -> list[dict[str, Any]]:
  """`{"query", "pro": [str], "con": [str], "response"}`: NPOV responses covering all args."""
  return readers.read_jsonl(path("npov_examples.jsonl"),
                            required=["query", "pro", "con", "response"])


def all_texts() -> list[str]:
  """Every text of the corpus, each once, in a fixed order (vocabulary training data)."""
  texts = [row[field] for rows, fields in ((clarify_questions(), ("situation", "question")),
                                           (clarify_answers(), ("answer", "hypothesis")),
                                           (clarify_fusion(), ("input", "output")),
                                           (clarify_judgments(), ("situation", "judgment")))
           for row in rows for field in fields]
  for d in dialogues():
    for turn in d["conversation"]:
      texts += [turn["utterance"], *turn["response_candidates"]]
  for topic in npov_kb():
    texts += [topic["query"]] + [a for side in ("pro", "con") for c in topic[side] for a in c]
  texts += [ex["response"] for ex in npov_examples()]
  return list(dict.fromkeys(texts))
