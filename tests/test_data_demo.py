"""Tests for the bundled demo corpus (jaxmoral.data.demo): formats, sizes, consistency."""

import pathlib
import re
import subprocess
import sys

from jaxmoral.data import demo

GENERATE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "demo_corpus" / "generate.py"

FILES = ["clarify_questions.tsv", "clarify_answers.tsv", "clarify_fusion.csv",
         "clarify_judgments.tsv", "dialogues.jsonl", "dialogues_train.jsonl",
         "dialogues_test.jsonl", "npov_kb.jsonl", "npov_examples.jsonl"]


def _generate(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True,
                        check=False)


def test_files_are_small_and_regenerate_identically(tmp_path):
  assert sum(demo.path(f).stat().st_size for f in FILES) < 300_000
  assert _generate("--check").returncode == 0  # the bundled files
  assert _generate(f"--out_dir={tmp_path}").returncode == 0
  for f in FILES:
    assert (tmp_path / f).read_bytes() == demo.path(f).read_bytes(), f
  with open(tmp_path / "npov_kb.jsonl", "a", encoding="utf-8") as edited:
    edited.write("\n")
  check = _generate("--check", f"--out_dir={tmp_path}")
  assert check.returncode == 1
  assert check.stderr.strip().splitlines() == [
      f"{tmp_path / 'npov_kb.jsonl'}: not what tools/demo_corpus/generate.py writes; rerun it "
      "without --check"]


def test_clarify_files():
  questions = demo.clarify_questions()
  assert len(questions) == 160 and len({r["situation"] for r in questions}) == 40
  wh = {r["question"].split()[0].lower() for r in questions}
  assert {"why", "what", "how", "who", "where", "when"} <= wh
  answers = demo.clarify_answers()
  assert len(answers) == 120
  assert {r["update_type"] for r in answers} == {"weakener", "strengthener"}
  assert {r["judgment"] for r in answers} == {"bad", "ok", "good"}
  fusion = demo.clarify_fusion()
  assert len(fusion) == 100
  pattern = re.compile(r"^SITUATION: .+\. QUESTION: .+\? ANSWER: .+$")
  assert all(pattern.match(r["input"]) for r in fusion)
  judgments = demo.clarify_judgments()
  assert len(judgments) == 160 and {r["judgment"] for r in judgments} == {"bad", "ok", "good"}
  # Updated situations shift judgments: some weakened "bad" situations become "ok"/"good".
  label = {r["situation"]: r["judgment"] for r in judgments}
  fused = {r["input"]: r["output"] for r in fusion}
  shifted = [r for r in answers if r["judgment"] != label.get(fused.get(
      f"SITUATION: {r['situation']}. QUESTION: {r['question']} ANSWER: {r['answer']}"), r["judgment"])]
  assert len(shifted) >= 20


def test_dialogues_format():
  dialogues = demo.dialogues()
  assert len(dialogues) == 60
  for d in dialogues:
    assert 4 <= len(d["conversation"]) <= 8
    for turn in d["conversation"]:
      assert isinstance(turn["utterance"], str) and turn["utterance"]
      assert all(isinstance(c, str) and c for c in turn["response_candidates"])
  with_candidates = [t for d in dialogues for t in d["conversation"] if t["response_candidates"]]
  assert with_candidates and any(t["utterance"] in t["response_candidates"]
                                 for t in with_candidates)
  assert not any("{" in t["utterance"] for d in dialogues for t in d["conversation"])


def test_the_dialogue_split_holds_out_whole_dialogues():
  def read(name):
    return demo.path(name).read_text().splitlines()
  train, test = read("dialogues_train.jsonl"), read("dialogues_test.jsonl")
  assert (len(train), len(test)) == (48, 12) and not set(train) & set(test)
  assert sorted(train + test) == sorted(read("dialogues.jsonl"))


def test_npov_kb_and_examples_cover_every_argument():
  kb = demo.npov_kb()
  assert len(kb) == 25
  for topic in kb:
    for side in ("pro", "con"):
      assert 3 <= len(topic[side]) <= 5
      assert all(1 <= len(cluster) <= 2 for cluster in topic[side])
  clusters = {t["query"]: {s: t[s] for s in ("pro", "con")} for t in kb}
  examples = demo.npov_examples()
  assert len(examples) == 60
  for ex in examples:
    sentences = ex["response"].split(". ")
    assert len(sentences) == 1 + len(ex["pro"]) + len(ex["con"])
    for side in ("pro", "con"):
      for arg in ex[side]:
        assert any(arg in cluster for cluster in clusters[ex["query"]][side])
        clause = arg[0].lower() + arg[1:].rstrip(".")
        assert clause in ex["response"], (clause, ex["response"])
