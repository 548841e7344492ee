"""The NPOV response task: examples, the curly-braces text format and response templates.

An example gives a user query and lists of pro and con arguments; the target response has a
short introduction and verbalises every given argument. Model inputs are key-value "curly
braces" fields, `{query: Should vaccination be compulsory?} {pro 1: ...} {con 1: ...}`; the
classifiers read the same text with `{response: ...}` appended.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

from jaxmoral.data import readers

SIDES = ("pro", "con")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NpovExample:
  """One NPOV example, possibly with a synthetic or annotated error.

  Attributes:
    topic: Topic id (splits are topic-disjoint; synthetic errors draw from the same topic).
    query: The user query (a PERSPECTRUM claim).
    pro, con: The argument texts of each side given to the model.
    pro_clusters, con_clusters: Knowledge-base cluster id of each argument (-1: unknown).
    response: The response (target for the generator, input for the detectors); "" if none.
    hallucination: Label: the response states an argument that is not in the input.
    coverage: Label: the response misses an argument of the input.
    removed_argument, added_argument: What a synthetic error removed from / added to the input.
    paraphrased: Whether the input arguments were replaced by paraphrases.
  """
  id: str
  topic: str
  query: str
  pro: tuple[str, ...]
  con: tuple[str, ...]
  pro_clusters: tuple[int, ...] = ()
  con_clusters: tuple[int, ...] = ()
  response: str = ""
  hallucination: Optional[bool] = None
  coverage: Optional[bool] = None
  removed_argument: Optional[str] = None
  added_argument: Optional[str] = None
  paraphrased: bool = False

  def __post_init__(self):
    _check_text(self.query, "NpovExample.query", self.id)
    _check_text(self.response, "NpovExample.response")
    for side in SIDES:
      texts = getattr(self, side)
      if not isinstance(texts, tuple):
        raise ValueError(f"NpovExample.{side} must be a tuple of str, got {type(texts).__name__}")
      for i, text in enumerate(texts):
        _check_text(text, f"NpovExample.{side}[{i}]", self.id)
      clusters = getattr(self, f"{side}_clusters")
      if clusters and len(clusters) != len(texts):
        raise ValueError(f"NpovExample.{side}_clusters has {len(clusters)} ids for "
                         f"{len(texts)} arguments (id {self.id!r})")

  def clusters(self, side: str) -> tuple[int, ...]:
    """Cluster ids of one side, -1 where unknown."""
    ids = getattr(self, f"{side}_clusters")
    return ids if ids else (-1,) * len(getattr(self, side))

  @property
  def arguments(self) -> tuple[str, ...]:
    return self.pro + self.con

  def replace(self, **changes: Any) -> NpovExample:
    return dataclasses.replace(self, **changes)

  def to_json(self) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _check_text(text: Any, field: str, example_id: Optional[str] = None) -> None:
  """A str without braces, and with `example_id` (named in the error) not blank."""
  if not isinstance(text, str):
    raise ValueError(f"{field} must be a str, got {type(text).__name__}")
  if "{" in text or "}" in text:
    # Braces delimit fields in the model input; a stray one would make it ambiguous.
    raise ValueError(f"{field} contains a curly brace: {text!r}")
  if example_id is not None and not text.strip():
    raise ValueError(f"{field} is empty (id {example_id!r})")


@dataclasses.dataclass(frozen=True)
class Span:
  """Where a field value sits in a formatted input: `field` is "query", "pro", "con" or
  "response"; `index` is the argument's index within its side (0 otherwise)."""
  field: str
  index: int
  start: int
  end: int


def format_input_with_spans(example: NpovExample, *, with_response: bool = False
                            ) -> tuple[str, list[Span]]:
  """`format_input` (or the classifier input) plus the character span of every value."""
  text, spans = "", []

  def add(key: str, field: str, index: int, value: str) -> None:
    nonlocal text
    text += ("" if not text else " ") + f"{{{key}: "
    spans.append(Span(field, index, len(text), len(text) + len(value)))
    text += value + "}"

  add("query", "query", 0, example.query)
  for side in SIDES:
    for i, value in enumerate(getattr(example, side)):
      add(f"{side} {i + 1}", side, i, value)
  if with_response:
    add("response", "response", 0, example.response)
  return text, spans


def format_input(example: NpovExample) -> str:
  """The generator's input text: query and numbered arguments in curly braces."""
  return format_input_with_spans(example)[0]


def format_classifier_input(example: NpovExample) -> str:
  """The classifiers' input: the generator input followed by `{response: ...}`."""
  return format_input_with_spans(example, with_response=True)[0]


def template_response(query: str, pro: Sequence[str], con: Sequence[str]) -> str:
  """An error-free reference response: an introduction plus every argument, verbatim (for
  PERSPECTRUM, which has no responses: a target that verbalises each argument and no other)."""
  topic = query.strip().rstrip(".?!")
  sentences = [f"People disagree about the claim that {topic[:1].lower() + topic[1:]}."]
  for side, texts in zip(SIDES, (pro, con), strict=True):
    for i, text in enumerate(texts):
      arg = text.strip().rstrip(".")
      sentences.append(f"{TEMPLATE_LEADS[side][min(i, 1)]} {arg[:1].lower() + arg[1:]}.")
  return " ".join(sentences)


# The template's lead phrases: (first argument of the side, each further one).
TEMPLATE_LEADS = {"pro": ("Supporters argue that", "They also point out that"),
                  "con": ("Critics argue that", "They also point out that")}


def template_points(response: str) -> dict[str, int]:
  """Arguments per side that a `template_response` verbalises, counted from its lead phrases
  (0 and 0 for a response not in the template's form)."""
  first = {side: response.find(TEMPLATE_LEADS[side][0]) for side in SIDES}
  if min(first.values()) < 0:
    return dict.fromkeys(SIDES, 0)
  texts = {"pro": response[first["pro"]:first["con"]], "con": response[first["con"]:]}
  return {side: 1 + texts[side].count(TEMPLATE_LEADS[side][1]) for side in SIDES}


def _as_tuple(value: Any, path: str, line: int, field: str, what: str,
              is_item: Callable[[Any], bool]) -> tuple[Any, ...]:
  if not isinstance(value, list) or not all(map(is_item, value)):
    raise readers.DataError(path, line, f"expected a list of {what}", field)
  return tuple(value)


# Every key `read_examples` reads (what `write_examples` writes): any other is an error, so a
# misspelt "pros" cannot read as an example without pro arguments.
EXAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(NpovExample))


def read_examples(path: str | os.PathLike, *, require_response: bool = False) -> list[NpovExample]:
  """Reads NPOV examples from JSONL: one `NpovExample` object a line (`query` required;
  `hallucination` / `coverage` as 0/1).

  Args:
    require_response: Every example must have a non-empty `response` (detection scores it;
      a missing or misspelt key would otherwise read as an empty response) and at least one
      argument (without any, every response word would read as a hallucination).

  Raises:
    readers.DataError: naming the file, line and field of a malformed example, an unknown key
      (`readers.UnknownFieldError`, naming the closest of `EXAMPLE_FIELDS`), or no examples.
  """
  path = str(path)
  required = ("query", "response") if require_response else ("query",)
  rows = readers.read_jsonl(path, required=required, optional=EXAMPLE_FIELDS, allow_empty=False)
  out = []
  first_line_of_id: dict[str, int] = {}
  for row, line in zip(rows, rows.lines, strict=False):
    kwargs: dict[str, Any] = {}
    for side in SIDES:
      kwargs[side] = _as_tuple(row.get(side, []), path, line, side, "strings",
                               lambda v: isinstance(v, str))
      key = f"{side}_clusters"
      kwargs[key] = _as_tuple(row.get(key, []), path, line, key, "integers",
                              lambda v: isinstance(v, int) and not isinstance(v, bool))
    for key in ("hallucination", "coverage"):
      value = row.get(key)
      if value not in (None, 0, 1, True, False):
        raise readers.DataError(path, line, f"expected 0/1/true/false/null, got {value!r}", key)
      kwargs[key] = None if value is None else bool(value)
    for key in ("query", "response", "removed_argument", "added_argument"):
      value = row.get(key, "" if key == "response" else None)
      if value is not None and not isinstance(value, str):
        raise readers.DataError(path, line, f"expected a string, got {type(value).__name__}", key)
      kwargs[key] = value
    if require_response and not kwargs["pro"] and not kwargs["con"]:
      raise readers.DataError(path, line, "no arguments (pro and con are both empty): there "
                              "is nothing to check the response against", "pro")
    paraphrased = row.get("paraphrased", False)
    if not isinstance(paraphrased, bool):
      raise readers.DataError(path, line, f"expected true/false, got {paraphrased!r}",
                              "paraphrased")
    example_id = str(row.get("id", f"{os.path.basename(path)}:{line}"))
    if example_id in first_line_of_id:
      raise readers.DataError(path, line, f"id {example_id!r} is also the id of line "
                              f"{first_line_of_id[example_id]}", "id")
    first_line_of_id[example_id] = line
    try:
      out.append(NpovExample(id=example_id, topic=str(row.get("topic", row["query"])),
                             paraphrased=paraphrased, **kwargs))
    except ValueError as e:
      field = str(e).split()[0].removeprefix("NpovExample.")
      raise readers.DataError(path, line, str(e), field) from None
  return out


def write_examples(examples: Sequence[NpovExample], path: str | os.PathLike) -> None:
  """Writes examples as JSONL (the format `read_examples` reads)."""
  readers.write_jsonl(path, (example.to_json() for example in examples))
