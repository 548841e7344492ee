"""Data inputs are never silently wrong.

Each case writes a small bad input, calls the library function a command calls first, and
checks the one-line message (file, line, key and the close valid name where there are such)
and that nothing was written. In process, no model: the whole file runs in seconds.
"""

import json
import pathlib
from typing import Any, Callable

import gin
import pytest

from jaxmoral import cli
from jaxmoral import gin_utils
from jaxmoral.clarify import commands
from jaxmoral.clarify import data as clarify_data
from jaxmoral.data import readers
from jaxmoral.diamante import data as diamante_data
from jaxmoral.npov import knowledge_base
from jaxmoral.npov import task

QUESTIONS = ("id\tsource\tsituation\tquestion\n"
             "0\tMTurk\tskipping the party\tWhy are you skipping it?\n"
             "1\tMTurk\tfeeding the cat\tWhat do you feed it?\n")
SILVER = ("DataSource\tHypothesis\tUpdate\tUpdateType\tquestion_davinci\tsituation\n"
          "SC\tIt's rude to skip parties.\tI was sick.\tweakener\tWhy skip?\tskipping the party\n")
FUSION = "input,output\nSITUATION: a QUESTION: b ANSWER: c,a because c\n"


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text, encoding="utf-8")
  return path


def _jsonl(path: pathlib.Path, *objects: Any) -> pathlib.Path:
  return _write(path, "".join(json.dumps(o) + "\n" for o in objects))


def _clarify_folder(root: pathlib.Path, *, questions: dict[str, str] | None = None,
                    silver: str | None = SILVER, fusion: str | None = FUSION) -> pathlib.Path:
  """A δ-Clarify data folder; None leaves a part's folder out."""
  for split, text in (questions if questions is not None else {"train": QUESTIONS}).items():
    _write(root / "delta_clarify" / f"{split}.tsv", text)
  if silver is not None:
    _write(root / "delta_clarify_silver" / "silver.tsv", silver)
  if fusion is not None:
    _write(root / "fusion" / "fusion.csv", fusion)
  return root


def _npov_example(**changes: Any) -> dict[str, Any]:
  return {"query": "Should uniforms be mandatory?", "pro": ["They save time."],
          "con": ["They cost money."], "response": "Some say they save time; others, money.",
          **changes}


def _dialogue(**turn: Any) -> dict[str, Any]:
  return {"conversation": [{"utterance": "hi", "response_candidates": []},
                           {"utterance": "hello", **turn}]}


# Each case: (tmp_path) -> (the call, the exception type, the texts its message must contain).
Case = Callable[[pathlib.Path], tuple[Callable[[], Any], type, list[str]]]


# -- item 8: unknown fields -------------------------------------------------------------------
def npov_pros(tmp: pathlib.Path):
  # What `npov detect` reads first (actions.detect_file -> task.read_examples).
  p = _jsonl(tmp / "responses.jsonl", _npov_example(),
             {**{k: v for k, v in _npov_example().items() if k != "pro"}, "pros": ["x"]})
  return (lambda: task.read_examples(p, require_response=True), readers.DataError,
          [f"{p}:2:", "unknown field 'pros'", "did you mean 'pro'?"])


def npov_kb_cons(tmp: pathlib.Path):
  p = _jsonl(tmp / "kb.jsonl", {"query": "q", "pro": ["a"], "cons": ["b"]})
  return (lambda: knowledge_base.read_kb_jsonl(p), readers.DataError,
          [f"{p}:1:", "unknown field 'cons'", "did you mean 'con'?"])


def diamante_response_candidate(tmp: pathlib.Path):
  p = _jsonl(tmp / "dialogues.jsonl", _dialogue(response_candidates=["hey"]),
             _dialogue(response_candidate=["hey"]))
  return (lambda: diamante_data.read_dialogues(p), readers.DataError,
          [f"{p}:2:", "unknown field 'conversation[1].response_candidate'",
           "did you mean 'response_candidates'?"])


def diamante_top_level_key(tmp: pathlib.Path):
  p = _jsonl(tmp / "dialogues.jsonl", {**_dialogue(), "conversations": []})
  return (lambda: diamante_data.read_dialogues(p), readers.DataError,
          [f"{p}:1:", "unknown field 'conversations'", "did you mean 'conversation'?"])


def clarify_question_column(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", questions={
      "train": QUESTIONS.replace("\tsituation\t", "\tsituaton\t", 1)})
  p = root / "delta_clarify" / "train.tsv"
  return (lambda: clarify_data.build_pairs("question", str(root)), readers.DataError,
          [f"{p}:1:", "unknown column 'situaton'", "did you mean 'situation'?"])


def clarify_silver_column(tmp: pathlib.Path):
  # An extra column is no longer dropped unseen ("DataSource" is the one known extra).
  root = _clarify_folder(tmp / "data", silver=SILVER.replace("DataSource", "DataSorce", 1))
  p = root / "delta_clarify_silver" / "silver.tsv"
  return (lambda: clarify_data.build_pairs("answer", str(root)), readers.DataError,
          [f"{p}:1:", "unknown column 'DataSorce'", "did you mean 'DataSource'?"])


# -- item 9: every input of a requested model -------------------------------------------------
def clarify_multitask_missing(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", silver=None, fusion=None)
  return (lambda: clarify_data.build_pairs("multitask", str(root)), FileNotFoundError,
          [str(root), "--which=multitask",
           "the silver folder delta_clarify_silver/ is missing (needed by answer, judge, nli)",
           "the fusion folder fusion/ is missing (needed by fusion, nli)"])


def clarify_answer_missing(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", silver=None, fusion=None)
  return (lambda: clarify_data.build_pairs("answer", str(root)), FileNotFoundError,
          ["--which=answer", "the silver folder delta_clarify_silver/ is missing"])


def clarify_silver_folder_empty(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data")
  (root / "delta_clarify_silver" / "silver.tsv").unlink()
  return (lambda: clarify_data.build_pairs("judge", str(root)), FileNotFoundError,
          ["--which=judge", "delta_clarify_silver/ has no *.tsv file (needed by judge)"])


# -- item 12: empty and header-only files name the file ---------------------------------------
def clarify_header_only(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", questions={"train": QUESTIONS.splitlines()[0] + "\n"})
  p = root / "delta_clarify" / "train.tsv"
  return (lambda: clarify_data.build_pairs("multitask", str(root)), readers.DataError,
          [f"{p}: has a header (line 1) but no data rows"])


def clarify_fusion_header_only(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", fusion="input,output\n")
  p = root / "fusion" / "fusion.csv"
  return (lambda: clarify_data.build_pairs("fusion", str(root)), readers.DataError,
          [f"{p}: has a header (line 1) but no data rows"])


def clarify_empty_file(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", silver="")
  p = root / "delta_clarify_silver" / "silver.tsv"
  return (lambda: clarify_data.build_pairs("answer", str(root)), readers.DataError,
          [f"{p}: empty file"])


def diamante_empty_file(tmp: pathlib.Path):
  p = _write(tmp / "dialogues.jsonl", "")
  return (lambda: diamante_data.read_dialogues(p), readers.DataError, [f"{p}: empty file"])


def npov_blank_lines_only(tmp: pathlib.Path):
  p = _write(tmp / "responses.jsonl", "\n  \n")
  return (lambda: task.read_examples(p, require_response=True), readers.DataError,
          [f"{p}: no rows (only blank lines)"])


# -- item 14: any split whose file is present ---------------------------------------------------
def clarify_evaluate_missing_split(tmp: pathlib.Path):
  root = _clarify_folder(tmp / "data", questions={"train": QUESTIONS, "dev": QUESTIONS})
  # The model folders exist (input paths are checked first) but hold no model: --source /
  # --split are checked before any loads.
  (tmp / "no_model").mkdir()
  flags = [f"--{m}_model_dir={tmp / 'no_model'}" for m in ("question", "answer", "fusion",
                                                           "judge")]
  flags += [f"--source={root}", "--split=test", f"--output_path={tmp / 'out' / 'eval.json'}"]
  return (lambda: commands.main("evaluate", flags, gin_utils.GinArgs()), FileNotFoundError,
          [f"{root}", "split 'test'", "delta_clarify/test.tsv is missing",
           "splits present: dev, train"])


CASES: list[Case] = [
    npov_pros, npov_kb_cons, diamante_response_candidate, diamante_top_level_key,
    clarify_question_column, clarify_silver_column,
    clarify_multitask_missing, clarify_answer_missing, clarify_silver_folder_empty,
    clarify_header_only, clarify_fusion_header_only, clarify_empty_file, diamante_empty_file,
    npov_blank_lines_only, clarify_evaluate_missing_split,
]


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _files(root: pathlib.Path) -> set[pathlib.Path]:
  return set(root.rglob("*"))


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_fails_with_one_line_and_writes_nothing(tmp_path, case):
  call, error_type, texts = case(tmp_path)
  before = _files(tmp_path)
  with pytest.raises(error_type) as error:
    call()
  message = cli.error_message(error.value)  # What the command line prints.
  assert isinstance(error.value, (ValueError, FileNotFoundError))  # The CLI's one-line errors.
  assert "\n" not in message
  for text in texts:
    assert text in message, (text, message)
  assert "is empty" not in message  # Not the old split-level message without the file.
  assert _files(tmp_path) == before  # Nothing written before the check failed.


def test_present_split_is_accepted(tmp_path):
  # clarify evaluate --split=test reads DIR/delta_clarify/test.tsv when it is there.
  root = _clarify_folder(tmp_path / "data", questions={"train": QUESTIONS, "test": QUESTIONS},
                         silver=None, fusion=None)
  assert clarify_data.situations(str(root), split="test") == ["skipping the party",
                                                              "feeding the cat"]
  assert clarify_data.folder_splits(root) == ["test", "train"]
  with pytest.raises(ValueError, match="split must be a file name"):
    clarify_data.situations(str(root), split="../train")


def test_known_fields_and_bundled_demo_still_load(tmp_path):
  # Everything `write_examples` writes reads back (clusters included).
  example = task.NpovExample(id="a", topic="t", query="q", pro=("p",), con=("c",),
                             pro_clusters=(2,), con_clusters=(0,), response="r")
  task.write_examples([example], tmp_path / "e.jsonl")
  assert task.read_examples(tmp_path / "e.jsonl") == [example]
  from jaxmoral.data import demo
  assert diamante_data.read_dialogues(demo.path("dialogues.jsonl"))
  assert task.read_examples(demo.path("npov_examples.jsonl"), require_response=True)
  assert knowledge_base.read_kb_jsonl(demo.path("npov_kb.jsonl"))
  assert clarify_data.read_questions(demo.path("clarify_questions.tsv"))
  assert clarify_data.read_fusion(demo.path("clarify_fusion.csv"))
  assert len(clarify_data.build_pairs("multitask", "demo")) > 1000
