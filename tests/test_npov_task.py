"""NPOV task format, knowledge bases, sampling and synthetic errors."""

import json
import re

import numpy as np
import pytest

from jaxmoral.data import readers
from jaxmoral.npov import knowledge_base as kb_lib
from jaxmoral.npov import synthetic
from jaxmoral.npov import task

KB_LINES = [
    {"id": "uniforms", "query": "School uniforms should be mandatory", "split": "test",
     "pro": [["Uniforms reduce bullying", "Bullying is rarer with uniforms"],
             ["Uniforms save parents money", "Parents spend less with uniforms"],
             "Uniforms build school spirit"],
     "con": [["Uniforms limit self-expression", "Students cannot express themselves"],
             ["Uniforms cost families money", "Families pay for uniforms"],
             "Uniforms are uncomfortable"]},
    {"id": "zoos", "query": "Zoos should be banned",
     "pro": [["Animals suffer in captivity", "Captivity makes animals suffer"]],
     "con": [["Zoos help conservation", "Conservation relies on zoos"], "Zoos educate kids"]},
]


def _parse_input(text):
  """Inverse of `task.format_input` / `format_classifier_input`: {query, pro, con[, response]}."""
  field_re = r"\{(query|response|(?:pro|con) \d+): ([^{}]*)\}"
  assert not re.sub(field_re, "", text).strip(), f"text outside {{key: value}} fields: {text!r}"
  out = {"pro": [], "con": []}
  for key, value in re.findall(field_re, text):
    if key in ("query", "response"):
      out[key] = value
    else:
      out[key.split()[0]].append(value)
  return out


@pytest.fixture
def kb_path(tmp_path):
  path = tmp_path / "kb.jsonl"
  path.write_text("\n".join(json.dumps(x) for x in KB_LINES) + "\n")
  return path


def test_format_round_trip_and_spans():
  example = task.NpovExample(id="a", topic="t", query="Q?", pro=("p one", "p two"),
                             con=("c one",), response="R.")
  text, spans = task.format_input_with_spans(example, with_response=True)
  assert text == "{query: Q?} {pro 1: p one} {pro 2: p two} {con 1: c one} {response: R.}"
  assert [text[s.start:s.end] for s in spans] == ["Q?", "p one", "p two", "c one", "R."]
  assert _parse_input(text) == {"query": "Q?", "pro": ["p one", "p two"],
                                "con": ["c one"], "response": "R."}
  with pytest.raises(ValueError, match=r"NpovExample.pro\[0\] contains a curly brace"):
    example.replace(pro=("a {b}",))


def test_read_kb_jsonl_and_errors(kb_path, tmp_path):
  topics = kb_lib.read_kb_jsonl(kb_path)
  assert [t.id for t in topics] == ["uniforms", "zoos"]
  assert topics[0].clusters[0].texts[1] == "Bullying is rarer with uniforms"
  assert topics[0].cluster_ids("con") == [3, 4, 5]
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(KB_LINES[1]) + "\n\n" + json.dumps({"query": "q", "pro": [3]}) + "\n")
  with pytest.raises(readers.DataError, match=r"bad.jsonl:3: .*field 'pro\[0\]'"):
    kb_lib.read_kb_jsonl(bad)


def test_sampling_same_number_per_side_and_topic_disjoint_splits(kb_path):
  topics = kb_lib.split_topics(kb_lib.read_kb_jsonl(kb_path), test_fraction=0.0)
  assert topics[0].split == "test" and topics[1].split in ("train", "dev")
  examples = kb_lib.sample_examples(topics, seed=3, examples_per_topic=20)
  counts = {len(e.pro) for e in examples if e.topic == "uniforms"}
  assert counts == {1, 2, 3}  # 1..3 per side, all reached in 20 draws
  for e in examples:
    assert len(e.pro) == len(e.con)
    for text in e.pro + e.con:
      assert text.rstrip(".")[1:] in e.response  # every argument is verbalised
  test_only = kb_lib.sample_examples(topics, seed=3, split="test")
  assert {e.topic for e in test_only} == {"uniforms"}
  # Independent counts per side: unbalanced examples too, every pair of counts reached.
  free = kb_lib.sample_examples(topics, seed=3, examples_per_topic=40, same_count_per_side=False)
  assert {(len(e.pro), len(e.con)) for e in free if e.topic == "uniforms"} == {
      (p, c) for p in (1, 2, 3) for c in (1, 2, 3)}


def test_synthetic_errors_keep_the_response(kb_path):
  topics = kb_lib.read_kb_jsonl(kb_path)
  examples = kb_lib.sample_examples(topics, seed=0, examples_per_topic=5)
  slices = synthetic.make_test_slices(examples, topics, seed=1)
  by_topic = {t.id: t for t in topics}
  for name, variants in slices.items():
    for v in variants:
      source = next(e for e in examples if v.id.startswith(e.id + "/") or v.id == e.id or
                    v.id == e.id + "/paraphrased")
      assert v.response == source.response
      given, before = set(v.arguments), set(source.arguments)
      if v.hallucination:
        assert v.removed_argument in source.arguments
        if name == "unparaphrased":
          assert before - given == {v.removed_argument} and given < before
      elif v.coverage:
        topic = by_topic[v.topic]
        assert any(v.added_argument in c.texts for c in topic.clusters)
        assert len(v.arguments) == len(source.arguments) + 1
        if name == "unparaphrased":
          assert given - before == {v.added_argument}
      if name == "paraphrased":
        assert v.paraphrased
        for side in task.SIDES:  # each argument is still from its own cluster
          for text, cid in zip(getattr(v, side), v.clusters(side)):
            assert text in by_topic[v.topic].clusters[cid].texts
  unpar = slices["unparaphrased"]
  assert sum(v.hallucination for v in unpar) == len(examples)
  can_add = sum(len(e.arguments) < len(by_topic[e.topic].clusters) for e in examples)
  assert sum(v.coverage for v in unpar) == can_add > 0
  changed = sum(a.arguments != b.arguments for a, b in zip(unpar, slices["paraphrased"]))
  assert changed > len(unpar) // 2



def test_a_substitution_swaps_one_argument_and_keeps_the_counts(kb_path):
  topics = kb_lib.read_kb_jsonl(kb_path)
  by_topic = {t.id: t for t in topics}
  examples = kb_lib.sample_examples(topics, seed=0, examples_per_topic=5)
  rng = np.random.default_rng(0)
  made = 0
  for e in examples:
    v = synthetic.make_substitution(e, by_topic[e.topic], rng)
    spare = {s: len(by_topic[e.topic].cluster_ids(s)) - len(getattr(e, s)) for s in task.SIDES}
    if v is None:  # only when a side has no unused argument (the chosen one)
      assert min(spare.values()) == 0
      continue
    made += 1
    assert v.hallucination and v.coverage and v.response == e.response
    assert {s: len(getattr(v, s)) for s in task.SIDES} == {s: len(getattr(e, s))
                                                           for s in task.SIDES}
    assert set(e.arguments) - set(v.arguments) == {v.removed_argument}
    assert set(v.arguments) - set(e.arguments) == {v.added_argument}
    side = "pro" if v.added_argument in v.pro else "con"
    assert v.removed_argument in getattr(e, side)  # swapped within its side
    for s in task.SIDES:
      for text, cid in zip(getattr(v, s), v.clusters(s)):
        assert text in by_topic[v.topic].clusters[cid].texts and (
            by_topic[v.topic].clusters[cid].stance == s)
  assert made >= 3


def test_read_examples_errors(tmp_path):
  path = tmp_path / "ex.jsonl"
  path.write_text(json.dumps({"query": "q", "pro": ["a"], "con": ["b"], "response": "r",
                              "hallucination": 1}) + "\n" +
                  json.dumps({"query": "q", "pro": ["a"], "con": "b"}) + "\n")
  with pytest.raises(readers.DataError, match=r"ex.jsonl:2: .*field 'con'"):
    task.read_examples(path)
  path.write_text(json.dumps({"query": "q", "pro": ["a"], "con": ["b"], "response": "r",
                              "hallucination": 1}) + "\n")
  (example,) = task.read_examples(path)
  assert example.hallucination is True and example.coverage is None
  out = tmp_path / "out.jsonl"
  task.write_examples([example], out)
  assert task.read_examples(out) == [example]


def test_perspectrum_reader(shared_dir):
  topics = kb_lib.read_perspectrum(shared_dir / "data" / "perspectrum")
  assert len(topics) == 907
  assert {t.split for t in topics} == {"train", "dev", "test"}
  with_paraphrases = sum(any(len(c.texts) > 1 for c in t.clusters) for t in topics)
  assert with_paraphrases > 400
  examples = kb_lib.sample_examples(topics, seed=0, split="test")
  assert len(examples) > 150 and all(1 <= len(e.pro) == len(e.con) <= 3 for e in examples)
