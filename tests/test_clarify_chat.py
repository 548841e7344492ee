"""Chat: the interactive loop (scripted input) and the JSONL-driven variant, on a random model."""

import json

import numpy as np
import pytest

from jaxmoral import partitioning
from jaxmoral.clarify import chat, formats, models
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib

import random_model_dirs

CLASSES = formats.DEMO_JUDGE_CLASSES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat")
  vocab_path = vocab_lib.build_demo_vocabulary(output_dir=root / "vocab")
  # One layer each side: what is tested is the turn logic, not depth (compiles faster).
  return random_model_dirs.random_model_dir(root / "model", seed=7, vocabulary_path=vocab_path,
                                  config=config_lib.t5_config(size="tiny", num_encoder_layers=1,
                                                              num_decoder_layers=1))


def _lines(path):
  return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_chat_from_file_three_turns(tmp_path, model_dir):
  source = tmp_path / "in.jsonl"
  source.write_text(
      json.dumps({"situation": "skipping a party", "answers": ["I was sick.", "Yes.", "No."]})
      + "\n" + json.dumps({"situation": "lying", "answers": ["To protect her."],
                           "update_type": "strengthener"}) + "\n")
  out = tmp_path / "out.jsonl"
  records = chat.chat_from_file(input_jsonl=str(source), output_jsonl=str(out),
                                question_model_dir=model_dir, fusion_model_dir=model_dir,
                                judge_model_dir=model_dir, answer_model_dir=model_dir,
                                judge_classes=CLASSES, max_turns=3)
  lines = _lines(out)
  assert lines == records
  first = [r for r in lines if r["conversation"] == 0]
  assert [r["turn"] for r in first] == [1, 2, 3]
  assert [r["answer"] for r in first] == ["I was sick.", "Yes.", "No."]
  assert first[0]["situation"] == "skipping a party"
  # Each turn starts from the previous turn's fused situation (unless that came out empty).
  for prev, cur in zip(first, first[1:]):
    assert cur["situation"] == (prev["fused_situation"] or prev["situation"])
  # The second conversation ran out of given answers: θA answered turns 2 and 3.
  second = [r for r in lines if r["conversation"] == 1]
  assert second[0]["answer"] == "To protect her."
  # The shown judgment is the argmax of the judge's distribution on that situation: every
  # record's situation scored again in one batch (rows are scored independently). The judge
  # as chat loads it (on the default inference mesh): the model and its scorer are the cached,
  # compiled ones, so only the batching differs.
  judge = models.load_model(model_dir, partitioner=partitioning.inference_partitioner())
  dists = judge.label_distribution([formats.judge_input(r["situation"]) for r in lines],
                                   CLASSES)
  for r, dist in zip(lines, dists, strict=True):
    assert r["judgment"] in formats.JUDGMENTS and r["new_judgment"] in formats.JUDGMENTS
    assert sum(r["distribution"].values()) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(list(r["distribution"].values()), dist, rtol=1e-5)
    assert r["judgment"] == formats.JUDGMENTS[int(dist.argmax())]


def test_interactive_chat_stops_on_empty_answer(tmp_path, model_dir):
  replies = iter(["borrowing a car without asking", "My sister was in labor.", ""])
  shown = []
  records = chat.chat(question_model_dir=model_dir, fusion_model_dir=model_dir,
                      judge_model_dir=model_dir, judge_classes=CLASSES,
                      transcript_path=str(tmp_path / "t.jsonl"),
                      input_fn=lambda prompt: next(replies), output_fn=shown.append)
  assert len(records) == 1 and records[0]["answer"] == "My sister was in labor."
  assert _lines(tmp_path / "t.jsonl") == records
  assert shown[0].startswith("[judgment: ")
  with pytest.raises(ValueError, match="ONE token"):
    chat.chat(question_model_dir=model_dir, fusion_model_dir=model_dir,
              judge_model_dir=model_dir, judge_classes=("bad", "ok", "good"),
              transcript_path=str(tmp_path / "x.jsonl"), input_fn=lambda p: "s")


def test_chat_file_errors(tmp_path, model_dir):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"situation": "a"}\n{"answers": ["x"]}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2"):
    chat.chat_from_file(input_jsonl=str(bad), output_jsonl=str(tmp_path / "o.jsonl"),
                        question_model_dir=model_dir, fusion_model_dir=model_dir,
                        judge_model_dir=model_dir, judge_classes=CLASSES)


@pytest.mark.parametrize("rows, line, field, message", [
    ([{"situation": "a", "answers": ["x", "y", "z"]}, {"situation": "b", "answers": "I did"}],
     2, "answers", "expected a list of non-empty strings"),
    ([{"situation": "a", "answers": [{"text": "because"}, "y", "z"]}],
     1, "answers", "expected a list of non-empty strings"),
    ([{"situation": 42, "answers": ["x", "y", "z"]}], 1, "situation", "expected a string"),
    ([{"situation": "a", "answers": ["x", "y", "z"]}, {},
      {"situation": "b", "answers": ["x", "y", "z"], "update_type": "weak"}],
     3, "update_type", "expected one of"),
    ([{"situation": "a", "answers": ["x"]}], 1, "answers", "1 answer(s) for up to 3 turns"),
    ([{"situation": "a", "answer": ["x", "y", "z"]}], 1, "answer",
     "unknown field 'answer' (did you mean 'answers'?)"),
])
def test_chat_file_rows_are_checked_before_anything_runs(tmp_path, rows, line, field, message):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("".join(json.dumps(r) + "\n" if r else "\n" for r in rows))
  out = tmp_path / "o.jsonl"
  with pytest.raises(ValueError) as error:
    # No such model directories: the rows fail first.
    chat.chat_from_file(input_jsonl=str(bad), output_jsonl=str(out), question_model_dir="/no",
                        fusion_model_dir="/no", judge_model_dir="/no", max_turns=3)
  assert (error.value.line, error.value.field) == (line, field)
  assert message in str(error.value) and not out.exists()
