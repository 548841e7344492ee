"""`jaxmoral clarify chat` (`chat`) and `chat-file` (`chat_from_file`).

A turn: the judge judges the current situation, θQ asks a clarification question, the user
answers, the fusion model folds the answer into the situation, and the judge judges the updated
situation, which the next turn starts from. Every turn is one JSON line of the transcript.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional, Sequence

import gin
import jax

from jaxmoral import fileio
from jaxmoral import partitioning
from jaxmoral.clarify import formats
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.clarify import models
from jaxmoral.data import readers


class ClarifySession:
  """The models of a chat, loaded once."""

  def __init__(self, *, question_model: models.ClarifyModel,
               fusion_model: models.ClarifyModel, judge_model: models.ClarifyModel,
               answer_model: Optional[models.ClarifyModel] = None,
               judge_classes: Optional[Sequence[str]] = None, top_p: float = 0.6,
               max_length: int = 48, seed: int = 0):
    self.question_model = question_model
    self.fusion_model = fusion_model
    self.judge_model = judge_model
    self.answer_model = answer_model
    self.judge_classes = (tuple(judge_classes) if judge_classes
                          else judge_lib.fitting_classes(judge_model.vocabulary))
    judge_lib.class_token_ids(judge_model.vocabulary, self.judge_classes)
    self.top_p = top_p
    self.max_length = max_length
    self._rng = jax.random.PRNGKey(seed)
    self._count = 0

  def judge(self, situation: str) -> tuple[str, list[float]]:
    dist = self.judge_model.label_distribution([formats.judge_input(situation)],
                                               self.judge_classes, require_single_token=True)[0]
    return formats.JUDGMENTS[int(dist.argmax())], [float(x) for x in dist]

  def _generate(self, model: models.ClarifyModel, text: str, **kwargs: Any) -> str:
    return model.predict([text], max_decode_length=self.max_length, **kwargs).decoded[0][0]

  def question(self, situation: str) -> str:
    self._count += 1
    return self._generate(self.question_model, formats.question_input(situation), greedy=False,
                          top_p=self.top_p, rng=jax.random.fold_in(self._rng, self._count))

  def fuse(self, situation: str, question: str, answer: str) -> str:
    return self._generate(self.fusion_model, formats.fusion_input(
        situation=situation, question=question, answer=answer), greedy=True)

  def answer(self, situation: str, question: str, judgment: str, update_type: str) -> str:
    if self.answer_model is None:
      raise ValueError("chat_from_file: a row has no answer and no answer_model_dir was given")
    text = formats.answer_input(judgment=judgment, situation=situation,
                                update_type=update_type, question=question)
    return self._generate(self.answer_model, text, greedy=True)

  def turn(self, situation: str, answer_fn: Callable[[str, str, str], Optional[str]],
           turn: int) -> Optional[dict[str, Any]]:
    """One turn; `answer_fn(situation, question, judgment)` gives the answer (None/"" ends)."""
    judgment, dist = self.judge(situation)
    question = self.question(situation)
    answer = answer_fn(situation, question, judgment)
    if not answer:
      return None
    fused = self.fuse(situation, question, answer)
    new_judgment, new_dist = self.judge(fused)
    return {"turn": turn, "situation": situation, "judgment": judgment,
            "distribution": dict(zip(formats.JUDGMENTS, dist, strict=True)), "question": question,
            "answer": answer, "fused_situation": fused, "new_judgment": new_judgment,
            "new_distribution": dict(zip(formats.JUDGMENTS, new_dist, strict=True))}


def _session(*, question_model_dir: str, fusion_model_dir: str, judge_model_dir: str,
             answer_model_dir: Optional[str], judge_classes: Optional[Sequence[str]],
             top_p: float, seed: int, partitioner: Any) -> ClarifySession:
  partitioner = partitioning.inference_partitioner(partitioner)
  load = lambda d: models.load_model(d, partitioner=partitioner)  # noqa: E731
  return ClarifySession(
      question_model=load(question_model_dir),
      fusion_model=load(fusion_model_dir),
      judge_model=load(judge_model_dir),
      answer_model=load(answer_model_dir) if answer_model_dir else None,
      judge_classes=judge_classes, top_p=top_p, seed=seed)


@gin.configurable
def chat(*, question_model_dir: str, fusion_model_dir: str, judge_model_dir: str,
         max_turns: int = 3, transcript_path: str = "clarify_chat.jsonl",
         input_fn: Optional[Callable[[str], str]] = None,
         output_fn: Callable[[str], None] = print,
         judge_classes: Optional[Sequence[str]] = None, top_p: float = 0.6,
         seed: int = 0, partitioner: Any = None) -> list[dict[str, Any]]:
  """Interactive loop; returns the transcript records (also written as JSONL).

  `input_fn` reads the user's line given a prompt (None: standard input, as Diamante's chat
  reads it); a line that is not UTF-8 is skipped with a note on stderr and asked for again.

  Args:
    question_model_dir: The question generator θQ (a run, export or PPO run directory).
    fusion_model_dir, judge_model_dir: The fusion model and the judge.
    max_turns: Turns at most (an empty answer ends the conversation sooner).
    transcript_path: JSONL transcript to write, one line per turn.
    output_fn: Shows a line to the user.
    judge_classes: The judge's class strings for bad, ok, good (each one vocabulary token;
      None: `judge.fitting_classes` of the judge's vocabulary).
    top_p: Nucleus mass of the sampled questions.
    seed: Seed of the sampled questions.
    partitioner: The mesh the models are read onto and run on (the run's PARTITIONER, e.g.
      `--partitioner=%PARTITIONER` with a gin/partitioning fragment; None: one device).
  """
  # Imported here, not at the top: loaded while gin parses, Diamante's `chat` would make
  # `chat.chat` bindings of user configs ambiguous.
  from jaxmoral.diamante.chat import NOT_UTF8  # pylint: disable=g-import-not-at-top
  from jaxmoral.diamante.chat import read_line  # pylint: disable=g-import-not-at-top
  input_fn = input_fn or read_line
  if max_turns <= 0:
    raise ValueError(f"chat: max_turns must be positive, got {max_turns}")
  session = _session(question_model_dir=question_model_dir, fusion_model_dir=fusion_model_dir,
                     judge_model_dir=judge_model_dir, answer_model_dir=None,
                     judge_classes=judge_classes, top_p=top_p, seed=seed,
                     partitioner=partitioner)
  def read(prompt: str) -> str:
    while True:
      try:
        line = input_fn(prompt).strip()
        line.encode("utf-8")  # A scripted input_fn may hand surrogates too.
        return line
      except EOFError:  # end of piped input ends the conversation
        return ""
      except UnicodeError:  # The models' SentencePiece would fail on it: ask again.
        print(NOT_UTF8, file=sys.stderr)

  situation = read("Describe a situation> ")
  if not situation:
    raise ValueError("chat: empty situation")
  records = []

  def ask(s: str, question: str, judgment: str) -> str:
    output_fn(f"[judgment: {judgment}] {question}")
    return read("your answer (empty to stop)> ")

  with fileio.open_text_writer(transcript_path) as out:
    for t in range(max_turns):
      record = session.turn(situation, ask, t + 1)
      if record is None:
        break
      output_fn(f"-> {record['fused_situation']}  [judgment: {record['new_judgment']}]")
      out.write(json.dumps(record) + "\n")
      records.append(record)
      situation = record["fused_situation"]
  output_fn(f"transcript: {transcript_path}")
  return records


@gin.configurable
def chat_from_file(*, input_jsonl: str, output_jsonl: str, question_model_dir: str,
                   fusion_model_dir: str, judge_model_dir: str,
                   answer_model_dir: Optional[str] = None, max_turns: int = 3,
                   judge_classes: Optional[Sequence[str]] = None, top_p: float = 0.6,
                   seed: int = 0, partitioner: Any = None) -> list[dict[str, Any]]:
  """Non-interactive chat: rows `{"situation", "answers": [...]?, "update_type"?}`.

  Answers come from the row (one per turn); when absent (or used up) θA answers
  (`update_type`, default "weakener", of the current judgment). Writes (and returns) one
  record per turn, with the row index as `conversation`. A malformed row (answers not a list
  of strings, an unknown update type, fewer answers than turns without θA) fails with its
  line before anything runs.

  Args:
    input_jsonl: The rows (JSONL).
    output_jsonl: JSONL transcript to write, one line per turn.
    answer_model_dir: The answer generator θA, answering where a row has no answer left
      (None: every row must give one answer per turn).
    max_turns: Turns per row at most.
    question_model_dir, fusion_model_dir, judge_model_dir, judge_classes, top_p, seed,
      partitioner: As for `chat`.
  """
  rows = readers.read_jsonl(input_jsonl, required=["situation"],
                            optional=["answers", "update_type"],
                            text=["situation", "update_type"])
  # Every row is checked before any model loads or any turn is written.
  for row, line in zip(rows, rows.lines, strict=False):
    answers = row.get("answers", [])
    if not isinstance(answers, list) or not all(isinstance(a, str) and a.strip()
                                                for a in answers):
      raise readers.DataError(input_jsonl, line, "expected a list of non-empty strings, got "
                              f"{json.dumps(answers)[:60]}", "answers")
    if row.get("update_type", "weakener") not in formats.UPDATE_TYPES:
      raise readers.DataError(input_jsonl, line, f"expected one of {formats.UPDATE_TYPES}, got "
                              f"{row['update_type']!r}", "update_type")
    if answer_model_dir is None and len(answers) < max_turns:
      raise readers.DataError(input_jsonl, line, f"{len(answers)} answer(s) for up to "
                              f"{max_turns} turns: give more, or answer_model_dir "
                              f"(--answer_model_dir) to answer the rest", "answers")
  session = _session(question_model_dir=question_model_dir, fusion_model_dir=fusion_model_dir,
                     judge_model_dir=judge_model_dir, answer_model_dir=answer_model_dir,
                     judge_classes=judge_classes, top_p=top_p, seed=seed,
                     partitioner=partitioner)
  records = []
  with fileio.open_text_writer(output_jsonl) as out:
    for index, row in enumerate(rows):
      given = row.get("answers", [])
      update_type = row.get("update_type", "weakener")
      situation = formats.clean(row["situation"])
      for t in range(max_turns):
        def answer_fn(s: str, q: str, j: str, t=t, given=given,
                      update_type=update_type) -> str:
          return given[t] if t < len(given) else session.answer(s, q, j, update_type)
        record = session.turn(situation, answer_fn, t + 1)
        if record is None:
          break
        record["conversation"] = index
        out.write(json.dumps(record) + "\n")
        records.append(record)
        situation = record["fused_situation"] or situation
  print(f"wrote {len(records)} turns to {output_jsonl}")
  return records
