"""Writes the demo files from the `_*_source.py` modules (deterministic; rerun after edits).

  python -m jaxmoral.data.demo._generate
"""

from __future__ import annotations

import csv
import json
import pathlib
from typing import Any

from jaxmoral.data.demo import _clarify_source
from jaxmoral.data.demo import _dialogue_source
from jaxmoral.data.demo import _npov_source

OUT_DIR = pathlib.Path(__file__).resolve().parent
JUDGMENT = {"b": "bad", "o": "ok", "g": "good"}
UPDATE = {"w": "weakener", "s": "strengthener"}


def _write_delimited(name: str, header: list[str], rows: list[list[str]],
                     delimiter: str) -> None:
  with open(OUT_DIR / name, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f, delimiter=delimiter, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)


def _write_jsonl(name: str, objects: list[dict]) -> None:
  with open(OUT_DIR / name, "w", encoding="utf-8") as f:
    for obj in objects:
      f.write(json.dumps(obj, ensure_ascii=False) + "\n")


def clarify() -> None:
  questions: list[list[str]] = []
  answers: list[list[str]] = []
  fusion: list[list[str]] = []
  judgments: list[list[str]] = []
  for situation, judgment, rot, qs, ans in _clarify_source.SITUATIONS:
    judgments.append([situation, JUDGMENT[judgment]])
    for q in qs:
      questions.append([str(len(questions)), "jaxmoral-demo", situation, q])
    for qi, kind, answer, fused, new_judgment in ans:
      answers.append([situation, JUDGMENT[judgment], qs[qi], UPDATE[kind], answer, rot])
      if len(answers) % 6:  # ~100 of the 120 fusion pairs.
        fusion.append([f"SITUATION: {situation}. QUESTION: {qs[qi]} ANSWER: {answer}", fused])
      judgments.append([fused, JUDGMENT[new_judgment]])
  _write_delimited("clarify_questions.tsv", ["id", "source", "situation", "question"],
                   questions, "\t")
  _write_delimited("clarify_answers.tsv", ["situation", "judgment", "question", "update_type",
                                           "answer", "hypothesis"], answers, "\t")
  _write_delimited("clarify_fusion.csv", ["input", "output"], fusion, ",")
  _write_delimited("clarify_judgments.tsv", ["situation", "judgment"], judgments, "\t")


def dialogues() -> None:
  generic = _dialogue_source.GENERIC_CANDIDATES
  out: list[dict[str, Any]] = []
  for turns, fills in _dialogue_source.TEMPLATES:
    for fill in fills:
      d = len(out)
      conversation = []
      for t, turn in enumerate(turns):
        utterance = turn.format(**fill)
        candidates: list[str] = []
        if d % 2 == 0 and t in (1, 3):
          candidates = [generic[(d + t) % len(generic)], generic[(d + 3 * t + 1) % len(generic)]]
          if d % 4 == 0:  # The shown reply was one of the candidates (else it was rewritten).
            candidates.insert((d // 4 + t) % 3, utterance)
        conversation.append({"utterance": utterance, "response_candidates": candidates})
      out.append({"conversation": conversation})
  _write_jsonl("dialogues.jsonl", out)
  # A split by dialogue for the configs and the demo: every fifth dialogue held out for testing,
  # so each template has fills on both sides but no dialogue is on both.
  _write_jsonl("dialogues_train.jsonl", [d for i, d in enumerate(out) if i % 5 != 4])
  _write_jsonl("dialogues_test.jsonl", [d for i, d in enumerate(out) if i % 5 == 4])


def _clause(sentence: str) -> str:
  """"Uniforms cost money." -> "uniforms cost money" (to follow "argue that")."""
  return sentence[0].lower() + sentence[1:].rstrip(".")


def npov_response(issue: str, sides: list[tuple[str, list[str]]], k: int) -> str:
  """A neutral one-sentence introduction, then every argument verbalised, side by side."""
  src = _npov_source
  parts = [src.INTROS[k % len(src.INTROS)].format(issue=issue)]
  for s, (side, args) in enumerate(sides):
    for i, arg in enumerate(args):
      if i == 0:
        pool = src.FIRST[side] if s == 0 else src.SWITCH[side]
      else:
        pool = src.MORE[side]
      parts.append(pool[(k + i) % len(pool)].format(a=_clause(arg)))
  return " ".join(parts)


def npov() -> None:
  kb: list[dict[str, Any]] = []
  examples: list[dict[str, Any]] = []
  for t, (query, issue, pro, con) in enumerate(_npov_source.TOPICS):
    kb.append({"query": query, "pro": pro, "con": con})
    def pick(clusters, j0, t=t):
      return [c[(t + j0 + j) % len(c)] for j, c in enumerate(clusters)]
    selections = [(pick(pro, 0), pick(con, 0), True),
                  (pick(pro[:2], 1), pick(con[-2:], 1), False)]
    if t < 10:
      selections.append((pick(pro[-1:], 0), pick(con[:2], 1), True))
    for p_args, c_args, pro_first in selections:
      k = len(examples)
      sides = [("pro", p_args), ("con", c_args)]
      if not pro_first:
        sides.reverse()
      examples.append({"query": query, "pro": p_args, "con": c_args,
                       "response": npov_response(issue, sides, k)})
  _write_jsonl("npov_kb.jsonl", kb)
  _write_jsonl("npov_examples.jsonl", examples)


def main(out_dir: str | pathlib.Path | None = None) -> None:
  """Writes every demo file into `out_dir` (default: this folder)."""
  global OUT_DIR
  if out_dir is not None:
    OUT_DIR = pathlib.Path(out_dir)
  clarify()
  dialogues()
  npov()


if __name__ == "__main__":
  main()
