"""ClarifyDelphi data: formats, silver label rules, pair builders, file errors."""

import json

import pytest

from jaxmoral.clarify import data, formats
from jaxmoral.data import readers


@pytest.mark.parametrize("rot,label", [
    ("You should help your family with funeral expenses.", "good"),
    ("It's good to hold the door open.", "good"),
    ("It is polite to say thank you.", "good"),
    ("It's wrong not to help someone in need.", "good"),
    ("It's rude to not say hello.", "good"),
    ("Parents should protect their children.", "good"),
    ("It's bad to leave work early.", "bad"),
    ("It is wrong to lie to people", "bad"),
    ("You shouldn't eat other people's food.", "bad"),
    ("You should not yell at your kids.", "bad"),
    ("It's not okay to hit people.", "bad"),
    ("It is okay to rest when you are tired.", "ok"),
    ("It's understandable to be sad.", "ok"),
    ("Exercise is healthy.", "ok"),
])
def test_default_judgment(rot, label):
  assert data.default_judgment(rot) == label


def test_shifted_judgment():
  assert [data.shifted_judgment(j, "strengthener") for j in formats.JUDGMENTS] == \
      list(formats.JUDGMENTS)
  assert [data.shifted_judgment(j, "weakener") for j in ("bad", "ok", "good")] == \
      ["ok", "bad", "ok"]
  with pytest.raises(ValueError, match="update_type"):
    data.shifted_judgment("bad", "neutralizer")


def test_formats():
  assert formats.question_input("lying", "Why") == "question: lying wh: why"
  assert formats.answer_input(judgment="bad", situation="lying", update_type="weakener",
                              question="Why?") == \
      "judgment: bad situation: lying type: weakener question: Why?"
  assert formats.fusion_input(situation="a", question="b", answer="c") == \
      "SITUATION: a QUESTION: b ANSWER: c"
  assert formats.why_question("Skipping class.") == "Why are you skipping class?"
  with pytest.raises(ValueError, match="update_type"):
    formats.answer_input(judgment="bad", situation="s", update_type="x", question="q")


def _write(path, text):
  path.write_text(text, encoding="utf-8")
  return path


def _data_folder(root):
  """A data folder laid out like ../shared/data: questions, silver updates, fusion pairs."""
  (root / "delta_clarify").mkdir(parents=True)
  (root / "delta_clarify_silver").mkdir()
  (root / "fusion").mkdir()
  _write(root / "delta_clarify" / "train.tsv",
         "id\tsource\tsituation\tquestion\n"
         "0\tMTurk\tskipping the party\tWhy are you skipping it?\n"
         "1\tMTurk\tskipping the party\tDid you tell the host?\n"
         "2\tMTurk\tskipping the meeting\tIs the meeting important?\n"
         "3\tMTurk\tfeeding the cat\tWhat do you feed it?\n")
  _write(root / "delta_clarify_silver" / "silver.tsv",
         "DataSource\tHypothesis\tUpdate\tUpdateType\tquestion_davinci\tsituation\n"
         "SC\tIt's rude to skip parties.\tI was sick.\tweakener\tWhy skip?\tskipping the party\n"
         "SC\tYou should feed pets.\tIt is my cat.\tstrengthener\tWhose cat?\tfeeding the cat\n")
  _write(root / "fusion" / "fusion.csv",
         "input,output\n"
         "SITUATION: skipping the party QUESTION: Why? ANSWER: I was sick,"
         "skipping the party because I was sick\n"
         "SITUATION: feeding the cat QUESTION: What? ANSWER: food,feeding the cat\n")
  return root


def test_builders_on_files(tmp_path):
  root = _data_folder(tmp_path / "data")
  source = str(root)
  questions = data.build_pairs("question", source)
  assert ("question: skipping the party", "Why are you skipping it?") in questions
  assert ("question: skipping the party wh: why", "Why are you skipping it?") in questions
  assert len(questions) == 8  # plain + wh-conditioned
  answers = data.build_pairs("answer", source)
  assert answers[0] == ("judgment: bad situation: skipping the party type: weakener "
                        "question: Why skip?", "I was sick.")
  assert answers[1][0].startswith("judgment: good situation: feeding the cat type: strengthener")
  judge = dict(data.build_pairs("judge", source, judge_classes=("wrong", "okay", "good")))
  assert judge["judge: skipping the party"] == "wrong"
  assert judge["judge: skipping the party, I was sick."] == "okay"   # weakened bad -> ok
  assert judge["judge: feeding the cat, It is my cat."] == "good"    # strengthened good
  nli = data.build_pairs("nli", source)
  assert ("nli premise: skipping the party hypothesis: I was sick.", "neutral") in nli
  assert ("nli premise: skipping the party hypothesis: I was not skipping the party.",
          "contradiction") in nli
  # The fusion row whose output only restates the situation gives an entailed answer.
  assert ("nli premise: feeding the cat hypothesis: food", "entailment") in nli
  relevance = data.build_pairs("relevance", source)
  # The most word-similar other situation of "skipping the party" is "skipping the meeting".
  assert ("relevance situation: skipping the party question: Is the meeting important?",
          "irrelevant") in relevance
  assert ("relevance situation: skipping the party question: Why are you skipping it?",
          "relevant") in relevance
  assert data.situations(source) == ["skipping the party", "skipping the meeting",
                                     "feeding the cat"]
  multi = data.build_pairs("multitask", source)
  assert len(multi) == sum(len(data.build_pairs(w, source)) for w in data.WHICH)
  out = data.write_pairs(multi, tmp_path / "pairs.jsonl")
  lines = [json.loads(line) for line in open(out)]
  assert lines[0] == {"inputs": multi[0][0], "targets": multi[0][1]}


def test_malformed_rows_name_file_and_line(tmp_path):
  bad = _write(tmp_path / "silver.tsv",
               "DataSource\tHypothesis\tUpdate\tUpdateType\tquestion_davinci\tsituation\n"
               "SC\tIt's rude.\tI was sick.\tweakener\tWhy?\tskipping\n"
               "SC\tIt's rude.\tI was sick.\tsideways\tWhy?\tskipping\n")
  with pytest.raises(readers.DataError, match=r"silver.tsv:3: .*UpdateType"):
    data.read_silver(bad)
  short = _write(tmp_path / "q.tsv", "id\tsource\tsituation\tquestion\n0\tM\tonly three\n")
  with pytest.raises(readers.DataError, match=r"q.tsv:2:"):
    data.read_questions(short)
  with pytest.raises(ValueError, match="which"):
    data.build_pairs("oracle", "demo")
  with pytest.raises(FileNotFoundError):
    data.load_source(str(tmp_path / "missing"))


def test_demo_source_builds_every_model():
  for which in data.WHICH:
    pairs = data.build_pairs(which, "demo", judge_classes=formats.DEMO_JUDGE_CLASSES)
    assert len(pairs) >= 100, which
    assert all(x and y for x, y in pairs)
  judge_targets = {y for _, y in data.build_pairs("judge", "demo",
                                                  judge_classes=formats.DEMO_JUDGE_CLASSES)}
  assert judge_targets == set(formats.DEMO_JUDGE_CLASSES)


def test_real_silver_labels(shared_dir):
  rows = data.read_silver(shared_dir / "data" / "delta_clarify_silver" /
                          "sc_dev_questions_gpt.tsv")
  labels = {data.default_judgment(r["hypothesis"]) for r in rows}
  assert labels == set(formats.JUDGMENTS)


def test_demo_splits_share_no_situation():
  train, dev = data.situations("demo", split="train"), data.situations("demo", split="dev")
  everything = list(dict.fromkeys(formats.clean(r["situation"])
                                  for r in data.load_source("demo")["questions"]))
  assert dev == everything[::data.DEMO_DEV_EVERY] and not set(train) & set(dev)
  assert sorted(train + dev) == sorted(everything)
  with pytest.raises(ValueError, match="split must be 'train' or 'dev', got 'nonsense'"):
    data.situations("demo", split="nonsense")


def test_mixing_cap_subsamples_only_the_large_models():
  every = {w: data.build_pairs(w, "demo") for w in data.WHICH}
  cap = sorted(len(p) for p in every.values())[2]  # some models above it, some at or below
  mixed = data.build_pairs("multitask", "demo", mixing_cap=cap, seed=3)
  assert len(mixed) == sum(min(len(p), cap) for p in every.values())
  start = 0
  for which in data.WHICH:  # models in WHICH order; each a subset of its own pairs
    n = min(len(every[which]), cap)
    part = mixed[start:start + n]
    start += n
    assert set(part) <= set(every[which])
    if len(every[which]) <= cap:
      assert part == every[which]
  assert mixed == data.build_pairs("multitask", "demo", mixing_cap=cap, seed=3)  # seeded
  assert mixed != data.build_pairs("multitask", "demo", mixing_cap=cap, seed=4)
  with pytest.raises(ValueError, match="mixing_cap"):
    data.build_pairs("multitask", "demo", mixing_cap=0)


def test_a_data_folder_in_a_bucket_gives_the_pairs_of_the_local_folder(gcs, tmp_path):
  from conftest import upload_folder  # pylint: disable=g-import-not-at-top
  del gcs
  local = str(_data_folder(tmp_path / "data"))
  bucket = upload_folder(tmp_path / "data", "gs://bucket/clarify_data")
  assert data.folder_splits(bucket) == data.folder_splits(local) == ["train"]
  for which in ("multitask", "answer", "judge"):
    assert data.build_pairs(which, bucket) == data.build_pairs(which, local)
  assert data.situations(bucket) == data.situations(local)
  with pytest.raises(FileNotFoundError, match="gs://bucket/clarify_data.*dev.tsv is missing"):
    data.build_pairs("question", bucket, split="dev")
