"""Writes the bundled demo corpus (jaxmoral/data/demo/) from the `*_source.py` modules here.

Deterministic: edit a source, then rerun; `--check` verifies (tests/test_data_demo.py does)
that the bundled files are exactly what the sources generate.

  python tools/demo_corpus/generate.py            # rewrite jaxmoral/data/demo/*
  python tools/demo_corpus/generate.py --check    # exit status 1, naming each file that differs
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import pathlib
import sys
from typing import Any

import clarify_source
import dialogue_source
import npov_source

DEMO_DIR = pathlib.Path(__file__).resolve().parents[2] / "jaxmoral" / "data" / "demo"
JUDGMENT = {"b": "bad", "o": "ok", "g": "good"}
UPDATE = {"w": "weakener", "s": "strengthener"}


def _delimited(header: list[str], rows: list[list[str]], delimiter: str) -> str:
  out = io.StringIO()
  writer = csv.writer(out, delimiter=delimiter, lineterminator="\n")
  writer.writerow(header)
  writer.writerows(rows)
  return out.getvalue()


def _jsonl(objects: list[dict]) -> str:
  return "".join(json.dumps(obj, ensure_ascii=False) + "\n" for obj in objects)


def clarify() -> dict[str, str]:
  questions: list[list[str]] = []
  answers: list[list[str]] = []
  fusion: list[list[str]] = []
  judgments: list[list[str]] = []
  for situation, judgment, rot, qs, ans in clarify_source.SITUATIONS:
    judgments.append([situation, JUDGMENT[judgment]])
    for q in qs:
      questions.append([str(len(questions)), "jaxmoral-demo", situation, q])
    for qi, kind, answer, fused, new_judgment in ans:
      answers.append([situation, JUDGMENT[judgment], qs[qi], UPDATE[kind], answer, rot])
      if len(answers) % 6:  # ~100 of the 120 fusion pairs.
        fusion.append([f"SITUATION: {situation}. QUESTION: {qs[qi]} ANSWER: {answer}", fused])
      judgments.append([fused, JUDGMENT[new_judgment]])
  return {
      "clarify_questions.tsv": _delimited(["id", "source", "situation", "question"],
                                          questions, "\t"),
      "clarify_answers.tsv": _delimited(["situation", "judgment", "question", "update_type",
                                         "answer", "hypothesis"], answers, "\t"),
      "clarify_fusion.csv": _delimited(["input", "output"], fusion, ","),
      "clarify_judgments.tsv": _delimited(["situation", "judgment"], judgments, "\t"),
  }


def dialogues() -> dict[str, str]:
  generic = dialogue_source.GENERIC_CANDIDATES
  out: list[dict[str, Any]] = []
  for turns, fills in dialogue_source.TEMPLATES:
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
  # A split by dialogue for the configs and the demo: every fifth dialogue held out for testing,
  # so each template has fills on both sides but no dialogue is on both.
  return {"dialogues.jsonl": _jsonl(out),
          "dialogues_train.jsonl": _jsonl([d for i, d in enumerate(out) if i % 5 != 4]),
          "dialogues_test.jsonl": _jsonl([d for i, d in enumerate(out) if i % 5 == 4])}


def _clause(sentence: str) -> str:
  """"Uniforms cost money." -> "uniforms cost money" (to follow "argue that")."""
  return sentence[0].lower() + sentence[1:].rstrip(".")


def npov_response(issue: str, sides: list[tuple[str, list[str]]], k: int) -> str:
  """A neutral one-sentence introduction, then every argument verbalised, side by side."""
  src = npov_source
  parts = [src.INTROS[k % len(src.INTROS)].format(issue=issue)]
  for s, (side, args) in enumerate(sides):
    for i, arg in enumerate(args):
      if i == 0:
        pool = src.FIRST[side] if s == 0 else src.SWITCH[side]
      else:
        pool = src.MORE[side]
      parts.append(pool[(k + i) % len(pool)].format(a=_clause(arg)))
  return " ".join(parts)


def npov() -> dict[str, str]:
  kb: list[dict[str, Any]] = []
  examples: list[dict[str, Any]] = []
  for t, (query, issue, pro, con) in enumerate(npov_source.TOPICS):
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
  return {"npov_kb.jsonl": _jsonl(kb), "npov_examples.jsonl": _jsonl(examples)}


def corpus() -> dict[str, str]:
  """Every demo file's name and text, as generated from the sources."""
  return {**clarify(), **dialogues(), **npov()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="compare instead of writing: exit status 1 if any file differs")
  parser.add_argument("--out_dir", type=pathlib.Path, default=DEMO_DIR,
                      help="the corpus folder (default: the package's jaxmoral/data/demo)")
  args = parser.parse_args(argv)
  files = corpus()
  if not args.check:
    for name, text in files.items():
      (args.out_dir / name).write_text(text, encoding="utf-8", newline="")
    return 0
  differ = [name for name, text in files.items()
            if not (args.out_dir / name).is_file()
            or (args.out_dir / name).read_bytes() != text.encode("utf-8")]
  for name in differ:
    print(f"{args.out_dir / name}: not what tools/demo_corpus/generate.py writes; rerun it "
          "without --check", file=sys.stderr)
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
